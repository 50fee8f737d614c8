"""Collective times on the cluster tree (``Network``); where groups lie is ``placement.py``.

Bytes are per rank; bandwidths per device and direction (``LinkSpec.bytes_per_s`` includes each
tier's achieved efficiency). For a group with at least ``g`` members on each of its ``N``
nodes, the bandwidth term of a ring collective is the larger of its intra-node part and its
inter-node part, whose traffic a node's ``g`` NICs share (NCCL's rail-aligned rings, one NIC
per member): all-reduce ``max(2(g-1)/g S/B_intra, 2(N-1)/N S/(g B_inter))``, reduce-scatter and
all-gather half of it; ``hierarchical=True`` runs intra reduce-scatter, inter all-reduce and
intra all-gather one after another (the phases add). Groups spanning racks use the inter-rack
tier (same bandwidth in a non-blocking fat tree, more latency).

NCCL (and RCCL / HCCL, which follow it) picks, per call, the algorithm and protocol its tuner
predicts fastest; we follow its model (``nccl/src/graph/tuning.cc``): a latency of
``base + intra steps x intra hop + inter steps x network hop`` and the bandwidth term above
scaled by the protocol's achievable share, for ring (all collectives: ``n-1`` steps per pass,
``N-1`` of them crossing nodes) and tree (all-reduce only: ``2((g-1) intra + log2 N network)``
hops, the whole buffer over each node's NICs up and down the tree), each with the LL, LL128 and
Simple protocols. Its latency constants (microseconds) are NCCL's own measured defaults, not
fitted here. ``comm.algorithm`` forces ring or tree (NCCL_ALGO). A cluster whose collectives
were measured (``network.measured_busbw``: nccl-tests bus bandwidth of whole-node communicators
by node count) has each tier capped at the per-device rate the measurement implies
(``Network.measured_bw``), so a fabric that degrades with scale is priced as measured.

Gloo (``collective_library: gloo``, the default for the ``cpu`` family) runs one ring over all
ranks in rank order with no aggregation of a node's NICs: ``2(n-1) (alpha + S/(n B))`` for an
all-reduce over the slowest edge, ``(n-1)(...)`` for an all-gather; its reduce-scatter costs an
all-reduce (docs/comm.md); ``hierarchical`` is the runtime's staged all-reduce
(``runtime/comm/hierarchical.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from trainpilot.perf.placement import GroupSpan, Placement  # noqa: F401 (re-exported)
from trainpilot.specs import ClusterSpec, LinkSpec

# NCCL's tuning constants (tuning.cc): base latency and per-hop latency (us) per algorithm and
# protocol (LL, LL128, Simple); the share of the link bandwidth each protocol reaches.
_BASE_US = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 0.0)}
_HOP_NVLINK_US = {"ring": (0.47, 1.9, 3.4), "tree": (0.52, 1.25, 28.0)}
_HOP_NET_US = {"ring": (2.7, 4.0, 9.6), "tree": (5.0, 8.5, 50.0)}
_RING_BW = (0.25, 0.92, 1.0)  # LL moves 8-byte words with 4-byte flags; LL128 120 of 128 bytes
_TREE_BW = (0.9 / 3.8, 0.9 * 0.915, 0.9)
AR, RS, AG = "all_reduce", "reduce_scatter", "all_gather"


@dataclass(frozen=True)
class Network:
    """The three tiers' effective bandwidth (bytes/s) and latency (s), the collective
    library whose algorithms run on them, and the algorithm choice (auto, ring, tree)."""

    intra_bw: float
    intra_lat: float
    inter_bw: float
    inter_lat: float
    rack_bw: float
    rack_lat: float
    library: str = "nccl"
    algorithm: str = "auto"
    # Measured bus bandwidth (ClusterSpec network.measured_busbw): per collective kind, the
    # (nodes, bytes/s) points, and the node size they were measured with.
    measured: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    devices_per_node: int = 1

    @classmethod
    def of(cls, cluster: ClusterSpec, default_library: str = "nccl") -> Network:
        """The cluster's tiers; the library is the cluster's ``collective_library`` if set,
        else ``default_library`` (the device family's, from its efficiency data)."""
        def bw_lat(link: LinkSpec) -> tuple[float, float]:
            return link.bytes_per_s, link.latency_us * 1e-6

        ib, il = bw_lat(cluster.network.intra_node)
        nb, nl = bw_lat(cluster.network.inter_node)
        rb, rl = bw_lat(cluster.inter_rack)
        found = cluster.network.measured_busbw
        measured = tuple((kind, tuple((n, gb * 1e9) for n, gb in getattr(found, kind)))
                         for kind in (AR, AG, RS) if found is not None and getattr(found, kind))
        return cls(ib, il, nb, nl, rb, rl,
                   cluster.network.collective_library or default_library,
                   measured=measured, devices_per_node=cluster.devices_per_node)

    def with_algorithm(self, algorithm: str) -> Network:
        if algorithm == self.algorithm:
            return self
        return replace(self, algorithm=algorithm)

    def measured_bw(self, kind: str, nodes: int) -> float | None:
        """The per-device bandwidth a measured bus bandwidth implies for a ``kind`` collective
        over ``nodes`` nodes (None: not measured). One node: the bus bandwidth itself (a ring
        inside a node moves ``(g-1)/g`` of the data over each device's link). N nodes of ``d``
        devices, ``n = N d`` ranks: nccl-tests times ``S`` bytes in ``t = f S / busbw`` (``f =
        2(n-1)/n`` for an all-reduce, ``(n-1)/n`` otherwise), which the ring's inter-node term
        ``passes (N-1)/N S / (d bw)`` matches at ``bw = busbw ((N-1)/N) / (d (n-1)/n)``.
        Between measured node counts the bus bandwidth is interpolated in log N."""
        if not self.measured:
            return None
        points = dict(self.measured).get(kind)
        if not points:
            return None
        if nodes <= 1:
            return next((b for n, b in points if n == 1), None)
        inter = [(n, b) for n, b in points if n >= 2]
        if not inter:
            return None
        if nodes <= inter[0][0]:
            busbw = inter[0][1]
        elif nodes >= inter[-1][0]:
            busbw = inter[-1][1]
        else:
            (n0, b0), (n1, b1) = next((a, b) for a, b in zip(inter, inter[1:]) if b[0] >= nodes)
            w = math.log(nodes / n0) / math.log(n1 / n0)
            busbw = math.exp(math.log(b0) + w * (math.log(b1) - math.log(b0)))
        d = self.devices_per_node
        n = nodes * d
        return busbw * ((nodes - 1) / nodes) / (d * (n - 1) / n)

    @property
    def single_ring(self) -> bool:
        """Gloo: one ring over all ranks, no multi-NIC aggregation."""
        return self.library == "gloo"

    def _outer(self, span: GroupSpan) -> tuple[float, float]:
        return (self.rack_bw, self.rack_lat) if span.racks > 1 else (self.inter_bw, self.inter_lat)

    def all_reduce_s(self, span: GroupSpan, num_bytes: float, *,
                     hierarchical: bool = False) -> float:
        """All-reduce of a ``num_bytes`` buffer on every rank of ``span``."""
        return self._collective(span, num_bytes, AR, hierarchical)

    def reduce_scatter_s(self, span: GroupSpan, num_bytes: float, *,
                         hierarchical: bool = False) -> float:
        """Reduce-scatter of a ``num_bytes`` input buffer (each rank keeps 1/n); on gloo an
        all-reduce."""
        return self._collective(span, num_bytes, AR if self.single_ring else RS, hierarchical)

    def all_gather_s(self, span: GroupSpan, num_bytes: float, *,
                     hierarchical: bool = False) -> float:
        """All-gather into a ``num_bytes`` output buffer (each rank contributes 1/n)."""
        return self._collective(span, num_bytes, AG, hierarchical)

    def latency_s(self, span: GroupSpan, kind: str = AR) -> float:
        """The time of a collective too small for bandwidth to matter (one extra bucket)."""
        return self._collective(span, 1.0, kind, False)

    def _collective(self, span: GroupSpan, num_bytes: float, kind: str,
                    hierarchical: bool) -> float:
        n = span.size
        if n <= 1 or num_bytes <= 0:
            return 0.0
        if self.single_ring:
            return self._ring_s(span, num_bytes, 2.0 if kind == AR else 1.0, hierarchical)
        passes = 2.0 if kind == AR else 1.0
        g, nodes = span.per_node, span.nodes
        intra_bw = min(self.intra_bw, self.measured_bw(kind, 1) or math.inf)
        intra = passes * (g - 1) / g * num_bytes / intra_bw if g > 1 else 0.0
        inter = 0.0
        bw = math.inf
        if nodes > 1:
            bw = min(self._outer(span)[0], self.measured_bw(kind, nodes) or math.inf)
            inter = passes * (nodes - 1) / nodes * num_bytes / (g * bw)
        bw_term = intra + inter if hierarchical else max(intra, inter)
        best = math.inf
        if self.algorithm in ("auto", "ring") or kind != AR or nodes == 1:
            best = self._ring_best(span, kind, bw_term, num_bytes)
        if kind == AR and nodes > 1 and self.algorithm in ("auto", "tree"):
            tree_bw = max(intra, 2 * num_bytes / (g * bw)) if not hierarchical else \
                intra + 2 * num_bytes / (g * bw)
            best = min(best, self._tree_best(span, tree_bw))
        return best

    def _ring_best(self, span: GroupSpan, kind: str, bw_term: float, num_bytes: float) -> float:
        n, nodes = span.size, span.nodes
        steps = 2 * (n - 1) if kind == AR else n - 1
        inter_steps = (2 * (nodes - 1) if kind == AR else nodes - 1) if nodes > 1 else 0
        rack = 2.0 if span.racks > 1 else 1.0  # spine hops: NCCL does not model them; we do
        best = math.inf
        for p in range(3):
            hop = _HOP_NVLINK_US["ring"][p] * (1.8 if nodes > 1 and p == 0 else 1.0)
            lat = _BASE_US["ring"][p] + (steps - inter_steps) * hop + \
                inter_steps * _HOP_NET_US["ring"][p] * rack
            if p == 2 and kind == AR and nodes > 1 and num_bytes >= n / 16 * 65536:
                lat *= 1.9  # NCCL's "plateau effect of ring"
            factor = _RING_BW[p]
            if p == 1 and span.per_node < 2 and nodes > 1:
                factor = 0.7
            best = min(best, lat * 1e-6 + bw_term / factor)
        return best

    def _tree_best(self, span: GroupSpan, bw_term: float) -> float:
        g, nodes = span.per_node, span.nodes
        rack = 2.0 if span.racks > 1 else 1.0
        depth = math.ceil(math.log2(nodes))
        best = math.inf
        for p in range(3):
            lat = _BASE_US["tree"][p] + 2 * ((g - 1) * _HOP_NVLINK_US["tree"][p] +
                                             depth * _HOP_NET_US["tree"][p] * rack)
            best = min(best, lat * 1e-6 + bw_term / _TREE_BW[p])
        return best

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

    def all_to_all_s(self, span: GroupSpan, num_bytes: float, *,
                     remote_share: float | None = None,
                     intra_share: float | None = None) -> float:
        """All-to-all where each rank holds ``num_bytes`` spread over the group. The share
        that leaves the node goes over the device's own NIC: ``(n-g)/n`` for a uniform
        exchange, ``remote_share`` when the dispatcher sends less (DeepEP's one copy per
        destination node); the share that crosses NVLink is ``(g-1)/n``, or ``intra_share``
        (DeepEP's one copy per destination GPU)."""
        n = span.size
        if n <= 1 or num_bytes <= 0:
            return 0.0
        g = span.per_node
        intra = ((g - 1) / n if intra_share is None else intra_share) * num_bytes / self.intra_bw
        if span.nodes == 1:
            return intra + self.intra_lat
        bw, hop = self._outer(span)
        share = (n - g) / n if remote_share is None else remote_share
        inter = share * num_bytes / bw
        return max(intra, inter) + hop + self.intra_lat

    def p2p_s(self, span: GroupSpan, num_bytes: float) -> float:
        """One point-to-point transfer between neighbours of ``span`` (pipeline stages)."""
        if span.size <= 1 or num_bytes <= 0:
            return 0.0
        if span.nodes <= 1:
            return num_bytes / self.intra_bw + self.intra_lat
        bw, hop = self._outer(span)
        return num_bytes / bw + hop
