"""Parameter counts and FLOPs of a ModelSpec.

FLOPs convention (the one behind published MFU numbers): Megatron-LM's
``num_floating_point_operations`` — every GEMM costs 2*m*n*k, a training step runs each GEMM
three times (forward, backward data-gradient, backward weight-gradient), attention scores are
counted over the full s x s square (no causal halving), the logit GEMM is included and the
embedding lookup, norms, softmax and the router are not. For the GPT-3 family this is exactly
Narayanan et al. 2021's 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)). GQA, SwiGLU, MoE (top-k routed
plus shared experts) and DeepSeek's multi-head latent attention are counted by their actual
projection shapes, which reduces to Megatron's expressions for each.

Hardware FLOPs (HFU) add what recomputation repeats: full recompute re-runs every layer's
forward, selective recompute re-runs the attention core (QK^T and AV) only.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpilot.specs import ModelSpec


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer."""

    attention: int  # Q, K, V, O projections (and MLA's low-rank factors), with biases
    mlp_total: int  # every expert, shared expert and router (what is stored)
    mlp_active: int  # what one token passes through: top_k routed + shared (+ router)
    norms: int

    @property
    def total(self) -> int:
        return self.attention + self.mlp_total + self.norms

    @property
    def active(self) -> int:
        return self.attention + self.mlp_active + self.norms


@dataclass(frozen=True)
class ParamCounts:
    embedding: int  # token (+ learned position) embeddings
    layers: tuple[LayerParams, ...]
    final_norm: int
    output: int  # untied output projection (0 when tied to the embedding)

    @property
    def total(self) -> int:
        return self.embedding + sum(l.total for l in self.layers) + self.final_norm + self.output

    @property
    def active(self) -> int:
        """Parameters touched per token (the "A" in MoE names such as 30B-A3B)."""
        return self.embedding + sum(l.active for l in self.layers) + self.final_norm + self.output


def _norm_params(model: ModelSpec) -> int:
    return model.hidden_size * (2 if model.norm == "layernorm" else 1)


def attention_params(model: ModelSpec) -> int:
    """Projection parameters of one attention block (biases included when ``model.bias``)."""
    h, a = model.hidden_size, model.num_attention_heads
    if model.mla is not None:
        m = model.mla
        qk_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * a * qk_dim
        else:
            q = h * a * qk_dim
        kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv_b = m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
        out = a * m.v_head_dim * h
        return q + kv_a + kv_b + out
    d, kv = model.head_size, model.kv_heads
    weights = h * a * d + 2 * h * kv * d + a * d * h
    biases = (a * d + 2 * kv * d + h) if model.bias else 0
    return weights + biases


def mlp_params(model: ModelSpec, width: int) -> int:
    """One feed-forward block of inner ``width`` (SwiGLU has three matrices, GELU two)."""
    h = model.hidden_size
    mats = 3 if model.activation == "swiglu" else 2
    return mats * h * width + (_mlp_biases(model, width) if model.bias else 0)


def _mlp_biases(model: ModelSpec, width: int) -> int:
    """Bias elements of one feed-forward block of inner ``width``: FC1's output (gate and up
    halves when gated) and FC2's."""
    return (2 if model.activation == "swiglu" else 1) * width + model.hidden_size


def layer_params(model: ModelSpec, index: int) -> LayerParams:
    """Parameters of decoder layer ``index``."""
    attn = attention_params(model)
    norms = 2 * _norm_params(model)
    if model.qk_norm:  # one RMSNorm weight of head_dim each on queries and keys (Qwen3)
        norms += 2 * model.head_size
    if not model.is_moe_layer(index):
        dense = mlp_params(model, model.ffn_size)
        return LayerParams(attn, dense, dense, norms)
    moe = model.moe
    assert moe is not None
    expert = mlp_params(model, moe.expert_intermediate_size)
    shared = mlp_params(model, moe.shared_width) if moe.num_shared_experts else 0
    router = model.hidden_size * moe.num_experts
    total = moe.num_experts * expert + shared + router
    active = moe.top_k * expert + shared + router
    return LayerParams(attn, total, active, norms)


def count_params(model: ModelSpec) -> ParamCounts:
    """Total and per-token-active parameters of ``model``."""
    h, v = model.hidden_size, model.vocab_size
    embedding = v * h
    if model.position_embedding == "learned":
        embedding += model.max_position_embeddings * h
    layers = tuple(layer_params(model, i) for i in range(model.num_hidden_layers))
    output = 0 if model.tie_word_embeddings else v * h
    return ParamCounts(embedding, layers, _norm_params(model), output)


@dataclass(frozen=True)
class ForwardFlops:
    """Forward-pass FLOPs per token, by part (summed over layers)."""

    attention_proj: float
    attention_scores: float  # QK^T and AV over the full s x s square
    mlp: float
    logits: float

    @property
    def total(self) -> float:
        return self.attention_proj + self.attention_scores + self.mlp + self.logits


def _score_dims(model: ModelSpec) -> tuple[int, int]:
    """(query-key dim, value dim) summed over heads."""
    a = model.num_attention_heads
    if model.mla is not None:
        m = model.mla
        return a * (m.qk_nope_head_dim + m.qk_rope_head_dim), a * m.v_head_dim
    d = model.head_size
    return a * d, a * d


def forward_flops_per_token(model: ModelSpec, seq_len: int) -> ForwardFlops:
    """Forward FLOPs per token at sequence length ``seq_len`` (Megatron's convention)."""
    h = model.hidden_size
    qk, vd = _score_dims(model)
    proj = mlp = 0.0
    for index in range(model.num_hidden_layers):
        layer = layer_params(model, index)
        proj += 2.0 * _matmul_weights_attention(model)
        router = h * model.moe.num_experts if model.is_moe_layer(index) else 0  # type: ignore[union-attr]
        mlp += 2.0 * (_matmul_weights_mlp(model, index, layer) - router)
    scores = 2.0 * seq_len * (qk + vd) * model.num_hidden_layers
    logits = 2.0 * model.vocab_size * h
    return ForwardFlops(proj, scores, mlp, logits)


def _matmul_weights_attention(model: ModelSpec) -> int:
    """Attention projection weights without biases or the MLA latent norms."""
    params = attention_params(model)
    if model.mla is not None:
        return params - (model.mla.q_lora_rank + model.mla.kv_lora_rank)
    if model.bias:
        a, d, kv, h = model.num_attention_heads, model.head_size, model.kv_heads, model.hidden_size
        params -= a * d + 2 * kv * d + h
    return params


def _matmul_weights_mlp(model: ModelSpec, index: int, layer: LayerParams) -> int:
    """Active MLP GEMM weights (routed top-k + shared + router) without biases."""
    if not model.bias:
        return layer.mlp_active
    moe = model.moe
    if moe is None or not model.is_moe_layer(index):
        return layer.mlp_active - _mlp_biases(model, model.ffn_size)
    shared = _mlp_biases(model, moe.shared_width) if moe.num_shared_experts else 0
    return layer.mlp_active - moe.top_k * _mlp_biases(model, moe.expert_intermediate_size) - shared


def model_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), for MFU."""
    return 3.0 * forward_flops_per_token(model, seq_len).total


def hardware_flops_per_token(model: ModelSpec, seq_len: int, recompute: str) -> float:
    """Training FLOPs actually executed per token, recomputation included, for HFU."""
    fwd = forward_flops_per_token(model, seq_len)
    extra = 0.0
    if recompute == "full":
        extra = fwd.attention_proj + fwd.attention_scores + fwd.mlp
    elif recompute == "selective":
        extra = fwd.attention_scores
    elif recompute == "op":
        extra = op_recompute_share(model) * (fwd.attention_proj + fwd.mlp)
    return 3.0 * fwd.total + extra


def op_recompute_share(model: ModelSpec) -> float:
    """Share of the linear maps' forward FLOPs that torchtitan's per-op selective checkpointing
    re-runs in 16-bit training: every second ``mm`` of a layer (``perf.layer.op_sac_split``)
    and an MoE layer's routed experts (grouped GEMMs, outside its save list)."""
    from trainpilot.perf.layer import op_sac_split

    total = again = 0.0
    for index in range(model.num_hidden_layers):
        moe_layer = model.is_moe_layer(index)
        saved, rerun = op_sac_split(model, moe_layer, 1)
        again += sum(n * k for n, k in rerun)
        total += sum(n * k for n, k in saved + rerun)
        if moe_layer:
            moe = model.moe
            assert moe is not None  # an MoE layer implies the MoE spec
            routed = moe.top_k * mlp_params(model, moe.expert_intermediate_size)
            total += routed
            again += routed
    return again / total if total else 0.0


def causal_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs per token in the causal count (Megatron-LM since 2025-03, torchtitan):
    as ``model_flops_per_token`` with the attention scores over the causal half of the square,
    and over the window only on sliding-window layers (a query attends to at most
    ``attention_span`` keys, on average half of them when the span is the whole sequence)."""
    fwd = forward_flops_per_token(model, seq_len)
    per_layer = fwd.attention_scores / model.num_hidden_layers  # full square, one layer
    scores = 0.0
    for index in range(model.num_hidden_layers):
        span = model.attention_span(index, seq_len)
        # Mean keys per query: (s + 1) / 2 ~ s / 2 causal; a window w << s: ~ w.
        mean_keys = seq_len / 2 if span >= seq_len else span * (1 - span / (2 * seq_len))
        scores += per_layer * mean_keys / seq_len
    return 3.0 * (fwd.total - fwd.attention_scores + scores)


def narayanan_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Narayanan et al. 2021's per-token count with the recompute forward included:
    96 l h^2 (1 + s/(6h) + V/(16 l h)) / s x s = 96 l h^2 (...) per sequence / s."""
    l, h, v = model.num_hidden_layers, model.hidden_size, model.vocab_size
    return 96.0 * l * h * h * (1 + seq_len / (6 * h) + v / (16 * l * h))


# Named FLOP conventions for published TFLOP/s and MFU: FLOPs per token at a sequence length.
CONVENTIONS = {
    # Megatron-LM's num_floating_point_operations until 2025-03 (Narayanan et al. 2021's
    # count without recompute): attention over the full s x s square, logits included.
    "megatron_full": model_flops_per_token,
    # Megatron-LM since 2025-03 and torchtitan: causal attention counted once.
    "megatron_causal": causal_flops_per_token,
    # Narayanan et al. 2021, Table 1: the full-square count plus the recompute forward.
    "narayanan": narayanan_flops_per_token,
}


def convention_flops_per_token(model: ModelSpec, seq_len: int, convention: str) -> float:
    """FLOPs per token under a named convention (ValueError for an unknown name)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"unknown FLOP convention {convention!r}; valid: "
                         f"{', '.join(CONVENTIONS)}")
    return CONVENTIONS[convention](model, seq_len)
