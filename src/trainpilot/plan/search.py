"""``search(model, cluster, ...)``: the fastest layouts that fit, ranked by predicted tokens/s.

How it stays fast: the device count is factored (tp x cp x pp x dp), every divisibility rule is a
filter on those factors, and for each (tp, cp, pp, split, ep, micro-batch) group a lower bound -
the layout with ZeRO-3, full recompute and sequence parallelism, the least memory that group can
reach - is checked first: if even it does not fit, the whole group is pruned, and so are larger
micro-batches. Survivors are checked for memory and only then costed, all through one
``Estimator`` whose caches (per-layer costs, group spans, parameter counts, stage signatures)
are shared by every candidate.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

from trainpilot.perf import CostOptions, Estimator, Layout, Prediction, predict
from trainpilot.perf.group import Group
from trainpilot.perf.runtime import resolve
from trainpilot.plan.space import (
    RECOMPUTE,
    SearchSpace,
    cp_options,
    divisors,
    ep_options,
    micro_batches,
    splits,
    tp_options,
)
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, RuntimeProfile, SpecError
from trainpilot.specs.loading import validate
from trainpilot.specs.plan import PRECISIONS, PpSchedule, Precision, Recompute, ZeroStage

GIB = 2.0**30


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One ranked plan with its full prediction."""

    rank: int
    plan: Plan
    prediction: Prediction

    def to_dict(self) -> dict[str, Any]:
        return dict(rank=self.rank, plan=self.plan.to_dict(), **self.prediction.to_dict())


@dataclass(frozen=True, kw_only=True)
class SearchStats:
    """Where every enumerated layout went: ``enumerated`` = ``pruned_memory`` (shown not to
    fit before any time was costed) + ``pruned_bound`` (shown, by a lower bound on their step
    time, unable to enter the top N: a group whose bound is no better than the N-th best, or a
    recompute mode heavier than one that already fits) + ``costed``. ``feasible``: costed
    layouts that fit (all of them: memory is checked first). ``wall_s``: seconds, end to end."""

    enumerated: int
    pruned_memory: int
    pruned_bound: int
    costed: int
    feasible: int
    wall_s: float
    duplicates: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(enumerated=self.enumerated, pruned_memory=self.pruned_memory,
                    pruned_bound=self.pruned_bound, duplicates=self.duplicates,
                    costed=self.costed, feasible=self.feasible,
                    wall_s=self.wall_s)


@dataclass(frozen=True, kw_only=True)
class Shortfall:
    """When nothing fits: the closest layout, how far it is over, and what would help."""

    plan: dict[str, Any]
    peak_gib: float
    limit_gib: float
    suggestions: tuple[str, ...]

    @property
    def short_gib(self) -> float:
        return self.peak_gib - self.limit_gib

    def to_dict(self) -> dict[str, Any]:
        return dict(plan=self.plan, peak_gib=self.peak_gib, limit_gib=self.limit_gib,
                    short_gib=self.short_gib, suggestions=list(self.suggestions))


@dataclass(frozen=True, kw_only=True)
class SearchResult(Sequence):
    """Ranked plans (a sequence of Candidates, best first), the search statistics, why the best
    beats the runner-up, and the memory shortfall when no plan fits."""

    model: ModelSpec
    cluster: ClusterSpec
    global_batch_size: int
    seq_len: int
    headroom: float
    plans: list[Candidate] = field(default_factory=list)
    stats: SearchStats
    why: str = ""
    shortfall: Shortfall | None = None

    def __len__(self) -> int:
        return len(self.plans)

    def __getitem__(self, index):  # type: ignore[override]
        return self.plans[index]

    def __iter__(self) -> Iterator[Candidate]:
        return iter(self.plans)

    @property
    def best(self) -> Candidate | None:
        return self.plans[0] if self.plans else None

    def to_dict(self) -> dict[str, Any]:
        return dict(model=self.model.name, cluster=self.cluster.name,
                    global_batch_size=self.global_batch_size, seq_len=self.seq_len,
                    headroom=self.headroom, search=self.stats.to_dict(), why=self.why,
                    plans=[c.to_dict() for c in self.plans],
                    shortfall=self.shortfall.to_dict() if self.shortfall else None)


def search(model: ModelSpec, cluster: ClusterSpec, *, global_batch_size: int, seq_len: int,
           top: int = 5, headroom: float = 0.1, precision: str = "bf16",
           fp8_recipe: str = "delayed", fp8_param_gather: bool | None = None,
           space: SearchSpace | None = None, options: CostOptions | None = None,
           runtime: RuntimeProfile | None = None) -> SearchResult:
    """Rank every valid layout of ``model`` on all of ``cluster`` by predicted tokens/s among
    those whose peak memory fits in ``(1 - headroom)`` of the device's HBM.

    ``global_batch_size`` is in sequences of ``seq_len`` tokens. Under precision fp8,
    ``fp8_recipe`` is the Plan's scaling recipe and ``fp8_param_gather`` its FP8 parameter
    all-gather, set on the plans that shard parameters (ZeRO >= 1); None: on for the megatron
    stack (its --fp8-param-gather, with Transformer Engine's weight cache: it halves the gather
    and costs neither time nor memory), off elsewhere (torchao's float8 all-gather is asked
    for explicitly: it changes the per-pass weight casts, and only FSDP applies it). Raises
    SpecError for bad arguments (a batch no layout can split, a precision the device lacks)."""
    start = time.perf_counter()
    space = space or SearchSpace()
    _check_args(model, cluster, global_batch_size, seq_len, top, headroom, precision)
    plan_precision = _training_precision(precision)
    est = Estimator(model, cluster, options)
    limit = est.device(precision).hbm_bytes * (1.0 - headroom)
    runtime = runtime or RuntimeProfile()
    fp8 = plan_precision == "fp8"
    gather = fp8 and runtime.stack == "megatron" if fp8_param_gather is None \
        else fp8_param_gather
    # The Plan's own checks refuse a gather its precision, recipe or stack cannot do.
    template = validate(Plan, dict(global_batch_size=global_batch_size, seq_len=seq_len,
                                   precision=plan_precision, runtime=runtime,
                                   fp8_recipe=fp8_recipe if fp8 else "delayed",
                                   fp8_param_gather=gather), doc="plan")
    rt = resolve(model, template, est.options)
    if gather and rt.weight_cast_per_pass:  # the gathered FP8 weight exists where FSDP gathers
        space = replace(space, zero=tuple(z for z in space.zero if z >= 1) or (1,))
    entries, walks = [], []
    for idle in idle_options(cluster, space):
        walk = _Walk(model, cluster, est, space, global_batch_size, seq_len, precision, limit,
                     top, rt, devices=cluster.num_devices - idle)
        walk.run()
        walks.append(walk)
        # Rank by tokens/s of the whole cluster: a layout on fewer devices must be faster
        # per step to win (idle devices are still paid for).
        entries += [(e, idle) for e in walk.heap]
    entries.sort(key=lambda item: (-item[0][0], item[1], -item[0][1], -item[0][2]))
    ranked = [_candidate(i + 1, model, cluster, e[3].variant(*e[4]), est, global_batch_size,
                         runtime, idle)
              for i, (e, idle) in enumerate(entries[:top])]
    if space.tune_buckets:
        ranked = _best_buckets(ranked, model, cluster, est)
    stats = SearchStats(enumerated=sum(w.enumerated for w in walks),
                        pruned_memory=sum(w.pruned for w in walks),
                        pruned_bound=sum(w.pruned_bound for w in walks),
                        duplicates=sum(w.duplicates for w in walks),
                        costed=sum(w.costed for w in walks),
                        feasible=sum(w.feasible for w in walks),
                        wall_s=time.perf_counter() - start)
    walk = walks[0]
    shortfall = None if ranked else _shortfall(walk, cluster, limit)
    return SearchResult(model=model, cluster=cluster, global_batch_size=global_batch_size,
                        seq_len=seq_len, headroom=headroom, plans=ranked, stats=stats,
                        why=explain(ranked), shortfall=shortfall)


def _check_args(model: ModelSpec, cluster: ClusterSpec, gbs: int, seq_len: int, top: int,
                headroom: float, precision: str) -> None:
    if gbs <= 0:
        raise SpecError("global_batch_size", gbs, "valid: a positive number of sequences")
    if seq_len <= 0:
        raise SpecError("seq_len", seq_len, "valid: a positive number of tokens")
    if model.position_embedding == "learned" and seq_len > model.max_position_embeddings:
        raise SpecError("seq_len", seq_len,
                        f"exceeds max_position_embeddings={model.max_position_embeddings}")
    if top <= 0:
        raise SpecError("top", top, "valid: at least 1")
    if not 0 <= headroom < 1:
        raise SpecError("headroom", headroom, "valid: a fraction in [0, 1)")
    if precision not in cluster.device.peak_tflops:
        raise SpecError("precision", precision,
                        f"device {cluster.device.name!r} lists no {precision} peak; valid: "
                        f"{', '.join(cluster.device.peak_tflops)}")


def _training_precision(precision: str) -> Precision:
    """``precision`` as a Plan precision; SpecError for one no Plan trains in (a device may
    list more peaks, such as fp32)."""
    for valid in PRECISIONS:
        if precision == valid:
            return valid
    raise SpecError("precision", precision, f"valid: {', '.join(PRECISIONS)}")


class _Walk:
    """The enumeration: groups of layouts that share (tp, cp, pp, split, ep, micro-batch) are
    checked against memory with their most memory-saving variant, bounded below in time, and
    then expanded best bound first until no remaining bound can enter the top N."""

    def __init__(self, model, cluster, est, space, gbs, seq_len, precision, limit, top, rt=None,
                 devices: int | None = None):
        self.model, self.cluster, self.est, self.space = model, cluster, est, space
        self.devices = devices or cluster.num_devices
        self.rt = rt if rt is not None else resolve(model, Plan(global_batch_size=gbs, seq_len=seq_len, precision=precision), est.options)
        self.gbs, self.seq_len, self.precision, self.limit, self.top = \
            gbs, seq_len, precision, limit, top
        self.heap: list[tuple] = []  # (1/step, -peak, -seq, group, (zero, recompute, sp))
        self.enumerated = self.pruned = self.pruned_bound = self.costed = self.feasible = 0
        self.duplicates = 0
        self.closest: tuple[float, Layout] | None = None  # smallest peak seen (nothing fits)
        self.sps = tuple(space.sequence_parallel)
        self.most_saving = _most_saving(space.recompute)
        self.coarse: dict[tuple, tuple[float, float]] = {}

    def run(self) -> None:
        """Best-first over three kinds of queue entries: families (tp, cp, pp, split, ep)
        keyed by a bound valid for every micro-batch size; groups (a family at one micro-batch
        size) first queued under their family's bound and refined to their own bound when they
        reach the front; refined groups, expanded into variants when they reach the front. The
        walk stops when the smallest key left cannot beat the N-th best plan found: every
        layout still queued is counted as pruned by the bound."""
        queue: list[tuple] = []  # (bound, kind, order, payload)
        for family in self._families():
            heapq.heappush(queue, (self._coarse_bound(family), _COARSE, self._seq(), family))
        while queue:
            bound, kind, _, payload = heapq.heappop(queue)
            if math.isinf(bound) or bound >= self._kth():
                for entry in [(bound, kind, 0, payload)] + queue:
                    self._drop(entry)
                return
            if kind == _COARSE:
                heapq.heappush(queue, (self._family_bound(payload), _FAMILY, self._seq(),
                                       payload))
            elif kind == _FAMILY:
                for entry in self._open_family(payload, bound):
                    heapq.heappush(queue, entry)
            elif kind == _UNREFINED:
                base, mb, variants, like = payload
                group = self._group(base, mb, variants, like)
                heapq.heappush(queue, (self._group_bound(group, variants), _GROUP, self._seq(),
                                       (group, variants)))
            else:
                self._expand(*payload)

    def _group_bound(self, group: Group, variants: tuple) -> float:
        """The group's bound: per sequence-parallel choice, the pipeline under the lightest
        recompute mode that can fit at all (with the most sharding), no data-parallel
        traffic. Heavier modes and less sharding only add time or memory."""
        zeros, modes, sps = variants
        bound = math.inf
        for sp in sps:
            for mode in (m for m in RECOMPUTE if m in modes):
                if group.peak(max(zeros), mode, sp)[0] <= self.limit:
                    bound = min(bound, group.lower_bound(sp, mode))
                    break
        return bound

    def _kth(self) -> float:
        """The N-th best step time so far (infinite until N plans fit)."""
        return 1.0 / self.heap[0][0] if len(self.heap) >= self.top else math.inf

    def _drop(self, entry: tuple) -> None:
        """Count the layouts of a queue entry left unexpanded: a family whose smallest
        micro-batch does not fit is pruned by memory, the rest by the bound."""
        bound, kind, _, payload = entry
        if kind == _COARSE:
            self.pruned_bound += len(payload[1]) * _count(payload[2])
            return
        if kind != _FAMILY:
            self.pruned_bound += _count(payload[-2] if kind == _UNREFINED else payload[1])
            return
        base, mbs, variants, info = payload
        if math.isinf(bound):
            self.pruned += len(mbs) * _count(variants)
            peak, group = info["closest"]
            zeros, _, sps = variants
            self._note_closest(peak, group.variant(max(zeros), self.most_saving, True in sps))
            return
        fit = len(info["fit"])
        self.pruned += (len(mbs) - fit) * _count(variants)
        self.pruned_bound += fit * _count(variants)

    def _seq(self) -> int:
        self._order = getattr(self, "_order", 0) + 1
        return self._order

    def _families(self):
        """(base fields without micro_batch_size, micro-batch sizes, variants) per family."""
        n, layers, space = self.devices, self.model.num_hidden_layers, self.space
        for tp in tp_options(self.model, self.cluster, space, n):
            sps = tuple(sp for sp in self.sps if tp > 1 or not sp) or (False,)
            variants = (tuple(space.zero), tuple(space.recompute), sps)
            for cp in cp_options(self.seq_len, n // tp, space):
                rest = n // (tp * cp)
                for pp in (p for p in divisors(rest) if p <= layers and
                           (space.pp is None or p in space.pp)):
                    dp = rest // pp
                    if self.gbs % dp:
                        continue
                    for split in splits(layers, pp, space):
                        mbs = tuple(mb for mb in micro_batches(self.gbs, dp, space)
                                    if split.vp == 1 or (self.gbs // (mb * dp)) % pp == 0)
                        if not mbs:  # Megatron's interleaving needs m % pp == 0
                            continue
                        for ep, etp in ep_options(self.model, dp, cp, space, tp):
                            base = dict(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, cp=cp, vp=split.vp,
                                        global_batch_size=self.gbs, seq_len=self.seq_len,
                                        precision=self.precision,
                                        schedule="interleaved" if split.vp > 1 else "1f1b",
                                        stage_layers=split.stage_layers, rt=self.rt)
                            self.enumerated += len(mbs) * _count(variants)
                            yield base, mbs, variants, {}

    def _group(self, base: dict, mb: int, variants: tuple, like=None):
        zeros, _, sps = variants
        lay = Layout(zero=max(zeros), recompute=self.most_saving, sequence_parallel=sps[-1],
                     micro_batch_size=mb, **base)
        return Group(self.est, lay, like)

    def _coarse_bound(self, family) -> float:
        """A bound shared by every family with the same (tp, cp, ep), given its pp, split and
        vp: the slowest stage takes at least the average (all layers' time / pp) and at least
        its busiest rank's layers at the cheaper layer's time, per micro-batch; the bubble,
        (sum of the stages' times - the slowest one's) / vp, is at least the layers off the
        busiest rank, one sample each, / vp. A layer's time per
        sample is at least its time per sample at a micro-batch as large as the whole global
        batch (per-sample time never rises with the micro-batch). No recomputation, no
        data-parallel or pipeline traffic."""
        base, _, variants, _ = family
        key = (base["tp"], base["cp"], base["ep"], base["etp"])
        found = self.coarse.get(key)
        if found is None:
            # Layer costs depend on tp, cp, ep (and their groups' spans, which the family's
            # own dp and pp leave unchanged) and the micro-batch: probe at the global batch.
            probe = Layout(zero=max(variants[0]), recompute="none", sequence_parallel=False,
                           micro_batch_size=self.gbs, **base)
            group = Group(self.est, probe)
            times = [group.layer_sample_time(sp) for sp in variants[2]]
            found = self.coarse[key] = (min(t[0] for t in times), min(t[1] for t in times))
        per_layers, per_layer = found
        busiest = max(base["stage_layers"])
        slowest = max(per_layers / base["pp"], busiest * per_layer)
        return self.gbs / base["dp"] * slowest + \
            (self.model.num_hidden_layers - busiest) * per_layer / base["vp"]

    def _family_bound(self, family) -> float:
        """A bound for every micro-batch size of the family: for each recompute mode, the
        per-sample bound at the largest size where that mode can fit (ZeRO-3, sequence
        parallel), times the sequences per replica, plus the bubble at the smallest size and
        the sharded optimizer step; the least over modes. Sizes are bisected: peak memory
        never falls as the micro-batch grows. A family whose smallest size does not fit even
        with full recompute gets an infinite bound (pruned by memory)."""
        base, mbs, variants, info = family
        zeros, modes, sps = variants
        first = self._group(base, mbs[0], variants)
        info["like"] = first
        zero, sp_min = max(zeros), True in sps
        fit_last = {}  # mode -> index of the largest size that fits
        # Peak memory never falls as the micro-batch grows, except at the size that leaves
        # one micro-batch per step, where gradients no longer accumulate unsharded: bisect
        # the others and test that one on its own.
        single = len(mbs) - 1 if self.gbs // (mbs[-1] * base["dp"]) == 1 else None
        top = len(mbs) - 1 if single is None else len(mbs) - 2
        last_fits = set()
        for mode in modes:
            if single is not None and first.peak(zero, mode, sp_min, mbs[single])[0] <= \
                    self.limit:
                last_fits.add(mode)
            if top < 0 or first.peak(zero, mode, sp_min)[0] > self.limit:
                if mode in last_fits:
                    fit_last[mode] = -1
                continue
            lo, hi = 0, top
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if first.peak(zero, mode, sp_min, mbs[mid])[0] <= self.limit:
                    lo = mid
                else:
                    hi = mid - 1
            fit_last[mode] = lo
        if not fit_last:
            info["fit"] = []
            info["closest"] = (first.peak(zero, self.most_saving, sp_min)[0], first)
            return math.inf
        fits = set(range(max(fit_last.values()) + 1))
        if last_fits:
            assert single is not None  # only the single-micro-batch size fills last_fits
            fits.add(single)
            for mode in last_fits:  # the bound below uses the largest size each mode reaches
                fit_last[mode] = single
        info["fit"] = sorted(fits)
        bound = math.inf
        per_replica = self.gbs / base["dp"]
        for mode, last in fit_last.items():
            group = first if last == 0 else self._group(base, mbs[last], variants, first)
            for sp in sps:
                bound = min(bound, per_replica * group.per_sample_bound(sp, mode)
                            + first.bubble_bound(sp))
        return bound + first.min_optimizer_s()

    def _open_family(self, family, bound: float):
        """Queue the family's micro-batch sizes that fit, under the family's bound; the sizes
        that do not fit are counted as pruned by memory."""
        base, mbs, variants, info = family
        fit = info["fit"]
        self.pruned += (len(mbs) - len(fit)) * _count(variants)
        return [(bound, _UNREFINED, self._seq(), (base, mbs[i], variants, info["like"]))
                for i in fit]

    def _expand(self, group, variants: tuple) -> None:
        """Cost the group's variants: for each (sequence parallelism, ZeRO stage), the lightest
        recompute mode that fits; a variant whose own bound cannot enter the top N is skipped
        without costing."""
        zeros, modes, sps = variants
        order = [mode for mode in RECOMPUTE if mode in modes]
        lay = group.base
        for sp in sps:
            for zero in zeros:
                if is_duplicate(zero, zeros, lay.dp * lay.cp, lay.num_micro_batches,
                                lay.rt.sync_for(zero)):
                    self.duplicates += len(order)
                    continue
                for j, mode in enumerate(order):
                    if group.lower_bound(sp, mode) >= self._kth():
                        self.pruned_bound += len(order) - j  # heavier modes are slower still
                        break
                    step, peak = group.quick(zero, mode, sp, self.limit)
                    if step is None:
                        self.pruned += 1
                        self._note_closest(peak, group.variant(zero, mode, sp))
                        continue
                    self.costed += 1
                    self.feasible += 1
                    # Ties keep the layout found first (the sequence number breaks them).
                    entry = (1.0 / step, -peak, -self.costed, group, (zero, mode, sp))
                    if len(self.heap) < self.top:
                        heapq.heappush(self.heap, entry)
                    elif entry[:3] > self.heap[0][:3]:
                        heapq.heapreplace(self.heap, entry)
                    # More recomputation only adds time: the rest of this (zero, sp) is slower.
                    self.pruned_bound += len(order) - j - 1
                    break

    def _note_closest(self, peak: float, lay: Layout) -> None:
        if self.closest is None or peak < self.closest[0]:
            self.closest = (peak, lay)


_FAMILY, _UNREFINED, _GROUP, _COARSE = 0, 1, 2, 3


def is_duplicate(zero: int, zeros: tuple[int, ...], shards: int, num_micro_batches: int,
                 grad_sync: str) -> bool:
    """Whether ZeRO stage ``zero`` is, for this layout, the same plan as a lower stage in
    ``zeros``: with one shard every stage is ZeRO-0 (nothing to shard); with gradients
    reduced once per step over several micro-batches, ZeRO-2 moves and holds what ZeRO-1
    does (the gradients accumulate unsharded either way)."""
    lower = [z for z in zeros if z < zero]
    if not lower:
        return False
    if shards == 1:
        return True
    return zero == 2 and 1 in zeros and grad_sync == "step" and num_micro_batches > 1


def _count(variants: tuple) -> int:
    return len(variants[0]) * len(variants[1]) * len(variants[2])


def _most_saving(modes: tuple[str, ...]) -> str:
    for mode in ("full", "selective", "none"):
        if mode in modes:
            return mode
    raise SpecError("space.recompute", modes, "valid: some of none, selective, full")


# Gradient bucket sizes tried for the ranked plans (MB): DDP's default, Megatron's (40M fp32
# parameters), and larger ones that amortise per-collective latency on large groups.
BUCKETS_MB = (25.0, 160.0, 640.0)


def _best_buckets(ranked: list[Candidate], model: ModelSpec, cluster: ClusterSpec,
                  est: Estimator) -> list[Candidate]:
    """Each ranked plan with the gradient bucket size (``BUCKETS_MB``) that makes it fastest,
    re-ranked. Buckets change only the data-parallel traffic (one collective per bucket), never
    memory, so only the ranked plans need the extra costing."""
    out = []
    for cand in ranked:
        best = cand
        for mb in BUCKETS_MB:
            if mb == cand.plan.comm.bucket_mb:
                continue
            plan = cand.plan.replace(comm=cand.plan.comm.replace(bucket_mb=mb))
            pred = predict(model, cluster, plan, estimator=est)
            if pred.step_time_s < best.prediction.step_time_s * (1 - 1e-9):
                best = Candidate(rank=cand.rank, plan=plan, prediction=pred)
        out.append(best)
    out.sort(key=lambda c: (-c.prediction.tokens_per_s, c.rank))
    return [Candidate(rank=i + 1, plan=c.plan, prediction=c.prediction)
            for i, c in enumerate(out)]


def idle_options(cluster: ClusterSpec, space: SearchSpace) -> list[int]:
    """Device counts to leave idle: 0, then (with ``max_idle_devices``, by default one node's
    worth when the device count has a prime factor above 7, e.g. 127 nodes) whole nodes, or
    single devices on a one-node cluster."""
    n, per_node = cluster.num_devices, cluster.devices_per_node
    limit = space.max_idle_devices
    if limit is None:
        limit = per_node if _largest_prime(n) > 7 else 0
    step = per_node if cluster.num_nodes > 1 else 1
    return [k for k in range(0, min(limit, n - 1) + 1, step)]


def _largest_prime(n: int) -> int:
    largest, p = 1, 2
    while p * p <= n:
        while n % p == 0:
            largest, n = p, n // p
        p += 1
    return max(largest, n) if n > 1 else largest


def layout_plan(lay: Layout, model: ModelSpec, runtime: RuntimeProfile | None = None,
                idle_devices: int = 0) -> Plan:
    """The Plan document of a Layout (uneven stages become Megatron's first/last overrides)."""
    first = last = None
    counts = lay.stage_layers
    if lay.pp > 1 and len(set(counts)) > 1:
        first, last = counts[0], counts[-1]
    # A Layout holds a plan's enumerated fields as plain values (taken from a Plan or from the
    # search's own enumerations); the Plan validates them again.
    return Plan(tp=lay.tp, pp=lay.pp, dp=lay.dp, ep=lay.ep, cp=lay.cp, vp=lay.vp,
                zero=cast(ZeroStage, lay.zero), micro_batch_size=lay.micro_batch_size,
                global_batch_size=lay.global_batch_size, seq_len=lay.seq_len,
                recompute=cast(Recompute, lay.recompute),
                sequence_parallel=lay.sequence_parallel,
                precision=cast(Precision, lay.precision),
                fp8_recipe=cast(Any, lay.rt.fp8_recipe),  # "delayed" unless precision fp8
                fp8_param_gather=lay.rt.fp8_param_gather and lay.zero >= 1,
                pp_schedule=cast(PpSchedule, lay.schedule), pp_first_stage_layers=first,
                pp_last_stage_layers=last, runtime=runtime or RuntimeProfile(), etp=lay.etp,
                idle_devices=idle_devices)


def _candidate(rank: int, model: ModelSpec, cluster: ClusterSpec, lay: Layout, est: Estimator,
               gbs: int, runtime: RuntimeProfile | None = None, idle: int = 0) -> Candidate:
    plan = layout_plan(lay, model, runtime, idle)
    return Candidate(rank=rank, plan=plan, prediction=predict(model, cluster, plan, estimator=est))


def describe(plan: Plan, *, short: bool = False) -> str:
    """Layout text: 'tp=8 pp=16 dp=8 mb=1 zero=1 recompute=full sp'; ``short`` for narrow
    tables: 't8 p16 d8 mb1 z1 full sp'. Axes of size 1 beyond tp, pp and dp are left out."""
    def item(name: str, letter: str, value: object) -> str:
        return f"{letter}{value}" if short else f"{name}={value}"

    parts = [item("tp", "t", plan.tp), item("pp", "p", plan.pp)]
    if plan.vp > 1:
        parts.append(item("vp", "v", plan.vp))
    first, last = plan.pp_first_stage_layers, plan.pp_last_stage_layers
    if first is not None:
        parts[-1] += (f"[{first}|{last}]" if short
                      else f" (first {first}, last {last} layers)")
    parts.append(item("dp", "d", plan.dp))
    parts += [item(name, name[0], size) for name, size in (("ep", plan.ep), ("cp", plan.cp))
              if size > 1]
    if plan.etp is not None:
        parts.append(item("etp", "etp", plan.etp))
    parts += [item("mb", "mb", plan.micro_batch_size), item("zero", "z", plan.zero),
              plan.recompute if short else f"recompute={plan.recompute}"]
    if plan.sequence_parallel:
        parts.append("sp")
    if plan.idle_devices:
        parts.append(f"idle={plan.idle_devices}" if not short else f"i{plan.idle_devices}")
    return " ".join(parts)


_NAMES = {"compute": "compute", "recompute": "recomputation", "tp_comm": "TP communication",
          "pp_comm": "pipeline transfers", "pp_bubble": "pipeline bubble",
          "dp_comm_exposed": "exposed data-parallel traffic", "ep_comm": "expert all-to-all",
          "cp_comm": "context-parallel transfers", "optimizer": "optimizer step"}
_FIELDS = ("tp", "pp", "vp", "dp", "ep", "etp", "cp", "micro_batch_size", "zero", "recompute",
           "sequence_parallel", "pp_first_stage_layers", "idle_devices")


def explain(ranked: list[Candidate]) -> str:
    """One sentence on why the best plan beats the runner-up: the layout fields they differ
    in and the breakdown terms that account for most of the gap."""
    if len(ranked) < 2:
        return "only one plan fits" if ranked else ""
    a, b = ranked[0].prediction, ranked[1].prediction
    diff = [f for f in _FIELDS if getattr(ranked[0].plan, f) != getattr(ranked[1].plan, f)]
    gap = b.step_time_s - a.step_time_s
    deltas = sorted(((b.breakdown_s[k] - a.breakdown_s[k], k) for k in a.breakdown_s),
                    reverse=True)
    gains = [f"{_NAMES[k]} {d:.3g} s shorter" for d, k in deltas if d > 0.05 * abs(gap) and d > 0]
    costs = [f"{_NAMES[k]} {-d:.3g} s longer" for d, k in reversed(deltas)
             if -d > 0.05 * abs(gap) and d < 0]
    fields = ", ".join(f"{f}={getattr(ranked[0].plan, f)} vs {getattr(ranked[1].plan, f)}"
                       for f in diff) or "the same layout fields"
    text = (f"#1 beats #2 by {gap / b.step_time_s:.1%} ({gap:.3g} s/step) with {fields}")
    if gains:
        text += ": " + ", ".join(gains[:2])
    if costs:
        text += "; " + ", ".join(costs[:1]) + " does not cancel it"
    if gap < 1e-9:
        text = f"#1 and #2 tie on step time ({fields}); #1 needs less memory"
    return text + "."


def _shortfall(walk: _Walk, cluster: ClusterSpec, limit: float) -> Shortfall | None:
    if walk.closest is None:
        return None
    peak, lay = walk.closest
    tips = []
    if lay.recompute != "full":
        tips.append("full activation recompute")
    if lay.zero != 3:
        tips.append("ZeRO-3 (zero=3)")
    if lay.micro_batch_size > 1:
        tips.append("micro_batch_size=1")
    need = cluster.num_devices * peak / limit
    per_node = cluster.devices_per_node
    more = math.ceil(need / per_node) * per_node
    tips.append(f"more devices: about {max(more, cluster.num_devices + per_node)} "
                f"(the closest layout is {(peak - limit) / GIB:.1f} GiB over on "
                f"{cluster.num_devices})")
    tips.append("a device with more memory, or a shorter sequence / smaller global batch")
    plan = dict(tp=lay.tp, pp=lay.pp, vp=lay.vp, dp=lay.dp, ep=lay.ep, cp=lay.cp,
                micro_batch_size=lay.micro_batch_size, zero=lay.zero, recompute=lay.recompute,
                sequence_parallel=lay.sequence_parallel, stage_layers=list(lay.stage_layers))
    return Shortfall(plan=plan, peak_gib=peak / GIB, limit_gib=limit / GIB,
                     suggestions=tuple(tips))
