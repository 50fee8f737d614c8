"""Reference models: shapes agree with the cost model's parameter count, recomputation does not
change gradients, the MoE balance loss reaches the gradients, and initial values do not depend
on how the model is cut."""

from __future__ import annotations

import pytest
import torch

from trainpilot.perf.flops import count_params
from trainpilot.runtime.models import build_gpt, init_parameters, keep_stage
from trainpilot.specs import load_model

VARIANTS = {
    "gelu-learned-tied": dict(name="v", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                              vocab_size=100, activation="gelu", norm="layernorm", bias=True,
                              position_embedding="learned", max_position_embeddings=32,
                              tie_word_embeddings=True),
}


def _model(spec, seq_len=32, seed=0):
    model = build_gpt(spec, max_seq_len=seq_len)
    model.to_empty(device="cpu")
    init_parameters(model, spec, seed=seed)
    return model


@pytest.mark.parametrize("name", ["tiny-gpt", "tiny-moe", "gelu-learned-tied"])
def test_parameter_count_matches_perf_flops(name):
    spec = load_model(VARIANTS.get(name, name))
    model = build_gpt(spec, max_seq_len=spec.max_position_embeddings
                      if spec.position_embedding == "learned" else 64)
    assert sum(p.numel() for p in model.parameters()) == count_params(spec).total


def _grads(spec, recompute):
    torch.manual_seed(0)
    model = _model(spec)
    model.set_recompute(recompute)
    x = torch.randint(0, spec.vocab_size, (2, 32))
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_leaves_gradients_unchanged(mode):
    spec = load_model("tiny-gpt")
    ref, got = _grads(spec, "none"), _grads(spec, mode)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=1e-6)


def test_moe_balance_loss_reaches_the_router_gradient():
    """The autograd trick (no loss term, a gradient injected in backward) must equal adding
    coeff * aux to the loss; and with coeff 0 the router gradient must differ (control)."""
    spec = load_model("tiny-moe")
    model = _model(spec)
    moe = model.layers["1"].feed_forward
    x = torch.randn(2, 16, spec.hidden_size)
    out = moe(x)
    out.sum().backward()
    injected = moe.router.weight.grad.clone()

    moe.zero_grad()
    coeff, moe.aux_coeff = moe.aux_coeff, 0.0
    out = moe(x)
    probs = moe.router(x.reshape(-1, spec.hidden_size)).float().softmax(-1)
    top = probs.topk(spec.moe.top_k, dim=-1).indices
    share = torch.bincount(top.flatten(), minlength=spec.moe.num_experts).float() / top.numel()
    aux = spec.moe.num_experts * (share * probs.mean(0)).sum()
    (out.sum() + coeff * aux).backward()
    torch.testing.assert_close(injected, moe.router.weight.grad, rtol=1e-5, atol=1e-7)

    moe.zero_grad()
    moe(x).sum().backward()  # still coeff 0: no balance gradient
    assert not torch.allclose(injected, moe.router.weight.grad, rtol=1e-3, atol=1e-6)


def test_init_is_independent_of_the_pipeline_cut():
    spec = load_model("tiny-gpt")
    full = _model(spec, seed=5)
    stage = build_gpt(spec, max_seq_len=32)
    keep_stage(stage, [2, 3], first=False, last=True)
    stage.to_empty(device="cpu")
    init_parameters(stage, spec, seed=5)
    full_params = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full_params[name]), name
    assert not torch.equal(_model(spec, seed=6).layers["0"].attention.wq.weight,
                           full.layers["0"].attention.wq.weight)


def test_stage_forward_composes_to_the_full_model():
    spec = load_model("tiny-gpt")
    full = _model(spec, seed=1)
    first = keep_stage(_model(spec, seed=1), [0, 1], first=True, last=False)
    last = keep_stage(_model(spec, seed=1), [2, 3], first=False, last=True)
    x = torch.randint(0, spec.vocab_size, (2, 32))
    torch.testing.assert_close(last(first(x)), full(x), rtol=0, atol=0)
