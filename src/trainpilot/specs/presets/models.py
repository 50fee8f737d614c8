"""Model presets. Each cites where its numbers come from; families derive from one base."""

from __future__ import annotations

from typing import Any

# GPT-3 style (Brown et al. 2020; Megatron-LM pads the GPT-2 vocabulary to 51,200): learned
# positions, LayerNorm, biased linears, GELU MLP of width 4h.
_GPT = dict(
    activation="gelu", norm="layernorm", bias=True, position_embedding="learned",
    max_position_embeddings=2048, vocab_size=51200, tie_word_embeddings=False,
)

# Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, Table 3, and the released config.json):
# RoPE (base 500,000), RMSNorm (eps 1e-5), SwiGLU, GQA with 8 key-value heads, 128,256-token
# vocabulary.
_LLAMA3 = dict(
    activation="swiglu", norm="rmsnorm", bias=False, position_embedding="rope",
    vocab_size=128256, num_key_value_heads=8, tie_word_embeddings=False,
    max_position_embeddings=131072, rope_theta=500000.0, norm_eps=1e-5,
)
# Llama 3.1's long-context RoPE scaling (the 3.1 config.json's `rope_scaling`).
_LLAMA31_ROPE = dict(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)


def _gpt(name: str, layers: int, hidden: int, heads: int) -> dict[str, Any]:
    return dict(_GPT, name=name, num_hidden_layers=layers, hidden_size=hidden,
                num_attention_heads=heads, intermediate_size=4 * hidden)


MODELS: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B config.json
    "llama3-8b": dict(_LLAMA3, name="llama3-8b", num_hidden_layers=32, hidden_size=4096,
                      num_attention_heads=32, intermediate_size=14336),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama3-70b": dict(_LLAMA3, name="llama3-70b", num_hidden_layers=80, hidden_size=8192,
                       num_attention_heads=64, intermediate_size=28672),
    # meta-llama/Llama-3.1-405B config.json; Llama 3 report Table 3
    "llama3-405b": dict(_LLAMA3, name="llama3-405b", num_hidden_layers=126, hidden_size=16384,
                        num_attention_heads=128, intermediate_size=53248,
                        rope_scaling=_LLAMA31_ROPE),
    # Brown et al. 2020, Table 2.1 (GPT-3 175B: 96 layers, d_model 12,288, 96 heads)
    "gpt3-175b": _gpt("gpt3-175b", 96, 12288, 96),
    # Korthikanti et al. 2022 ("Reducing Activation Recomputation"), Table 3
    "megatron-22b": _gpt("megatron-22b", 48, 6144, 64),
    "megatron-530b": _gpt("megatron-530b", 105, 20480, 128),
    "megatron-1t": _gpt("megatron-1t", 128, 25600, 160),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts, 2 active, expert width 14,336,
    # rope_theta 1e6, rms_norm_eps 1e-5
    "mixtral-8x7b": dict(
        name="mixtral-8x7b", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, activation="swiglu",
        norm="rmsnorm", position_embedding="rope", max_position_embeddings=32768,
        rope_theta=1e6, norm_eps=1e-5,
        moe=dict(num_experts=8, top_k=2, expert_intermediate_size=14336, aux_loss_coeff=0.02),
    ),
    # deepseek-ai/DeepSeek-V3 config.json and the DeepSeek-V3 report (arXiv 2412.19437):
    # 61 layers, first 3 dense (width 18,432), 256 routed experts of width 2,048, 8 active,
    # 1 shared expert. Multi-head latent attention is modelled exactly by its projections
    # (q_lora_rank 1536, kv_lora_rank 512, qk head dim 128 + 64 RoPE, v head dim 128); the
    # multi-token-prediction module (14B) is left out of the cost model, as in the report's
    # 671B count, but exported (num_nextn_predict_layers 1). Routing as in config.json:
    # sigmoid scores, an expert bias for the choice (noaux_tc), 8 groups with the best 4 kept,
    # weights renormalised and scaled by 2.5; YaRN RoPE (factor 40 over a 4,096 context).
    "deepseek-v3": dict(
        name="deepseek-v3", num_hidden_layers=61, hidden_size=7168, num_attention_heads=128,
        num_key_value_heads=128, head_dim=128, intermediate_size=18432, vocab_size=129280,
        activation="swiglu", norm="rmsnorm", position_embedding="rope",
        max_position_embeddings=163840, norm_eps=1e-6, rope_theta=10000.0, num_mtp_layers=1,
        rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        moe=dict(num_experts=256, top_k=8, expert_intermediate_size=2048, num_shared_experts=1,
                 first_k_dense_layers=3, aux_loss_coeff=0.0001, router_score="sigmoid",
                 router_norm_topk=True, router_expert_bias=True, num_expert_groups=8,
                 topk_groups=4, router_scaling_factor=2.5),
        mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128),
    ),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of width 768, 8 active, head_dim 128,
    # RMSNorm on queries and keys, rope_theta 1e6, rms_norm_eps 1e-6
    "qwen3-30b-a3b": dict(
        name="qwen3-30b-a3b", num_hidden_layers=48, hidden_size=2048, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144, vocab_size=151936,
        activation="swiglu", norm="rmsnorm", position_embedding="rope",
        max_position_embeddings=40960, qk_norm=True, rope_theta=1e6, norm_eps=1e-6,
        moe=dict(num_experts=128, top_k=8, expert_intermediate_size=768, aux_loss_coeff=0.001),
    ),
    # Qwen/Qwen3-235B-A22B config.json: 94 layers, 128 experts of width 1,536, 8 active,
    # GQA with 4 KV heads of dim 128 (QK-norm not modelled: a negligible elementwise op)
    "qwen3-235b-a22b": dict(
        name="qwen3-235b-a22b", num_hidden_layers=94, hidden_size=4096, num_attention_heads=64,
        num_key_value_heads=4, head_dim=128, intermediate_size=12288, vocab_size=151936,
        activation="swiglu", norm="rmsnorm", position_embedding="rope",
        max_position_embeddings=40960,
        moe=dict(num_experts=128, top_k=8, expert_intermediate_size=1536, aux_loss_coeff=0.001),
    ),
    # moonshotai/Kimi-K2-Base config.json: DeepSeek-V3's architecture with 384 routed experts,
    # 64 attention heads and one dense layer (first_k_dense_replace = 1), vocabulary 163,840.
    "kimi-k2": dict(
        name="kimi-k2", num_hidden_layers=61, hidden_size=7168, num_attention_heads=64,
        num_key_value_heads=64, head_dim=128, intermediate_size=18432, vocab_size=163840,
        activation="swiglu", norm="rmsnorm", position_embedding="rope",
        max_position_embeddings=131072,
        moe=dict(num_experts=384, top_k=8, expert_intermediate_size=2048, num_shared_experts=1,
                 first_k_dense_layers=1, aux_loss_coeff=0.0),
        mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128),
    ),
    # openai/gpt-oss-20b and gpt-oss-120b config.json: 64 query heads of dim 64, 8 KV heads,
    # alternating 128-token sliding-window and full attention layers (the first is sliding),
    # 32 / 128 experts of width 2,880, 4 active; biases on the attention projections, the
    # experts and the router ("attention_bias": true, the checkpoints' *_bias tensors); the GLU's
    # inputs clamped to 7 ("swiglu_limit"). Attention sinks (one learned logit per head) are an
    # elementwise detail the cost model leaves out.
    "gpt-oss-20b": dict(
        name="gpt-oss-20b", num_hidden_layers=24, hidden_size=2880, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, intermediate_size=2880, vocab_size=201088,
        activation="swiglu", norm="rmsnorm", position_embedding="rope", bias=True,
        activation_clamp=7.0,
        max_position_embeddings=131072, sliding_window=128, sliding_window_every=2,
        moe=dict(num_experts=32, top_k=4, expert_intermediate_size=2880),
    ),
    "gpt-oss-120b": dict(
        name="gpt-oss-120b", num_hidden_layers=36, hidden_size=2880, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, intermediate_size=2880, vocab_size=201088,
        activation="swiglu", norm="rmsnorm", position_embedding="rope", bias=True,
        activation_clamp=7.0,
        max_position_embeddings=131072, sliding_window=128, sliding_window_every=2,
        moe=dict(num_experts=128, top_k=4, expert_intermediate_size=2880),
    ),
    # Test-sized models (ours): train in seconds on one CPU core.
    "tiny-gpt": dict(
        name="tiny-gpt", num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=384, vocab_size=256, activation="swiglu",
        norm="rmsnorm", position_embedding="rope", max_position_embeddings=1024,
    ),
    "tiny-moe": dict(
        name="tiny-moe", num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=384, vocab_size=256, activation="swiglu",
        norm="rmsnorm", position_embedding="rope", max_position_embeddings=1024,
        moe=dict(num_experts=4, top_k=2, expert_intermediate_size=192, num_shared_experts=1,
                 first_k_dense_layers=1),
    ),
}
