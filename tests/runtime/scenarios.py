"""Scenarios run inside spawned gloo ranks (see harness.py), and their single-process
references. Each returns plain data: per-step losses and full parameters by global name."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch

from trainpilot.runtime.config import TrainConfig
from trainpilot.runtime.layout import Layout
from trainpilot.runtime.parallelize import full_parameters
from trainpilot.runtime.sampler import ResumableSampler
from trainpilot.runtime.trainer import Trainer
from trainpilot.specs import load_model, load_plan

STEPS = 4
BASE = "micro_batch_size=4,global_batch_size=16,seq_len=64"
# No warm-up and no clipping so every step moves the weights by a full AdamW update: a
# layout that got the gradient wrong cannot hide behind a tiny LR or a clipped norm.
CONFIG = dict(steps=STEPS, warmup_steps=0, lr=3e-3, grad_clip=None, seed=7, predict=False)


def train(model: str, plan: str, *, single: bool = False) -> dict[str, Any]:
    """Train ``model`` under ``plan`` (inline) in this process's layout; losses and params.
    ``single``: a one-process layout even inside a process group."""
    plan_doc = load_plan(plan)
    trainer = Trainer(model=load_model(model), plan=plan_doc, config=TrainConfig(**CONFIG),
                      layout=Layout(plan=plan_doc) if single else None)
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    return dict(losses=losses, params=full_parameters(trainer.model),
                sampler=trainer.sampler.state_dict())


def run_many(runs: list[list[str]]) -> dict[str, Any]:
    """Several (name, model, plan) runs in one spawn: one import, one process group."""
    return {name: train(model, plan) for name, model, plan in runs}


def dense() -> dict[str, Any]:
    """DDP and FSDP2 on 2 ranks; a repeat (determinism); a one-process run inside this child
    (bit-identity across processes); and a sabotaged data split (negative control)."""
    out = run_many([["ddp", "tiny-gpt", "dp=2,zero=0," + BASE],
                    ["fsdp_zero3", "tiny-gpt", "dp=2,zero=3," + BASE],
                    ["fsdp_zero1", "tiny-gpt", "dp=2,zero=1," + BASE],
                    ["ddp_again", "tiny-gpt", "dp=2,zero=0," + BASE]])
    out["single"] = train("tiny-gpt", "dp=1," + BASE, single=True)
    shard = ResumableSampler.shard
    with mock.patch.object(ResumableSampler, "shard",
                           staticmethod(lambda idx, rank, size: shard(idx, 0, size))):
        out["ddp_same_data_on_both_ranks"] = train("tiny-gpt", "dp=2,zero=0," + BASE)
    return out


def model_parallel() -> dict[str, Any]:
    """TP (+SP), PP schedules and expert parallel (MoE, with DDP or FSDP2 for the dense
    weights) on 2 ranks."""
    return run_many([["ep_ddp", "tiny-moe", "dp=2,ep=2,zero=0," + BASE],
                     ["ep_fsdp", "tiny-moe", "dp=2,ep=2,zero=3," + BASE],
                     ["pp_moe", "tiny-moe", "pp=2," + BASE],
                     ["tp", "tiny-gpt", "tp=2," + BASE],
                     ["tp_sp", "tiny-gpt", "tp=2,sequence_parallel=true," + BASE],
                     ["pp_gpipe", "tiny-gpt", "pp=2,pp_schedule=gpipe," + BASE],
                     ["pp_1f1b", "tiny-gpt", "pp=2,pp_schedule=1f1b," + BASE],
                     ["pp_interleaved", "tiny-gpt", "pp=2,vp=2," + BASE],
                     ["pp_zero_bubble", "tiny-gpt", "pp=2,vp=2,pp_schedule=zero_bubble," + BASE]])


def four_ranks() -> dict[str, Any]:
    """2-D layouts on 4 ranks."""
    return run_many([["fsdp_tp", "tiny-gpt", "dp=2,tp=2,zero=3," + BASE],
                     ["pp_dp", "tiny-gpt", "pp=2,dp=2,zero=0," + BASE],
                     ["hsdp", "tiny-gpt", "dp=4,zero=3,dp_shard=2," + BASE],
                     ["ep_edp", "tiny-moe", "dp=4,ep=2,zero=0," + BASE]])


def reference(model: str) -> dict[str, Any]:
    """The single-process run with the same global batch (call without a process group)."""
    torch.set_num_threads(1)
    return train(model, "dp=1," + BASE)
