"""torchtitan's per-op selective activation checkpointing as a plan's ``recompute: op``: priced
from its policy (every second ``aten.mm`` of a layer recomputed, the attention and the other
saved outputs kept, every op outside its save list re-run), exported to torchtitan, refused by
the stacks that have no such policy."""

from __future__ import annotations

import pytest

from trainpilot.perf import predict
from trainpilot.perf.flops import hardware_flops_per_token, op_recompute_share
from trainpilot.plan.deepspeed import deepspeed_config
from trainpilot.plan.megatron import megatron_args
from trainpilot.runtime.layout import check_runtime
from trainpilot.specs import Plan, SpecError, load_cluster, load_model


def _plan(recompute: str, precision: str = "bf16") -> Plan:
    return Plan(dp=8, zero=3, micro_batch_size=1, global_batch_size=8, seq_len=8192,
                recompute=recompute, precision=precision)


def _recompute_s(recompute: str, precision: str = "bf16") -> float:
    pred = predict(load_model("llama3-8b"), load_cluster("h100-sxm-x8"),
                   _plan(recompute, precision))
    return pred.breakdown_s["recompute"]


def test_every_second_matmul_of_a_layer_is_recomputed():
    """Llama 3 8B runs wq, wk, wv, wo, w1, w3, w2 per layer; the policy's counter re-runs the
    2nd, 4th and 6th: wk (4,096 x 1,024), wo (4,096^2), w3 (4,096 x 14,336), 36.5% of the
    linear FLOPs, so the executed FLOPs grow by that share of the forward's linear part."""
    l8 = load_model("llama3-8b")
    h, kv, f = 4096, 1024, 14336
    share = (h * kv + h * h + h * f) / (2 * h * h + 2 * h * kv + 3 * h * f)
    assert op_recompute_share(l8) == pytest.approx(share, rel=1e-12)
    assert share == pytest.approx(0.365, abs=1e-3)
    none, op = (hardware_flops_per_token(l8, 8192, r) for r in ("none", "op"))
    full = hardware_flops_per_token(l8, 8192, "full")
    assert none < op < full


def test_it_costs_between_none_and_full_and_under_fp8_re_runs_every_linear():
    """16-bit: more than no recompute, less than a whole layer without its attention core.
    fp8: the linears run as ``aten._scaled_mm``, outside the save list of torchtitan's
    2024-25 policy, so all of them are re-run: the whole layer but the attention core (full
    recompute less selective), to rounding."""
    assert _recompute_s("none") == 0.0
    bf16_op, bf16_full, bf16_sel = (_recompute_s(r) for r in ("op", "full", "selective"))
    assert 0.2 * (bf16_full - bf16_sel) < bf16_op < 0.8 * (bf16_full - bf16_sel)
    fp8_op, fp8_full, fp8_sel = (_recompute_s(r, "fp8") for r in ("op", "full", "selective"))
    assert fp8_op == pytest.approx(fp8_full - fp8_sel, rel=0.02)


def test_torchtitan_exports_it_and_the_other_stacks_refuse_it():
    from trainpilot.plan.torchtitan import torchtitan_config

    l8, plan = load_model("llama3-8b"), _plan("op")
    assert "config.activation_checkpoint = SelectiveAC.Config()" in torchtitan_config(plan, l8)
    with pytest.raises(SpecError, match="Megatron-LM"):
        megatron_args(plan, l8)
    with pytest.raises(SpecError, match="whole layers"):
        deepspeed_config(plan, l8)
    with pytest.raises(SpecError, match="plan.recompute"):
        check_runtime(load_model("tiny-gpt"), plan.replace(dp=2, global_batch_size=2,
                                                            seq_len=64), backend="gloo")


def test_the_collectives_outside_its_save_list_run_again():
    """The policy saves reduce-scatter outputs only: under sequence parallelism the two
    all-gathers of a layer's forward run again (half its TP traffic: a quarter of forward plus
    backward), without it both all-reduces (half of forward plus backward)."""
    l8, h100 = load_model("llama3-8b"), load_cluster("h100-sxm-x8")

    def tp_comm(recompute: str, sp: bool) -> float:
        plan = Plan(tp=8, micro_batch_size=1, global_batch_size=1, seq_len=8192,
                    recompute=recompute, sequence_parallel=sp)
        return predict(l8, h100, plan).breakdown_s["tp_comm"]

    assert tp_comm("op", True) == pytest.approx(1.25 * tp_comm("none", True), rel=0.02)
    assert tp_comm("op", False) == pytest.approx(1.5 * tp_comm("none", False), rel=0.02)


def test_it_keeps_the_saved_matmul_outputs_and_the_attention_output():
    """Llama 3 8B, 8,192 tokens, one rank, bf16: the layer input, the outputs of wq, wv, w1 and
    w2 (the odd matmuls), the attention output and its fp32 log-sum-exp; under fp8 no matmul
    output ( ``_scaled_mm`` is not saved). Between full recompute and none, by hand."""
    from trainpilot.perf.layer import LayerSetup, activation_bytes

    l8 = load_model("llama3-8b")
    m, h, kv, f, heads = 8192, 4096, 1024, 14336, 32
    setup = LayerSetup(tp=1, cp=1, ep=1, micro_batch_size=1, seq_len=m,
                       sequence_parallel=False, flash_attention=True, dropout=False)
    none, _, full, op = activation_bytes(l8, False, setup)
    by_hand = 2 * m * (h + h + kv + f + h) + 2 * m * h + 4 * heads * m
    assert op == pytest.approx(by_hand, rel=1e-12)
    assert full < op < 0.6 * none
    fp8 = activation_bytes(l8, False, LayerSetup(**{**setup.__dict__, "gemm_input_bytes": 1}))
    assert fp8[3] == pytest.approx(2 * m * h + 2 * m * h + 4 * heads * m, rel=1e-12)
    peak = {r: predict(l8, load_cluster("h100-sxm-x8"), _plan(r)).memory_gib["peak"]
            for r in ("none", "op", "full")}
    assert peak["full"] < peak["op"] < peak["none"]
