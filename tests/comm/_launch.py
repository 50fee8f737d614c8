"""Start N gloo ranks of a scenario in ``tests.comm._worker`` and collect their JSON results.

The processes are run by :func:`trainpilot.runtime.local_ranks.run_local_ranks` (the same
function the benchmarks use): the parent hosts the rendezvous TCPStore on a port bound to 0 (no
race), starts every rank in its own session, and on a wall-clock timeout kills each by its
process id (process-group timeouts do not catch hook deadlocks).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainpilot.runtime.local_ranks import run_local_ranks

REPO = Path(__file__).resolve().parents[2]


def run_ranks(scenario: str, world_size: int, tmp_path: Path, *, timeout_s: float = 90,
              args: dict | None = None, module: str = "tests.comm._worker") -> list[dict]:
    """Run ``scenario`` of ``module`` (a worker with this command line) on ``world_size`` ranks;
    return each rank's result dict (rank order).

    Fails the calling test with every rank's output when a rank exits non-zero or times out.
    """
    def command(rank: int, port: int) -> list[str]:
        return [sys.executable, "-m", module, scenario, str(rank), str(world_size), str(port),
                str(tmp_path), json.dumps(args or {})]

    result = run_local_ranks(command, world_size, timeout_s=timeout_s, cwd=REPO,
                             env={"PYTHONPATH": str(REPO)},
                             logs=[tmp_path / f"{scenario}.rank{r}.log"
                                   for r in range(world_size)])
    if not result.ok:
        raise AssertionError(f"{scenario}: timed out ranks {result.timed_out}, exit codes "
                             f"{result.returncodes}\n{result.describe()}")
    return [json.loads((tmp_path / f"{scenario}.rank{r}.json").read_text())
            for r in range(world_size)]
