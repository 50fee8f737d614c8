"""A short, real data-parallel training run that writes a run store: what the dashboard tests
(and docs/dashboard.png) look at.

Started under torchrun (``python -m torch.distributed.run --standalone --nproc-per-node 2 -m
tests.ui.ddp_run RUN_DIR``). Every rank trains the health toy LM (``tests.health.toyrun``) on
its own shard of the seeded Markov data; gradients are averaged with one flat gloo all-reduce
after backward, so each rank's compute time (forward + backward, before the collective) and
communication time are measured apart, as the store's ``rank_timings`` want. Every rank runs a
HealthMonitor on the same (all-reduced) losses and gradients, so opt-in interventions act alike
everywhere; only rank 0's monitor writes the store. ``--slow-rank R`` adds a sleep before the
collective on rank R (a straggler); ``--spike-at S`` scales step S's loss by 1e4 on every rank (an
alert, and a skipped batch); a real ``torch.save`` checkpoint every ``--checkpoint-every`` steps
is timed and logged as a checkpoint event with its stall.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from trainpilot.runtime.procexit import run_and_end


def _lr_lambda(warmup: int, total: int):
    def factor(step: int) -> float:  # step counts optimizer steps taken so far (0-based)
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.ui.ddp_run")
    parser.add_argument("run_dir")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--slow-rank", type=int, default=None)
    # 20 ms: well above the noise of a loaded 2-core machine (4 ms was flipped by it once).
    parser.add_argument("--slow-s", type=float, default=0.02)
    parser.add_argument("--spike-at", type=int, default=None)
    parser.add_argument("--checkpoint-every", type=int, default=25)
    parser.add_argument("--forecast-interval-s", type=float, default=2.0)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    from tests.health.toyrun import MarkovData, ToyLM
    from trainpilot.fsio import atomic_write_bytes
    from trainpilot.health.config import load_health_config
    from trainpilot.health.monitor import HealthMonitor, StepRecord
    from trainpilot.store import RankTiming, RunStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    model = ToyLM(vocab_size=32, dim=32, num_layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(10, args.steps))
    data = MarkovData(vocab_size=32, seq_len=32, batch_size=8, seed=0)
    tokens_per_step = world * data.batch_size * data.seq_len

    run_dir = Path(args.run_dir)
    store = None
    if rank == 0:
        store = RunStore.create(run_dir, name=run_dir.name, world_size=world,
                                info={"writer": "tests.ui.ddp_run"}, flush_every_steps=5,
                                flush_interval_s=0.5)
        store.set_document("model", {"name": "toy-lm", "vocab_size": 32, "dim": 32,
                                     "num_layers": 2})
        store.set_document("plan", {"dp": world, "tp": 1, "pp": 1, "micro_batch_size": 8,
                                    "global_batch_size": 8 * world, "seq_len": 32})
    base = load_health_config()
    config = base.model_copy(update={
        "forecast_interval_s": args.forecast_interval_s,
        "interventions": base.interventions.model_copy(update={
            "skip_batch_on_spike": base.interventions.skip_batch_on_spike.model_copy(
                update={"enabled": True})})})
    monitor = HealthMonitor(store=store, config=config, model=model, optimizer=optimizer,
                            scheduler=scheduler, total_steps=args.steps)
    monitor.on_train_start()
    params = [p for p in model.parameters()]
    try:
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            x, y = data.batch(step * world + rank)
            data_s = time.perf_counter() - start
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            if step == args.spike_at:
                loss = loss * 1e4
            loss.backward()
            if rank == args.slow_rank:
                time.sleep(args.slow_s)  # a slow rank: its compute ends late
            compute_end = time.perf_counter()
            flat = _flatten_dense_tensors([p.grad for p in params] + [loss.detach().reshape(1)])
            dist.all_reduce(flat)
            flat /= world
            comm_end = time.perf_counter()
            *grads, mean_loss = _unflatten_dense_tensors(
                flat, [p.grad for p in params] + [loss.detach().reshape(1)])
            for p, g in zip(params, grads):
                p.grad.copy_(g)
            monitor.observe_loss(step, float(mean_loss))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step_s = time.perf_counter() - start
            mine = torch.tensor([step_s, compute_end - start - data_s, comm_end - compute_end,
                                 data_s], dtype=torch.float64)
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine)
            timings = [RankTiming(step=step, rank=r, step_s=float(t[0]), compute_s=float(t[1]),
                                  comm_s=float(t[2]), data_s=float(t[3]))
                       for r, t in enumerate(gathered)]
            monitor.end_step(StepRecord(step=step, loss=float(mean_loss), tokens=tokens_per_step,
                                        step_time_s=step_s, data_time_s=data_s,
                                        compute_time_s=compute_end - start - data_s,
                                        comm_time_s=comm_end - compute_end,
                                        comm_max_s=comm_end - compute_end,
                                        rank_timings=timings if rank == 0 else None))
            if args.checkpoint_every and step % args.checkpoint_every == 0 and rank == 0:
                import io

                t0 = time.perf_counter()
                buffer = io.BytesIO()
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "step": step}, buffer)
                atomic_write_bytes(run_dir / "checkpoints" / f"step{step:06d}.pt",
                                   buffer.getvalue())
                monitor.on_event("checkpoint", {"step": step, "stall_s": time.perf_counter() - t0,
                                                "path": f"checkpoints/step{step:06d}.pt"})
        monitor.on_train_end()
        if store is not None:
            store.close(status="completed")
    except BaseException:
        if store is not None:
            store.close(status="failed")
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    run_and_end(main)
