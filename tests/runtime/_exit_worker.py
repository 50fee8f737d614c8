"""One rank of the exit-abort scenario (tests/runtime/test_procexit.py). Usage:
python -m tests.runtime._exit_worker RANK PORT HOW, HOW = sys_exit | end_process.

Rank 0 leaves with all-reduces still in flight on gloo's threads and a slow interpreter
teardown (an object whose finalizer sleeps, standing in for a big process's teardown); rank 1
joins those all-reduces only once rank 0 is leaving, so they complete on rank 0's gloo threads
while it exits. With ``sys.exit`` rank 0 often dies of SIGABRT ("terminate called without an
active exception"); with ``end_process`` it exits 0. Rank 1 always exits 0."""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from trainpilot.runtime.procexit import end_process

NUM_OPS = 400


class SlowTeardown:
    def __del__(self, sleep=time.sleep):
        sleep(1.0)


def main() -> None:
    rank, port, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        store.wait(["leaving"])
        try:
            for _ in range(NUM_OPS):
                dist.all_reduce(torch.ones(1 << 14))
        except RuntimeError:
            pass  # rank 0 left with end_process: its half of the collectives went with it
        os._exit(0)
    tensors = [torch.ones(1 << 14) for _ in range(NUM_OPS)]
    for t in tensors:
        dist.all_reduce(t, async_op=True)
    globals().update(tensors=tensors, slow=SlowTeardown())
    store.set("leaving", "1")
    print("rank 0 leaving", flush=True)
    if how == "end_process":
        end_process(0)
    sys.exit(0)


if __name__ == "__main__":
    main()
