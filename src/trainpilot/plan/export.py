"""A chosen plan for other tools: our plan YAML, Megatron-LM arguments, a torchtitan TOML
``[parallelism]`` section, and a SLURM batch script that starts ``trainpilot train`` under
torchrun with c10d rendezvous.

Mappings that are not one-to-one are stated in the output itself (a comment line), never
silently dropped: Megatron has no ZeRO-2 (zero=2 exports its distributed optimizer, the nearest),
torchtitan has no ZeRO-1/2 (exported as FSDP without resharding after forward, ZeRO-2-like).
"""

from __future__ import annotations

import shlex

from trainpilot.perf.predict import Prediction
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError, dump
from trainpilot.specs.job import stage_layers, virtual_stage_layers

FORMATS = ("yaml", "megatron", "torchtitan", "slurm")


def export(fmt: str, plan: Plan, model: ModelSpec, cluster: ClusterSpec,
           prediction: Prediction | None = None) -> str:
    """The plan in ``fmt`` (one of FORMATS) as text."""
    if fmt == "yaml":
        return plan_yaml(plan, model, cluster, prediction)
    if fmt == "megatron":
        return megatron_args(plan, model)
    if fmt == "torchtitan":
        return torchtitan_toml(plan, model)
    if fmt == "slurm":
        return slurm_script(plan, model, cluster)
    raise SpecError("--export", fmt, f"valid: {', '.join(FORMATS)}")


def plan_yaml(plan: Plan, model: ModelSpec, cluster: ClusterSpec,
              prediction: Prediction | None = None) -> str:
    """Our plan document, headed by what it was planned for (comments, so it loads as is)."""
    head = [f"# plan for {model.name} on {cluster.name} ({cluster.num_devices} x "
            f"{cluster.device.name})"]
    if prediction is not None:
        head.append(f"# predicted: {prediction.step_time_s:.3f} s/step, "
                    f"{prediction.tokens_per_s:,.0f} tokens/s, MFU {prediction.mfu:.1%}, "
                    f"peak {prediction.memory_gib['peak']:.1f} GiB per device")
    return "\n".join(head) + "\n" + dump(plan)


def megatron_args(plan: Plan, model: ModelSpec) -> str:
    """Megatron-LM ``pretrain_gpt.py`` arguments for the layout, batch, recompute and model."""
    args: list[str] = []
    notes: list[str] = []

    def add(flag: str, value: object = None) -> None:
        args.append(flag if value is None else f"{flag} {value}")

    add("--tensor-model-parallel-size", plan.tp)
    add("--pipeline-model-parallel-size", plan.pp)
    args += _megatron_stage_args(plan, model)
    if plan.ep > 1:
        add("--expert-model-parallel-size", plan.ep)
    if plan.cp > 1:
        add("--context-parallel-size", plan.cp)
    if plan.sequence_parallel:
        add("--sequence-parallel")
    if plan.recompute == "selective":
        add("--recompute-granularity", "selective")
    elif plan.recompute == "full":
        add("--recompute-granularity", "full")
        add("--recompute-method", "uniform")
        add("--recompute-num-layers", 1)
    if plan.zero in (1, 2):
        add("--use-distributed-optimizer")
        if plan.zero == 2:
            notes.append("zero=2 has no Megatron equivalent; exported as the distributed "
                         "optimizer (ZeRO-1)")
    elif plan.zero == 3:
        add("--use-torch-fsdp2")
    if plan.comm.overlap and plan.dp * plan.cp > 1:
        add("--overlap-grad-reduce")
        if plan.zero == 1:
            add("--overlap-param-gather")
    add("--micro-batch-size", plan.micro_batch_size)
    add("--global-batch-size", plan.global_batch_size)
    add("--seq-length", plan.seq_len)
    add("--max-position-embeddings", max(plan.seq_len, model.max_position_embeddings)
        if model.position_embedding == "rope" else model.max_position_embeddings)
    if plan.precision == "fp8":
        add("--bf16")
        add("--fp8-format", "hybrid")
    else:
        add(f"--{plan.precision}")
    args += _model_args(model)
    lines = [f"# {note}" for note in notes]
    lines.append(" \\\n".join(args))
    return "\n".join(lines) + "\n"


def _megatron_stage_args(plan: Plan, model: ModelSpec) -> list[str]:
    """How the layers split over (virtual) pipeline stages, in Megatron-core's flags:
    ``--decoder-first/last-pipeline-num-layers`` (with ``--num-virtual-stages-per-pipeline-rank``
    when interleaved) where every stage divides evenly into its virtual stages; the
    embedding/loss accounting flags where each edge stage is one layer short of a middle one
    and that layer comes off its outer chunk (Llama 3 405B); ``--pipeline-model-parallel-layout``
    for any other short outer chunk."""
    uneven = plan.pp_first_stage_layers is not None or plan.pp_last_stage_layers is not None
    if plan.vp == 1 or not uneven:
        out = []
        if plan.vp > 1:
            out.append(f"--num-layers-per-virtual-pipeline-stage "
                       f"{model.num_hidden_layers // (plan.pp * plan.vp)}")
        if plan.pp_first_stage_layers is not None:
            out.append(f"--decoder-first-pipeline-num-layers {plan.pp_first_stage_layers}")
        if plan.pp_last_stage_layers is not None:
            out.append(f"--decoder-last-pipeline-num-layers {plan.pp_last_stage_layers}")
        return out
    chunks = virtual_stage_layers(model, plan)
    if all(len(set(c)) == 1 for c in chunks):
        out = [f"--num-virtual-stages-per-pipeline-rank {plan.vp}"]
        if plan.pp_first_stage_layers is not None:
            out.append(f"--decoder-first-pipeline-num-layers {plan.pp_first_stage_layers}")
        if plan.pp_last_stage_layers is not None:
            out.append(f"--decoder-last-pipeline-num-layers {plan.pp_last_stage_layers}")
        return out
    mid = chunks[1] if plan.pp > 2 else None
    if mid and chunks[0] == [mid[0] - 1] + mid[1:] and chunks[-1] == mid[:-1] + [mid[-1] - 1]:
        return [f"--num-virtual-stages-per-pipeline-rank {plan.vp}",
                "--account-for-embedding-in-pipeline-split",
                "--account-for-loss-in-pipeline-split"]
    stages = []  # model order: chunk 0 of every rank, then chunk 1, ...
    for k in range(plan.vp):
        for i in range(plan.pp):
            text = ("E" if (k, i) == (0, 0) else "") + "t" * chunks[i][k]
            stages.append(text + ("L" if (k, i) == (plan.vp - 1, plan.pp - 1) else ""))
    return [f"--pipeline-model-parallel-layout {shlex.quote('|'.join(stages))}"]


def _model_args(model: ModelSpec) -> list[str]:
    out = [f"--num-layers {model.num_hidden_layers}", f"--hidden-size {model.hidden_size}",
           f"--num-attention-heads {model.num_attention_heads}",
           f"--ffn-hidden-size {model.intermediate_size}"]
    if model.kv_heads != model.num_attention_heads and model.mla is None:
        out += ["--group-query-attention", f"--num-query-groups {model.kv_heads}"]
    if model.head_dim and model.head_dim * model.num_attention_heads != model.hidden_size:
        out.append(f"--kv-channels {model.head_dim}")
    if model.activation == "swiglu":
        out.append("--swiglu")
    if model.norm == "rmsnorm":
        out.append("--normalization RMSNorm")
    position = "rope" if model.position_embedding == "rope" else "learned_absolute"
    out.append(f"--position-embedding-type {position}")
    if not model.bias:
        out.append("--disable-bias-linear")
    if not model.tie_word_embeddings:
        out.append("--untie-embeddings-and-output-weights")
    if model.moe is not None:
        moe = model.moe
        out += [f"--num-experts {moe.num_experts}", f"--moe-router-topk {moe.top_k}",
                f"--moe-ffn-hidden-size {moe.expert_intermediate_size}"]
        if moe.num_shared_experts:
            out.append(f"--moe-shared-expert-intermediate-size {moe.shared_width}")
        if moe.first_k_dense_layers or moe.layer_freq > 1:
            pattern = [1 if model.is_moe_layer(i) else 0 for i in range(model.num_hidden_layers)]
            out.append(f"--moe-layer-freq {shlex.quote(str(pattern).replace(' ', ''))}")
    if model.mla is not None:
        mla = model.mla
        out += ["--multi-latent-attention", f"--kv-lora-rank {mla.kv_lora_rank}",
                f"--qk-head-dim {mla.qk_nope_head_dim}",
                f"--qk-pos-emb-head-dim {mla.qk_rope_head_dim}",
                f"--v-head-dim {mla.v_head_dim}"]
        if mla.q_lora_rank:
            out.append(f"--q-lora-rank {mla.q_lora_rank}")
    out.append(f"--padded-vocab-size {model.vocab_size}")
    return out


_TITAN_SCHEDULES = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B",
                    "zero_bubble": "InterleavedZeroBubble"}


def torchtitan_toml(plan: Plan, model: ModelSpec) -> str:
    """torchtitan ``[parallelism]`` (plus the batch and activation-checkpoint keys it needs).
    Interleaving becomes ``pipeline_parallel_layers_per_stage``; uneven first/last stages
    become explicit ``pipeline_parallel_split_points``."""
    notes = []
    if plan.zero == 3:
        shard = plan.dp_shard or plan.dp
        replicate = plan.dp // shard
        reshard = "default"
    elif plan.zero == 0:
        shard, replicate, reshard = 1, plan.dp, "default"
    else:
        shard, replicate, reshard = plan.dp, 1, "never"
        notes.append(f"zero={plan.zero}: torchtitan shards with FSDP only; exported as FSDP "
                     "without resharding after forward (ZeRO-2-like)")
    lines = [f"# {n}" for n in notes] + [
        "[parallelism]",
        f"data_parallel_replicate_degree = {replicate}",
        f"data_parallel_shard_degree = {shard}",
        f'fsdp_reshard_after_forward = "{reshard}"',
        f"tensor_parallel_degree = {plan.tp}",
        f"pipeline_parallel_degree = {plan.pp}",
    ]
    if plan.pp > 1:
        lines.append(f'pipeline_parallel_schedule = "{_TITAN_SCHEDULES[str(plan.pp_schedule)]}"')
        lines.append(f"pipeline_parallel_microbatch_size = {plan.micro_batch_size}")
        if plan.pp_first_stage_layers is not None or plan.pp_last_stage_layers is not None:
            lines += _titan_uneven_stages(plan, model)
        else:
            per_stage = model.num_hidden_layers // (plan.pp * plan.vp)
            lines.append(f"pipeline_parallel_layers_per_stage = {per_stage}")
    lines += [f"context_parallel_degree = {plan.cp}", f"expert_parallel_degree = {plan.ep}",
              "", "[training]",
              f"local_batch_size = {plan.global_batch_size // plan.dp}",
              f"global_batch_size = {plan.global_batch_size}", f"seq_len = {plan.seq_len}",
              "", "[activation_checkpoint]", f'mode = "{plan.recompute}"']
    return "\n".join(lines) + "\n"


def _titan_uneven_stages(plan: Plan, model: ModelSpec) -> list[str]:
    """Uneven stages for torchtitan: split points between the stages (vp = 1), or, with
    interleaving, the modules of each of the pp * vp model parts in model order (torchtitan
    assigns part s to rank s % pp, as Megatron does), which can also express a part holding
    only the embedding or only the output layer."""
    if plan.vp == 1:
        cuts, start = [], 0
        for count in stage_layers(model, plan)[:-1]:
            start += count
            cuts.append(f'"layers.{start}"')
        return [f"pipeline_parallel_split_points = [{', '.join(cuts)}]"]
    chunks = virtual_stage_layers(model, plan)
    parts, start = [], 0
    for k in range(plan.vp):
        for i in range(plan.pp):
            names = [f'"layers.{j}"' for j in range(start, start + chunks[i][k])]
            start += chunks[i][k]
            if (k, i) == (0, 0):
                names.insert(0, '"tok_embeddings"')
            if (k, i) == (plan.vp - 1, plan.pp - 1):
                names += ['"norm"', '"output"']
            parts.append(f"[{', '.join(names)}]")
    return [f"module_fqns_per_model_part = [{', '.join(parts)}]"]


def slurm_script(plan: Plan, model: ModelSpec, cluster: ClusterSpec, *,
                 job_name: str | None = None, plan_path: str = "plan.yaml") -> str:
    """An sbatch script: one task per node, each running ``trainpilot train`` with torchrun's
    own options (``train`` passes them to torchrun): ``--nnodes`` = nodes,
    ``--nproc-per-node`` = devices per node, c10d rendezvous on the first node. Write the plan
    next to it with ``--export yaml``."""
    per_node = cluster.devices_per_node
    nodes, rest = divmod(plan.world_size, per_node)
    if rest or nodes == 0:
        nodes, per_node = 1, plan.world_size
    name = job_name or f"{model.name}-{nodes}x{per_node}"
    return f"""#!/bin/bash
#SBATCH --job-name={name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={per_node}
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
# Layout: tp={plan.tp} pp={plan.pp} dp={plan.dp} cp={plan.cp} ep={plan.ep} on {cluster.name}.
set -euo pipefail
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS=1
srun trainpilot train \\
  --nnodes={nodes} \\
  --nproc-per-node={per_node} \\
  --rdzv-backend=c10d \\
  --rdzv-endpoint="$head_node:29500" \\
  --rdzv-id="$SLURM_JOB_ID" \\
  --model {shlex.quote(model.name)} --cluster {shlex.quote(cluster.name)} \\
  --plan {shlex.quote(plan_path)} --run-dir "runs/$SLURM_JOB_ID"
"""
