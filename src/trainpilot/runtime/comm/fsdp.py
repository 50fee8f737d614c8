"""FSDP2 gradient communication from a Plan's ``comm`` options.

FSDP2 (``fully_shard``, ``plan.zero >= 1``) reduce-scatters gradients instead of all-reducing
them, so DDP's communication hooks do not apply. What carries over, and how:

* ``compression`` fp16 / bf16: FSDP2's own ``MixedPrecisionPolicy(reduce_dtype=...)``
  (:func:`fsdp_mp_policy`), passed to ``fully_shard``: gradients are cast before the
  reduce-scatter and back to the parameter dtype after it. top-k and PowerSGD are refused
  (:func:`check_fsdp_comm`): a sparse or low-rank exchange does not compose with a
  reduce-scatter whose output is the shard a sharded optimizer steps on.
* ``hierarchical``: :class:`HierarchicalReduceScatter`, installed with
  ``FSDPModule.set_custom_reduce_scatter``: a reduce-scatter inside each node, then across
  nodes (and racks) among ranks of the same local rank, each stage built from
  ``all_to_all_single`` plus a local sum (:class:`~.hierarchical.StagedAllReduce`).
* otherwise FSDP2's own ``reduce_scatter_single``, wrapped only to be counted
  (:class:`CountedReduceScatter`): same call, same bits.

Both reduce-scatters record into a :class:`~.counters.CommCounters`, so the trainer and the
health monitor get the same per-step ``CommMetrics`` as with DDP. ``FSDPComm`` has the
``CommHook`` surface the trainer uses (``counters``, ``end_step``, ``close``, ``state_dict``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from trainpilot.runtime.comm.counters import CommCounters, CommMetrics, now_s
from trainpilot.runtime.comm.hierarchical import StagedAllReduce
from trainpilot.runtime.comm.topology import HierarchyGroups, Subgroup, build_groups, make_subgroup
from trainpilot.specs.cluster import ClusterSpec
from trainpilot.specs.errors import SpecError
from trainpilot.specs.plan import CommOptions

FSDP_COMPRESSIONS = ("none", "fp16", "bf16")
FSDP_COMPRESSION_REFUSAL = ("topk and powersgd need zero=0 (DDP); FSDP2 (zero>=1) supports "
                            "none, fp16, bf16")
_REDUCE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_fsdp_comm(comm: CommOptions) -> None:
    """Raise SpecError for ``comm`` options FSDP2 cannot honour (top-k, PowerSGD)."""
    if comm.compression not in FSDP_COMPRESSIONS:
        raise SpecError("plan.comm.compression", comm.compression, FSDP_COMPRESSION_REFUSAL)


def fsdp_mp_policy(comm: CommOptions) -> MixedPrecisionPolicy:
    """``fully_shard``'s mixed-precision policy for ``comm``: ``reduce_dtype`` fp16/bf16 when
    compression asks for it, parameters left in their own dtype (``param_dtype=None``)."""
    check_fsdp_comm(comm)
    return MixedPrecisionPolicy(reduce_dtype=_REDUCE_DTYPES.get(comm.compression))


def fsdp_modules(module: torch.nn.Module) -> list[FSDPModule]:
    """Every module ``fully_shard`` was applied to under ``module`` (itself included)."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class _Counted(ReduceScatter):
    """Plain allocation (``torch.empty``) and the group check shared by both reduce-scatters."""

    def __init__(self, *, ranks: tuple[int, ...], counters: CommCounters):
        self.ranks = ranks
        self.counters = counters
        self.num_calls = 0
        self._checked: set[int] = set()

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _check_group(self, group: dist.ProcessGroup) -> None:
        # The subgroups were built for one FSDP group; a module sharded over another mesh
        # must not silently reduce over the wrong ranks.
        if id(group) not in self._checked:
            ranks = tuple(dist.get_process_group_ranks(group))
            if ranks != self.ranks:
                raise RuntimeError(f"{type(self).__name__} was built for ranks {self.ranks}, "
                                   f"FSDP reduce-scatters over {ranks}")
            self._checked.add(id(group))


class CountedReduceScatter(_Counted):
    """FSDP2's default reduce-scatter (``dist.reduce_scatter_single`` with FSDP's op), counted.

    Wire bytes: gloo implements reduce-scatter as a full all-reduce (measured with
    ``/proc/self/io``: 1.50 x the input on 4 ranks, the ring all-reduce's 2 (g-1)/g), so on gloo
    it is counted as one; elsewhere as a ring reduce-scatter, (g-1)/g, the all-to-all's figure.
    """

    def __init__(self, *, flat: Subgroup, counters: CommCounters):
        super().__init__(ranks=flat.ranks, counters=counters)
        self.flat = flat
        self._model_op = "all_reduce" if dist.get_backend(flat.group) == "gloo" else "all_to_all"

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False):
        self._check_group(group)
        self.num_calls += 1
        start, nbytes = now_s(), input_tensor.numel() * input_tensor.element_size()
        self.counters.add_collective(self._model_op, nbytes, self.flat)
        # The call FSDP2's DefaultReduceScatter makes, so the result is bit-identical.
        work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, op=op,
                                          group=group, async_op=async_op)
        # FSDP2 calls synchronously; an async caller's wait is not ours to time.
        self.counters.add_bucket(nbytes, start, start if async_op else now_s())
        return work


class HierarchicalReduceScatter(_Counted):
    """Reduce-scatter over the cluster's levels (node, then nodes of a rack, then racks).

    FSDP's input is ``world`` equal chunks, chunk ``r`` for group rank ``r``. The chunks are
    reordered so that row ``local * N * R + node * R + rack`` is the chunk of the rank at those
    coordinates; then each level reduce-scatters the rows among its subgroup (all-to-all plus a
    sum in group-rank order), innermost first. After the local level, local rank ``j`` holds the
    node's sum of the chunks of every rank with local rank ``j``; after the last, each rank holds
    its own chunk summed over every rank. Ops: SUM (FSDP with ``force_sum_reduction_for_comms``,
    which :meth:`FSDPComm.register` sets: FSDP divides before/after) and AVG.
    """

    def __init__(self, *, groups: HierarchyGroups, counters: CommCounters):
        super().__init__(ranks=groups.layout.ranks, counters=counters)
        self.staged = StagedAllReduce(scatter=groups.levels, top=None, counters=counters)
        n_local, n_node, n_rack = groups.layout.sizes
        rows = [local * n_node * n_rack + node * n_rack + rack
                for local, node, rack in groups.layout.coords]
        # order[row] = the group rank whose chunk goes to that row.
        self.order = torch.tensor(sorted(range(len(rows)), key=rows.__getitem__))

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False):
        self._check_group(group)
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"HierarchicalReduceScatter supports SUM and AVG, got {op}; "
                             "call FSDPModule.set_force_sum_reduction_for_comms(True)")
        self.num_calls += 1
        start = now_s()
        world = len(self.ranks)
        rows = input_tensor.view(world, -1).index_select(0, self.order).reshape(-1)
        mine, _ = self.staged.reduce_scatter(rows)
        if op == dist.ReduceOp.AVG:
            mine = mine.div_(world)
        output_tensor.copy_(mine)
        self.counters.add_bucket(input_tensor.numel() * input_tensor.element_size(), start,
                                 now_s())
        return None  # done: FSDP only waits on a returned Work


class FSDPComm:
    """The FSDP2 side of ``plan.comm`` on one process group: build on every rank of it (the
    hierarchical subgroups are created here), then ``register`` on the ``fully_shard``-ed model.

    ``hierarchical`` needs ``cluster`` (SpecError otherwise, as for DDP); on a single node it is
    one all-to-all reduce-scatter inside the node.
    """

    def __init__(self, comm: CommOptions, *, cluster: ClusterSpec | None = None,
                 process_group: dist.ProcessGroup | None = None):
        check_fsdp_comm(comm)
        if comm.hierarchical and cluster is None:
            raise SpecError("plan.comm.hierarchical", True, "needs a cluster to place ranks on")
        self.comm = comm
        group = process_group or dist.group.WORLD
        if group is None:
            raise RuntimeError("FSDPComm needs a process group: call init_process_group first")
        self.group = group
        self.counters = CommCounters()
        ranks = tuple(dist.get_process_group_ranks(self.group))
        if comm.hierarchical:
            assert cluster is not None  # refused above
            self.reduce_scatter: _Counted = HierarchicalReduceScatter(
                groups=build_groups(cluster, self.group), counters=self.counters)
        else:
            flat = make_subgroup("flat", ranks, cluster, group=self.group)
            self.reduce_scatter = CountedReduceScatter(flat=flat, counters=self.counters)

    def register(self, module: torch.nn.Module) -> FSDPComm:
        """Install the reduce-scatter on every FSDP module under ``module``; returns self."""
        modules = fsdp_modules(module)
        if not modules:
            raise ValueError("no fully_shard-ed module to register on")
        for m in modules:
            m.set_custom_reduce_scatter(self.reduce_scatter)
            if self.comm.hierarchical:
                m.set_force_sum_reduction_for_comms(True)  # SUM on the wire, FSDP divides
        return self

    def end_step(self) -> CommMetrics:
        """Close this step's counters (after backward: FSDP2 reduced every gradient)."""
        return self.counters.end_step()

    def close(self) -> None:
        """Nothing runs in the background (the reduce-scatter is synchronous)."""

    def state_dict(self) -> dict:
        return {}  # stateless: no residuals to save

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise SpecError("comm_state", sorted(state),
                            "FSDP2 communication keeps no state; valid: empty")


def make_fsdp_comm(comm: CommOptions, cluster: ClusterSpec | None = None,
                   process_group: dist.ProcessGroup | None = None) -> FSDPComm:
    """``FSDPComm(comm, ...)``; collective over ``process_group`` (default: the world)."""
    return FSDPComm(comm, cluster=cluster, process_group=process_group)
