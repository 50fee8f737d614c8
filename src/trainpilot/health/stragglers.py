"""Straggler detection from per-rank compute times, and gathering those times to rank 0.

Per step, each rank's compute time (measured *before* the gradient collective: DDP's all-reduce
makes every rank wait for the slowest, so step times look even) is compared with the median of
the other ranks: ``ratio_r = t_r / median(t_others)``. With 4 or more ranks the robust z-score
``(t_r - median) / (1.4826 * MAD)`` must also pass ``z`` (with 2-3 ranks the MAD says nothing).
A rank is a straggler when it is flagged in at least ``min_fraction`` of the last ``window``
steps; its reported slowdown is the median ratio over those steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainpilot.health.detectors import MAD_TO_SIGMA


@dataclass(frozen=True, kw_only=True)
class Straggler:
    rank: int
    slowdown: float  # median over the window of compute time / median of the other ranks
    num_flagged: int
    window: int


def step_ratios(compute_s: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank (ratio to the median of the other ranks, robust z-score) for one step."""
    t = np.asarray(compute_s, dtype=np.float64)
    n = len(t)
    if n < 2:
        return np.ones(n), np.zeros(n)
    others = np.array([np.median(np.delete(t, r)) for r in range(n)])
    ratio = np.where(others > 0, t / np.maximum(others, 1e-12), 1.0)
    median = np.median(t)
    sigma = MAD_TO_SIGMA * np.median(np.abs(t - median))
    z = (t - median) / sigma if sigma > 0 else np.where(t > median, np.inf, 0.0)
    return ratio, z


class StragglerDetector:
    """Keeps a window of per-rank flags and reports consistent stragglers."""

    def __init__(self, *, ratio: float = 1.2, window: int = 10, min_fraction: float = 0.8,
                 z: float = 3.0):
        self.ratio, self.window, self.min_fraction, self.z = ratio, window, min_fraction, z
        self._history: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=window)

    def update(self, compute_s: Sequence[float]) -> list[Straggler]:
        """Add one step's per-rank compute times (index = rank); return current stragglers."""
        ratio, z = step_ratios(compute_s)
        if self._history and len(self._history[-1][1]) != len(ratio):
            # The world size changed (an elastic resize): rank r is not the same process any
            # more, so its window starts again.
            self._history.clear()
        flagged = ratio >= self.ratio
        if len(ratio) >= 4:
            flagged &= z >= self.z
        self._history.append((flagged, ratio))
        if len(self._history) < self.window:
            return []
        flags = np.stack([f for f, _ in self._history])
        ratios = np.stack([r for _, r in self._history])
        counts = flags.sum(axis=0)
        need = int(np.ceil(self.min_fraction * self.window))
        return [Straggler(rank=int(r), slowdown=float(np.median(ratios[:, r])),
                          num_flagged=int(counts[r]), window=self.window)
                for r in np.flatnonzero(counts >= need)]

    def reset(self) -> None:
        self._history.clear()

    def state_dict(self) -> dict[str, list]:
        return {"flags": [f.tolist() for f, _ in self._history],
                "ratios": [r.tolist() for _, r in self._history]}

    def load_state_dict(self, state: dict[str, list]) -> None:
        self._history = deque(((np.asarray(f, dtype=bool), np.asarray(r, dtype=np.float64))
                               for f, r in zip(state["flags"], state["ratios"])),
                              maxlen=self.window)


# The gather is the runtime's (a collective); kept importable from here too.
from trainpilot.runtime.ranktimes import gather_rank_timings  # noqa: E402,F401
