"""The GEMM kernel classes of the serving cost model, refit from their published measurements.

``perf.serve.GEMM_KERNELS`` holds, per kernel class, the four constants of the cost model's
GEMM form (``perf.serve.GemmKernels``). They come from DeepGEMM's published FP8 table on H800
(``data/serve_gemm.yaml``): ``fit_gemm("deepgemm")`` fits DeepGEMM's own times,
``fit_gemm("cutlass-3.6")`` its times x the speedup column (DeepSeek's tuned CUTLASS 3.6
implementation of the same GEMMs). Least squares on log time over the shapes the form
describes: N >= 4,096 and K >= 1,536 (22 of the 28; a shape with fewer output tiles than SMs
or a K this short is bound by tile count or by its epilogue, which the form does not model).
No serving measurement is read.

``fit_moe_triton()`` fits the same form to vLLM's published times of the Triton fused-MoE
kernel on DeepSeek-V3's 256 block-FP8 experts (``data/serve_moe_triton.yaml``), priced the way
the serving model prices routed experts: each receiving expert's three GEMMs as square pieces
of its weights, over the experts the tokens touch (``1 - (1 - k/E)^tokens`` of them). The table
starts at 128 tokens, where every expert is touched, so it pins the cost per touched expert,
not how the kernel behaves with fewer.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from trainpilot.perf.serve import GemmKernels, gemm_seconds

MIN_N, MIN_K = 4096, 1536


@lru_cache(maxsize=2)
def _load(name: str) -> dict[str, Any]:
    text = resources.files("trainpilot.sim").joinpath("data", name).read_text()
    return yaml.safe_load(text)


def load_table() -> dict[str, Any]:
    """The bundled DeepGEMM table (source, device, rows)."""
    return _load("serve_gemm.yaml")


def _least_squares(errors: Callable[[GemmKernels], list[float]], start: list[float],
                   lower: list[float], upper: list[float]) -> tuple[GemmKernels, float]:
    """The ``GemmKernels`` minimising ``errors`` (log ratios) from ``start`` inside the bounds,
    and its mean |error|."""
    from scipy.optimize import least_squares

    def of(x) -> GemmKernels:
        return GemmKernels(fp8_efficiency=x[0], hbm_efficiency=x[1], overlap_loss=x[2],
                           latency_us=x[3])

    kernels = of(least_squares(lambda x: errors(of(x)), start, bounds=(lower, upper)).x)
    return kernels, statistics.mean(abs(math.expm1(e)) for e in errors(kernels))


def _rows(kind: str) -> list[tuple[float, float, float, float, float]]:
    """(groups, M, N, K, measured seconds) of the fitted shapes for ``kind``."""
    out = []
    for groups, m, n, k, tflops, speedup in load_table()["rows"]:
        if n < MIN_N or k < MIN_K:
            continue
        seconds = 2.0 * groups * m * n * k / (tflops * 1e12)
        out.append((groups, m, n, k, seconds * (speedup if kind == "cutlass-3.6" else 1.0)))
    return out


def _predict(kernels: GemmKernels, groups: float, m: float, n: float, k: float) -> float:
    dev = load_table()["source"]["device"]
    seconds, _, _ = gemm_seconds(kernels, dev["peak_tflops"] * 1e12 * kernels.fp8_efficiency,
                                 dev["hbm_gbytes_per_s"] * 1e9, rows=m, n=n, k=k,
                                 weight_bytes=1.0, act_bytes=1.0, groups=groups)
    return seconds


def fit_errors(kernels: GemmKernels, kind: str) -> list[float]:
    """log(predicted / measured) time of each fitted shape."""
    return [math.log(_predict(kernels, g, m, n, k) / t) for g, m, n, k, t in _rows(kind)]


def fit_gemm(kind: str) -> tuple[GemmKernels, float]:
    """The least-squares ``GemmKernels`` for ``kind`` ("deepgemm" or "cutlass-3.6") and its
    mean |error| on the fitted shapes."""
    return _least_squares(lambda kernels: fit_errors(kernels, kind), [0.7, 0.85, 0.3, 3.0],
                          [0.3, 0.3, 0.0, 0.0], [1.0, 1.0, 1.0, 30.0])


def load_moe_table() -> dict[str, Any]:
    """The bundled Triton fused-MoE table (source, device, experts, rows)."""
    return _load("serve_moe_triton.yaml")


def _predict_moe(kernels: GemmKernels, tokens: float, tp: int) -> float:
    """Seconds of one fused-MoE call of ``tokens`` tokens as the serving model prices it."""
    src = load_moe_table()["source"]
    dev, ex = src["device"], src["experts"]
    active = ex["num_experts"] * (1.0 - (1.0 - ex["top_k"] / ex["num_experts"]) ** tokens)
    side = math.sqrt(ex["hidden"] * ex["width"] / tp)  # each of the 3 GEMMs: hidden x width/tp
    seconds, _, _ = gemm_seconds(kernels, dev["peak_tflops"] * 1e12 * kernels.fp8_efficiency,
                                 dev["hbm_gbytes_per_s"] * 1e9,
                                 rows=tokens * ex["top_k"] / active, n=side, k=side,
                                 weight_bytes=1.0, act_bytes=1.0, groups=active)
    return 3 * seconds


def moe_fit_errors(kernels: GemmKernels) -> list[float]:
    """log(predicted / measured) time of each row of the Triton fused-MoE table."""
    return [math.log(_predict_moe(kernels, tokens, tp) / (us * 1e-6))
            for tokens, tp, us in load_moe_table()["rows"]]


def fit_moe_triton() -> tuple[GemmKernels, float]:
    """The least-squares ``GemmKernels`` of "triton-moe-2025" and its mean |error| on the
    table."""
    return _least_squares(moe_fit_errors, [0.3, 0.3, 0.3, 3.0], [0.01, 0.05, 0.0, 0.0],
                          [1.0, 1.0, 1.0, 500.0])
