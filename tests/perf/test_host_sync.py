"""Host issue time as the cost model prices it: the host runs ahead of the GPU, except after a
device-to-host sync (a dropless MoE layer reading its per-expert token counts), where the
kernels it issues next wait on it; CUDA graphs replay their kernels from one launch; token
dropping (a capacity factor with padded expert inputs) has static shapes and no sync."""

from __future__ import annotations

import pytest

from trainpilot.perf import predict
from trainpilot.perf.layer import Ops
from trainpilot.plan.megatron import megatron_export
from trainpilot.runtime.layout import check_runtime
from trainpilot.specs import Plan, SpecError, load_cluster, load_model
from trainpilot.specs.loading import validate


def test_the_host_runs_ahead_until_a_sync():
    ops = Ops(10e-6)
    for _ in range(10):  # ten 50 us kernels: the host (10 us each) is hidden
        ops.add(50e-6)
    assert ops.total == pytest.approx(500e-6)
    for _ in range(10):  # ten 1 us kernels: 100 us of issue against 10 of GPU time
        ops.add(1e-6)
    assert ops.total == pytest.approx(max(510e-6, 200e-6))
    ops.sync()  # the host waits here; what follows cannot hide behind what came before
    for _ in range(10):
        ops.add(1e-6)
    assert ops.total == pytest.approx(510e-6 + 100e-6)
    # Negative control: the same kernels without the sync hide the tail's issue time.
    plain = Ops(10e-6)
    for gpu in [50e-6] * 10 + [1e-6] * 20:
        plain.add(gpu)
    assert plain.total == pytest.approx(520e-6)
    assert plain.total < ops.total


def test_a_cuda_graph_is_one_launch():
    eager, graphed = Ops(10e-6), Ops(10e-6)
    with graphed.graph(True):
        for _ in range(50):
            graphed.add(1e-6)
    for _ in range(50):
        eager.add(1e-6)
    assert eager.total == pytest.approx(500e-6)
    assert graphed.total == pytest.approx(50e-6)  # the GPU time; one 10 us launch under it
    assert graphed.kernels == eager.kernels == 50


def _qwen3_b200(mbs: int = 1, **runtime) -> float:
    """Step time of Qwen3-30B-A3B on 8 B200 (EP 8, 16 local experts each), Megatron-Core,
    MXFP8 as Megatron-Bridge's B200 recipes run it (one quantization per local expert)."""
    plan = Plan(dp=8, ep=8, etp=1, micro_batch_size=mbs, global_batch_size=64, seq_len=4096,
                precision="fp8", fp8_recipe="mxfp8",
                runtime=dict(stack="megatron", moe_imbalance=1.0, **runtime))
    return predict(load_model("qwen3-30b-a3b"), load_cluster("b200-x8"), plan).step_time_s


def test_dropless_moe_pays_its_sync_and_token_dropping_does_not():
    # Where the GPU work before the sync (attention) outlasts its issue and the expert path
    # after it does not (micro-batch 4), the sync exposes the expert path's issue time.
    assert _qwen3_b200(mbs=4) > 1.05 * _qwen3_b200(mbs=4, moe_capacity_factor=1.0)
    # Host-bound throughout (micro-batch 1), a sync changes nothing: both runs are issue time.
    assert _qwen3_b200() >= _qwen3_b200(moe_capacity_factor=1.0)
    # Megatron-Bridge's issue #1998 / performance tables: the token-drop run (whole layers
    # captured as CUDA graphs, static shapes) ran about 2x the dropless one's tokens/s.
    graphed = _qwen3_b200(moe_capacity_factor=1.0, cuda_graph_scope=["attn", "moe"])
    assert graphed < 0.5 * _qwen3_b200()
    # A larger micro-batch amortises the per-layer issue time over 4x the tokens.
    assert _qwen3_b200(mbs=4) < 0.5 * _qwen3_b200()
    # Negative control: with a negligible host time neither the sync nor graphs matter.
    fast = dict(host_us_per_kernel=0.01)
    base = _qwen3_b200(mbs=4, **fast)
    assert base == pytest.approx(_qwen3_b200(mbs=4, moe_capacity_factor=1.0, **fast),
                                 rel=1e-3)
    assert base == pytest.approx(_qwen3_b200(mbs=4, moe_capacity_factor=1.0,
                                             cuda_graph_scope=["attn", "moe"], **fast),
                                 rel=1e-3)


def test_a_gpu_bound_dense_model_ignores_the_host_time():
    def step(host: float) -> float:
        plan = Plan(tp=8, dp=1, micro_batch_size=1, global_batch_size=16, seq_len=8192,
                    sequence_parallel=True, runtime=dict(stack="megatron",
                                                         host_us_per_kernel=host))
        return predict(load_model("llama3-70b"), load_cluster("h100-sxm-x8"),
                       plan).step_time_s

    assert step(36.5) == pytest.approx(step(10.0), rel=1e-3)  # the optimizer step's launches
    assert step(5000.0) > 1.5 * step(10.0)  # the mechanism is live when the host is slow


@pytest.mark.parametrize("runtime,needle", [
    (dict(cuda_graph_scope=["attn", "moe"]), "moe_capacity_factor"),
    (dict(moe_capacity_factor=1.0, cuda_graph_scope=["moe", "moe_router"]), "moe or moe_router"),
    (dict(cuda_graph_scope=["moe_preprocess"]), "add moe_router"),
    (dict(cuda_graph_scope=["attn", "attn"]), "twice"),
    (dict(moe_capacity_factor=1.0, cuda_graph_scope=["moe_router", "moe_preprocess"]),
     "drop moe_preprocess"),
])
def test_graph_scopes_megatron_refuses_are_refused_in_one_line(runtime, needle):
    data = dict(dp=8, ep=8, global_batch_size=8, seq_len=4096,
                runtime=dict(stack="megatron", **runtime))
    with pytest.raises(SpecError, match=needle) as info:
        validate(Plan, data, doc="plan")
    assert str(info.value).startswith("plan.runtime.cuda_graph_scope: ")
    assert "\n" not in str(info.value)


def test_inline_plans_take_a_scope_list():
    from trainpilot.specs.loading import parse_inline

    data = parse_inline("dp=8,runtime.cuda_graph_scope=[attn,moe_router],runtime.stack=megatron")
    assert data == {"dp": 8, "runtime": {"cuda_graph_scope": ["attn", "moe_router"],
                                         "stack": "megatron"}}


def test_the_knobs_reach_megatron_and_other_stacks_refuse_them():
    model = load_model("qwen3-30b-a3b")
    plan = Plan(dp=8, ep=8, etp=1, global_batch_size=8, seq_len=4096,
                runtime=dict(stack="megatron", moe_capacity_factor=1.25,
                             cuda_graph_scope=["attn", "moe"]))
    flags = dict(megatron_export(plan, model).flags)
    assert flags["--moe-expert-capacity-factor"] == "1.25"
    assert "--moe-pad-expert-input-to-capacity" in flags
    assert flags["--cuda-graph-impl"] == "transformer_engine"
    assert flags["--cuda-graph-scope"] == ["attn", "moe"]
    assert "--cuda-graph-scope attn moe" in megatron_export(plan, model).text()
    with pytest.raises(SpecError, match="dropless"):
        check_runtime(model, plan, backend="fake")


def test_current_scaling_pays_its_amax_pass():
    """Transformer Engine's current scaling (Float8CurrentScalingQuantizer::quantize_impl) runs
    an amax kernel over the input, a scale kernel and the cast: 3 kernels and 6 bytes per element
    where delayed scaling's fused cast is 1 and 4; MXFP8 computes block scales in the cast."""
    from trainpilot.perf.hardware import FP8_CAST

    assert FP8_CAST["current"] == (6.0, 3) and FP8_CAST["delayed"] == (4.0, 1)
    assert FP8_CAST["mxfp8"][1] == 1 and FP8_CAST["mxfp8"][0] < 4.1

    def step(recipe: str, model: str = "qwen3-30b-a3b") -> float:
        plan = Plan(dp=16, ep=16, etp=1, global_batch_size=64, seq_len=4096, precision="fp8",
                    fp8_recipe=recipe, runtime=dict(stack="megatron", moe_imbalance=1.0))
        return predict(load_model(model), load_cluster("h100-sxm-x16"), plan).step_time_s

    assert step("current") > 1.05 * step("delayed")  # 8 local experts' casts, after the sync
    # MXFP8 quantizes per expert (one kernel each, block scales inside the cast), delayed
    # scaling once for all of them (GroupedLinear's multi-tensor cast): in between.
    assert step("delayed") < step("mxfp8") < step("current")
    with pytest.raises(SpecError, match="fp8_recipe") as info:
        validate(Plan, dict(dp=8, global_batch_size=8, seq_len=4096, fp8_recipe="current"),
                 doc="plan")
    assert str(info.value).startswith("plan.fp8_recipe: ") and "\n" not in str(info.value)
    plan = Plan(dp=8, global_batch_size=8, seq_len=4096, precision="fp8", fp8_recipe="current")
    assert dict(megatron_export(plan, load_model("llama3-8b")).flags)["--fp8-recipe"] == \
        "tensorwise"
