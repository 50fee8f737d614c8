"""Gradient communication for DDP: hierarchical all-reduce over the cluster's nodes and racks,
compression hooks (top-k with error feedback; PyTorch's fp16/bf16 and PowerSGD, wrapped),
fusion and overlap settings from the Plan, and counters for the health monitor.

Typical use inside a training loop::

    hook = make_comm_hook(plan.comm, cluster)          # every rank
    ddp = DistributedDataParallel(model, **ddp_kwargs(plan.comm, model))
    hook.register(ddp)
    ...
    loss.backward(); optimizer.step(); metrics = hook.end_step()
    checkpoint["comm"] = hook.state_dict()             # per rank: residuals differ
"""

from trainpilot.runtime.comm.counters import CommCounters, CommMetrics, wire_bytes
from trainpilot.runtime.comm.hierarchical import StagedAllReduce, hierarchical_all_reduce
from trainpilot.runtime.comm.hooks import CommHook, ddp_kwargs, make_comm_hook
from trainpilot.runtime.comm.topk import ErrorFeedback, TopKCodec
from trainpilot.runtime.comm.topology import (
    HierarchyGroups,
    RankLayout,
    build_groups,
    hierarchy_partitions,
    rank_layout,
)

__all__ = [
    "CommCounters", "CommHook", "CommMetrics", "ErrorFeedback", "HierarchyGroups", "RankLayout",
    "StagedAllReduce", "TopKCodec", "build_groups", "ddp_kwargs", "hierarchical_all_reduce",
    "hierarchy_partitions", "make_comm_hook", "rank_layout", "wire_bytes",
]
