"""Gradient communication for DDP: hierarchical all-reduce over the cluster's nodes and racks,
compression hooks (top-k with error feedback; PyTorch's fp16/bf16 and PowerSGD, wrapped),
fusion and overlap settings from the Plan, and counters for the health monitor. For FSDP2
(``zero >= 1``, :mod:`.fsdp`): a hierarchical reduce-scatter installed with
``set_custom_reduce_scatter``, fp16/bf16 as FSDP2's ``reduce_dtype``, the same counters; top-k
and PowerSGD are refused there (``check_runtime``).

Typical use inside a training loop::

    hook = make_comm_hook(plan.comm, cluster)          # every rank
    ddp = DistributedDataParallel(model, **ddp_kwargs(plan.comm, model))
    hook.register(ddp)
    ...
    loss.backward(); optimizer.step(); metrics = hook.end_step()
    checkpoint["comm"] = hook.state_dict()             # per rank: residuals differ

With FSDP2::

    fully_shard(block, mesh=mesh, mp_policy=fsdp_mp_policy(plan.comm))   # blocks, then root
    comm = make_fsdp_comm(plan.comm, cluster, dp_group).register(model)   # every rank
    ...
    loss.backward(); optimizer.step(); metrics = comm.end_step()
"""

from trainpilot.runtime.comm.counters import CommCounters, CommMetrics, wire_bytes
from trainpilot.runtime.comm.fsdp import (
    FSDPComm,
    HierarchicalReduceScatter,
    check_fsdp_comm,
    fsdp_mp_policy,
    make_fsdp_comm,
)
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
    "CommCounters", "CommHook", "CommMetrics", "ErrorFeedback", "FSDPComm",
    "HierarchicalReduceScatter", "HierarchyGroups", "RankLayout", "StagedAllReduce", "TopKCodec",
    "build_groups", "check_fsdp_comm", "ddp_kwargs", "fsdp_mp_policy", "hierarchical_all_reduce",
    "hierarchy_partitions", "make_comm_hook", "make_fsdp_comm", "rank_layout", "wire_bytes",
]
