"""Does the plan fit in memory? Asked before any process starts, from the cost model.

The cost model's per-rank peak (weights, gradients, optimizer state, activations of the
micro-batches in flight, workspace: ``trainpilot.perf``) is compared with what each rank of
this node can have: the accelerator's memory, or on a CPU the host memory available to this
process tree (``MemAvailable``, or the cgroup's limit when lower) shared by the node's ranks,
each of which also carries the interpreter and torch (measured here as this launcher's own
resident size, which has imported the same). A plan that does not fit is refused with both
figures; ``--skip-memory-check`` launches it anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    predicted_gib: float  # per rank
    capacity_gib: float  # per rank
    where: str  # what the capacity is
    parts: dict[str, float]  # the prediction's terms, GiB
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.predicted_gib <= self.capacity_gib


def host_available_bytes() -> int | None:
    """Memory this process tree may still use: ``MemAvailable``, capped by the cgroup."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit = _cgroup_room()
    if limit is not None:
        avail = limit if avail is None else min(avail, limit)
    return avail


def _cgroup_room() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, then v1); None if unlimited."""
    candidates = [("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current")]
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                candidates.insert(0, (f"/sys/fs/cgroup{path}/memory.max",
                                      f"/sys/fs/cgroup{path}/memory.current"))
            elif "memory" in controllers.split(","):
                base = f"/sys/fs/cgroup/memory{path}"
                candidates.insert(0, (f"{base}/memory.limit_in_bytes",
                                      f"{base}/memory.usage_in_bytes"))
    except (OSError, ValueError):
        pass
    for limit_file, usage_file in candidates:
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                continue
            usage = int(Path(usage_file).read_text().strip())
            return max(0, int(raw) - usage)
        except (OSError, ValueError):
            continue
    return None


def own_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_memory(model: ModelSpec, plan: Plan, *, cluster: ClusterSpec | None,
                 ranks_on_node: int, device_type: str = "cpu") -> MemoryFit | None:
    """The fit of ``plan`` on this node, or None when the cost model cannot price it."""
    from trainpilot.perf.predict import predict
    from trainpilot.specs import load_cluster

    priced = cluster if cluster is not None else load_cluster(f"cpu-x{plan.world_size}")
    try:
        pred = predict(model, priced, plan)
    except ValueError:  # SpecError included: the cost model does not price this case
        return None
    mem = pred.memory_gib
    peak = float(mem["peak"])
    stage = mem.get("per_stage", [{}])[mem.get("peak_stage", 0)] if mem.get("per_stage") else {}
    parts = {k: float(v) for k, v in stage.items() if isinstance(v, (int, float))}
    if device_type == "cpu" and (cluster is None or cluster.device.name.startswith("cpu")):
        avail = host_available_bytes()
        if avail is None:
            return None
        base = own_rss_bytes() / GIB
        return MemoryFit(predicted_gib=peak + base, parts=dict(parts, process=base),
                         capacity_gib=avail / GIB / max(1, ranks_on_node),
                         where=f"host memory available ({avail / GIB:.1f} GiB) shared by "
                               f"{ranks_on_node} rank(s) of this node")
    if cluster is not None:
        return MemoryFit(predicted_gib=peak, parts=parts, capacity_gib=cluster.device.hbm_gib,
                         where=f"{cluster.device.name} memory")
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / GIB
    return MemoryFit(predicted_gib=peak, parts=parts, capacity_gib=total,
                     where=f"{torch.cuda.get_device_name(0)} memory")


def require_fit(fit: MemoryFit | None) -> None:
    """SpecError (exit 2) when ``fit`` says the plan does not fit."""
    if fit is None or fit.fits:
        return
    terms = ", ".join(f"{k} {v:.1f}" for k, v in fit.parts.items() if v >= 0.05 and k != "total")
    raise SpecError("plan", f"{fit.predicted_gib:.1f} GiB per rank", (
        f"the cost model predicts a peak of {fit.predicted_gib:.1f} GiB per rank ({terms}); "
        f"{fit.where} gives {fit.capacity_gib:.1f} GiB per rank; valid: a plan that fits "
        "(more ranks, zero=3, recompute, a smaller micro_batch_size), or --skip-memory-check"))
