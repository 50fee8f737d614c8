"""Scenarios run inside spawned gloo ranks (see harness.py), and their single-process
references. Each returns plain data: per-step losses and full parameters by global name."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

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
# fp32 compute: on a CPU with native bf16 (AVX512-BF16/AMX) "auto" autocasts, and a layout
# compared with one process at 5e-6 must not differ by bf16 rounding.
CONFIG = dict(steps=STEPS, warmup_steps=0, lr=3e-3, grad_clip=None, seed=7, predict=False,
              autocast="off")


def train(model: str | dict, plan: str, *, single: bool = False,
          autocast: str = "off") -> dict[str, Any]:
    """Train ``model`` under ``plan`` (inline) in this process's layout; losses and params.
    ``single``: a one-process layout even inside a process group."""
    plan_doc = load_plan(plan)
    trainer = Trainer(model=load_model(model), plan=plan_doc,
                      config=TrainConfig(**dict(CONFIG, autocast=autocast)),
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
    weights) on 2 ranks; and expert parallel under bf16 autocast, where the experts answer in
    bf16 for tokens sent in fp32."""
    out = run_many([["ep_ddp", "tiny-moe", "dp=2,ep=2,zero=0," + BASE],
                    ["ep_fsdp", "tiny-moe", "dp=2,ep=2,zero=3," + BASE],
                    ["pp_moe", "tiny-moe", "pp=2," + BASE],
                    ["tp", "tiny-gpt", "tp=2," + BASE],
                    ["tp_sp", "tiny-gpt", "tp=2,sequence_parallel=true," + BASE],
                    ["pp_gpipe", "tiny-gpt", "pp=2,pp_schedule=gpipe," + BASE],
                    ["pp_1f1b", "tiny-gpt", "pp=2,pp_schedule=1f1b," + BASE],
                    ["pp_interleaved", "tiny-gpt", "pp=2,vp=2," + BASE],
                    ["pp_zero_bubble", "tiny-gpt", "pp=2,vp=2,pp_schedule=zero_bubble," + BASE]])
    out["ep_bf16"] = train("tiny-moe", "dp=2,ep=2,zero=0," + BASE, autocast="bf16")
    return out


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


# ---- context parallelism (tests/runtime/test_context_parallel.py) ---------------------------
def _contiguous_split(x, *, cp_rank, cp, dim=1):
    """A wrong chunk order: rank i takes the i-th contiguous S/cp tokens, while positions and
    attention assume the load-balanced chunks (i, 2cp-1-i)."""
    return x.chunk(cp, dim=dim)[cp_rank]


def _no_causal_mask(q, k, v):
    """Attention without its causal mask: every query sees every gathered key."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


# GPT-2 style: learned positions (indexed by global position under cp), GELU, LayerNorm with
# bias, multi-head attention, tied embeddings.
GPT2_STYLE = dict(name="tiny-gpt2-style", num_hidden_layers=2, hidden_size=128,
                  num_attention_heads=4, num_key_value_heads=4, intermediate_size=512,
                  vocab_size=256, activation="gelu", norm="layernorm", bias=True,
                  position_embedding="learned", tie_word_embeddings=True)


def context_parallel() -> dict[str, Any]:
    """CP=2 on 2 ranks (DDP over cp, and FSDP2 over cp; a GPT-2 style model against its own
    one-process run), and two sabotaged runs (negative controls): a wrong chunk order, a
    missing causal mask."""
    from trainpilot.runtime.models import context

    out = run_many([["cp", "tiny-gpt", "cp=2,zero=0," + BASE],
                    ["cp_fsdp", "tiny-gpt", "cp=2,zero=3," + BASE],
                    ["cp_gpt2_style", GPT2_STYLE, "cp=2,zero=0," + BASE]])
    out["gpt2_style_single"] = train(GPT2_STYLE, "dp=1," + BASE, single=True)
    with mock.patch.object(context, "shard_sequence", _contiguous_split):
        out["cp_wrong_chunk_order"] = train("tiny-gpt", "cp=2,zero=0," + BASE)
    with mock.patch.object(context, "_attend", _no_causal_mask):
        out["cp_no_causal_mask"] = train("tiny-gpt", "cp=2,zero=0," + BASE)
    return out


def context_parallel_4() -> dict[str, Any]:
    """cp=2 with dp=2 (gradients averaged over dp x cp), with tp=2 + sequence parallel, and
    with a 2-stage pipeline."""
    return run_many([["cp_dp", "tiny-gpt", "cp=2,dp=2,zero=0," + BASE],
                     ["cp_tp_sp", "tiny-gpt", "cp=2,tp=2,sequence_parallel=true," + BASE],
                     ["cp_pp", "tiny-gpt", "cp=2,pp=2," + BASE]])


# ---- fp16 loss scaling (tests/runtime/test_fp16.py) ------------------------------------------
def _fp16_run(plan: str) -> dict[str, Any]:
    """3 steps of an fp16 plan (fp32 compute: the scaler's logic does not depend on it) with a
    NaN gradient injected on rank 1 at step 2; full parameters, scale and skip flag per step."""
    from trainpilot.runtime.faults import FaultInjector

    faults = FaultInjector("nan:rank=1,step=2,at=grad")  # after the reduction, rank 1 only
    trainer = Trainer(model=load_model("tiny-gpt"), plan=load_plan(plan), faults=faults,
                      config=TrainConfig(**CONFIG))
    out: dict[str, list] = dict(params=[], scales=[], skipped=[], losses=[])
    for _ in range(3):
        record = trainer.train_step()
        out["params"].append(full_parameters(trainer.model))
        out["scales"].append(trainer.scaler.get_scale())
        out["skipped"].append(record.skipped_update)
        out["losses"].append(record.loss)
    out["fired"] = len(faults.fired("nan"))
    return out


def fp16_skip() -> dict[str, Any]:
    """fp16 with a NaN on one rank under pp=2 and tp=2: every rank must skip the same step.
    Negative control: per-rank torch GradScalers (no all-reduce of the found-inf flag)."""
    from trainpilot.runtime import layout as layout_module

    def local_scaler(precision, device, *, distributed):
        scaler = torch.amp.GradScaler(device.type)
        scaler.scale(torch.zeros(()))  # creates the scale on ranks that never scale a loss
        return scaler

    out = {}
    # This CPU emulates fp16, so check_runtime refuses it; the scaler is what is tested here.
    with mock.patch.object(layout_module, "cpu_has_native_fp16", lambda: True):
        out["pp"] = _fp16_run("pp=2,precision=fp16," + BASE)
        out["tp"] = _fp16_run("tp=2,precision=fp16," + BASE)
        with mock.patch("trainpilot.runtime.trainer.build_grad_scaler", local_scaler):
            out["pp_local_scaler"] = _fp16_run("pp=2,precision=fp16," + BASE)
    out["dp_backward"] = _nan_run("nan:rank=1,step=2")
    out["dp_grad"] = _nan_run("nan:rank=1,step=2,at=grad")
    # Each rank decides alone from the norm of the reduced gradients: the same on every rank
    # in every layout (FSDP reduce-scatter, TP and PP norm all-reduces), NaN on rank 0 or 1.
    for name, plan in (("fsdp", "dp=2,zero=3,"), ("tp", "tp=2,"), ("pp", "pp=2,")):
        for rank in (0, 1):
            out[f"{name}_backward_{rank}"] = _nan_run(f"nan:rank={rank},step=2", plan)
    return out


def _nan_run(spec: str, plan: str = "dp=2,zero=0,") -> dict[str, Any]:
    """fp32 on 2 ranks, 3 steps with a NaN injected at step 2: the attempts per step, or the
    error that stopped the run."""
    from trainpilot.runtime.elastic.retry import NonfiniteDisagreement
    from trainpilot.runtime.faults import FaultInjector

    faults = FaultInjector(spec)
    trainer = Trainer(model=load_model("tiny-gpt"), plan=load_plan(plan + BASE),
                      faults=faults, config=TrainConfig(**CONFIG))
    out: dict[str, Any] = dict(attempts=[], error=None)
    try:
        for _ in range(3):
            out["attempts"].append(trainer.train_step().attempts)
    except NonfiniteDisagreement as err:
        out["error"] = str(err)
    out["fired"] = [(r["rank"], r["point"]) for r in faults.fired("nan")]
    return out


def health_stats() -> dict[str, Any]:
    """The health collector's gradient statistics after one step under DDP, FSDP2 (ZeRO-1 and
    -3) and TP on 2 ranks, read in an optimizer pre-step hook (where the HealthMonitor reads
    them); then the clip intervention halves the norm. ``local_only``: the norm of this rank's
    shards alone (what a collector that ignored sharding would report; the negative control)."""
    from torch.distributed.tensor import DTensor

    from trainpilot.health.collector import MetricsCollector
    from trainpilot.health.interventions import clip_gradients

    out: dict[str, Any] = {}
    for name, plan in [("ddp", "dp=2,zero=0"), ("zero3", "dp=2,zero=3"),
                       ("zero1", "dp=2,zero=1"), ("tp", "tp=2")]:
        plan_doc = load_plan(f"{plan},{BASE}")
        trainer = Trainer(model=load_model("tiny-gpt"), plan=plan_doc,
                          config=TrainConfig(**CONFIG))
        collector = MetricsCollector(trainer.model, trainer.optimizer)
        seen: dict[str, Any] = {}

        def hook(optimizer, args, kwargs, collector=collector, seen=seen):
            stats = collector.grad_stats(detailed=True)
            grads = [p.grad for p in collector.params if p.grad is not None]
            local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
            seen.update(grad_norm=stats.grad_norm, layer_norms=stats.layer_norms,
                        zero_frac=stats.zero_grad_frac,
                        local_only=float(torch.linalg.vector_norm(
                            torch.stack([torch.linalg.vector_norm(g) for g in local]))),
                        clip=clip_gradients(collector.params, stats.grad_norm / 2))

        handle = trainer.optimizer.register_step_pre_hook(hook)
        trainer.train_step()
        handle.remove()
        out[name] = seen
    return out


def ddp_restart_drift(settle: bool) -> dict[str, Any]:
    """Six SGD steps of one DDP model, against three steps, a rebuilt DDP (what a restarted
    process makes) and three more; with or without settling the buckets at each build.
    Returns whether the final weights are bit-equal and their largest difference."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainpilot.runtime.parallelize import settle_ddp_buckets

    rank = dist.get_rank()

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64),
                                   torch.nn.ReLU(), torch.nn.Linear(64, 64))

    def build(module: torch.nn.Module) -> tuple[DDP, torch.optim.Optimizer]:
        ddp = DDP(module, bucket_cap_mb=0.005)  # several buckets
        if settle:
            settle_ddp_buckets(ddp, torch.device("cpu"))
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step(ddp: DDP, opt: torch.optim.Optimizer, i: int) -> None:
        tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(10 * i
                                                                                   + rank))
        out = ddp(tokens)
        torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad()

    whole = model()
    ddp, opt = build(whole)
    for i in range(6):
        step(ddp, opt, i)
    first = model()
    ddp, opt = build(first)
    for i in range(3):
        step(ddp, opt, i)
    resumed = copy.deepcopy(first)
    ddp, opt = build(resumed)
    for i in range(3, 6):
        step(ddp, opt, i)
    pairs = list(zip(whole.parameters(), resumed.parameters()))
    return dict(equal=all(torch.equal(a, b) for a, b in pairs),
                max_diff=max(float((a - b).abs().max()) for a, b in pairs))
