"""Import a Hugging Face ``config.json`` (Llama, Mistral/Mixtral, Qwen2/3(-MoE), DeepSeek-V2/V3,
GPT-2/NeoX style) as ModelSpec keys."""

from __future__ import annotations

from typing import Any

_HF_MARKERS = ("model_type", "architectures", "n_layer", "transformers_version")


def looks_like_hf_config(data: dict[str, Any]) -> bool:
    return any(key in data for key in _HF_MARKERS)


def _first(data: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if data.get(key) is not None:
            return data[key]
    return default


def model_from_hf_config(data: dict[str, Any], *, default_name: str = "hf-model") -> dict[str, Any]:
    """ModelSpec keys from a Hugging Face config mapping (unknown HF keys are ignored: they
    describe things we do not model, such as dropout or rope scaling)."""
    act = str(_first(data, "hidden_act", "activation_function", default="gelu")).lower()
    gated = act in ("silu", "swish", "swiglu") or data.get("model_type") in ("llama", "mistral")
    spec: dict[str, Any] = {
        "name": str(_first(data, "_name_or_path", default=default_name)).rstrip("/").split("/")[-1]
        or default_name,
        "num_hidden_layers": _first(data, "num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": _first(data, "hidden_size", "n_embd", "d_model"),
        "num_attention_heads": _first(data, "num_attention_heads", "n_head"),
        "vocab_size": data.get("vocab_size"),
        "activation": "swiglu" if gated else "gelu",
        "tie_word_embeddings": bool(data.get("tie_word_embeddings", False)),
        "norm": "rmsnorm" if "rms_norm_eps" in data else "layernorm",
        "position_embedding": "learned" if "n_positions" in data else "rope",
    }
    optional = {
        "num_key_value_heads": _first(data, "num_key_value_heads", "num_query_groups"),
        "intermediate_size": _first(data, "intermediate_size", "n_inner", "ffn_hidden_size"),
        "head_dim": data.get("head_dim"),
        "max_position_embeddings": _first(data, "max_position_embeddings", "n_positions"),
    }
    spec.update({k: v for k, v in optional.items() if v is not None})
    if "n_layer" in data and "bias" not in spec:  # GPT-2 family has biased linears
        spec["bias"] = True
    num_experts = _first(data, "n_routed_experts", "num_local_experts", "num_experts")
    if num_experts:
        expert_width = _first(data, "moe_intermediate_size", "intermediate_size")
        moe = {
            "num_experts": num_experts,
            "top_k": _first(data, "num_experts_per_tok", "moe_topk", default=2),
            "expert_intermediate_size": expert_width,
            "num_shared_experts": _first(data, "n_shared_experts", default=0),
            "first_k_dense_layers": _first(data, "first_k_dense_replace", default=0),
            "layer_freq": _first(data, "moe_layer_freq", "decoder_sparse_step", default=1),
        }
        shared = data.get("shared_expert_intermediate_size")
        if shared:  # Qwen2-MoE: one shared expert of its own width
            moe["num_shared_experts"] = max(1, moe["num_shared_experts"])
            moe["shared_expert_intermediate_size"] = shared
        spec["moe"] = moe
    if data.get("kv_lora_rank"):
        spec["mla"] = {
            "q_lora_rank": data.get("q_lora_rank") or 0,
            "kv_lora_rank": data["kv_lora_rank"],
            "qk_nope_head_dim": data["qk_nope_head_dim"],
            "qk_rope_head_dim": data["qk_rope_head_dim"],
            "v_head_dim": data["v_head_dim"],
        }
        spec.setdefault("head_dim", data["v_head_dim"])
    return spec
