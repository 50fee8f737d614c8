"""Sim2Infer: a serving deployment's latency, throughput and memory from its three documents.

``simulate_serve(model, cluster, plan)`` sizes the KV cache and the largest batch that fits,
then costs the passes the deployment runs (``trainpilot.perf.serve.pass_cost``):

* disaggregated (``plan.prefill`` set): prefill passes of ``prefill_tokens`` per attention group
  on the prefill instances (TTFT = one pass + shipping the prompt's KV cache to a decode
  instance over the inter-node network), decode steps on the decode instances at the mean
  context ``input_len + output_len / 2``;
* colocated, static batching: the batch is prefilled in one pass, then decodes ``output_len``
  tokens together: throughput = batch x output / (prefill + steps x step time);
* colocated, continuous batching: every pass carries the running batch's decode rows plus the
  prompt tokens that keep the batch full in steady state (``input / output`` prompt tokens per
  output token), the way chunked prefill mixes them;
* colocated, unmixed: sequences join running batches, but prompts are prefilled in passes of
  their own that the decoding sequences wait for; per batch of requests, one prefill pass of
  their prompts plus ``output`` decode steps, as static batching costs it (the prompts of a
  batch in one pass or one by one cost the same where the pass is compute-bound; a mixed pass
  would instead touch every expert on every decode step), with the running-length admission.

Speculative decoding verifies ``1 + num_draft_tokens`` rows per sequence per step and yields
``SpeculativeSpec.tokens_per_step`` tokens. Per phase the report names the bound (compute, HBM
weights, HBM KV cache, TP collectives, all-to-all, overhead) that takes the most time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainpilot.perf.serve import (
    PassCost,
    PassShape,
    ServeEfficiency,
    check_serve,
    kv_bytes_per_token,
    kv_capacity_tokens,
    pass_cost,
    weight_bytes_per_device,
)
from trainpilot.specs import ClusterSpec, ModelSpec, SpecError
from trainpilot.specs.serve import InstanceLayout, ServePlan

GIB = 2**30


@dataclass
class ServeReport:
    """What ``simulate_serve`` predicts. Throughputs count output tokens unless named input;
    "per device" divides by every device of the deployment's instances of that phase."""

    ttft_s: float
    tpot_s: float
    output_tokens_per_s_per_device: float
    output_tokens_per_s_per_instance: float
    input_tokens_per_s_per_device: float  # prefill instances (disaggregated) or the instance
    batch_size: int  # sequences decoding at once per decode instance
    largest_batch: int  # the most that fit the KV cache (capped by max_batch_size)
    fits: bool  # batch_size <= what fits
    kv_capacity_tokens: float  # per attention group of the decode instance
    weights_gib_per_device: float
    kv_gib_per_token_x1e6: float  # KV bytes of one token on one device, in GiB per million
    phases: dict[str, PassCost] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("phases",)}
        out["phases"] = {k: v.to_dict() for k, v in self.phases.items()}
        return out


def _prefill_shape(plan: ServePlan, tokens: float) -> PassShape:
    """A prefill pass of ``tokens`` computed prompt tokens (whole prompts, fractional counts
    allowed) per attention group."""
    computed = plan.input_len * (1.0 - plan.prefix_cache_hit)
    cached = plan.input_len - computed
    seqs = tokens / computed
    pairs = seqs * (computed * cached + computed * (computed + 1) / 2)
    return PassShape(prefill_rows=tokens, prefill_pairs=pairs, prefill_seqs=seqs)


def largest_batch(model: ModelSpec, cluster: ClusterSpec, plan: ServePlan,
                  eff: ServeEfficiency = ServeEfficiency()) -> tuple[int, float]:
    """(largest batch per decode instance that fits its KV cache at ``input + output`` tokens
    per sequence, or ``input + output / 2`` when a continuous batch admits on current length
    (``plan.kv_admission``), capped by ``max_batch_size``; KV tokens per attention group)."""
    layout = plan.decode
    capacity = kv_capacity_tokens(model, cluster, plan, layout, eff)
    held: float = plan.input_len + plan.output_len
    if plan.kv_admission == "current" and plan.batching != "static" and not plan.disaggregated:
        held = plan.input_len + plan.output_len / 2
    per_group = int(capacity // held)
    batch = per_group * layout.dp_attention
    if plan.max_batch_size is not None:
        batch = min(batch, plan.max_batch_size)
    return batch, capacity


def simulate_serve(model: ModelSpec, cluster: ClusterSpec, plan: ServePlan,
                   eff: ServeEfficiency = ServeEfficiency()) -> ServeReport:
    """Predict TTFT, TPOT, throughput and KV capacity of ``plan`` (see the module docstring).
    Raises SpecError when the weights leave no room for a single sequence's KV cache."""
    check_serve(model, plan)
    dec = plan.decode
    if dec.num_devices > cluster.num_devices:
        raise SpecError("decode", dec.label(), f"needs {dec.num_devices} devices; the cluster "
                        f"has {cluster.num_devices}")
    largest, capacity = largest_batch(model, cluster, plan, eff)
    weights = weight_bytes_per_device(model, dec, plan)
    if capacity < plan.input_len + plan.output_len:  # not one sequence per attention group
        raise SpecError("decode", dec.label(),
                        f"weights take {weights / GIB:.1f} GiB per device of "
                        f"{cluster.device.hbm_gib:g}: no room for one sequence of "
                        f"{plan.input_len + plan.output_len} tokens per attention group")
    batch = plan.batch_size or largest
    notes = []
    fits = batch <= largest or plan.batch_size is None
    if not fits:
        notes.append(f"batch {batch} exceeds the {largest} sequences that fit the KV cache")
    spec = plan.speculative
    tps = spec.tokens_per_step
    # The busiest attention group paces every pass (the MoE layers wait for all of them):
    # ceil(batch / dp_attention) sequences, also when fewer sequences run than there are groups.
    per_group = math.ceil(batch / dec.dp_attention - 1e-9)
    decode_shape = PassShape(decode_seqs=per_group,
                             decode_rows=per_group * (1 + spec.num_draft_tokens),
                             context=plan.input_len + plan.output_len / 2)
    computed = plan.input_len * (1.0 - plan.prefix_cache_hit)
    phases: dict[str, PassCost] = {}
    if plan.prefill is not None:
        pre_layout = plan.prefill
        tokens = plan.prefill_tokens or computed
        pre = pass_cost(model, cluster, plan, pre_layout, _prefill_shape(plan, tokens), eff)
        step = pass_cost(model, cluster, plan, dec, decode_shape, eff)
        phases.update(prefill=pre, decode=step)
        kv_full = kv_bytes_per_token(model, InstanceLayout(), plan.kv_dtype)
        transfer = plan.input_len * kv_full / cluster.network.inter_node.bytes_per_s
        ttft = pre.total_s + transfer
        seqs = tokens / computed
        n_pre = pre_layout.num_devices
        input_rate = seqs * plan.input_len * pre_layout.dp_attention / pre.total_s / n_pre
        out_instance = batch * tps / step.total_s
        tpot = step.total_s / tps
        notes.append(f"KV transfer to decode {transfer * 1e3:.1f} ms per prompt")
    elif plan.batching in ("static", "unmixed"):
        pre = pass_cost(model, cluster, plan, dec, _prefill_shape(plan, per_group * computed),
                        eff)
        step = pass_cost(model, cluster, plan, dec, decode_shape, eff)
        phases.update(prefill=pre, decode=step)
        total = pre.total_s + plan.output_len / tps * step.total_s
        out_instance = batch * plan.output_len / total
        input_rate = batch * plan.input_len / pre.total_s / dec.num_devices
        ttft, tpot = pre.total_s, step.total_s / tps
    else:
        prompt_rows = per_group * computed * tps / plan.output_len
        pre_shape = _prefill_shape(plan, prompt_rows)
        mixed = PassShape(decode_seqs=decode_shape.decode_seqs,
                          decode_rows=decode_shape.decode_rows, context=decode_shape.context,
                          prefill_rows=pre_shape.prefill_rows,
                          prefill_pairs=pre_shape.prefill_pairs,
                          prefill_seqs=pre_shape.prefill_seqs)
        step = pass_cost(model, cluster, plan, dec, mixed, eff)
        phases.update(mixed=step)
        out_instance = batch * tps / step.total_s
        input_rate = out_instance * plan.input_len / plan.output_len / dec.num_devices
        tpot = step.total_s / tps
        ttft = step.total_s * max(1.0, computed / max(prompt_rows, 1e-9))
    n_dec = dec.num_devices
    return ServeReport(
        ttft_s=ttft, tpot_s=tpot, output_tokens_per_s_per_device=out_instance / n_dec,
        output_tokens_per_s_per_instance=out_instance, input_tokens_per_s_per_device=input_rate,
        batch_size=int(batch), largest_batch=int(largest), fits=fits,
        kv_capacity_tokens=capacity, weights_gib_per_device=weights / GIB,
        kv_gib_per_token_x1e6=kv_bytes_per_token(model, dec, plan.kv_dtype) * 1e6 / GIB,
        phases=phases, notes=notes,
    )


def deployment_summary(report: ServeReport, plan: ServePlan) -> dict[str, float]:
    """Deployment-wide totals: devices, output tokens/s of all decode instances."""
    return dict(devices=plan.num_devices,
                output_tokens_per_s=report.output_tokens_per_s_per_instance
                * plan.num_decode_instances,
                concurrent_sequences=report.batch_size * plan.num_decode_instances,
                requests_per_s=report.output_tokens_per_s_per_instance
                * plan.num_decode_instances / plan.output_len)

