"""Hugging Face models through ``trainpilot train`` as a user types it: ``--model
path/config.json`` (a tiny Llama, Qwen3 and Mixtral made from transformers' own config
classes), real text (Python's standard-library sources, a BPE trained on them), 2 gloo ranks.
Each layout trains (loss falls) and its checkpoint is exported for ``from_pretrained``; the
Mixtral run (experts sharded over ep, whose checkpoint is the hardest to restore) also survives
a rank killed mid-run bit-exact against the same command uninterrupted. The Trainer-level tests
(tests/runtime/test_hf_models.py) restore every model bit-exact in process."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from tests.external.harness import assert_same_run, job, losses, train_args
from tests.runtime.byo_data import SEQ_LEN, make_corpus, tiny_configs

pytestmark = [pytest.mark.dist, pytest.mark.external]
STEPS = 12

CASES = {  # model -> plan (one layout each: the Trainer-level tests cover the others)
    "llama": "dp=2,zero=0,micro_batch_size=4,global_batch_size=8",
    "qwen3": "dp=2,zero=3,micro_batch_size=4,global_batch_size=8",
    "mixtral": "dp=2,ep=2,zero=0,micro_batch_size=4,global_batch_size=8",
}
KILLED = {"mixtral"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def _args(run, config_path, plan, corpus):
    args = train_args(run, steps=STEPS, plan=f"{plan},seq_len={SEQ_LEN}", every=4,
                      extra=("--data", corpus["jsonl"], "--data-tokenizer", corpus["tokenizer"]))
    args[args.index("--model") + 1] = str(config_path)
    return args


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CASES))
def test_hf_model_trains_and_exports(name, corpus, tmp_path):
    config = dict(tiny_configs()[name], model_type=name)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    ref, run = tmp_path / "ref", tmp_path / "run"
    with job(_args(ref, config_path, CASES[name], corpus)) as j:
        assert j.wait() == 0, j.output()[-3000:]
    curve = losses(ref)
    assert curve[STEPS] < curve[1] - 0.3, curve  # it learns the text
    if name in KILLED:
        with job(_args(run, config_path, CASES[name], corpus)) as j:
            j.wait_step(6)
            os.kill(j.workers()[1], signal.SIGKILL)
            assert j.wait() == 0, j.output()[-3000:]
            assert "crash of rank 1" in j.output()  # the fault fired: recovery was needed
        assert_same_run(run, ref, step=STEPS)
    else:
        run = ref

    from transformers import AutoModelForCausalLM

    from tests.external.harness import final_state
    from trainpilot.cli.main import main

    assert main(["export-weights", str(run), "--to", "hf"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(run / "export-hf")
    state = final_state(run, STEPS)
    for key, value in exported.state_dict().items():
        if f"model/{key}" in state:  # a tied head is stored once
            assert torch.equal(value, state[f"model/{key}"]), key
