"""The callback protocol through which monitors, stores and checkpointers watch a Trainer, and
the per-step record they receive."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from trainpilot.runtime.trainer import Trainer


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """What one optimizer step did. Times in seconds; ``tokens`` is the whole job's (all dp
    replicas); ``loss`` in nats, averaged over the global batch."""

    step: int  # optimizer steps completed, 1-based
    loss: float
    lr: float
    grad_norm: float  # global L2 norm before clipping
    step_time_s: float  # wall time of the step, data included
    data_wait_s: float  # part of step_time_s spent producing the batch
    tokens: int
    tokens_per_s: float
    predicted_step_time_s: float | None  # the cost model's figure for this plan and cluster
    aux_loss: float | None = None  # MoE load-balancing loss (mean over MoE layers)
    epoch: int = 0
    samples_seen: int = 0  # since the start of training (all ranks)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@runtime_checkable
class CallbackProtocol(Protocol):
    def on_train_start(self, trainer: Trainer) -> None: ...
    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None: ...
    def on_event(self, kind: str, payload: dict[str, Any]) -> None: ...
    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...


class Callback:
    """Base class with no-op hooks: subclass and override what you need. Called on every rank;
    check ``trainer.layout.rank`` to act on one. A callback may call ``trainer.request_stop``."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Before the first step (the model, optimizer and sampler exist)."""

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        """After each optimizer step."""

    def on_event(self, kind: str, payload: dict[str, Any]) -> None:
        """Something worth noting that is not a step: calibration, autocast decision, stop..."""

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        """After the last step (also after a requested stop)."""


class JsonlMetrics(Callback):
    """Rank 0 appends one JSON line per step (and per event) to ``path``. Lines are flushed as
    written, so a reader tailing the file (the launcher's progress bar) sees whole lines."""

    def __init__(self, path: str | os.PathLike, *, rank: int = 0):
        self.path = Path(path)
        self.active = rank == 0
        self._handle = None

    def _write(self, data: dict[str, Any]) -> None:
        if not self.active:
            return
        if self._handle is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = open(self.path, "a", encoding="utf-8")
        self._handle.write(json.dumps(data) + "\n")
        self._handle.flush()

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        self._write(dict(kind="step", **record.to_dict()))

    def on_event(self, kind: str, payload: dict[str, Any]) -> None:
        self._write(dict(kind=kind, **payload))

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._write(dict(kind="end", **summary))
        if self._handle is not None:
            self._handle.close()
            self._handle = None
