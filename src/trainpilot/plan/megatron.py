"""A plan as Megatron-LM ``pretrain_gpt.py`` arguments (flag names and rules of Megatron-LM at
tag ``core_v0.16.1``, the release matching the ``megatron-core`` the tests validate against).

The model flags carry the model, not only its shape: RoPE base and Llama 3 scaling, YaRN for
MLA, qk-layernorm, norm epsilon, tied embeddings, the router (score function, expert bias,
group-limited top-k, scaling factor, load balancing) and the MTP modules. A combination
Megatron's ``validate_args`` or model code refuses raises SpecError with one line, rather than
being written out to fail on the cluster. Mappings that are not one-to-one are stated in a
comment line of the output.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from trainpilot.specs import ModelSpec, MoESpec, Plan, SpecError
from trainpilot.specs.job import virtual_stage_layers

# Megatron's Llama 3 RoPE scaling has these fixed (rotary_pos_embedding._apply_scaling), and
# its MLA YaRN these defaults with no flag to change them (MLATransformerConfig).
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


@dataclass(kw_only=True)
class MegatronExport:
    """Flags in order (``(flag, value or None)``), environment variables Megatron requires,
    and notes on mappings that are not exact."""

    flags: list[tuple[str, object]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, flag: str, value: object = None) -> None:
        self.flags.append((flag, value))

    def argv(self) -> list[str]:
        out: list[str] = []
        for flag, value in self.flags:
            out.append(flag)
            out.extend(_values(value))
        return out

    def text(self) -> str:
        lines = [f"# {note}" for note in self.notes]
        lines += [f"export {k}={v}" for k, v in self.env.items()]
        lines.append(" \\\n".join(" ".join([f] + [shlex.quote(v) for v in _values(value)])
                                  for f, value in self.flags))
        return "\n".join(lines) + "\n"


def _values(value: object) -> list[str]:
    """A flag's arguments: none, one, or several (an ``nargs='+'`` flag's list)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def megatron_export(plan: Plan, model: ModelSpec) -> MegatronExport:
    """The plan and model as Megatron-LM arguments; SpecError for what Megatron refuses."""
    out = MegatronExport()
    out.add("--tensor-model-parallel-size", plan.tp)
    out.add("--pipeline-model-parallel-size", plan.pp)
    for flag in _stage_args(plan, model):
        out.flags.append(flag)
    if plan.ep > 1:
        out.add("--expert-model-parallel-size", plan.ep)
    if model.moe is not None:
        # The cost model shards experts over ep * tp (memory.py): expert TP = tp.
        out.add("--expert-tensor-parallel-size", plan.tp)
    if plan.cp > 1:
        out.add("--context-parallel-size", plan.cp)
    if plan.sequence_parallel:
        out.add("--sequence-parallel")
    if plan.recompute == "op":
        raise SpecError("plan.recompute", "op", "torchtitan's per-op checkpointing has no "
                        "Megatron-LM flag; valid: none, selective or full")
    if plan.recompute == "selective":  # Megatron's default selective module: core_attn
        out.add("--recompute-granularity", "selective")
    elif plan.recompute == "full":
        out.add("--recompute-granularity", "full")
        out.add("--recompute-method", "uniform")
        out.add("--recompute-num-layers", 1)
    _sharding(out, plan, model)
    out.add("--micro-batch-size", plan.micro_batch_size)
    out.add("--global-batch-size", plan.global_batch_size)
    out.add("--seq-length", plan.seq_len)
    out.add("--max-position-embeddings", max(plan.seq_len, model.max_position_embeddings)
            if model.position_embedding == "rope" else model.max_position_embeddings)
    if plan.precision == "fp8" and plan.fp8_recipe == "rowwise":
        raise SpecError("plan.fp8_recipe", "rowwise", "torchao's row-wise scaling is not a "
                        "Megatron recipe; valid: delayed, current (tensorwise), mxfp8, blockwise")
    if plan.precision == "fp8":
        out.add("--bf16")
        out.add("--fp8-format", "hybrid")
        if plan.fp8_recipe != "delayed":  # Megatron's default recipe is delayed scaling
            out.add("--fp8-recipe", {"current": "tensorwise"}.get(plan.fp8_recipe,
                                                                  plan.fp8_recipe))
        if plan.fp8_param_gather:  # the Plan holds it only with zero >= 1 (validate_args)
            out.add("--fp8-param-gather")
    else:
        out.add(f"--{plan.precision}")
    _model_args(out, model)
    _runtime_args(out, plan, model)
    if (plan.tp > 1 or plan.cp > 1) and plan.zero != 3:
        # validate_args: TP/CP need one hardware queue before Blackwell (compute capability
        # 10); FSDP2 needs more than one, so it is left unset there.
        out.env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return out


def _runtime_args(out: MegatronExport, plan: Plan, model: ModelSpec) -> None:
    """Token dropping and CUDA graphs (``RuntimeProfile.moe_capacity_factor``,
    ``cuda_graph_scope``) as Megatron-Core's flags."""
    rt = plan.runtime
    if rt.moe_capacity_factor is not None and model.moe is not None:
        out.add("--moe-expert-capacity-factor", f"{rt.moe_capacity_factor:g}")
        out.add("--moe-pad-expert-input-to-capacity")  # static shapes, as the cost model has
    scope = list(rt.cuda_graph_scope)
    if not scope:
        return
    moe_scopes = {"moe", "moe_router", "moe_preprocess"}
    if model.moe is None and moe_scopes & set(scope):
        raise SpecError("runtime.cuda_graph_scope", scope,
                        "the model has no MoE layers; valid: attn, mlp, full_iteration")
    if model.moe is not None and "mlp" in scope and not model.moe.first_k_dense_layers \
            and model.moe.layer_freq == 1:
        raise SpecError("runtime.cuda_graph_scope", scope,
                        "Megatron graphs mlp in dense layers only and this model has none")
    if "full_iteration" in scope:
        if scope != ["full_iteration"]:
            raise SpecError("runtime.cuda_graph_scope", scope,
                            "full_iteration already covers every scope; list it alone")
        out.add("--cuda-graph-impl", "local")  # Megatron-Core's whole-iteration graph
    else:
        if plan.recompute == "full":
            raise SpecError("runtime.cuda_graph_scope", scope, "Megatron graphs fully "
                            "recomputed layers only in a full_iteration graph")
        out.add("--cuda-graph-impl", "transformer_engine")
    out.add("--cuda-graph-scope", scope)


def megatron_args(plan: Plan, model: ModelSpec) -> str:
    """``megatron_export(plan, model)`` as text: notes, environment, then the flags."""
    return megatron_export(plan, model).text()


def _sharding(out: MegatronExport, plan: Plan, model: ModelSpec) -> None:
    if plan.zero in (1, 2):
        out.add("--use-distributed-optimizer")
        if plan.zero == 2:
            out.notes.append("zero=2 has no Megatron equivalent; exported as the distributed "
                             "optimizer (ZeRO-1)")
    elif plan.zero == 3:
        # validate_args refuses FSDP2 with any of these (arguments.py, `if args.use_torch_fsdp2`).
        for bad, why in ((plan.pp > 1, f"pp={plan.pp}"), (plan.ep > 1, f"ep={plan.ep}"),
                         (model.tie_word_embeddings, "tied embeddings"),
                         (plan.precision == "fp16", "fp16")):
            if bad:
                raise SpecError("plan.zero", 3, f"Megatron's --use-torch-fsdp2 refuses {why}; "
                                "valid: zero 0-2 for this layout")
        out.add("--use-torch-fsdp2")
        out.add("--no-gradient-accumulation-fusion")
        out.add("--ckpt-format", "torch_dist")
        if plan.dp_shard is not None and plan.dp_shard != plan.dp:
            out.notes.append(f"dp_shard={plan.dp_shard}: Megatron's FSDP2 shards over all "
                             f"dp={plan.dp} ranks (no HSDP)")
    if plan.comm.overlap and plan.dp * plan.cp > 1:
        out.add("--overlap-grad-reduce")
        if plan.zero in (1, 2):
            out.add("--overlap-param-gather")


def _stage_args(plan: Plan, model: ModelSpec) -> list[tuple[str, object]]:
    """How the layers split over (virtual) pipeline stages, in Megatron-core's flags:
    ``--decoder-first/last-pipeline-num-layers`` (with ``--num-virtual-stages-per-pipeline-rank``
    when interleaved) where every stage divides evenly into its virtual stages; the
    embedding/loss accounting flags where each edge stage is one layer short of a middle one
    and that layer comes off its outer chunk (Llama 3 405B); ``--pipeline-model-parallel-layout``
    for any other short outer chunk."""
    first, last = plan.pp_first_stage_layers, plan.pp_last_stage_layers
    edges: list[tuple[str, object]] = [(f, n) for f, n in (("--decoder-first-pipeline-num-layers", first),
                                 ("--decoder-last-pipeline-num-layers", last)) if n is not None]
    if plan.vp == 1 or not edges:
        out: list[tuple[str, object]] = []
        if plan.vp > 1:
            out.append(("--num-virtual-stages-per-pipeline-rank", plan.vp))
        return out + edges
    chunks = virtual_stage_layers(model, plan)
    if all(len(set(c)) == 1 for c in chunks):
        return [("--num-virtual-stages-per-pipeline-rank", plan.vp)] + edges
    mid = chunks[1] if plan.pp > 2 else None
    if mid and chunks[0] == [mid[0] - 1] + mid[1:] and chunks[-1] == mid[:-1] + [mid[-1] - 1]:
        return [("--num-virtual-stages-per-pipeline-rank", plan.vp),
                ("--account-for-embedding-in-pipeline-split", None),
                ("--account-for-loss-in-pipeline-split", None)]
    stages = []  # model order: chunk 0 of every rank, then chunk 1, ...
    for k in range(plan.vp):
        for i in range(plan.pp):
            text = ("E" if (k, i) == (0, 0) else "") + "t" * chunks[i][k]
            stages.append(text + ("L" if (k, i) == (plan.vp - 1, plan.pp - 1) else ""))
    return [("--pipeline-model-parallel-layout", "|".join(stages))]


def _model_args(out: MegatronExport, model: ModelSpec) -> None:
    add = out.add
    add("--num-layers", model.num_hidden_layers)
    add("--hidden-size", model.hidden_size)
    add("--num-attention-heads", model.num_attention_heads)
    add("--ffn-hidden-size", model.intermediate_size)
    if model.mla is None:
        if model.kv_heads != model.num_attention_heads:
            add("--group-query-attention")
            add("--num-query-groups", model.kv_heads)
        if model.head_size * model.num_attention_heads != model.hidden_size:
            add("--kv-channels", model.head_size)
    if model.activation == "swiglu":
        add("--swiglu")
    add("--normalization", "RMSNorm" if model.norm == "rmsnorm" else "LayerNorm")
    add("--norm-epsilon", model.norm_eps)
    if model.qk_norm:
        add("--qk-layernorm")
    if not model.bias:
        add("--disable-bias-linear")
    if not model.tie_word_embeddings:
        add("--untie-embeddings-and-output-weights")
    _position_args(out, model)
    if model.moe is not None:
        _moe_args(out, model, model.moe)
    if model.mla is not None:
        mla = model.mla
        add("--multi-latent-attention")
        if mla.q_lora_rank:
            add("--q-lora-rank", mla.q_lora_rank)
        add("--kv-lora-rank", mla.kv_lora_rank)
        add("--qk-head-dim", mla.qk_nope_head_dim)
        add("--qk-pos-emb-head-dim", mla.qk_rope_head_dim)
        add("--v-head-dim", mla.v_head_dim)
    if model.num_mtp_layers:
        add("--mtp-num-layers", model.num_mtp_layers)
    add("--padded-vocab-size", model.vocab_size)


def _position_args(out: MegatronExport, model: ModelSpec) -> None:
    if model.position_embedding == "learned":
        out.add("--position-embedding-type", "learned_absolute")
        if model.num_mtp_layers:
            raise SpecError("num_mtp_layers", model.num_mtp_layers,
                            "Megatron's MTP needs rope positions; valid: 0 here")
        return
    out.add("--position-embedding-type", "rope")
    if not float(model.rope_theta).is_integer():
        raise SpecError("rope_theta", model.rope_theta,
                        "Megatron's --rotary-base is an integer; valid: a whole number")
    out.add("--rotary-base", int(model.rope_theta))
    scaling = model.rope_scaling
    if model.mla is not None:
        if scaling is None:
            out.add("--rope-type", "rope")
            return
        if scaling.type != "yarn":
            raise SpecError("rope_scaling.type", scaling.type,
                            "Megatron's MLA takes yarn or plain rope; valid: yarn or none")
        _check_fixed(scaling, _YARN_FIXED, "MLA YaRN")
        out.add("--rope-type", "yarn")
        out.add("--rotary-scaling-factor", f"{scaling.factor:g}")
        out.add("--mscale", f"{scaling.mscale if scaling.mscale is not None else 1.0:g}")
        out.add("--mscale-all-dim", f"{scaling.mscale_all_dim or 0.0:g}")
        return
    if scaling is None:
        return
    if scaling.type != "llama3":
        raise SpecError("rope_scaling.type", scaling.type,
                        "Megatron's standard attention scales RoPE only the Llama 3 way "
                        "(--use-rope-scaling); valid: llama3 or none")
    _check_fixed(scaling, _LLAMA3_FIXED, "Llama 3 RoPE scaling")
    out.add("--use-rope-scaling")
    out.add("--rope-scaling-factor", f"{scaling.factor:g}")


def _check_fixed(scaling, fixed: dict[str, float], what: str) -> None:
    for key, value in fixed.items():
        ours = getattr(scaling, key)
        if ours is not None and float(ours) != value:
            raise SpecError(f"rope_scaling.{key}", ours,
                            f"Megatron's {what} has it fixed at {value:g}; valid: {value:g}")


def _moe_args(out: MegatronExport, model: ModelSpec, moe: MoESpec) -> None:
    add = out.add
    add("--num-experts", moe.num_experts)
    add("--moe-router-topk", moe.top_k)
    add("--moe-ffn-hidden-size", moe.expert_intermediate_size)
    add("--moe-grouped-gemm")
    add("--moe-token-dispatcher-type", "alltoall")
    if moe.num_shared_experts:
        add("--moe-shared-expert-intermediate-size", moe.shared_width)
    if moe.first_k_dense_layers or moe.layer_freq > 1:
        pattern = [1 if model.is_moe_layer(i) else 0 for i in range(model.num_hidden_layers)]
        add("--moe-layer-freq", str(pattern).replace(" ", ""))
    if moe.router_score == "sigmoid":
        if not moe.router_norm_topk:
            raise SpecError("moe.router_norm_topk", False, "Megatron renormalises sigmoid "
                            "top-k weights; valid: true with router_score sigmoid")
        add("--moe-router-score-function", "sigmoid")
    elif not moe.router_norm_topk:
        add("--moe-router-pre-softmax")  # softmax over all experts, top-k not renormalised
    if moe.router_expert_bias:
        add("--moe-router-enable-expert-bias")
    if moe.num_expert_groups > 1 and moe.topk_groups is not None:
        add("--moe-router-num-groups", moe.num_expert_groups)
        add("--moe-router-group-topk", moe.topk_groups)
    if moe.router_scaling_factor is not None:
        add("--moe-router-topk-scaling-factor", f"{moe.router_scaling_factor:g}")
    # DeepSeek-V3 pairs its bias balancing with a sequence-wise auxiliary loss (report §2.1.2).
    add("--moe-router-load-balancing-type",
        "seq_aux_loss" if moe.router_expert_bias else "aux_loss")
    add("--moe-aux-loss-coeff", f"{moe.aux_loss_coeff:g}")
