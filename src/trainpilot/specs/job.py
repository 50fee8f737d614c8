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
    the remaining layers split evenly over the middle stages (Megatron's uneven pipeline).
    Raises SpecError when the layers cannot be split that way.
    """
    num_layers, pp, vp = model.num_hidden_layers, plan.pp, plan.vp
    first, last = plan.pp_first_stage_layers, plan.pp_last_stage_layers
    if pp * vp > num_layers:
        field = "plan.pp" if vp == 1 else "plan.vp"
        raise SpecError(
            field, pp if vp == 1 else vp,
            f"pp * vp = {pp * vp} exceeds num_hidden_layers={num_layers}; "
            f"valid: pp * vp <= {num_layers}",
        )
    if first is None and last is None:
        if num_layers % (pp * vp):
            raise SpecError(
                "plan.pp", pp,
                f"num_hidden_layers={num_layers} does not split evenly over pp * vp = {pp * vp}; "
                f"valid: pp * vp dividing {num_layers} ({_divisors(num_layers)}), or set "
                "pp_first_stage_layers / pp_last_stage_layers",
            )
        return [num_layers // pp] * pp
    if vp > 1:
        raise SpecError("plan.vp", vp, "uneven first/last pipeline stages need vp=1")
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
    widths = {"intermediate_size": int(model.intermediate_size)}
    if model.moe:
        widths["moe.expert_intermediate_size"] = model.moe.expert_intermediate_size
    for key, width in widths.items():
        if width % plan.tp:
            raise SpecError("plan.tp", plan.tp, f"does not divide {key}={width}")
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
    if plan.world_size != cluster.num_devices:
        raise SpecError(
            "plan.dp*tp*pp*cp", plan.world_size,
            f"dp*tp*pp*cp = {plan.dp}*{plan.tp}*{plan.pp}*{plan.cp} must equal the cluster's "
            f"{cluster.num_devices} devices ({cluster.num_nodes} nodes x {cluster.devices_per_node})",
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
