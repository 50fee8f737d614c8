"""Where the ranks of a process group sit on a ClusterSpec, and the subgroups that follow from it.

Global rank ``g`` runs on node ``g // devices_per_node`` (torchrun's default placement: ranks fill
a node before the next); node ``n`` is in rack ``n // nodes_per_rack``. A process group (the
whole world, or a data-parallel group of a larger layout) then has three coordinates per rank:

* ``local``  - its position among the group's ranks on the same node,
* ``node``   - the position of its node among the group's nodes in the same rack,
* ``rack``   - the position of its rack among the group's racks.

A hierarchical all-reduce reduce-scatters along ``local`` (inside a node), then along ``node``
(across the nodes of a rack), all-reduces along ``rack``, and all-gathers back. Levels of size 1
are dropped, so a single-rack job is the classic intra-node reduce-scatter / inter-node
all-reduce among ranks with the same local rank / intra-node all-gather.

The pure part (``rank_layout``, ``hierarchy_partitions``) has no process group and is what the
tier-1 tests check; ``build_groups`` creates the torch.distributed subgroups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainpilot.specs.cluster import ClusterSpec
from trainpilot.specs.errors import SpecError

if TYPE_CHECKING:
    import torch.distributed as dist

LEVELS = ("local", "node", "rack")  # innermost first


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """Coordinates of every rank of a process group, in group-rank order.

    Invariant: the coordinates form a full grid of ``sizes`` (same count of the group's ranks on
    every node it uses, same count of nodes in every rack it uses), so every subgroup of one
    level has the same size.
    """

    ranks: tuple[int, ...]  # global ranks, in group-rank order
    coords: tuple[tuple[int, int, int], ...]  # (local, node, rack) per group rank
    sizes: tuple[int, int, int]  # extent along (local, node, rack)


def rank_layout(cluster: ClusterSpec, ranks: list[int] | tuple[int, ...]) -> RankLayout:
    """Place the global ``ranks`` of a process group on ``cluster``.

    Raises SpecError when a rank lies outside the cluster or the group does not form a full grid
    (e.g. 3 of its ranks on one node and 1 on another), which a hierarchical all-reduce needs.
    """
    ranks = tuple(int(r) for r in ranks)
    if not ranks:
        raise SpecError("ranks", ranks, "valid: at least one rank")
    if len(set(ranks)) != len(ranks):
        raise SpecError("ranks", ranks, "valid: distinct global ranks")
    per_node, per_rack = cluster.devices_per_node, cluster.rack_nodes
    if max(ranks) >= cluster.num_devices or min(ranks) < 0:
        raise SpecError(
            "cluster.num_devices", cluster.num_devices,
            f"the process group holds global rank {max(ranks)}; valid: a cluster with more than "
            f"{max(ranks)} devices ({cluster.devices_per_node} per node)",
        )
    node_of = {g: g // per_node for g in ranks}
    rack_of = {g: node_of[g] // per_rack for g in ranks}
    racks = sorted(set(rack_of.values()))
    nodes_in_rack = {r: sorted({node_of[g] for g in ranks if rack_of[g] == r}) for r in racks}
    on_node = {n: sorted(g for g in ranks if node_of[g] == n) for n in set(node_of.values())}
    _check_uniform("devices per node", {n: len(v) for n, v in on_node.items()}, ranks, "node")
    _check_uniform("nodes per rack", {r: len(v) for r, v in nodes_in_rack.items()}, ranks, "rack")
    coords = tuple(
        (on_node[node_of[g]].index(g), nodes_in_rack[rack_of[g]].index(node_of[g]),
         racks.index(rack_of[g]))
        for g in ranks
    )
    sizes = (len(next(iter(on_node.values()))), len(next(iter(nodes_in_rack.values()))),
             len(racks))
    return RankLayout(ranks=ranks, coords=coords, sizes=sizes)


def _check_uniform(what: str, counts: dict[int, int], ranks: tuple[int, ...], unit: str) -> None:
    if len(set(counts.values())) > 1:
        raise SpecError(
            "ranks", ranks,
            f"uneven {what} ({', '.join(f'{unit} {k}: {v}' for k, v in sorted(counts.items()))}); "
            "valid for a hierarchical all-reduce: the same count on every " + unit,
        )


def hierarchy_partitions(layout: RankLayout) -> dict[str, list[tuple[int, ...]]]:
    """For each level, the partition of the group's global ranks into that level's subgroups.

    ``local``: ranks on the same node; ``node``: same rack and same local position; ``rack``:
    same local position and same node-in-rack position; ``cross_node``: same local position on
    every node (the inter-node stage that compression replaces). Levels whose subgroups have one
    rank are omitted. Each subgroup lists its ranks in order of the varying coordinate, which is
    the order chunks are assigned in.
    """
    out: dict[str, list[tuple[int, ...]]] = {}
    for axis, name in enumerate(LEVELS):
        if layout.sizes[axis] > 1:
            out[name] = _partition(layout, varying=(axis,))
    if layout.sizes[1] * layout.sizes[2] > 1:
        out["cross_node"] = _partition(layout, varying=(2, 1))
    return out


def _partition(layout: RankLayout, *, varying: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Groups of ranks agreeing on every coordinate not in ``varying``, members ordered by the
    varying coordinates (outermost first; that is also global-rank order), groups by first
    member."""
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for rank, coord in zip(layout.ranks, layout.coords):
        key = tuple(c for axis, c in enumerate(coord) if axis not in varying)
        order = tuple(coord[axis] for axis in varying)
        groups.setdefault(key, []).append((order, rank))
    return sorted(tuple(r for _, r in sorted(members)) for members in groups.values())


@dataclass(frozen=True, kw_only=True)
class Subgroup:
    """One subgroup this rank belongs to: the process group, its members' global ranks and
    nodes (in group-rank order), and this rank's index among them."""

    name: str
    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    nodes: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def off_node_bytes(self, op: str, payload_bytes: int) -> int:
        """Of what this rank sends for ``op`` (see ``counters.wire_bytes``), the bytes that
        leave its node. Ring collectives send everything to the next member; all-to-all sends a
        1/g piece to each other member."""
        from trainpilot.runtime.comm.counters import wire_bytes

        g, me = self.size, self.index
        if op == "all_to_all":
            return payload_bytes // g * sum(n != self.nodes[me] for n in self.nodes)
        return wire_bytes(op, payload_bytes, g) if self.nodes[(me + 1) % g] != self.nodes[me] \
            else 0


def make_subgroup(name: str, ranks: tuple[int, ...], cluster: ClusterSpec | None, *,
                  group: dist.ProcessGroup | None = None) -> Subgroup:
    """This rank's Subgroup over the global ``ranks``: ``group`` when given, else a new one
    (``subgroup``). Without a cluster every member counts as its own node (all traffic
    off-node)."""
    import torch.distributed as dist

    ranks = tuple(sorted(ranks))
    nodes = tuple(r // cluster.devices_per_node for r in ranks) if cluster else ranks
    return Subgroup(name=name, group=group or subgroup(ranks), ranks=ranks, nodes=nodes,
                    index=ranks.index(dist.get_rank()))


@dataclass(frozen=True, kw_only=True)
class HierarchyGroups:
    """This rank's subgroups, innermost level first. ``levels`` excludes ``cross_node``."""

    layout: RankLayout
    levels: tuple[Subgroup, ...]
    cross_node: Subgroup | None
    local: Subgroup | None  # same as levels[0] when the group spans more than one device per node


_GROUP_CACHE: dict[tuple[int, ...], dist.ProcessGroup] = {}


def subgroup(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A process group over ``ranks``, created once per process and rank set.

    Only the members call this (``use_local_synchronization``), so it also works when the
    communicating group is a data-parallel subgroup of a larger layout. The cache matters: groups
    created with local synchronisation are named by a hash of their ranks, so creating the same
    rank set twice would reuse the same rendezvous keys.
    """
    import torch.distributed as dist

    ranks = tuple(sorted(ranks))
    if ranks not in _GROUP_CACHE:
        _GROUP_CACHE[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _GROUP_CACHE[ranks]


def build_groups(cluster: ClusterSpec, process_group: dist.ProcessGroup | None = None,
                 ) -> HierarchyGroups:
    """Create this rank's hierarchical subgroups of ``process_group`` (default: the world).

    Every rank of ``process_group`` must call this (collective). Ranks are placed on ``cluster``
    by global rank; see the module docstring.
    """
    import torch.distributed as dist

    group = process_group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    layout = rank_layout(cluster, ranks)
    me = dist.get_rank()
    mine: dict[str, Subgroup] = {}
    # Every member creates its groups in the same (sorted) order; non-members are not involved.
    for name, partition in hierarchy_partitions(layout).items():
        members = next(p for p in partition if me in p)
        mine[name] = make_subgroup(name, members, cluster)
    levels = tuple(mine[n] for n in LEVELS if n in mine)
    return HierarchyGroups(layout=layout, levels=levels, cross_node=mine.get("cross_node"),
                           local=mine.get("local"))
