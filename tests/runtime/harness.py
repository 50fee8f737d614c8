"""Run a scenario on N gloo ranks as separate processes, and collect each rank's result.

Rendezvous is a FileStore in the test's temporary folder (no fixed port; gloo binds its own
sockets to free ports). Every process starts in its own session and is killed by its process id
when the wall-clock limit passes, on top of the process-group timeout.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainpilot.runtime.procexit import run_and_end

REPO = Path(__file__).resolve().parents[2]


def spawn(scenario: str, world_size: int, workdir: Path, *, timeout_s: float = 150,
          args: dict | None = None) -> list:
    """Run ``tests.runtime.scenarios.<scenario>(args)`` (or ``package.module:function``) on
    ``world_size`` ranks; returns the per-rank return values (torch.load'ed). Raises with
    every rank's stderr on failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    store = workdir / "store"
    store.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs, logs = [], []
    for rank in range(world_size):
        log = open(workdir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tests.runtime.harness", scenario, str(rank), str(world_size),
             str(store), str(workdir), json.dumps(args or {})],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2)  # let the others report their side, then stop them
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its own session: pgid == pid
                p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        text = "\n".join(f"--- rank {r} (exit {c}) ---\n"
                         + (workdir / f"rank{r}.log").read_text()[-4000:]
                         for r, c in enumerate(codes))
        raise AssertionError(f"scenario {scenario!r} failed or timed out:\n{text}")
    import torch

    return [torch.load(workdir / f"result{r}.pt", weights_only=False) for r in range(world_size)]


def _child(scenario: str, rank: int, world_size: int, store: str, workdir: str, args: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    try:
        # "name" (tests.runtime.scenarios) or "package.module:name"
        module_name, _, name = scenario.rpartition(":")
        module = importlib.import_module(module_name or "tests.runtime.scenarios")
        result = getattr(module, name)(**json.loads(args))
        torch.save(result, Path(workdir) / f"result{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(lambda: _child(*sys.argv[1:2], int(sys.argv[2]), int(sys.argv[3]),
                               *sys.argv[4:7]))
