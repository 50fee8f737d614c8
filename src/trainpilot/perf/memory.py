"""Memory per device: parameters per pipeline stage, the bytes each ZeRO stage keeps per
parameter, in-flight micro-batches of each pipeline schedule.

Bytes per parameter (weights, gradients, optimizer), mixed-precision Adam, ``d`` = ranks the
state is sharded over (dp x cp; dp x cp / ep for expert parameters):

* zero 0, Megatron without a distributed optimizer: 2 + g + 12 (g = gradient bytes, 4 for
  fp32 main gradients; fp32 master weights and two Adam moments);
* zero 1, Megatron's distributed optimizer: 2 + g + 12/d;
* zero 2: 2 + (g + 12)/d, or 2 + g + 12/d when the runtime accumulates gradients unsharded
  over several micro-batches (gradient sync once per step: Megatron, FSDP2's sync flag);
* zero 3 / FSDP: (2 + g + 12)/d (g unsharded likewise), plus the gathered-layer buffer (one
  layer's full 16-bit weights in use, the next one prefetched, its 16-bit gradients and
  their copy in the reduce dtype being reduce-scattered).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trainpilot.perf.flops import attention_params, mlp_params
from trainpilot.specs import ModelSpec

GIB = 2.0**30


def bytes_per_param(zero: int, shards: int, grad_bytes: int = 4,
                    unsharded_grads: bool = False) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter for ZeRO stage ``zero`` over
    ``shards`` ranks. Gradients are held in the reduction dtype (``grad_bytes``: Megatron's
    fp32 main gradients, FSDP's reduce dtype); sharded from zero 2 on, unless the runtime
    accumulates them unsharded over micro-batches (``unsharded_grads``: gradient sync once
    per step). With one shard every stage holds the same (18 bytes with fp32 gradients)."""
    d = float(max(shards, 1))
    grads = grad_bytes if zero < 2 or unsharded_grads else grad_bytes / d
    if zero == 0:
        return 2.0, grads, 12.0
    if zero in (1, 2):
        return 2.0, grads, 12.0 / d
    return 2.0 / d, grads, 12.0 / d


@dataclass(frozen=True)
class RankParams:
    """Parameters one rank holds for one pipeline stage, split by how they are sharded."""

    dense: float  # sharded by tp (or replicated norms); data-parallel over dp*cp
    expert: float  # routed experts, sharded by ep*tp; data-parallel over dp*cp/ep
    largest_layer: float  # one layer's parameters on this rank (FSDP's gathered buffer)

    @property
    def total(self) -> float:
        return self.dense + self.expert


def layer_rank_params(model: ModelSpec, index: int, tp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters of layer ``index`` on one rank."""
    h = model.hidden_size
    norms = 2 * h * (2 if model.norm == "layernorm" else 1)
    dense = attention_params(model) / tp + norms
    if not model.is_moe_layer(index):
        return dense + mlp_params(model, model.ffn_size) / tp, 0.0
    moe = model.moe
    assert moe is not None
    shared = mlp_params(model, moe.shared_width) / tp if moe.num_shared_experts else 0.0
    router = h * moe.num_experts
    expert = moe.num_experts * mlp_params(model, moe.expert_intermediate_size) / (ep * tp)
    return dense + shared + router, expert


def stage_rank_params(model: ModelSpec, layer_ids: Iterable[int], *, tp: int, ep: int, first: bool,
                      last: bool, pp: int) -> RankParams:
    """Parameters on one rank of the pipeline stage holding ``layer_ids`` (the embedding on
    the first stage, the final norm and output layer on the last; with tied embeddings and
    pp > 1 the last stage keeps its own copy of the embedding, as Megatron does)."""
    h, v = model.hidden_size, model.vocab_size
    dense = expert = largest = 0.0
    kinds: dict[bool, tuple[float, float]] = {}  # a layer's parameters depend on its kind only
    for i in layer_ids:
        moe = model.is_moe_layer(i)
        found = kinds.get(moe)
        if found is None:
            found = kinds[moe] = layer_rank_params(model, i, tp, ep)
        d, e = found
        dense, expert, largest = dense + d, expert + e, max(largest, d + e)
    if first:
        dense += v * h / tp
        if model.position_embedding == "learned":
            dense += model.max_position_embeddings * h
    if last:
        dense += h * (2 if model.norm == "layernorm" else 1)
        if not model.tie_word_embeddings or pp > 1:
            dense += v * h / tp
    return RankParams(dense, expert, largest)


def in_flight(schedule: str, stage: int, pp: int, vp: int, num_micro_batches: int,
              chunks: tuple[int, ...] = ()) -> float:
    """Micro-batches whose activations stage ``stage`` holds at its peak, in units of the
    stage's full layer set (an interleaved chunk counts its share of the stage's layers).

    Interleaved (Megatron): before its first backward, rank i runs ``2(p - i - 1) + (v - 1)p``
    warm-up forwards plus one, forward ``j`` on chunk ``(j // p) % v``; with ``chunks`` (layers
    per virtual stage, uneven at the edge stages) each held forward weighs its chunk's layers."""
    m = num_micro_batches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved" and vp > 1:
        passes = min(2 * (pp - stage - 1) + (vp - 1) * pp + 1, m * vp)
        total = sum(chunks)
        if not total or len(set(chunks)) == 1:
            return passes / vp
        return sum(chunks[(j // pp) % vp] for j in range(passes)) / total
    return float(min(pp - stage, m))  # 1F1B and zero-bubble (ZB-H1 keeps 1F1B's peak)
