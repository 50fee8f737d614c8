"""Each kind of bad input: one line naming the field, exit code 2, no traceback."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

GOOD_PLAN = "tp=8,pp=16,dp=8,micro_batch_size=1,global_batch_size=1536,seq_len=2048"


def _check(result, *needles):
    assert result.returncode == 2, result.stderr + result.stdout
    err = result.stderr.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


def _show(*args):
    return run_cli("show", *args)


def test_malformed_yaml(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("num_hidden_layers: 4\nhidden_size: [128\n")
    err = _check(_show("--model", str(path)), "model", "malformed YAML", "line")
    assert str(path) in err


def test_unknown_key(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("num_hidden_layers: 4\nhidden_size: 128\nnum_attention_heads: 4\n"
                    "vocab_size: 256\nhiden_dropout: 0.1\n")
    _check(_show("--model", str(path)), "model.hiden_dropout", "unknown key", "hidden_size")


def test_unknown_nested_key(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("device: a100-80gb\ndevices_per_node: 8\nnum_nodes: 2\nnetwork:\n"
                    "  intra_node: {gbytes_per_s: 300, latncy_us: 5}\n"
                    "  inter_node: {gbytes_per_s: 25}\n")
    _check(_show("--model", "tiny-gpt", "--cluster", str(path)),
           "cluster.network.intra_node.latncy_us", "unknown key", "latency_us")


def test_wrong_type(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("num_hidden_layers: four\nhidden_size: 128\nnum_attention_heads: 4\n"
                    "vocab_size: 256\n")
    _check(_show("--model", str(path)), "model.num_hidden_layers", "'four'", "integer")


def test_negative_size(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text("num_hidden_layers: 4\nhidden_size: -128\nnum_attention_heads: 4\n"
                    "vocab_size: 256\n")
    _check(_show("--model", str(path)), "model.hidden_size", "-128", "greater than 0")


def test_tp_not_dividing_heads():
    _check(_show("--model", "gpt3-175b", "--cluster", "a100-80gb-x1024", "--plan",
                 GOOD_PLAN.replace("tp=8,pp=16,dp=8", "tp=5,pp=16,dp=8")),
           "plan.tp", "got 5", "num_attention_heads=96", "valid: 1, 2, 3")


def test_pp_larger_than_layers():
    _check(_show("--model", "tiny-gpt", "--plan",
                 "pp=8,dp=1,global_batch_size=8,seq_len=64"),
           "plan.pp", "got 8", "num_hidden_layers=4")


def test_world_size_not_matching_cluster():
    _check(_show("--model", "gpt3-175b", "--cluster", "a100-80gb-x1024", "--plan",
                 GOOD_PLAN.replace("dp=8", "dp=4").replace("1536", "1024")),
           "plan.dp*tp*pp*cp", "512", "1024 devices")


def test_top_k_above_num_experts(tmp_path):
    path = tmp_path / "moe.yaml"
    path.write_text("num_hidden_layers: 4\nhidden_size: 128\nnum_attention_heads: 4\n"
                    "vocab_size: 256\nmoe: {num_experts: 4, top_k: 8, expert_intermediate_size: 64}\n")
    _check(_show("--model", str(path)), "model.moe", "top_k=8", "num_experts=4")


def test_batch_not_divisible():
    _check(_show("--model", "tiny-gpt", "--plan", "dp=3,global_batch_size=16,seq_len=64"),
           "plan.global_batch_size", "got 16", "micro_batch_size * dp")


def test_unknown_preset():
    _check(_show("--model", "llama9-1t"), "model", "llama9-1t", "valid presets", "llama3-8b")


def test_missing_file():
    _check(_show("--model", "/nonexistent/model.yaml"), "model", "cannot read")


@pytest.mark.parametrize("plan", ["tp=8,pp", "tp=eight,global_batch_size=8,seq_len=8"])
def test_bad_inline_plan(plan):
    _check(_show("--model", "tiny-gpt", "--plan", plan), "plan")
