"""Start N gloo ranks of a scenario in ``tests.comm._worker`` and collect their JSON results.

The parent hosts the rendezvous TCPStore on a port bound to 0 (no race), starts every rank in
its own session, and on a wall-clock timeout kills each by its process id (process-group
timeouts do not catch hook deadlocks).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_ranks(scenario: str, world_size: int, tmp_path: Path, *, timeout_s: float = 90,
              args: dict | None = None, module: str = "tests.comm._worker") -> list[dict]:
    """Run ``scenario`` of ``module`` (a worker with this command line) on ``world_size`` ranks;
    return each rank's result dict (rank order).

    Fails the calling test with every rank's stderr when a rank exits non-zero or times out.
    """
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs, logs = [], []
    for rank in range(world_size):
        log = open(tmp_path / f"{scenario}.rank{rank}.log", "w+")
        cmd = [sys.executable, "-m", module, scenario, str(rank), str(world_size),
               str(store.port), str(tmp_path), json.dumps(args or {})]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        timed_out = [p.pid for p in procs if p.poll() is None]
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: this rank only
                proc.wait()
        del store
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    codes = [p.returncode for p in procs]
    if timed_out or any(codes):
        report = "\n".join(f"--- rank {r} (exit {c}) ---\n{o[-3000:]}"
                           for r, (c, o) in enumerate(zip(codes, outputs)))
        raise AssertionError(f"{scenario}: timed out {timed_out}, exit codes {codes}\n{report}")
    return [json.loads((tmp_path / f"{scenario}.rank{r}.json").read_text())
            for r in range(world_size)]
