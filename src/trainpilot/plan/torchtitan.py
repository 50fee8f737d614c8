"""A plan as a torchtitan 0.3.0 job: a Python config module for its ``ConfigManager``.

torchtitan 0.3.0 has no TOML loader: a job is a Python function returning ``Trainer.Config``
(``--module M --config F``), with ``--section.key`` overrides on top. The export is such a
module: torchtitan's own recipe of the model family (data, optimizer, checkpointing), the
model from torchtitan's registry, and the plan's parallelism, batch and activation
checkpointing set on it.

What torchtitan 0.3.0 cannot express is refused with one line, not approximated:
* a model its registry does not ship (it builds models from named flavors only);
* ``recompute=selective``: our cost model prices attention-core recompute (Megatron's), while
  torchtitan's ``SelectiveAC`` is per-op (it saves attention and recomputes every second
  matmul), a different memory/compute trade: that one is ``recompute=op``, exported as
  ``SelectiveAC.Config()``;
* fp16 (torchtitan trains in bf16/fp32) and fp8 (needs torchao's float8 converters);
* a pipeline schedule that does not match the number of stages per rank.
Mappings that are not exact are stated in the module's docstring: ZeRO-1/2 become FSDP
without resharding after forward; experts with tp > 1 are spread over ep * tp ranks as expert
parallelism (torchtitan has no expert TP; the same expert memory per rank).
"""

from __future__ import annotations

from trainpilot.specs import ModelSpec, Plan, SpecError
from trainpilot.specs.job import virtual_stage_layers

VERSION = "0.3.0"

# Our preset -> (torchtitan module, registry flavor, recipe function giving the rest of the
# Trainer.Config). tests/interop/test_torchtitan.py builds each flavor and checks its
# parameter count and shape against the preset.
FLAVORS = {
    "llama3-8b": ("llama3", "8B", "llama3_8b"),
    "llama3-70b": ("llama3", "70B", "llama3_70b"),
    "llama3-405b": ("llama3", "405B", "llama3_8b"),  # its own recipe adds torchao float8
    "qwen3-30b-a3b": ("qwen3", "30B-A3B", "qwen3_30b_a3b"),
    "deepseek-v3": ("deepseek_v3", "671B", "deepseek_v3_671b"),
}
_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B",
              "zero_bubble": "InterleavedZeroBubble"}
_LOOPED = ("interleaved", "zero_bubble")


def flavor_of(model: ModelSpec) -> tuple[str, str, str]:
    """The torchtitan registry entry whose model is ``model`` (every field but the name and
    the context length equal to the preset's); SpecError when there is none."""
    from trainpilot.specs import load_model

    for preset, entry in FLAVORS.items():
        ours = load_model(preset)
        same = dict(name="x", max_position_embeddings=1)
        if model.replace(**same) == ours.replace(**same):
            return entry
    names = ", ".join(f"{m} {f}" for m, f, _ in FLAVORS.values())
    raise SpecError("model", model.name,
                    f"torchtitan {VERSION} builds models from its registry only; valid: a "
                    f"model equal to one of {names} (presets {', '.join(FLAVORS)})")


def torchtitan_config(plan: Plan, model: ModelSpec, *, function: str = "trainpilot_job") -> str:
    """Python source of a torchtitan config module defining ``function()``."""
    module, flavor, recipe = flavor_of(model)
    if plan.recompute == "selective":
        raise SpecError("plan.recompute", "selective",
                        f"torchtitan {VERSION}'s SelectiveAC is per-op, not the attention-core "
                        "recompute the plan was costed with; valid: none, full or op (per-op)")
    if plan.precision != "bf16":
        raise SpecError("plan.precision", plan.precision,
                        f"torchtitan {VERSION} trains in bf16 (fp8 needs torchao converters); "
                        "valid: bf16")
    if plan.runtime.moe_capacity_factor is not None and model.moe is not None:
        raise SpecError("runtime.moe_capacity_factor", plan.runtime.moe_capacity_factor,
                        f"torchtitan {VERSION}'s MoE is dropless; valid: unset")
    if model.num_mtp_layers and (plan.pp > 1 or plan.cp > 1):
        raise SpecError("model.num_mtp_layers", model.num_mtp_layers,
                        f"torchtitan {VERSION}'s MTP supports neither pipeline nor context "
                        "parallelism (deepseek_v3/mtp.py); valid: pp=1 and cp=1")
    notes: list[str] = []
    sets = _parallelism(plan, model, notes)
    if plan.pp > 1 or any(k == "parallelism.expert_parallel_degree" and isinstance(v, int) and v > 1
                           for k, v in sets):
        # Trainer.Config refuses CUDA graphs with PP and with the all-to-all EP dispatcher.
        sets.append(("training.disable_cuda_graphs", True))
    if plan.pp > 1:
        sets += _pipeline(plan, model)
    m, num_micro = plan.micro_batch_size, plan.num_micro_batches
    sets += [
        # Without PP torchtitan accumulates over global / (local * dp) steps of local_batch;
        # with PP its local batch is split into microbatches of pipeline_parallel_microbatch_size.
        ("training.local_batch_size", m if plan.pp == 1 else m * num_micro),
        ("training.global_batch_size", plan.global_batch_size),
        ("training.seq_len", plan.seq_len),
        ("training.mixed_precision_param", '"bfloat16"'),
    ]
    ac = {"none": "None", "full": "FullAC.Config()", "op": "SelectiveAC.Config()"}[
        plan.recompute]
    registry_args = f'"{flavor}"'
    if model.num_mtp_layers:
        registry_args += f", num_mtp_layers={model.num_mtp_layers}"
    lines = [
        f'"""torchtitan {VERSION} job for {model.name}, planned by trainpilot: tp={plan.tp} '
        f"pp={plan.pp} vp={plan.vp} dp={plan.dp} cp={plan.cp} ep={plan.ep} "
        f"zero={plan.zero} micro-batch={plan.micro_batch_size}.",
        "",
        *[f"Note: {n}" for n in notes],
        *([""] if notes else []),
        f"Run (this file on PYTHONPATH): torchrun --nproc-per-node=... -m torchtitan.train "
        f"--module {{this module}} --config {function}",
        '"""',
        "",
        "from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC",
        "from torchtitan.models.common.config_utils import decoder_vocab_size",
        f"from torchtitan.models.{module} import model_registry",
        f"from torchtitan.models.{module}.config_registry import {recipe}",
        "",
        "",
        f"def {function}():",
        f"    config = {recipe}()  # torchtitan's recipe: data, optimizer, checkpointing",
        f"    config.model_spec = model_registry({registry_args})",
        "    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)",
        *[f"    config.{key} = {value}" for key, value in sets],
        f"    config.activation_checkpoint = {ac}",
        "    return config",
    ]
    return "\n".join(lines) + "\n"


def _parallelism(plan: Plan, model: ModelSpec, notes: list[str]) -> list[tuple[str, object]]:
    if plan.zero == 3:
        shard = plan.dp_shard or plan.dp
        replicate, reshard = plan.dp // shard, '"always"'
    elif plan.zero == 0:
        shard, replicate, reshard = 1, plan.dp, '"default"'
    else:
        shard, replicate, reshard = plan.dp, 1, '"never"'
        notes.append(f"zero={plan.zero}: torchtitan shards with FSDP only; exported as FSDP "
                     "without resharding after forward (ZeRO-2-like)")
    ep = 1
    if model.moe is not None:
        ep = plan.ep * plan.tp
        if plan.tp > 1:
            notes.append(f"ep={plan.ep} with tp={plan.tp}: torchtitan has no expert tensor "
                         f"parallelism; experts spread over ep*tp = {ep} ranks as expert "
                         "parallelism (the same expert memory per rank, all-to-all instead of "
                         "TP gathers)")
        region = shard * plan.cp * plan.tp
        if model.moe.num_experts % ep or region % ep:
            raise SpecError("plan.ep", plan.ep,
                            f"torchtitan needs ep*tp = {ep} to divide the experts "
                            f"({model.moe.num_experts}) and dp_shard*cp*tp = {region}; "
                            "valid: an FSDP layout (zero>=1) whose dp*cp*tp ep*tp divides")
    return [
        ("parallelism.data_parallel_replicate_degree", replicate),
        ("parallelism.data_parallel_shard_degree", shard),
        ("parallelism.fsdp_reshard_after_forward", reshard),
        ("parallelism.tensor_parallel_degree", plan.tp),
        ("parallelism.enable_sequence_parallel", plan.sequence_parallel or plan.tp == 1),
        ("parallelism.pipeline_parallel_degree", plan.pp),
        ("parallelism.context_parallel_degree", plan.cp),
        ("parallelism.expert_parallel_degree", ep),
    ]


def _pipeline(plan: Plan, model: ModelSpec) -> list[tuple[str, object]]:
    """The modules of each of the pp * vp model parts in model order (torchtitan gives part s
    to rank s % pp, as Megatron interleaves), so even, uneven and interleaved splits are all
    exact; the *_less_layers heuristics are then unused."""
    schedule = str(plan.pp_schedule)
    if (plan.vp > 1) != (schedule in _LOOPED):
        raise SpecError("plan.pp_schedule", schedule,
                        f"torchtitan's {_SCHEDULES[schedule]} runs "
                        f"{'several stages' if schedule in _LOOPED else 'one stage'} per rank, "
                        f"the plan has vp={plan.vp}; valid: "
                        f"{'interleaved or zero_bubble' if plan.vp > 1 else '1f1b or gpipe'}")
    chunks = virtual_stage_layers(model, plan)
    parts, start = [], 0
    for k in range(plan.vp):
        for i in range(plan.pp):
            names = [f"layers.{j}" for j in range(start, start + chunks[i][k])]
            start += chunks[i][k]
            if (k, i) == (0, 0):
                names.insert(0, "tok_embeddings")
            if (k, i) == (plan.vp - 1, plan.pp - 1):
                names += ["norm", "lm_head"]
            parts.append(names)
    return [
        ("parallelism.pipeline_parallel_schedule", f'"{_SCHEDULES[schedule]}"'),
        ("parallelism.pipeline_parallel_microbatch_size", plan.micro_batch_size),
        ("parallelism.pipeline_parallel_layers_per_stage", None),
        ("parallelism.module_fqns_per_model_part", repr(parts)),
    ]
