"""Tier 1: where ranks sit and which subgroups a hierarchical all-reduce uses (no process group)."""

from __future__ import annotations

import pytest

from trainpilot.runtime.comm import hierarchy_partitions, rank_layout
from trainpilot.runtime.comm.topology import Subgroup
from trainpilot.specs import ClusterSpec, SpecError


def cluster(per_node: int, nodes: int, per_rack: int | None = None) -> ClusterSpec:
    link = dict(gbytes_per_s=1.0)
    return ClusterSpec(device="cpu", devices_per_node=per_node, num_nodes=nodes,
                       nodes_per_rack=per_rack, network=dict(intra_node=link, inter_node=link))


def test_two_nodes_of_two():
    layout = rank_layout(cluster(2, 2), range(4))
    assert layout.sizes == (2, 2, 1)
    parts = hierarchy_partitions(layout)
    assert parts == {"local": [(0, 1), (2, 3)], "node": [(0, 2), (1, 3)],
                     "cross_node": [(0, 2), (1, 3)]}


def test_racks_add_a_level():
    # 2 racks x 2 nodes x 2 devices: reduce-scatter in node, then in rack, all-reduce across racks
    parts = hierarchy_partitions(rank_layout(cluster(2, 4, per_rack=2), range(8)))
    assert parts["local"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert parts["node"] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert parts["rack"] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert parts["cross_node"] == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_one_device_per_node_has_no_local_level():
    parts = hierarchy_partitions(rank_layout(cluster(1, 4, per_rack=2), range(4)))
    assert "local" not in parts
    assert parts["node"] == [(0, 1), (2, 3)] and parts["rack"] == [(0, 2), (1, 3)]


def test_data_parallel_subgroup_of_a_larger_layout():
    # dp ranks 0, 2, 4, 6 of a tp=2 layout on nodes of 4: two per node, two nodes
    layout = rank_layout(cluster(4, 2), [0, 2, 4, 6])
    assert layout.sizes == (2, 2, 1)
    assert hierarchy_partitions(layout)["local"] == [(0, 2), (4, 6)]


def test_uneven_placement_is_refused():
    with pytest.raises(SpecError, match="uneven devices per node"):
        rank_layout(cluster(4, 2), [0, 1, 2, 4])


def test_rank_outside_the_cluster_is_refused():
    with pytest.raises(SpecError, match="cluster.num_devices"):
        rank_layout(cluster(2, 2), range(5))


def test_off_node_bytes_follow_the_ring():
    # flat ring over 2 nodes x 2: only the ranks whose successor is on the other node send off it
    def flat(index):
        return Subgroup(name="flat", group=None, ranks=(0, 1, 2, 3), nodes=(0, 0, 1, 1),
                        index=index)

    assert flat(0).off_node_bytes("all_reduce", 1000) == 0
    assert flat(1).off_node_bytes("all_reduce", 1000) == 1500  # 2(g-1)/g of the payload
    # all-to-all sends a quarter to each of the two ranks on the other node
    assert flat(0).off_node_bytes("all_to_all", 1000) == 500
