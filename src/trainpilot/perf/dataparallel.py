"""Data-parallel traffic of one pipeline stage per ZeRO stage, and how much of it is exposed.

Gradients travel at ``grad_bytes`` per element in every ZeRO stage (``CostOptions``: fp32 for
bf16 runs, as Megatron reduces its main gradients and as torchtitan's FSDP2 default
``mixed_precision_reduce = float32`` does; 16-bit for fp16 runs or when set), parameters are
gathered in 16-bit. Dense parameters reduce over the dp x cp group, expert parameters over the
expert-data-parallel group.

* zero 0: all-reduce the gradients once per step, after (or overlapped with) the last
  micro-batch's backward;
* zero 1: reduce-scatter the gradients likewise, all-gather the updated parameters before (or
  overlapped with) the next step's first forward;
* zero 2: reduce-scatter 16-bit gradients after every micro-batch's backward, all-gather the
  parameters once per step;
* zero 3: all-gather the parameters for every micro-batch's forward and again for its backward,
  reduce-scatter its gradients; with HSDP the shards are then all-reduced across replicas.

Collectives are issued in pieces, each paying the collective's latency: gradient reductions
and parameter gathers of ZeRO 0-2 in buckets of ``comm.bucket_mb``, ZeRO-3 gathers and scatters
once per layer (FSDP wraps each decoder layer).

Overlap (``comm.overlap``): traffic hides behind the compute window it overlaps except the first
or last piece, and slows the overlapped kernels by the device's ``overlap_slowdown``.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpilot.perf.memory import RankParams
from trainpilot.perf.topology import GroupSpan, Network


@dataclass(frozen=True, slots=True)
class Traffic:
    """Seconds of raw (unoverlapped) traffic for one stage; ``*_edge_s`` is the bucket that
    cannot overlap (the last gradient bucket, the first gathered one)."""

    step_grad_s: float = 0.0  # zero 0/1, once per step
    step_grad_edge_s: float = 0.0
    step_gather_s: float = 0.0  # zero 1/2, once per step
    step_gather_edge_s: float = 0.0
    mb_fwd_s: float = 0.0  # zero 3 gathers per micro-batch forward
    mb_bwd_s: float = 0.0  # zero 2 scatters / zero 3 gathers + scatters per micro-batch backward
    mb_edge_s: float = 0.0
    replicate_s: float = 0.0  # HSDP all-reduce across replicas, once per step
    tied_s: float = 0.0  # tied-embedding gradient all-reduce between first and last stage

    @property
    def step_s(self) -> float:
        """The traffic issued once per step (what a step timeline schedules after the last
        backward); ZeRO-2/3's per-micro-batch traffic is part of each micro-batch's time."""
        return self.step_grad_s + self.step_gather_s + self.replicate_s + self.tied_s

    def total_s(self, num_micro_batches: int) -> float:
        """All of it per step, as if nothing overlapped."""
        return (self.step_grad_s + self.step_gather_s + self.replicate_s + self.tied_s
                + num_micro_batches * (self.mb_fwd_s + self.mb_bwd_s))


def traffic(net: Network, *, zero: int, params: RankParams, grad_bytes: int,
            spans: dict[str, GroupSpan], hierarchical: bool, bucket_bytes: float,
            dp_shard: int | None, tied_bytes: float, num_layers: int) -> Traffic:
    """Raw data-parallel traffic of one stage (see the module docstring); ``num_layers``:
    decoder layers on the stage (ZeRO-3's gather/scatter units)."""
    dense, expert = params.dense, params.expert
    dp, edp = spans["dp"], spans["expert_dp"]
    ops = {"ar": net.all_reduce_s, "rs": net.reduce_scatter_s, "ag": net.all_gather_s}
    units = max(1, num_layers)

    def op(span: GroupSpan, num_bytes: float, kind: str, pieces: float = 1.0) -> float:
        """``num_bytes`` in ``pieces`` collectives: the bandwidth term once, the latency (a
        1-byte collective) once per extra piece."""
        if num_bytes <= 0:
            return 0.0
        fn = ops[kind]
        extra = (pieces - 1) * fn(span, 1.0, hierarchical=hierarchical) if pieces > 1 else 0.0
        return fn(span, num_bytes, hierarchical=hierarchical) + extra

    def bucketed(span: GroupSpan, num_bytes: float, kind: str) -> float:
        return op(span, num_bytes, kind, max(1.0, -(-num_bytes // bucket_bytes)))

    def both(span: GroupSpan, per_param: float, kind: str, per_layer: bool = False) -> float:
        if per_layer:
            return op(span, per_param * dense, kind, units) + \
                op(edp, per_param * expert, kind, units)
        return bucketed(span, per_param * dense, kind) + bucketed(edp, per_param * expert, kind)

    def edge(span: GroupSpan, per_param: float, kind: str) -> float:
        return op(span, min(bucket_bytes, per_param * dense), kind)

    tied = op(spans["pp"], tied_bytes, "ar") if tied_bytes else 0.0
    if zero in (0, 1):
        kind = "ar" if zero == 0 else "rs"
        out = dict(step_grad_s=both(dp, grad_bytes, kind),
                   step_grad_edge_s=edge(dp, grad_bytes, kind))
        if zero == 1:
            out.update(step_gather_s=both(dp, 2, "ag"), step_gather_edge_s=edge(dp, 2, "ag"))
        return Traffic(tied_s=tied, **out)
    if zero == 2:
        return Traffic(mb_bwd_s=both(dp, grad_bytes, "rs"), mb_edge_s=edge(dp, grad_bytes, "rs"),
                       step_gather_s=both(dp, 2, "ag"), step_gather_edge_s=edge(dp, 2, "ag"),
                       tied_s=tied)
    shard = spans.get("dp_shard", dp)
    ag, rs = both(shard, 2, "ag", per_layer=True), both(shard, grad_bytes, "rs", per_layer=True)
    replicate = 0.0
    if "dp_replicate" in spans:
        replicate = op(spans["dp_replicate"], grad_bytes * dense / (dp_shard or 1), "ar")
    return Traffic(mb_fwd_s=ag, mb_bwd_s=ag + rs,
                   mb_edge_s=op(shard, 2 * params.largest_layer, "ag"), replicate_s=replicate,
                   tied_s=tied)


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
