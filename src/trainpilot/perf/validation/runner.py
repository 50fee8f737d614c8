"""Run the cost model on every validation case and summarise the errors.

Error of a row: (predicted - measured) / measured. A dataset's score is the mean absolute
error over its rows (MAPE) with the maximum beside it; calibration and held-out rows are
summarised separately. ``THRESHOLDS`` are the committed gates ``trainpilot validate`` exits 1 on.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from trainpilot.perf.estimator import Estimator, layout_of
from trainpilot.perf.flops import forward_flops_per_token
from trainpilot.perf.hardware import EfficiencyCurve
from trainpilot.perf.memory import GIB, bytes_per_param, stage_rank_params
from trainpilot.perf.validation.cases import CALIBRATION, HELD_OUT, Case
from trainpilot.specs import ModelSpec

# Committed gates: every dataset's mean |error| must stay at or under these.
THRESHOLDS = {"time": 0.10, "memory": 0.05}
TIME_METRICS = ("step_time_s", "tflops_per_gpu", "causal_tflops_per_gpu")


@dataclass(frozen=True)
class Result:
    case: Case
    predicted: float

    @property
    def error(self) -> float:
        return (self.predicted - self.case.measured) / self.case.measured

    @property
    def kind(self) -> str:
        return "time" if self.case.metric in TIME_METRICS else "memory"


@dataclass(frozen=True)
class Summary:
    dataset: str
    split: str
    kind: str  # time | memory
    count: int
    mape: float
    max_ape: float
    bias: float  # mean signed error

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def narayanan_flops(case: Case) -> float:
    """Narayanan et al.'s per-iteration FLOPs, 96 B s l h^2 (1 + s/6h + V/16lh)."""
    m, p = case.model, case.plan
    b, s, l, h, v = p.global_batch_size, p.seq_len, m.num_hidden_layers, m.hidden_size, \
        m.vocab_size
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def causal_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Megatron's model FLOPs per token (perf/flops.py) with the attention scores counted
    over the causal half of the s x s square: the work a causal attention kernel does."""
    fwd = forward_flops_per_token(model, seq_len)
    return 3.0 * (fwd.total - fwd.attention_scores / 2)


def predict_case(case: Case, est: Estimator) -> float:
    """The model's value for the case's metric."""
    lay = layout_of(case.model, case.plan, est.options)
    if case.metric == "step_time_s":
        return est.evaluate(lay).step_time_s
    if case.metric == "tflops_per_gpu":
        step = est.evaluate(lay).step_time_s
        return narayanan_flops(case) / step / lay.world_size / 1e12
    if case.metric == "causal_tflops_per_gpu":
        step = est.evaluate(lay).step_time_s
        return causal_flops_per_token(case.model, lay.seq_len) * lay.global_batch_size * \
            lay.seq_len / step / lay.world_size / 1e12
    ids = est.stage_ids(lay)[0]
    if case.metric == "weights_optimizer_gib":
        params = stage_rank_params(case.model, ids, tp=lay.tp, ep=lay.ep, first=False,
                                   last=False, pp=lay.pp)
        return params.total * sum(bytes_per_param(lay.zero, lay.dp * lay.cp)) / GIB
    if case.metric == "activations_gib":
        layer = est.layer(lay, False, est.spans(lay))
        flight = est._in_flight(lay, 0)
        return flight * len(ids) * layer.act_bytes(lay.recompute) / GIB
    raise ValueError(f"unknown metric {case.metric!r}")


def run(cases: list[Case], curve: EfficiencyCurve | None = None) -> list[Result]:
    """Predict every case (one Estimator per model/cluster/options, so caches are shared)."""
    estimators: dict[tuple, Estimator] = {}
    out = []
    for case in cases:
        options = dataclasses.replace(case.options, curve=curve) if curve else case.options
        key = (id(case.model), id(case.cluster), options)  # specs hold dicts: not hashable
        est = estimators.get(key)
        if est is None:
            est = estimators[key] = Estimator(case.model, case.cluster, options)
        out.append(Result(case, predict_case(case, est)))
    return out


def summarize(results: list[Result]) -> list[Summary]:
    """One summary per (dataset, split), then the pooled held-out time and memory rows."""
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for r in results:
        groups[(r.case.dataset, r.case.split, r.kind)].append(r.error)
        if r.case.split == HELD_OUT:
            groups[("all held-out", HELD_OUT, r.kind)].append(r.error)
    out = []
    order = {CALIBRATION: 0, HELD_OUT: 1}
    for (dataset, split, kind), errs in sorted(
            groups.items(), key=lambda kv: (kv[0][0] == "all held-out", order[kv[0][1]], kv[0])):
        out.append(Summary(dataset, split, kind, len(errs), sum(map(abs, errs)) / len(errs),
                           max(map(abs, errs)), sum(errs) / len(errs)))
    return out


def failures(summaries: list[Summary], thresholds: dict[str, float] | None = None) -> list[str]:
    """One line per dataset whose mean |error| passes its committed threshold."""
    limits = thresholds or THRESHOLDS
    return [f"{s.dataset} ({s.split}): mean |error| {s.mape:.1%} > {limits[s.kind]:.0%}"
            for s in summaries if s.dataset != "all held-out" and s.mape > limits[s.kind]]
