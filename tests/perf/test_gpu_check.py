"""benchmarks/gpu_check.py: its CPU dry run (tiny model over gloo at world size 1) measures a
real step and costs the same documents with the cost model. The GPU mode needs a GPU and is
not run here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--warmup", "1",
                           "--steps", "2", "--out", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "dry-run" and data["measured"]["backend"] == "gloo"
    assert data["measured"]["steps"] == 2 and data["measured"]["step_time_s"] > 0
    assert data["measured"]["params"] > 0
    assert data["predicted"]["step_time_s"] > 0
    assert data["predicted"]["plan"]["runtime"]["stack"] == "trainpilot"
    assert "measured" in proc.stdout and "predicted" in proc.stdout


def test_gpu_check_refuses_a_gpu_run_without_a_gpu():
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "no CUDA GPU" in proc.stderr + proc.stdout
