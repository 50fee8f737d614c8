"""ClusterSpec, the "where" document: devices, nodes, racks and the wires between them."""

from __future__ import annotations

import math
from typing import Any, Literal

import pydantic
from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt

from trainpilot.specs.base import Spec
from trainpilot.specs.errors import SpecError

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "fp4"]


class DeviceSpec(Spec):
    """One accelerator. ``peak_tflops`` are dense (no sparsity) tensor-core peaks per dtype."""

    name: str
    peak_tflops: dict[Dtype, PositiveFloat]
    hbm_gib: PositiveFloat
    hbm_gbytes_per_s: PositiveFloat
    power_w: PositiveFloat | None = None  # board power at full load (TDP)
    # A power cap below the TDP (nvidia-smi -pl): the cost model scales the compute peak by the
    # clock the cap allows, (power_limit_w / power_w)^(1/3) (dynamic power ~ f V^2, V ~ f).
    power_limit_w: PositiveFloat | None = None
    # Name of the per-device efficiency data the cost model uses; default: `name`.
    efficiency_curve: str | None = None

    @pydantic.model_validator(mode="after")
    def _check_power(self) -> DeviceSpec:
        if self.power_limit_w is not None and self.power_w is None:
            raise SpecError("device.power_limit_w", self.power_limit_w,
                            "needs power_w (the TDP the limit is compared with)")
        return self

    @property
    def clock_factor(self) -> float:
        """Share of the rated clock a power cap leaves: (limit / TDP)^(1/3), at most 1."""
        if self.power_limit_w is None or self.power_w is None:
            return 1.0
        return min(1.0, (self.power_limit_w / self.power_w) ** (1.0 / 3.0))

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (falls back to bf16, then fp16, for missing entries)."""
        for key in (dtype, "bf16", "fp16"):
            if key in self.peak_tflops:
                return self.peak_tflops[key] * 1e12
        raise ValueError(f"device {self.name!r} lists no peak for {dtype!r}")


class LinkSpec(Spec):
    """A network tier, per device and per direction."""

    gbytes_per_s: PositiveFloat
    latency_us: NonNegativeFloat = 0.0
    # Achieved / nominal bandwidth for large collectives (nccl-tests bus bandwidth / line rate).
    efficiency: float = pydantic.Field(default=1.0, gt=0, le=1)

    @property
    def bytes_per_s(self) -> float:
        return self.gbytes_per_s * 1e9 * self.efficiency


BusPoints = list[tuple[PositiveInt, PositiveFloat]]


class MeasuredBusBandwidth(Spec):
    """What the cluster's collectives were measured to deliver: nccl-tests bus bandwidth
    (``busbw``, GB/s, large messages) of a communicator holding every device of each of N
    nodes, as ``[[N, GB/s], ...]`` per collective, N ascending (1: one node, the intra-node
    tier). The cost model caps each tier's per-device bandwidth at what the measurement implies
    for a group spanning that many nodes (interpolated in log N, held at the ends), so a fabric
    that degrades with scale (congestion, oversubscription, a cloud fabric) is priced as
    measured; the link speeds still apply where they are lower."""

    all_reduce: BusPoints = []
    all_gather: BusPoints = []
    reduce_scatter: BusPoints = []

    @pydantic.model_validator(mode="after")
    def _check(self) -> MeasuredBusBandwidth:
        for kind in ("all_reduce", "all_gather", "reduce_scatter"):
            nodes = [n for n, _ in getattr(self, kind)]
            if any(b <= a for a, b in zip(nodes, nodes[1:])):
                raise SpecError(kind, nodes,
                                "node counts must be strictly ascending")
        return self


class NetworkSpec(Spec):
    intra_node: LinkSpec
    inter_node: LinkSpec
    inter_rack: LinkSpec | None = None  # default: same as inter_node
    # The collective library, whose algorithms the cost model follows (NCCL's multi-ring,
    # rail-aligned collectives vs gloo's single ring over all ranks). Default: the device
    # family's usual library (gloo for "cpu", NCCL otherwise).
    collective_library: Literal["nccl", "rccl", "hccl", "gloo"] | None = None
    # Measured collective bandwidth by node count (nccl-tests), which caps the tiers above.
    measured_busbw: MeasuredBusBandwidth | None = None


class ClusterSpec(Spec):
    """Identical nodes of ``devices_per_node`` devices, grouped into racks."""

    name: str = "custom"
    device: DeviceSpec
    devices_per_node: PositiveInt
    num_nodes: PositiveInt
    nodes_per_rack: PositiveInt | None = None  # default: one rack holds every node
    network: NetworkSpec
    price_per_device_hour: NonNegativeFloat | None = None  # USD, for cost estimates

    @pydantic.field_validator("device", mode="before")
    @classmethod
    def _device_by_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            from trainpilot.specs.presets import device_preset

            return device_preset(value)
        return value

    @pydantic.model_validator(mode="after")
    def _fill(self) -> ClusterSpec:
        if self.nodes_per_rack is None:
            object.__setattr__(self, "nodes_per_rack", self.num_nodes)
        return self

    @property
    def num_devices(self) -> int:
        return self.devices_per_node * self.num_nodes

    @property
    def rack_nodes(self) -> int:
        """Nodes per rack (``nodes_per_rack``, filled in by the validator)."""
        if self.nodes_per_rack is None:
            raise RuntimeError("ClusterSpec.nodes_per_rack is unset: build specs with validation")
        return self.nodes_per_rack

    @property
    def num_racks(self) -> int:
        return math.ceil(self.num_nodes / self.rack_nodes)

    @property
    def inter_rack(self) -> LinkSpec:
        return self.network.inter_rack or self.network.inter_node

    def with_devices(self, num_devices: int) -> ClusterSpec:
        """The same cluster resized to ``num_devices`` (whole nodes, or one partial node)."""
        if num_devices <= 0:
            raise SpecError("num_devices", num_devices, "valid: a positive count")
        if num_devices < self.devices_per_node:
            return self.replace(devices_per_node=num_devices, num_nodes=1, nodes_per_rack=1)
        if num_devices % self.devices_per_node:
            raise SpecError("num_devices", num_devices,
                            f"not a whole number of {self.devices_per_node}-device nodes")
        nodes = num_devices // self.devices_per_node
        per_rack = min(int(self.nodes_per_rack), nodes) if self.nodes_per_rack else nodes
        if self.nodes_per_rack == self.num_nodes:  # a single-rack cluster stays single-rack
            per_rack = nodes
        name = f"{self.device.name}-x{num_devices}"
        return self.replace(name=name, num_nodes=nodes, nodes_per_rack=per_rack)
