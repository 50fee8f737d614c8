"""Shared fixtures. Tiers: pure logic (most tests), one rank on gloo, several ranks on gloo
(marked `dist`), browser (marked `browser`). See docs/testing.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("OMP_NUM_THREADS", "1")

# `make test` runs pytest with two xdist workers (--dist loadgroup). Every test that starts
# processes, trains or drives a browser is in one group, "procs", which one worker runs in
# order, as a plain `pytest` would: never two multi-rank tests at once on a 2-core machine.
# The in-process tests of these folders (specs, the cost model, the planner, the simulators,
# the store, the monitor's logic, the UI's data) run on the other worker meanwhile.
LIGHT_DIRS = {"perf", "plan", "sim", "specs", "store", "health", "ui", "interop"}
PROC_MARKS = {"dist", "external", "browser", "slow", "multinode"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(str(item.fspath)).relative_to(REPO / "tests").parts
        light = len(parts) > 1 and parts[0] in LIGHT_DIRS
        if not light or any(item.get_closest_marker(m) for m in PROC_MARKS):
            item.add_marker(pytest.mark.xdist_group("procs"))


def run_cli(*args: str, timeout: float = 120, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m trainpilot ARGS`` in a fresh process and capture its output."""
    full_env = dict(os.environ, **(env or {}))
    for name in ("COLUMNS", "LINES"):  # the CLI's own width off a terminal, whoever runs pytest
        if not env or name not in env:
            full_env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "trainpilot", *args], capture_output=True, text=True,
        timeout=timeout, env=full_env, cwd=cwd,
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def ref2(tmp_path_factory):
    """An uninterrupted 2-rank ``trainpilot train`` run (tests/external/harness.py's command),
    made once per session: the oracle every recovery through the CLI is compared with."""
    from tests.external.harness import PLAN2, STEPS2, job, train_args

    run_dir = tmp_path_factory.mktemp("ref") / "ref2"
    with job(train_args(run_dir, steps=STEPS2, plan=PLAN2)) as j:
        assert j.wait() == 0, j.output()[-3000:]
    return run_dir


@pytest.fixture(scope="session")
def ref4(tmp_path_factory):
    """The same at 4 ranks."""
    from tests.external.harness import PLAN4, STEPS4, job, train_args

    run_dir = tmp_path_factory.mktemp("ref") / "ref4"
    with job(train_args(run_dir, steps=STEPS4, plan=PLAN4)) as j:
        assert j.wait() == 0, j.output()[-3000:]
    return run_dir
