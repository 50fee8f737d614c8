"""A writer for the live-view race test: logs each step in two calls (as the runtime's recorder
and the health monitor do), then the ranks' timings, a checkpoint event every 10 steps, and
flushes after every call (the worst case for a reader: a step is committed in pieces)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from trainpilot.store import RankTiming, RunStore


def main(run_dir: str, num_steps: int, go_file: str) -> None:
    store = RunStore.create(run_dir, name="race", world_size=2, flush_every_steps=1)
    store.log_metrics(0, {"warmup": 0.0})
    store.flush()
    while not Path(go_file).exists():
        time.sleep(0.01)
    for step in range(1, num_steps + 1):
        store.log_metrics(step, {"step_time_s": 0.002, "tokens_per_s": 4096.0 + step})
        store.log_metrics(step, {"loss": 5.0 / step ** 0.5, "lr": 1e-3, "health/score": 90.0})
        store.log_rank_timings([RankTiming(step=step, rank=r, step_s=0.002, compute_s=0.001)
                                for r in (0, 1)])
        if step % 10 == 0:
            store.log_event("checkpoint", step, {"step": step})
        time.sleep(0.002)
    store.close(status="completed")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
