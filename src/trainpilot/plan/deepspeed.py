"""A plan as a DeepSpeed 0.19 config (``ds_config.json``) for a Hugging Face causal LM.

DeepSpeed's config carries what its engine applies by itself: the batch (micro-batch,
gradient accumulation, global batch), precision, ZeRO stage 0-3, AutoTP tensor parallelism
(``tensor_parallel.autotp_size``) and AutoEP expert parallelism (``expert_parallel``, with
DeepSpeed's preset for the model's MoE layers). Refused with one line, because DeepSpeed sets
them in model code or not at all: pipeline parallelism (``PipelineModule``), context
parallelism (DeepSpeed's sequence parallelism is Ulysses all-to-all, not the ring attention
the plan was costed with), HSDP groups (ZeRO++'s hpZ keeps the full ZeRO-3 partition) and
selective recompute. Full recompute is the model's ``gradient_checkpointing_enable()``; the
export says so in its ``trainpilot`` block, which DeepSpeed ignores.
"""

from __future__ import annotations

import json

from trainpilot.specs import ModelSpec, MoESpec, Plan, SpecError


def deepspeed_config(plan: Plan, model: ModelSpec) -> dict:
    """The ds_config mapping; SpecError for what DeepSpeed cannot run as planned."""
    for bad, field, value, why in (
            (plan.pp > 1, "plan.pp", plan.pp, "DeepSpeed pipelines are PipelineModule code, "
                                               "not config; valid: 1"),
            (plan.cp > 1, "plan.cp", plan.cp, "DeepSpeed's sequence parallelism is Ulysses, "
                                               "not the ring attention priced; valid: 1"),
            (plan.dp_shard not in (None, plan.dp), "plan.dp_shard", plan.dp_shard,
             "DeepSpeed has no HSDP (ZeRO++ hpZ keeps the full ZeRO-3 partition); valid: unset"),
            (plan.recompute in ("selective", "op"), "plan.recompute", plan.recompute,
             "DeepSpeed recomputes whole layers (gradient_checkpointing_enable); valid: none "
             "or full"),
            (plan.runtime.moe_capacity_factor is not None and model.moe is not None,
             "runtime.moe_capacity_factor", plan.runtime.moe_capacity_factor,
             "the exported AutoEP layers are not given a capacity; valid: unset")):
        if bad:
            raise SpecError(field, value, why)
    notes = []
    config: dict = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "gradient_clipping": 1.0,
        "zero_optimization": _zero(plan),
        "steps_per_print": 10,
    }
    if plan.precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    else:
        config["bf16"] = {"enabled": True}
        if plan.precision == "fp8":
            notes.append("fp8: DeepSpeed's config has no fp8 training switch; exported as bf16 "
                         "(use Transformer Engine layers in the model for fp8 GEMMs)")
    if plan.tp > 1:
        config["tensor_parallel"] = {"autotp_size": plan.tp}
    if model.moe is not None and plan.tp > 1:
        raise SpecError("plan.tp", plan.tp, "DeepSpeed's AutoEP has no expert tensor "
                        "parallelism yet (expert_tensor_parallel_size 1), the plan shards experts "
                        "over ep*tp; valid: tp=1 for an MoE model")
    if model.moe is not None and plan.ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": plan.ep,
                                     "preset_model": _ep_preset(model, model.moe)}
    if plan.recompute == "full":
        notes.append("recompute=full: call model.gradient_checkpointing_enable() (HF) before "
                     "deepspeed.initialize")
    config["trainpilot"] = {
        "model": model.name,
        "layout": f"dp={plan.dp} tp={plan.tp} ep={plan.ep} zero={plan.zero}",
        "notes": notes,
    }
    return config


def deepspeed_json(plan: Plan, model: ModelSpec) -> str:
    """``deepspeed_config`` as the JSON text of a ds_config file."""
    return json.dumps(deepspeed_config(plan, model), indent=2) + "\n"


def _zero(plan: Plan) -> dict:
    zero: dict = {"stage": plan.zero}
    if plan.zero:
        zero.update(overlap_comm=plan.comm.overlap, contiguous_gradients=True,
                    reduce_bucket_size=int(plan.comm.ddp_bucket_mb * 1e6))
    if plan.zero == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return zero


def _ep_preset(model: ModelSpec, moe: MoESpec) -> str:
    """DeepSpeed AutoEP's preset for the model's MoE layers ``moe`` (its HF architecture)."""
    if model.mla is not None and moe.router_score == "sigmoid":
        return "deepseek_v3"
    if model.qk_norm and not moe.num_shared_experts:
        return "qwen3_moe"
    if not (moe.num_shared_experts or moe.first_k_dense_layers or moe.layer_freq > 1
            or model.qk_norm):
        return "mixtral"
    raise SpecError("model.moe", model.name, "no DeepSpeed AutoEP preset has these MoE "
                                              "layers; valid: Mixtral, Qwen3-MoE or "
                                              "DeepSeek-V3 shaped experts")
