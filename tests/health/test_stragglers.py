"""Stragglers: the robust ratio on its own, and two real gloo ranks with one slowed on purpose."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainpilot.health.stragglers import StragglerDetector, step_ratios
from trainpilot.store import RunStore

REPO = Path(__file__).resolve().parents[2]


def test_ratio_is_against_the_median_of_the_other_ranks():
    ratio, z = step_ratios([1.0, 1.0, 1.0, 1.5])
    assert ratio.tolist() == [1.0, 1.0, 1.0, 1.5] and z[3] == float("inf")
    ratio, _ = step_ratios([2.0, 1.0])
    assert ratio.tolist() == [2.0, 0.5]


def test_detector_needs_consistency_and_the_ratio():
    det = StragglerDetector(ratio=1.2, window=10, min_fraction=0.8)
    flagged = []
    for step in range(10):
        slow = 1.3 if step % 4 else 1.0  # slow in 7 of 10 steps: not consistent
        flagged = det.update([1.0, 1.02, slow, 0.98])
    assert flagged == []
    det.reset()
    for _ in range(10):
        flagged = det.update([1.0, 1.02, 1.25, 0.98])
    assert [s.rank for s in flagged] == [2] and flagged[0].slowdown == pytest.approx(1.25)
    det.reset()
    for _ in range(10):
        flagged = det.update([1.0, 1.02, 1.15, 0.98])  # 1.15x: below the 1.2x threshold
    assert flagged == []


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_two_gloo_ranks_one_slowed_is_flagged_from_compute_time(tmp_path):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.health._straggler_worker", str(rank),
                               "2", str(store.port), str(tmp_path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for rank in range(2)]
    try:
        outputs = [p.communicate(timeout=100)[0].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    result = json.loads((tmp_path / "result.json").read_text())
    first = result["alerts"][0]
    assert first["rank"] == 1 and first["slowdown"] >= 1.2
    assert first["step"] == 10  # detected once its 10-step window is full
    # DDP-style all-reduce evens step times out: fed step times, nobody is flagged.
    assert result["flagged_by_step_time"] == []
    assert result["hardware"] < 0.9
    reader = RunStore.open_readonly(tmp_path / "run")
    timings = reader.rank_timings()
    assert {t.rank for t in timings} == {0, 1} and len(timings) == 28
    assert reader.events(kinds=["alert"])[0].name == "straggler"
