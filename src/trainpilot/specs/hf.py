"""Hugging Face ``config.json`` <-> ModelSpec, with transformers' own semantics.

Import goes through ``transformers.AutoConfig.for_model(model_type, **data)``, so every key a
file leaves out takes the default that transformers itself would use (a GPT-2 config without
``tie_word_embeddings`` is tied; a Llama config without ``rms_norm_eps`` has 1e-6), and RoPE
settings are read from transformers' normalised ``rope_parameters``. Each supported
``model_type`` maps the fields its modelling code reads; anything we cannot represent is
refused with one line rather than approximated (tests/specs/test_hf_import.py checks the
parameter count of each against ``AutoModelForCausalLM.from_config`` on the meta device).

Export (:func:`hf_config_from_model`) writes the inverse for the two shapes that map exactly
onto a transformers architecture: Llama (RoPE, RMSNorm, SwiGLU, no biases) and GPT-2 (learned
positions, LayerNorm, GELU-tanh, biases, multi-head attention).
"""

from __future__ import annotations

from typing import Any

from trainpilot.specs.errors import SpecError

_HF_MARKERS = ("model_type", "architectures", "n_layer", "transformers_version")

# model_type -> family of mapping rules below.
SUPPORTED = {
    "llama": "llama", "mistral": "llama", "qwen3": "llama", "mixtral": "llama",
    "qwen3_moe": "llama", "deepseek_v3": "deepseek", "gpt2": "gpt2",
}
_QK_NORM = ("qwen3", "qwen3_moe")


def looks_like_hf_config(data: dict[str, Any]) -> bool:
    return any(key in data for key in _HF_MARKERS)


def hf_config(data: dict[str, Any]):
    """The ``transformers`` config object a Hub ``config.json`` mapping stands for."""
    import transformers

    model_type = data.get("model_type") or ("gpt2" if "n_layer" in data else None)
    if model_type not in SUPPORTED:
        raise SpecError("model_type", model_type,
                        f"valid: {', '.join(sorted(SUPPORTED))} (a Hugging Face config.json)")
    kwargs = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    except (TypeError, ValueError) as err:
        raise SpecError("config.json", model_type, f"transformers rejects it: {err}") from None


def model_from_hf_config(data: dict[str, Any], *, default_name: str = "hf-model") -> dict[str, Any]:
    """ModelSpec keys from a Hugging Face config mapping, read with transformers' defaults."""
    cfg = hf_config(data)
    family = SUPPORTED[cfg.model_type]
    name = str(data.get("_name_or_path") or default_name).rstrip("/").split("/")[-1]
    spec = {"name": name or default_name, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": bool(cfg.tie_word_embeddings)}
    if family == "gpt2":
        spec.update(_gpt2(cfg))
    else:
        spec.update(_decoder(cfg))
        if family == "deepseek":
            spec.update(_deepseek(cfg))
        elif cfg.model_type in ("mixtral", "qwen3_moe"):
            spec["moe"] = _moe(cfg)
    return spec


def _gpt2(cfg) -> dict[str, Any]:
    if cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise SpecError("activation_function", cfg.activation_function,
                        "valid: gelu_new or gelu_pytorch_tanh (the tanh GELU we model)")
    return {
        "num_hidden_layers": cfg.n_layer, "hidden_size": cfg.n_embd,
        "num_attention_heads": cfg.n_head, "intermediate_size": cfg.n_inner or 4 * cfg.n_embd,
        "activation": "gelu", "norm": "layernorm", "norm_eps": cfg.layer_norm_epsilon,
        "bias": True, "position_embedding": "learned",
        "max_position_embeddings": cfg.n_positions,
    }


def _decoder(cfg) -> dict[str, Any]:
    """Fields every RoPE / RMSNorm / gated-MLP decoder shares (Llama's modelling code)."""
    if cfg.hidden_act != "silu":
        raise SpecError("hidden_act", cfg.hidden_act, "valid: silu (SwiGLU)")
    for key in ("attention_bias", "mlp_bias"):
        if getattr(cfg, key, False):
            raise SpecError(key, True, "biases on some linears only are not modelled; "
                                       "valid: false")
    heads = cfg.num_attention_heads
    out = {
        "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "intermediate_size": cfg.intermediate_size, "activation": "swiglu",
        "norm": "rmsnorm", "norm_eps": cfg.rms_norm_eps, "bias": False,
        "position_embedding": "rope", "max_position_embeddings": cfg.max_position_embeddings,
        "qk_norm": cfg.model_type in _QK_NORM,
    }
    out.update(_rope(cfg))
    return out


def _rope(cfg) -> dict[str, Any]:
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    out: dict[str, Any] = {"rope_theta": float(params.get("rope_theta", 10000.0))}
    kind = params.get("rope_type", "default")
    if kind == "default":
        return out
    if kind not in ("llama3", "yarn", "linear"):
        raise SpecError("rope_scaling.rope_type", kind, "valid: default, llama3, yarn, linear")
    keys = ("factor", "original_max_position_embeddings", "low_freq_factor",
            "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    out["rope_scaling"] = {"type": kind, **{k: params[k] for k in keys
                                             if params.get(k) is not None}}
    return out


def _moe(cfg) -> dict[str, Any]:
    if cfg.model_type == "mixtral":  # softmax over all experts, top-k renormalised
        return {"num_experts": cfg.num_local_experts, "top_k": cfg.num_experts_per_tok,
                "expert_intermediate_size": cfg.intermediate_size,
                "aux_loss_coeff": cfg.router_aux_loss_coef}
    if list(getattr(cfg, "mlp_only_layers", None) or []):
        raise SpecError("mlp_only_layers", cfg.mlp_only_layers,
                        "dense layers outside a leading block are not modelled; valid: []")
    return {"num_experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
            "expert_intermediate_size": cfg.moe_intermediate_size,
            "layer_freq": cfg.decoder_sparse_step, "router_norm_topk": bool(cfg.norm_topk_prob),
            "aux_loss_coeff": cfg.router_aux_loss_coef}


def _deepseek(cfg) -> dict[str, Any]:
    """DeepSeek-V3 as transformers builds it: MLA, sigmoid routing with an expert bias
    (``noaux_tc``), group-limited top-k, shared experts, a dense prefix, MTP modules."""
    groups = cfg.n_group if (cfg.n_group or 1) > 1 else None
    moe = {"num_experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
           "expert_intermediate_size": cfg.moe_intermediate_size,
           "num_shared_experts": cfg.n_shared_experts or 0,
           "first_k_dense_layers": cfg.first_k_dense_replace,
           "router_score": "sigmoid", "router_expert_bias": True,
           "router_norm_topk": bool(cfg.norm_topk_prob),
           "num_expert_groups": groups or 1, "topk_groups": cfg.topk_group if groups else None,
           "router_scaling_factor": cfg.routed_scaling_factor}
    mla = {"q_lora_rank": cfg.q_lora_rank or 0, "kv_lora_rank": cfg.kv_lora_rank,
           "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
           "v_head_dim": cfg.v_head_dim}
    return {"moe": {k: v for k, v in moe.items() if v is not None}, "mla": mla,
            "head_dim": cfg.v_head_dim, "qk_norm": False,
            "num_key_value_heads": cfg.num_attention_heads,
            "num_mtp_layers": getattr(cfg, "num_nextn_predict_layers", 0) or 0}


def hf_config_from_model(model) -> dict[str, Any]:
    """A ``config.json`` mapping for ``model`` (a ModelSpec) whose transformers model computes
    what trainpilot's reference GPT computes: Llama for the RoPE/RMSNorm/SwiGLU shape, GPT-2
    for the learned-position/LayerNorm/GELU shape. Raises SpecError for any other shape."""
    if model.moe is not None or model.mla is not None:
        raise SpecError("model", model.name, "MoE and MLA models have no exact transformers "
                        "counterpart here; valid: a dense Llama- or GPT-2-shaped model")
    if (model.position_embedding, model.norm, model.activation, model.bias) == (
            "rope", "rmsnorm", "swiglu", False) and not model.qk_norm:
        out = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
               "hidden_size": model.hidden_size, "intermediate_size": model.intermediate_size,
               "num_hidden_layers": model.num_hidden_layers,
               "num_attention_heads": model.num_attention_heads,
               "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim,
               "hidden_act": "silu", "rms_norm_eps": model.norm_eps,
               "max_position_embeddings": model.max_position_embeddings,
               "vocab_size": model.vocab_size, "tie_word_embeddings": model.tie_word_embeddings,
               "attention_bias": False, "mlp_bias": False,
               "rope_theta": model.rope_theta}
        if model.rope_scaling is not None:
            scaling = model.rope_scaling.to_dict()
            out["rope_scaling"] = {"rope_type": scaling.pop("type"), **scaling}
        return out
    if (model.position_embedding, model.norm, model.activation, model.bias) == (
            "learned", "layernorm", "gelu", True) and model.kv_heads == model.num_attention_heads:
        return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                "n_layer": model.num_hidden_layers, "n_embd": model.hidden_size,
                "n_head": model.num_attention_heads, "n_inner": model.intermediate_size,
                "n_positions": model.max_position_embeddings, "vocab_size": model.vocab_size,
                "activation_function": "gelu_new", "layer_norm_epsilon": model.norm_eps,
                "tie_word_embeddings": model.tie_word_embeddings,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    raise SpecError("model", model.name,
                    f"{model.position_embedding} positions, {model.norm}, {model.activation}, "
                    f"bias={model.bias}: no exact transformers architecture; valid: rope + "
                    "rmsnorm + swiglu without biases (Llama) or learned + layernorm + gelu with "
                    "biases and multi-head attention (GPT-2)")
