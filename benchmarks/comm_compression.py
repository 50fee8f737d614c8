"""Gradient compression on gloo: bytes on the wire, step time and final loss, per method.

    python benchmarks/comm_compression.py                 # 2 ranks, every method, ~10 min
    python benchmarks/comm_compression.py --world-size 4 --steps 200
    python benchmarks/comm_compression.py --methods none topk15 --steps 50   # quick look
    sudo .venv/bin/python benchmarks/comm_compression.py --nodes 4 --world-size 8 \
        --methods none topk15-hier topk15-hier-ag          # 4 hosts (network namespaces) x 2

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

``--nodes N`` (root): the ranks run on N hosts of a cluster of network namespaces
(tests/multinode/netns.py, links shaped to ``--rate-mbit``), one torchrun per host joined by
torchrun's c10d rendezvous, gloo over each host's ``eth0``. Off-node bytes are then also
measured on the links themselves: each host's ``eth0`` transmit counter (IP and TCP headers and
ACKs included) over the timed steps, beside the counters' model. Without ``--nodes`` the ranks
are labelled as 2 nodes on one host and off-node bytes are the model's only.

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
    # Flat top-k with every rank's selection all-gathered (the exchange "auto" replaced at
    # more than 2 ranks: it grows with the rank count).
    "topk15-ag": dict(compression="topk", topk_density=0.15, topk_exchange="all_gather"),
    # Ranks split into nodes (world >= 4): dense inside a node, top-k across nodes only.
    "topk15-hier": dict(compression="topk", topk_density=0.15, hierarchical=True),
    "topk15-hier-ag": dict(compression="topk", topk_density=0.15, hierarchical=True,
                           topk_exchange="all_gather"),
}
MULTI_NODE = ("topk15-hier", "topk15-hier-ag")
DEFAULT_METHODS = [m for m in METHODS if m not in MULTI_NODE and m != "topk15-ag"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-per-rank", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                        help="default: all; topk15-hier only from 4 ranks")
    parser.add_argument("--nodes", type=int, default=None,
                        help="run on this many hosts of a network-namespace cluster (root); "
                             "world size must divide by it")
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="with --nodes: each host's link, Mbit/s each way")
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
    hook = make_comm_hook(comm, node_layout(world, args.nodes)).register(ddp)
    opt = build_optimizer(ddp.module.named_parameters(), lr=args.lr, weight_decay=0.1)
    sched = build_lr_scheduler(opt, warmup_steps=args.steps // 10, total_steps=args.steps)
    batch, global_batch = args.batch_per_rank, args.batch_per_rank * world
    step_s, wire, losses, metrics = [], [], [], []
    skip = min(5, args.steps // 2)  # warm-up; PowerSGD compresses from its 2nd step
    link_start = None
    for step in range(args.steps):
        if step == skip:
            link_start = link_tx_bytes()
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
    link_end = link_tx_bytes()
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
        # This host's link per step (every rank reads its host's counter: the same number for
        # all ranks of a host), None off a namespace cluster.
        link_tx_bytes=(None if link_start is None or link_end is None
                       else (link_end - link_start) / (args.steps - skip)),
        payload_bytes=statistics.mean(m.payload_bytes for m in tail),
        dense_bytes=statistics.mean(m.dense_bytes for m in tail),
        comm_s=statistics.median(m.comm_s for m in tail),
        step_s=statistics.median(step_s[skip:]),
        train_loss_last20=statistics.mean(losses[-20:]),
        eval_loss=eval_loss,
    )


def link_tx_bytes() -> int | None:
    """Bytes this host's ``eth0`` has sent (a namespace cluster's host link), None elsewhere."""
    if not os.environ.get("TRAINPILOT_BENCH_LINK"):
        return None
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except OSError:
        return None


def node_layout(world: int, nodes: int | None):
    """This run's ranks as ``nodes`` nodes (default 2) of world/nodes ranks: the layout
    "off-node" bytes refer to (torchrun numbers ranks host by host)."""
    from trainpilot.specs import ClusterSpec

    link = dict(gbytes_per_s=1.0)
    per_node = max(1, world // (nodes or 2))
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
                      nodes=args.nodes or 2, on_links=bool(os.environ.get("TRAINPILOT_BENCH_LINK")),
                      rate_mbit=args.rate_mbit if args.nodes else None,
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
    per_node = max(1, result["world_size"] // result.get("nodes", 2))
    for row in rows:
        row["excess_loss"] = row["eval_loss"] - floor
        if "link_tx_bytes" in row:  # a host's link, shared by its ranks: per rank
            row["off_node_link"] = row["link_tx_bytes"] / per_node
        if base:
            row["wire_reduction"] = base["wire_bytes_measured"] / max(row["wire_bytes_measured"], 1)
            row["off_node_reduction"] = (base["off_node_bytes_model"]
                                         / max(row["off_node_bytes_model"], 1))
            if "off_node_link" in row and "off_node_link" in base:
                row["off_node_link_reduction"] = base["off_node_link"] / max(
                    row["off_node_link"], 1)
            row["loss_rel"] = row["eval_loss"] / base["eval_loss"] - 1
            row["excess_rel"] = row["excess_loss"] / (base["eval_loss"] - floor) - 1
    return rows


def print_table(result: dict, rows: list[dict]) -> str:
    """Print the table; returns it as text."""
    from rich.console import Console
    from rich.table import Table

    nodes, links = result.get("nodes", 2), result.get("on_links", False)
    where = (f"{nodes} hosts (network namespaces, {result['rate_mbit']:g} Mbit/s links)"
             if links else f"labelled as {nodes} nodes on one host")
    table = Table(title=f"gradient compression: tiny-gpt ({result['params'] / 1e6:.2f} M params),"
                        f" {result['world_size']} gloo ranks {where}, {result['steps']} steps; "
                        f"entropy floor {result['entropy_floor_nats']:.4f} nats; per rank and step")
    for col in ("method", "wire MB (measured)", "model", "fewer bytes",
                f"off-node MB ({nodes} nodes, model)", "fewer", "off-node MB (link)", "fewer ",
                "step ms", "comm ms", "eval loss", "vs none", "excess over floor", "vs none "):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        link = r.get("off_node_link")
        table.add_row(
            r["method"], f"{r['wire_bytes_measured'] / 1e6:.3f}",
            f"{r['wire_bytes_model'] / 1e6:.3f}", f"{r.get('wire_reduction', 1):.1f}x",
            f"{r['off_node_bytes_model'] / 1e6:.3f}", f"{r.get('off_node_reduction', 1):.1f}x",
            "-" if link is None else f"{link / 1e6:.3f}",
            "-" if link is None else f"{r.get('off_node_link_reduction', 1):.1f}x",
            f"{r['step_s'] * 1e3:.0f}", f"{r['comm_s'] * 1e3:.1f}", f"{r['eval_loss']:.4f}",
            f"{r.get('loss_rel', 0) * 100:+.2f}%", f"{r['excess_loss']:.4f}",
            f"{r.get('excess_rel', 0) * 100:+.1f}%")
    console = Console(width=230, record=True)
    console.print(table)
    return console.export_text()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    suffix = f"_n{args.nodes}" if args.nodes else ""
    args.out = args.out or RESULTS / f"comm_compression_w{args.world_size}{suffix}.json"
    if args.methods is None:
        args.methods = DEFAULT_METHODS + (["topk15-hier"] if args.world_size >= 4 else [])
    if args.worker:
        worker(args)
        return 0
    if args.nodes is not None and (args.nodes < 1 or args.world_size % args.nodes):
        print(f"--nodes: got {args.nodes}; valid: a divisor of --world-size "
              f"({args.world_size})", file=sys.stderr)
        return 2
    worker_args = [__file__, "--worker", f"--world-size={args.world_size}",
                   f"--steps={args.steps}", f"--batch-per-rank={args.batch_per_rank}",
                   f"--seq-len={args.seq_len}", f"--lr={args.lr}", f"--out={args.out}",
                   *([f"--nodes={args.nodes}", f"--rate-mbit={args.rate_mbit}"]
                     if args.nodes else []), "--methods", *args.methods]
    start = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.nodes:
        code = run_on_hosts(args, worker_args, env)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.world_size}", *worker_args]
        code = subprocess.run(cmd, env=env).returncode
    if code:
        return code
    result = json.loads(args.out.read_text())
    text = print_table(result, summarize(result))
    from trainpilot.fsio import atomic_write_text

    atomic_write_text(args.out.with_suffix(".txt"), text)
    print(f"wall {time.time() - start:.0f} s; results in {args.out} (.txt: the table)")
    return 0


def run_on_hosts(args: argparse.Namespace, worker_args: list[str], env: dict) -> int:
    """One torchrun per host of a namespace cluster, joined by c10d rendezvous on node0."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.multinode.netns import NetCluster, missing_requirements

    missing = missing_requirements(iptables=False)
    if missing:
        print(f"--nodes: {missing}", file=sys.stderr)
        return 2
    hosts = [f"node{i}" for i in range(args.nodes)]
    env = dict(env, GLOO_SOCKET_IFNAME="eth0", TRAINPILOT_BENCH_LINK="1")
    with NetCluster(hosts, rate_mbit=args.rate_mbit, lifetime_s=7200) as net:
        procs = [net.popen(host, [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={args.nodes}",
            f"--nproc-per-node={args.world_size // args.nodes}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={net.address('node0')}:29400", "--rdzv-id=compression",
            f"--local-addr={net.address(host)}", *worker_args], env=env) for host in hosts]
        try:
            codes = [proc.wait() for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
    return max(codes)


if __name__ == "__main__":
    run_and_end(main)
