"""Calibrate the ``cpu`` device entry from this machine, and predict a plan's step time.

The ``cpu`` preset's peak and link figures are placeholders. Before a CPU run each rank times a
1024^3 fp32 matmul (all ranks at once, as they will run during training, sharing the memory
system) and the ranks time gloo all-reduces of 8 B (latency) and 4 MiB (bus bandwidth,
2(n-1)/n x bytes / time). The measured figures replace the preset's in a ClusterSpec that the
cost model (``trainpilot.perf.predict``) turns into a predicted step time.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainpilot.specs import ClusterSpec, ModelSpec, Plan
from trainpilot.specs.loading import load_cluster


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Measured on this machine: matmul FLOP/s per rank, all-reduce latency and bus bandwidth."""

    matmul_tflops: float
    matmul_dtype: str
    allreduce_latency_us: float | None  # None with one process
    allreduce_busbw_gbps: float | None  # GB/s (1e9 bytes/s) of bus bandwidth

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_matmul_tflops(*, size: int = 1024, repeats: int = 3, dtype: torch.dtype = torch.float32,
                          device: torch.device = torch.device("cpu")) -> float:
    """Best-of-``repeats`` TFLOP/s of a ``size``^3 matmul (2 * size^3 FLOPs)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up: first call allocates and picks kernels
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best / 1e12


def measure_allreduce(group=None, *, small_bytes: int = 8, large_bytes: int = 4 << 20,
                      repeats: int = 5, device: torch.device = torch.device("cpu"),
                      ) -> tuple[float, float]:
    """(latency in s of a ``small_bytes`` all-reduce, bus bandwidth in bytes/s at
    ``large_bytes``), medians over ``repeats``, identical on every rank (max over ranks)."""
    world = dist.get_world_size(group)

    def timed(num_bytes: int) -> float:
        t = torch.ones(max(1, num_bytes // 4), device=device)
        dist.all_reduce(t, group=group)  # warm-up (connection set-up)
        times = []
        for _ in range(repeats):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(t, group=group)
            times.append(time.perf_counter() - start)
        times.sort()
        result = torch.tensor([times[len(times) // 2]], dtype=torch.float64, device=device)
        dist.all_reduce(result, op=dist.ReduceOp.MAX, group=group)
        return float(result)

    latency = timed(small_bytes)
    large = timed(large_bytes)
    busbw = 2 * (world - 1) / world * large_bytes / large
    return latency, busbw


def calibrate(*, device: torch.device, dtype: torch.dtype = torch.float32) -> Calibration:
    """Measure this machine; with a process group, all ranks take part (call on every rank)."""
    flops = measure_matmul_tflops(device=device, dtype=dtype)
    latency = busbw = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor([flops], dtype=torch.float64, device=device)
        dist.all_reduce(value)
        flops = float(value) / dist.get_world_size()
        lat_s, bw = measure_allreduce(device=device)
        latency, busbw = lat_s * 1e6, bw / 1e9
    return Calibration(matmul_tflops=flops, matmul_dtype=str(dtype).replace("torch.", ""),
                       allreduce_latency_us=latency, allreduce_busbw_gbps=busbw)


def calibrated_cpu_cluster(num_devices: int, cal: Calibration) -> ClusterSpec:
    """The ``cpu-x<N>`` preset with its peak and intra-node link replaced by measurements."""
    base = load_cluster(f"cpu-x{num_devices}")
    peak = dict(base.device.peak_tflops)
    for key in ("fp32", "bf16") if cal.matmul_dtype == "float32" else ("bf16",):
        peak[key] = cal.matmul_tflops
    device = base.device.replace(peak_tflops=peak)
    network = base.network
    if cal.allreduce_busbw_gbps is not None and cal.allreduce_latency_us is not None:
        # The cost model charges gloo's ring all-reduce 2 (n - 1) hops of the link latency, so
        # the measured time of a tiny all-reduce is spread over those hops.
        hops = 2 * max(1, num_devices - 1)
        link = network.intra_node.replace(gbytes_per_s=cal.allreduce_busbw_gbps,
                                          latency_us=cal.allreduce_latency_us / hops,
                                          efficiency=1.0)
        network = network.replace(intra_node=link)
    return base.replace(name=f"cpu-x{num_devices}-calibrated", device=device, network=network)


def predict_step_time_s(model: ModelSpec, cluster: ClusterSpec, plan: Plan,
                        ) -> tuple[float | None, str]:
    """(predicted seconds per optimizer step, note). None with the reason when the cost model
    is not installed or declines the case."""
    try:
        from trainpilot.perf import predict  # type: ignore[attr-defined]
    except ImportError:
        return None, "cost model (trainpilot.perf.predict) not available"
    try:
        step_time_s = predict(model, cluster, plan).step_time_s
        return float(step_time_s), f"trainpilot.perf on {cluster.name}"
    except ValueError as err:  # SpecError included: the model refuses this case
        return None, f"cost model declined: {err}"
