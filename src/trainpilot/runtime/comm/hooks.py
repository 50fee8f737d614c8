"""The DDP communication hook a Plan asks for: ``make_comm_hook(plan.comm, cluster, group)``.

One ``CommHook`` object is the hook's state; ``hook.register(ddp)`` installs it. It combines

* the reduction: flat, or hierarchical over the cluster's nodes and racks (``topology``),
* the compression: none, fp16/bf16 and PowerSGD (PyTorch's hooks, wrapped), or top-k with error
  feedback; with ``hierarchical`` only the inter-node stage is compressed,
* overlap: with ``overlap=False`` no bucket is launched before the backward pass has produced
  every gradient (the last bucket), so communication cannot hide behind computation,
* counters (``hook.counters``): bytes and communication time per step, for the health monitor.

Staged reductions run on one communication thread per hook: gloo runs ``.then()`` callbacks on
its own two worker threads, and a collective issued there can deadlock (PyTorch's PowerSGD does,
with several buckets). The thread issues the stages in bucket order, which DDP keeps the same on
every rank, on subgroups only this hook uses.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainpilot.runtime.comm.counters import CommCounters, now_s
from trainpilot.runtime.comm.hierarchical import PieceLayout, StagedAllReduce
from trainpilot.runtime.comm.topk import ErrorFeedback, TopKCodec
from trainpilot.runtime.comm.topology import (
    HierarchyGroups,
    Subgroup,
    build_groups,
    make_subgroup,
)
from trainpilot.runtime.comm.torch_hooks import PowerSGD, cast_hook
from trainpilot.specs.cluster import ClusterSpec
from trainpilot.specs.errors import SpecError
from trainpilot.specs.plan import CommOptions

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel


def trainpilot_comm_hook(state: CommHook, bucket):
    """The function DDP calls per bucket; all logic lives in ``CommHook``. (Its name matters:
    DDP refuses functions named like PyTorch's bf16 hook on gloo.)"""
    return state.on_bucket(bucket)


class _CommThread:
    """One daemon thread running submitted reductions in order; results arrive as futures."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="trainpilot-comm", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], torch.Tensor]) -> torch.futures.Future:
        import torch

        future: torch.futures.Future = torch.futures.Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, future = item
            try:
                future.set_result(job())
            except BaseException as err:  # noqa: BLE001 - handed to DDP, which re-raises
                future.set_exception(err)

    def close(self) -> None:
        self._jobs.put(None)


class CommHook:
    """State of the DDP communication hook for one ``CommOptions``; see the module docstring."""

    def __init__(self, comm: CommOptions, *, cluster: ClusterSpec | None = None,
                 process_group: dist.ProcessGroup | None = None, seed: int = 0):
        import torch.distributed as dist

        if comm.hierarchical and cluster is None:
            raise SpecError("plan.comm.hierarchical", True, "needs a cluster to place ranks on")
        if comm.hierarchical and comm.compression == "powersgd":
            raise SpecError("plan.comm.compression", "powersgd",
                            "PowerSGD does not compose with hierarchical=true; valid there: "
                            "none, fp16, bf16, topk")
        self.comm = comm
        group = process_group or dist.group.WORLD
        if group is None:
            raise RuntimeError("CommHook needs a process group: call init_process_group first")
        self.group = group
        self.world_size = dist.get_world_size(self.group)
        # Describes the whole group for the counters of PyTorch's hooks, which run on it.
        self.flat = make_subgroup("flat", tuple(dist.get_process_group_ranks(self.group)),
                                  cluster, group=self.group)
        self.counters = CommCounters()
        self.codec = TopKCodec(density=comm.topk_density) if comm.compression == "topk" else None
        self.error_feedback = (ErrorFeedback(density=comm.topk_density)
                               if self.codec and comm.error_feedback else None)
        self.powersgd = (PowerSGD(group=self.group, rank=comm.powersgd_rank, seed=seed,
                                  error_feedback=comm.error_feedback)
                         if comm.compression == "powersgd" else None)
        self.staged = self._build_staged(cluster)
        self._thread = _CommThread() if self.staged is not None else None
        self._names: dict[int, str] = {}
        self._deferred: list[tuple[Any, torch.futures.Future]] = []

    def _build_staged(self, cluster: ClusterSpec | None) -> StagedAllReduce | None:
        """The staged reducer, for the paths that run on the communication thread."""
        if self.comm.hierarchical:
            assert cluster is not None  # refused by __init__
            groups: HierarchyGroups = build_groups(cluster, self.group)
            return StagedAllReduce.from_groups(groups, compress_top=self.comm.compression != "none",
                                               counters=self.counters)
        if self.codec is None:
            return None  # flat none/fp16/bf16/powersgd: PyTorch's hooks, from the hook body
        # Its own group: this thread's collectives must not interleave with the caller's.
        flat = make_subgroup("flat", self.flat.ranks, cluster)
        return StagedAllReduce(scatter=(), top=flat, counters=self.counters)

    # -- wiring ---------------------------------------------------------------------------

    def register(self, ddp: DistributedDataParallel) -> CommHook:
        """Install on ``ddp`` (call before the first backward); returns self."""
        module = ddp.module
        self._names = {id(p): name for name, p in module.named_parameters()}
        if self.powersgd is not None and self.powersgd.on_gloo:
            grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters()
                             if p.requires_grad)
            if ddp.bucket_bytes_cap < grad_bytes:
                raise SpecError(
                    "plan.comm.bucket_mb", ddp.bucket_bytes_cap / 2**20,
                    f"PowerSGD on gloo needs one bucket; valid: >= {grad_bytes / 2**20:.2f} MiB "
                    "(the model's gradients), e.g. via trainpilot.runtime.comm.ddp_kwargs")
        ddp.register_comm_hook(self, trainpilot_comm_hook)
        return self

    def end_step(self):
        """Close this step's counters and return its ``CommMetrics`` (call after backward: DDP
        has waited for every bucket). Without this call a step closes when the next begins."""
        return self.counters.end_step()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()

    # -- per bucket -------------------------------------------------------------------------

    def on_bucket(self, bucket) -> torch.futures.Future:
        if bucket.index() == 0 and self.counters.has_open_buckets():
            # A new backward began and nobody closed the last step: close it here, so the
            # counters stay per step in loops that never call end_step().
            self.counters.end_step()
        if self.comm.overlap:
            return self._launch(bucket)
        import torch

        if not bucket.is_last():  # DDP hands buckets over in index order; the last comes last
            future: torch.futures.Future = torch.futures.Future()
            self._deferred.append((bucket, future))
            return future
        pending, self._deferred = self._deferred, []
        for held, future in pending:
            self._launch(held).add_done_callback(functools.partial(_forward, out=future))
        return self._launch(bucket)

    def _launch(self, bucket) -> torch.futures.Future:
        compression = self.comm.compression
        if self.staged is None:
            if compression in ("fp16", "bf16"):
                return cast_hook(compression, self.flat, bucket, self.counters)
            if self.powersgd is not None:  # compression == "powersgd"
                return self.powersgd(bucket, self.flat, self.counters)
            return self._flat_all_reduce(bucket)
        names, numels = self._bucket_params(bucket)
        buffer = bucket.buffer()
        start = now_s()
        assert self._thread is not None  # started with the staged reducer
        return self._thread.submit(lambda: self._reduce(buffer, names, numels, start))

    def _flat_all_reduce(self, bucket) -> torch.futures.Future:
        """DDP's own arithmetic (divide, then sum), counted."""
        import torch.distributed as dist

        buffer, start = bucket.buffer(), now_s()
        buffer.div_(self.world_size)
        self.counters.add_collective("all_reduce", buffer.numel() * buffer.element_size(),
                                     self.flat)
        work = dist.all_reduce(buffer, group=self.group, async_op=True)

        def done(fut):
            self.counters.add_bucket(buffer.numel() * buffer.element_size(), start, now_s())
            return fut.value()[0]

        return work.get_future().then(done)

    def _bucket_params(self, bucket) -> tuple[list[str], list[int]]:
        params = bucket.parameters()
        names = [self._names.get(id(p), "") for p in params]
        if "" in names:
            raise RuntimeError("CommHook.register(ddp) was not called before backward")
        return names, [p.numel() for p in params]

    def _reduce(self, buffer: torch.Tensor, names: list[str], numels: list[int],
                start: float) -> torch.Tensor:
        """On the communication thread: the staged reduction of one bucket, averaged."""
        import torch

        compression, n = self.comm.compression, buffer.numel()
        staged = self.staged
        assert staged is not None  # only the staged path submits to the thread
        if compression in ("fp16", "bf16"):
            dtype = torch.float16 if compression == "fp16" else torch.bfloat16
            # Divide first, as PyTorch's hook does, so the half-precision sum cannot overflow.
            total = staged(buffer / self.world_size, self._cast_stage(dtype))
        elif compression == "topk":
            total = self._topk_reduce(buffer, names, numels).div_(self.world_size)
        else:
            total = staged(buffer).div_(self.world_size)
        self.counters.add_bucket(n * buffer.element_size(), start, now_s())
        return total

    def _cast_stage(self, dtype: torch.dtype):
        import torch.distributed as dist

        def stage(chunk: torch.Tensor, sub: Subgroup, piece: int, layout) -> torch.Tensor:
            low = chunk.to(dtype)
            self.counters.add_collective("all_reduce", low.numel() * low.element_size(), sub)
            dist.all_reduce(low, group=sub.group)
            return low.to(chunk.dtype)

        return stage

    def _topk_reduce(self, buffer: torch.Tensor, names: list[str], numels: list[int],
                     ) -> torch.Tensor:
        """Sum of every rank's top-k selection of (gradient + residual) over the top stage.

        Selection is per parameter piece, so neither bucketing nor DDP's bucket rebuild changes
        the result. The residual keeps what this rank's row did not send, filed per parameter.
        """
        import torch
        import torch.distributed as dist

        ef, codec, staged = self.error_feedback, self.codec, self.staged
        assert codec is not None and staged is not None  # compression == "topk" built both
        x = buffer + ef.gather(names, numels, buffer.dtype) if ef else buffer
        layout = staged.layout(tuple(numels))
        residual_rows = torch.zeros(layout.num_pieces, layout.row, dtype=buffer.dtype)

        def stage(row: torch.Tensor, sub: Subgroup, piece: int, layout) -> torch.Tensor:
            kept = residual_rows[piece] if ef is not None else None
            if self._scatters(sub):
                return self._topk_scatter(row, sub, layout, kept)
            message, index = codec.encode(row, layout.widths)
            if kept is not None:
                kept.copy_(row)
                kept[index] = 0
            gathered = torch.empty(message.numel() * sub.size, dtype=torch.uint8)
            self.counters.add_collective("all_gather", message.numel(), sub)
            dist.all_gather_single(gathered, message, group=sub.group)
            return codec.decode_sum(gathered.view(sub.size, -1), layout.widths, row.dtype)

        total = staged(x, stage, segments=tuple(numels))
        if ef is not None:
            ef.store(names, numels, layout.unpermute(residual_rows.reshape(-1)))
        return total

    def _scatters(self, sub: Subgroup) -> bool:
        """Whether the top-k stage over ``sub`` is a sparse reduce-scatter (see CommOptions)."""
        exchange = self.comm.topk_exchange
        return exchange == "scatter" or (exchange == "auto" and sub.size > 2)

    def _topk_scatter(self, row: torch.Tensor, sub: Subgroup, layout: PieceLayout,
                      kept: torch.Tensor | None) -> torch.Tensor:
        """Sum ``row`` over ``sub`` by a sparse reduce-scatter and a sparse all-gather.

        The row is cut into ``sub.size`` chunks, per parameter piece (``PieceLayout`` again, so
        bucketing still changes nothing). Each rank sends its top-k of chunk ``j`` to member
        ``j`` (its own chunk stays dense: it never leaves the process), the owner sums what it
        received, selects the top-k of that sum and all-gathers it. One rank's wire bytes:
        2 (g-1)/g messages of one chunk each way round, against (g-1) whole-row messages for
        the plain all-gather. ``kept`` (error feedback) receives what this rank did not send:
        the unsent part of every other chunk, and of its own chunk the part of the sum it did
        not broadcast. Each owner's unsent sum thus re-enters through its own next gradient,
        so sent + residuals = the true gradients' sum still holds, with one residual per rank.
        """
        import torch
        import torch.distributed as dist

        codec = self.codec
        assert codec is not None
        g, me = sub.size, dist.get_rank(sub.group)
        chunks = PieceLayout(segments=layout.widths, num_pieces=g)
        cut = chunks.permute(row).view(g, chunks.row)
        size = codec.message_bytes(chunks.widths, row.element_size())
        outgoing = torch.zeros(g, size, dtype=torch.uint8)
        unsent = cut.clone() if kept is not None else None
        for j in range(g):
            if j != me:
                outgoing[j], index = codec.encode(cut[j], chunks.widths)
                if unsent is not None:
                    unsent[j, index] = 0
        incoming = torch.empty_like(outgoing)
        self.counters.add_collective("all_to_all", outgoing.numel(), sub)
        dist.all_to_all_single(incoming, outgoing, group=sub.group)
        others = torch.cat([incoming[:me], incoming[me + 1:]])
        # The others' entries in group-rank order, then this rank's own: a fixed order.
        summed = codec.decode_sum(others, chunks.widths, row.dtype).add_(cut[me])
        message, index = codec.encode(summed, chunks.widths)
        if unsent is not None and kept is not None:
            unsent[me] = summed
            unsent[me, index] = 0
            kept.copy_(chunks.unpermute(unsent.reshape(-1)))
        gathered = torch.empty(g, size, dtype=torch.uint8)
        self.counters.add_collective("all_gather", size, sub)
        dist.all_gather_single(gathered.view(-1), message, group=sub.group)
        dense = torch.stack([codec.decode_sum(gathered[i: i + 1], chunks.widths, row.dtype)
                             for i in range(g)])
        return chunks.unpermute(dense.reshape(-1))

    # -- checkpointing ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's compression state (top-k residuals or PowerSGD memories; empty for the
        stateless paths). Ranks differ: save one per rank."""
        if self.error_feedback is not None:
            return {"topk": self.error_feedback.state_dict()}
        if self.powersgd is not None:
            return {"powersgd": self.powersgd.state_dict()}
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "topk" in state and self.error_feedback is not None:
            self.error_feedback.load_state_dict(state["topk"])
        elif "powersgd" in state and self.powersgd is not None:
            self.powersgd.load_state_dict(state["powersgd"])
        elif state:
            raise SpecError("comm_state", sorted(state),
                            f"does not match compression={self.comm.compression!r} "
                            f"(error_feedback={self.comm.error_feedback})")


def _forward(done: torch.futures.Future, out: torch.futures.Future) -> None:
    """Complete ``out`` with ``done``'s result or error (a deferred bucket must never hang)."""
    try:
        out.set_result(done.value())
    except BaseException as err:  # noqa: BLE001 - DDP re-raises it from backward
        out.set_exception(err)


def make_comm_hook(comm: CommOptions, cluster: ClusterSpec | None = None,
                   process_group: dist.ProcessGroup | None = None, *, seed: int = 0) -> CommHook:
    """The hook for ``comm`` (a Plan's ``comm``) on ``process_group`` (default: the world).

    Collective: every rank of the group calls it (hierarchical subgroups are created here).
    Install with ``make_comm_hook(...).register(ddp)``; build the DDP with ``ddp_kwargs``.
    """
    return CommHook(comm, cluster=cluster, process_group=process_group, seed=seed)


def ddp_kwargs(comm: CommOptions, model: torch.nn.Module, *, backend: str = "gloo",
               ) -> dict[str, Any]:
    """Keyword arguments for ``DistributedDataParallel`` from ``comm``: the fusion threshold
    ``bucket_cap_mb`` (MiB), enlarged to hold every gradient for PowerSGD on gloo."""
    bucket_mb = comm.ddp_bucket_mb
    if comm.compression == "powersgd" and backend == "gloo":
        grad_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        bucket_mb = max(bucket_mb, grad_mib * 1.01 + 1)
    return {"bucket_cap_mb": bucket_mb}
