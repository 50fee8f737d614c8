"""Placement of parallel groups on the cluster tree, and collective times on that tree.

Rank order, innermost first: ``tp`` (inside a node), ``cp``, the part of ``dp`` that expert
parallelism needs (``dp_ep``, so an EP group is a compact block of nodes), ``pp``, then the rest
of ``dp`` (outermost). A rank r sits on node ``r // devices_per_node``, rack
``node // nodes_per_rack``.

Collectives (bytes are per rank; bandwidths per device and direction, ``LinkSpec.bytes_per_s``
already includes the tier's achieved efficiency):

* inside one node, ring: all-reduce ``2(n-1)/n * S / B_intra``; reduce-scatter and all-gather
  ``(n-1)/n * S / B_intra``;
* across nodes with ``g`` group members per node (NCCL's rail-aligned rings, one NIC per member):
  the inter-node bandwidth term is ``2(N-1)/N * S / (g * B_inter)`` for all-reduce over ``N``
  nodes, pipelined with the intra-node part (we take the max); ``hierarchical=True`` runs the
  three phases (intra reduce-scatter, inter all-reduce, intra all-gather) one after another;
* latency: all-reduce ``2(g-1)`` intra hops plus a tree across nodes (``2 ceil(log2 N)``
  inter hops: NCCL's tree algorithm at scale); reduce-scatter and all-gather run as rings,
  ``n-1`` steps each paying the slowest hop's latency;
* all-to-all: the ``(n-g)/n`` share that leaves the node goes over the device's own NIC;
* groups spanning racks use the inter-rack tier (same bandwidth in a non-blocking fat tree,
  more latency).

Those are NCCL's (and RCCL's, HCCL's) algorithms. Gloo (``collective_library: gloo``, the
default for the ``cpu`` device family) runs one ring over all ranks in rank order, with no
aggregation of a node's NICs: a ring step moves ``S/n`` over every edge at once and waits for
the slowest (an inter-node edge as soon as the group spans nodes), each step paying that edge's
per-message latency. All-reduce ``2(n-1) (alpha + S/(n B))``; all-gather ``(n-1) (alpha +
S/(n B))``; reduce-scatter costs an all-reduce (gloo's ``reduce_scatter`` all-reduces and keeps
a slice: measured 1.5 x the payload on the wire at 4 ranks, docs/comm.md). ``hierarchical``
is the runtime's staged all-reduce (``runtime/comm/hierarchical.py``): an all-to-all inside the
node (the reduce-scatter), a ring all-reduce of ``S/g`` among the ranks of the same local index
(each on its own link), a ring all-gather inside the node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from trainpilot.specs import ClusterSpec, LinkSpec, Plan

AXES = ("tp", "cp", "dp_ep", "pp", "dp")


class GroupSpan(NamedTuple):
    """Where one parallel group lies: ``size`` ranks, ``per_node`` of them in each of ``nodes``
    nodes, over ``racks`` racks. (A named tuple: spans key the estimator's caches on the
    search's hot path, and a tuple hashes in C.)"""

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


def axis_sizes(plan: Plan) -> dict[str, int]:
    """Sizes of the rank axes (innermost first). ``dp_ep`` is the smallest part of dp that,
    with cp, holds a whole EP group."""
    dp_ep = plan.ep // math.gcd(plan.ep, plan.cp)
    return dict(tp=plan.tp, cp=plan.cp, dp_ep=dp_ep, pp=plan.pp, dp=plan.dp // dp_ep)


@lru_cache(maxsize=4096)
def _span(strides_counts: tuple[tuple[int, int], ...], per_node: int,
          nodes_per_rack: int) -> GroupSpan:
    ranks = [0]
    for stride, count in strides_counts:
        ranks = [r + i * stride for r in ranks for i in range(count)]
    nodes = {r // per_node for r in ranks}
    racks = {n // nodes_per_rack for n in nodes}
    return GroupSpan(len(ranks), len(ranks) // len(nodes), len(nodes), len(racks))


@lru_cache(maxsize=1024)
def _span_of(ranks: tuple[int, ...], per_node: int, nodes_per_rack: int) -> GroupSpan:
    nodes = {r // per_node for r in ranks}
    racks = {n // nodes_per_rack for n in nodes}
    return GroupSpan(len(ranks), max(1, len(ranks) // len(nodes)), len(nodes), len(racks))


@dataclass(frozen=True)
class Placement:
    """Rank -> (rack, node, device) and the span of each parallel group of rank 0."""

    sizes: tuple[tuple[str, int], ...]
    devices_per_node: int
    nodes_per_rack: int

    @classmethod
    def of(cls, plan: Plan, cluster: ClusterSpec) -> Placement:
        return cls.from_sizes(tuple(axis_sizes(plan).items()), cluster.devices_per_node,
                              int(cluster.nodes_per_rack))

    @classmethod
    def from_sizes(cls, sizes: tuple[tuple[str, int], ...], devices_per_node: int,
                   nodes_per_rack: int) -> Placement:
        return cls(sizes, devices_per_node, nodes_per_rack)

    def _strides(self) -> dict[str, tuple[int, int]]:
        out, stride = {}, 1
        for name, size in self.sizes:
            out[name] = (stride, size)
            stride *= size
        return out

    def span(self, *axes: str) -> GroupSpan:
        """Span of the group that varies ``axes`` (others fixed at rank 0's coordinates)."""
        strides = self._strides()
        key = tuple(strides[a] for a in axes if strides[a][1] > 1)
        return _span(key, self.devices_per_node, self.nodes_per_rack)

    def _group_ranks(self, axes: tuple[str, ...]) -> list[int]:
        strides = self._strides()
        ranks = [0]
        for name in axes:
            stride, count = strides[name]
            ranks = [r + i * stride for i in range(count) for r in ranks]
        return ranks

    def span_prefix(self, axes: tuple[str, ...], count: int) -> GroupSpan:
        """Span of the first ``count`` ranks of the group varying ``axes`` (an HSDP shard
        group)."""
        ranks = self._group_ranks(axes)[:count]
        return _span_of(tuple(ranks), self.devices_per_node, self.nodes_per_rack)

    def span_stride(self, axes: tuple[str, ...], step: int) -> GroupSpan:
        """Span of every ``step``-th rank of the group varying ``axes`` (an HSDP replica
        group)."""
        ranks = self._group_ranks(axes)[::step]
        return _span_of(tuple(ranks), self.devices_per_node, self.nodes_per_rack)

    def groups(self, ep: int) -> dict[str, GroupSpan]:
        """The spans of the tp, cp, ep, pp and (gradient) dp groups."""
        sizes, strides = dict(self.sizes), self._strides()
        out = dict(tp=self.span("tp"), cp=self.span("cp"), pp=self.span("pp"),
                   dp=self.span("cp", "dp_ep", "dp"))
        # EP ranks: `ep` consecutive ranks of the (cp, dp_ep) block, at stride tp.
        tp, block = sizes["tp"], sizes["cp"] * sizes["dp_ep"]  # block = lcm(ep, cp)
        key = ((tp, ep),) if ep > 1 else ()
        out["ep"] = _span(key, self.devices_per_node, self.nodes_per_rack)
        # Expert parameters are reduced over the ranks holding the same experts: the same slot
        # of every EP group (stride tp*ep inside the block, then across outer dp replicas).
        key = tuple(sc for sc in ((tp * ep, block // ep), strides["dp"]) if sc[1] > 1)
        out["expert_dp"] = _span(key, self.devices_per_node, self.nodes_per_rack)
        return out

    def coords(self, rank: int) -> dict[str, int]:
        out = {}
        for name, size in self.sizes:
            out[name] = rank % size
            rank //= size
        return out

    def rank_map(self, limit: int | None = None) -> list[dict[str, int]]:
        """``[{rank, rack, node, device, tp, cp, dp, pp}, ...]`` for the first ``limit`` ranks."""
        total = math.prod(size for _, size in self.sizes)
        rows = []
        for rank in range(total if limit is None else min(limit, total)):
            node = rank // self.devices_per_node
            c = self.coords(rank)
            dp = c["dp"] * dict(self.sizes)["dp_ep"] + c["dp_ep"]
            rows.append(dict(rank=rank, rack=node // self.nodes_per_rack, node=node,
                             device=rank % self.devices_per_node, tp=c["tp"], cp=c["cp"],
                             dp=dp, pp=c["pp"]))
        return rows


@dataclass(frozen=True)
class Network:
    """The three tiers' effective bandwidth (bytes/s) and latency (s), and the collective
    library whose algorithms run on them."""

    intra_bw: float
    intra_lat: float
    inter_bw: float
    inter_lat: float
    rack_bw: float
    rack_lat: float
    library: str = "nccl"

    @classmethod
    def of(cls, cluster: ClusterSpec, default_library: str = "nccl") -> Network:
        """The cluster's tiers; the library is the cluster's ``collective_library`` if set,
        else ``default_library`` (the device family's, from its efficiency data)."""
        def bw_lat(link: LinkSpec) -> tuple[float, float]:
            return link.bytes_per_s, link.latency_us * 1e-6

        ib, il = bw_lat(cluster.network.intra_node)
        nb, nl = bw_lat(cluster.network.inter_node)
        rb, rl = bw_lat(cluster.inter_rack)
        return cls(ib, il, nb, nl, rb, rl,
                   cluster.network.collective_library or default_library)

    @property
    def single_ring(self) -> bool:
        """Gloo: one ring over all ranks, no multi-NIC aggregation."""
        return self.library == "gloo"

    def _outer(self, span: GroupSpan) -> tuple[float, float]:
        return (self.rack_bw, self.rack_lat) if span.racks > 1 else (self.inter_bw, self.inter_lat)

    def all_reduce_s(self, span: GroupSpan, num_bytes: float, *,
                     hierarchical: bool = False) -> float:
        """All-reduce of a ``num_bytes`` buffer on every rank of ``span``."""
        return self._reduce_like(span, num_bytes, 2.0, hierarchical)

    def reduce_scatter_s(self, span: GroupSpan, num_bytes: float, *,
                         hierarchical: bool = False) -> float:
        """Reduce-scatter of a ``num_bytes`` input buffer (each rank keeps 1/n); on gloo an
        all-reduce."""
        return self._reduce_like(span, num_bytes, 2.0 if self.single_ring else 1.0,
                                 hierarchical)

    def all_gather_s(self, span: GroupSpan, num_bytes: float, *,
                     hierarchical: bool = False) -> float:
        """All-gather into a ``num_bytes`` output buffer (each rank contributes 1/n)."""
        return self._reduce_like(span, num_bytes, 1.0, hierarchical)

    def _reduce_like(self, span: GroupSpan, num_bytes: float, passes: float,
                     hierarchical: bool) -> float:
        n = span.size
        if n <= 1 or num_bytes <= 0:
            return 0.0
        if self.single_ring:
            return self._ring_s(span, num_bytes, passes, hierarchical)
        g, nodes = span.per_node, span.nodes
        intra = passes * (g - 1) / g * num_bytes / self.intra_bw if g > 1 else 0.0
        if nodes == 1:
            return intra + (n - 1) * passes * self.intra_lat
        bw, hop = self._outer(span)
        inter = passes * (nodes - 1) / nodes * num_bytes / (g * bw)
        if passes == 2.0:  # all-reduce: tree across nodes
            lat = 2 * (g - 1) * self.intra_lat + 2 * math.ceil(math.log2(nodes)) * hop
        elif hierarchical:  # ring inside the node, ring over the node leaders
            lat = (g - 1) * self.intra_lat + (nodes - 1) * hop
        else:  # one ring over all n ranks: each step waits for its slowest (inter-node) hop
            lat = (n - 1) * hop
        return (intra + inter if hierarchical else max(intra, inter)) + lat

    def _ring_s(self, span: GroupSpan, num_bytes: float, passes: float,
                hierarchical: bool) -> float:
        """Gloo: ``passes * (n-1)`` ring steps of ``S/n`` over the slowest edge; hierarchical
        all-reduce as the runtime's staged one (see the module docstring)."""
        n, g, nodes = span.size, span.per_node, span.nodes
        bw, lat = (self.intra_bw, self.intra_lat) if nodes <= 1 else self._outer(span)
        if not (hierarchical and passes == 2.0 and nodes > 1 and g > 1):
            return passes * (n - 1) * (lat + num_bytes / (n * bw))
        piece = num_bytes / g  # what each rank owns after the intra-node all-to-all
        scatter = (g - 1) / g * num_bytes / self.intra_bw + self.intra_lat
        across = 2 * (nodes - 1) * (lat + piece / (nodes * bw))
        gather = (g - 1) * (self.intra_lat + piece / self.intra_bw)
        return scatter + across + gather

    def all_to_all_s(self, span: GroupSpan, num_bytes: float) -> float:
        """All-to-all where each rank holds ``num_bytes`` spread evenly over the group."""
        n = span.size
        if n <= 1 or num_bytes <= 0:
            return 0.0
        g = span.per_node
        intra = (g - 1) / n * num_bytes / self.intra_bw
        if span.nodes == 1:
            return intra + self.intra_lat
        bw, hop = self._outer(span)
        inter = (n - g) / n * num_bytes / bw
        return max(intra, inter) + hop + self.intra_lat

    def p2p_s(self, span: GroupSpan, num_bytes: float) -> float:
        """One point-to-point transfer between neighbours of ``span`` (pipeline stages)."""
        if span.size <= 1 or num_bytes <= 0:
            return 0.0
        if span.nodes <= 1:
            return num_bytes / self.intra_bw + self.intra_lat
        bw, hop = self._outer(span)
        return num_bytes / bw + hop
