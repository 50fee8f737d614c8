"""FP8 training as Transformer Engine and torchao run it: only the linear layers' GEMMs are
FP8, at the measured FP8-over-BF16 GEMM share (not the datasheet's 2x), each with its inputs'
cast-transposes; attention and the LM head stay 16-bit. The blind batch of 2026-12-02 found
FP8 rows 20-350% optimistic under the old "BF16 curve at the FP8 peak" pricing (attention
included); these tests fail on it."""

from __future__ import annotations

import pytest

from trainpilot.perf import predict
from trainpilot.perf.hardware import FP8_CAST_BYTES, FP8_GEMM_SHARE, device_model
from trainpilot.specs import Plan, load_cluster, load_model

MEGATRON_70B = dict(tp=4, pp=8, vp=5, dp=2, micro_batch_size=1, global_batch_size=128,
                    seq_len=8192, sequence_parallel=True,
                    runtime=dict(stack="megatron", tp_comm_overlap=True))


def test_fp8_speeds_a_large_model_up_by_well_under_2x():
    """Llama 3 70B on 64 H100 (the Megatron-Bridge layout): the old pricing made FP8 1.8x
    faster; GEMMs at 1.67x, 16-bit attention and the casts leave 1.2-1.6x (Megatron-Bridge's
    FP8 run of this layout and DGX Cloud's BF16 one differ by 1.45x)."""
    model, cluster = load_model("llama3-70b"), load_cluster("h100-sxm-x64")
    bf16 = predict(model, cluster, Plan(precision="bf16", **MEGATRON_70B))
    fp8 = predict(model, cluster, Plan(precision="fp8", **MEGATRON_70B))
    assert 1.2 < bf16.step_time_s / fp8.step_time_s < 1.6


def test_attention_and_other_gemms_stay_16_bit_and_linear_gemms_pay_their_casts():
    cluster = load_cluster("h100-sxm-x8")
    bf16, fp8 = device_model(cluster, "bf16"), device_model(cluster, "fp8")
    assert fp8.attention_s(1e12) == pytest.approx(bf16.attention_s(1e12))
    assert fp8.gemm_s(8192, 8192, 8192) == pytest.approx(bf16.gemm_s(8192, 8192, 8192))
    ratio = bf16.gemm_s(8192, 8192, 8192, linear=True) / fp8.gemm_s(8192, 8192, 8192,
                                                                     linear=True)
    assert ratio == pytest.approx(fp8.fp8_flops / fp8.peak_flops)  # compute-bound: 1.67x
    assert fp8.fp8_flops == pytest.approx(1979e12 * FP8_GEMM_SHARE)
    assert fp8.fp8_cast_s(1e9) == pytest.approx(FP8_CAST_BYTES * 1e9 / fp8.hbm_bytes_per_s)
    assert bf16.fp8_cast_s(1e9) == 0.0
    # MFU is still quoted against the precision's datasheet peak.
    assert (fp8.nominal_flops, bf16.nominal_flops) == (1979e12, 989e12)


def _dense_layer(stack: str, recipe: str, precision: str = "fp8", **extra):
    """One Llama 3 8B layer on an H100 (8,192 rows, TP 1), as the cost model prices it."""
    from trainpilot.perf.estimator import Estimator, layout_of

    model = load_model("llama3-8b")
    plan = Plan(dp=8, micro_batch_size=1, global_batch_size=8, seq_len=8192, precision=precision,
                fp8_recipe=recipe, runtime=dict(stack=stack), **extra)
    est = Estimator(model, load_cluster("h100-sxm-x8"))
    lay = layout_of(model, plan, est.options)
    return est.layer(lay, False, est.spans(lay))


def test_te_norms_carry_the_amax_of_their_output_under_current_scaling():
    """Transformer Engine's LayerNormLinear computes the norm output's amax inside the norm
    kernel under current scaling (FUSED_NORM_AMAX_FP8), so the QKV and FC1 inputs skip the
    separate amax pass (2 bytes per element, one kernel) that the attention output and the
    activation, the other two GEMM inputs, still pay."""
    model = load_model("llama3-8b")
    h, ffn = model.hidden_size, model.ffn_size

    def extra(stack: str) -> tuple[float, int]:
        cur, delayed = _dense_layer(stack, "current"), _dense_layer(stack, "delayed")
        return cur.fwd_compute_s - delayed.fwd_compute_s, cur.num_kernels - delayed.num_kernels

    te_s, te_k = extra("megatron")
    plain_s, plain_k = extra("deepspeed")  # negative control: norms without the amax
    assert te_s > 0  # the attention output and the activation still pay their amax pass
    # All four inputs (h, h, h, ffn elements per row) against the two that are not norm-fed.
    assert plain_s / te_s == pytest.approx((3 * h + ffn) / (h + ffn), rel=1e-6)
    assert plain_k - te_k == 2


def test_grouped_linear_casts_all_experts_at_once_only_under_delayed_scaling():
    """Transformer Engine's GroupedLinear quantizes its experts' inputs with split_quantize:
    one multi-tensor cast-transpose for every local expert under delayed scaling, one
    quantization per expert otherwise (cast.cpp, multi_tensor_quantize_impl)."""
    from trainpilot.perf.estimator import Estimator, layout_of

    def moe_kernels(recipe: str, ep: int) -> int:
        model = load_model("qwen3-30b-a3b")  # 128 experts: 16 per rank at EP 8, 128 at EP 1
        plan = Plan(dp=8, ep=ep, etp=1, micro_batch_size=1, global_batch_size=8, seq_len=4096,
                    precision="fp8", fp8_recipe=recipe,
                    runtime=dict(stack="megatron", moe_imbalance=1.0))
        est = Estimator(model, load_cluster("h100-sxm-x8"))
        lay = layout_of(model, plan, est.options)
        return est.layer(lay, True, est.spans(lay)).num_kernels

    # Per input (two forward, two backward): one kernel under delayed scaling whatever the
    # local experts, three per local expert under current scaling. The difference between
    # the recipes, taken at 128 and at 16 local experts, leaves the expert casts alone (the
    # attention's casts and the permutation cancel): 4 inputs x 3 kernels x 112 experts. Had
    # delayed scaling cast per expert too, it would be 4 x (3 - 1) x 112.
    gap = {ep: moe_kernels("current", ep) - moe_kernels("delayed", ep) for ep in (1, 8)}
    assert gap[1] - gap[8] == 4 * 3 * (128 - 16)


def _linear_elements(model) -> tuple[float, float, float]:
    """(weight, input, output-gradient) elements of one dense layer's linear maps (the
    attention projections, the SwiGLU FC1 and FC2) for the ``_dense_layer`` micro-batch."""
    from trainpilot.perf.layer import _attention_gemms

    m, h, ffn = 8192.0, model.hidden_size, model.ffn_size
    gemms = _attention_gemms(model, 1) + [(2 * ffn, h), (h, ffn)]
    return (sum(n * k for n, k in gemms), sum(m * k for _, k in gemms),
            sum(m * n for n, _ in gemms))


def test_pytorch_stacks_cast_fp8_weights_in_every_pass():
    """torchao's Float8Linear quantizes its weight inside every forward (both orientations, an
    amax read first under tensorwise scaling: 8 bytes per element as torchao's roofline counts
    them); Transformer Engine caches the FP8 weight for the step. Two stacks that differ in
    nothing else differ by exactly that traffic."""
    from trainpilot.perf.hardware import FP8_WEIGHT_CAST

    model = load_model("llama3-8b")
    torchao, cached = _dense_layer("pytorch", "current"), _dense_layer("trainpilot", "current")
    weights, _, _ = _linear_elements(model)
    hbm = device_model(load_cluster("h100-sxm-x8"), "fp8").hbm_bytes_per_s
    assert FP8_WEIGHT_CAST["current"][0] == 8.0
    assert torchao.fwd_compute_s - cached.fwd_compute_s == pytest.approx(
        8.0 * weights / hbm, rel=1e-6)
    assert torchao.bwd_compute_s == pytest.approx(cached.bwd_compute_s)
    # Negative control: in BF16 the stacks cost the same.
    bf16 = [_dense_layer(s, "delayed", precision="bf16") for s in ("pytorch", "trainpilot")]
    assert bf16[0].fwd_compute_s == pytest.approx(bf16[1].fwd_compute_s)


def test_rowwise_scaling_casts_each_orientation_and_rescales_the_backward_outputs():
    """torchao's rowwise recipe: each GEMM input is cast twice from 16 bits (8 bytes per
    element against tensorwise's 6), and the backward GEMMs run cuBLAS's tensor-scaled kernel
    and multiply their 16-bit outputs by the scales afterwards (a read and a write, 4 bytes
    per element of each backward output). On a stack that caches weights (no weight casts),
    rowwise minus tensorwise is exactly that."""
    model = load_model("llama3-8b")
    row, tensor = _dense_layer("trainpilot", "rowwise"), _dense_layer("trainpilot", "current")
    weights, inputs, grad_outputs = _linear_elements(model)
    hbm = device_model(load_cluster("h100-sxm-x8"), "fp8").hbm_bytes_per_s
    assert row.fwd_compute_s - tensor.fwd_compute_s == pytest.approx(
        (8.0 - 6.0) * inputs / hbm, rel=1e-6)
    # The backward outputs: each GEMM's input gradient (m x k) and weight gradient (n x k).
    assert row.bwd_compute_s - tensor.bwd_compute_s == pytest.approx(
        ((8.0 - 6.0) * grad_outputs + 4.0 * (inputs + weights)) / hbm, rel=1e-6)


def test_megatron_export_refuses_the_rowwise_recipe_in_one_line():
    """Row-wise scaling is torchao's; Megatron's --fp8-recipe has no such choice."""
    from trainpilot.plan.megatron import megatron_export
    from trainpilot.specs import SpecError

    plan = Plan(dp=8, global_batch_size=8, seq_len=4096, precision="fp8", fp8_recipe="rowwise")
    with pytest.raises(SpecError) as info:
        megatron_export(plan, load_model("llama3-8b"))
    assert str(info.value).startswith("plan.fp8_recipe: ") and "\n" not in str(info.value)
    tensorwise = Plan(dp=8, global_batch_size=8, seq_len=4096, precision="fp8",
                      fp8_recipe="current")  # negative control: exported
    assert dict(megatron_export(tensorwise, load_model("llama3-8b")).flags)["--fp8-recipe"] == \
        "tensorwise"


def _stage(**plan):
    """The first pipeline stage of Llama 3 8B on 64 H100 (Megatron, DP 64) as costed."""
    from trainpilot.perf.estimator import Estimator, layout_of

    model = load_model("llama3-8b")
    est = Estimator(model, load_cluster("h100-sxm-x64"))
    full = Plan(dp=64, micro_batch_size=1, global_batch_size=128, seq_len=8192,
                runtime=dict(stack="megatron"), **plan)
    return est.evaluate(layout_of(model, full, est.options)).stages[0]


def test_fp8_param_gather_moves_one_byte_per_parameter():
    """Megatron's --fp8-param-gather (torchtitan's float8 all-gather) gathers the 8-bit weights:
    the distributed optimizer's parameter all-gather carries half the bytes, exactly the
    traffic of a model with half the parameters at 16 bits. MXFP8 is the negative control:
    Megatron gathers 16-bit values into the gradient buffer and quantizes after the gather."""
    import dataclasses

    from trainpilot.perf.dataparallel import traffic
    from trainpilot.perf.estimator import Estimator, layout_of
    from trainpilot.perf.memory import RankParams

    base = dict(zero=1, fp8_recipe="current", precision="fp8")
    plain, gathered = _stage(**base), _stage(**base, fp8_param_gather=True)
    assert gathered.dp_comm_s < plain.dp_comm_s
    assert gathered.compute_s == pytest.approx(plain.compute_s)  # TE caches its FP8 weight
    mx = dict(zero=1, fp8_recipe="mxfp8", precision="fp8")
    assert _stage(**mx, fp8_param_gather=True).dp_comm_s == pytest.approx(
        _stage(**mx).dp_comm_s)
    # The all-gather term itself: 1 byte per parameter is 2 bytes for half of them.
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x64")
    est = Estimator(model, cluster)
    lay = layout_of(model, Plan(dp=64, global_batch_size=64, seq_len=8192), est.options)
    spans = est.spans(lay)
    params = RankParams(dense=8e9, expert=0.0, largest_layer=2e8)
    half = dataclasses.replace(params, dense=4e9)
    net = est.net
    common = dict(zero=1, grad_bytes=2, spans=spans, hierarchical=False, bucket_bytes=160e6,
                  dp_shard=None, tied_bytes=0.0, num_layers=32)
    one = traffic(net, params=params, param_bytes=1.0, **common)
    two = traffic(net, params=half, param_bytes=2.0, **common)
    assert one.step_gather_s == pytest.approx(two.step_gather_s)
    assert traffic(net, params=params, **common).step_gather_s > one.step_gather_s


def test_a_float8_gathered_weight_is_transposed_not_cast_in_every_pass():
    """torchao with FSDP2 float8 all-gather casts each rank's shard before the gather, so the
    layer stops casting the whole weight (8 bytes per element under tensorwise scaling) and
    only copies it transposed for the backward's grad_input GEMM (1 + 1 bytes)."""
    from trainpilot.perf.hardware import FP8_GATHERED_WEIGHT

    model = load_model("llama3-8b")
    weights, _, _ = _linear_elements(model)
    hbm = device_model(load_cluster("h100-sxm-x8"), "fp8").hbm_bytes_per_s
    cast = _dense_layer("pytorch", "current", zero=3)
    gathered = _dense_layer("pytorch", "current", zero=3, fp8_param_gather=True)
    assert FP8_GATHERED_WEIGHT == (2.0, 1)
    assert cast.fwd_compute_s - gathered.fwd_compute_s == pytest.approx(
        (8.0 - 2.0) * weights / hbm, rel=1e-6)
    # Negative control: Transformer Engine's weight cache makes the flag free in compute.
    te = [_dense_layer("megatron", "current", zero=1, fp8_param_gather=flag)
          for flag in (False, True)]
    assert te[0].fwd_compute_s == pytest.approx(te[1].fwd_compute_s)


@pytest.mark.parametrize("plan, field", [
    (dict(precision="bf16", fp8_param_gather=True), "fp8_param_gather"),
    (dict(precision="fp8", fp8_recipe="rowwise", fp8_param_gather=True), "fp8_param_gather"),
    (dict(precision="fp8", fp8_recipe="mxfp8", fp8_param_gather=True,
          runtime=dict(stack="pytorch")), "fp8_param_gather"),
    # Nothing is gathered without sharded parameters (Megatron's validate_args refuses it too).
    (dict(precision="fp8", fp8_recipe="current", fp8_param_gather=True, zero=0),
     "fp8_param_gather"),
])
def test_fp8_param_gather_is_refused_where_no_stack_does_it(plan, field):
    from trainpilot.specs import SpecError, load_plan

    with pytest.raises(SpecError) as info:
        load_plan(dict(dp=8, global_batch_size=8, seq_len=4096, **plan))
    assert info.value.field.endswith(field) and "\n" not in str(info.value)
    # Negative control: the same flag with a recipe that gathers is accepted.
    Plan(dp=8, global_batch_size=8, seq_len=4096, precision="fp8", fp8_recipe="current",
         fp8_param_gather=True, runtime=dict(stack="pytorch"))


def test_megatron_export_passes_fp8_param_gather_and_needs_the_distributed_optimizer():
    from trainpilot.plan.megatron import megatron_export
    from trainpilot.specs import SpecError, load_plan

    model = load_model("llama3-8b")
    plan = Plan(dp=8, global_batch_size=8, seq_len=4096, precision="fp8", zero=1,
                fp8_param_gather=True)
    assert "--fp8-param-gather" in dict(megatron_export(plan, model).flags)
    off = Plan(dp=8, global_batch_size=8, seq_len=4096, precision="fp8", zero=1)
    assert "--fp8-param-gather" not in dict(megatron_export(off, model).flags)
    # ZeRO 0 cannot hold the flag, so no exported plan carries it without the distributed
    # optimizer (Megatron's validate_args would refuse it).
    with pytest.raises(SpecError) as info:
        load_plan(dict(dp=8, global_batch_size=8, seq_len=4096, precision="fp8", zero=0,
                       fp8_param_gather=True))
    assert info.value.field.endswith("fp8_param_gather") and "zero is 0" in str(info.value)


def _fp8_search(**kw):
    from trainpilot.plan import search
    from trainpilot.specs import RuntimeProfile, load_cluster

    runtime = RuntimeProfile.model_validate(dict(stack=kw.pop("stack", "megatron")))
    return search(load_model("llama3-8b"), load_cluster("h100-sxm-x16"), global_batch_size=128,
                  seq_len=8192, top=3, runtime=runtime, **kw)


def test_search_sets_fp8_param_gather_on_megatron_plans_that_shard_parameters():
    """Megatron's FP8 runs all-gather 8-bit parameters (--fp8-param-gather); the search used to
    rank FP8 plans with 16-bit gathers and export them without the flag."""
    found = _fp8_search(precision="fp8", fp8_recipe="current")
    assert found.plans, "an fp8 plan fits"
    for cand in found.plans:
        assert cand.plan.fp8_recipe == "current"  # the recipe reaches the plan (was: delayed)
        assert cand.plan.fp8_param_gather == (cand.plan.zero >= 1)
    sharded = [c for c in found.plans if c.plan.zero >= 1]
    assert sharded, "a plan with the distributed optimizer ranks in the top 3"
    # Negative control: the flag turned off prices the same plan's gather in 16 bits.
    off = _fp8_search(precision="fp8", fp8_recipe="current", fp8_param_gather=False)
    assert all(not c.plan.fp8_param_gather for c in off.plans)
    plan = sharded[0].plan
    slower = predict(load_model("llama3-8b"), load_cluster("h100-sxm-x16"),
                     plan.model_copy(update=dict(fp8_param_gather=False)))
    assert slower.breakdown_s["dp_comm_exposed"] > sharded[0].prediction.breakdown_s[
        "dp_comm_exposed"]
    # bf16 and stacks without the flag never get it unasked.
    assert not any(c.plan.fp8_param_gather for c in _fp8_search(precision="bf16").plans)
    assert not any(c.plan.fp8_param_gather
                   for c in _fp8_search(precision="fp8", stack="pytorch").plans)


def test_search_with_torchao_float8_all_gather_keeps_to_fsdp_plans():
    found = _fp8_search(precision="fp8", fp8_recipe="current", fp8_param_gather=True,
                        stack="pytorch")
    assert found.plans and all(c.plan.zero >= 1 and c.plan.fp8_param_gather
                               for c in found.plans)


@pytest.mark.parametrize("argv, field", [
    (["--precision", "fp8", "--fp8-recipe", "rowwise", "--fp8-param-gather"],
     "plan.fp8_param_gather"),
    (["--fp8-recipe", "current"], "--fp8-recipe"),
    (["--no-fp8-param-gather"], "--fp8-param-gather"),
])
def test_plan_cli_refuses_fp8_flags_that_cannot_apply(argv, field, capsys):
    from trainpilot.cli.main import main

    code = main(["plan", "--model", "llama3-8b", "--cluster", "h100-sxm-x16",
                 "--global-batch-size", "128", "--seq-len", "8192", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {field}: ") and err.count("\n") == 1, err
