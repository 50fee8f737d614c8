"""A Hugging Face config.json on disk loads as a ModelSpec (files written by the test)."""

from __future__ import annotations

import json

import pytest

from trainpilot.perf.flops import count_params
from trainpilot.specs import load_model

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 128256, "transformers_version": "4.40.0",
}

MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "vocab_size": 32000,
    "max_position_embeddings": 32768,
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "num_hidden_layers": 61, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
}


def _write(tmp_path, folder, data):
    path = tmp_path / folder / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    return path


def test_llama_config_matches_preset(tmp_path):
    model = load_model(str(_write(tmp_path, "Meta-Llama-3-8B", LLAMA3_8B)))
    preset = load_model("llama3-8b")
    assert model.name == "Meta-Llama-3-8B"
    assert model.replace(name="x", max_position_embeddings=1) == preset.replace(
        name="x", max_position_embeddings=1)


def test_mixtral_config_is_moe(tmp_path):
    model = load_model(str(_write(tmp_path, "mixtral", MIXTRAL)))
    assert model.moe is not None and (model.moe.num_experts, model.moe.top_k) == (8, 2)
    counts = count_params(model)
    assert counts.total / 1e9 == pytest.approx(46.70, rel=0.005)


def test_deepseek_config_counts_671b(tmp_path):
    model = load_model(str(_write(tmp_path, "DeepSeek-V3", DEEPSEEK_V3)))
    assert model.mla is not None and model.moe.first_k_dense_layers == 3
    assert count_params(model).total / 1e9 == pytest.approx(671.0, rel=0.005)


def test_gpt2_style_config(tmp_path):
    data = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
            "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new"}
    model = load_model(str(_write(tmp_path, "gpt2", data)))
    assert model.position_embedding == "learned" and model.bias
    # GPT-2 small has 124.4M parameters with its embedding tied to the output.
    assert model.replace(tie_word_embeddings=True) is not None
    assert count_params(model.replace(tie_word_embeddings=True)).total / 1e6 == pytest.approx(124.4, rel=0.005)
