"""Issue 14's twelve mechanisms, one test (or two) each, through the public API only, so that
each can be run against the cost model before the issue (commit 9b89b7d) and shown to fail
there (docs/cost_model.md, "Issue 14 checks", lists the result of doing so)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from trainpilot.perf import predict
from trainpilot.specs import ClusterSpec, Plan, SpecError, load_cluster, load_model
from trainpilot.specs.loading import validate


def _gpt3():
    return load_model("gpt3-175b")


# 1. Every group of every axis is priced by its slowest member, in the rank order used.
def test_1_tp_groups_that_straddle_nodes_are_priced_as_such():
    """tp = 6 on 8-device nodes: ranks 6-11 form a TP group on two nodes; rank 0's group alone
    lies inside node 0. The whole job's TP collectives run at the straddling group's pace."""
    plan = Plan(tp=6, pp=8, dp=1, global_batch_size=8, seq_len=2048)
    pred = predict(_gpt3(), load_cluster("a100-80gb-x48"), plan)
    tp = pred.placement["groups"]["tp"]
    assert tp["nodes"] == 2 and tp["per_node"] == 2
    inside = predict(_gpt3(), load_cluster("a100-80gb-x48"),
                     Plan(tp=6, pp=8, dp=1, global_batch_size=8, seq_len=2048,
                          rank_order="tp-cp-ep-dp-pp"))
    assert inside.breakdown_s["tp_comm"] == pytest.approx(pred.breakdown_s["tp_comm"])


# 2. ZeRO-2 with pipeline parallelism as the runtimes do it.
def test_2_zero2_with_pp_reduces_once_per_step_like_the_runtime():
    """trainpilot's runtime (and Megatron's distributed optimizer) reduce gradients once, during
    the last micro-batch's backward; ZeRO-2 then costs what ZeRO-1 costs, bubble included."""
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x32")
    base = dict(tp=1, pp=4, dp=8, micro_batch_size=1, global_batch_size=128, seq_len=4096)
    z1 = predict(model, cluster, Plan(zero=1, **base))
    z2 = predict(model, cluster, Plan(zero=2, **base))
    assert z2.step_time_s == pytest.approx(z1.step_time_s, rel=1e-9)
    assert z2.breakdown_s["pp_bubble"] == pytest.approx(z1.breakdown_s["pp_bubble"])


def test_2_per_micro_batch_reduction_is_what_deepspeed_does():
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x32")
    base = dict(tp=1, pp=4, dp=8, zero=2, micro_batch_size=1, global_batch_size=128,
                seq_len=4096)
    step = predict(model, cluster, Plan(**base))
    per_mb = predict(model, cluster, Plan(runtime=dict(grad_sync="micro_batch"), **base))
    assert per_mb.step_time_s > step.step_time_s
    assert any("gradients" in c or "ZeRO-2" in c for c in per_mb.caveats)


# 3. Zero-bubble: one answer, the simulator's.
def test_3_zero_bubble_bubble_is_the_simulators():
    from trainpilot.sim.timeline import StageCosts, StepSpec, simulate_step

    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x32")
    plan = Plan(tp=1, pp=4, dp=8, zero=1, micro_batch_size=1, global_batch_size=256,
                seq_len=4096, pp_schedule="zero_bubble", comm=dict(overlap=False))
    pred = predict(model, cluster, plan)
    stages = tuple(StageCosts(fwd_s=s.fwd_s, bwd_s=s.bwd_s,
                              weight_grad_share=s.wgrad_s / s.bwd_s) for s in pred.stages)
    sim = simulate_step(StepSpec(stages=stages, num_micro_batches=pred.num_micro_batches,
                                 schedule="zero_bubble"))
    ideal = max(pred.num_micro_batches * (s.fwd_s + s.bwd_s) for s in pred.stages)
    assert pred.breakdown_s["pp_bubble"] == pytest.approx(sim.pipeline_end_s - ideal, rel=1e-6)


# 4. Collective algorithms and bucket size.
def test_4_nccl_picks_tree_for_small_all_reduces_at_scale():
    from trainpilot.perf.topology import GroupSpan, Network

    net = Network.of(load_cluster("h100-sxm-x8192"))
    span = GroupSpan(size=1024, per_node=1, nodes=1024, racks=32)
    assert net.all_reduce_s(span, 1e5) < net.with_algorithm("ring").all_reduce_s(span, 1e5) / 5


def test_4_the_search_chooses_the_gradient_bucket():
    """Where per-bucket latency matters (a distributed optimizer over 1,024 ranks: one
    reduce-scatter and one all-gather per bucket, each ~1 ms of ring latency), the best plan
    comes with larger buckets than DDP's 25 MB default on a stack that defaults to it; on the
    megatron stack the default itself is Megatron-Core's max(40M, 1M x DP) parameters (4 GB of
    fp32 gradients at DP 1,024), which no searched size beats."""
    from trainpilot.perf.runtime import bucket_mb, resolve
    from trainpilot.plan import SearchSpace, search
    from trainpilot.specs import RuntimeProfile

    model = load_model("llama3-8b")
    for stack in ("megatron-legacy", "megatron"):
        result = search(model, load_cluster("h100-sxm-x1024"),
                        global_batch_size=1024, seq_len=4096, top=1,
                        space=SearchSpace(tp=(1,), pp=(1,), cp=(1,), zero=(1,)),
                        runtime=RuntimeProfile(stack=stack))
        plan = result.best.plan
        if stack == "megatron-legacy":
            assert plan.comm.bucket_mb is not None and plan.comm.bucket_mb > 25
        else:
            assert plan.comm.bucket_mb is None and plan.dp == 1024
            assert bucket_mb(plan, resolve(model, plan)) == 1024e6 * 4 / 1e6


def test_4_megatron_buckets_follow_megatron_cores_default():
    """Unset, the megatron stack's bucket is Megatron-Core's ``max(40M, 1M x DP)`` parameters
    of its gradient buffer (one bucket without overlap); other stacks keep DDP's 25 MB; a
    bucket the plan names is used as written. At one GPU per node over 288 nodes (TP 8 fills
    each node) 25 MB buckets make a step's ring latencies alone exceed the compute."""
    from trainpilot.perf.runtime import MEGATRON_ONE_BUCKET_MB, bucket_mb, resolve
    from trainpilot.specs import RuntimeProfile

    model = load_model("llama3-8b")
    meg = RuntimeProfile(stack="megatron")
    cases = [(dict(dp=8, runtime=meg), 40e6 * 4 / 1e6),
             (dict(dp=288, runtime=meg), 288e6 * 4 / 1e6),
             (dict(dp=288, runtime=meg, comm={"compression": "bf16"}), 288e6 * 2 / 1e6),
             (dict(dp=288, runtime=meg, comm={"overlap": False}), MEGATRON_ONE_BUCKET_MB),
             (dict(dp=288, runtime=meg, comm={"bucket_mb": 25}), 25.0),
             (dict(dp=288, runtime=RuntimeProfile(stack="pytorch")), 25.0)]
    for fields, want in cases:
        plan = Plan(global_batch_size=1152, seq_len=4096, **fields)
        assert bucket_mb(plan, resolve(model, plan)) == pytest.approx(want), fields
    # What it changes: the same 288-node TP 8 job's exposed data-parallel time.
    cluster = load_cluster("h100-sxm-x2304")
    times = {}
    for mb in (None, 25.0):
        plan = Plan(tp=8, dp=288, sequence_parallel=True, micro_batch_size=1,
                    global_batch_size=1152, seq_len=4096, runtime=meg, comm={"bucket_mb": mb})
        times[mb] = predict(model, cluster, plan).breakdown_s["dp_comm_exposed"]
    assert times[None] < times[25.0] / 2, times


# 5. MoE at scale.
def test_5_parallel_folding_layouts_are_expressible():
    """EP 32 over TP 2 x DP 16 with expert TP 1 (a published Qwen3-235B layout)."""
    plan = Plan(tp=2, pp=8, dp=16, ep=32, etp=1, global_batch_size=2048, seq_len=4096,
                sequence_parallel=True, pp_first_stage_layers=11, pp_last_stage_layers=11,
                vp=4)
    pred = predict(load_model("qwen3-235b-a22b"), load_cluster("h100-sxm-x256"), plan)
    assert pred.placement["groups"]["ep"]["size"] == 32
    assert pred.placement["groups"]["etp"]["size"] == 1


def test_5_expert_all_to_all_overlap_and_per_node_dedup():
    model, cluster = load_model("deepseek-v3"), load_cluster("h800-x2048")
    base = dict(tp=1, pp=16, dp=128, ep=64, zero=1, micro_batch_size=1,
                global_batch_size=15360, seq_len=4096, recompute="full",
                pp_first_stage_layers=3, pp_last_stage_layers=2)
    plain = predict(model, cluster, Plan(**base))
    dedup = predict(model, cluster, Plan(runtime=dict(ep_dispatcher="deepep"), **base))
    both = predict(model, cluster,
                   Plan(runtime=dict(ep_dispatcher="deepep", ep_comm_overlap=True), **base))
    assert dedup.breakdown_s["ep_comm"] < 0.8 * plain.breakdown_s["ep_comm"]
    assert both.breakdown_s["ep_comm"] < 0.5 * dedup.breakdown_s["ep_comm"]


def test_5_the_search_does_not_shrink_deepseek_v3_to_ep8():
    from trainpilot.plan import search
    from trainpilot.specs import RuntimeProfile

    result = search(load_model("deepseek-v3"), load_cluster("h800-x2048"),
                    global_batch_size=15360, seq_len=4096, top=1, precision="fp8",
                    runtime=RuntimeProfile(stack="megatron", ep_comm_overlap=True,
                                           ep_dispatcher="deepep"))
    assert result.best.plan.ep > 8


def test_5_experts_run_one_by_one_are_issued_one_by_one():
    # Megatron-Core's TEGroupedMLP runs Transformer Engine's GroupedLinear: one GEMM and, under
    # MXFP8 (Megatron-Bridge's B200 recipes), one input quantization per local expert. 128
    # experts over EP 8: 16 per rank, each of the layer's 2 forward GEMMs (+ 2 casts) and 4
    # backward GEMMs (+ 2 casts) issued 16 times where one grouped kernel
    # (torch._grouped_mm) is issued once. (Under delayed scaling GroupedLinear casts all
    # experts in one multi-tensor kernel: tests/perf/test_fp8.py.)
    from trainpilot.perf.estimator import Estimator
    from trainpilot.perf.stages import layout_of

    model, cluster = load_model("qwen3-30b-a3b"), load_cluster("b200-x8")
    base = dict(dp=8, ep=8, etp=1, zero=1, micro_batch_size=1, global_batch_size=512,
                seq_len=4096, precision="fp8", fp8_recipe="mxfp8")
    costs = {}
    for gemm in ("per_expert", "grouped"):
        plan = Plan(runtime=dict(stack="megatron", expert_gemm=gemm), **base)
        est, lay = Estimator(model, cluster), layout_of(model, plan)
        costs[gemm] = est.layer(lay, True, est.spans(lay))
    per, one = costs["per_expert"], costs["grouped"]
    assert per.num_kernels - one.num_kernels == (16 - 1) * (2 + 2 + 4 + 2)
    assert per.fwd_compute_s > one.fwd_compute_s and per.bwd_compute_s > one.bwd_compute_s
    # The stacks' defaults: Megatron per expert, torchtitan-style PyTorch grouped.
    from trainpilot.specs import RuntimeProfile

    assert RuntimeProfile(stack="megatron").resolved("expert_gemm") == "per_expert"
    assert RuntimeProfile(stack="pytorch").resolved("expert_gemm") == "grouped"
    slow = predict(model, cluster, Plan(runtime=dict(stack="megatron"), **base))
    fast = predict(model, cluster,
                   Plan(runtime=dict(stack="megatron", expert_gemm="grouped"), **base))
    assert slow.step_time_s > 1.03 * fast.step_time_s


# 6. Every knob in the documents.
def test_6_the_llama3_job_reproduces_its_validation_row():
    from trainpilot.perf.validation import all_cases, run

    out = run_cli("predict", "--job", "llama3-405b-h100-16384", "--json")
    assert out.returncode == 0, out.stderr
    causal = json.loads(out.stdout)["flops"]["megatron_causal"]["tflops_per_device"]
    row = [c for c in all_cases(find_vtrain=False) if c.dataset == "llama3_2024"
           and c.label == "405B t8 c1 p16 d128 16384 GPUs"]
    assert causal == pytest.approx(run(row)[0].predicted, rel=1e-12)


# 7. Both FLOP conventions, named.
def test_7_predict_reports_both_flop_conventions():
    out = run_cli("predict", "--job", "gpt3-175b-a100-1024", "--json")
    data = json.loads(out.stdout)
    full, causal = data["flops"]["megatron_full"], data["flops"]["megatron_causal"]
    assert data["flops_convention"] == "megatron_full"
    assert full["tflops_per_device"] == pytest.approx(data["tflops_per_device"])
    assert causal["tflops_per_device"] < full["tflops_per_device"]


# 8. New devices.
def test_8_an_inline_device_gets_a_roofline_default():
    base = load_cluster("h100-sxm-x8").to_dict()
    base["device"] = dict(name="new-accelerator", peak_tflops={"bf16": 1500},
                          hbm_gib=120, hbm_gbytes_per_s=5000)
    cluster = ClusterSpec.model_validate(base)
    pred = predict(load_model("llama3-8b"), cluster,
                   Plan(dp=8, zero=3, global_batch_size=64, seq_len=4096))
    assert 0 < pred.mfu < 1
    assert any("roofline" in c for c in pred.caveats)


# 9. Device counts.
def test_9_a_device_count_that_is_not_whole_nodes_is_one_clear_line():
    out = run_cli("predict", "--model", "gpt3-175b", "--cluster", "a100-80gb-x1021",
                  "--plan", "tp=1,dp=1021,global_batch_size=1021,seq_len=2048")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "a100-80gb-x1016" in out.stderr + out.stdout


def test_9_a_prime_node_count_gets_leave_devices_idle():
    from trainpilot.plan import search

    result = search(_gpt3(), load_cluster("a100-80gb-x104"), global_batch_size=1536,
                    seq_len=2048, top=1)
    assert result.best is not None and result.best.plan.idle_devices == 8


def test_9_zero_stages_on_one_shard_are_one_plan_and_cost_the_same_memory():
    from trainpilot.plan import search

    model, cluster = load_model("tiny-gpt"), load_cluster("cpu-x1")
    result = search(model, cluster, global_batch_size=8, seq_len=256, top=10)
    zeros = {c.plan.zero for c in result}
    assert zeros == {0}
    z0 = predict(model, cluster, Plan(zero=0, global_batch_size=8, seq_len=256))
    z2 = predict(model, cluster, Plan(zero=2, global_batch_size=8, seq_len=256))
    assert z2.memory_gib["peak"] == pytest.approx(z0.memory_gib["peak"])


# 10. The search space from the CLI.
def test_10_the_cli_restricts_the_search():
    out = run_cli("plan", "--model", "gpt3-175b", "--cluster", "a100-80gb-x1024",
                  "--global-batch-size", "1536", "--seq-len", "2048", "--tp", "8", "--no-cp",
                  "--top", "3", "--json")
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)["plans"]
    assert plans and all(p["plan"]["tp"] == 8 and p["plan"]["cp"] == 1 for p in plans)


def test_10_tp_stays_inside_a_node_unless_asked():
    from trainpilot.plan import SearchSpace, search

    cluster = load_cluster("a100-80gb-x1024")
    result = search(_gpt3(), cluster, global_batch_size=1536, seq_len=2048, top=5)
    assert all(c.plan.tp <= cluster.devices_per_node for c in result)
    wider = search(_gpt3(), cluster, global_batch_size=1536, seq_len=2048, top=1,
                   space=SearchSpace(tp=(16,), tp_across_nodes=True))
    assert wider.best.plan.tp == 16


# 11. Small models at large data-parallel sizes.
@pytest.mark.parametrize("label", ["mpt-1b s2048 512xh100_80gb mb12 z2",
                                   "Nemotron-4 15B t4 2048 GPUs"])
def test_11_small_models_at_large_dp_are_not_several_times_too_slow(label):
    from trainpilot.perf.validation import all_cases, run

    [case] = [c for c in all_cases(find_vtrain=False) if c.label == label]
    [result] = run([case])
    assert abs(result.error) < 0.5, result.error


# 12. The executing stack.
def test_12_the_runtime_profile_changes_the_prediction_physically():
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x8")
    base = dict(dp=8, zero=3, micro_batch_size=2, global_batch_size=16, seq_len=8192)
    eager = predict(model, cluster, Plan(runtime=dict(stack="pytorch"), **base))
    compiled = predict(model, cluster, Plan(runtime=dict(stack="pytorch", compile=True), **base))
    megatron = predict(model, cluster, Plan(runtime=dict(stack="megatron"), **base))
    assert eager.step_time_s > compiled.step_time_s > 0
    assert eager.step_time_s > megatron.step_time_s
    # trainpilot's own runtime is PyTorch FSDP2 eager: predicted as that.
    own = predict(model, cluster, Plan(**base))
    assert own.step_time_s == pytest.approx(eager.step_time_s)
    with pytest.raises(SpecError, match=r"^plan\.runtime\.compile: ") as info:
        validate(Plan, dict(runtime=dict(stack="megatron", compile=True), **base), doc="plan")
    assert "\n" not in str(info.value)
