"""Collective times and placement on the cluster tree, against hand-computed cases."""

from __future__ import annotations

import pytest

from trainpilot.perf.topology import GroupSpan, Network, Placement
from trainpilot.specs import Plan, load_cluster, load_model

NET = Network(intra_bw=200e9, intra_lat=2e-6, inter_bw=20e9, inter_lat=5e-6, rack_bw=20e9,
              rack_lat=10e-6)
S = 1e9  # bytes


def test_ring_all_reduce_inside_a_node():
    span = GroupSpan(size=8, per_node=8, nodes=1, racks=1)
    expected = 2 * 7 / 8 * S / 200e9 + 2 * 7 * 2e-6
    assert NET.all_reduce_s(span, S) == pytest.approx(expected)


def test_all_reduce_across_nodes_uses_one_nic_per_member():
    span = GroupSpan(size=32, per_node=4, nodes=8, racks=1)
    inter = 2 * 7 / 8 * S / (4 * 20e9)
    intra = 2 * 3 / 4 * S / 200e9
    latency = 2 * 3 * 2e-6 + 2 * 3 * 5e-6  # intra ring, tree over 8 nodes
    assert NET.all_reduce_s(span, S) == pytest.approx(max(inter, intra) + latency)
    # The hierarchical form runs the phases one after another.
    assert NET.all_reduce_s(span, S, hierarchical=True) == pytest.approx(inter + intra + latency)


def test_reduce_scatter_and_all_gather_are_half_a_ring_with_ring_latency():
    span = GroupSpan(size=16, per_node=1, nodes=16, racks=2)
    expected = 15 / 16 * S / 20e9 + 15 * 10e-6  # ring of 16, each step over the rack hop
    assert NET.reduce_scatter_s(span, S) == pytest.approx(expected)
    assert NET.all_gather_s(span, S) == pytest.approx(expected)


def test_all_to_all_sends_the_off_node_share_over_the_nic():
    span = GroupSpan(size=64, per_node=8, nodes=8, racks=1)
    inter = (64 - 8) / 64 * S / 20e9
    assert NET.all_to_all_s(span, S) == pytest.approx(inter + 5e-6 + 2e-6)


def test_single_rank_groups_cost_nothing():
    one = GroupSpan(size=1, per_node=1, nodes=1, racks=1)
    assert NET.all_reduce_s(one, S) == NET.all_to_all_s(one, S) == NET.p2p_s(one, S) == 0.0


def test_placement_keeps_tp_in_a_node_and_dp_outermost():
    cluster = load_cluster("a100-80gb-x1024")  # 8 per node, 20 nodes per rack
    plan = Plan(tp=8, pp=16, dp=8, global_batch_size=1536, seq_len=2048)
    place = Placement.of(plan, cluster)
    groups = place.groups(plan.ep)
    assert groups["tp"] == GroupSpan(8, 8, 1, 1)
    assert groups["pp"].nodes == 16 and groups["pp"].per_node == 1
    assert groups["dp"].size == 8 and groups["dp"].nodes == 8 and groups["dp"].racks > 1
    rows = place.rank_map(9)
    assert rows[8] == dict(rank=8, rack=0, node=1, device=0, tp=0, cp=0, dp=0, pp=1)


def test_expert_parallel_group_is_a_compact_block():
    cluster = load_cluster("h800-x2048")
    plan = Plan(tp=1, pp=16, dp=128, ep=64, global_batch_size=15360, seq_len=4096)
    groups = Placement.of(plan, cluster).groups(plan.ep)
    assert groups["ep"] == GroupSpan(64, 8, 8, 1)  # 8 nodes, as DeepSeek-V3 ran it
    assert groups["expert_dp"].size == 2


GLOO = Network(intra_bw=200e9, intra_lat=2e-6, inter_bw=20e9, inter_lat=5e-6, rack_bw=20e9,
               rack_lat=10e-6, library="gloo")
TWO_BY_TWO = GroupSpan(size=4, per_node=2, nodes=2, racks=1)


def test_gloo_runs_one_ring_paced_by_its_slowest_edge():
    """Ring 0-1-2-3 crosses the node boundary on two of its edges; every one of the 2(n-1)
    steps moves S/n and waits for an inter-node edge. NCCL's rail-aligned rings use both of a
    node's NICs instead, so gloo is 3x slower here."""
    flat = 2 * 3 * (5e-6 + S / (4 * 20e9))
    assert GLOO.all_reduce_s(TWO_BY_TWO, S) == pytest.approx(flat)
    assert GLOO.all_reduce_s(TWO_BY_TWO, S) / NET.all_reduce_s(TWO_BY_TWO, S) > 2.5
    assert GLOO.all_gather_s(TWO_BY_TWO, S) == pytest.approx(flat / 2)
    # gloo's reduce_scatter all-reduces and keeps a slice.
    assert GLOO.reduce_scatter_s(TWO_BY_TWO, S) == pytest.approx(flat)


def test_gloo_hierarchical_all_reduce_is_the_runtimes_staged_one():
    """All-to-all inside the node, a ring all-reduce of S/2 per rail, ring all-gather."""
    scatter = S / 2 / 200e9 + 2e-6
    across = 2 * (5e-6 + S / 2 / 2 / 20e9)
    gather = 2e-6 + S / 2 / 200e9
    hier = GLOO.all_reduce_s(TWO_BY_TWO, S, hierarchical=True)
    assert hier == pytest.approx(scatter + across + gather)
    assert hier < GLOO.all_reduce_s(TWO_BY_TWO, S) / 2  # the gain NCCL's model cannot show
    assert NET.all_reduce_s(TWO_BY_TWO, S, hierarchical=True) >= NET.all_reduce_s(TWO_BY_TWO, S)


def test_the_library_comes_from_the_cluster_or_its_device_family():
    from trainpilot.perf import Estimator

    model = load_model("tiny-gpt")
    assert Estimator(model, load_cluster("cpu-x4")).net.library == "gloo"
    assert Estimator(model, load_cluster("a100-80gb-x16")).net.library == "nccl"
    cluster = load_cluster("a100-80gb-x16")
    forced = cluster.replace(network=cluster.network.replace(collective_library="gloo"))
    assert Estimator(model, forced).net.library == "gloo"
