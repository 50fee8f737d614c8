"""Tokens/s of trainpilot's Trainer vs a plain hand-written DDP loop, side by side.

Both train the same tiny GPT (tiny-gpt preset, same initial weights) on the same Markov-corpus
batches with the same AdamW, warmup+cosine LR and gradient clipping, on 2 ranks over gloo under
torchrun. They run in the same two processes, alternating blocks of steps (A B B A ...), so
machine load hits both alike; the first block of each is warm-up and not counted. Target: the
Trainer at >= 0.97x the plain loop.

    .venv/bin/python benchmarks/trainer_vs_ddp.py         # about 80 s idle; appends to results/
    .venv/bin/python benchmarks/trainer_vs_ddp.py --steps 4 --rounds 4 --gbs 16   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from trainpilot.runtime.procexit import run_and_end

RESULTS = Path(__file__).parent / "results" / "trainer_vs_ddp.txt"
MODEL = "tiny-gpt"
PLAN = "dp=2,zero=0,micro_batch_size=8,global_batch_size={gbs},seq_len=64"
CONFIG = dict(lr=3e-3, warmup_steps=2, grad_clip=1.0, seed=0)


class PlainDDP:
    """What a user writes by hand: DDP, AdamW, LambdaLR, clip, no_sync accumulation."""

    def __init__(self, spec, plan, steps: int):
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from trainpilot.runtime.data import MarkovCorpus
        from trainpilot.runtime.models import build_gpt, init_parameters
        from trainpilot.runtime.optim import WarmupCosine

        model = build_gpt(spec, max_seq_len=plan.seq_len)
        model.to_empty(device="cpu")
        init_parameters(model, spec, seed=CONFIG["seed"])
        # As tuned as ours: the RoPE tables are identical on every rank, do not broadcast them.
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["rope_cos", "rope_sin"])
        self.model = DDP(model)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        self.opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1),
                                      dict(params=no_decay, weight_decay=0.0)],
                                     lr=CONFIG["lr"], betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, WarmupCosine(warmup_steps=CONFIG["warmup_steps"], total_steps=steps))
        self.data = MarkovCorpus(vocab_size=spec.vocab_size, seq_len=plan.seq_len, seed=0,
                                 concentration=0.05)
        self.plan, self.rank, self.cursor = plan, dist.get_rank(), 0

    def step(self) -> float:
        import numpy as np
        import torch

        plan = self.plan
        local = plan.global_batch_size // plan.dp
        start = self.cursor + self.rank * local
        x, y = self.data.get_batch(np.arange(start, start + local))
        self.cursor += plan.global_batch_size
        n = plan.num_micro_batches
        for i, (xb, yb) in enumerate(zip(x.chunk(n), y.chunk(n))):
            ctx = self.model.no_sync() if i < n - 1 else torch.enable_grad()
            with ctx:
                logits = self.model(xb)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), yb.flatten())
                (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CONFIG["grad_clip"])
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def worker(steps: int, rounds: int, gbs: int) -> None:
    import torch
    import torch.distributed as dist

    from trainpilot.runtime.config import TrainConfig
    from trainpilot.runtime.trainer import Trainer
    from trainpilot.specs import load_model, load_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    spec, plan = load_model(MODEL), load_plan(PLAN.format(gbs=gbs))
    total = steps * rounds * 2
    plain = PlainDDP(spec, plan, total)
    ours = Trainer(model=spec, plan=plan, config=TrainConfig(
        steps=total, predict=False, **CONFIG))
    rates: dict[str, list[float]] = {"plain": [], "trainer": [], "plain_cpu": [],
                                     "trainer_cpu": []}
    runners = {"plain": plain.step, "trainer": ours.train_step}
    for r in range(rounds + 1):  # round 0: warm-up of both, not counted
        order = ["plain", "trainer"] if r % 2 == 0 else ["trainer", "plain"]
        for name in order:
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(steps):
                runners[name]()
            elapsed = time.perf_counter() - start
            # CPU seconds this process used (all its threads, gloo's included), summed over
            # ranks: insensitive to other processes taking the cores, unlike wall time.
            cpu = torch.tensor([time.process_time() - cpu_start], dtype=torch.float64)
            dist.all_reduce(cpu)
            if r:
                tokens = steps * plan.tokens_per_step
                rates[name].append(tokens / elapsed)
                rates[name + "_cpu"].append(tokens / float(cpu))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(dict(gbs=gbs, steps=steps, rounds=rounds, **rates)))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per timed block")
    parser.add_argument("--rounds", type=int, default=12, help="timed blocks of each loop")
    parser.add_argument("--gbs", type=int, nargs="+", default=[16, 32],
                        help="global batch sizes (16: one micro-batch per rank, 32: two)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps, args.rounds, args.gbs[0])
        return 0
    import subprocess

    from trainpilot.fsio import atomic_write_text

    lines = [f"# benchmarks/trainer_vs_ddp.py, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{os.cpu_count()} cores, OMP_NUM_THREADS=1, 2 ranks (torchrun, gloo), {MODEL}",
             f"load average at start: {os.getloadavg()[0]:.1f} (other processes share the cores)",
             f"{'global batch':>12} {'clock':>5} {'plain DDP tok/s':>16} {'Trainer tok/s':>14} "
             f"{'ratio':>6} {'ratio min-max over rounds':>26}",
             "(wall: tokens per wall-clock second; cpu: tokens per CPU-second summed over both "
             "ranks; medians over rounds; ratio: median of the per-round Trainer/plain ratios)"]
    for gbs in args.gbs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, "--worker", "--steps", str(args.steps),
               "--rounds", str(args.rounds), "--gbs", str(gbs)]
        out = subprocess.run(cmd, capture_output=True, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        found = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode or not found:
            print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
            return 1
        res = json.loads(found[0][len("RESULT "):])
        for kind, suffix in (("wall", ""), ("cpu", "_cpu")):
            plain = statistics.median(res["plain" + suffix])
            ours = statistics.median(res["trainer" + suffix])
            # Each round's two blocks ran back to back: their ratio cancels slow load drift.
            ratios = [t / p for t, p in zip(res["trainer" + suffix], res["plain" + suffix])]
            lines.append(f"{gbs:>12} {kind:>5} {plain:>16,.0f} {ours:>14,.0f} "
                         f"{statistics.median(ratios):>6.3f} {min(ratios):>12.3f} - "
                         f"{max(ratios):.3f}")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    # Keep earlier runs: on shared cores one run is one sample of a noisy measurement.
    previous = RESULTS.read_text() + "\n" if RESULTS.exists() else ""
    atomic_write_text(RESULTS, previous + text)
    return 0


if __name__ == "__main__":
    run_and_end(main)
