"""Device and cluster presets, with sources.

Peaks are dense (no 2:4 sparsity) tensor-core TFLOP/s from the vendors' datasheets. Network
figures are per device and per direction; ``efficiency`` is the achieved share of the line rate
for large collectives (nccl-tests bus bandwidth over nominal), which users should replace with
their own nccl-tests measurement.
"""

from __future__ import annotations

import re
from typing import Any

DEVICES: dict[str, dict[str, Any]] = {
    # NVIDIA A100 datasheet (2021): 312 TFLOP/s bf16/fp16 dense, 40 GB HBM2 at 1,555 GB/s, 400 W.
    "a100-40gb": dict(name="a100-40gb", peak_tflops=dict(bf16=312, fp16=312, tf32=156, fp32=19.5),
                      hbm_gib=40, hbm_gbytes_per_s=1555, power_w=400, efficiency_curve="a100"),
    # NVIDIA A100 datasheet: 80 GB HBM2e at 2,039 GB/s (SXM); nvidia-smi shows 81,920 MiB = 80 GiB.
    "a100-80gb": dict(name="a100-80gb", peak_tflops=dict(bf16=312, fp16=312, tf32=156, fp32=19.5),
                      hbm_gib=80, hbm_gbytes_per_s=2039, power_w=400, efficiency_curve="a100"),
    # NVIDIA H100 datasheet (SXM5): 989 bf16, 1,979 fp8 dense; "80 GB" HBM3 at 3.35 TB/s; 700 W.
    # Capacity as the driver reports it: nvidia-smi shows 81,559 MiB = 79.65 GiB per H100 80GB
    # HBM3 (not 80 GiB).
    "h100-sxm": dict(name="h100-sxm",
                     peak_tflops=dict(bf16=989, fp16=989, fp8=1979, tf32=494, fp32=67),
                     hbm_gib=79.65, hbm_gbytes_per_s=3350, power_w=700, efficiency_curve="h100"),
    # H800: the H100 SXM compute die and 80 GB HBM3 with NVLink cut to 400 GB/s (DeepSeek-V3
    # report, sec. 3.1); capacity as the H100 80GB's.
    "h800": dict(name="h800", peak_tflops=dict(bf16=989, fp16=989, fp8=1979, tf32=494, fp32=67),
                 hbm_gib=79.65, hbm_gbytes_per_s=3350, power_w=700, efficiency_curve="h100"),
    # NVIDIA H200 datasheet: H100 compute, 141 GB HBM3e at 4.8 TB/s; 700 W. nvidia-smi shows
    # 143,771 MiB = 140.40 GiB.
    "h200": dict(name="h200", peak_tflops=dict(bf16=989, fp16=989, fp8=1979, tf32=494, fp32=67),
                 hbm_gib=140.4, hbm_gbytes_per_s=4800, power_w=700, efficiency_curve="h100"),
    # NVIDIA HGX B200 datasheet (per GPU): 2.25 PFLOP/s bf16 dense, 4.5 fp8 dense, 9 fp4 dense
    # (18 with sparsity); 180 GB HBM3e at 8 TB/s; 1,000 W. nvidia-smi shows 183,359 MiB =
    # 179.06 GiB.
    "b200": dict(name="b200", peak_tflops=dict(bf16=2250, fp16=2250, fp8=4500, fp4=9000,
                                               tf32=1100, fp32=75),
                 hbm_gib=179.06, hbm_gbytes_per_s=8000, power_w=1000, efficiency_curve="b200"),
    # Huawei Ascend 910B as publicly reported (Atlas 800T A2): about 320 TFLOP/s fp16/bf16,
    # 64 GB HBM2e at about 1.6 TB/s, 400 W. Vendor figures are not fully published; treat as
    # approximate and calibrate on your own cluster.
    "ascend-910b": dict(name="ascend-910b", peak_tflops=dict(bf16=320, fp16=320),
                        hbm_gib=64, hbm_gbytes_per_s=1600, power_w=400,
                        efficiency_curve="ascend-910b"),
    # This machine's CPU cores as "devices" for local runs over gloo. A placeholder: the runtime
    # replaces the peak with a quick matmul measurement and says so.
    "cpu": dict(name="cpu", peak_tflops=dict(fp32=0.1, bf16=0.1), hbm_gib=16,
                hbm_gbytes_per_s=20, efficiency_curve="cpu"),
}

# Per-device-family wiring (per device, per direction). Sources: NVIDIA DGX A100 / H100 / B200
# user guides (NVLink 3: 600 GB/s, NVLink 4: 900 GB/s, NVLink 5: 1.8 TB/s bidirectional;
# one 200 Gb/s HDR or 400 Gb/s NDR InfiniBand port per GPU); DeepSeek-V3 report for H800
# (NVLink 400 GB/s bidirectional, 160 GB/s achieved; 50 GB/s InfiniBand per GPU); Atlas 800T A2
# for Ascend (HCCS 392 GB/s, 8 x 200 GE RoCE). Efficiencies: typical nccl-tests all-reduce
# bus bandwidth over line rate on those systems.
_WIRING: dict[str, dict[str, Any]] = {
    "a100": dict(intra_node=dict(gbytes_per_s=300, latency_us=3, efficiency=0.78),
                 inter_node=dict(gbytes_per_s=25, latency_us=6, efficiency=0.9)),
    "h100": dict(intra_node=dict(gbytes_per_s=450, latency_us=3, efficiency=0.8),
                 inter_node=dict(gbytes_per_s=50, latency_us=6, efficiency=0.9)),
    "h800": dict(intra_node=dict(gbytes_per_s=200, latency_us=3, efficiency=0.8),
                 inter_node=dict(gbytes_per_s=50, latency_us=6, efficiency=0.9)),
    "b200": dict(intra_node=dict(gbytes_per_s=900, latency_us=3, efficiency=0.8),
                 inter_node=dict(gbytes_per_s=50, latency_us=6, efficiency=0.9)),
    "ascend-910b": dict(intra_node=dict(gbytes_per_s=196, latency_us=5, efficiency=0.75),
                        inter_node=dict(gbytes_per_s=25, latency_us=8, efficiency=0.85)),
    # Loopback TCP between local processes (gloo); rough, the runtime measures its own.
    "cpu": dict(intra_node=dict(gbytes_per_s=2, latency_us=50, efficiency=1.0),
                inter_node=dict(gbytes_per_s=1, latency_us=100, efficiency=1.0)),
}
_FAMILY = {"a100-40gb": "a100", "a100-80gb": "a100", "h100-sxm": "h100", "h800": "h800",
           "h200": "h100", "b200": "b200", "ascend-910b": "ascend-910b", "cpu": "cpu"}

# Nodes per "rack": one leaf-switch group of a rail-optimised fat tree (a DGX SuperPOD scalable
# unit is 20 A100 nodes or 32 H100 nodes). Crossing it adds spine hops: more latency, same
# bandwidth in a non-blocking fat tree.
_NODES_PER_RACK = {"a100": 20, "h100": 32, "h800": 32, "b200": 32, "ascend-910b": 16, "cpu": 1}

# Named clusters: a device and a count (the generic form is "<device>-x<devices>").
NAMED_CLUSTERS: dict[str, tuple[str, int]] = {
    # NVIDIA Selene as used by Narayanan et al. 2021 / Korthikanti et al. 2022 (A100 80GB, DGX).
    "selene": ("a100-80gb", 1024),
    "dgx-a100": ("a100-80gb", 8),
    "dgx-h100": ("h100-sxm", 8),
}
EXAMPLE_CLUSTERS = ["a100-80gb-x1024", "h100-sxm-x16384", "h800-x2048", "h200-x8", "b200-x512",
                    "ascend-910b-x1024"]


def device_preset(name: str) -> dict[str, Any]:
    """The named device as a dict (raises KeyError-free ValueError with the valid names)."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(DEVICES)}")
    return dict(DEVICES[name])


def build_cluster(device: str, num_devices: int, name: str | None = None) -> dict[str, Any]:
    """A cluster of ``num_devices`` devices in nodes of 8 (fewer: one partial node)."""
    family = _FAMILY[device]
    per_node = min(8, num_devices)
    if num_devices % per_node:
        from trainpilot.specs.errors import SpecError

        below, above = num_devices // per_node * per_node, -(-num_devices // per_node) * per_node
        raise SpecError("cluster", name or f"{device}-x{num_devices}",
                        f"{num_devices} devices is not a whole number of {per_node}-device "
                        f"nodes; valid: {device}-x{below} or {device}-x{above} (a plan may "
                        f"leave devices idle: plan.idle_devices)")
    nodes = num_devices // per_node
    wiring = _WIRING[family]
    inter_rack = dict(wiring["inter_node"], latency_us=wiring["inter_node"]["latency_us"] * 2)
    return dict(
        name=name or f"{device}-x{num_devices}",
        device=device_preset(device),
        devices_per_node=per_node,
        num_nodes=nodes,
        nodes_per_rack=min(nodes, _NODES_PER_RACK[family]),
        network=dict(wiring, inter_rack=inter_rack),
    )


_GENERIC = re.compile(r"^(?P<device>.+)-x(?P<count>[1-9][0-9]*)$")


def cluster_preset(name: str) -> dict[str, Any] | None:
    """A named cluster or "<device>-x<N>"; None when ``name`` is neither."""
    if name in NAMED_CLUSTERS:
        device, count = NAMED_CLUSTERS[name]
        return build_cluster(device, count, name=name)
    match = _GENERIC.match(name)
    if match and match["device"] in DEVICES:
        return build_cluster(match["device"], int(match["count"]))
    return None
