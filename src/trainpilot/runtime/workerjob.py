"""The typed job document every rank reads: written once by the launcher into the run
directory (``RUN_DIR/job.json``, atomically), read by each worker (``--job-file``).

It is the resolved form of what the user typed: the three documents, the training config,
and the runtime's options (faults to inject, recovery, health, checkpoints, resume point,
preemption signals). Unknown keys are errors, like every other document.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pydantic

from trainpilot.fsio import atomic_write_text
from trainpilot.runtime.config import TrainConfig
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError
from trainpilot.specs.base import Spec

JOB_FILE = "job.json"


class WorkerJob(Spec):
    """What a worker needs to run its rank of the job (paths absolute)."""

    model: ModelSpec | None  # None: the caller supplies its own module (app.rank.RankHooks)
    # A Hugging Face causal LM to train (its config.json as a dict): the transformers model is
    # built and parallelized (runtime.hf_parallel); ``model`` is then its ModelSpec, for the
    # cost model and the monitor. ``hf_weights``: a local safetensors file or folder.
    hf_config: dict[str, Any] | None = None
    hf_weights: str | None = None
    plan: Plan
    config: TrainConfig = TrainConfig()
    cluster: ClusterSpec | None = None
    run_dir: str
    callbacks: list[str] = []
    inject: str = ""
    elastic: dict[str, Any] = {}
    health: bool = True
    health_config: str | None = None
    checkpoint: bool = True
    # Restore only checkpoints at or before this step (``--resume <step>``); None: the newest.
    resume_step: int | None = None
    # Signals that request a last-moment checkpoint and a clean exit (names: "TERM", "USR1").
    preempt_signals: list[str] = ["TERM"]
    # Seconds a preempted worker may spend on its last checkpoint before it exits anyway
    # (torchrun's agent kills its workers 30 s after forwarding the signal).
    preempt_deadline_s: float = pydantic.Field(default=20.0, gt=0)
    # Where rank 0 also sends its metrics (``tensorboard=DIR,prometheus=PORT|FILE``).
    export_metrics: str | None = None

    @pydantic.field_validator("preempt_signals")
    @classmethod
    def _signals(cls, value: list[str]) -> list[str]:
        import signal

        out = []
        for name in value:
            name = name.upper().removeprefix("SIG")
            if name not in ("TERM", "USR1", "USR2", "INT", "HUP"):
                raise ValueError(f"preempt signal {name!r}; valid: TERM, USR1, USR2, INT, HUP")
            getattr(signal, f"SIG{name}")
            out.append(name)
        return out

    def path(self) -> Path:
        return Path(self.run_dir) / JOB_FILE

    def write(self) -> Path:
        """Write ``RUN_DIR/job.json`` (atomically); returns its path."""
        path = self.path()
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")
        return path


def read_job(path: str | os.PathLike) -> WorkerJob:
    """The job document at ``path``; SpecError when unreadable or invalid."""
    from trainpilot.specs.loading import validate

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SpecError("job", str(path), f"unreadable job document ({err})") from None
    return validate(WorkerJob, data, doc="job")
