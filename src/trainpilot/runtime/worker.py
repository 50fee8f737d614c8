"""The worker torchrun starts on every rank: ``python -m trainpilot.runtime.worker --job JSON``.

It joins the job's process group through an elastic session (a generation over the job's
store), builds the layout (the plan fitted to the world size torchrun gave it), lets rank 0
write the resolved documents into the run directory (atomically) and open the run store,
calibrates the cost model on CPU, and trains with the checkpointer (``plan.checkpoint``), the
fault injector (``--inject``), the health monitor and in-process recovery wired in. Per-step
records stream to ``metrics.jsonl`` for the launcher; ``summary.json`` ends the run.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

from trainpilot.fsio import atomic_write_text
from trainpilot.runtime.callbacks import Callback
from trainpilot.runtime.preempt import PreemptGuard
from trainpilot.runtime.watchdog import Beacon
from trainpilot.runtime.workerjob import WorkerJob, read_job
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError, dump


def write_documents(run_dir: Path, *, model: ModelSpec, plan: Plan, config, extra: dict) -> None:
    """The resolved model, plan and training config, plus the environment (rank 0 only)."""
    dump(model, run_dir / "model.yaml")
    dump(plan, run_dir / "plan.yaml")
    dump(config, run_dir / "train.yaml")
    atomic_write_text(run_dir / "env.json", json.dumps(extra, indent=2) + "\n")


def predict(model: ModelSpec, plan: Plan, layout, cluster: ClusterSpec | None, *,
            calibrate_now: bool = True) -> dict[str, Any]:
    """Calibrate (CPU) or take the given cluster, and ask the cost model for the step time.
    ``calibrate_now=False`` (a replacement process: its peers do not calibrate again) skips the
    measurement, which is collective."""
    from trainpilot.runtime.calibrate import calibrate, calibrated_cpu_cluster, predict_step_time_s

    info: dict[str, Any] = {}
    if cluster is None and layout.device.type == "cpu" and calibrate_now:
        cal = calibrate(device=layout.device)
        cluster = calibrated_cpu_cluster(layout.world_size, cal)
        info["calibration"] = cal.to_dict()
        info["calibration_note"] = ("cpu device calibrated on this machine: 1024^3 fp32 matmul "
                                    "(all ranks at once) and gloo all-reduce (8 B, 4 MiB)")
    if cluster is None:
        info.update(predicted_step_time_s=None, prediction_note="no cluster given")
        return info
    value, note = predict_step_time_s(model, cluster, plan)
    info.update(cluster=cluster, predicted_step_time_s=value, prediction_note=note)
    return info


def open_store(run_dir: Path, *, model: ModelSpec, plan: Plan, config, cluster, layout,
               job: WorkerJob):
    """Rank 0's run store with the resolved documents (reopening it after a restart)."""
    from trainpilot.store import RunStore

    store = RunStore.create(run_dir, name=run_dir.name, world_size=layout.world_size,
                            info=dict(writer="trainpilot.runtime.worker", inject=job.inject),
                            flush_every_steps=50, flush_interval_s=1.0)
    store.set_document("model", model.to_dict())
    store.set_document("plan", plan.to_dict())
    store.set_document("train", config.to_dict())
    if cluster is not None:
        store.set_document("cluster", cluster.to_dict())
    store.set_document("job", dict(inject=job.inject, elastic=job.elastic,
                                   layout=layout.describe()))
    return store


def build_monitor(job: WorkerJob, *, store, model: ModelSpec, plan: Plan, config, cluster):
    """The HealthMonitor of this rank (None when ``--no-health``): every rank builds one fed
    the same global loss, so every rank takes the same decisions; only rank 0's writes."""
    if not job.health:
        return None
    from trainpilot.health.config import load_health_config
    from trainpilot.health.monitor import HealthMonitor
    from trainpilot.perf.flops import model_flops_per_token

    health_config = load_health_config(job.health_config) if job.health_config \
        else load_health_config()
    flops = model_flops_per_token(model, plan.seq_len) * plan.tokens_per_step
    peak = None
    if cluster is not None:
        peak = cluster.device.peak_tflops.get("bf16", 0.0) * 1e12 * plan.world_size or None
    from trainpilot.runtime.optim import WarmupCosine

    # The planned schedule (the LR of step s is lr x f(s - 1): the scheduler steps after each
    # update), so the convergence forecast knows where the LR decays.
    schedule = WarmupCosine(warmup_steps=config.warmup_steps, total_steps=config.steps,
                            min_ratio=config.min_lr_ratio)
    monitor = HealthMonitor(store=store, config=health_config, total_steps=config.steps,
                            flops_per_step=flops, peak_flops=peak,
                            lr_at=lambda step: config.lr * schedule(max(0, step - 1)))
    monitor.log_events = False  # the RunRecorder records the runtime's events
    return monitor


def build_checkpointer(job: WorkerJob, *, plan: Plan, run_dir: Path, faults, elastic):
    """The checkpointer of ``plan.checkpoint`` (None with ``--no-checkpoint``). A failed save
    is logged and training goes on (the next one may succeed: a disk that was full)."""
    if not job.checkpoint:
        return None
    from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer

    timeout = elastic.config.collective_timeout_s if elastic is not None else 600.0
    config = CheckpointConfig.from_policy(
        plan.checkpoint, run_dir / "checkpoints",
        on_write_error="warn", group_timeout_s=max(timeout, 60.0),
        drain_timeout_s=max(2.0 * timeout, 10.0))
    return Checkpointer(config, faults=faults)


class _Emitter:
    """Late-bound event target: the store and metrics writers are built before the Trainer
    whose ``emit`` announces their degradation."""

    def __init__(self) -> None:
        self.target: Any = None

    def __call__(self, kind: str, payload: dict[str, Any]) -> None:
        if self.target is not None:
            self.target(kind, payload)


def run_worker(job: WorkerJob, *, beacon: Beacon | None = None,
               guard: PreemptGuard | None = None) -> str:
    """Train this rank of ``job``; returns ``"completed"``, or ``"preempted"`` when a signal
    stopped the run after its last-moment checkpoint. Raises for everything else (the caller
    records why)."""
    import torch
    import torch.distributed as dist

    from trainpilot.runtime.callbacks import JsonlMetrics, RunRecorder
    from trainpilot.runtime.elastic import ElasticConfig
    from trainpilot.runtime.elastic.resize import plan_for_world
    from trainpilot.runtime.elastic.session import ElasticSession
    from trainpilot.runtime.faults import FaultInjector
    from trainpilot.runtime.layout import build_layout
    from trainpilot.runtime.trainer import Trainer

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, plan, config, cluster = job.model, job.plan, job.config, job.cluster
    run_dir = Path(job.run_dir)
    watch_dir = beacon.dir if beacon is not None else None
    session = ElasticSession(ElasticConfig(**job.elastic))
    session.start()
    store = checkpointer = None
    emit = _Emitter()
    try:
        plan = plan_for_world(plan, dist.get_world_size())  # elastic --nnodes=MIN:MAX
        layout = build_layout(plan, model=model)
        rank0 = layout.rank == 0
        if rank0:
            write_documents(run_dir, model=model, plan=plan, config=config, extra=dict(
                torch=torch.__version__, python=platform.python_version(),
                host=platform.node(), **layout.describe()))
        pred = _prediction(model, plan, layout, cluster, config, run_dir, session)
        if rank0 and pred.get("cluster") is not None:
            dump(pred["cluster"], run_dir / "cluster.yaml")
        if rank0:
            store = _open_store(run_dir, model=model, plan=plan, config=config,
                                cluster=pred.get("cluster"), layout=layout, job=job, emit=emit)
        faults = FaultInjector(job.inject, journal_path=run_dir / "faults.jsonl")
        checkpointer = build_checkpointer(job, plan=plan, run_dir=run_dir, faults=faults,
                                          elastic=session)
        monitor = build_monitor(job, store=store, model=model, plan=plan, config=config,
                                cluster=pred.get("cluster"))
        recorder = RunRecorder(store, rank=layout.rank, journal=faults,
                               monitor_logs_metrics=monitor is not None,
                               on_fault=(lambda rec: monitor.on_event("fault", rec))
                               if monitor is not None else None)
        metrics = JsonlMetrics(run_dir / "metrics.jsonl", rank=layout.rank, on_degraded=emit,
                               mirror=watch_dir / "stream.jsonl" if watch_dir else None)
        extra = [BeaconSteps(beacon)] if beacon is not None else []
        trainer = Trainer(model=model, plan=plan, config=config, layout=layout,
                          callbacks=[metrics, recorder, *extra, *load_callbacks(
                              job.callbacks, run_dir=run_dir, layout=layout)],
                          predicted_step_time_s=pred.get("predicted_step_time_s"),
                          cluster=cluster or pred.get("cluster"), checkpointer=checkpointer,
                          faults=faults, monitor=monitor, elastic=session, preempt=guard)
        emit.target = trainer.emit
        if rank0:
            # A preemption marker of an earlier attempt: this one trains on (torchrun's agent
            # also stops healthy workers with SIGTERM when the job's membership changes; they
            # save and stop like a preemption, and the next attempt resumes from it).
            from trainpilot.runtime.rundir import clear_preempted

            clear_preempted(run_dir)
        if "calibration" in pred:
            trainer.emit("calibration", dict(**pred["calibration"], note=pred["calibration_note"]))
        summary = trainer.fit()
        if trainer.stop_reason == "preempted":
            if trainer.layout.rank == 0:
                _write_preempted(run_dir, trainer, guard)
            if store is not None:
                store.close(status="preempted")
                store = None
            return "preempted"
        if trainer.layout.rank == 0:
            summary.update(
                layout=trainer.layout.describe(), autocast=trainer.autocast_note,
                prediction_note=pred.get("prediction_note"),
                calibration=pred.get("calibration"), data=_data_info(trainer.dataset),
                faults_fired=len(faults.fired()),
                checkpoint_errors=len(checkpointer.errors) if checkpointer else 0)
            if store is not None:
                summary.update(_whole_run(store))
            _write_summary(run_dir, watch_dir, summary)
        if store is not None:
            store.close(status="completed")
            store = None
        return "completed"
    finally:
        if checkpointer is not None:
            checkpointer.close()
        if store is not None:
            store.close(status="failed")
        session.close()
        if dist.is_initialized():
            dist.destroy_process_group()


class BeaconSteps(Callback):
    """Tells the node's watchdog which step this rank finished."""

    def __init__(self, beacon: Beacon):
        self.beacon = beacon

    def on_step_end(self, trainer, record) -> None:
        self.beacon.update(step=record.step)


def _open_store(run_dir: Path, *, emit: _Emitter, **kwargs: Any):
    """Rank 0's run store, wrapped so that a full disk degrades it instead of ending the run;
    None (with a warning) when it cannot even be opened."""
    from trainpilot.runtime.degrade import TolerantStore, describe_disk, disk_of, is_disk_error

    try:
        store = open_store(run_dir, **kwargs)
    except Exception as err:  # noqa: BLE001 - judged below
        if not is_disk_error(err):
            raise
        print(f"warning: the run store cannot be opened ({err}): "
              f"{describe_disk(disk_of(run_dir))}; this attempt runs without it",
              file=sys.stderr)
        return None
    return TolerantStore(store, on_degraded=emit)


def _write_summary(run_dir: Path, watch_dir: Path | None, summary: dict[str, Any]) -> None:
    """``summary.json`` in the run directory; also in the node-local watch folder, where the
    launcher reads it when the run's disk is full."""
    text = json.dumps(summary, indent=2) + "\n"
    if watch_dir is not None:
        atomic_write_text(watch_dir / "summary.json", text)
    try:
        atomic_write_text(run_dir / "summary.json", text)
    except OSError as err:
        print(f"warning: summary.json not written ({err.strerror})", file=sys.stderr)


def _write_preempted(run_dir: Path, trainer, guard: PreemptGuard | None) -> None:
    from trainpilot.runtime.rundir import PREEMPTED

    name = getattr(trainer, "preempt_signal", "") or (guard.signal_name if guard else "")
    code = 128 + int(getattr(signal, name, signal.SIGTERM)) if name else 143
    body = dict(step=trainer.step, signal=name or None, exit_code=code, time_unix_s=time.time(),
                checkpoint=trainer.preempt_checkpoint)
    atomic_write_text(run_dir / PREEMPTED, json.dumps(body) + "\n")


def _prediction(model, plan, layout, cluster, config, run_dir: Path, session,
                ) -> dict[str, Any]:
    """The predicted step time (``{}`` with ``--no-predict``). A replacement process reads the
    cluster its peers calibrated (``cluster.yaml``) instead of measuring: calibration is a
    collective its peers, busy recovering, do not run again."""
    from trainpilot.specs import load_cluster

    if not config.predict:
        return {}
    if session.is_replacement:
        saved = run_dir / "cluster.yaml"
        known = cluster or (load_cluster(str(saved)) if saved.is_file() else None)
        return predict(model, plan, layout, known, calibrate_now=False)
    return predict(model, plan, layout, cluster)


def _whole_run(store) -> dict[str, Any]:
    """What the summary of a restarted process cannot know by itself: the first loss of the
    run (before any restart) and every recovery, from the run store."""
    store.flush()
    steps, losses = store.series("loss")
    out: dict[str, Any] = {}
    if steps and steps[0] == 1:
        out["first_loss"] = losses[0]
    out["recoveries"] = [dict(e.payload, time_unix_s=e.time)
                         for e in store.events(kinds=["recovered"])]
    out["faults"] = [e.payload for e in store.events(kinds=["fault"])]
    return out


def load_callbacks(refs: list[str], *, run_dir: Path, layout) -> list:
    """Instantiate ``"package.module:factory"`` references; each factory is called as
    ``factory(run_dir=..., layout=...)`` and returns a Callback (how a user's own observer
    attaches to a ``trainpilot train`` run)."""
    import importlib

    out = []
    for ref in refs:
        module_name, sep, attr = ref.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr) if sep else None
        except (ImportError, AttributeError):
            factory = None
        if factory is None:
            raise SpecError("--callback", ref, "not an importable 'package.module:factory'")
        out.append(factory(run_dir=run_dir, layout=layout))
    return out


def _data_info(dataset) -> dict[str, Any]:
    info: dict[str, Any] = dict(kind=type(dataset).__name__, num_samples=dataset.num_samples)
    if hasattr(dataset, "entropy_rate_nats"):
        info.update(entropy_rate_nats=dataset.entropy_rate_nats,
                    uniform_loss_nats=dataset.uniform_loss_nats)
    return info


def main(argv: list[str] | None = None) -> int:
    from trainpilot.runtime.checkpoint.restore import TemplateMismatch
    from trainpilot.runtime.degrade import QuietStream
    from trainpilot.runtime.preempt import Preempted
    from trainpilot.runtime.watchdog import die_with_launcher

    parser = argparse.ArgumentParser(prog="trainpilot.runtime.worker")
    parser.add_argument("--job-file", required=True, help="the run's job.json")
    args = parser.parse_args(argv)
    sys.stdout, sys.stderr = QuietStream(sys.stdout), QuietStream(sys.stderr)
    die_with_launcher()
    beacon = Beacon(int(os.environ.get("RANK", "0"))).start()
    try:
        job = read_job(args.job_file)
        guard = PreemptGuard(job.preempt_signals, deadline_s=job.preempt_deadline_s,
                             on_exit=beacon.record_exit).install()
        if "USR1" not in job.preempt_signals:
            # `kill -USR1 <pid>` prints every thread's stack to the worker's stderr: what a
            # hang diagnosis needs first, without stopping the process.
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        outcome = run_worker(job, beacon=beacon, guard=guard)
    except (SpecError, TemplateMismatch) as err:
        line = str(err) if isinstance(err, SpecError) else (
            f"the checkpoint does not match this job's model or layout: {err}")
        print(f"error: {line}", file=sys.stderr)
        beacon.record_exit(2, "bad_input", line)
        return 2
    except Preempted as err:
        beacon.record_exit(guard.exit_code, "terminated", str(err))
        return guard.exit_code
    except BaseException as err:
        first = (str(err).strip().splitlines() or [""])[0][:300]
        beacon.record_exit(1, _failure_reason(err), f"{type(err).__name__}: {first}")
        raise
    beacon.record_exit(0, outcome)
    return 0


def _failure_reason(err: BaseException) -> str:
    from trainpilot.runtime.elastic.retry import is_recoverable

    return "peer_failed" if is_recoverable(err) else "failed"


if __name__ == "__main__":
    from trainpilot.runtime.procexit import run_and_end

    run_and_end(main)
