"""TrainJob ties the three documents together; ``check_job`` holds the cross-document rules."""

from __future__ import annotations

from typing import Any

import pydantic
from pydantic import PositiveInt

from trainpilot.specs.base import Spec
from trainpilot.specs.cluster import ClusterSpec
from trainpilot.specs.errors import SpecError
from trainpilot.specs.model import ModelSpec
from trainpilot.specs.plan import Plan


def _divisors(n: int, limit: int = 12) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    text = ", ".join(map(str, found[:limit]))
    return text + (", ..." if len(found) > limit else "")


def stage_layers(model: ModelSpec, plan: Plan) -> list[int]:
    """Decoder layers held by each pipeline rank (all its virtual stages together).

    Even split unless ``pp_first_stage_layers`` / ``pp_last_stage_layers`` are set, in which case
    the remaining layers split evenly over the middle stages (Megatron's uneven pipeline). With
    ``vp > 1`` each rank's layers are further split into virtual stages by
    ``virtual_stage_layers``. Raises SpecError when the layers cannot be split that way.
    """
    return [sum(chunks) for chunks in virtual_stage_layers(model, plan)]


def virtual_stage_layers(model: ModelSpec, plan: Plan) -> list[list[int]]:
    """Decoder layers of each virtual stage (model chunk) on each pipeline rank:
    ``out[rank][chunk]``. Model order is chunk-major: chunk 0 of ranks 0 .. pp-1, then chunk 1
    of ranks 0 .. pp-1, and so on (Megatron's interleaving).

    Uneven first/last stages with ``vp > 1`` follow Megatron-core
    (``get_transformer_layer_offset``): the middle stages' layers must split into ``vp`` equal
    chunks; an edge stage whose count divides by ``vp`` gets ``count / vp`` per chunk
    (``--decoder-first/last-pipeline-num-layers`` with ``--num-virtual-stages-per-pipeline-rank``);
    otherwise the edge stage's shortfall against a middle stage comes off its outermost chunk
    only (the first chunk of rank 0, the last chunk of the last rank), which is what
    ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` build
    when the shortfall is one layer (Llama 3 405B: 126 layers on pp=16, the embedding and the
    loss each standing in for one layer) and ``--pipeline-model-parallel-layout`` expresses in
    general. Raises SpecError when the layers cannot be split that way.
    """
    layers = _rank_layers(model, plan)
    return chunk_layers(layers, plan.vp, field="plan.vp")


def chunk_layers(rank_layers: list[int] | tuple[int, ...], vp: int, *,
                 field: str = "vp") -> list[list[int]]:
    """Split each rank's layer count into ``vp`` virtual-stage counts (the rule of
    ``virtual_stage_layers``). ``rank_layers``: layers per pipeline rank, first to last."""
    pp = len(rank_layers)
    if vp == 1:
        return [[n] for n in rank_layers]
    inner = rank_layers[1:-1] if pp > 2 else []
    if pp > 2 and (len(set(inner)) != 1 or inner[0] % vp or inner[0] < vp):
        raise SpecError(field, vp, f"middle stages hold {sorted(set(inner))} layers; valid: "
                        f"equal middle stages of at least one layer per virtual stage, "
                        f"their layer count a multiple of vp={vp}")
    mid_chunk = inner[0] // vp if inner else None
    out = [[n // vp] * vp for n in rank_layers]
    for index in (0, pp - 1):
        count = rank_layers[index]
        if count % vp == 0:
            continue
        short = (mid_chunk or 0) * vp - count
        if mid_chunk is None or not 0 < short <= mid_chunk:
            raise SpecError(
                field, vp,
                f"stage {index} holds {count} layers: not a multiple of vp={vp}, nor the "
                f"{(mid_chunk or 0) * vp} of a middle stage less at most one chunk "
                f"({mid_chunk or 0} layers); valid: vp dividing {count}, or edge stages "
                "short of a middle stage by at most one chunk")
        chunks = [mid_chunk] * vp
        chunks[0 if index == 0 else -1] -= short  # the embedding / the loss end
        out[index] = chunks
    return out


def _rank_layers(model: ModelSpec, plan: Plan) -> list[int]:
    """Layers per pipeline rank, before any interleaving."""
    num_layers, pp, vp = model.num_hidden_layers, plan.pp, plan.vp
    first, last = plan.pp_first_stage_layers, plan.pp_last_stage_layers
    even = first is None and last is None
    if pp * vp > num_layers and (even or vp == 1):
        field = "plan.pp" if vp == 1 else "plan.vp"
        raise SpecError(
            field, pp if vp == 1 else vp,
            f"pp * vp = {pp * vp} exceeds num_hidden_layers={num_layers}; "
            f"valid: pp * vp <= {num_layers}",
        )
    if even:
        if num_layers % (pp * vp):
            raise SpecError(
                "plan.pp", pp,
                f"num_hidden_layers={num_layers} does not split evenly over pp * vp = {pp * vp}; "
                f"valid: pp * vp dividing {num_layers} ({_divisors(num_layers)}), or set "
                "pp_first_stage_layers / pp_last_stage_layers",
            )
        return [num_layers // pp] * pp
    fixed = [(0, first), (pp - 1, last)]
    middle = pp - sum(n is not None for _, n in fixed)
    rest = num_layers - sum(n or 0 for _, n in fixed)
    if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
        raise SpecError(
            "plan.pp_first_stage_layers", first,
            f"with pp_last_stage_layers={last}, the remaining {rest} of {num_layers} layers do not "
            f"split evenly over {middle} middle stage(s)",
        )
    layers = [rest // middle if middle else 0] * pp
    for index, count in fixed:
        if count is not None:
            layers[index] = count
    return layers


def check_job(model: ModelSpec, cluster: ClusterSpec | None, plan: Plan) -> None:
    """Raise SpecError for the first rule the three documents break together."""
    heads, kv = model.num_attention_heads, model.kv_heads
    if heads % plan.tp:
        raise SpecError(
            "plan.tp", plan.tp,
            f"does not divide num_attention_heads={heads}; valid: {_divisors(heads)}",
        )
    if model.mla is None and kv % plan.tp:
        raise SpecError(
            "plan.tp", plan.tp,
            f"does not divide num_key_value_heads={kv}; valid: {_divisors(kv)}",
        )
    if model.ffn_size % plan.tp:
        raise SpecError("plan.tp", plan.tp,
                        f"does not divide intermediate_size={model.intermediate_size}")
    if model.moe:
        etp = plan.etp if plan.etp is not None else plan.tp
        field = "plan.etp" if plan.etp is not None else "plan.tp"
        width = model.moe.expert_intermediate_size
        if width % etp:
            raise SpecError(field, etp, f"does not divide moe.expert_intermediate_size={width}")
        if model.moe.num_shared_experts and model.moe.shared_width % plan.tp:
            raise SpecError("plan.tp", plan.tp,
                            f"does not divide the shared experts' width {model.moe.shared_width}")
    elif plan.etp is not None:
        raise SpecError("plan.etp", plan.etp, f"model {model.name!r} has no experts; "
                        "valid: leave etp unset")
    stage_layers(model, plan)
    if plan.ep > 1:
        if model.moe is None:
            raise SpecError("plan.ep", plan.ep, f"model {model.name!r} has no experts; valid: 1")
        if model.moe.num_experts % plan.ep:
            raise SpecError(
                "plan.ep", plan.ep,
                f"does not divide moe.num_experts={model.moe.num_experts}; "
                f"valid: {_divisors(model.moe.num_experts)}",
            )
    if plan.cp > 1 and plan.seq_len % (2 * plan.cp):
        raise SpecError(
            "plan.cp", plan.cp,
            f"seq_len={plan.seq_len} must split into 2 * cp = {2 * plan.cp} equal chunks "
            "(load-balanced causal attention)",
        )
    if model.position_embedding == "learned" and plan.seq_len > model.max_position_embeddings:
        raise SpecError(
            "plan.seq_len", plan.seq_len,
            f"exceeds max_position_embeddings={model.max_position_embeddings}",
        )
    if cluster is None:
        return
    if plan.world_size + plan.idle_devices != cluster.num_devices:
        idle = f" + idle_devices {plan.idle_devices}" if plan.idle_devices else ""
        raise SpecError(
            "plan.dp*tp*pp*cp", plan.world_size,
            f"dp*tp*pp*cp{idle} = {plan.dp}*{plan.tp}*{plan.pp}*{plan.cp}{idle} must equal the "
            f"cluster's {cluster.num_devices} devices ({cluster.num_nodes} nodes x "
            f"{cluster.devices_per_node}); leave devices unused with plan.idle_devices",
        )
    if plan.precision not in cluster.device.peak_tflops:
        raise SpecError(
            "plan.precision", plan.precision,
            f"device {cluster.device.name!r} lists no {plan.precision} peak; "
            f"valid: {', '.join(cluster.device.peak_tflops)}",
        )


class TrainJob(Spec):
    """A model on a cluster with a plan, and how many tokens to train on."""

    name: str = "job"
    model: ModelSpec
    cluster: ClusterSpec
    plan: Plan
    total_tokens: PositiveInt | None = None

    @pydantic.field_validator("model", "cluster", "plan", mode="before")
    @classmethod
    def _resolve_refs(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        """Inside a job file a document may be a preset name or a path."""
        if isinstance(value, str):
            from trainpilot.specs import loading

            return getattr(loading, f"load_{info.field_name}")(value)
        return value

    @pydantic.model_validator(mode="after")
    def _cross_check(self) -> TrainJob:
        check_job(self.model, self.cluster, self.plan)
        return self
