"""Interventions, each opt-in, each logged with before/after evidence and, once it is known,
its outcome (also written to the knowledge base: anomaly, action, outcome).

- ``clip``: when the global gradient norm passes ``trigger_norm``, clip it to ``max_norm``.
- ``skip_batch``: drop this batch's update (gradients set to ``None``, so the optimizer leaves
  every parameter and its state untouched) on a loss spike or non-finite gradients.
- ``halve_lr``: multiply every parameter group's LR (and a scheduler's ``base_lrs``) by
  ``factor`` on a plateau, at most once per ``cooldown_steps``. Judged against the
  counterfactual of a plateau (the loss would have stayed at the plateau's median): recovered
  when the median loss of the next quarter-window is at least ``min_rel_improvement`` (the
  plateau rule's 1 %) below the plateau's median, not on any decrease.
- ``rollback``: on divergence (``patience`` consecutive flagged steps), restore the last good
  checkpoint at least ``rewind_steps`` before the first flagged step through a ``restore(step)``
  callable, and tell the loop to skip ``skip_batches`` data batches (PaLM: restart ~100 steps
  earlier and skip 200-500 batches). Judged only after ``max(4 * patience, 10)`` steps have
  actually run after the restore: recovered when none of them was flagged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trainpilot.store.runstore import RunStore

log = logging.getLogger("trainpilot.health")

RestoreFn = Callable[[int], None]  # restore model/optimizer/scheduler state saved at a step


@dataclass(kw_only=True)
class InterventionRecord:
    action: str
    trigger: str  # the rule (anomaly) that triggered it
    step: int
    before: dict[str, Any]
    after: dict[str, Any]
    outcome: str | None = None  # recovered | not_recovered | not_possible, once known
    event_id: int | None = None


@dataclass(kw_only=True)
class PendingOutcome:
    record: InterventionRecord
    due_step: int
    check: Callable[[], tuple[str, dict[str, Any]]] = field(repr=False)
    steps_left: int = 0  # steps that must still run (a rollback re-runs steps below due_step)


class InterventionLog:
    """Writes intervention events and outcomes to the store (and keeps them in memory)."""

    def __init__(self, store: RunStore | None):
        self.store = store
        self.records: list[InterventionRecord] = []
        self.pending: list[PendingOutcome] = []
        self.experience: dict[tuple[str, str], Any] = {}  # (anomaly, action) -> Experience

    def record(self, action: str, trigger: str, step: int, before: dict, after: dict, *,
               outcome: str | None = None) -> InterventionRecord:
        rec = InterventionRecord(action=action, trigger=trigger, step=step, before=before,
                                 after=after, outcome=outcome)
        self.records.append(rec)
        log.warning("intervention %s at step %d (trigger %s): before %s after %s", action, step,
                    trigger, before, after)
        if self.store is not None:
            past = self.experience.get((trigger, action))
            history = None if past is None else dict(tried=past.num_tried,
                                                     recovered=past.num_recovered)
            rec.event_id = self.store.log_event(
                "intervention", step, dict(trigger=trigger, before=before, after=after,
                                           outcome=outcome, history=history),
                severity="warning", name=action, message=f"{action} on {trigger}")
            if outcome is not None:
                self.store.log_knowledge(trigger, action, outcome, evidence=_brief(before, after))
        return rec

    def expect(self, rec: InterventionRecord, due_step: int,
               check: Callable[[], tuple[str, dict[str, Any]]], *, min_steps: int = 0) -> None:
        """Judge ``rec``'s outcome with ``check()`` at the end of ``due_step``, and not before
        ``min_steps`` more steps have run (after a rollback the step counter goes back)."""
        self.pending.append(PendingOutcome(record=rec, due_step=due_step, check=check,
                                           steps_left=min_steps))

    def settle(self, step: int) -> None:
        """Evaluate the outcomes that are due (call once per finished step)."""
        for p in self.pending:
            p.steps_left -= 1
        ready = [p.due_step <= step and p.steps_left <= 0 for p in self.pending]
        due = [p for p, r in zip(self.pending, ready) if r]
        self.pending = [p for p, r in zip(self.pending, ready) if not r]
        for p in due:
            outcome, evidence = p.check()
            p.record.outcome = outcome
            p.record.after = dict(p.record.after, **evidence)
            if self.store is not None:
                self.store.log_event("intervention", step,
                                     dict(trigger=p.record.trigger, phase="outcome",
                                          intervention_step=p.record.step, outcome=outcome,
                                          before=p.record.before, after=p.record.after),
                                     name=p.record.action,
                                     message=f"{p.record.action}: {outcome}")
                self.store.log_knowledge(p.record.trigger, p.record.action, outcome,
                                         evidence=_brief(p.record.before, p.record.after),
                                         payload=dict(step=p.record.step))

    def drop_after(self, step: int) -> None:
        """A rollback to ``step`` voids outcomes that were to be judged on discarded steps."""
        for p in self.pending:
            if p.record.step > step:
                p.record.outcome = "rolled_back"
        self.pending = [p for p in self.pending if p.record.step <= step]


def _brief(before: dict, after: dict) -> str:
    return f"before {before}; after {after}"[:500]


def drop_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Skip this step's update: optimizers leave parameters whose ``grad`` is None untouched."""
    for p in params:
        p.grad = None


def clip_gradients(params: Sequence[torch.nn.Parameter], max_norm: float) -> tuple[float, float]:
    """Clip the global L2 norm to ``max_norm`` (the runtime's clip, right also for gradients
    sharded as DTensors); returns (norm before, norm after)."""
    from trainpilot.runtime.optim import clip_grad_norm_, global_grad_norm

    params = list(params)
    if not any(p.grad is not None for p in params):
        return 0.0, 0.0
    before = float(clip_grad_norm_(params, max_norm))
    return before, float(global_grad_norm(params))


def scale_lr(optimizer: torch.optim.Optimizer, factor: float, min_lr: float,
             scheduler: Any | None = None) -> tuple[list[float], list[float]]:
    """Multiply each group's LR by ``factor`` (not below ``min_lr``); a scheduler's ``base_lrs``
    too, or it would undo the change at its next step. Returns (before, after) LRs."""
    before = [float(g["lr"]) for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = max(min_lr, float(group["lr"]) * factor)
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [max(min_lr, lr * factor) for lr in scheduler.base_lrs]
    return before, [float(g["lr"]) for g in optimizer.param_groups]


def pick_rollback_step(good_steps: Sequence[int], first_bad_step: int,
                       rewind_steps: int) -> int | None:
    """The latest good checkpoint at least ``rewind_steps`` before the first bad step; failing
    that, the latest good one before it; ``None`` when there is none."""
    earlier = [s for s in good_steps if s < first_bad_step]
    rewound = [s for s in earlier if s <= first_bad_step - rewind_steps]
    if rewound:
        return max(rewound)
    return max(earlier) if earlier else None


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)
