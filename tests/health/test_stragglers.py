"""Stragglers: the robust ratio on its own, and two real gloo ranks with one slowed on purpose."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trainpilot.health.stragglers import StragglerDetector, step_ratios
from trainpilot.runtime.local_ranks import run_local_ranks
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
    ranks = run_local_ranks(
        lambda rank, port: [sys.executable, "-m", "tests.health._straggler_worker", str(rank),
                            "2", str(port), str(tmp_path)],
        2, timeout_s=100, cwd=REPO, env=dict(PYTHONPATH=str(REPO)),
        logs=[tmp_path / f"rank{rank}.log" for rank in range(2)])
    assert ranks.ok, ranks.describe()
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
