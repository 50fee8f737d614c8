"""Data-parallel traffic of one pipeline stage, as the executing stack issues it, and how much
of it is exposed.

Gradients travel at ``grad_bytes`` per element (``runtime.grad_bytes``: fp32 by default for
bf16 runs, 16-bit with ``comm.compression``), parameters are gathered in 16-bit. Dense
parameters reduce over the dp x cp group, expert parameters over the expert-data-parallel group.

When gradients are reduced (``runtime.grad_sync``):

* ``step`` (Megatron's distributed optimizer and DDP with overlap, PyTorch DDP ``no_sync`` and
  FSDP2's ``set_requires_gradient_sync``, trainpilot's runtime): gradients accumulate unsharded
  over the micro-batches and are reduced once, during the last micro-batch's backward. ZeRO-2
  then moves the same bytes as ZeRO-1 (and holds the same gradient memory while accumulating);
* ``micro_batch`` (DeepSpeed ZeRO-2, FSDP without no_sync, Megatron-Core's FSDP at ZeRO-2/3
  whatever no_sync says: ``Runtime.sync_for``): ZeRO-2/3 reduce-scatter after every
  micro-batch's backward and keep only their shard.

Per ZeRO stage: zero 0 all-reduces gradients; zero 1 and 2 reduce-scatter them and all-gather
the updated parameters before (or overlapped with) the next step's first forward; zero 3
all-gathers each unit's parameters for every micro-batch's forward and again for its backward
(and with HSDP all-reduces the shards across replicas once per step).

Pieces: FSDP-style stacks (PyTorch FSDP/FSDP2, trainpilot, Megatron-FSDP for zero 3) issue one
collective per wrapped unit (a decoder layer); DDP and Megatron's buffers use ``comm.bucket_mb``.
Each piece pays its collective's latency (``Network``: NCCL's tuner model).

DeepSpeed's first ZeRO-3 (0.3.12-0.5.4, 2021; ``runtime.zero3_collectives: per_param``) issues
one collective per partitioned weight tensor (``weight_tensors`` per layer; norms and biases,
under its 1e5-element persistence threshold, stay whole), gathers again for the recomputed
forward under full recompute (its module hooks release a module's parameters after every
forward), and hands PyTorch each collective as a list of the group's ``n`` chunk views, which
ProcessGroupNCCL copies out (all-gather) or in (reduce-scatter) one chunk at a time: ``n`` copy
kernels, each costing the host its issue time (``chunk_issue_s``). A device synchronize precedes
every parameter gather, so this traffic does not overlap compute (``serialized``).

Overlap (``comm.overlap``): traffic hides behind the compute window it overlaps except the first
or last piece, and slows the overlapped kernels by the device's ``overlap_slowdown``. The window
of the step's gradient reduction is the last micro-batch's backward, except under Megatron's
interleaved schedule (``grad_sync_window``).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpilot.perf.memory import RankParams
from trainpilot.perf.topology import GroupSpan, Network


@dataclass(frozen=True, slots=True)
class Traffic:
    """Seconds of raw (unoverlapped) traffic for one stage; ``*_edge_s`` is the piece that
    cannot overlap (the last gradient bucket, the first gathered one)."""

    step_grad_s: float = 0.0  # reduced once per step (after the last micro-batch)
    step_grad_edge_s: float = 0.0
    step_gather_s: float = 0.0  # zero 1/2, once per step
    step_gather_edge_s: float = 0.0
    mb_fwd_s: float = 0.0  # zero 3 gathers per micro-batch forward
    mb_bwd_s: float = 0.0  # per micro-batch backward: zero 3 gathers (+ scatters when per mb)
    mb_edge_s: float = 0.0
    replicate_s: float = 0.0  # HSDP all-reduce across replicas, once per step
    tied_s: float = 0.0  # tied-embedding gradient all-reduce between first and last stage

    @property
    def step_s(self) -> float:
        """The traffic issued once per step (what a step timeline schedules after the last
        backward); per-micro-batch traffic is part of each micro-batch's time."""
        return self.step_grad_s + self.step_gather_s + self.replicate_s + self.tied_s

    def total_s(self, num_micro_batches: int) -> float:
        """All of it per step, as if nothing overlapped."""
        return (self.step_grad_s + self.step_gather_s + self.replicate_s + self.tied_s
                + num_micro_batches * (self.mb_fwd_s + self.mb_bwd_s))


def per_unit(stack: str, zero: int) -> bool:
    """Whether the stack issues one collective per wrapped unit (FSDP) rather than buckets."""
    if stack in ("trainpilot", "pytorch"):
        return zero >= 1
    return zero == 3 and stack == "megatron"


def traffic(net: Network, *, zero: int, params: RankParams, grad_bytes: int,
            spans: dict[str, GroupSpan], hierarchical: bool, bucket_bytes: float,
            dp_shard: int | None, tied_bytes: float, num_layers: int,
            units: bool = False, sync: str = "micro_batch",
            param_bytes: float = 2.0, weight_tensors: int = 0, chunk_issue_s: float = 0.0,
            recompute_gather: bool = False) -> Traffic:
    """Raw data-parallel traffic of one stage (see the module docstring); ``num_layers``:
    decoder layers on the stage (the FSDP units when ``units``); ``sync``: ``step`` or
    ``micro_batch`` (``runtime.grad_sync``); ``param_bytes``: bytes per parameter of the
    parameter all-gather (``Runtime.param_gather_bytes``); ``weight_tensors`` > 0: ZeRO-3
    collectives per weight tensor (that many per layer) with ``chunk_issue_s`` of host time per
    rank's chunk, and one more gather per micro-batch when ``recompute_gather``."""
    dense, expert = params.dense, params.expert
    dp, edp = spans["dp"], spans["expert_dp"]
    ops = {"ar": net.all_reduce_s, "rs": net.reduce_scatter_s, "ag": net.all_gather_s}
    layers = max(1, num_layers)

    def op(span: GroupSpan, num_bytes: float, kind: str, pieces: float = 1.0) -> float:
        """``num_bytes`` in ``pieces`` equal collectives."""
        if num_bytes <= 0 or span.size <= 1:
            return 0.0
        pieces = max(1.0, pieces)
        return pieces * ops[kind](span, num_bytes / pieces, hierarchical=hierarchical)

    def pieces_of(num_bytes: float) -> float:
        return float(layers) if units else max(1.0, -(-num_bytes // bucket_bytes))

    def both(span: GroupSpan, per_param: float, kind: str) -> float:
        return op(span, per_param * dense, kind, pieces_of(per_param * dense)) + \
            op(edp, per_param * expert, kind, pieces_of(per_param * expert) if expert else 1)

    def edge(span: GroupSpan, per_param: float, kind: str) -> float:
        total = per_param * (dense + expert)
        piece = total / layers if units else min(bucket_bytes, total)
        return op(span, piece, kind)

    tied = op(spans["pp"], tied_bytes, "ar") if tied_bytes else 0.0
    if zero == 0:
        return Traffic(step_grad_s=both(dp, grad_bytes, "ar"),
                       step_grad_edge_s=edge(dp, grad_bytes, "ar"), tied_s=tied)
    if zero in (1, 2):
        gather = dict(step_gather_s=both(dp, param_bytes, "ag"),
                      step_gather_edge_s=edge(dp, param_bytes, "ag"))
        if zero == 2 and sync == "micro_batch":
            return Traffic(mb_bwd_s=both(dp, grad_bytes, "rs"),
                           mb_edge_s=edge(dp, grad_bytes, "rs"), tied_s=tied, **gather)
        return Traffic(step_grad_s=both(dp, grad_bytes, "rs"),
                       step_grad_edge_s=edge(dp, grad_bytes, "rs"), tied_s=tied, **gather)
    shard = spans.get("dp_shard", dp)

    def per_layer(span: GroupSpan, per_param: float, kind: str) -> float:
        if weight_tensors and dense > 0 and span.size > 1:
            pieces = weight_tensors * layers
            listed = op(span, per_param * dense, kind, pieces) + \
                pieces * span.size * chunk_issue_s
        else:
            listed = op(span, per_param * dense, kind, layers)
        return listed + op(edp, per_param * expert, kind, layers if expert else 1)

    ag = per_layer(shard, param_bytes, "ag")
    rs = per_layer(shard, grad_bytes, "rs")
    bwd_ag = 2 * ag if recompute_gather else ag  # the recomputed forward gathers again
    replicate = 0.0
    if "dp_replicate" in spans:
        replicate = op(spans["dp_replicate"], grad_bytes * dense / (dp_shard or 1), "ar")
    edge_ag = op(shard, param_bytes * params.largest_layer, "ag")
    if sync == "step":
        return Traffic(mb_fwd_s=ag, mb_bwd_s=bwd_ag, mb_edge_s=edge_ag, step_grad_s=rs,
                       step_grad_edge_s=op(shard, grad_bytes * params.largest_layer, "rs"),
                       replicate_s=replicate, tied_s=tied)
    return Traffic(mb_fwd_s=ag, mb_bwd_s=bwd_ag + rs, mb_edge_s=edge_ag, replicate_s=replicate,
                   tied_s=tied)


def grad_sync_window(stack: str, vp: int, pp: int, micro_batches: int) -> float:
    """The step's gradient-reduction window in micro-batch backwards of the stage. Megatron's
    interleaved schedule (``forward_backward_pipelining_with_interleaving``) calls its
    ``grad_sync_func`` for a model chunk as soon as that chunk's last micro-batch backward is
    done, and Apex's distributed Adam (NeMo 1) launches a bucket's reduction from the gradient
    hook of that same last backward, so the first chunk to finish reduces while the other
    ``v - 1`` chunks run the backwards of the final group of ``min(m, p)`` micro-batches: a
    window of ``(1 + (v - 1) min(m, p)) / v`` micro-batch backwards. Without interleaving
    (``vp`` 1) and on other stacks, one: the last micro-batch's backward. The parameter
    all-gather keeps one micro-batch forward: a chunk's parameters are needed at its first
    forward, which the schedule reaches within the first micro-batch's forward of all chunks."""
    if stack != "megatron" or vp <= 1:
        return 1.0
    return (1 + (vp - 1) * min(micro_batches, pp)) / vp


def exposed(comm: float, window: float, edge: float, *, overlap: bool, slowdown: float) -> float:
    """Traffic left on the critical path: all of it without overlap; else what the window
    cannot hide (at least the edge bucket), plus the slowdown of the compute it overlaps."""
    if comm <= 0.0:
        return 0.0
    if not overlap:
        return comm
    hidden = comm if comm < window else window
    rest = comm - window
    return (edge if edge > rest else rest) + (slowdown - 1.0) * hidden
