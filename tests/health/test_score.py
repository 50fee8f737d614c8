"""The health score's documented formulas, part by part."""

from __future__ import annotations

import math

import pytest

from trainpilot.health.detectors import PlateauDetector, TrendDetector
from trainpilot.health.score import ScoreInputs, health_score


def test_a_healthy_step_scores_100_and_parts_are_quarters():
    s = health_score(ScoreInputs(grad_norm=1.0, median_grad_norm=1.0, num_layers=4,
                                 step_s=1.0, comm_s=0.1, mem_frac=0.5,
                                 compute_s_by_rank=(1.0, 1.0)))
    assert s.score == 100.0
    assert s.as_metrics()["health/score"] == 25 * sum(
        (s.gradient_flow, s.communication, s.hardware, s.convergence))


@pytest.mark.parametrize("inputs, part, expected", [
    (dict(finite=False), "gradient_flow", 0.0),
    (dict(grad_norm=20.0, median_grad_norm=1.0), "gradient_flow", 0.5),  # 10x median / 20x
    (dict(grad_norm=2e5), "gradient_flow", 0.0),  # past the explosion threshold
    (dict(num_layers=4, num_vanishing_layers=1), "gradient_flow", 0.75),
    (dict(step_s=1.0, comm_s=0.625), "communication", 0.5),
    (dict(comm_max_s=6.0), "communication", 0.0),
    (dict(mem_frac=0.95), "hardware", 0.5),
    (dict(compute_s_by_rank=(1.0, 1.0, 1.25)), "hardware", 0.8),
    (dict(recent_fault=True), "hardware", 0.5),
    (dict(loss_z=5.25, loss_above_trend=True), "convergence", 0.5),
    (dict(loss_z=4.4, loss_above_trend=True), "convergence", 1.0),  # batch noise is free
    (dict(loss_z=5.25, loss_above_trend=False), "convergence", 1.0),
    (dict(learned_rel=0.001), "convergence", 0.0),  # learns nothing
    (dict(learned_rel=0.30), "convergence", 1.0),
    (dict(recent_spike=True), "convergence", 0.2),
    (dict(improvement=0.0), "convergence", 0.5),
    (dict(improvement=0.005), "convergence", 0.75),
])
def test_each_factor(inputs, part, expected):
    assert getattr(health_score(ScoreInputs(**inputs)), part) == pytest.approx(expected)


def test_bands_of_the_score():
    from trainpilot.health.score import band

    assert [band(x) for x in (100, 90, 89.9, 80, 79, 60, 59, 0, None)] == [
        "healthy", "healthy", "watch", "watch", "act", "act", "failing", "failing", "unknown"]


def test_score_stays_in_range_for_extreme_inputs():
    s = health_score(ScoreInputs(finite=False, comm_max_s=99, mem_frac=1.5, loss_z=math.inf,
                                 loss_above_trend=True, compute_s_by_rank=(1, 100)))
    assert s.score == pytest.approx(25 * s.hardware) and 0 <= s.score <= 100


def test_trend_detector_excludes_the_current_point_and_flagged_points():
    det = TrendDetector(window=16, min_points=8, z_threshold=6.0, rise=0.3)
    for step in range(1, 21):
        det.accept(step, 3.0 - 0.01 * step)
    spike = det.score(21, 6.0)
    assert spike.flagged and spike.prediction == pytest.approx(2.79, rel=1e-3)
    assert not det.score(21, 2.8).flagged
    assert not det.score(21, 3.2).flagged  # z is huge on a smooth curve, but only +15 %
    assert det.score(21, math.nan).flagged
    det.truncate(10)
    assert len(det) == 6  # the window held steps 5-20


def test_plateau_detector():
    det = PlateauDetector(window=8, min_rel_improvement=0.01)
    results = [det.update(v) for v in [3, 2.9, 2.8, 2.7, 2.6, 2.5, 2.4, 2.3]]
    assert results[-1].improvement == pytest.approx((2.95 - 2.35) / 2.95) and not results[-1].flagged
    for v in [2.3] * 8:
        last = det.update(v)
    assert last.flagged and last.improvement == 0


def test_monitor_relearns_the_trend_after_a_lasting_level_shift():
    from trainpilot.health.monitor import HealthMonitor

    monitor = HealthMonitor()
    flagged = []
    for step in range(1, 121):
        loss = 2.0 if step <= 50 else 4.0  # the loss doubles for good at step 51
        monitor.end_step(step=step, loss=loss)
        flagged.append(monitor._state.loss_score.flagged)
    assert flagged[50] and all(flagged[50:66])  # the shift is flagged...
    assert not any(flagged[70:])  # ...until the detector re-baselines (after window / 2 = 16)
    assert [a.step for a in monitor.alerts.log if a.rule == "divergence_risk"] == [51]
