"""Fit one device's efficiency data to the calibration rows (and only those).

Which rows calibrate which data is fixed per device family (``CALIBRATION_SOURCES``): the A100
data on the even vTrain rows (Megatron-DeepSpeed, 2022), the H100 data on NVIDIA's DGX Cloud
recipes (``dgxc_2024``: NeMo/Megatron-Core, 2024). Every other source is held out from both.


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
from typing import NotRequired, TypedDict

from trainpilot.perf.hardware import EfficiencyCurve
from trainpilot.perf.validation.cases import CALIBRATION, Case
from trainpilot.perf.validation.runner import run

FIT_MIN_LOG10 = 11.0
CALIBRATION_STACK = "megatron-legacy"  # the stack of the vTrain calibration rows


class CalibrationSetup(TypedDict):
    """What one curve is fitted to and which of its parameters are free."""

    datasets: tuple[str, ...]
    fit_min_log10: float
    flash: bool
    hbm_host: bool
    scale: NotRequired[bool]


# The datasets each curve is fitted to, the GEMM sizes it frees, and whether the FlashAttention
# factor is fitted too (only where the calibration rows use flash attention) and the HBM share
# and host time (only where small models make them identifiable).
CALIBRATION_SOURCES: dict[str, CalibrationSetup] = {
    "a100": dict(datasets=("vtrain_single", "vtrain_multi"), fit_min_log10=11.0, flash=False,
                 hbm_host=True),
    # H100: one factor on the whole measured (OpenXLA, short-burst) GEMM table - the sustained
    # share of the burst throughput under training's power and thermal load - and the
    # FlashAttention factor: two physical parameters, which the weak-scaling rows identify
    # (freeing each GEMM point gave a non-monotone-looking, unphysical curve at equal error).
    "h100": dict(datasets=("dgxc_2024",), fit_min_log10=0.0, flash=True, hbm_host=False,
                 scale=True),
}
# No GEMM runs faster than the device's measured maximum achievable matmul throughput (bf16,
# best shape of a sweep; S. Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS": A100 SXM
# 271.2 of 312 TFLOP/s). The fit may not exceed it (the first fit put 1e13-FLOP GEMMs at 0.909).
GEMM_CEILING = {"a100": 0.869, "h100": 0.81}


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


def encode(curve: EfficiencyCurve, fit_min_log10: float = FIT_MIN_LOG10, *,
           flash: bool = False, hbm_host: bool = True, scale: bool = False) -> list[float]:
    """Curve -> unconstrained vector: fitted GEMM efficiencies as shares of the headroom between
    the previous point and 1 (so they stay increasing), then (``hbm_host``) HBM share and host
    time per kernel (log), then (``flash``) the FlashAttention factor."""
    first, prev = _split(curve, fit_min_log10)
    vec = []
    if scale:  # one factor on every GEMM point, starting at 1
        vec.append(_logit(0.999))
    else:
        for _, y in curve.gemm_points[first:]:
            vec.append(_logit((y - prev) / max(1.0 - prev, 1e-9)))
            prev = y
    if hbm_host:
        vec += [_logit(curve.hbm_efficiency), math.log(curve.host_us_for(CALIBRATION_STACK))]
    if flash:
        vec.append(_logit(curve.attention_efficiency("fused")))
    return vec


def decode(vec: list[float], base: EfficiencyCurve,
           fit_min_log10: float = FIT_MIN_LOG10, *, flash: bool = False,
           hbm_host: bool = True, scale: bool = False) -> EfficiencyCurve:
    first, prev = _split(base, fit_min_log10)
    free = len(base.gemm_points) - first
    ceiling = GEMM_CEILING.get(base.name, 1.0)
    if scale:
        factor = _sigmoid(vec[0])
        points = tuple((x, max(round(y * factor, 5), 1e-5)) for x, y in base.gemm_points)
        free = 1
    else:
        ys = []
        for a in vec[:free]:
            prev = prev + (1.0 - prev) * _sigmoid(a)
            ys.append(min(max(round(prev, 4), 1e-4), ceiling))
        points = base.gemm_points[:first] + tuple((x, y) for (x, _), y in
                                                  zip(base.gemm_points[first:], ys))
    changes: dict = dict(gemm_points=points)
    at = free
    if hbm_host:
        changes["hbm_efficiency"] = min(max(round(_sigmoid(vec[at]), 4), 1e-3), 1.0)
        # The host time is the calibration stack's (Megatron-DeepSpeed, 2022): stored as that
        # stack's, not as the device's (other stacks issue kernels faster).
        host = round(math.exp(min(max(vec[at + 1], -5.0), 8.0)), 2)
        stacks = dict(base.stack_host_us_per_kernel, **{CALIBRATION_STACK: host})
        changes["stack_host_us_per_kernel"] = tuple(sorted(stacks.items()))
        at += 2
    if flash:
        # The calibration rows run Megatron-Core's fused (cuDNN) attention: that factor.
        changes["fused_attention_efficiency"] = min(max(round(_sigmoid(vec[at]), 4), 0.05),
                                                    1.0)
    return base.replace(**changes)


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
        if r.predicted is not None:
            by_set.setdefault(r.case.dataset, []).append(abs(r.error))
    return sum(sum(e) / len(e) for e in by_set.values()) / len(by_set)


def calibration_rows(cases: list[Case], curve_name: str) -> list[Case]:
    """The calibration-split rows that calibrate ``curve_name``'s data."""
    datasets = CALIBRATION_SOURCES[curve_name]["datasets"]
    return [c for c in cases if c.split == CALIBRATION and c.dataset in datasets]


def calibrate(cases: list[Case], base: EfficiencyCurve, *, max_evals: int = 800,
              fit_min_log10: float | None = None) -> Fit:
    """Fit ``base`` to its calibration rows among ``cases`` (the others are ignored)."""
    from scipy.optimize import minimize

    fallback = CalibrationSetup(datasets=(), fit_min_log10=FIT_MIN_LOG10, flash=False,
                                hbm_host=True)
    setup = CALIBRATION_SOURCES.get(base.name, fallback)
    lo = setup["fit_min_log10"] if fit_min_log10 is None else fit_min_log10
    flash, hbm_host, scale = setup["flash"], setup["hbm_host"], setup.get("scale", False)
    rows = calibration_rows(cases, base.name) if base.name in CALIBRATION_SOURCES else \
        [c for c in cases if c.split == CALIBRATION]
    if not rows:
        raise ValueError(f"no calibration rows for {base.name!r} (is the vTrain folder "
                         "present?)")
    count = [0]

    def objective(vec):
        count[0] += 1
        return mape(rows, decode(list(vec), base, lo, flash=flash, hbm_host=hbm_host,
                                 scale=scale))

    x0 = encode(base, lo, flash=flash, hbm_host=hbm_host, scale=scale)
    start = objective(x0)
    res = minimize(objective, x0, method="Powell",
                   options=dict(maxfev=max_evals, xtol=1e-3, ftol=1e-4))
    best = decode(list(res.x), base, lo, flash=flash, hbm_host=hbm_host, scale=scale)
    return Fit(best, start, mape(rows, best), count[0], len(rows))
