"""Pipeline schedules as per-rank operation orders: GPipe, 1F1B, interleaved 1F1B, zero-bubble.

An operation is (kind, chunk, micro_batch): kind "F" forward, "B" backward (for zero-bubble
only the input-gradient half), "W" weight-gradient half (zero-bubble only). Rank r's chunk c is
virtual stage c * pp + r (Megatron-LM's interleaving); with vp = 1, chunk 0 is the stage.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from trainpilot.specs.errors import SpecError

Schedule = Literal["gpipe", "1f1b", "interleaved", "zero_bubble"]
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zero_bubble")


class Op(NamedTuple):
    kind: str  # "F", "B" or "W"
    chunk: int
    micro_batch: int

    @property
    def label(self) -> str:
        chunk = f"c{self.chunk}." if self.chunk else ""
        return f"{self.kind}{chunk}{self.micro_batch}"


def gpipe(pp: int, rank: int, num_micro_batches: int) -> list[Op]:
    """All forwards, then all backwards (Huang et al. 2019)."""
    del pp, rank
    m = range(num_micro_batches)
    return [Op("F", 0, i) for i in m] + [Op("B", 0, i) for i in m]


def one_f_one_b(pp: int, rank: int, num_micro_batches: int) -> list[Op]:
    """PipeDream-Flush 1F1B (Narayanan et al. 2021): pp - rank - 1 warm-up forwards, then one
    forward and one backward in turn, then the remaining backwards."""
    m = num_micro_batches
    warmup = min(pp - rank - 1, m)
    ops = [Op("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        ops += [Op("F", 0, warmup + i), Op("B", 0, i)]
    ops += [Op("B", 0, i) for i in range(m - warmup, m)]
    return ops


def interleaved(pp: int, rank: int, num_micro_batches: int, vp: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``):
    micro-batches go through the chunks in groups of pp; warm-up of 2 (pp - rank - 1) +
    (vp - 1) pp virtual forwards. Needs num_micro_batches to be a multiple of pp."""
    m = num_micro_batches
    if m % pp:
        raise SpecError("plan.num_micro_batches", m,
                        f"interleaved 1F1B needs a multiple of pp={pp} micro-batches")
    total = m * vp
    group = pp * vp

    def fwd(k: int) -> Op:
        return Op("F", (k % group) // pp, (k // group) * pp + k % pp)

    def bwd(k: int) -> Op:
        return Op("B", vp - 1 - (k % group) // pp, (k // group) * pp + k % pp)

    warmup = min((pp - rank - 1) * 2 + (vp - 1) * pp, total)
    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [fwd(warmup + k), bwd(k)]
    ops += [bwd(k) for k in range(total - warmup, total)]
    return ops


def zero_bubble(pp: int, rank: int, num_micro_batches: int) -> list[Op]:
    """ZB-H1 order (Qi et al. 2023): 1F1B with each backward split into B (input gradient) and
    W (weight gradient). This list gives the 1F1B order of F and B with each W right after its
    B; the engine defers a W whenever the next F or B is still waiting for data, which fills
    the bubble with weight-gradient work at 1F1B's activation memory."""
    ops: list[Op] = []
    for op in one_f_one_b(pp, rank, num_micro_batches):
        ops.append(op)
        if op.kind == "B":
            ops.append(Op("W", 0, op.micro_batch))
    return ops


def rank_ops(schedule: str, pp: int, rank: int, num_micro_batches: int, vp: int = 1,
             ) -> list[Op]:
    """Rank ``rank``'s operations in issue order."""
    if schedule not in SCHEDULES:
        raise SpecError("plan.pp_schedule", schedule, f"valid: {', '.join(SCHEDULES)}")
    if schedule != "interleaved" and vp != 1:
        raise SpecError("plan.vp", vp, f"{schedule} runs one chunk per rank; valid: vp=1")
    if schedule == "gpipe":
        return gpipe(pp, rank, num_micro_batches)
    if schedule == "1f1b":
        return one_f_one_b(pp, rank, num_micro_batches)
    if schedule == "zero_bubble":
        return zero_bubble(pp, rank, num_micro_batches)
    return interleaved(pp, rank, num_micro_batches, vp)
