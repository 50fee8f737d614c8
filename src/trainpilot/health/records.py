"""What a training loop tells the HealthMonitor about a step, and what it is told back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainpilot.records import RankTiming

_RECORD_FIELDS = {  # StepRecord field -> names a Trainer's record may use for it
    "step": ("step",), "loss": ("loss",), "lr": ("lr", "learning_rate"),
    "tokens": ("tokens", "num_tokens"), "step_time_s": ("step_time_s", "step_s"),
    "data_time_s": ("data_time_s", "data_s", "data_wait_s"),
    "compute_time_s": ("compute_time_s", "compute_s"), "comm_time_s": ("comm_time_s", "comm_s"),
    "comm_max_s": ("comm_max_s",), "rank_timings": ("rank_timings",),
    "predicted_step_time_s": ("predicted_step_time_s",),
}


@dataclass(kw_only=True)
class StepRecord:
    """What the loop knows about one finished step (seconds; tokens processed this step)."""

    step: int
    loss: float
    lr: float | None = None
    tokens: int | None = None
    step_time_s: float | None = None
    data_time_s: float | None = None
    compute_time_s: float | None = None  # before the gradient collective
    comm_time_s: float | None = None  # exposed time in collectives
    comm_max_s: float | None = None  # longest single collective
    rank_timings: Sequence[RankTiming] | None = None  # rank 0: every rank's timings
    predicted_step_time_s: float | None = None  # the cost model's figure, stored beside it

    @classmethod
    def from_any(cls, record: Any) -> StepRecord:
        """Read a Trainer's record (a mapping or an object) by field name, with aliases."""
        if isinstance(record, StepRecord):
            return record
        get = record.get if isinstance(record, Mapping) else (
            lambda k, d=None: getattr(record, k, d))
        values: dict[str, Any] = {}  # StepRecord field -> the record's value
        for name, aliases in _RECORD_FIELDS.items():
            for alias in aliases:
                value = get(alias, None)
                if value is not None:
                    values[name] = float(value) if name == "loss" and torch.is_tensor(value) \
                        else value
                    break
        return cls(**values)


@dataclass(kw_only=True)
class Directive:
    """What the loop should do after a step. ``rollback_to``: state was restored to that step;
    continue with step ``rollback_to + 1`` after skipping ``skip_batches`` data batches."""

    skipped_update: bool = False
    rollback_to: int | None = None
    skip_batches: int = 0
