"""Records that several layers exchange, at the bottom of the package so that the layer that
makes them (runtime) and the layers that keep or judge them (store, health) need not import
each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RankTiming:
    """Seconds one rank spent in one step. ``compute_s`` is measured before the gradient
    collective: DDP's all-reduce evens out ``step_s`` across ranks, so stragglers show only
    there."""

    step: int
    rank: int
    step_s: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    data_s: float | None = None
