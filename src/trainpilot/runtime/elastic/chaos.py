"""Chaos schedules: random faults at exponential inter-arrival times, as an ``--inject`` spec.

Failures of independent components arrive as a Poisson process (the model behind the
availability simulator's MTBF), so the gaps between faults are exponential. The schedule is in
steps (a fault fires when its rank reaches the step), drawn from a seeded generator: a failed
chaos run can be replayed exactly.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

# Faults a chaos run draws from, with the parameters that make each one realistic here.
DEFAULT_KINDS = ("crash", "crash_exit", "crash_in_write", "hang", "collective", "nan", "slow")


def fault_spec(kind: str, *, rank: int, step: int) -> str:
    """One fault of ``kind`` at ``step`` on ``rank``, in the ``--inject`` syntax."""
    specs = {
        "crash": f"crash:rank={rank},step={step}",
        "crash_exit": f"crash:rank={rank},step={step},mode=exit",
        "crash_in_write": f"crash:rank={rank},step={step},at=data",
        "hang": f"hang:rank={rank},step={step}",
        "hang_collective": f"hang:rank={rank},step={step},at=collective,mode=sleep",
        "collective": f"collective:rank={rank},step={step}",
        "nan": f"nan:rank={rank},step={step}",
        "slow": f"slow:rank={rank},step={step},factor=3",
    }
    if kind not in specs:
        raise ValueError(f"unknown chaos fault {kind!r}; valid: {', '.join(specs)}")
    return specs[kind]


def chaos_schedule(*, seed: int, num_steps: int, mean_gap_steps: float, world_size: int,
                   kinds: Sequence[str] = DEFAULT_KINDS, first_step: int = 2,
                   ) -> list[tuple[int, str, int]]:
    """(step, kind, rank) of each fault: gaps ~ Exponential(mean ``mean_gap_steps``), kinds and
    ranks uniform, steps in ``[first_step, num_steps]``, at most one fault per step."""
    rng = random.Random(seed)
    out: list[tuple[int, str, int]] = []
    t = float(first_step - 1)
    while True:
        t += rng.expovariate(1.0 / mean_gap_steps)
        step = max(first_step, int(round(t)))
        if step > num_steps:
            return out
        if out and step <= out[-1][0]:
            step = out[-1][0] + 1
            if step > num_steps:
                return out
        out.append((step, rng.choice(list(kinds)), rng.randrange(world_size)))


def chaos_inject(schedule: Sequence[tuple[int, str, int]]) -> str:
    """The ``--inject`` spec of a schedule."""
    return ";".join(fault_spec(kind, rank=rank, step=step) for step, kind, rank in schedule)
