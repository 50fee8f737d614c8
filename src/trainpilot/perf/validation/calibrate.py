"""Fit one device's efficiency data to the calibration rows (and only those).

Free parameters: the GEMM efficiency at the curve's sizes of at least ``fit_min_log10`` FLOPs
(kept increasing with size, as GEMM throughput is, above the last fixed point and at most the
device's measured maximum achievable matmul throughput, ``GEMM_CEILING``), the achieved
HBM share and the host time per kernel. Not fitted: the host time per collective (the objective
is flat in it from 0 to ~40 us, so it stays at a typical NCCL enqueue cost); the small-GEMM
points (on the calibration rows they trade off one-for-one against the host time per kernel -
both make small models slow - and a joint fit drifts to unphysical values: a 1-GFLOP GEMM at 1%
of peak, zero host time); the FlashAttention factor, the overlap slowdown and the reserved
memory (no calibration row exercises them).

The objective is the mean over calibration datasets of each dataset's mean absolute percentage
error (so the 55 multi-node rows weigh as much as the 720 single-node ones); scipy's Powell
method minimises it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainpilot.perf.hardware import EfficiencyCurve
from trainpilot.perf.validation.cases import CALIBRATION, Case
from trainpilot.perf.validation.runner import run

FIT_MIN_LOG10 = 11.0
# No GEMM runs faster than the device's measured maximum achievable matmul throughput (bf16,
# best shape of a sweep; S. Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS": A100 SXM
# 271.2 of 312 TFLOP/s). The fit may not exceed it (the first fit put 1e13-FLOP GEMMs at 0.909).
GEMM_CEILING = {"a100": 0.869}


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-min(max(x, -50.0), 50.0)))


def _logit(y: float) -> float:
    y = min(max(y, 1e-6), 1 - 1e-6)
    return math.log(y / (1 - y))


def _split(curve: EfficiencyCurve, fit_min_log10: float) -> tuple[int, float]:
    """Index of the first fitted GEMM point and the floor (the last fixed point's efficiency)."""
    first = sum(1 for x, _ in curve.gemm_points if x < fit_min_log10)
    floor = curve.gemm_points[first - 1][1] if first else 0.0
    return first, floor


def encode(curve: EfficiencyCurve, fit_min_log10: float = FIT_MIN_LOG10) -> list[float]:
    """Curve -> unconstrained vector: fitted GEMM efficiencies as shares of the headroom between
    the previous point and 1 (so they stay increasing), then HBM share and host time per kernel
    (log)."""
    first, prev = _split(curve, fit_min_log10)
    vec = []
    for _, y in curve.gemm_points[first:]:
        vec.append(_logit((y - prev) / max(1.0 - prev, 1e-9)))
        prev = y
    return vec + [_logit(curve.hbm_efficiency), math.log(curve.host_us_per_kernel)]


def decode(vec: list[float], base: EfficiencyCurve,
           fit_min_log10: float = FIT_MIN_LOG10) -> EfficiencyCurve:
    first, prev = _split(base, fit_min_log10)
    free = len(base.gemm_points) - first
    ceiling = GEMM_CEILING.get(base.name, 1.0)
    ys = []
    for a in vec[:free]:
        prev = prev + (1.0 - prev) * _sigmoid(a)
        ys.append(min(max(round(prev, 4), 1e-4), ceiling))
    points = base.gemm_points[:first] + tuple((x, y) for (x, _), y in
                                              zip(base.gemm_points[first:], ys))
    hbm = min(max(round(_sigmoid(vec[free]), 4), 1e-3), 1.0)
    host = round(math.exp(min(max(vec[free + 1], -5.0), 8.0)), 2)
    return base.replace(gemm_points=points, hbm_efficiency=hbm, host_us_per_kernel=host)


@dataclass(frozen=True)
class Fit:
    curve: EfficiencyCurve
    start_mape: float
    mape: float
    evaluations: int
    rows: int


def mape(cases: list[Case], curve: EfficiencyCurve) -> float:
    """Mean over datasets of each dataset's mean |error|."""
    by_set: dict[str, list[float]] = {}
    for r in run(cases, curve):
        by_set.setdefault(r.case.dataset, []).append(abs(r.error))
    return sum(sum(e) / len(e) for e in by_set.values()) / len(by_set)


def calibrate(cases: list[Case], base: EfficiencyCurve, *, max_evals: int = 800,
              fit_min_log10: float = FIT_MIN_LOG10) -> Fit:
    """Fit ``base`` to the calibration-split rows of ``cases`` (the others are ignored)."""
    from scipy.optimize import minimize

    rows = [c for c in cases if c.split == CALIBRATION]
    if not rows:
        raise ValueError("no calibration rows (is the vTrain folder present?)")
    count = [0]

    def objective(vec):
        count[0] += 1
        return mape(rows, decode(list(vec), base, fit_min_log10))

    x0 = encode(base, fit_min_log10)
    start = objective(x0)
    res = minimize(objective, x0, method="Powell",
                   options=dict(maxfev=max_evals, xtol=1e-3, ftol=1e-4))
    best = decode(list(res.x), base, fit_min_log10)
    return Fit(best, start, mape(rows, best), count[0], len(rows))
