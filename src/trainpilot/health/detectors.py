"""Robust detectors over a metric's recent history (numpy only; microseconds per step).

- :class:`TrendDetector` (divergence risk, loss spikes): a Theil–Sen line through the last
  ``window`` accepted points, *not* including the point being judged, predicts the current value;
  the robust z-score is ``(x - prediction) / (1.4826 * MAD(residuals))``, computed on ``log(x)``
  when every value is positive (a loss's batch-to-batch noise is multiplicative). A point is
  flagged when ``z > z_threshold`` and ``x > (1 + rise) * prediction``. Flagged points are not
  added to the history, so one spike cannot drag the trend after it. The logs of the history
  and the pairs' step gaps (for a run of consecutive steps) are kept between calls: a fit is
  some 14 numpy calls on 32 points, 0.03 ms alone and about 0.3 ms inside a training step
  (cold caches, a shared core).
- :class:`PlateauDetector` (slow convergence): over the last ``window`` points, the median of the
  last quarter against the median of the first quarter; flagged when the relative improvement is
  below ``min_rel_improvement``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution is 0.6745 sigma
_MIN_REL_SIGMA = 1e-3  # floor on sigma relative to the prediction: a perfectly smooth curve


@lru_cache(maxsize=64)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)


def fast_median(a: np.ndarray) -> float:
    """Median by partial sort (np.median's wrapper costs more than the work at these sizes)."""
    n = len(a)
    k = n // 2
    if n % 2:
        return float(np.partition(a, k)[k])
    part = np.partition(a, (k - 1, k))
    return 0.5 * float(part[k - 1] + part[k])


@lru_cache(maxsize=64)
def _unit_gaps(n: int) -> np.ndarray:
    i, j = _pairs(n)
    return (j - i).astype(np.float64)


def theil_sen(x: np.ndarray, y: np.ndarray, *, consecutive: bool = False) -> tuple[float, float]:
    """(slope, intercept) of the Theil–Sen line: median pairwise slope, median intercept.
    ``consecutive``: ``x`` is a run of consecutive integers, so the pairs' gaps are cached."""
    i, j = _pairs(len(x))
    gaps = _unit_gaps(len(x)) if consecutive else x[j] - x[i]
    slope = fast_median((y[j] - y[i]) / gaps)
    return slope, fast_median(y - slope * x)


def robust_sigma(residuals: np.ndarray) -> float:
    """1.4826 * median absolute deviation: a standard deviation that ignores outliers."""
    return MAD_TO_SIGMA * fast_median(np.abs(residuals - fast_median(residuals)))


@dataclass(frozen=True, kw_only=True)
class TrendScore:
    value: float
    prediction: float | None  # None until min_points accepted points exist
    z: float
    ratio: float  # value / prediction
    flagged: bool


class TrendDetector:
    """Flags a value far above the robust trend of the recent history (see module docstring)."""

    def __init__(self, *, window: int = 32, min_points: int = 10, z_threshold: float = 6.0,
                 rise: float = 0.30):
        self.window, self.min_points = window, min_points
        self.z_threshold, self.rise = z_threshold, rise
        self._steps: deque[int] = deque(maxlen=window)
        self._values: deque[float] = deque(maxlen=window)
        self._logs: deque[float] = deque(maxlen=window)  # log(value), nan when value <= 0

    def __len__(self) -> int:
        return len(self._values)

    def score(self, step: int, value: float) -> TrendScore:
        """Judge ``value`` at ``step`` against the history (which does not include it)."""
        if not math.isfinite(value):
            return TrendScore(value=value, prediction=None, z=math.inf, ratio=math.inf,
                              flagged=True)
        if len(self._values) < self.min_points:
            return TrendScore(value=value, prediction=None, z=0.0, ratio=1.0, flagged=False)
        positive = value > 0 and min(self._values) > 0
        return self._judge(self._fit_line(positive), step, value)

    def _fit_line(self, positive: bool) -> tuple[float, float, float, bool]:
        """(slope, intercept, robust sigma of the residuals, on logs?) of the history now."""
        n = len(self._values)
        x = np.fromiter(self._steps, np.float64, n)
        # losses: multiplicative noise, so judge log(loss)
        y = np.fromiter(self._logs if positive else self._values, np.float64, n)
        # Steps only grow (accept() keeps them so): first and last n - 1 apart means a run.
        slope, intercept = theil_sen(x, y, consecutive=self._steps[-1] - self._steps[0] == n - 1)
        return slope, intercept, robust_sigma(y - (slope * x + intercept)), positive

    def _judge(self, fit: tuple[float, float, float, bool], step: int,
               value: float) -> TrendScore:
        slope, intercept, sigma, positive = fit
        line = slope * step + intercept
        floor = _MIN_REL_SIGMA if positive else _MIN_REL_SIGMA * abs(line)
        z = ((math.log(value) if positive else value) - line) / max(sigma, floor, 1e-12)
        prediction = math.exp(line) if positive else line
        ratio = value / prediction if prediction > 0 else math.inf
        flagged = z > self.z_threshold and ratio > 1.0 + self.rise
        return TrendScore(value=value, prediction=prediction, z=z, ratio=ratio, flagged=flagged)

    def accept(self, step: int, value: float) -> None:
        """Add a point judged normal to the history (a step at or before the newest one
        replaces the points from it on: the run went back)."""
        if self._steps and step <= self._steps[-1]:
            self.truncate(step - 1)
        self._steps.append(step)
        self._values.append(value)
        self._logs.append(math.log(value) if value > 0 else math.nan)

    def state_dict(self) -> dict[str, list]:
        return {"steps": list(self._steps), "values": list(self._values)}

    def load_state_dict(self, state: dict[str, list]) -> None:
        self._steps = deque(maxlen=self.window)
        self._values = deque(maxlen=self.window)
        self._logs = deque(maxlen=self.window)
        for step, value in zip(state["steps"], state["values"]):
            self.accept(int(step), float(value))

    def truncate(self, last_step: int) -> None:
        """Forget points after ``last_step`` (the run was rolled back to it)."""
        while self._steps and self._steps[-1] > last_step:
            self._steps.pop()
            self._values.pop()
            self._logs.pop()


@dataclass(frozen=True, kw_only=True)
class PlateauScore:
    improvement: float | None  # relative; None until the window is full
    flagged: bool


class PlateauDetector:
    """Flags a loss that stopped improving over ``window`` steps (see module docstring)."""

    def __init__(self, *, window: int = 200, min_rel_improvement: float = 0.01):
        self.window, self.min_rel_improvement = window, min_rel_improvement
        self._values: deque[float] = deque(maxlen=window)

    def update(self, value: float, *, evaluate: bool = True) -> PlateauScore:
        """Add a value; judge the window when ``evaluate`` (a plateau is slow: the monitor judges
        every ``detail_every`` steps)."""
        if math.isfinite(value):
            self._values.append(value)
        if len(self._values) < self.window or not evaluate:
            return PlateauScore(improvement=None, flagged=False)
        y = np.asarray(self._values)
        quarter = max(1, self.window // 4)
        early, late = fast_median(y[:quarter]), fast_median(y[-quarter:])
        improvement = (early - late) / abs(early) if early else 0.0
        return PlateauScore(improvement=improvement,
                            flagged=improvement < self.min_rel_improvement)

    def reset(self) -> None:
        """Start a new window (after the LR changed, or a rollback)."""
        self._values.clear()

    def state_dict(self) -> dict[str, list]:
        return {"values": list(self._values)}

    def load_state_dict(self, state: dict[str, list]) -> None:
        self._values = deque((float(v) for v in state["values"]), maxlen=self.window)
