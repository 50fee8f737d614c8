"""Sim2Infer's kernel physics: the GEMM form and its fit to DeepGEMM's table, the runtime
profiles (GEMM kernel class, GQA KV reuse), the prefill all-to-all's SM share, kernel counts."""

from __future__ import annotations

import math

import pytest

from trainpilot.perf.serve import (
    GEMM_KERNELS,
    GemmKernels,
    PassShape,
    ServeEfficiency,
    gemm_seconds,
    kernels_per_layer,
    pass_cost,
)
from trainpilot.sim import serve_gemm
from trainpilot.specs import SpecError, load_cluster, load_model
from trainpilot.specs.serve import InstanceLayout, ServePlan, load_serve_plan

EFF = ServeEfficiency()
K = GemmKernels(fp8_efficiency=0.5, hbm_efficiency=0.8, overlap_loss=0.5, latency_us=2.0)


def test_gemm_form_by_hand():
    peak, bw = 500e12, 4e12  # FLOP/s after the class's efficiency; nominal HBM bytes/s
    achieved = bw * K.hbm_efficiency

    def by_hand(rows, padded):
        num_bytes = 8192 * 8192 + rows * 8192 * 1.0 + rows * 8192 * 2.0
        c, m = 2 * padded * 8192 * 8192 / peak, num_bytes / achieved
        return max(c, m) + 0.5 * min(c, m) + 2e-6, num_bytes, c >= m

    # 64 rows through 8,192 x 8,192 FP8 weights: memory-bound, the overlap loss on compute.
    got = gemm_seconds(K, peak, bw, rows=64, n=8192, k=8192, weight_bytes=1.0, act_bytes=1.0)
    assert got[2] is False and got == pytest.approx(by_hand(64, 64))
    # 65 rows are computed as 128 (the 64-row tile) and become compute-bound.
    got = gemm_seconds(K, peak, bw, rows=65, n=8192, k=8192, weight_bytes=1.0, act_bytes=1.0)
    assert got[2] is True and got == pytest.approx(by_hand(65, 128))
    # Grouped: four groups cost four times the FLOPs and bytes, one latency.
    one = gemm_seconds(K, peak, bw, rows=256, n=4096, k=7168, weight_bytes=1.0)
    four = gemm_seconds(K, peak, bw, rows=256, n=4096, k=7168, weight_bytes=1.0, groups=4)
    assert four[0] == pytest.approx(4 * (one[0] - 2e-6) + 2e-6)


def test_gemm_constants_are_the_fit_to_deepgemms_table():
    for kind in ("deepgemm", "cutlass-3.6"):
        fitted, mape = serve_gemm.fit_gemm(kind)
        committed = GEMM_KERNELS[kind]
        for name in ("fp8_efficiency", "hbm_efficiency", "overlap_loss", "latency_us"):
            assert getattr(committed, name) == pytest.approx(getattr(fitted, name), rel=0.01,
                                                             abs=0.01), (kind, name)
        assert mape < 0.08
        # Negative control: the plain roofline (perfect overlap, no latency) misses the table.
        plain = GemmKernels(fp8_efficiency=committed.fp8_efficiency,
                            hbm_efficiency=committed.hbm_efficiency, overlap_loss=0.0,
                            latency_us=0.0)
        errors = serve_gemm.fit_errors(plain, kind)
        assert sum(abs(math.expm1(e)) for e in errors) / len(errors) > 1.5 * mape
    source = serve_gemm.load_table()["source"]
    assert source["url"].startswith("https://") and source["licence"]


def test_runtime_profiles_change_what_they_say():
    l70, h200 = load_model("llama3-70b"), load_cluster("h200-x8")
    shape = PassShape(decode_seqs=64, decode_rows=64, context=4096)
    base = ServePlan(input_len=4096, output_len=2, weight_dtype="fp8", kv_dtype="fp8")
    layout = InstanceLayout()

    def kv_s(plan, model=l70):
        return pass_cost(model, h200, plan, layout, shape, EFF).seconds["hbm_kv"]

    masked = base.replace(runtime=dict(name="masked", gqa_kv_reuse=False))
    assert kv_s(masked) == pytest.approx(8 * kv_s(base))  # 64 query heads over 8 KV heads
    mha = l70.replace(num_key_value_heads=64)
    assert kv_s(masked, mha) == pytest.approx(kv_s(base, mha))  # MHA: nothing to share
    ds = load_model("deepseek-v3")  # MLA: one latent per token, nothing per head
    assert kv_s(masked, ds) == pytest.approx(kv_s(base, ds))
    old = base.replace(runtime="trtllm-0.5")
    assert old.runtime.gemm_kernels == "cutlass-3.6" and not old.runtime.gqa_kv_reuse
    slow = pass_cost(l70, h200, base.replace(runtime=dict(gemm_kernels="cutlass-3.6")),
                     layout, shape, EFF)
    fast = pass_cost(l70, h200, base, layout, shape, EFF)
    assert slow.seconds["hbm_weights"] > 1.3 * fast.seconds["hbm_weights"]
    with pytest.raises(SpecError, match="runtime: got 'trtllm-9'; valid: current"):
        load_serve_plan("llama3-8b-tp1-fp8", runtime="trtllm-9")


def test_prefill_all_to_all_holds_sms_decode_does_not():
    ds, h800 = load_model("deepseek-v3"), load_cluster("h800-x144")
    ep = InstanceLayout(dp_attention=32, ep=32)
    plan = ServePlan(input_len=4096, output_len=1, weight_dtype="fp8", two_batch_overlap=True)
    prompt = PassShape(prefill_rows=16384, prefill_pairs=4 * 4096 * 4097 / 2, prefill_seqs=4)
    free = EFF.replace(a2a_sm_fraction=0.0)
    held = pass_cost(ds, h800, plan, ep, prompt, EFF).total_s
    assert held > 1.02 * pass_cost(ds, h800, plan, ep, prompt, free).total_s
    step = PassShape(decode_seqs=128, decode_rows=128, context=4096)
    assert pass_cost(ds, h800, plan, ep, step, EFF).total_s == pytest.approx(
        pass_cost(ds, h800, plan, ep, step, free).total_s)


def test_kernel_counts_by_architecture():
    assert kernels_per_layer(load_model("llama3-8b"), False) == 12
    ds = load_model("deepseek-v3")
    assert kernels_per_layer(ds, True) == 26 and kernels_per_layer(ds, False) == 18


def test_triton_moe_constants_are_the_fit_to_vllms_table():
    """The routed experts' early-2025 kernel class is the fit to vLLM's published Triton
    fused-MoE times; the DeepGEMM class, the default, misses that table by far (so the table
    says something the default does not)."""
    fitted, mape = serve_gemm.fit_moe_triton()
    committed = GEMM_KERNELS["triton-moe-2025"]
    for name in ("fp8_efficiency", "hbm_efficiency", "overlap_loss", "latency_us"):
        assert getattr(committed, name) == pytest.approx(getattr(fitted, name), rel=0.01,
                                                         abs=0.01), name
    assert mape < 0.13
    errors = serve_gemm.moe_fit_errors(GEMM_KERNELS["deepgemm"])
    assert sum(abs(math.expm1(e)) for e in errors) / len(errors) > 4 * mape
    assert all(e < 0 for e in errors)  # the default class is faster than the Triton kernel
    source = serve_gemm.load_moe_table()["source"]
    assert source["url"].startswith("https://") and source["licence"]


def test_moe_kernel_class_prices_the_routed_experts_only():
    ds, llama, h200 = load_model("deepseek-v3"), load_model("llama3-70b"), load_cluster("h200-x8")
    plan = ServePlan(input_len=3200, output_len=800, weight_dtype="fp8")
    triton = plan.replace(runtime="triton-moe-2025")
    assert triton.runtime.moe_gemm_kernels == "triton-moe-2025"
    assert triton.runtime.gemm_kernels == plan.runtime.gemm_kernels
    layout, step = InstanceLayout(tp=8), PassShape(decode_seqs=128, decode_rows=128,
                                                   context=4000)
    fast, slow = (pass_cost(ds, h200, p, layout, step, EFF) for p in (plan, triton))
    assert slow.total_s > 2 * fast.total_s
    # Same FLOPs and bytes: only the kernel's achieved rates differ.
    assert slow.flops == pytest.approx(fast.flops) and slow.hbm_bytes == pytest.approx(
        fast.hbm_bytes)
    # Negative control: a dense model has no routed experts, so nothing changes.
    assert pass_cost(llama, h200, triton, layout, step, EFF).total_s == pytest.approx(
        pass_cost(llama, h200, plan, layout, step, EFF).total_s)
