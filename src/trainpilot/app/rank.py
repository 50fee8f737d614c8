"""One rank of a job, built from its job document: the composition root.

:func:`build_rank` joins the job's process group through an elastic session (a generation over
the job's store), builds the layout (the plan fitted to the world size torchrun gave it), lets
rank 0 write the resolved documents into the run directory (atomically) and open the run store,
calibrates the cost model on CPU, and builds the checkpointer (``plan.checkpoint``), the fault
injector (``--inject``), the health monitor and the Trainer with in-process recovery wired in.
:func:`run_rank` trains it: per-step records stream to ``metrics.jsonl`` (and the launcher's
node-local stream); ``summary.json`` ends the run, ``preempted.json`` a preempted one.

Callers other than ``trainpilot train`` (the recovery drills, tests) change what they must
through :class:`RankHooks` (a model of their own, a recording dataset, extra callbacks, a
negative-control subclass) and get everything else exactly as ``trainpilot train`` builds it.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainpilot.fsio import atomic_write_text
from trainpilot.runtime.callbacks import Callback
from trainpilot.runtime.preempt import PreemptGuard
from trainpilot.runtime.watchdog import Beacon
from trainpilot.runtime.workerjob import WorkerJob
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError, dump


def write_documents(run_dir: Path, *, model: ModelSpec | None, plan: Plan, config,
                    extra: dict) -> None:
    """The resolved model, plan and training config, plus the environment (rank 0 only). A
    disk that refuses them costs a warning, not the run."""
    from trainpilot.runtime.degrade import is_disk_error

    try:
        if model is not None:
            dump(model, run_dir / "model.yaml")
        dump(plan, run_dir / "plan.yaml")
        dump(config, run_dir / "train.yaml")
        atomic_write_text(run_dir / "env.json", json.dumps(extra, indent=2) + "\n")
    except OSError as err:
        if not is_disk_error(err):
            raise
        print(f"warning: the run's documents were not written ({err})", file=sys.stderr)


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
                            info=dict(writer="trainpilot.app.rank", inject=job.inject),
                            flush_every_steps=50, flush_interval_s=1.0)
    if model is not None:
        store.set_document("model", model.to_dict())
    store.set_document("plan", plan.to_dict())
    store.set_document("train", config.to_dict())
    if cluster is not None:
        store.set_document("cluster", cluster.to_dict())
    store.set_document("job", dict(inject=job.inject, elastic=job.elastic,
                                   layout=layout.describe()))
    return store


def build_monitor(job: WorkerJob, *, store, model: ModelSpec | None, plan: Plan, config,
                  cluster):
    """The HealthMonitor of this rank (None when ``--no-health``): every rank builds one fed
    the same global loss, so every rank takes the same decisions; only rank 0's writes."""
    if not job.health:
        return None
    from trainpilot.health.config import load_health_config
    from trainpilot.health.monitor import HealthMonitor
    from trainpilot.perf.flops import model_flops_per_token

    health_config = load_health_config(job.health_config) if job.health_config \
        else load_health_config()
    flops = (model_flops_per_token(model, plan.seq_len) * plan.tokens_per_step
             if model is not None else None)
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


def build_checkpointer(job: WorkerJob, *, plan: Plan, run_dir: Path, faults, elastic,
                       cls: type | None = None, watch_dir: Path | None = None):
    """The checkpointer of ``plan.checkpoint`` (None with ``--no-checkpoint``). A failed save
    is logged and training goes on (the next one may succeed: a disk that was full). On a
    multi-node job its snapshots are also kept in the node's RAM under the launcher's
    ``watch_dir``, so that a restarted worker still holds them (``checkpoint/nodemem.py``)."""
    if not job.checkpoint:
        return None
    from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer
    from trainpilot.runtime.checkpoint.nodemem import node_memory_dir_for

    timeout = elastic.config.collective_timeout_s if elastic is not None else 600.0
    node_memory = node_memory_dir_for(watch_dir) if plan.checkpoint.in_memory_peer else None
    config = CheckpointConfig.from_policy(
        plan.checkpoint, run_dir / "checkpoints",
        on_write_error="warn", group_timeout_s=max(timeout, 60.0),
        drain_timeout_s=max(2.0 * timeout, 10.0), node_memory_dir=node_memory)
    return (cls or Checkpointer)(config, faults=faults)


class _Emitter:
    """Late-bound event target: the store and metrics writers are built before the Trainer
    whose ``emit`` announces their degradation."""

    def __init__(self) -> None:
        self.target: Any = None

    def __call__(self, kind: str, payload: dict[str, Any]) -> None:
        if self.target is not None:
            self.target(kind, payload)


@dataclass(kw_only=True)
class RankHooks:
    """What a caller other than ``trainpilot train`` may change in a rank; everything else is
    built exactly as ``trainpilot train`` builds it.

    ``model_factory``: a user's own ``nn.Module`` (tokens -> logits) instead of ``job.model``
    (which is then None). ``dataset``: instead of the one ``job.config.data`` names.
    ``wrap_dataset(dataset, rank)``: e.g. record what each step reads. ``callbacks(rank)``:
    extra callbacks, built once the session and layout exist. ``trainer_cls`` /
    ``checkpointer_cls``: subclasses (the oracle's negative controls)."""

    model_factory: Callable[[], Any] | None = None
    dataset: Any = None
    wrap_dataset: Callable[[Any, Rank], Any] | None = None
    callbacks: Callable[[Rank], list] | None = None
    trainer_cls: type | None = None
    checkpointer_cls: type | None = None


@dataclass(kw_only=True)
class Rank:
    """The pieces of one rank (built by :func:`build_rank`; :meth:`close` releases them)."""

    job: WorkerJob
    run_dir: Path
    session: Any
    plan: Plan
    layout: Any = None
    store: Any = None
    faults: Any = None
    checkpointer: Any = None
    monitor: Any = None
    trainer: Any = None
    prediction: dict[str, Any] = field(default_factory=dict)
    watch_dir: Path | None = None

    @property
    def rank(self) -> int:
        return self.session.rank

    def close(self, status: str = "failed") -> None:
        """Close the store (with ``status`` unless already closed), the checkpointer, the
        session and the process group. Safe to call twice."""
        import torch.distributed as dist

        if self.checkpointer is not None:
            self.checkpointer.close()
            self.checkpointer = None
        if self.store is not None:
            self.store.close(status=status)
            self.store = None
        self.session.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def build_rank(job: WorkerJob, *, hooks: RankHooks | None = None, beacon: Beacon | None = None,
               guard: PreemptGuard | None = None) -> Rank:
    """Join the job and build this rank's pieces (collective with the other ranks)."""
    import torch
    import torch.distributed as dist

    from trainpilot.runtime.callbacks import JsonlMetrics, RunRecorder
    from trainpilot.runtime.elastic import ElasticConfig
    from trainpilot.runtime.elastic.resize import plan_for_world
    from trainpilot.runtime.elastic.session import ElasticSession
    from trainpilot.runtime.faults import FaultInjector
    from trainpilot.runtime.layout import build_layout
    from trainpilot.runtime.trainer import Trainer, make_dataset

    hooks = hooks or RankHooks()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, config, cluster = job.model, job.config, job.cluster
    factory = hooks.model_factory
    if job.hf_config is not None and factory is None:
        from trainpilot.runtime.hf_parallel import HFModel

        # A Hugging Face model: transformers builds it, the plan parallelizes it; the
        # ModelSpec (job.model) stays for the cost model and the monitor.
        factory = HFModel(job.hf_config, weights=job.hf_weights, seed=config.seed)
    run_dir = Path(job.run_dir)
    session = ElasticSession(ElasticConfig(**job.elastic))
    session.start()
    part = Rank(job=job, run_dir=run_dir, session=session, plan=job.plan,
                watch_dir=beacon.dir if beacon is not None else None)
    emit = _Emitter()
    try:
        plan = part.plan = plan_for_world(job.plan, dist.get_world_size())  # --nnodes=MIN:MAX
        if factory is not None and hasattr(factory, "check"):
            factory.check(plan)
        layout = part.layout = build_layout(
            plan, model=model if factory is None else None,
            custom_model=factory is not None and not hasattr(factory, "parallelize"))
        rank0 = layout.rank == 0
        if rank0:
            write_documents(run_dir, model=model, plan=plan, config=config, extra=dict(
                torch=torch.__version__, python=platform.python_version(),
                host=platform.node(), **layout.describe()))
        pred = part.prediction = _prediction(model, plan, layout, cluster, config, run_dir,
                                             session)
        if rank0 and pred.get("cluster") is not None:
            dump(pred["cluster"], run_dir / "cluster.yaml")
        if rank0 and job.hf_config is not None:  # what export-weights --to hf reads back
            atomic_write_text(run_dir / "hf_config.json", json.dumps(job.hf_config, indent=1))
        if rank0:
            part.store = _open_store(run_dir, model=model, plan=plan, config=config,
                                     cluster=pred.get("cluster"), layout=layout, job=job,
                                     emit=emit)
            if part.store is not None and job.export_metrics:
                from trainpilot.store.exporters import export_metrics

                export_metrics(getattr(part.store, "inner", part.store), job.export_metrics)
        part.faults = FaultInjector(job.inject, journal_path=run_dir / "faults.jsonl")
        part.checkpointer = build_checkpointer(job, plan=plan, run_dir=run_dir,
                                               faults=part.faults, elastic=session,
                                               cls=hooks.checkpointer_cls,
                                               watch_dir=part.watch_dir)
        monitor = part.monitor = build_monitor(job, store=part.store, model=model, plan=plan,
                                               config=config, cluster=pred.get("cluster"))
        recorder = RunRecorder(part.store, rank=layout.rank, journal=part.faults,
                               monitor_logs_metrics=monitor is not None,
                               on_fault=(lambda rec: monitor.on_event("fault", rec))
                               if monitor is not None else None)
        metrics = JsonlMetrics(run_dir / "metrics.jsonl", rank=layout.rank, on_degraded=emit,
                               mirror=part.watch_dir / "stream.jsonl" if part.watch_dir else None)
        extra = [BeaconSteps(beacon)] if beacon is not None else []
        extra += hooks.callbacks(part) if hooks.callbacks is not None else []
        dataset = hooks.dataset if hooks.dataset is not None else make_dataset(config, model,
                                                                                plan)
        if hooks.wrap_dataset is not None:
            dataset = hooks.wrap_dataset(dataset, part)
        cls = hooks.trainer_cls or Trainer
        part.trainer = cls(model=model if factory is None else None, model_factory=factory,
                           plan=plan,
                           config=config, layout=layout, dataset=dataset,
                           callbacks=[metrics, recorder, *extra, *load_callbacks(
                               job.callbacks, run_dir=run_dir, layout=layout)],
                           predicted_step_time_s=pred.get("predicted_step_time_s"),
                           cluster=cluster or pred.get("cluster"),
                           checkpointer=part.checkpointer, faults=part.faults, monitor=monitor,
                           elastic=session, preempt=guard)
        emit.target = part.trainer.emit
        if rank0 and session is not None and _multi_node():
            part.trainer.drain_requested = DrainCheck(part.trainer, run_dir)
        if rank0:
            # A preemption marker of an earlier attempt: this one trains on (torchrun's agent
            # also stops healthy workers with SIGTERM when the job's membership changes; they
            # save and stop like a preemption, and the next attempt resumes from it).
            from trainpilot.runtime.rundir import clear_preempted

            clear_preempted(run_dir)
        if "calibration" in pred:
            part.trainer.emit("calibration", dict(**pred["calibration"],
                                                  note=pred["calibration_note"]))
        return part
    except BaseException:
        part.close()
        raise


def run_rank(job: WorkerJob, *, hooks: RankHooks | None = None, beacon: Beacon | None = None,
             guard: PreemptGuard | None = None) -> str:
    """Build this rank and train it to the end; returns ``"completed"``, or ``"preempted"``
    when a signal stopped the run after its last-moment checkpoint. Raises for everything else
    (the caller records why)."""
    part = build_rank(job, hooks=hooks, beacon=beacon, guard=guard)
    try:
        outcome = finish(part, part.trainer.fit(), guard=guard)
        part.close(status=outcome)
        return outcome
    finally:
        part.close()


def finish(part: Rank, summary: dict[str, Any], *, guard: PreemptGuard | None = None) -> str:
    """After ``fit``: rank 0 writes ``summary.json`` (or ``preempted.json``); returns the
    outcome."""
    trainer = part.trainer
    if trainer.stop_reason == "drain":
        return _leave_or_stay(part)
    if trainer.stop_reason == "preempted":
        if trainer.layout.rank == 0:
            _write_preempted(part.run_dir, trainer, guard)
        return "preempted"
    if trainer.layout.rank == 0:
        summary.update(
            layout=trainer.layout.describe(), autocast=trainer.autocast_note,
            prediction_note=part.prediction.get("prediction_note"),
            calibration=part.prediction.get("calibration"), data=_data_info(trainer.dataset),
            faults_fired=len(part.faults.fired()),
            checkpoint_errors=len(part.checkpointer.errors) if part.checkpointer else 0)
        if part.store is not None:
            summary.update(_whole_run(part.store))
        _write_summary(part.run_dir, part.watch_dir, summary)
    return "completed"


def _multi_node() -> bool:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))


class DrainCheck:
    """Rank 0's look for a drain request (``runtime.drain``), at most once a second; a request
    for a host none of the job's ranks runs on is recorded as done and ignored."""

    def __init__(self, trainer, run_dir: Path):
        from trainpilot.runtime.drain import DrainWatch

        self.trainer, self.run_dir, self.watch = trainer, run_dir, DrainWatch(run_dir)

    def __call__(self) -> bool:
        from trainpilot.runtime.drain import mark_done, read_request
        from trainpilot.runtime.elastic.rendezvous import host_name

        if not self.watch():
            return False
        request = read_request(self.run_dir)
        if request is None:
            return False
        heartbeat = getattr(self.trainer.elastic, "heartbeat", None)
        hosts = {host_name()} | {v.info.get("host") for v in
                                 (heartbeat.peers.values() if heartbeat is not None else ())}
        if request["host"] in hosts:
            return True
        mark_done(self.run_dir, dict(request, note="no rank of the job runs on that host"),
                  step=self.trainer.step, ranks=[])
        return False


def _leave_or_stay(part: Rank) -> str:
    """After a drain's step is saved: ``"drained"`` for the ranks on the drained host (they
    leave), ``"drain_peer"`` for the others (they exit so that torchrun re-forms the job)."""
    from trainpilot.runtime.drain import mark_done, read_request
    from trainpilot.runtime.elastic.rendezvous import host_name

    trainer, ckpt = part.trainer, part.trainer.checkpointer
    rank0 = trainer.layout.rank == 0
    if ckpt is None:  # no group of our own to agree on: every rank reads the shared file
        request = read_request(part.run_dir)
        host = request["host"] if request else ""
        mine = [host_name() == host]
    else:
        request = read_request(part.run_dir) if rank0 else None
        host = next(h for h in ckpt.group.all_gather(request["host"] if request else "") if h)
        mine = ckpt.group.all_gather(host_name() == host)
    if rank0 and request is not None:
        mark_done(part.run_dir, request, step=trainer.step,
                  ranks=[r for r, drained in enumerate(mine) if drained])
    return "drained" if host_name() == host else "drain_peer"


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

    if not config.predict or model is None:  # a user's own module: nothing to price
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
