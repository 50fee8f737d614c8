"""The plain records the cost model passes around: a plan's Layout, per-stage numbers, the
full Costing, and how layers add into a stage."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainpilot.perf.layer import LayerCost
from trainpilot.perf.memory import RankParams
from trainpilot.perf.runtime import Runtime, bucket_mb, resolve
from trainpilot.perf.topology import GroupSpan
from trainpilot.specs import ModelSpec, Plan, stage_layers

OPT_BYTES_PER_PARAM = 34.0  # Adam: read master, grad, m, v; write master, m, v, 16-bit copy; norm
BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "pp_comm", "pp_bubble", "dp_comm_exposed",
                  "ep_comm", "cp_comm", "optimizer")


@dataclass(frozen=True, slots=True)
class Layout:
    """The plan fields the cost model reads, as plain values."""

    tp: int
    pp: int
    dp: int
    ep: int
    cp: int
    vp: int
    zero: int
    micro_batch_size: int
    global_batch_size: int
    seq_len: int
    recompute: str
    sequence_parallel: bool
    precision: str
    schedule: str
    stage_layers: tuple[int, ...]
    dp_shard: int | None = None
    overlap: bool = True
    hierarchical: bool = False
    bucket_mb: float = 25.0
    etp: int | None = None  # expert tensor parallel size under MoE parallel folding
    rank_order: str = "tp-cp-ep-pp-dp"
    algorithm: str = "auto"  # NCCL algorithm choice (comm.algorithm)
    rt: Runtime = Runtime()

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp


def layout_of(model: ModelSpec, plan: Plan, options=None) -> Layout:
    """A plan's Layout (raises SpecError when its layers cannot be split over the stages);
    ``options`` (CostOptions) override what the documents say about the runtime."""
    rt = resolve(model, plan, options)
    return Layout(
        tp=plan.tp, pp=plan.pp, dp=plan.dp, ep=plan.ep, cp=plan.cp, vp=plan.vp, zero=plan.zero,
        micro_batch_size=plan.micro_batch_size, global_batch_size=plan.global_batch_size,
        seq_len=plan.seq_len, recompute=plan.recompute, sequence_parallel=plan.sequence_parallel,
        precision=plan.precision, schedule=str(plan.pp_schedule),
        stage_layers=tuple(stage_layers(model, plan)), dp_shard=plan.dp_shard,
        overlap=plan.comm.overlap, hierarchical=plan.comm.hierarchical,
        bucket_mb=bucket_mb(plan, rt), etp=plan.etp, rank_order=plan.rank_order,
        algorithm=plan.comm.algorithm, rt=rt,
    )


@dataclass(frozen=True, slots=True)
class Sig:
    """What makes pipeline ranks cost the same: their layers, how they split into virtual
    stages, and whether they hold the embedding (first) or the output layer (last)."""

    ids: tuple[int, ...]
    n_moe: int
    first: bool
    last: bool
    chunks: tuple[int, ...] = ()  # layers per virtual stage (interleaving)


@dataclass(frozen=True, slots=True)
class Sigs:
    """The distinct signatures of a split, where each first occurs, how many ranks share it,
    and how many ranks of each signature come before that first occurrence."""

    sigs: tuple[Sig, ...]
    of_stage: tuple[int, ...]
    first_index: tuple[int, ...]
    count: tuple[int, ...]
    before: tuple[tuple[int, ...], ...]


@dataclass(slots=True)
class StageNumbers:
    """One pipeline rank's numbers (seconds per micro-batch unless said otherwise; bytes)."""

    index: int
    layers: int
    params: RankParams
    fwd_s: float = 0.0
    bwd_s: float = 0.0  # includes recompute
    wgrad_s: float = 0.0  # weight-gradient GEMMs inside bwd_s (zero-bubble's deferrable W)
    fsdp_fwd_s: float = 0.0  # per micro-batch, ZeRO-3 gathers not hidden by the forward
    fsdp_bwd_s: float = 0.0  # per micro-batch, ZeRO-2/3 traffic not hidden by the backward
    compute_s: float = 0.0
    recompute_s: float = 0.0
    tp_s: float = 0.0
    ep_s: float = 0.0
    cp_s: float = 0.0
    p2p_s: float = 0.0
    dp_comm_s: float = 0.0  # per step, step-level traffic (Traffic.step_s), if not overlapped
    dp_tail_rs_s: float = 0.0  # gradient traffic left after the backward overlap
    dp_tail_ag_s: float = 0.0  # parameter gathers left after the forward overlap
    dp_exposed_s: float = 0.0  # per step, after overlap and pipeline slack
    optimizer_s: float = 0.0
    bucket_bytes: tuple[int, ...] = ()
    static_bytes: float = 0.0  # weights + grads + optimizer + other
    act_bytes: float = 0.0  # per in-flight micro-batch (the stage's layers)
    act_edge_bytes: float = 0.0  # output-layer activations (last stage), held once
    memory: dict[str, float] = field(default_factory=dict)  # bytes

    @property
    def fsdp_exposed_s(self) -> float:
        return self.fsdp_fwd_s + self.fsdp_bwd_s

    @property
    def period_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.fsdp_fwd_s + self.fsdp_bwd_s


@dataclass(slots=True)
class Costing:
    """Everything ``predict`` reports, as numbers."""

    layout: Layout
    stages: list[StageNumbers]
    step_time_s: float
    breakdown_s: dict[str, float]
    peak_bytes: float
    peak_stage: int
    model_flops_per_step: float
    hardware_flops_per_step: float
    peak_flops: float
    hbm_bytes: float
    spans: dict[str, GroupSpan]


# A recompute mode's slot in the (none, selective, full, op) tuples of per-layer numbers ("op":
# torchtitan's per-op selective checkpointing).
MODE_INDEX = {"none": 0, "selective": 1, "full": 2, "op": 3}


def add_layers(st: StageNumbers, layer: LayerCost, count: int, mode: str) -> None:
    """Add ``count`` decoder layers' times (under recompute ``mode``) to the stage's."""
    rc, rt, re = layer.recompute_s(mode)
    st.fwd_s += count * layer.fwd_s
    st.bwd_s += count * layer.bwd_s(mode)
    st.wgrad_s += count * layer.wgrad_s
    st.compute_s += count * (layer.fwd_compute_s + layer.bwd_compute_s)
    st.recompute_s += count * rc
    st.tp_s += count * (layer.tp_fwd_s + layer.tp_bwd_s + rt)
    st.ep_s += count * (layer.ep_fwd_s + layer.ep_bwd_s + re)
    st.cp_s += count * (layer.cp_fwd_s + layer.cp_bwd_s)


def pipeline_bubble(schedule: str, periods: list[float], wgrads: list[float], vp: int) -> float:
    """Seconds the pipeline idles per step, given each pipeline rank's forward + backward
    time per micro-batch (``periods``) and the weight-gradient part of its backward
    (``wgrads``): ``(sum_i t_i - t_c) / v`` for 1F1B, interleaved and GPipe (Narayanan's
    ``(p - 1) / (v m)`` for uniform stages), and for zero-bubble (ZB-H1: each backward split
    into input-gradient B and weight-gradient W, W deferred into the bubble) the same with each
    stage's W taken out, ``sum_i (t_i - w_i) - (t_c - w_c)``: on uniform stages
    ``(p - 1)(F + B - W)``, exactly what ``sim/timeline.py``'s zero-bubble schedule produces
    (tests/perf/test_issue14.py compares them). One rank: no bubble."""
    if len(periods) <= 1:
        return 0.0
    if schedule == "zero_bubble":
        net = [t - w for t, w in zip(periods, wgrads)]
        crit = max(range(len(periods)), key=lambda i: periods[i])
        return sum(net) - net[crit]
    return (sum(periods) - max(periods)) / vp


def add_edges(st: StageNumbers, edges: tuple[float, float, float, float]) -> None:
    """Add the embedding / output-layer ``(fwd, bwd, fwd TP, bwd TP)`` seconds to the stage's."""
    f, b, tf, tb = edges
    st.fwd_s += f + tf
    st.bwd_s += b + tb
    st.compute_s += f + b
    st.tp_s += tf + tb
