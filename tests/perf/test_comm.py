"""Collective times and placement on the cluster tree, against hand-computed cases."""

from __future__ import annotations

import pytest

from trainpilot.perf.topology import GroupSpan, Network, Placement
from trainpilot.specs import Plan, load_cluster, load_model

NET = Network(intra_bw=200e9, intra_lat=2e-6, inter_bw=20e9, inter_lat=5e-6, rack_bw=20e9,
              rack_lat=10e-6)
S = 1e9  # bytes


def test_ring_all_reduce_inside_a_node_takes_ncclS_fastest_protocol():
    """1 GB inside a node: NCCL's Simple protocol (full bandwidth, 8.4 + 3.4 us per step)."""
    span = GroupSpan(size=8, per_node=8, nodes=1, racks=1)
    expected = 2 * 7 / 8 * S / 200e9 + (8.4 + 14 * 3.4) * 1e-6
    assert NET.all_reduce_s(span, S) == pytest.approx(expected)
    # A tiny buffer goes by LL (low latency at a quarter of the bandwidth).
    tiny = 8e3
    assert NET.all_reduce_s(span, tiny) == pytest.approx(
        (6.6 + 14 * 0.47) * 1e-6 + 2 * 7 / 8 * tiny / 200e9 / 0.25)


def test_all_reduce_across_nodes_uses_one_nic_per_member():
    span = GroupSpan(size=32, per_node=4, nodes=8, racks=1)
    inter = 2 * 7 / 8 * S / (4 * 20e9)
    intra = 2 * 3 / 4 * S / 200e9
    ring_lat = (8.4 + (62 - 14) * 3.4 + 14 * 9.6) * 1e-6 * 1.9  # Simple, plateau factor
    tree = 2 * S / (4 * 20e9) / 0.9 + (0 + 2 * (3 * 28 + 3 * 50)) * 1e-6
    assert NET.all_reduce_s(span, S) == pytest.approx(min(max(inter, intra) + ring_lat, tree))
    # The hierarchical form runs the phases one after another.
    assert NET.all_reduce_s(span, S, hierarchical=True) > NET.all_reduce_s(span, S)


def test_nccl_picks_tree_for_small_all_reduces_at_scale():
    """Ring latency grows with the ranks (2(n-1) steps), tree latency with log2(nodes):
    NCCL's tuner (and this model) pick the tree for small buffers over many nodes, the ring
    for large ones, so a small all-reduce over 1,024 nodes costs far less than a ring."""
    big = GroupSpan(size=1024, per_node=1, nodes=1024, racks=32)
    small = 1e5
    ring = NET.with_algorithm("ring").all_reduce_s(big, small)
    tree = NET.with_algorithm("tree").all_reduce_s(big, small)
    assert tree < ring / 5
    assert NET.all_reduce_s(big, small) == pytest.approx(tree)
    assert NET.all_reduce_s(big, 1e10) == pytest.approx(
        NET.with_algorithm("ring").all_reduce_s(big, 1e10))
    # Reduce-scatter and all-gather only have the ring: latency linear in the ranks.
    assert NET.reduce_scatter_s(big, small) > 1023 * 2.7e-6


def test_reduce_scatter_and_all_gather_are_half_a_ring():
    span = GroupSpan(size=16, per_node=1, nodes=16, racks=2)
    bw = 15 / 16 * S / 20e9
    assert NET.reduce_scatter_s(span, S) == pytest.approx(bw + (8.4 + 15 * 9.6 * 2) * 1e-6)
    assert NET.all_gather_s(span, S) == NET.reduce_scatter_s(span, S)


def test_all_to_all_sends_the_off_node_share_over_the_nic():
    span = GroupSpan(size=64, per_node=8, nodes=8, racks=1)
    inter = (64 - 8) / 64 * S / 20e9
    assert NET.all_to_all_s(span, S) == pytest.approx(inter + 5e-6 + 2e-6)
    assert NET.all_to_all_s(span, S, remote_share=0.5) == pytest.approx(
        0.5 * S / 20e9 + 5e-6 + 2e-6)


def test_single_rank_groups_cost_nothing():
    one = GroupSpan(size=1, per_node=1, nodes=1, racks=1)
    assert NET.all_reduce_s(one, S) == NET.all_to_all_s(one, S) == NET.p2p_s(one, S) == 0.0


def _place(plan, cluster):
    return Placement.build(tp=plan.tp, cp=plan.cp, dp=plan.dp, pp=plan.pp, ep=plan.ep,
                           etp=plan.etp, order=plan.rank_order,
                           devices_per_node=cluster.devices_per_node,
                           nodes_per_rack=int(cluster.nodes_per_rack))


def test_placement_keeps_tp_in_a_node_and_dp_outermost():
    cluster = load_cluster("a100-80gb-x1024")  # 8 per node, 20 nodes per rack
    plan = Plan(tp=8, pp=16, dp=8, global_batch_size=1536, seq_len=2048)
    place = _place(plan, cluster)
    groups = place.groups()
    assert groups["tp"] == GroupSpan(8, 8, 1, 1)
    assert groups["pp"].nodes == 16 and groups["pp"].per_node == 1
    assert groups["dp"].size == 8 and groups["dp"].nodes == 8 and groups["dp"].racks > 1
    rows = place.rank_map(9)
    assert rows[8] == dict(rank=8, rack=0, node=1, device=0, tp=0, cp=0, dp=0, pp=1)
    # Megatron's order puts pipeline stages outermost: data-parallel groups become 8
    # consecutive nodes (the worst of them straddles a 20-node rack boundary) and pipeline
    # groups span the racks.
    mega = _place(plan.replace(rank_order="tp-cp-ep-dp-pp"), cluster).groups()
    assert mega["dp"] == GroupSpan(8, 1, 8, 2) and mega["pp"].racks == 7


def test_every_group_is_priced_by_its_worst_member():
    """tp = 6 on 8-device nodes: rank 0's group lies inside node 0, but ranks 6-11 span two
    nodes (2 + 4 members): the TP collectives of the whole job run at that group's pace."""
    cluster = load_cluster("h100-sxm-x48")
    plan = Plan(tp=6, dp=8, global_batch_size=64, seq_len=2048)
    groups = _place(plan, cluster).groups()
    assert groups["tp"] == GroupSpan(6, 2, 2, 1)
    # Aligned layouts still look at one group only and find the same as before.
    aligned = _place(Plan(tp=4, dp=12, global_batch_size=48, seq_len=2048), cluster).groups()
    assert aligned["tp"] == GroupSpan(4, 4, 1, 1)


def test_expert_parallel_group_is_a_compact_block():
    cluster = load_cluster("h800-x2048")
    plan = Plan(tp=1, pp=16, dp=128, ep=64, global_batch_size=15360, seq_len=4096)
    groups = _place(plan, cluster).groups()
    assert groups["ep"] == GroupSpan(64, 8, 8, 1)  # 8 nodes, as DeepSeek-V3 ran it
    assert groups["expert_dp"].size == 2


def test_parallel_folding_puts_ep_across_tp_and_dp():
    """MoE parallel folding (EP 32 over TP 2 x DP 16, expert TP 1; a published Qwen3-235B
    layout): expert groups of 32 consecutive ranks of a stage, expert TP of one rank."""
    cluster = load_cluster("h100-sxm-x256")
    plan = Plan(tp=2, pp=8, dp=16, ep=32, etp=1, global_batch_size=2048, seq_len=4096,
                rank_order="tp-cp-ep-dp-pp")
    groups = _place(plan, cluster).groups()
    assert groups["ep"] == GroupSpan(32, 8, 4, 1)
    assert groups["etp"].size == 1 and groups["expert_dp"].size == 1
    assert groups["tp"] == GroupSpan(2, 2, 1, 1)


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


def test_interleaved_megatron_reduces_each_chunks_gradients_as_its_last_backward_ends():
    """Megatron's interleaved schedule syncs a chunk's gradients after that chunk's last
    micro-batch backward, so the step's reduction hides behind (1 + (v-1) min(m, p)) / v
    micro-batch backwards, not one; without interleaving, or on another stack, one."""
    from trainpilot.perf import dataparallel, estimator
    from trainpilot.perf.dataparallel import grad_sync_window
    from trainpilot.perf.estimator import Estimator, layout_of

    assert grad_sync_window("megatron", 8, 6, 6) == pytest.approx((1 + 7 * 6) / 8)
    assert grad_sync_window("megatron", 4, 8, 2) == pytest.approx((1 + 3 * 2) / 4)
    assert grad_sync_window("megatron", 1, 8, 64) == 1.0
    assert grad_sync_window("deepspeed", 8, 6, 6) == 1.0
    # GPT-3 175B on 10,752 H100 as MLPerf v4.0 ran it: six micro-batches per replica.
    model, cluster = load_model("gpt3-175b"), load_cluster("h100-sxm-x16384")
    plan = Plan(tp=4, pp=6, vp=8, dp=448, micro_batch_size=1, global_batch_size=2688,
                seq_len=2048, sequence_parallel=True, precision="fp8", idle_devices=16384 - 10752,
                comm=dict(overlap=True, compression="bf16"),
                runtime=dict(stack="megatron", tp_comm_overlap=True))

    def tail(window) -> float:
        original = estimator.grad_sync_window
        estimator.grad_sync_window = window
        try:
            est = Estimator(model, cluster)
            return est.evaluate(layout_of(model, plan, est.options)).stages[0].dp_tail_rs_s
        finally:
            estimator.grad_sync_window = original

    chunked = tail(dataparallel.grad_sync_window)
    one = tail(lambda *args: 1.0)  # negative control: the window of one micro-batch backward
    assert 0 <= chunked < one


# The Ultra-Scale Playbook's own measurement of its cluster (nanotron_ultrascale_2503.yaml):
# whole-node collectives, median bus bandwidth in GB/s by node count.
HF_BUSBW = {"all_reduce": [[2, 361.7], [4, 160.1], [16, 84.7], [64, 32.9]],
            "all_gather": [[2, 184.6], [4, 119.0], [16, 55.0], [64, 11.0]]}


def _measured_cluster(nodes: int, busbw=HF_BUSBW):
    from trainpilot.specs.cluster import ClusterSpec

    data = load_cluster(f"h100-sxm-x{8 * nodes}").model_dump(mode="python")
    data["network"]["measured_busbw"] = busbw
    return ClusterSpec.model_validate(data)


@pytest.mark.parametrize("nodes", [4, 16, 64])
def test_a_measured_bus_bandwidth_caps_whole_node_collectives_at_what_was_measured(nodes):
    size, n = 2**30, 8 * nodes
    span = GroupSpan(size=n, per_node=8, nodes=nodes, racks=1)
    measured = Network.of(_measured_cluster(nodes))
    for kind, factor in (("all_reduce", 2.0), ("all_gather", 1.0)):
        busbw = size / measured._collective(span, size, kind, False) * factor * (n - 1) / n
        want = dict(HF_BUSBW[kind])[nodes] * 1e9
        assert busbw == pytest.approx(want, rel=0.12), (kind, busbw / 1e9)
    # Negative control: the same links without the measurement keep the preset's fabric.
    preset = Network.of(load_cluster(f"h100-sxm-x{n}"))
    plain = size / preset.all_reduce_s(span, size) * 2 * (n - 1) / n
    assert plain > 250e9 and (nodes == 4 or plain > 2 * dict(HF_BUSBW["all_reduce"])[nodes] * 1e9)


def test_a_measurement_never_speeds_a_tier_up_and_groups_use_their_own_nics():
    # Measured faster than the links: the links still bound it.
    fast = {"all_reduce": [[2, 5000.0], [64, 5000.0]]}
    span = GroupSpan(size=128, per_node=2, nodes=64, racks=1)
    base = Network.of(load_cluster("h100-sxm-x512")).all_reduce_s(span, 2**28)
    assert Network.of(_measured_cluster(64, fast)).all_reduce_s(span, 2**28) == base
    # A group with 2 members per node moves its share over 2 NICs at the measured per-NIC rate.
    slow = Network.of(_measured_cluster(64)).all_reduce_s(span, 2**28)
    assert slow > 5 * base


def test_measured_node_counts_must_ascend():
    from trainpilot.specs import SpecError
    from trainpilot.specs.cluster import ClusterSpec
    from trainpilot.specs.loading import validate

    data = load_cluster("h100-sxm-x16").model_dump(mode="python")
    data["network"]["measured_busbw"] = {"all_reduce": [[4, 160.0], [2, 361.0]]}
    with pytest.raises(SpecError) as info:
        validate(ClusterSpec, data, doc="cluster")
    assert "measured_busbw.all_reduce" in str(info.value) and "\n" not in str(info.value)


def _ep_table():
    from importlib import resources

    import yaml

    text = resources.files("trainpilot.perf").joinpath("data", "ep_dispatch_h100.yaml").read_text()
    return yaml.safe_load(text)


def _dispatch_us(model, ep: int, dispatcher: str, *, old_reach: bool = False) -> float:
    """The cost model's one dispatch (or combine) of 4,096 tokens per rank over ``ep`` H100s."""
    from trainpilot.perf.hardware import curve_for
    from trainpilot.perf.mlp import nvlink_copies, remote_copies

    cluster = load_cluster(f"h100-sxm-x{max(ep, 8)}")
    net = Network.of(cluster, curve_for(cluster).collective_library)
    span = GroupSpan(size=ep, per_node=min(ep, 8), nodes=max(1, ep // 8), racks=1)
    sent = 2 * 4096 * model.moe.top_k * model.hidden_size
    remote = remote_copies(model, span, dispatcher)
    intra = nvlink_copies(model, span, dispatcher)
    if old_reach:  # the model before 2026-12-07: reach = topk_groups x nodes // groups, and
        # every copy over NVLink
        nodes, k = span.nodes, model.moe.top_k
        reach = max(1, min(nodes, model.moe.topk_groups * nodes // model.moe.num_expert_groups))
        remote = (reach * (nodes - 1) / nodes if nodes > 1 else 0.0) / k
        intra = None
    return 1e6 * net.all_to_all_s(span, sent, remote_share=remote, intra_share=intra)


def test_expert_dispatch_matches_megatron_cores_h100_measurements():
    """Megatron-Core's measured dispatch and combine times for DeepSeek-V3's shapes on H100
    (its MoE report's Table 7, EP 8-64) against the model's all-to-all: NCCL's all-to-all (every
    copy to its GPU) and DeepEP/HybridEP (one copy per destination node over the network, one
    per destination GPU over NVLink, group-limited routing picking the groups first). Negative
    control: the model before the per-GPU copy count and the group-aware node reach missed the
    HybridEP rows by 43% on average (EP 16 2.4x too fast, EP 8 1.8x too slow)."""
    model = load_model("deepseek-v3")
    table = _ep_table()
    assert table["source"]["licence"] and table["source"]["url"].startswith("https://")
    errors = {"deepep": [], "alltoall": [], "old": []}
    for ep, _phase, hybrid_us, nccl_us in table["rows"]:
        errors["deepep"].append(_dispatch_us(model, ep, "deepep") / hybrid_us - 1)
        errors["alltoall"].append(_dispatch_us(model, ep, "alltoall") / nccl_us - 1)
        errors["old"].append(_dispatch_us(model, ep, "deepep", old_reach=True) / hybrid_us - 1)

    def mean_abs(values):
        return sum(map(abs, values)) / len(values)

    assert mean_abs(errors["deepep"]) < 0.10 and max(map(abs, errors["deepep"])) < 0.25
    assert mean_abs(errors["alltoall"]) < 0.08 and max(map(abs, errors["alltoall"])) < 0.15
    assert mean_abs(errors["old"]) > 0.35


def test_group_limited_routing_reaches_the_nodes_of_its_groups():
    """DeepSeek-V3 picks 4 of 8 groups: over 8 nodes (one group each) a token reaches exactly 4
    nodes; over 2 nodes (4 groups each) both unless all 4 groups sit on one (2 of the 70 picks);
    over 16 (a group spans 2) its 2 experts per group land on 1.5 of the group's nodes; without
    group limits, the uniform count."""
    import math

    from trainpilot.perf.mlp import distinct_reached

    ds = load_model("deepseek-v3")
    assert distinct_reached(ds, 8) == pytest.approx(4.0)
    assert distinct_reached(ds, 2) == pytest.approx(2 - 2 / math.comb(8, 4))
    assert distinct_reached(ds, 16) == pytest.approx(4 * 2 * (1 - 0.5 ** 2))  # groups span 2
    free = ds.replace(moe=ds.moe.model_copy(update=dict(topk_groups=None)))
    assert distinct_reached(free, 8) == pytest.approx(8 * (1 - (7 / 8) ** 8))


def test_deepspeeds_first_zero3_pays_per_parameter_collectives_and_per_rank_chunk_copies():
    """DeepSpeed 0.3.12-0.5.4 (runtime.zero3_collectives per_param) issues one collective per
    weight tensor, each over a Python list of the group's chunks that ProcessGroupNCCL copies
    one at a time, and synchronizes the device before every parameter gather. Its traffic is
    the bucketed traffic's bytes in more pieces plus n chunk issues per piece, grows with the
    group size at a fixed per-rank load, and is never hidden behind compute."""
    from trainpilot.perf.dataparallel import traffic
    from trainpilot.perf.estimator import Estimator, layout_of
    from trainpilot.perf.memory import RankParams

    params = RankParams(dense=1e9, expert=0.0, largest_layer=1e8)
    issue = 10e-6

    def z3(n: int, tensors: int, regather: bool = False, sync: str = "micro_batch"):
        span = GroupSpan(size=n, per_node=8, nodes=n // 8, racks=1)
        spans = {"dp": span, "expert_dp": GroupSpan(size=1, per_node=1, nodes=1, racks=1),
                 "pp": GroupSpan(size=1, per_node=1, nodes=1, racks=1)}
        return traffic(NET, zero=3, params=params, grad_bytes=2, spans=spans, hierarchical=False,
                       bucket_bytes=25e6, dp_shard=None, tied_bytes=0.0, num_layers=10,
                       weight_tensors=tensors, chunk_issue_s=issue, recompute_gather=regather,
                       sync=sync)

    bucketed, per_param = z3(64, 0), z3(64, 4)
    pieces = 4 * 10
    span = GroupSpan(size=64, per_node=8, nodes=8, racks=1)
    gather = pieces * NET.all_gather_s(span, 2 * 1e9 / pieces) + pieces * 64 * issue
    assert per_param.mb_fwd_s == pytest.approx(gather)
    assert per_param.mb_fwd_s > bucketed.mb_fwd_s
    # The recomputed forward gathers again in the backward.
    assert z3(64, 4, regather=True).mb_bwd_s == pytest.approx(per_param.mb_bwd_s + gather)
    # ... in every micro-batch's backward, also when gradients are reduced once per step.
    once = z3(64, 4, regather=True, sync="step")
    assert once.mb_bwd_s == pytest.approx(2 * gather)
    assert once.step_grad_s == pytest.approx(z3(64, 4, sync="step").step_grad_s)
    # The chunk copies grow with the group: 4x the ranks, 4x the issue time.
    extra = z3(256, 4).mb_fwd_s - z3(256, 0).mb_fwd_s
    assert extra > 3 * (per_param.mb_fwd_s - bucketed.mb_fwd_s)
    # In the estimator: the paper's GPT-3 175B ZeRO-3 row on 1,536 A100 (Narayanan et al.
    # 2021, Table 2) is slower per_param than bucketed (negative control: the same plan with
    # bucketed collectives and overlap hides most of its traffic).
    model, cluster = load_model("gpt3-175b"), load_cluster("a100-80gb-x1536")

    def step(mode: str) -> tuple[float, float]:
        plan = Plan(dp=1536, zero=3, micro_batch_size=1, global_batch_size=1536, seq_len=2048,
                    precision="fp16", recompute="full", comm=dict(overlap=True, compression="fp16"),
                    runtime=dict(stack="deepspeed", zero3_collectives=mode))
        est = Estimator(model, cluster)
        ev = est.evaluate(layout_of(model, plan, est.options))
        return ev.step_time_s, ev.breakdown_s["dp_comm_exposed"]

    (slow, exposed_pp), (fast, exposed_b) = step("per_param"), step("bucketed")
    assert slow > 2 * fast
    assert exposed_pp > 10 * exposed_b


def test_per_parameter_zero3_collectives_are_deepspeeds_only():
    from trainpilot.specs import SpecError
    from trainpilot.specs.loading import validate

    def plan(stack: str):
        return validate(Plan, dict(dp=8, zero=3, global_batch_size=8, seq_len=4096,
                                   runtime=dict(stack=stack, zero3_collectives="per_param")),
                        doc="plan")

    with pytest.raises(SpecError, match="valid: stack deepspeed") as info:
        plan("pytorch")
    assert str(info.value).startswith("plan.runtime.zero3_collectives: ")
    assert "\n" not in str(info.value)
    # Negative control: DeepSpeed accepts it.
    assert plan("deepspeed").runtime.zero3_collectives == "per_param"
