"""Gradient compression on gloo: bytes on the wire, step time and final loss, per method.

    python benchmarks/comm_compression.py                 # 2 ranks, every method, ~10 min
    python benchmarks/comm_compression.py --world-size 4 --steps 200
    python benchmarks/comm_compression.py --methods none topk15 --steps 50   # quick look

Each method trains the reference model (``tiny-gpt`` preset, trainpilot.runtime.models) from the
same initial weights on the same synthetic Markov corpus (trainpilot.runtime.data, known entropy
floor) with AdamW + warmup/cosine, DDP under torchrun, for the same number of steps. Measured
per rank and step:

* wire bytes: what the process wrote to its sockets during backward, from the kernel's
  ``/proc/self/io`` ``wchar`` (gloo's TCP transport sends with ``writev``), beside the counters'
  model (``CommMetrics.wire_bytes``) and the compressed payload;
* step time (median after warm-up) and communication time (``CommMetrics.comm_s``);
* final loss: mean cross-entropy on 64 held-out sequences, and its excess over the corpus's
  entropy floor (what is left to learn; a more sensitive comparison than the loss itself).

Writes benchmarks/results/comm_compression_w{N}.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainpilot.runtime.procexit import run_and_end

RESULTS = Path(__file__).resolve().parent / "results"

# name -> CommOptions fields
METHODS: dict[str, dict] = {
    "none": dict(compression="none"),
    "fp16": dict(compression="fp16"),
    "powersgd": dict(compression="powersgd", powersgd_rank=4),
    "topk15": dict(compression="topk", topk_density=0.15),
    "topk5": dict(compression="topk", topk_density=0.05),
    "topk1": dict(compression="topk", topk_density=0.01),
    "topk15-noef": dict(compression="topk", topk_density=0.15, error_feedback=False),
    "topk5-noef": dict(compression="topk", topk_density=0.05, error_feedback=False),
    "topk1-noef": dict(compression="topk", topk_density=0.01, error_feedback=False),
    # Ranks split into 2 "nodes" (world >= 4): only the inter-node stage is compressed.
    "topk15-hier": dict(compression="topk", topk_density=0.15, hierarchical=True),
}
DEFAULT_METHODS = [m for m in METHODS if m != "topk15-hier"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-per-rank", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                        help="default: all; topk15-hier only from 4 ranks")
    parser.add_argument("--out", type=Path, default=None, help="results JSON path")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- one rank --------------------------------------------------------------------------------

def train_one(method: str, args: argparse.Namespace, corpus, spec) -> dict:
    """Train under ``method``; returns this rank's measurements."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainpilot.runtime.comm import ddp_kwargs, make_comm_hook
    from trainpilot.runtime.comm.counters import process_bytes_written
    from trainpilot.runtime.models import build_gpt, init_parameters
    from trainpilot.runtime.optim import build_lr_scheduler, build_optimizer
    from trainpilot.specs import CommOptions

    rank, world = dist.get_rank(), dist.get_world_size()
    comm = CommOptions(**METHODS[method])
    model = build_gpt(spec, max_seq_len=args.seq_len, device="cpu")
    init_parameters(model, spec, seed=0)
    ddp = DDP(model, **ddp_kwargs(comm, model))
    hook = make_comm_hook(comm, two_nodes(world)).register(ddp)
    opt = build_optimizer(ddp.module.named_parameters(), lr=args.lr, weight_decay=0.1)
    sched = build_lr_scheduler(opt, warmup_steps=args.steps // 10, total_steps=args.steps)
    batch, global_batch = args.batch_per_rank, args.batch_per_rank * world
    step_s, wire, losses, metrics = [], [], [], []
    for step in range(args.steps):
        first = step * global_batch + rank * batch
        x, y = corpus.get_batch(np.arange(first, first + batch))
        start = time.perf_counter()
        logits = ddp(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        written = process_bytes_written()
        loss.backward()
        wire.append(process_bytes_written() - written)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        sched.step()
        step_s.append(time.perf_counter() - start)
        metrics.append(hook.end_step())
        losses.append(loss.item())
    skip = min(5, args.steps // 2)  # warm-up; PowerSGD compresses from its 2nd step
    eval_x, eval_y = corpus.get_batch(np.arange(10**6, 10**6 + 64))  # never trained on
    with torch.no_grad():
        eval_loss = torch.nn.functional.cross_entropy(model(eval_x).flatten(0, 1),
                                                      eval_y.flatten()).item()
    hook.close()
    tail = metrics[skip:]
    return dict(
        method=method, rank=rank,
        wire_bytes_measured=statistics.mean(wire[skip:]),
        wire_bytes_model=statistics.mean(m.wire_bytes for m in tail),
        off_node_bytes_model=statistics.mean(m.off_node_bytes for m in tail),
        payload_bytes=statistics.mean(m.payload_bytes for m in tail),
        dense_bytes=statistics.mean(m.dense_bytes for m in tail),
        comm_s=statistics.median(m.comm_s for m in tail),
        step_s=statistics.median(step_s[skip:]),
        train_loss_last20=statistics.mean(losses[-20:]),
        eval_loss=eval_loss,
    )


def two_nodes(world: int):
    """This run's ranks as 2 nodes of world/2 (the layout "off-node" bytes refer to)."""
    from trainpilot.specs import ClusterSpec

    link = dict(gbytes_per_s=1.0)
    per_node = max(1, world // 2)
    return ClusterSpec(device="cpu", devices_per_node=per_node, num_nodes=world // per_node,
                       network=dict(intra_node=link, inter_node=link))


def worker(args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from trainpilot.fsio import atomic_write_text
    from trainpilot.runtime.data import MarkovCorpus
    from trainpilot.specs import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    spec = load_model("tiny-gpt")
    corpus = MarkovCorpus(vocab_size=spec.vocab_size, seq_len=args.seq_len, seed=0)
    rows = []
    for method in args.methods:
        torch.manual_seed(0)
        mine = train_one(method, args, corpus, spec)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        rows.append(everyone)
        if dist.get_rank() == 0:
            print(f"  {method}: eval loss {mine['eval_loss']:.4f}, "
                  f"step {mine['step_s'] * 1e3:.0f} ms", flush=True)
    if dist.get_rank() == 0:
        result = dict(world_size=dist.get_world_size(), steps=args.steps,
                      batch_per_rank=args.batch_per_rank, seq_len=args.seq_len, lr=args.lr,
                      model="tiny-gpt", entropy_floor_nats=corpus.entropy_rate_nats,
                      params=sum(p.numel() for p in _model_params(spec, args.seq_len)),
                      per_rank=rows)
        atomic_write_text(args.out, json.dumps(result, indent=1))
    dist.destroy_process_group()


def _model_params(spec, seq_len: int):
    from trainpilot.runtime.models import build_gpt

    return list(build_gpt(spec, max_seq_len=seq_len, device="meta").parameters())


# -- driver ------------------------------------------------------------------------------------

def summarize(result: dict) -> list[dict]:
    """One row per method: means over ranks, ratios against 'none'."""
    rows = []
    for ranks in result["per_rank"]:
        mean = {k: statistics.mean(r[k] for r in ranks) for k in ranks[0]
                if isinstance(ranks[0][k], (int, float)) and k != "rank"}
        rows.append(dict(method=ranks[0]["method"], **mean))
    base = next((r for r in rows if r["method"] == "none"), None)
    floor = result["entropy_floor_nats"]
    for row in rows:
        row["excess_loss"] = row["eval_loss"] - floor
        if base:
            row["wire_reduction"] = base["wire_bytes_measured"] / max(row["wire_bytes_measured"], 1)
            row["loss_rel"] = row["eval_loss"] / base["eval_loss"] - 1
            row["excess_rel"] = row["excess_loss"] / (base["eval_loss"] - floor) - 1
    return rows


def print_table(result: dict, rows: list[dict]) -> str:
    """Print the table; returns it as text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"gradient compression: tiny-gpt ({result['params'] / 1e6:.2f} M params),"
                        f" {result['world_size']} gloo ranks, {result['steps']} steps; entropy "
                        f"floor {result['entropy_floor_nats']:.4f} nats")
    for col in ("method", "wire MB/step (measured)", "model", "fewer bytes",
                "off-node MB (2 nodes, model)", "step ms", "comm ms", "eval loss", "vs none",
                "excess over floor", "vs none "):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        table.add_row(
            r["method"], f"{r['wire_bytes_measured'] / 1e6:.3f}",
            f"{r['wire_bytes_model'] / 1e6:.3f}", f"{r.get('wire_reduction', 1):.1f}x",
            f"{r['off_node_bytes_model'] / 1e6:.3f}",
            f"{r['step_s'] * 1e3:.0f}", f"{r['comm_s'] * 1e3:.1f}", f"{r['eval_loss']:.4f}",
            f"{r.get('loss_rel', 0) * 100:+.2f}%", f"{r['excess_loss']:.4f}",
            f"{r.get('excess_rel', 0) * 100:+.1f}%")
    console = Console(width=190, record=True)
    console.print(table)
    return console.export_text()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out or RESULTS / f"comm_compression_w{args.world_size}.json"
    if args.methods is None:
        args.methods = DEFAULT_METHODS + (["topk15-hier"] if args.world_size >= 4 else [])
    if args.worker:
        worker(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.world_size}", __file__, "--worker",
           f"--steps={args.steps}", f"--batch-per-rank={args.batch_per_rank}",
           f"--seq-len={args.seq_len}", f"--lr={args.lr}", f"--out={args.out}",
           "--methods", *args.methods]
    start = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if subprocess.run(cmd, env=env).returncode:
        return 1
    result = json.loads(args.out.read_text())
    text = print_table(result, summarize(result))
    from trainpilot.fsio import atomic_write_text

    atomic_write_text(args.out.with_suffix(".txt"), text)
    print(f"wall {time.time() - start:.0f} s; results in {args.out} (.txt: the table)")
    return 0


if __name__ == "__main__":
    run_and_end(main)
