"""The callback protocol through which monitors, stores and checkpointers watch a Trainer, and
the per-step record they receive."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
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
    # Estimated compute of this rank: forward + backward less the time a gradient bucket was in
    # flight (DDP overlaps the two, and its all-reduce makes fast ranks wait for slow ones).
    compute_time_s: float | None = None
    comm_time_s: float | None = None  # wall time with a gradient bucket in flight (comm hook)
    # The longest single collective of the step: a gradient bucket, or the wait for the step's
    # statistics all-reduce (where a stalled or slow peer shows).
    comm_max_s: float | None = None
    comm_bytes: int | None = None  # bytes this rank sent for gradients (comm hook's model)
    comm_payload_bytes: int | None = None  # bytes handed to collectives (compressed size)
    rank_timings: Any = None  # rank 0, when gathered: every rank's RankTiming of this step
    attempts: int = 1  # 2 when a non-finite gradient made the step be computed again
    collective_retries: int = 0  # transient collective failures retried in this step
    skipped_update: bool = False  # the health monitor skipped this batch's update
    # Waiting, before the update, for the previous checkpoint's overlapped copy to host
    # memory: that checkpoint's stall, not part of step_time_s.
    checkpoint_wait_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("rank_timings")
        return out



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
    """Rank 0 appends one JSON line per step (and per event) to ``path``, and to ``mirror``
    when given (the launcher's node-local stream: it must reach the launcher when the run's
    disk is full). Lines are flushed as written, so a reader tailing the file (the launcher's
    progress bar) sees whole lines; lines the disk refuses are kept and written later."""

    def __init__(self, path: str | os.PathLike, *, rank: int = 0,
                 mirror: str | os.PathLike | None = None, on_degraded: Any = None):
        from trainpilot.runtime.degrade import LineFile

        self.path = Path(path)
        self.active = rank == 0
        self._files = [LineFile(self.path, on_degraded=on_degraded)]
        if mirror is not None:
            self._files.append(LineFile(Path(mirror)))

    def _write(self, data: dict[str, Any]) -> None:
        if not self.active:
            return
        for handle in self._files:
            handle.write(data)

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        self._write(dict(kind="step", **record.to_dict()))

    def on_event(self, kind: str, payload: dict[str, Any]) -> None:
        self._write(dict(kind=kind, **payload))

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._write(dict(kind="end", **summary))
        for handle in self._files:
            handle.close()


# Event kinds the runtime emits, and the severity the run store records them with.
_SEVERITY = {"fault": "critical", "failure_detected": "critical", "restart": "warning",
             "disk_full": "critical", "preempted": "warning",
             "checkpoint_failed": "warning", "collective_retry": "warning",
             "nonfinite_recompute": "warning", "nonfinite_loss": "critical"}


class RunRecorder(Callback):
    """Writes a run into its store (rank 0 only; other ranks' recorders do nothing).

    Per step: the metrics the health monitor does not record itself (all of them when there is
    no monitor): comm bytes, samples seen, recomputes and collective retries. Events: every
    runtime event (checkpoints with their stall, restarts, retries, ...), and every injected
    fault read from the shared fault journal, on any rank, with the time it fired (a rank that
    crashed cannot write; rank 0 reads its journal record). After each restart the first
    completed step logs a ``recovered`` event: seconds from the fault to that step and the steps
    lost (redone).
    """

    def __init__(self, store: Any, *, rank: int = 0, journal: Any = None,
                 monitor_logs_metrics: bool = False,
                 on_fault: Callable[[dict[str, Any]], None] | None = None):
        self.store = store if rank == 0 else None
        self.journal = journal  # a FaultInjector (its fired() reads the shared journal)
        self.monitor_logs_metrics = monitor_logs_metrics
        self.on_fault = on_fault  # e.g. the health monitor: faults lower its hardware score
        self._ingested = self._journal_lines_in_store()
        path = getattr(journal, "journal_path", None)
        self.launcher_journal = path.parent / "launcher.jsonl" if path is not None else None
        self._launcher_lines = self._launcher_lines_in_store()
        self._pending_restart: dict[str, Any] | None = None
        self._last_fault = self._unrecovered_fault()

    def _journal_lines_in_store(self) -> int:
        if self.store is None:
            return 0
        lines = [e.payload.get("journal_line", -1) for e in self.store.events(kinds=["fault"])]
        return max(lines, default=-1) + 1

    def _launcher_lines_in_store(self) -> int:
        if self.store is None:
            return 0
        seen = [e.payload.get("launcher_line", -1)
                for e in self.store.events(kinds=["attempt_start", "worker_end"])]
        return max(seen, default=-1) + 1

    def _unrecovered_fault(self) -> dict[str, Any] | None:
        """The newest fault after the last ``recovered`` event: the one a restarted process
        (whose predecessor logged the fault) is recovering from."""
        if self.store is None or self.journal is None:
            return None
        done = [e.time for e in self.store.events(kinds=["recovered"])]
        since = max(done, default=0.0)
        faults = [r for r in self.journal.fired() if r.get("time_unix_s", 0.0) > since]
        return faults[-1] if faults else None

    def ingest_journal(self) -> None:
        """Log the journal's new fault records as ``fault`` events (at the time they fired)."""
        if self.store is None or self.journal is None:
            return
        records = self.journal.fired()
        for line, rec in enumerate(records[self._ingested:], start=self._ingested):
            self._last_fault = rec
            external = rec.get("source") == "external"
            message = (f"observed {rec.get('kind')} of rank {rec.get('rank')}: "
                       f"{rec.get('evidence')}" if external else f"injected {rec.get('fault')}")
            self.store.log_event("fault", rec.get("step"), dict(rec, journal_line=line),
                                 severity="critical", name=rec.get("kind", ""),
                                 message=message, time_s=rec.get("time_unix_s"))
            if self.on_fault is not None:
                self.on_fault(rec)
        self._ingested = max(self._ingested, len(records))
        self._ingest_launcher()

    def _ingest_launcher(self) -> None:
        """The launcher's own records (``launcher.jsonl``: attempts torchrun started, workers
        that ended) as events, so an attempt that died during start-up is on record too."""
        if (self.store is None or self.launcher_journal is None
                or not self.launcher_journal.exists()):
            return
        lines = self.launcher_journal.read_text().splitlines()
        for line_no, raw in enumerate(lines[self._launcher_lines:], start=self._launcher_lines):
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if rec.get("kind") not in ("attempt_start", "worker_end"):
                continue
            msg = (f"torchrun attempt {rec.get('attempt')} started" if rec["kind"] ==
                   "attempt_start" else f"attempt {rec.get('attempt')}: rank {rec.get('rank')} "
                   f"{rec.get('evidence')}")
            self.store.log_event(rec["kind"], None, dict(rec, launcher_line=line_no),
                                 severity="info" if rec["kind"] == "attempt_start" else "warning",
                                 name=rec["kind"], message=msg, time_s=rec.get("time_unix_s"))
        self._launcher_lines = max(self._launcher_lines, len(lines))

    def on_train_start(self, trainer: Trainer) -> None:
        self.ingest_journal()

    def on_step_end(self, trainer: Trainer, record: StepRecord) -> None:
        if self.store is None:
            return
        self.ingest_journal()
        m: dict[str, float] = {"samples_seen": record.samples_seen, "epoch": record.epoch,
                               "attempts": record.attempts,
                               "collective_retries": record.collective_retries}
        if record.checkpoint_wait_s:
            m["checkpoint_wait_s"] = record.checkpoint_wait_s
        for key in ("comm_bytes", "comm_payload_bytes", "aux_loss"):
            value = getattr(record, key)
            if value is not None:
                m[key] = value
        if not self.monitor_logs_metrics:
            m.update(loss=record.loss, lr=record.lr, grad_norm=record.grad_norm,
                     step_time_s=record.step_time_s, data_time_s=record.data_wait_s,
                     tokens_per_s=record.tokens_per_s)
            for key in ("compute_time_s", "comm_time_s", "predicted_step_time_s"):
                if getattr(record, key) is not None:
                    m[key] = getattr(record, key)
            if record.rank_timings:
                self.store.log_rank_timings(record.rank_timings)
        self.store.log_metrics(record.step, m)
        if self._pending_restart is not None:
            self._log_recovered(record)

    def _log_recovered(self, record: StepRecord) -> None:
        info, self._pending_restart = self._pending_restart, None
        if info is None or self.store is None:  # on_step_end checks both first
            return
        now = time.time()
        fault = self._last_fault
        fault_time = fault.get("time_unix_s") if fault else None
        start = fault_time or info.get("failed_at_unix_s") or info.get("last_step_unix_s")
        since = "fault" if fault_time else "failure_seen" if info.get("failed_at_unix_s") \
            else "last_step" if start else None
        failed_step = info.get("failed_step") or (fault.get("step") if fault else None)
        restored = info.get("restored_step", 0)
        payload = dict(first_step=record.step, restored_step=restored, reason=info.get("reason"),
                       source=info.get("source"),
                       recovery_s=None if start is None else now - start, since=since,
                       lost_steps=None if failed_step is None else max(0, failed_step - 1
                                                                       - restored),
                       fault=fault.get("fault") if fault else None)
        self.store.log_event("recovered", record.step, payload, severity="info",
                             message=f"first step after the restart: {record.step}")
        self._last_fault = None

    def on_event(self, kind: str, payload: dict[str, Any]) -> None:
        if self.store is None:
            return
        if kind == "restart":
            self.ingest_journal()
            self._pending_restart = dict(payload)
            times = [t for _, t in self.store.step_times()]
            # Without a fault record (a real failure), recovery is timed from the last step
            # the store saw completed: an upper bound (it includes the failed step's part).
            self._pending_restart["last_step_unix_s"] = max(times) if times else None
        step = payload.get("step", payload.get("restored_step"))
        self.store.log_event(kind, step if isinstance(step, int) else None, payload,
                             severity=_SEVERITY.get(kind, "info"), name=kind,
                             message=_message(kind, payload))

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if self.store is not None:
            self.ingest_journal()
            self.store.flush()


def _message(kind: str, p: dict[str, Any]) -> str:
    if kind == "checkpoint":
        where = "memory + storage" if p.get("to_storage") else "memory"
        return f"step {p.get('step')} to {where}, stall {1e3 * p.get('stall_s', 0):.1f} ms"
    if kind == "restart":
        return (f"{p.get('reason')}: restored step {p.get('restored_step')} from "
                f"{p.get('source')}")
    if kind == "failure_detected":
        return f"rank {p.get('rank')} {p.get('reason')} for {p.get('waited_s')} s"
    return ""
