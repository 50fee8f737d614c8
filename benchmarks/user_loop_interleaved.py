"""The per-step cost of trainpilot's parts in a user's loop, measured inside one pair of
processes: blocks of steps of the plain loop (examples/plain_ddp.py's step) and of the loop
with the parts (examples/ddp_with_trainpilot.py's step) alternate, A B A B ..., on the same
model, optimizer and data, 2 ranks over gloo under torchrun.

Why beside benchmarks/user_loop_parts.py (two scripts, each launched anew): on this shared
2-core machine the same script's step time and CPU time move by 5-10% from one launch to the
next, more than the effect. Here both loops share the launch, the memory layout and the load
of the moment (blocks of ``--block`` steps, a few tenths of a second each), so the ratio of
neighbouring blocks is the parts' own cost. What this does not see, and the two-script
benchmark does: the parts' set-up (the elastic session's rendezvous, the checkpointer's
group) and anything their presence changes outside their calls. The heartbeat thread runs
through both kinds of block (0.01-0.02 CPU-s over a 150-step run, measured).

The parts' block runs what the example runs each step: the fault injector's step hook, the
heartbeat update, the resumable sampler, the step guard (clipping and the non-finite vote in
the loss all-reduce), the health monitor (loss judgement, its optimizer hooks, end of step)
and the checkpoint manager's ``maybe_save`` (no save falls inside a block). The plain block:
a randperm slice, clipping, the optimizer step and the loss all-reduce after it.

    .venv/bin/python benchmarks/user_loop_interleaved.py      # about 1 min; appends to results/
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from user_loop_parts import copy_texts  # the same twelve standard-library files

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "user_loop_interleaved.txt"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainpilot.health.monitor import HealthMonitor
    from trainpilot.runtime.checkpoint.manager import CheckpointManager
    from trainpilot.runtime.datasets import TextDataset
    from trainpilot.runtime.elastic import ElasticConfig, ElasticSession
    from trainpilot.runtime.faults import FaultInjector
    from trainpilot.runtime.procexit import run_and_end
    from trainpilot.runtime.sampler import ResumableSampler
    from trainpilot.runtime.stepguard import StepGuard
    from trainpilot.specs.plan import CheckpointPolicy

    def main() -> None:
        session = ElasticSession(ElasticConfig(recovery="restart"))
        session.start()
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)
        torch.manual_seed(0)
        data = TextDataset(args.data, seq_len=64, vocab_size=512)
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        model = DDP(LlamaForCausalLM(config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        faults = FaultInjector("", journal_path=os.path.join(args.run_dir, "faults.jsonl"))
        steps = args.blocks * args.block
        monitor = HealthMonitor(model=model.module, optimizer=optimizer, total_steps=steps)
        sampler = ResumableSampler(data.num_samples, seed=0)
        manager = CheckpointManager(
            dict(model=model.module, optimizer=optimizer, sampler=sampler, monitor=monitor),
            root_dir=os.path.join(args.run_dir, "ckpt"), faults=faults,
            policy=CheckpointPolicy(interval_steps=steps + 1))
        guard = StepGuard(model.parameters(), max_norm=1.0, faults=faults,
                          poison=[model.module.lm_head],
                          on_grad_norms=monitor.observe_grad_norms)
        order = torch.randperm(data.num_samples, generator=torch.Generator().manual_seed(0))
        batch = 16

        def plain_step(step: int) -> None:
            i = (step - 1) % (data.num_samples // batch)
            mine = order[i * batch:(i + 1) * batch].view(world, -1)[rank]
            inputs, targets = data.get_batch(mine.numpy())
            logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
            loss.item()

        def parts_step(step: int) -> None:
            faults.on_step(step, rank=rank)
            session.heartbeat.update(step=step)
            mine = ResumableSampler.shard(sampler.next_indices(batch), rank, world)
            inputs, targets = data.get_batch(mine)
            for attempt in guard.attempts(step):
                logits = model(input_ids=inputs).logits
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss.backward()
                attempt.check(loss)
            monitor.observe_loss(step, guard.loss)
            if guard.finite:
                optimizer.step()
            optimizer.zero_grad()
            monitor.end_step(step=step, loss=guard.loss.item(), tokens=batch * 64)
            manager.maybe_save(step)

        rows = []
        step = 0
        for block in range(args.warmup + args.blocks):
            parts = block % 2 == 1
            if parts:
                monitor.attach(model.module, optimizer)
            else:
                monitor.detach()
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.block):
                step += 1
                (parts_step if parts else plain_step)(step)
            both = torch.tensor([time.perf_counter() - start, time.process_time() - cpu],
                                dtype=torch.float64)
            dist.all_reduce(both)  # wall: summed over ranks (each waited for the other)
            if block >= args.warmup:
                rows.append((parts, float(both[0]) / world, float(both[1])))
        if rank == 0:
            for parts, wall, cpu in rows:
                print(f"BLOCK {'parts' if parts else 'plain'} {wall:.6f} {cpu:.6f}", flush=True)
        manager.close()
        session.close()
        dist.destroy_process_group()

    run_and_end(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40, help="timed blocks (half of each)")
    parser.add_argument("--block", type=int, default=10, help="steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed blocks first")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", __file__, "--worker", "--data", copy_texts(tmp),
               "--run-dir", os.path.join(tmp, "run"),
               "--blocks", str(args.blocks), "--block", str(args.block),
               "--warmup", str(args.warmup)]
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO)]))
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=1200)
    rows = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith("BLOCK ")]
    if out.returncode or not rows:
        sys.exit(f"worker failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    blocks = [(kind == "parts", float(wall), float(cpu)) for kind, wall, cpu in rows]
    # Each parts block against the mean of the plain blocks on either side of it.
    wall_ratios, cpu_ratios = [], []
    for i, (parts, wall, cpu) in enumerate(blocks):
        if parts and 0 < i < len(blocks) - 1:
            before, after = blocks[i - 1], blocks[i + 1]
            wall_ratios.append((before[1] + after[1]) / 2 / wall)
            cpu_ratios.append((before[2] + after[2]) / 2 / cpu)
    plain = [w for p, w, _ in blocks if not p]
    parts_ = [w for p, w, _ in blocks if p]
    q = statistics.quantiles(wall_ratios, n=4)
    per_step = args.block
    summary = (f"{time.strftime('%Y-%m-%d %H:%M')} blocks={args.blocks}x{args.block} steps "
               f"load={os.getloadavg()[0]:.1f}: plain {statistics.median(plain) / per_step * 1e3:.1f}"
               f" ms/step, with parts {statistics.median(parts_) / per_step * 1e3:.1f} ms/step; "
               f"throughput ratio (parts block vs its neighbours) median "
               f"{statistics.median(wall_ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}, "
               f"{len(wall_ratios)} blocks), CPU-time ratio {statistics.median(cpu_ratios):.3f}")
    print(summary)
    RESULTS.parent.mkdir(exist_ok=True)
    with open(RESULTS, "a") as handle:
        handle.write(summary + "\n")


if __name__ == "__main__":
    main()
