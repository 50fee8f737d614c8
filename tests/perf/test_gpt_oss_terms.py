"""GPT-OSS's clamped GLU and expert biases, as the stacks that run them compute them: the two
clamps (and on Megatron-Core the concatenation after them) move the GLU input again, and
Megatron-Core's TEGroupedMLP adds FC2's per-expert bias outside the grouped GEMM, a few kernels
per local expert. Bias parameters of an MoE layer count once per expert and are not GEMM
weights."""

from __future__ import annotations

import pydantic
import pytest

from trainpilot.perf.estimator import Estimator, layout_of
from trainpilot.perf.flops import count_params, forward_flops_per_token
from trainpilot.specs import Plan, load_cluster, load_model
from trainpilot.specs.model import ModelSpec


def _layer(stack: str, **changes):
    model = load_model("gpt-oss-120b").model_copy(update=changes)
    plan = Plan(dp=8, ep=8, etp=1, micro_batch_size=1, global_batch_size=64, seq_len=4096,
                runtime=dict(stack=stack, moe_imbalance=1.0))
    est = Estimator(model, load_cluster("h100-sxm-x8"))
    lay = layout_of(model, plan, est.options)
    return est.layer(lay, True, est.spans(lay))


def test_the_preset_says_what_the_checkpoint_has():
    model = load_model("gpt-oss-120b")
    assert model.bias and model.activation_clamp == 7.0


def test_clamp_and_bias_cost_what_megatron_core_moves():
    full = _layer("megatron")
    no_clamp = _layer("megatron", activation_clamp=None)
    neither = _layer("megatron", activation_clamp=None, bias=False)
    # Clamp: two clamps and a concatenation forward, two masked gradients backward.
    assert full.num_kernels == no_clamp.num_kernels + 3 + 2
    # Bias: 2 kernels per local expert (16) and a concatenation forward, 4 and one backward.
    assert no_clamp.num_kernels == neither.num_kernels + (2 * 16 + 1) + (4 * 16 + 1)
    # They move bytes: each term adds a few percent of the layer's forward, not a rounding.
    assert full.fwd_compute_s > no_clamp.fwd_compute_s * 1.01
    assert no_clamp.fwd_compute_s > neither.fwd_compute_s * 1.01


def test_other_stacks_clamp_without_concatenating_and_keep_bias_in_the_gemm():
    full = _layer("pytorch")
    no_clamp = _layer("pytorch", activation_clamp=None)
    neither = _layer("pytorch", activation_clamp=None, bias=False)
    assert full.num_kernels == no_clamp.num_kernels + 2 + 2
    # Negative control: outside Megatron-Core the expert bias is not a separate pass.
    assert no_clamp.num_kernels == neither.num_kernels
    assert no_clamp.fwd_compute_s == pytest.approx(neither.fwd_compute_s)


def test_moe_biases_are_parameters_not_gemm_flops():
    model = load_model("gpt-oss-120b")
    plain = model.model_copy(update={"bias": False})
    layer, plain_layer = count_params(model).layers[0], count_params(plain).layers[0]
    moe = model.moe
    assert moe is not None
    per_expert = 2 * moe.expert_intermediate_size + model.hidden_size  # gated FC1 + FC2
    assert layer.mlp_total - plain_layer.mlp_total == moe.num_experts * per_expert
    # The FLOP count is the GEMMs': biases change neither the MLP's nor the total.
    assert forward_flops_per_token(model, 4096).mlp == pytest.approx(
        forward_flops_per_token(plain, 4096).mlp)


def test_a_clamp_needs_a_gated_activation():
    with pytest.raises(pydantic.ValidationError, match="activation_clamp.*valid: with activation swiglu"):
        ModelSpec(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
                  activation="gelu", activation_clamp=7.0)
