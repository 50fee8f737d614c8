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


def run_cli(*args: str, timeout: float = 120, env: dict | None = None,
            cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m trainpilot ARGS`` in a fresh process and capture its output."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "trainpilot", *args], capture_output=True, text=True,
        timeout=timeout, env=full_env, cwd=cwd,
    )


@pytest.fixture
def cli():
    return run_cli
