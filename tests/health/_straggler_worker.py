"""One rank of the straggler scenario: rank 1 sleeps inside its compute; gradients are averaged
with an explicit all_reduce after compute is timed; rank 0 gathers every rank's timings and feeds
a HealthMonitor writing a run store. Usage: python -m tests.health._straggler_worker RANK WORLD
PORT OUTDIR."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.health.toyrun import ToyTrainer
from trainpilot.health.monitor import HealthMonitor, StepRecord
from trainpilot.health.stragglers import StragglerDetector, gather_rank_timings
from trainpilot.runtime.procexit import run_and_end
from trainpilot.store import RunStore

NUM_STEPS, SLOW_RANK, EXTRA_S = 14, 1, 0.050  # 50 ms: a clear straggler even on a loaded host


def main() -> None:
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    trainer = ToyTrainer(seed=0)
    run = RunStore.create(Path(outdir) / "run", world_size=world) if rank == 0 else None
    monitor = HealthMonitor(store=run, model=trainer.model, optimizer=trainer.optimizer) \
        if rank == 0 else None
    step_only = StragglerDetector()  # the negative control: fed step times instead
    flagged_by_step_time = []
    for step in range(1, NUM_STEPS + 1):
        start = time.perf_counter()
        x, y = trainer.data.batch(step * world + rank)
        loss = F.cross_entropy(trainer.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if rank == SLOW_RANK:
            time.sleep(EXTRA_S)  # the straggler: slower compute
        compute_s = time.perf_counter() - start
        comm_start = time.perf_counter()
        for p in trainer.model.parameters():  # what DDP does after backward
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        comm_s = time.perf_counter() - comm_start
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        step_s = time.perf_counter() - start
        timings = gather_rank_timings(step, step_s=step_s, compute_s=compute_s, comm_s=comm_s)
        if rank == 0:
            by_step = step_only.update([t.step_s for t in timings])
            flagged_by_step_time += [s.rank for s in by_step]
            monitor.end_step(StepRecord(step=step, loss=float(loss.detach()), step_time_s=step_s,
                                        compute_time_s=compute_s, comm_time_s=comm_s,
                                        rank_timings=timings))
    if rank == 0:
        monitor.on_train_end()
        run.close(status="completed")
        alerts = [dict(step=a.step, **a.payload) for a in monitor.alerts.log
                  if a.rule == "straggler"]
        Path(outdir, "result.json").write_text(json.dumps(dict(
            alerts=alerts, flagged_by_step_time=flagged_by_step_time,
            hardware=monitor.last_score.hardware)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
