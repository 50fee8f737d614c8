"""TrendDetector against a direct evaluation of its definition (module docstring of
trainpilot.health.detectors): the cached logs and pair gaps must not change a judgement."""

from __future__ import annotations

import math

import numpy as np

from trainpilot.health.detectors import TrendDetector


def direct_score(steps, values, step, value, *, z_threshold=6.0, rise=0.30):
    """(prediction, z, flagged) computed from scratch: Theil–Sen on log(values) (when all are
    positive), robust sigma of the residuals, floored at 1e-3."""
    x, y = np.array(steps, float), np.array(values, float)
    positive = bool(np.all(y > 0)) and value > 0
    if positive:
        y, current = np.log(y), math.log(value)
    else:
        current = value
    pairs = [(a, b) for a in range(len(x)) for b in range(a + 1, len(x))]
    slope = float(np.median([(y[b] - y[a]) / (x[b] - x[a]) for a, b in pairs]))
    intercept = float(np.median(y - slope * x))
    fit = slope * step + intercept
    residuals = y - (slope * x + intercept)
    floor = 1e-3 if positive else 1e-3 * abs(fit)
    sigma = max(1.4826 * float(np.median(np.abs(residuals - np.median(residuals)))), floor,
                1e-12)
    z = (current - fit) / sigma
    prediction = math.exp(fit) if positive else fit
    ratio = value / prediction if prediction > 0 else math.inf
    return prediction, z, bool(z > z_threshold and ratio > 1.0 + rise)


def test_scores_equal_the_direct_evaluation_consecutive_gapped_and_signed():
    rng = np.random.default_rng(0)
    flagged = 0
    for case in range(60):
        det = TrendDetector(window=32, min_points=10)
        steps, values = [], []
        step = 0
        for _ in range(80):
            step += 1 if case % 3 else int(rng.integers(1, 4))  # runs and gapped steps
            base = 3.0 * (1 + step) ** -0.3 * math.exp(rng.normal(0, 0.02))
            value = base * (2.0 if rng.random() < 0.05 else 1.0)  # a few spikes
            if case % 5 == 0:
                value -= 2.5  # signed values: no logarithm
            got = det.score(step, value)
            if len(steps) >= 10:
                pred, z, flag = direct_score(steps[-32:], values[-32:], step, value)
                assert math.isclose(got.prediction, pred, rel_tol=1e-9, abs_tol=1e-12)
                assert math.isclose(got.z, z, rel_tol=1e-7, abs_tol=1e-9)
                assert got.flagged == flag
                flagged += flag
            if not got.flagged:
                det.accept(step, value)
                steps.append(step)
                values.append(value)
    assert flagged > 20  # the spikes were judged, not only the calm points


def test_a_repeated_step_replaces_the_newer_points_and_state_round_trips():
    det = TrendDetector(window=8, min_points=3)
    for step in range(1, 11):
        det.accept(step, 1.0 / step)
    det.accept(7, 0.5)  # the run went back to step 6 and redid 7
    assert det.state_dict()["steps"] == [3, 4, 5, 6, 7]
    again = TrendDetector(window=8, min_points=3)
    again.load_state_dict(det.state_dict())
    assert again.score(8, 0.4) == det.score(8, 0.4)
