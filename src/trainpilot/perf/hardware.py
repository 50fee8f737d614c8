"""What one device achieves: GEMM efficiency by size, memory-bound throughput, host overhead.

The numbers are data (``perf/data/efficiency.yaml``), keyed by ``DeviceSpec.efficiency_curve``;
this module only interpolates them. Units: seconds, bytes, FLOPs.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from trainpilot.specs import ClusterSpec, SpecError

_DATA = "efficiency.yaml"
_KEYS = {"gemm_efficiency", "flash_attention_efficiency", "hbm_efficiency",
         "host_us_per_kernel", "host_us_per_collective", "overlap_slowdown", "reserved_gib"}
# Optional keys and their defaults (files written before they existed stay valid).
_OPTIONAL = {"collective_library": "nccl", "host_us_per_sharded_op": 0.0,
             "fused_attention_efficiency": None, "stack_host_us_per_kernel": None,
             "fp8_gemm_share": None}
# FlashAttention v1 runs at half FlashAttention-2's throughput (Dao 2023, "FlashAttention-2":
# "2x faster than FlashAttention", forward + backward).
FLASH1_SHARE = 0.5
_LIBRARIES = ("nccl", "rccl", "hccl", "gloo")


@dataclass(frozen=True, kw_only=True)
class EfficiencyCurve:
    """One device family's efficiency data (see the YAML file's header for each key)."""

    name: str
    gemm_points: tuple[tuple[float, float], ...]  # (log10 FLOPs, fraction of peak), ascending
    flash_attention_efficiency: float
    hbm_efficiency: float
    host_us_per_kernel: float
    host_us_per_collective: float
    overlap_slowdown: float
    reserved_gib: float
    collective_library: str = "nccl"  # the device family's usual library (its algorithms)
    host_us_per_sharded_op: float = 0.0  # extra host time per op on a TP-sharded (DTensor) tensor
    # Transformer Engine / cuDNN fused attention relative to a GEMM of the same FLOPs (None:
    # flash_attention_efficiency, the FlashAttention-2 figure).
    fused_attention_efficiency: float | None = None
    # Host time per kernel of a particular stack where it was measured or calibrated: the
    # Python-heavy 2022 Megatron-DeepSpeed ({"megatron-legacy": 65.67}, fitted on vTrain),
    # Megatron-Core with Transformer Engine ({"megatron": 36.5}, TE's measured CPU time per
    # module call); other stacks use host_us_per_kernel.
    stack_host_us_per_kernel: tuple[tuple[str, float], ...] = ()
    # An FP8 GEMM's achieved share of the FP8 peak over a BF16 GEMM's of the BF16 peak on this
    # device family (None: FP8_GEMM_SHARE, the Hopper figure).
    fp8_gemm_share: float | None = None
    _xs: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _ys: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        points = self.gemm_points
        if len(points) < 2:
            raise SpecError(f"efficiency.{self.name}.gemm_efficiency", len(points),
                            "valid: at least two [log10 FLOPs, fraction] points")
        xs = [float(x) for x, _ in points]
        ys = [float(y) for _, y in points]
        if any(b <= a for a, b in zip(xs, xs[1:])):
            raise SpecError(f"efficiency.{self.name}.gemm_efficiency", xs,
                            "valid: strictly increasing log10(FLOPs)")
        if any(not 0 < y <= 1 for y in ys):
            raise SpecError(f"efficiency.{self.name}.gemm_efficiency", ys,
                            "valid: fractions in (0, 1]")
        if any(b < a for a, b in zip(ys, ys[1:])):
            # Larger GEMMs never run less efficiently; the search's lower bounds rely on it.
            raise SpecError(f"efficiency.{self.name}.gemm_efficiency", ys,
                            "valid: fractions that never decrease with size")
        for key in ("flash_attention_efficiency", "hbm_efficiency"):
            if not 0 < getattr(self, key) <= 1:
                raise SpecError(f"efficiency.{self.name}.{key}", getattr(self, key),
                                "valid: a fraction in (0, 1]")
        if self.overlap_slowdown < 1:
            raise SpecError(f"efficiency.{self.name}.overlap_slowdown", self.overlap_slowdown,
                            "valid: >= 1")
        if self.collective_library not in _LIBRARIES:
            raise SpecError(f"efficiency.{self.name}.collective_library",
                            self.collective_library, f"valid: {', '.join(_LIBRARIES)}")
        if self.fp8_gemm_share is not None and not 0 < self.fp8_gemm_share <= 1.5:
            raise SpecError(f"efficiency.{self.name}.fp8_gemm_share", self.fp8_gemm_share,
                            "valid: a ratio in (0, 1.5]")
        if self.host_us_per_sharded_op < 0:
            raise SpecError(f"efficiency.{self.name}.host_us_per_sharded_op",
                            self.host_us_per_sharded_op, "valid: >= 0")
        object.__setattr__(self, "_xs", tuple(xs))
        object.__setattr__(self, "_ys", tuple(ys))

    def gemm_efficiency(self, flops: float) -> float:
        """Achieved fraction of peak for one GEMM of ``flops`` FLOPs (log-linear interpolation,
        clamped to the end points)."""
        xs, ys = self._xs, self._ys
        x = math.log10(flops) if flops > 0 else xs[0]
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, x)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def to_dict(self) -> dict[str, Any]:
        return dict(gemm_efficiency=[list(p) for p in self.gemm_points],
                    flash_attention_efficiency=self.flash_attention_efficiency,
                    hbm_efficiency=self.hbm_efficiency,
                    host_us_per_kernel=self.host_us_per_kernel,
                    host_us_per_collective=self.host_us_per_collective,
                    overlap_slowdown=self.overlap_slowdown, reserved_gib=self.reserved_gib,
                    collective_library=self.collective_library,
                    host_us_per_sharded_op=self.host_us_per_sharded_op,
                    **({"fused_attention_efficiency": self.fused_attention_efficiency}
                       if self.fused_attention_efficiency is not None else {}),
                    **({"stack_host_us_per_kernel": dict(self.stack_host_us_per_kernel)}
                       if self.stack_host_us_per_kernel else {}),
                    **({"fp8_gemm_share": self.fp8_gemm_share}
                       if self.fp8_gemm_share is not None else {}))

    def host_us_for(self, stack: str) -> float:
        """Host time per kernel of ``stack`` (its own measured value, else the device's)."""
        return dict(self.stack_host_us_per_kernel).get(stack, self.host_us_per_kernel)

    def attention_efficiency(self, kernel: str) -> float:
        """The attention kernel's efficiency relative to a GEMM of the same FLOPs."""
        if kernel == "fused" and self.fused_attention_efficiency is not None:
            return self.fused_attention_efficiency
        if kernel == "flash1":
            return FLASH1_SHARE * self.flash_attention_efficiency
        return self.flash_attention_efficiency

    def replace(self, **changes: Any) -> EfficiencyCurve:
        data: dict[str, Any] = dict(name=self.name, gemm_points=self.gemm_points,
                    flash_attention_efficiency=self.flash_attention_efficiency,
                    hbm_efficiency=self.hbm_efficiency, host_us_per_kernel=self.host_us_per_kernel,
                    host_us_per_collective=self.host_us_per_collective,
                    overlap_slowdown=self.overlap_slowdown, reserved_gib=self.reserved_gib,
                    collective_library=self.collective_library,
                    host_us_per_sharded_op=self.host_us_per_sharded_op,
                    fused_attention_efficiency=self.fused_attention_efficiency,
                    stack_host_us_per_kernel=self.stack_host_us_per_kernel,
                    fp8_gemm_share=self.fp8_gemm_share)
        data.update(changes)
        return EfficiencyCurve(**data)


def curve_from_dict(name: str, data: dict[str, Any]) -> EfficiencyCurve:
    """Build a curve from one YAML entry; unknown or missing keys are SpecErrors."""
    unknown = set(data) - _KEYS - set(_OPTIONAL)
    if unknown:
        raise SpecError(f"efficiency.{name}.{sorted(unknown)[0]}", "<key>",
                        f"unknown key; valid keys: {', '.join(sorted(_KEYS | set(_OPTIONAL)))}")
    missing = _KEYS - set(data)
    if missing:
        raise SpecError(f"efficiency.{name}.{sorted(missing)[0]}", "<missing>",
                        "this key is required")
    return EfficiencyCurve(
        name=name, gemm_points=tuple((float(x), float(y)) for x, y in data["gemm_efficiency"]),
        flash_attention_efficiency=float(data["flash_attention_efficiency"]),
        hbm_efficiency=float(data["hbm_efficiency"]),
        host_us_per_kernel=float(data["host_us_per_kernel"]),
        host_us_per_collective=float(data["host_us_per_collective"]),
        overlap_slowdown=float(data["overlap_slowdown"]), reserved_gib=float(data["reserved_gib"]),
        collective_library=str(data.get("collective_library", _OPTIONAL["collective_library"])),
        host_us_per_sharded_op=float(data.get("host_us_per_sharded_op",
                                              _OPTIONAL["host_us_per_sharded_op"])),
        fused_attention_efficiency=(float(data["fused_attention_efficiency"])
                                    if data.get("fused_attention_efficiency") is not None
                                    else None),
        stack_host_us_per_kernel=tuple(sorted(
            (str(k), float(v)) for k, v in (data.get("stack_host_us_per_kernel") or {}).items())),
        fp8_gemm_share=(float(data["fp8_gemm_share"])
                        if data.get("fp8_gemm_share") is not None else None),
    )


@cache
def _bundled() -> dict[str, EfficiencyCurve]:
    text = resources.files("trainpilot.perf").joinpath("data", _DATA).read_text()
    return {name: curve_from_dict(name, entry) for name, entry in yaml.safe_load(text).items()}


def load_curves(path: str | Path | None = None) -> dict[str, EfficiencyCurve]:
    """Every curve in ``path`` (default: the bundled data file)."""
    if path is None:
        return dict(_bundled())
    data = yaml.safe_load(Path(path).read_text())
    return {name: curve_from_dict(name, entry) for name, entry in data.items()}


# The roofline default for a device without efficiency data (docs/cost_model.md, "Devices"):
# the best large-GEMM share typical of tensor-core accelerators (A100 0.87, H100 0.81 in short
# bursts; chosen when the B200 figure was a vendor-level 0.74, which made the mean 0.80: its
# measured best-shape burst share is 0.78, Bekman's MAMF), a kernel floor of a few microseconds,
# and the rest of the data at typical values.
ROOFLINE_CEILING = 0.80
ROOFLINE_KERNEL_FLOOR_S = 5e-6
ROOFLINE_HBM_EFFICIENCY = 0.8


def roofline_curve(name: str, peak_tflops: float, hbm_gbytes_per_s: float) -> EfficiencyCurve:
    """Efficiency data derived from a device's own peak and HBM bandwidth: a square 16-bit
    GEMM of F FLOPs (n = (F/2)^(1/3)) moves 6 n^2 bytes, so its arithmetic intensity is n/3
    FLOPs per byte; its efficiency is ``ceiling x min(1, intensity x HBM / peak, F / (peak x
    floor))`` at 10^7 .. 10^13 FLOPs, kept non-decreasing."""
    peak, hbm = peak_tflops * 1e12, hbm_gbytes_per_s * 1e9 * ROOFLINE_HBM_EFFICIENCY
    points, last = [], 0.0
    for tenth in range(70, 131, 5):
        flops = 10 ** (tenth / 10)
        n = (flops / 2) ** (1 / 3)
        eff = ROOFLINE_CEILING * min(1.0, n / 3 * hbm / peak,
                                     flops / (peak * ROOFLINE_KERNEL_FLOOR_S))
        last = max(last, min(max(eff, 1e-4), 1.0))
        points.append((tenth / 10, round(last, 5)))
    return EfficiencyCurve(name=name, gemm_points=tuple(points), flash_attention_efficiency=0.5,
                           hbm_efficiency=ROOFLINE_HBM_EFFICIENCY, host_us_per_kernel=10.0,
                           host_us_per_collective=20.0, overlap_slowdown=1.15,
                           reserved_gib=2.5)


def is_roofline(cluster: ClusterSpec) -> bool:
    """Whether the cluster's device has no efficiency data and gets the roofline default."""
    device = cluster.device
    return device.efficiency_curve is None and device.name not in _bundled()


def curve_for(cluster: ClusterSpec) -> EfficiencyCurve:
    """The bundled curve named by the cluster's device (``efficiency_curve``, else its name);
    a device that names none and has no data of its own name gets ``roofline_curve``."""
    device = cluster.device
    key = device.efficiency_curve or device.name
    curves = _bundled()
    if key in curves:
        return curves[key]
    if device.efficiency_curve is None:
        return roofline_curve(device.name, device.peak_flops("bf16") / 1e12,
                              device.hbm_gbytes_per_s)
    raise SpecError("cluster.device.efficiency_curve", key,
                    f"no efficiency data; valid: {', '.join(curves)}, or leave it unset for "
                    "a roofline default from the device's peak and HBM bandwidth")


# FP8 training (Transformer Engine, torchao float8): only the linear layers' GEMMs run in FP8;
# attention, the LM head, the router and every elementwise kernel stay 16-bit.
# FP8_GEMM_SHARE: an FP8 GEMM's achieved share of the FP8 peak over a 16-bit GEMM's of the
# 16-bit peak, from two published measurements of large GEMMs on Hopper: DeepGEMM's FP8 table
# on H800, 0.668 of the FP8 peak (the "deepgemm" class fitted in perf/serve.py), and the ~794
# TFLOP/s maximum achievable BF16 matmul of an H100 SXM, 0.80 of its peak (Bekman,
# ml-engineering): 0.668 / 0.80. So an FP8 GEMM is 1.67x, not 2x, its BF16 twin.
FP8_GEMM_SHARE = 0.668 / 0.80


def fp8_gemm_share(curve: EfficiencyCurve) -> float:
    """The device family's FP8 share (its ``fp8_gemm_share``, else the Hopper figure)."""
    return FP8_GEMM_SHARE if curve.fp8_gemm_share is None else curve.fp8_gemm_share
# FP8_CAST_BYTES: HBM bytes per element to quantize a GEMM input (the forward's activation, the
# backward's output gradient): Transformer Engine's fused cast-transpose reads it in 16 bits and
# writes the row-wise and the column-wise (transposed, for the other GEMMs of the backward)
# 8-bit copies, 2 + 1 + 1. Weights are cast once per step (TE's FP8 weight cache): not charged.
FP8_CAST_BYTES = 4.0
# Per scaling recipe (Plan.fp8_recipe): (HBM bytes per element, kernels) of one quantization,
# counted from Transformer Engine's quantizers (transformer_engine/pytorch/csrc/quantizer.cpp):
# delayed scaling casts with the scale of past steps' amax (one fused cast-transpose, the amax
# recorded on the way); current scaling (Float8CurrentScalingQuantizer::quantize_impl) runs
# nvte_compute_amax (a full read of the 16-bit input), nvte_compute_scale_from_amax and the cast:
# 2 more bytes, 3 kernels; MXFP8 and blockwise scaling compute each block's scale inside the
# cast, writing one 8-bit scale per 32 (MX) or 128 (blockwise) elements with each copy.
# Row-wise scaling (torchao's "rowwise": a scale per row along the reduction dimension) needs
# the other orientation scaled along the other axis, so it cannot transpose the 8-bit copy: as
# torchao's own roofline counts it (torchao/testing/training/roofline_utils.py, 2025), one
# kernel reads the 16-bit input and writes the row-scaled 8-bit copy and a 16-bit transposed
# copy (2 + 1 + 2), a second reads that and writes the column-scaled 8-bit copy (2 + 1).
FP8_CAST = {"delayed": (FP8_CAST_BYTES, 1), "current": (FP8_CAST_BYTES + 2.0, 3),
            "mxfp8": (FP8_CAST_BYTES + 2.0 / 32, 1), "blockwise": (FP8_CAST_BYTES + 2.0 / 128, 1),
            "rowwise": (8.0, 2)}
# Weights on a stack that casts them in every forward (torchao's Float8Linear: no weight cache
# across micro-batches; Runtime.weight_cast_per_pass), per element of the rank's weight, from
# the same roofline: tensorwise ("current") an amax read (2) and a cast per orientation (3 + 3),
# rowwise 3 + 4 + 3 (the cast, the 16-bit transpose, the cast of the transpose), MX a cast per
# orientation (3 + 3); delayed and blockwise, a cast per orientation.
FP8_WEIGHT_CAST = {"delayed": (6.0, 2), "current": (8.0, 3), "mxfp8": (6.0, 2),
                   "blockwise": (6.0, 2), "rowwise": (10.0, 3)}
# A weight that arrives in 8 bits from a float8 all-gather (Plan.fp8_param_gather on the PyTorch
# stack: torchao's WeightWithDynamicFloat8CastTensor casts each rank's shard before FSDP2
# gathers it) is not cast again; the forward GEMM reads it as the transposed view it needs, and
# the backward's grad_input GEMM, whose second operand must be column-major, copies it
# transposed (torchao/float8/float8_ops.py, preprocess_addmm: b_data.t().contiguous().t()): a
# read and a write of 1 byte, one kernel. The shard's own cast (3 bytes per element of the
# 1/dp shard, per gather) is not charged.
FP8_GATHERED_WEIGHT = (2.0, 1)
# torchao's rowwise backward GEMMs run without fast accumulation, which its row-scaled CUTLASS
# kernel does slowly, so it calls the tensor-scaled cuBLAS kernel and multiplies the 16-bit
# output by the row and column scales afterwards (torchao/float8/float8_ops.py,
# addmm_float8_unwrapped, since pytorch/ao#1377): a read and a write of each backward GEMM's
# output, one kernel each.
FP8_RESCALE_BYTES = {"rowwise": 4.0}
# A GEMM input that a Transformer Engine norm produces (LayerNormLinear: QKV, FC1) under current
# scaling: the norm kernel computes its output's amax on the way (normalization.cpp,
# FUSED_NORM_AMAX_FP8, TE 2.x), so quantize_with_amax runs only the scale and the cast.
FP8_CAST_NORM_FED = {"current": (FP8_CAST_BYTES, 2)}


def _fp8_cast(recipe: str, norm_fed: bool) -> tuple[float, int]:
    return FP8_CAST_NORM_FED.get(recipe, FP8_CAST[recipe]) if norm_fed else FP8_CAST[recipe]


@dataclass(frozen=True, kw_only=True)
class Device:
    """A device as the cost model sees it: peaks, HBM, efficiency data."""

    peak_flops: float  # dense 16-bit FLOP/s (at the clock a power cap allows): attention, etc.
    hbm_bytes_per_s: float  # achieved (nominal * hbm_efficiency)
    hbm_bytes: float
    curve: EfficiencyCurve
    rated_flops: float = 0.0  # the datasheet peak (what MFU is quoted against); 0: peak_flops
    fp8: bool = False  # the plan's linear layers run FP8 GEMMs
    fp8_flops: float = 0.0  # their dense FP8 peak x fp8_gemm_share (at the capped clock)

    @property
    def nominal_flops(self) -> float:
        return self.rated_flops or self.peak_flops

    @property
    def host_s(self) -> float:
        """Host time to issue one kernel."""
        return self.curve.host_us_per_kernel * 1e-6

    @property
    def host_sharded_s(self) -> float:
        """Extra host time per op on a tensor-parallel (DTensor) tensor: sharding propagation
        and redistribution checks that a plain tensor does not pay."""
        return self.curve.host_us_per_sharded_op * 1e-6

    @property
    def host_coll_s(self) -> float:
        """Host time to issue one collective (NCCL call and its framework wrapper)."""
        return self.curve.host_us_per_collective * 1e-6

    def gemm_s(self, m: float, n: float, k: float, *, batch: float = 1.0,
               linear: bool = False) -> float:
        """Seconds for ``batch`` GEMMs of (m x k) @ (k x n): roofline of the size-dependent
        compute rate and the HBM traffic. 16-bit, except a ``linear`` layer's GEMM under FP8
        (8-bit operands at ``fp8_flops``; its inputs' quantization is ``fp8_cast_s``).
        Excludes host overhead."""
        flops = 2.0 * m * n * k * batch
        if flops <= 0:
            return 0.0
        eight = linear and self.fp8
        peak = self.fp8_flops if eight else self.peak_flops
        compute = flops / (peak * self.curve.gemm_efficiency(flops))
        operand = 1.0 if eight else 2.0
        traffic = (operand * (m * k + k * n) + 2.0 * m * n) * batch / self.hbm_bytes_per_s
        return compute if compute > traffic else traffic

    def fp8_cast_s(self, elements: float, recipe: str = "delayed", *,
                   norm_fed: bool = False) -> float:
        """Seconds to quantize ``elements`` of a GEMM input to FP8 under ``recipe`` (0 without
        FP8; ``FP8_CAST``); ``norm_fed``: the input comes from a norm that computed its amax
        (``FP8_CAST_NORM_FED``)."""
        if not self.fp8:
            return 0.0
        return _fp8_cast(recipe, norm_fed)[0] * elements / self.hbm_bytes_per_s

    @staticmethod
    def fp8_cast_kernels(recipe: str = "delayed", *, norm_fed: bool = False) -> int:
        """Kernels one quantization under ``recipe`` issues (``FP8_CAST``)."""
        return _fp8_cast(recipe, norm_fed)[1]

    def fp8_weight_cast(self, elements: float, recipe: str, *,
                        gathered: bool = False) -> tuple[float, int]:
        """(seconds, kernels) to quantize ``elements`` of a weight in both orientations for one
        forward and backward (``FP8_WEIGHT_CAST``), or, for a weight all-gathered in 8 bits
        (``gathered``), to transpose it for the backward (``FP8_GATHERED_WEIGHT``); (0, 0)
        without FP8."""
        if not self.fp8:
            return 0.0, 0
        per, kernels = FP8_GATHERED_WEIGHT if gathered else FP8_WEIGHT_CAST[recipe]
        return per * elements / self.hbm_bytes_per_s, kernels

    def fp8_rescale(self, elements: float, recipe: str) -> tuple[float, int]:
        """(seconds, kernels) of the separate pass that scales ``elements`` of a backward GEMM's
        output under ``recipe`` (``FP8_RESCALE_BYTES``: rowwise only); (0, 0) otherwise."""
        per = FP8_RESCALE_BYTES.get(recipe, 0.0) if self.fp8 else 0.0
        return (per * elements / self.hbm_bytes_per_s, 1) if per else (0.0, 0)

    def attention_s(self, flops: float, kernel: str = "flash2") -> float:
        """Seconds for a fused attention kernel (``kernel``: flash1, flash2 or fused) doing
        ``flops`` FLOPs."""
        if flops <= 0:
            return 0.0
        eff = self.curve.gemm_efficiency(flops) * self.curve.attention_efficiency(kernel)
        return flops / (self.peak_flops * eff)

    def memory_s(self, num_bytes: float) -> float:
        """Seconds for a memory-bound kernel moving ``num_bytes`` through HBM."""
        return num_bytes / self.hbm_bytes_per_s


def device_model(cluster: ClusterSpec, precision: str,
                 curve: EfficiencyCurve | None = None) -> Device:
    """The cost model's view of ``cluster.device`` at ``precision`` (bf16/fp16/fp8)."""
    spec = cluster.device
    curve = curve or curve_for(cluster)
    sixteen = "bf16" if precision == "fp8" else precision
    return Device(
        peak_flops=spec.peak_flops(sixteen) * spec.clock_factor,
        fp8=precision == "fp8",
        fp8_flops=spec.peak_flops("fp8") * spec.clock_factor * fp8_gemm_share(curve),
        rated_flops=spec.peak_flops(precision),
        hbm_bytes_per_s=spec.hbm_gbytes_per_s * 1e9 * curve.hbm_efficiency,
        hbm_bytes=spec.hbm_gib * 2**30,
        curve=curve,
    )
