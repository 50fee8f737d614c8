"""Scenarios for spawned gloo ranks (harness.py, ``tests.runtime.byo_scenarios:NAME``): HF
models under the Trainer's layouts, and the data resume 2 -> 1 -> 2 ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.runtime.byo_data import SEQ_LEN, VOCAB, more_configs, tiny_configs
from trainpilot.runtime.config import TrainConfig
from trainpilot.runtime.datasets import open_dataset
from trainpilot.runtime.hf_parallel import HFModel
from trainpilot.runtime.layout import Layout
from trainpilot.runtime.parallelize import full_parameters
from trainpilot.runtime.trainer import Trainer
from trainpilot.specs import load_plan

STEPS = 20
BASE = f"micro_batch_size=4,global_batch_size=8,seq_len={SEQ_LEN}"
CONFIG = dict(steps=STEPS, warmup_steps=0, lr=3e-3, grad_clip=None, seed=7, predict=False,
              autocast="off")  # fp32 compute even where the CPU has native bf16
PROBE = torch.arange(2 * SEQ_LEN).view(2, SEQ_LEN) * 37 % VOCAB  # fixed tokens for logits


def train_hf(model: str, plan: str, data: str, tokenizer: str, *, single: bool = False,
             steps: int = STEPS) -> dict[str, Any]:
    """``steps`` AdamW steps of the tiny HF ``model`` on the text corpus; per-step losses, the
    logits of PROBE before training (full vocabulary, on every rank) and the final weights."""
    plan_doc = load_plan(plan)
    dataset = open_dataset(data, seq_len=SEQ_LEN, vocab_size=VOCAB, tokenizer=tokenizer)
    trainer = Trainer(plan=plan_doc, config=TrainConfig(**{**CONFIG, "steps": steps}),
                      model_factory=HFModel({**tiny_configs(), **more_configs()}[model]),
                      dataset=dataset, layout=Layout(plan=plan_doc) if single else None)
    logits, shapes = None, [None]
    if trainer.model.schedule is None:  # (a pipeline stage cannot take the probe alone)
        module = trainer.model.chunks[0]
        module.eval()
        # What the first decoder layer sees (SP: S / tp).
        hook = trainer.model.modules[0].model.layers[0].register_forward_pre_hook(
            lambda mod, args: shapes.append(tuple(args[0].shape)))
        with torch.no_grad():
            logits = module(PROBE).float()
        hook.remove()
        if trainer.model.data_parallel == "fsdp":  # FSDP2 leaves the root unsharded after eval
            module.reshard()
        module.train()
    losses = [trainer.train_step().loss for _ in range(steps)]
    return dict(losses=losses, logits=logits, params=full_parameters(trainer.model),
                sampler=trainer.sampler.state_dict(), layer_input_shape=shapes[-1])


def hf_dense(data: str, tokenizer: str) -> dict[str, Any]:
    """Tiny Llama under DDP, FSDP2 (zero 3), TP and TP + SP, Qwen3 under DDP and FSDP2, on 2
    ranks; and DDP with both ranks reading the same shard (negative control)."""
    from unittest import mock

    from trainpilot.runtime.sampler import ResumableSampler

    out = hf_runs(data, tokenizer, [
        ["llama_ddp", "llama", "dp=2,zero=0"], ["llama_fsdp", "llama", "dp=2,zero=3"],
        ["llama_tp", "llama", "tp=2"], ["llama_sp", "llama", "tp=2,sequence_parallel=true"],
        ["qwen3_ddp", "qwen3", "dp=2,zero=0"], ["qwen3_fsdp", "qwen3", "dp=2,zero=3"]])
    shard = ResumableSampler.shard
    with mock.patch.object(ResumableSampler, "shard",
                           staticmethod(lambda idx, rank, size: shard(idx, 0, size))):
        out["llama_ddp_same_data"] = train_hf("llama", f"dp=2,zero=0,{BASE}", data, tokenizer,
                                              steps=4)
    return out


def hf_runs(data: str, tokenizer: str, runs: list[list[str]], steps: int = STEPS
            ) -> dict[str, Any]:
    """(name, model, plan) runs in one spawn."""
    return {name: train_hf(model, f"{plan},{BASE}", data, tokenizer, steps=steps)
            for name, model, plan in runs}


def hf_pipelines(data: str, tokenizer: str) -> dict[str, Any]:
    """Llama with pp=2 (1F1B), and a 4-layer Llama with an interleaved pp=2, vp=2."""
    return hf_runs(data, tokenizer, [["llama_pp", "llama", "pp=2"],
                                     ["llama4_vp", "llama4", "pp=2,vp=2"]])


def hf_moe(data: str, tokenizer: str) -> dict[str, Any]:
    """Qwen3 under TP (tied embeddings, q/k norms), tiny Mixtral under DDP, FSDP2, TP
    (experts replicated) and EP=2, on 2 ranks."""
    return hf_runs(data, tokenizer, [
        ["qwen3_tp", "qwen3", "tp=2"], ["mixtral_ddp", "mixtral", "dp=2,zero=0"],
        ["mixtral_fsdp", "mixtral", "dp=2,zero=3"], ["mixtral_tp", "mixtral", "tp=2"],
        ["mixtral_ep", "mixtral", "dp=2,ep=2,zero=0"]])


class Recording:
    """A dataset wrapper that records the sample indices this rank reads."""

    def __init__(self, dataset: Any):
        self.dataset, self.seen = dataset, []
        self.num_samples, self.seq_len = dataset.num_samples, dataset.seq_len

    def get_batch(self, indices: np.ndarray):
        self.seen.extend(int(i) for i in indices)
        return self.dataset.get_batch(indices)


def _resume_run(plan: str, data: str, tokenizer: str, steps: int, state: dict | None,
                single: bool) -> tuple[list[int], dict, list[float]]:
    plan_doc = load_plan(plan)
    dataset = Recording(open_dataset(data, seq_len=SEQ_LEN, vocab_size=VOCAB,
                                     tokenizer=tokenizer))
    trainer = Trainer(plan=plan_doc, config=TrainConfig(**{**CONFIG, "steps": 100}),
                      model_factory=HFModel(tiny_configs()["llama"]), dataset=dataset,
                      layout=Layout(plan=plan_doc) if single else None)
    if state is not None:
        trainer.sampler.load_state_dict(state)
    losses = [trainer.train_step().loss for _ in range(steps)]
    return dataset.seen, trainer.state_dict()["sampler"], losses


def data_resume(data: str, tokenizer: str, steps: tuple[int, int, int]) -> dict[str, Any]:
    """The Trainer on 2 ranks, then 1 (rank 0 alone, from the sampler state the 2-rank run
    saved), then 2 again: every sample index each rank read, and the sampler states."""
    import torch.distributed as dist

    plan2 = f"dp=2,zero=0,micro_batch_size=4,global_batch_size=8,seq_len={SEQ_LEN}"
    plan1 = f"dp=1,micro_batch_size=8,global_batch_size=8,seq_len={SEQ_LEN}"
    first, state, losses = _resume_run(plan2, data, tokenizer, steps[0], None, False)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        middle, state1, _ = _resume_run(plan1, data, tokenizer, steps[1], state, True)
        box = [state1]
    else:
        middle = []
    dist.broadcast_object_list(box, src=0)
    last, state2, _ = _resume_run(plan2, data, tokenizer, steps[2], box[0], False)
    return dict(first=first, middle=middle, last=last, states=[state, box[0], state2],
                losses=losses)
