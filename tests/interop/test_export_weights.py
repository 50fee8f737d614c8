"""``trainpilot export-weights``: a run's checkpoint written out and loaded by transformers'
``from_pretrained`` (logits equal to the trained model's) or by plain torch."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_cli
from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer
from trainpilot.specs import dump, load_model

transformers = pytest.importorskip("transformers")


def _checkpoint(run_dir, model: torch.nn.Module, steps: int = 3, vocab: int = 128) -> None:
    """Train ``model`` a few AdamW steps on random tokens and save it with trainpilot's
    checkpointer (single process), as a run would."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (2, 16), generator=gen)
        out = model(tokens)
        logits = out.logits if hasattr(out, "logits") else out
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with Checkpointer(CheckpointConfig(root_dir=run_dir / "checkpoints", async_save=False)) as c:
        c.save(steps, {"model": model.state_dict(), "optimizer": opt.state_dict(),
                       "step": steps}).result()


def _tokens(vocab: int = 128):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def test_hf_model_trained_and_saved_by_trainpilot_loads_with_from_pretrained(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, model)
    (run_dir / "hf_config.json").write_text(json.dumps(config.to_dict()))
    result = run_cli("export-weights", str(run_dir), "--to", "hf", "--output",
                     str(tmp_path / "out"), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == 3
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    model.eval()
    with torch.no_grad():
        ours, theirs = model(_tokens()).logits, loaded(_tokens()).logits
    assert torch.equal(ours, theirs)
    fresh = transformers.LlamaForCausalLM(config)  # negative control: untrained weights
    with torch.no_grad():
        assert not torch.allclose(fresh(_tokens()).logits, ours)


def _reference_gpt(spec, seed: int = 0):
    from trainpilot.runtime.models.gpt import build_gpt
    from trainpilot.runtime.models.init import init_parameters

    model = build_gpt(spec, max_seq_len=32, device="cpu")
    init_parameters(model, spec, seed=seed)
    return model


@pytest.mark.parametrize("shape", ["llama", "gpt2"])
def test_reference_gpt_exports_to_a_transformers_architecture(tmp_path, shape):
    spec = load_model("tiny-gpt").replace(num_hidden_layers=2, vocab_size=128)
    if shape == "gpt2":
        spec = spec.replace(position_embedding="learned", norm="layernorm", activation="gelu",
                            bias=True, num_key_value_heads=4, tie_word_embeddings=True)
    model = _reference_gpt(spec)
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, model)
    dump(spec, run_dir / "model.yaml")
    result = run_cli("export-weights", str(run_dir), "--to", "hf")
    assert result.returncode == 0, result.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "export-hf")
    assert type(loaded).__name__ == ("LlamaForCausalLM" if shape == "llama"
                                     else "GPT2LMHeadModel")
    model.eval()
    with torch.no_grad():
        ours, theirs = model(_tokens()), loaded(_tokens()).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), (ours - theirs).abs().max()
    with torch.no_grad():  # negative control: the comparison sees a wrong mapping
        loaded.lm_head.weight.mul_(1.01)
        assert not torch.allclose(ours, loaded(_tokens()).logits, atol=1e-5, rtol=1e-5)


def test_torch_state_dict_loads_into_the_model(tmp_path):
    spec = load_model("tiny-gpt").replace(num_hidden_layers=2, vocab_size=128)
    model = _reference_gpt(spec)
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, model)
    assert run_cli("export-weights", str(run_dir), "--to", "torch").returncode == 0
    state = torch.load(run_dir / "export-torch" / "model.pt", weights_only=True)
    fresh = _reference_gpt(spec, seed=5)
    fresh.load_state_dict(state, strict=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_shapes_without_an_exact_hf_counterpart_are_refused(tmp_path):
    spec = load_model("tiny-moe").replace(vocab_size=128)
    model = _reference_gpt(spec)
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, model)
    dump(spec, run_dir / "model.yaml")
    result = run_cli("export-weights", str(run_dir), "--to", "hf")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "valid" in result.stderr
