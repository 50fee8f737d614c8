"""Apply a Layout to the reference model with PyTorch's own APIs.

Order (each step needs the previous one): cut the pipeline stage(s) -> tensor parallel
(``parallelize_module``, with sequence parallel) -> expert parallel (keep this rank's experts)
-> context parallel (the cp group into attention; :mod:`.models.context`) -> materialise and
initialise (layout-independent values) -> recompute flags -> data parallel (DDP, or FSDP2
``fully_shard``: zero 1/2 keep parameters unsharded between forward and backward, zero 3
reshards, ``dp_shard`` gives HSDP; over ``dp`` x ``cp`` with context parallelism) ->
``PipelineStage`` and schedule.

Expert weights are excluded from DDP/FSDP: they are already sharded over ``ep`` and are summed
over ``edp`` by :func:`sync_expert_grads`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from trainpilot.runtime.layout import Layout
from trainpilot.specs import ModelSpec
from trainpilot.specs.job import virtual_stage_layers

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from trainpilot.runtime.models.gpt import GPT, Block


@dataclass(kw_only=True)
class ParallelModel:
    """This rank's share of the model, ready to train.

    ``chunks``: the model chunk(s) on this rank, wrapped for data parallel where used (one, or
    ``vp`` under an interleaved pipeline). ``schedule``: the pipeline schedule (pp > 1).
    ``expert_params``: weights sharded over ``ep`` that follow :func:`sync_expert_grads`.
    """

    layout: Layout
    spec: ModelSpec | None
    chunks: list[nn.Module]
    modules: list[nn.Module]  # the same chunks unwrapped (DDP's .module)
    data_parallel: str  # "none" | "ddp" | "fsdp"
    schedule: Any = None
    stage_ids: list[int] = field(default_factory=list)
    expert_params: list[nn.Parameter] = field(default_factory=list)
    _moe: list[nn.Module] | None = field(default=None, repr=False, compare=False)

    def parameters(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for chunk in self.chunks:
            for p in chunk.parameters():
                seen.setdefault(id(p), p)
        return list(seen.values())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Global names (``layers.7.attention.wq.weight``), whatever the wrapping."""
        out: list[tuple[str, nn.Parameter]] = []
        for module in self.modules:
            out.extend(module.named_parameters())
        return out

    def train(self, mode: bool = True) -> ParallelModel:
        for chunk in self.chunks:
            chunk.train(mode)
        return self

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids or not self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        plan = self.layout.plan
        return not self.stage_ids or plan.pp * plan.vp - 1 in self.stage_ids

    def moe_layers(self) -> list[nn.Module]:
        """The MoE layers of this rank's chunks (found once: the module tree does not change)."""
        from trainpilot.runtime.models.moe import MoE

        if self._moe is None:
            self._moe = [m for module in self.modules for m in module.modules()
                         if isinstance(m, MoE)]
        return self._moe


def stage_plan(spec: ModelSpec, layout: Layout) -> list[tuple[int, list[int]]]:
    """(stage index, decoder layer ids) of each pipeline stage on this rank.

    Stages are numbered 0 .. pp*vp-1 in model order; rank r holds r, r+pp, ... (Megatron's
    interleaving). Counts follow ``virtual_stage_layers`` (uneven first/last stages, also with
    vp > 1): model-order stage s is chunk s // pp of rank s % pp.
    """
    plan = layout.plan
    if plan.pp == 1:
        return [(0, list(range(spec.num_layers)))]
    num_stages = plan.pp * plan.vp
    chunks = virtual_stage_layers(spec, plan)
    counts = [chunks[s % plan.pp][s // plan.pp] for s in range(num_stages)]
    starts = [sum(counts[:i]) for i in range(num_stages)]
    mine = range(layout.pp_rank, num_stages, plan.pp)
    return [(s, list(range(starts[s], starts[s] + counts[s]))) for s in mine]


def _blocks(model: GPT) -> list[Block]:
    return [cast("Block", block) for block in model.layers.values()]  # GPT's layers are Blocks


def apply_tensor_parallel(model: GPT, tp_mesh, *, sequence_parallel: bool) -> None:
    """Megatron-style TP on the reference GPT: column-parallel Q/K/V and W1/W3, row-parallel O and
    W2, vocabulary-parallel embedding and output; with sequence parallel the norms and the
    residual stream are sharded over the sequence dimension."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in _blocks(model):
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if block.feed_forward.w3 is not None:
            plan["feed_forward.w3"] = ColwiseParallel()
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None),
                                                use_local_output=True),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),),
                                                   use_local_output=True),
            })
        parallelize_module(block, tp_mesh, plan)


def apply_expert_parallel(model: nn.Module, layout: Layout) -> None:
    """Keep this rank's experts (before materialising) and give each MoE layer the ep group."""
    from trainpilot.runtime.models.moe import MoE

    if layout.size("ep") == 1:
        return
    for module in model.modules():
        if isinstance(module, MoE):
            module.experts.shard(layout.coord("ep"), layout.size("ep"))
            module.ep_group = layout.group("ep")


def apply_context_parallel(model: GPT, layout: Layout) -> None:
    """Give the model its place in the cp group: from now on it takes this rank's share of
    each sequence (:func:`trainpilot.runtime.models.context.shard_sequence`)."""
    from trainpilot.runtime.models.context import ContextParallel

    if layout.size("cp") == 1:
        return
    model.set_context_parallel(ContextParallel(mesh=layout.submesh("cp"), rank=layout.cp_rank,
                                               size=layout.size("cp")))


def expert_parameters(model: nn.Module, layout: Layout) -> list[nn.Parameter]:
    """Expert weights sharded over ``ep`` (empty when ep = 1: then they are ordinary weights).
    Call after ``to_empty``, which replaces parameter objects."""
    from trainpilot.runtime.models.moe import MoE

    if layout.size("ep") == 1:
        return []
    return [p for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


def _data_parallel(model: nn.Module, layout: Layout, ignored: list[nn.Parameter],
                   ) -> tuple[nn.Module, str]:
    """Wrap for the plan's data parallelism: zero 0 -> DDP (FSDP2 replicate under a pipeline),
    zero 1/2 -> FSDP2 without resharding after forward, zero 3 -> FSDP2 resharding, dp_shard
    -> HSDP; over ``layout.grad_axis`` (dp, or dp x cp). ``ignored`` (expert weights) stay out
    of it. Returns (module, kind)."""
    plan = layout.plan
    axis = layout.grad_axis
    if layout.size(axis) == 1:
        return model, "none"
    if plan.zero == 0 and plan.pp > 1:
        # DDP's reducer asserts when a pipeline schedule runs several backward passes per step
        # (bucket rebuild after the first step, torch 2.13); FSDP2's replicate (all-reduce,
        # no sharding) is what torch.distributed.pipelining supports for plain data parallel.
        from torch.distributed._composable.replicate_with_fsdp import replicate

        # replicate() swaps the module's class in place and returns the module itself.
        replicate(model, mesh=layout.submesh(axis), ignored_params=set(ignored) or None)
        return model, "fsdp"
    if plan.zero == 0:
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Expert weights follow sync_expert_grads; the RoPE tables are computed identically
        # on every rank, so broadcasting them each forward would be wasted traffic.
        ids = {id(p) for p in ignored}
        names = [n for n, p in model.named_parameters() if id(p) in ids]
        names += [n for n, _ in model.named_buffers() if n.startswith("rope_")]
        DDP._set_params_and_buffers_to_ignore_for_model(model, names)
        ddp = DDP(model, process_group=layout.group(axis), bucket_cap_mb=plan.comm.ddp_bucket_mb)
        settle_ddp_buckets(ddp, layout.device)
        return ddp, "ddp"
    from torch.distributed.fsdp import fully_shard

    from trainpilot.runtime.comm.fsdp import fsdp_mp_policy

    mesh = layout.mesh["dp_replicate", "dp_shard"] if plan.dp_shard else layout.submesh(axis)
    # comm.compression fp16/bf16 -> reduce_dtype; hierarchical reduce-scatter and counters are
    # installed by the trainer (trainpilot.runtime.comm.FSDPComm), which knows the cluster.
    kwargs = dict(mesh=mesh, reshard_after_forward=plan.zero == 3,
                  ignored_params=set(ignored) or None, mp_policy=fsdp_mp_policy(plan.comm))
    # One FSDP unit per layer: GPT's ModuleDict, or a user model's ``layers`` ModuleList.
    layers = getattr(model, "layers", None)
    blocks = (list(layers.values()) if isinstance(layers, nn.ModuleDict)
              else list(layers) if isinstance(layers, nn.ModuleList) else [])
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model, "fsdp"


def parallelize(spec: ModelSpec, layout: Layout, *, seed: int, max_seq_len: int,
                loss_fn: Callable | None = None, materialize: bool = True) -> ParallelModel:
    """Build this rank's share of the reference model for ``layout``, initialised from
    ``seed`` to the same values as the single-process model. ``materialize=False`` leaves it
    on the meta device (sharded, no memory, no DDP wrapper, no pipeline schedule): what
    ``--dry-run`` measures."""
    from trainpilot.runtime.models import build_gpt, init_parameters, keep_stage

    plan = layout.plan
    modules: list[nn.Module] = []
    chunks: list[nn.Module] = []
    experts: list[nn.Parameter] = []
    stage_ids: list[int] = []
    kind = "none"
    for stage, layer_ids in stage_plan(spec, layout):
        model = build_gpt(spec, max_seq_len=max_seq_len, device="meta")
        if plan.pp > 1:
            keep_stage(model, layer_ids, first=stage == 0, last=stage == plan.pp * plan.vp - 1)
        if plan.tp > 1:
            apply_tensor_parallel(model, layout.submesh("tp"),
                                  sequence_parallel=plan.sequence_parallel)
        apply_expert_parallel(model, layout)
        apply_context_parallel(model, layout)
        if materialize:
            model.to_empty(device=layout.device)
        chunk_experts = expert_parameters(model, layout)
        if materialize:
            init_parameters(model, spec, seed=seed)
        model.set_recompute(plan.recompute)
        if materialize or plan.zero > 0:
            wrapped, kind = _data_parallel(model, layout, chunk_experts)
        else:
            # replicas: same counts
            wrapped, kind = model, "ddp" if layout.size(layout.grad_axis) > 1 else "none"
        modules.append(model)
        chunks.append(wrapped)
        experts.extend(chunk_experts)
        stage_ids.append(stage)
    pm = ParallelModel(layout=layout, spec=spec, chunks=chunks, modules=modules,
                       data_parallel=kind, expert_params=experts,
                       stage_ids=stage_ids if plan.pp > 1 else [])
    if plan.pp > 1 and materialize:
        pm.schedule = build_schedule(pm, loss_fn or token_cross_entropy)
    return pm


@runtime_checkable
class _HoldsAuxLoss(Protocol):
    """A module keeping the MoE balance loss of its last forward (``models.moe.MoE``)."""

    def take_aux_loss(self) -> Any: ...


def settle_ddp_buckets(ddp: DistributedDataParallel, device: torch.device) -> None:
    """Run one throw-away forward/backward through ``ddp`` so that its gradient buckets take
    their final layout before the first real step.

    DDP reduces the first iteration in one bucket and rebuilds its buckets after it, in the
    order gradients became ready. A bucket's layout decides which ring segment each element
    falls in, so it decides the order in which ranks' values are summed: with 3 or more ranks
    (a + b) + c is not (b + c) + a in the last bit. A run restarted at step k would reduce step
    k + 1 with the first-iteration layout while the uninterrupted run uses the rebuilt one, and
    the two drift apart (measured: 1e-8 after a few steps at 4 ranks; exact at 2, where a + b ==
    b + a). Settling the buckets at every build makes every real step of every run use the
    same layout. The pass runs in eval mode (no buffer updates, no dropout) on 2 tokens, with
    the RNG state restored and the gradients dropped afterwards; its all-reduce is collective
    like any step's."""
    module = ddp.module
    was_training = module.training
    devices = [] if device.type == "cpu" else [device]
    with torch.random.fork_rng(devices=devices, device_type=device.type):
        module.eval()
        try:
            out = ddp(torch.zeros(1, 2, dtype=torch.long, device=device))
            if not torch.is_tensor(out):
                out = out.logits if hasattr(out, "logits") else out[0]
            (out.float().sum() * 0.0).backward()
        finally:
            module.train(was_training)
    for p in module.parameters():
        p.grad = None
    for sub in module.modules():
        if isinstance(sub, _HoldsAuxLoss):
            sub.take_aux_loss()  # the throw-away pass's MoE balance loss


def wrap_custom(module: nn.Module, layout: Layout) -> ParallelModel:
    """A user's own module (``forward(tokens) -> logits``), data parallel only."""
    module = module.to(layout.device)
    wrapped, kind = _data_parallel(module, layout, [])
    return ParallelModel(layout=layout, spec=None, chunks=[wrapped], modules=[module],
                         data_parallel=kind)


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32 (nats)."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_schedule(pm: ParallelModel, loss_fn: Callable) -> Any:
    """A ``torch.distributed.pipelining`` schedule over this rank's stage(s)."""
    from torch.distributed import pipelining as pipe

    layout, plan = pm.layout, pm.layout.plan
    num_stages = plan.pp * plan.vp
    stages = [pipe.PipelineStage(chunk, stage, num_stages, layout.device, group=layout.group("pp"))
              for chunk, stage in zip(pm.chunks, pm.stage_ids)]
    n = plan.num_micro_batches
    if plan.vp == 1 and plan.pp_schedule in ("gpipe", "1f1b"):
        cls = pipe.ScheduleGPipe if plan.pp_schedule == "gpipe" else pipe.Schedule1F1B
        return cls(stages[0], n_microbatches=n, loss_fn=loss_fn)
    assert plan.pp_schedule is not None  # the Plan's validator fills it in
    multi = {"gpipe": pipe.ScheduleLoopedBFS, "1f1b": pipe.ScheduleInterleaved1F1B,
             "interleaved": pipe.ScheduleInterleaved1F1B,
             "zero_bubble": pipe.ScheduleInterleavedZeroBubble}[plan.pp_schedule]
    return multi(stages, n_microbatches=n, loss_fn=loss_fn)


def sync_expert_grads(pm: ParallelModel) -> None:
    """Expert gradients -> the global-batch mean: sum over the ranks holding the same experts
    (``edp``), divide by dp. (The all-to-all backward already summed over ``ep``.)"""
    if not pm.expert_params:
        return
    layout = pm.layout
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in pm.expert_params]
    group = layout.group("edp")
    if group is not None:
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=group)
        grads = list(torch.split(flat, [g.numel() for g in grads]))
        grads = [g.view_as(p) for g, p in zip(grads, pm.expert_params)]
    for p, g in zip(pm.expert_params, grads):
        p.grad = g / layout.size("dp")


def full_parameters(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU copies of this rank's stage parameters by global name: DTensors
    gathered over their mesh, experts over ``ep``. Collective: call on every rank."""
    from torch.distributed.tensor import DTensor

    expert_ids = {id(p) for p in pm.expert_params}
    group = pm.layout.group("ep")
    out = {}
    for name, p in pm.named_parameters():
        value = p.detach()
        if isinstance(value, DTensor):
            value = value.full_tensor()
        elif id(p) in expert_ids and group is not None:
            parts = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, value.contiguous(), group=group)
            value = torch.cat(parts)
        out[name] = value.cpu().clone()
    return out
