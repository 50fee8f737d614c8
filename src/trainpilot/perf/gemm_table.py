"""GEMM efficiency curves derived from a measured matmul table, and the derivation of the B200
curve in ``data/efficiency.yaml`` (docs/cost_model.md, "Devices").

The table (``data/xla_matmul_bf16.csv``) is OpenXLA's default GEMM cost table: bf16 throughput of
375 shapes ``b x (m x k) @ (k x n)``, each dimension 256-4096, b 1-4, measured by XLA on one
sm_100 (B200) and one sm_90 (H100) GPU in short bursts. A curve point is the median throughput
of the shapes whose FLOPs fall in a half-decade bin around it, over the device's dense peak,
times the share of the burst throughput sustained in training:

* H100 (``efficiency.yaml``'s h100 curve, built earlier from the same project's sm_90 table):
  0.721, the one factor fitted on the H100 calibration source (NVIDIA's DGX Cloud recipes;
  0.763 until the refit of 2026-12-07, see ``efficiency.yaml``);
* B200: that factor times the B200's measured sustained-over-burst ratio relative to the
  H200's (``sustained_over_burst``), so the only fitted number stays the H100 one and the
  B200's extra loss under power saturation is a measurement, not a fit.

Nothing here was fitted to a validation row.
"""

from __future__ import annotations

import csv
import math
import statistics
from functools import cache
from importlib import resources

# The share of OpenXLA's burst GEMM table sustained in multi-hour training on H100, fitted on
# dgxc_2024 (perf/validation/calibrate.py: the h100 curve's scale; 0.763 x the refit's 0.9452).
H100_SUSTAINED_SHARE = 0.7212
# (sustained, burst) bf16 matmul TFLOP/s - MSMF, the GPU soaked at its power limit, and MAMF,
# the best-shape boost burst - measured with the same tool and protocol on both chips, all 8
# GPUs of a node computing, 5 rounds: S. Bekman, ml-engineering,
# compute/accelerator/benchmarks/README.md, "What we measured: alone vs all-8 concurrent"
# (B200 torch 2.13.0+cu130; H200 torch 2.14 dev). The H200 stands in for Hopper (the H100's
# GH100 die and 700 W board limit; its extra HBM does not enter a compute-bound matmul). Their
# dense bf16 peaks beside them.
MATMUL_ALL_BUSY_TFLOPS = {"b200": (1426.4, 1751.2), "hopper": (698.6, 823.9)}
BF16_PEAK_TFLOPS = {"b200": 2250.0, "hopper": 989.0}
# Best-shape burst matmul TFLOP/s over the dense peak (MAMF), bf16 and fp8, from the same
# source's comparison table (compute/accelerator/README.md and its H200-to-B200 guide): Hopper
# (H100/H200 SXM) 794.5 / 989 and 1453.4 / 1979; B200 1745.0 / 2250 and 3432.5 / 4500.
MAMF_SHARE = {"hopper": {"bf16": 794.5 / 989, "fp8": 1453.4 / 1979},
              "b200": {"bf16": 1745.0 / 2250, "fp8": 3432.5 / 4500}}
# log10(FLOPs) at which curve points are placed, and the half-width of each bin.
POINTS = (7.5, 8.0, 8.5, 9.0, 9.5, 10.0, 10.5, 11.0, 11.5)
HALF_BIN = 0.25
_DATA = "xla_matmul_bf16.csv"


@cache
def table(arch: str) -> tuple[tuple[float, float], ...]:
    """(FLOPs, measured FLOP/s) of every shape of ``arch`` (sm_90 or sm_100) in the table."""
    text = resources.files("trainpilot.perf").joinpath("data", _DATA).read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    rows = [r for r in csv.DictReader(lines) if r["arch"] == arch]
    if not rows:
        raise ValueError(f"gemm table: no rows for arch {arch!r}; valid: sm_90, sm_100")
    return tuple((2.0 * int(r["b"]) * int(r["m"]) * int(r["n"]) * int(r["k"]),
                  float(r["flops_per_s"])) for r in rows)


def binned_medians(arch: str) -> tuple[tuple[float, float], ...]:
    """(log10 FLOPs, median FLOP/s) per half-decade bin of ``POINTS`` that holds a shape."""
    out = []
    for x in POINTS:
        rates = [rate for flops, rate in table(arch)
                 if x - HALF_BIN <= math.log10(flops) < x + HALF_BIN]
        if rates:
            out.append((x, statistics.median(rates)))
    return tuple(out)


def sustained_over_burst(device: str) -> float:
    """MSMF / MAMF of ``device`` (b200 or hopper): what power saturation takes off a burst."""
    sustained, burst = MATMUL_ALL_BUSY_TFLOPS[device]
    return sustained / burst


def b200_sustained_share() -> float:
    """The H100's fitted sustained share, scaled by the B200's measured power-saturation loss
    relative to the H200's (0.693)."""
    return H100_SUSTAINED_SHARE * sustained_over_burst("b200") / sustained_over_burst("hopper")


def b200_fp8_share() -> float:
    """The B200's FP8 share: the Hopper figure (``hardware.FP8_GEMM_SHARE``, from DeepGEMM's
    FP8 kernels on H800) times how much closer to its FP8 peak a B200 runs than a Hopper GPU,
    relative to BF16, by the MAMF table (0.983 against 0.914: 0.898)."""
    from trainpilot.perf.hardware import FP8_GEMM_SHARE

    def ratio(device: str) -> float:
        return MAMF_SHARE[device]["fp8"] / MAMF_SHARE[device]["bf16"]

    return FP8_GEMM_SHARE * ratio("b200") / ratio("hopper")


def derived_points(arch: str, peak_flops: float, share: float) -> tuple[tuple[float, float], ...]:
    """The GEMM curve's points: binned medians over ``peak_flops`` times ``share``, rounded to
    5 decimals and kept non-decreasing (larger GEMMs never run less efficiently)."""
    out, last = [], 0.0
    for x, rate in binned_medians(arch):
        last = max(last, round(rate / peak_flops * share, 5))
        out.append((x, last))
    return tuple(out)


def saturation_share(device: str) -> float:
    """Where the curve ends for GEMMs far beyond the table: the same fraction of the device's
    measured sustained best-shape rate (MSMF over its dense peak) as the h100 curve ends at
    (0.585 of peak against the H200's MSMF of 0.706: 0.827). On H100 the table's top bins have
    already levelled off there; on B200 they still rise at the table's largest shapes (5.5e11
    FLOPs), so the curve is extended to that level at ``SATURATION_LOG10``."""
    def msmf_share(name: str) -> float:
        return MATMUL_ALL_BUSY_TFLOPS[name][0] / BF16_PEAK_TFLOPS[name]

    return H100_CURVE_END / msmf_share("hopper") * msmf_share(device)


# The h100 curve's last point (efficiency.yaml), and where a table that has not levelled off
# is extended to its saturation: 1e12.5 FLOPs, ~6x the table's largest GEMM.
H100_CURVE_END = 0.58452
SATURATION_LOG10 = 12.5


def b200_points() -> tuple[tuple[float, float], ...]:
    """The b200 curve of ``efficiency.yaml`` (its dense bf16 peak: 2,250 TFLOP/s): the table's
    bins, then the saturation point."""
    points = derived_points("sm_100", BF16_PEAK_TFLOPS["b200"] * 1e12, b200_sustained_share())
    end = round(saturation_share("b200"), 5)
    return points + ((SATURATION_LOG10, max(end, points[-1][1])),)
