"""The Plan applied to a Hugging Face causal LM (:mod:`trainpilot.runtime.models.hf`).

Order, as for the reference model: tensor parallel (DTensor plans keyed on HF's module names)
-> expert parallel (keep this rank's experts, all-to-all dispatch) -> materialise and
initialise (layout-independent values, or a safetensors checkpoint) -> recompute -> data
parallel (DDP, or FSDP2 ``fully_shard`` per decoder layer and at the root; HSDP with
``dp_shard``).

* **TP** (``tp>1``): ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` column-wise,
  ``o_proj`` and ``down_proj`` row-wise, ``embed_tokens`` vocabulary-parallel (row-wise),
  ``lm_head`` column-wise with the logits gathered; Qwen3's per-head ``q_norm``/``k_norm`` see
  the head dimension sharded (their weight gradients are reduced over tp by DTensor). HF's
  attention infers its head count from the projection width (``view(*shape, -1, head_dim)``), so
  a column-parallel projection just yields fewer heads a rank. MoE blocks stay replicated over
  tp (no expert tensor parallelism): their input is replicated after ``o_proj``. With
  ``sequence_parallel`` (dense models) the residual stream and the norms are sharded over the
  sequence; :class:`~.models.hf.CausalLM` passes the positions from the tokens, so HF's
  rotary tables see the whole sequence.
* **EP** (``ep>1``, MoE models): each rank keeps ``num_experts / ep`` experts of every MoE
  block (HF's fused ``gate_up_proj`` / ``down_proj``); HF's router runs unchanged and the routed
  tokens travel with ``all_to_all_single`` (dropless). Expert weights stay out of DDP/FSDP and
  follow :func:`~trainpilot.runtime.parallelize.sync_expert_grads`.
* **PP** (``pp>1``, dense models without tied embeddings): the meta model is cut into
  :class:`~trainpilot.runtime.hf_pipeline.HFStage` s (``stage_plan``'s split, interleaving
  included) and run by the reference model's ``torch.distributed.pipelining`` schedules.
* Refused with one line each: ``cp>1``, ``sequence_parallel`` on MoE models, ``pp>1`` on MoE or
  tied models, ``recompute=selective`` (:func:`check_hf_plan`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainpilot.runtime.layout import Layout
from trainpilot.runtime.models.hf import (
    CausalLM,
    build_meta,
    init_hf_parameters,
    is_moe,
    load_hf_config,
    num_experts,
    tie_embeddings,
)
from trainpilot.runtime.parallelize import ParallelModel, settle_ddp_buckets
from trainpilot.specs import Plan, SpecError

if TYPE_CHECKING:
    from trainpilot.runtime.hf_pipeline import HFStage


def check_hf_plan(config: Any, plan: Plan) -> None:
    """Raise SpecError for what this runtime cannot do with this HF model under ``plan``."""
    from trainpilot.runtime.hf_pipeline import check_hf_pipeline

    check_hf_pipeline(config, plan)
    if plan.cp > 1:
        raise SpecError("plan.cp", plan.cp, "context parallelism is not supported for Hugging "
                        "Face models (HF attention sees whole sequences); valid: cp=1")
    if plan.sequence_parallel and is_moe(config):
        raise SpecError("plan.sequence_parallel", True, "not supported for Hugging Face MoE "
                        "models (their experts, replicated over tp, would see only this rank's "
                        "tokens); valid: false, or a dense model")
    if plan.recompute in ("selective", "op"):
        raise SpecError("plan.recompute", plan.recompute, "Hugging Face models recompute whole "
                        "decoder layers; valid: none, full")
    if plan.tp > 1:
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if heads % plan.tp or kv % plan.tp:
            raise SpecError("plan.tp", plan.tp, f"must divide the attention heads ({heads}) and "
                            f"key/value heads ({kv})")
        if config.vocab_size % plan.tp:
            raise SpecError("plan.tp", plan.tp, f"must divide vocab_size {config.vocab_size}")
    if plan.ep > 1:
        if not is_moe(config):
            raise SpecError("plan.ep", plan.ep, f"model_type {config.model_type} has no experts; "
                            "valid: ep=1")
        if num_experts(config) % plan.ep:
            raise SpecError("plan.ep", plan.ep, f"must divide the {num_experts(config)} experts")


def apply_hf_tensor_parallel(model: CausalLM, tp_mesh, *, sequence_parallel: bool = False
                             ) -> None:
    """Megatron-style TP keyed on HF module names (see the module doc). With
    ``sequence_parallel`` the residual stream, the norms and the embedding output are sharded
    over the sequence (``Shard(1)``); attention and the MLP gather it back."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["model.norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for layer in model.model.layers:
        plan: dict[str, Any] = {f"self_attn.{p}": ColwiseParallel()
                                for p in ("q_proj", "k_proj", "v_proj")}
        plan["self_attn.o_proj"] = RowwiseParallel(output_layouts=seq)
        for norm in ("q_norm", "k_norm"):  # Qwen3: RMSNorm over head_dim of [b, s, heads, d]
            if getattr(layer.self_attn, norm, None) is not None:
                plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2,
                                                             use_local_output=True)
        if hasattr(layer.mlp, "gate_proj"):  # dense SwiGLU MLP
            plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                         "mlp.down_proj": RowwiseParallel(output_layouts=seq)})
        if sequence_parallel:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    use_local_output=True),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
            })
        parallelize_module(layer, tp_mesh, plan)


class LocalExperts(nn.Module):
    """This rank's experts of an HF MoE block (HF's fused ``gate_up_proj [E, 2F, H]`` and
    ``down_proj [E, H, F]``, sliced to ``[expert_offset, expert_offset + E_local)``), with the
    HF experts' call signature ``(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])``.
    Tokens go to their experts' ranks and back with ``all_to_all_single``."""

    def __init__(self, hf_experts: Any, *, ep_rank: int, ep_size: int, group):
        super().__init__()
        total = hf_experts.gate_up_proj.shape[0]
        self.num_global_experts = total
        self.num_local_experts = total // ep_size
        self.expert_offset = ep_rank * self.num_local_experts
        rows = slice(self.expert_offset, self.expert_offset + self.num_local_experts)
        self.gate_up_proj = nn.Parameter(torch.empty_like(hf_experts.gate_up_proj[rows]))
        self.down_proj = nn.Parameter(torch.empty_like(hf_experts.down_proj[rows]))
        self.act_fn = hf_experts.act_fn
        self.group = group

    def run_local(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` grouped by local expert, ``counts[e]`` for expert e (HF's expert math)."""
        outputs = []
        for e, chunk in enumerate(torch.split(tokens, counts)):
            gate, up = nn.functional.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
            outputs.append(nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(outputs)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        from trainpilot.runtime.models.moe import expert_parallel

        k = top_k_index.shape[1]
        flat = top_k_index.flatten()
        order = torch.argsort(flat, stable=True)
        token_index = order // k
        counts = torch.bincount(flat, minlength=self.num_global_experts)
        routed = expert_parallel(_Dispatch(self), hidden[token_index], counts, self.group)
        routed = routed * top_k_weights.flatten()[order, None].to(routed.dtype)
        return torch.zeros_like(hidden).index_add(0, token_index, routed.to(hidden.dtype))


class _Dispatch:
    """What the all-to-all dispatcher calls: ``num_local_experts`` and ``(tokens, counts)``."""

    def __init__(self, experts: LocalExperts):
        self.num_local_experts = experts.num_local_experts
        self._run = experts.run_local

    def __call__(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        return self._run(tokens, counts)


def apply_hf_expert_parallel(model: CausalLM, layout: Layout) -> list[str]:
    """Replace every MoE block's experts by this rank's :class:`LocalExperts`; returns the
    names of the expert parameters."""
    if layout.size("ep") == 1:
        return []
    names = []
    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj"):
            continue  # a dense layer of a mixed model (Qwen-MoE's mlp_only_layers)
        layer.mlp.experts = LocalExperts(experts, ep_rank=layout.coord("ep"),
                                         ep_size=layout.size("ep"), group=layout.group("ep"))
        names += [f"model.layers.{i}.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")]
    return names


def _wrap_data_parallel(model: CausalLM | HFStage, layout: Layout,
                        ignored: list[nn.Parameter]) -> tuple[nn.Module, str]:
    """DDP (zero 0) or FSDP2 (zero 1/2: keep parameters gathered between forward and
    backward; zero 3: reshard; ``dp_shard``: HSDP) over ``dp``, expert weights left out."""
    plan = layout.plan
    if layout.size("dp") == 1:
        return model, "none"
    if plan.zero == 0 and plan.pp > 1:
        # As for the reference model: DDP's reducer asserts under a pipeline schedule's many
        # backward passes (torch 2.13); FSDP2's replicate is what pipelining supports.
        from torch.distributed._composable.replicate_with_fsdp import replicate

        # replicate() swaps the module's class in place and returns the module itself.
        replicate(model, mesh=layout.submesh("dp"), ignored_params=set(ignored) or None)
        return model, "fsdp"
    if plan.zero == 0:
        from torch.nn.parallel import DistributedDataParallel as DDP

        skip = {id(p) for p in ignored}
        names = [n for n, p in model.named_parameters() if id(p) in skip]
        names += [n for n, _ in model.named_buffers()]  # rotary tables: same on every rank
        DDP._set_params_and_buffers_to_ignore_for_model(model, names)
        ddp = DDP(model, process_group=layout.group("dp"), bucket_cap_mb=plan.comm.ddp_bucket_mb)
        settle_ddp_buckets(ddp, layout.device)
        return ddp, "ddp"
    from torch.distributed.fsdp import fully_shard

    from trainpilot.runtime.comm.fsdp import fsdp_mp_policy

    mesh = (layout.mesh["dp_replicate", "dp_shard"] if plan.dp_shard
            else layout.submesh("dp"))
    options = dict(mesh=mesh, reshard_after_forward=plan.zero == 3,
                   ignored_params=set(ignored) or None, mp_policy=fsdp_mp_policy(plan.comm))
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model, "fsdp"


def parallelize_hf(config: Any, layout: Layout, *, seed: int,
                   weights: str | os.PathLike | None = None,
                   loss_fn: Callable | None = None) -> ParallelModel:
    """This rank's share of the HF model ``config`` under ``layout`` (the ParallelModel the
    Trainer trains), initialised from ``seed`` (or ``weights``) to the one-process values.
    ``loss_fn``: the pipeline schedule's (pp > 1)."""
    from trainpilot.runtime.parallelize import build_schedule, token_cross_entropy

    plan = layout.plan
    check_hf_plan(config, plan)
    model = build_meta(config)
    model.aux_scale = 1.0 / plan.num_micro_batches
    if plan.tp > 1:
        apply_hf_tensor_parallel(model, layout.submesh("tp"),
                                 sequence_parallel=plan.sequence_parallel)
    expert_names = set(apply_hf_expert_parallel(model, layout))
    pieces: list[tuple[int, CausalLM | HFStage]] = [(0, model)]
    if plan.pp > 1:  # cut on the meta device: each rank materialises its own stages only
        from trainpilot.runtime.hf_pipeline import HFStage
        from trainpilot.runtime.models.hf import hf_model_spec
        from trainpilot.runtime.parallelize import stage_plan

        last = plan.pp * plan.vp - 1
        pieces = [(stage, HFStage(model, ids, first=stage == 0, last=stage == last))
                  for stage, ids in stage_plan(hf_model_spec(config), layout)]
    modules: list[nn.Module] = []
    chunks: list[nn.Module] = []
    experts: list[nn.Parameter] = []
    kind = "none"
    for _, module in pieces:
        module.to_empty(device=layout.device)
        if isinstance(module, CausalLM):  # stages never tie: check_hf_plan refuses it
            tie_embeddings(module)
        init_hf_parameters(module, seed=seed, weights=weights)
        if plan.recompute == "full":
            for layer in decoder_layers(module):  # HF's GradientCheckpointingLayer
                layer.gradient_checkpointing = True
                layer._gradient_checkpointing_func = _checkpoint
        mine = [p for n, p in module.named_parameters() if n in expert_names]
        wrapped, kind = _wrap_data_parallel(module, layout, mine)
        modules.append(module)
        chunks.append(wrapped)
        experts.extend(mine)
    pm = ParallelModel(layout=layout, spec=None, chunks=chunks, modules=modules,
                       data_parallel=kind, expert_params=experts,
                       stage_ids=[s for s, _ in pieces] if plan.pp > 1 else [])
    if plan.pp > 1:
        pm.schedule = build_schedule(pm, loss_fn or token_cross_entropy)
    return pm


def decoder_layers(module: CausalLM | HFStage) -> list[Any]:
    """The decoder layers of a :class:`CausalLM` or of a pipeline stage (HF's layer classes,
    which carry HF's own attributes such as ``gradient_checkpointing``)."""
    layers = module.model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def _checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(function, *args, use_reentrant=False, **kwargs)


class HFModel:
    """A Hugging Face causal LM as a Trainer model: ``Trainer(model_factory=HFModel(path))``.

    Calling it returns the whole model in one process (the plain module); :meth:`parallelize`
    returns this rank's share under a layout (the Trainer calls it when present: torchtitan's
    "model + parallelize function" protocol). ``weights``: a local safetensors checkpoint
    (file or folder); None: seeded random initialisation.
    """

    def __init__(self, config: Any, *, weights: str | os.PathLike | None = None, seed: int = 0):
        self.config = load_hf_config(config)
        self.weights, self.seed = weights, seed

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def __call__(self) -> nn.Module:
        from trainpilot.runtime.models.hf import build_plain

        return build_plain(self.config, seed=self.seed, weights=self.weights)

    def check(self, plan: Plan) -> None:
        check_hf_plan(self.config, plan)

    def parallelize(self, layout: Layout, *, seed: int | None = None,
                    loss_fn: Callable | None = None) -> ParallelModel:
        return parallelize_hf(self.config, layout, seed=self.seed if seed is None else seed,
                              weights=self.weights, loss_fn=loss_fn)


def build_hf_model(config_path: Any, layout: Layout, *, seed: int,
                   weights: str | os.PathLike | None = None) -> ParallelModel:
    """``trainpilot train --model path/config.json``: this rank's ParallelModel."""
    return parallelize_hf(load_hf_config(config_path), layout, seed=seed, weights=weights)
