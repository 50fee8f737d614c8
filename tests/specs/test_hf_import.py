"""A Hugging Face config.json loads as a ModelSpec with transformers' own semantics, and its
parameter count equals transformers' own model built on the meta device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainpilot.perf.flops import count_params
from trainpilot.specs import ModelSpec, SpecError, load_model
from trainpilot.specs.hf import hf_config, hf_config_from_model, model_from_hf_config

DATA = Path(__file__).parents[1] / "data" / "hf"

# Published config.json values (the Hub repositories named), the keys that shape the model.
LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 128256, "transformers_version": "4.40.0",
}
LLAMA31_405B = dict(  # meta-llama/Llama-3.1-405B
    LLAMA3_8B, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
    num_hidden_layers=126, max_position_embeddings=131072,
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"})
MIXTRAL = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "vocab_size": 32000,
    "max_position_embeddings": 32768, "rope_theta": 1e6, "router_aux_loss_coef": 0.02,
}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "num_hidden_layers": 61, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840,
    "tie_word_embeddings": False, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "num_nextn_predict_layers": 1, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "router_aux_loss_coef": 0.001,
}
GPT2 = json.loads((DATA / "gpt2" / "config.json").read_text())


def _write(tmp_path, folder, data):
    path = tmp_path / folder / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    return path


def _meta_count(data: dict) -> int:
    """transformers' own parameter count: its model for the config, built on the meta device
    (tied weights counted once, as ``parameters()`` yields them)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config(data))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("data", [LLAMA3_8B, LLAMA31_405B, MIXTRAL, DEEPSEEK_V3, QWEN3_30B_A3B,
                                  GPT2], ids=["llama3-8b", "llama3.1-405b", "mixtral-8x7b",
                                              "deepseek-v3", "qwen3-30b-a3b", "gpt2"])
def test_parameter_count_equals_transformers_meta_build(data):
    ours = count_params(ModelSpec(**model_from_hf_config(data))).total
    assert ours == _meta_count(data)


def test_the_meta_count_catches_a_wrong_import():
    # Negative control: the old import's GPT-2 (untied, as trainpilot used to default) is
    # 38.6M away from what transformers builds for the same file.
    spec = ModelSpec(**model_from_hf_config(GPT2)).replace(tie_word_embeddings=False)
    assert count_params(spec).total - _meta_count(GPT2) == 50257 * 768


def test_gpt2_hub_config_imports_at_124_4m():
    model = load_model(str(DATA / "gpt2" / "config.json"))
    assert model.tie_word_embeddings  # transformers' default: the file has no such key
    assert (model.position_embedding, model.norm, model.bias) == ("learned", "layernorm", True)
    assert count_params(model).total == 124_439_808
    assert round(count_params(model).total / 1e6, 1) == 124.4


def test_hub_configs_import_as_the_presets(tmp_path):
    """A preset equals its model's published config (the name, context length and the MoE
    aux-loss weight, which DeepSeek-V3's config does not carry, aside)."""
    def same(a, b, **extra):
        keep = dict(name="x", max_position_embeddings=1, **extra)
        return a.replace(**keep) == b.replace(**keep)

    assert same(load_model(str(_write(tmp_path, "l8", LLAMA3_8B))), load_model("llama3-8b"))
    assert same(load_model(str(_write(tmp_path, "l405", LLAMA31_405B))),
                load_model("llama3-405b"))
    assert same(load_model(str(_write(tmp_path, "mx", MIXTRAL))), load_model("mixtral-8x7b"))
    assert same(load_model(str(_write(tmp_path, "q3", QWEN3_30B_A3B))),
                load_model("qwen3-30b-a3b"))
    ds = load_model(str(_write(tmp_path, "DeepSeek-V3", DEEPSEEK_V3)))
    preset = load_model("deepseek-v3")
    assert ds.moe.replace(aux_loss_coeff=1) == preset.moe.replace(aux_loss_coeff=1)
    assert same(ds.replace(moe=None), preset.replace(moe=None))
    assert ds.name == "DeepSeek-V3"


def test_real_hyper_parameters_come_through():
    llama = ModelSpec(**model_from_hf_config(LLAMA31_405B))
    assert llama.rope_theta == 500000.0 and llama.rope_scaling.type == "llama3"
    assert llama.rope_scaling.factor == 8.0 and llama.norm_eps == 1e-5
    qwen = ModelSpec(**model_from_hf_config(QWEN3_30B_A3B))
    assert qwen.qk_norm and qwen.norm_eps == 1e-6 and qwen.moe.router_norm_topk
    ds = ModelSpec(**model_from_hf_config(DEEPSEEK_V3))
    assert (ds.moe.router_score, ds.moe.router_expert_bias) == ("sigmoid", True)
    assert (ds.moe.num_expert_groups, ds.moe.topk_groups) == (8, 4)
    assert ds.num_mtp_layers == 1 and ds.rope_scaling.type == "yarn"


def test_transformers_defaults_fill_missing_keys():
    # No rms_norm_eps / rope_theta: LlamaConfig's defaults (1e-6, 10,000), not ours.
    data = {k: v for k, v in LLAMA3_8B.items() if k not in ("rms_norm_eps", "rope_theta")}
    spec = ModelSpec(**model_from_hf_config(data))
    assert spec.norm_eps == 1e-6 and spec.rope_theta == 10000.0


@pytest.mark.parametrize("preset", ["tiny-gpt", "llama3-405b", "gpt3-175b"])
def test_export_round_trips_through_transformers(preset):
    spec = load_model(preset)
    data = hf_config_from_model(spec)
    assert ModelSpec(**model_from_hf_config(data)).replace(name=spec.name) == spec
    assert _meta_count(data) == count_params(spec).total


def test_unsupported_configs_are_refused_in_one_line():
    with pytest.raises(SpecError, match="model_type"):
        model_from_hf_config({"model_type": "t5", "d_model": 512})
    with pytest.raises(SpecError, match="hidden_act"):
        model_from_hf_config(dict(LLAMA3_8B, hidden_act="gelu"))
    with pytest.raises(SpecError, match="valid"):
        hf_config_from_model(load_model("deepseek-v3"))
