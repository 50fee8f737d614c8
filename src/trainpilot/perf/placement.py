"""Where each parallel group lies on the cluster tree, for every group of every axis.

Ranks are mixed-radix numbers over the plan's axes in its rank order (innermost first):
``tp-cp-ep-pp-dp`` (trainpilot's default: ``tp``, ``cp``, the part of ``dp`` an expert group
needs (``dp_ep``), ``pp``, the rest of ``dp``) or ``tp-cp-ep-dp-pp`` (Megatron-Core's default:
pipeline stages outermost). Rank r sits on node ``r // devices_per_node``, rack
``node // nodes_per_rack``.

A group is a set of (stride, count) digits: its members are ``base + sum_k i_k stride_k``, and
the groups of one kind are the translates that tile the ranks. A collective runs at the pace of
its slowest member, so each kind of group is priced by the worst span over all its groups:
the most nodes and racks it touches and the fewest members on any one of its nodes (the
node whose NICs carry the most of the group's inter-node traffic per member). When every digit
is aligned with the node and rack sizes all translates look alike and one is enough; otherwise
(tp = 6 on 8-device nodes) every group is looked at.

Expert layers may re-map the ranks of each pipeline stage (MoE parallel folding, Megatron-Core's
``--expert-tensor-parallel-size``): the stage's ranks, in rank order, are split as
``etp x ep x edp`` (innermost first). With ``etp`` unset it equals ``tp``, which is the classic
layout (EP groups inside ``dp x cp``, expert TP = TP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from trainpilot.specs import SpecError

Digits = tuple[tuple[int, int], ...]  # (stride, count) pairs, innermost first


class GroupSpan(NamedTuple):
    """Where one kind of parallel group lies (its worst member group): ``size`` ranks, at
    least ``per_node`` of them on each of its ``nodes`` nodes, over ``racks`` racks. (A named
    tuple: spans key the estimator's caches on the search's hot path.)"""

    size: int
    per_node: int
    nodes: int
    racks: int

    @property
    def tier(self) -> str:
        if self.size <= 1:
            return "none"
        if self.nodes <= 1:
            return "intra_node"
        return "inter_rack" if self.racks > 1 else "inter_node"

    def to_dict(self) -> dict:
        return dict(size=self.size, per_node=self.per_node, nodes=self.nodes, racks=self.racks,
                    tier=self.tier)


def _aligned(digits: Digits, unit: int) -> bool:
    """Whether every translate of the group meets ``unit``-sized blocks (nodes or racks) the
    same way: each digit either steps over whole blocks, or stays inside one, or tiles a
    whole number of them evenly."""
    for stride, count in digits:
        extent = stride * count
        if stride % unit == 0 or unit % extent == 0 or (unit % stride == 0 and
                                                         extent % unit == 0):
            continue
        return False
    return True


def _members(digits: Digits) -> list[int]:
    ranks = [0]
    for stride, count in digits:
        ranks = [r + i * stride for i in range(count) for r in ranks]
    return ranks


def _stats(ranks: list[int], per_node: int, per_rack: int) -> tuple[int, int, int]:
    counts: dict[int, int] = {}
    for r in ranks:
        node = r // per_node
        counts[node] = counts.get(node, 0) + 1
    racks = {node // per_rack for node in counts}
    return len(counts), min(counts.values()), len(racks)


@lru_cache(maxsize=8192)
def worst_span(digits: Digits, world: int, per_node: int, nodes_per_rack: int) -> GroupSpan:
    """The worst span over every group with these digits among ``world`` ranks."""
    digits = tuple(d for d in digits if d[1] > 1)
    members = _members(digits)
    size = len(members)
    per_rack = max(1, nodes_per_rack)
    if size <= 1:
        return GroupSpan(1, 1, 1, 1)
    rack_ranks = per_node * per_rack
    if _aligned(digits, per_node) and (world <= rack_ranks or _aligned(digits, rack_ranks)):
        nodes, least, racks = _stats(members, per_node, per_rack)
        return GroupSpan(size, least, nodes, racks)
    covered = bytearray(world)
    worst_nodes = worst_racks = 0
    worst_least = size
    seen: set[int] = set()
    for base in range(world):
        if covered[base]:
            continue
        ranks = [base + m for m in members]
        for r in ranks:
            covered[r] = 1
        key = base % (rack_ranks if world > rack_ranks else per_node)
        if key in seen:
            continue
        seen.add(key)
        nodes, least, racks = _stats(ranks, per_node, per_rack)
        worst_nodes, worst_racks = max(worst_nodes, nodes), max(worst_racks, racks)
        worst_least = min(worst_least, least)
    return GroupSpan(size, worst_least, worst_nodes, worst_racks)


def split_digits(digits: Digits, sizes: tuple[int, ...], *, field: str = "plan.etp"
                 ) -> list[Digits]:
    """Split a mixed-radix index (``digits``, innermost first) into consecutive axes of
    ``sizes`` (innermost first), dividing a digit where an axis ends inside it. SpecError when
    an axis does not fall on the digits (etp x ep not a product of the stage's factors)."""
    queue = [d for d in digits if d[1] > 1]
    out = []
    for size in sizes:
        axis, need = [], size
        while need > 1:
            if not queue:
                raise SpecError(field, size, "expert axes larger than the ranks of a stage")
            stride, count = queue.pop(0)
            if need % count == 0:
                axis.append((stride, count))
                need //= count
            elif count % need == 0:
                axis.append((stride, need))
                queue.insert(0, (stride * need, count // need))
                need = 1
            else:
                raise SpecError(field, size, f"etp x ep x edp does not factor over the stage's "
                                f"rank digits {digits}; valid: sizes that divide them in order")
        out.append(tuple(axis))
    return out


@dataclass(frozen=True)
class Placement:
    """The rank digits of a layout and the spans of all its groups."""

    sizes: tuple[tuple[str, int], ...]  # (axis, size) in rank order, innermost first
    devices_per_node: int
    nodes_per_rack: int
    etp: int = 0  # expert tensor parallel size (0: same as tp)
    ep: int = 1

    @classmethod
    def build(cls, *, tp: int, cp: int, dp: int, pp: int, ep: int, etp: int | None,
              order: str, devices_per_node: int, nodes_per_rack: int) -> Placement:
        """Digits for ``order``; ``dp_ep`` is the smallest part of dp that, with tp and cp,
        holds a whole expert group, so expert groups are compact blocks of nodes."""
        etp_ = etp or tp
        block = etp_ * ep
        dp_ep = math.lcm(block, tp * cp) // (tp * cp) if block > 1 else 1
        if dp % dp_ep:
            dp_ep = 1
        if order == "tp-cp-ep-dp-pp":
            sizes = (("tp", tp), ("cp", cp), ("dp_ep", dp_ep), ("dp", dp // dp_ep), ("pp", pp))
        else:
            sizes = (("tp", tp), ("cp", cp), ("dp_ep", dp_ep), ("pp", pp), ("dp", dp // dp_ep))
        return cls(sizes, devices_per_node, nodes_per_rack, etp_, ep)

    @classmethod
    def of(cls, plan, cluster) -> Placement:
        """The placement of ``plan`` (a Plan) on ``cluster``."""
        return cls.build(tp=plan.tp, cp=plan.cp, dp=plan.dp, pp=plan.pp, ep=plan.ep,
                         etp=plan.etp, order=plan.rank_order,
                         devices_per_node=cluster.devices_per_node,
                         nodes_per_rack=cluster.rack_nodes)

    @property
    def world(self) -> int:
        return math.prod(size for _, size in self.sizes)

    def digits(self, *axes: str) -> Digits:
        out, stride = [], 1
        for name, size in self.sizes:
            if name in axes:
                out.append((stride, size))
            stride *= size
        return tuple(out)

    def span_of(self, digits: Digits) -> GroupSpan:
        return worst_span(digits, self.world, self.devices_per_node, self.nodes_per_rack)

    def span(self, *axes: str) -> GroupSpan:
        """Worst span of the groups that vary ``axes``."""
        return self.span_of(self.digits(*axes))

    def expert_digits(self) -> tuple[Digits, Digits, Digits]:
        """(etp, ep, edp) digits: the stage's ranks (every axis but pp, in rank order) split
        as etp x ep x edp."""
        stage = self.digits("tp", "cp", "dp_ep", "dp")
        total = math.prod(c for _, c in stage)
        edp = total // (self.etp * self.ep)
        return tuple(split_digits(stage, (self.etp, self.ep, edp)))  # type: ignore[return-value]

    def groups(self, ep: int | None = None) -> dict[str, GroupSpan]:
        """The spans of the tp, cp, pp, dense-gradient dp, ep, expert tp and expert dp
        groups (``ep``: ignored, the placement knows it)."""
        out = dict(tp=self.span("tp"), cp=self.span("cp"), pp=self.span("pp"),
                   dp=self.span("cp", "dp_ep", "dp"))
        etp_digits, ep_digits, edp_digits = self.expert_digits()
        out["ep"] = self.span_of(ep_digits)
        out["etp"] = self.span_of(etp_digits)
        out["expert_dp"] = self.span_of(edp_digits)
        return out

    def sub_span(self, axes: tuple[str, ...], count: int, *, stride_part: bool) -> GroupSpan:
        """HSDP: the first ``count`` ranks of the group varying ``axes`` (the shard group), or
        every ``count``-th (``stride_part``: the replica group)."""
        digits = split_digits(self.digits(*axes), (count,), field="plan.dp_shard")[0]
        if not stride_part:
            return self.span_of(digits)
        inner = math.prod(c for _, c in digits)
        rest = [d for d in self.digits(*axes)]
        total = math.prod(c for _, c in rest)
        outer = split_digits(tuple(rest), (inner, total // inner), field="plan.dp_shard")[1]
        return self.span_of(outer)

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, size in self.sizes:
            out[name] = rank % size
            rank //= size
        return out

    def rank_map(self, limit: int | None = None) -> list[dict[str, int]]:
        """``[{rank, rack, node, device, tp, cp, dp, pp}, ...]`` for the first ``limit`` ranks."""
        total = self.world
        sizes = dict(self.sizes)
        rows = []
        for rank in range(total if limit is None else min(limit, total)):
            node = rank // self.devices_per_node
            c = self.coords(rank)
            dp = c["dp"] * sizes["dp_ep"] + c["dp_ep"]
            rows.append(dict(rank=rank, rack=node // self.nodes_per_rack, node=node,
                             device=rank % self.devices_per_node, tp=c["tp"], cp=c["cp"],
                             dp=dp, pp=c["pp"]))
        return rows
