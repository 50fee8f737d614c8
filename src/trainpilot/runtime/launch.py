"""Start a training job under torchrun, in-process.

The launcher reuses ``torch.distributed.run``'s own argument parser (``--nnodes``,
``--nproc-per-node``, ``--rdzv-*``, ``--max-restarts``, ...) and calls
``torch.distributed.run.run`` with the worker module :mod:`trainpilot.app.worker`; multi-node
is torchrun's c10d rendezvous. A single-node job with no rendezvous options runs standalone
(torchrun picks a free port). A thread tails the run's ``metrics.jsonl`` to show progress.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from trainpilot.runtime.rundir import PREEMPTED, check_usable, clear_preempted, decide, inspect
from trainpilot.runtime.watchdog import (
    ENV_DIR,
    ENV_LAUNCHER,
    AgentExitReports,
    Observation,
    Watchdog,
    journal_lost_launch,
    launches_elsewhere,
    log_launch,
    signal_name,
    watch_dir_for,
)
from trainpilot.runtime.workerjob import WorkerJob
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError

# torchrun restarts of the whole group after a rank dies, unless the user says otherwise.
DEFAULT_MAX_RESTARTS = 3
# How often torchrun's agent polls its workers (torchrun's own default: 0.1 s). The watchdog
# reads each worker's exit status the moment it ends; an agent that reaps the process first
# leaves only the first failure in its log, so a second rank dying with it would be journaled
# without its signal. Polling less often gives the watchdog that moment; restarts start up to
# 0.4 s later.
DEFAULT_MONITOR_INTERVAL_S = 0.5

# torchrun options that do not apply: we always start our own worker module.
_NOT_FORWARDED = {"help", "module", "no_python", "run_path", "training_script",
                  "training_script_args"}
WORKER_MODULE = "trainpilot.app.worker"  # the composition root (a module name only)


def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def add_torchrun_arguments(parser: argparse.ArgumentParser) -> None:
    """Copy torchrun's own options onto ``parser`` (one group), not re-declaring them."""
    group = parser.add_argument_group("torchrun options (torch.distributed.run's own parser)")
    for action in torchrun_parser()._actions:
        if action.dest not in _NOT_FORWARDED and action.option_strings:
            action = copy.copy(action)
            if action.dest == "nproc_per_node":
                # Unset means "the plan's size on one node" rather than torchrun's 1.
                action.default = os.environ.get("PET_NPROC_PER_NODE")
                action.help = (action.help or "") + " (trainpilot default: the plan's " \
                    "dp*tp*pp*cp on a single node)"
            elif action.dest == "max_restarts":
                # Unset means trainpilot's default (fault tolerance on), not torchrun's 0.
                action.default = os.environ.get("PET_MAX_RESTARTS")
                action.help = (f"Maximum number of worker group restarts before failing "
                               f"(trainpilot default: {DEFAULT_MAX_RESTARTS}; 0 or "
                               "--no-recovery: none).")
            elif action.dest == "monitor_interval":
                action.default = float(os.environ.get("PET_MONITOR_INTERVAL",
                                                      DEFAULT_MONITOR_INTERVAL_S))
                action.help = (f"{action.help} (trainpilot default: "
                               f"{DEFAULT_MONITOR_INTERVAL_S} s)")
            group._add_action(action)


def torchrun_namespace(options: argparse.Namespace | dict | None, worker_args: list[str],
                       ) -> argparse.Namespace:
    """torchrun's namespace for running our worker with ``worker_args``; values in ``options``
    (a namespace parsed by a parser extended with :func:`add_torchrun_arguments`, or a dict of
    torchrun dests) override torchrun's defaults."""
    parser = torchrun_parser()
    args = parser.parse_args(["-m", WORKER_MODULE, *worker_args])
    defaults = vars(parser.parse_args(["-m", WORKER_MODULE]))
    given = vars(options) if isinstance(options, argparse.Namespace) else dict(options or {})
    for dest in defaults:
        if dest in given and dest not in _NOT_FORWARDED:
            setattr(args, dest, given[dest])
    if "monitor_interval" not in given and "PET_MONITOR_INTERVAL" not in os.environ:
        args.monitor_interval = DEFAULT_MONITOR_INTERVAL_S
    user_rdzv = any(getattr(args, d) != defaults[d] for d in
                    ("rdzv_endpoint", "master_addr", "master_port", "rdzv_backend", "nnodes"))
    if not user_rdzv and not args.standalone:
        args.standalone = True  # single node: torchrun's own free-port rendezvous
    return args


def _nproc(args: argparse.Namespace) -> int | None:
    try:
        return int(args.nproc_per_node)
    except (TypeError, ValueError):
        return None  # "auto", "gpu", ...: torchrun resolves it


def _nnodes(args: argparse.Namespace) -> int | None:
    """Fixed node count ("2" or "2:2"); None for an elastic range ("1:4")."""
    low, _, high = str(args.nnodes).partition(":")
    if low.isdigit() and (not high or high == low):
        return int(low)
    return None


def prepare(*, model: ModelSpec, plan: Plan, options: argparse.Namespace | dict | None,
            job: WorkerJob) -> argparse.Namespace:
    """Check the plan against the launch (processes, backend) and build torchrun's namespace.
    Raises SpecError before anything starts. ``--nproc-per-node`` defaults to the plan's size
    on one node."""
    from trainpilot.runtime.layout import check_runtime, default_backend

    args = torchrun_namespace(options, ["--job-file", str(job.path())])
    nnodes = _nnodes(args)
    if args.nproc_per_node is None:
        args.nproc_per_node = str(plan.world_size) if nnodes == 1 else "1"
    nproc = _nproc(args)
    world = nproc * nnodes if nproc is not None and nnodes is not None else None
    # A model transformers builds is checked by its factory (HFModel.check below), not
    # against the reference GPT's feature list.
    check_runtime(model if job.hf_config is None else None, plan, backend=default_backend(),
                  world_size=world)
    if job.config.data != "markov":
        from trainpilot.runtime.trainer import make_dataset

        # Open it here too: a missing or malformed file is bad input, not a failed run.
        make_dataset(job.config, model, plan)
    if job.hf_config is not None:
        from trainpilot.runtime.hf_parallel import HFModel

        HFModel(job.hf_config, weights=job.hf_weights).check(plan)
    return args


class WorkerBadInput(SpecError):
    """Bad input only a worker could see (e.g. every checkpoint fails its checksums): its
    one-line error, exit 2."""

    def __init__(self, line: str):
        self.field, self.value, self.valid, self.source = "worker", None, line, None
        ValueError.__init__(self, line)


class TrainingFailed(RuntimeError):
    """The run failed (its message is the final line: which rank, which fault)."""


class RunPreempted(RuntimeError):
    """The run stopped on a preemption signal after its last-moment checkpoint (or without
    one, past the deadline). ``exit_code`` is ``128 + signal``."""

    def __init__(self, message: str, exit_code: int, step: int | None):
        super().__init__(message)
        self.exit_code, self.step = exit_code, step


def launch(*, model: ModelSpec, plan: Plan, config, run_dir: str | os.PathLike,
           options: argparse.Namespace | dict | None = None, cluster: ClusterSpec | None = None,
           callbacks: Sequence[str] = (), on_record: Callable[[dict], None] | None = None,
           inject: str | None = None, elastic: dict[str, Any] | None = None,
           health: bool = True, health_config: str | None = None, checkpoint: bool = True,
           resume: str = "auto", recovery: bool = True, memory_check: bool = True,
           preempt_signals: tuple[str, ...] = ("TERM",), preempt_deadline_s: float = 20.0,
           on_note: Callable[[str], None] | None = None,
           on_launch: Callable[[], None] | None = None,
           hf_config: dict[str, Any] | None = None, hf_weights: str | None = None,
           export_metrics: str | None = None) -> dict[str, Any]:
    """Train under torchrun; returns the run's summary (rank 0's ``summary.json``).

    ``resume``: ``auto`` (continue an existing run from its newest valid checkpoint), ``never``
    (start over; the old run is moved to ``RUN_DIR/previous/``) or a checkpoint step.
    ``recovery`` (default on): torchrun restarts the group after a rank dies (3 times unless
    ``--max-restarts`` says otherwise) and failures that leave every process alive are
    recovered in process; off: the first fault fails the run. ``on_record`` is called in this
    process with each record rank 0 streams (steps and events, e.g. for a progress bar),
    ``on_note`` with each line worth telling the user (where the run resumes from, a full
    disk), ``on_launch`` once just before the processes start. ``inject``: faults to inject (``--inject``: see :mod:`trainpilot.runtime.faults`;
    ``chaos:...`` expands to a seeded schedule). Raises SpecError for bad input (before
    anything starts), TrainingFailed when the run fails and RunPreempted when a signal stopped
    it.
    """
    note = on_note or (lambda line: None)
    run_dir = Path(run_dir).resolve()
    inject = _check_options(inject, elastic, callbacks, config=config, plan=plan)
    elastic = dict(elastic or {})
    if not recovery:
        elastic.setdefault("recovery", "restart")
    check_usable(run_dir)
    job = WorkerJob(model=model, plan=plan, config=config, cluster=cluster, run_dir=str(run_dir),
                    callbacks=list(callbacks), inject=inject, elastic=elastic, health=health,
                    health_config=health_config, checkpoint=checkpoint,
                    preempt_signals=list(preempt_signals), preempt_deadline_s=preempt_deadline_s,
                    hf_config=hf_config, hf_weights=hf_weights, export_metrics=export_metrics)
    args = prepare(model=model, plan=plan, options=options, job=job)
    if memory_check:
        from trainpilot.runtime.memfit import check_memory, require_fit

        nproc = _nproc(args) or 1
        require_fit(check_memory(model, plan, cluster=cluster, ranks_on_node=nproc,
                                 device_type=_device_type()))
    if not args.standalone and resume != "auto":
        raise SpecError("--resume", resume, "a multi-node job resumes with auto only (every "
                        "node's launcher reads the same run directory)")
    decision = decide(inspect(run_dir), resume, job.to_dict())
    run_dir.mkdir(parents=True, exist_ok=True)
    joining = [] if args.standalone else launches_elsewhere(run_dir)
    if joining:  # another host's launcher already decided where this job starts
        decision.notes = [f"joining the job launched on {', '.join(joining)}"]
    for line in decision.notes:
        note(line)
    if decision.complete:
        return dict(json.loads((run_dir / "summary.json").read_text()), already_complete=True)
    clear_preempted(run_dir)
    journal_lost_launch(run_dir)
    _apply_defaults(args, run_dir, recovery=recovery, options=options)
    job.write()
    return _supervise(args, run_dir, elastic=elastic, signals=preempt_signals,
                      on_record=on_record, note=note if on_note else None, on_launch=on_launch)


def _supervise(args: argparse.Namespace, run_dir: Path, *, elastic: dict[str, Any],
               signals: tuple[str, ...], on_record: Callable[[dict], None] | None,
               note: Callable[[str], None] | None, on_launch: Callable[[], None] | None,
               ) -> dict[str, Any]:
    """Run torchrun with the watchdog and the stream tail around it; the launch's start and
    end are recorded in ``launcher.jsonl`` (a launch with no end was killed)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run as torchrun

    watch = watch_dir_for(os.getpid())
    env = _worker_env(args, watch, signals)
    on_end = _OnWorkerEnd(run_dir, watch, local_ranks=_nproc(args) or 1)
    dog = Watchdog(watch, run_dir=run_dir, on_observation=on_end,
                   timeout_s=float(elastic.get("heartbeat_timeout_s", 3.0))).start()
    tail = _Tail([watch / "stream.jsonl", run_dir / "metrics.jsonl"], on_record, note) \
        if (on_record or note) else None
    log_launch(run_dir, "launch_start")
    probe = on_end.probe = _start_link_probe(args, run_dir, elastic, watch)
    outcome = "failed"
    failure: BaseException | None = None
    left = ""  # why this host's agent ended without running the job to its end
    if on_launch is not None:
        on_launch()
    try:
        try:
            with _environ(env), _agent_logs_to(run_dir / "logs" / "launcher.log",
                                               AgentExitReports(dog)), _on_sigchld(dog):
                torchrun(args)
        except (ChildFailedError, SignalException) as err:
            failure = err
        except AttributeError as err:
            # torch 2.13's launch_agent reads ``result.is_failed()`` of an agent whose run
            # ended without a result: a standby node (torchrun's redundancy list) whose job
            # finished without needing it. The job's outcome is the run directory's.
            if "is_failed" not in str(err):
                raise
            left = "a standby the job finished without"
        except RendezvousError as err:
            # This host lost the rendezvous (its store's host finished, or a partition cut it
            # off): the job may have gone on, or finished, without it.
            left = f"the rendezvous is gone from here ({_first_line(err)})"
        finally:
            dog.stop()
            if tail:
                tail.stop()
            if probe is not None:
                probe.stop()
        if left and (drained := _drained_here(run_dir)) is not None:
            # The drained ranks' exit records reached the watchdog only after torchrun's agent
            # had gone on to wait at its exit barrier (seen under load): the same departure.
            summary = dict(_read_json(run_dir / "summary.json") or {}, drained=drained,
                           left_job=_DRAINED_LINE.format(step=drained.get("step")))
            outcome = "drained"
            return summary
        if left:
            summary = _left_job(run_dir, left, args)
            outcome = "left"
            return summary
        summary = _outcome(run_dir, watch, dog, failure, args)
        outcome = "completed"
        return summary
    except RunPreempted:
        outcome = "preempted"
        raise
    except SpecError:
        outcome = "bad_input"
        raise
    finally:
        log_launch(run_dir, "launch_end", outcome=outcome)
        shutil.rmtree(watch, ignore_errors=True)


def _start_link_probe(args: argparse.Namespace, run_dir: Path, elastic: dict[str, Any],
                      watch: Path) -> _ProbeProcess | None:
    """The host's link probe (``runtime.elastic.linkprobe``, its own process) for a multi-node
    job that asks for one (``elastic.link_probe_s``), else None."""
    interval = elastic.get("link_probe_s")
    if args.standalone or not interval:
        return None
    import socket

    from trainpilot.runtime.elastic.rendezvous import host_name

    host = host_name()
    try:
        address = getattr(args, "local_addr", None) or socket.gethostbyname(host)
    except OSError as err:
        log_launch(run_dir, "link_probe_off", why=f"cannot resolve {host!r} ({err}): give "
                   "--local-addr")
        return None
    drain = "off"
    if elastic.get("drain_slow_links"):
        drain = "refused" if _holds_rendezvous(args, address) else "on"
    cmd = [sys.executable, "-m", "trainpilot.runtime.elastic.linkprobe", "--run-dir",
           str(run_dir), "--host", host, "--address", address, "--interval", str(interval),
           "--ratio", str(elastic.get("slow_link_ratio", 0.5)),
           "--rounds", str(elastic.get("slow_link_rounds", 3)), "--drain", drain,
           "--watch", str(watch), "--parent", str(os.getpid())]
    return _ProbeProcess(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))


class _ProbeProcess:
    """The link probe's process: stopped (SIGTERM, then SIGKILL) when the launch ends."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _holds_rendezvous(args: argparse.Namespace, address: str) -> bool:
    """Whether this host serves the c10d rendezvous (``--rdzv-endpoint`` names it)."""
    import socket

    endpoint = str(getattr(args, "rdzv_endpoint", "") or "")
    head = endpoint.rsplit(":", 1)[0].strip("[]") if endpoint else ""
    if not head:
        return False
    try:
        return socket.gethostbyname(head) in (address, "127.0.0.1")
    except OSError:
        return False


@contextlib.contextmanager
def _on_sigchld(dog: Watchdog):
    """``dog.peek_children`` on SIGCHLD while torchrun runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGCHLD, dog.peek_children)
    signal.siginterrupt(signal.SIGCHLD, False)  # system calls restart (the agent's store I/O)
    try:
        yield
    finally:
        signal.signal(signal.SIGCHLD, previous)


_DRAINED_LINE = ("this host was drained after step {step}: its ranks saved that step and left; "
                 "the job goes on without it")


def _drained_here(run_dir: Path) -> dict[str, Any] | None:
    """The drain record (``runtime.drain``) when it names this host, else None."""
    from trainpilot.runtime.drain import DONE
    from trainpilot.runtime.elastic.rendezvous import host_name

    record = _read_json(run_dir / DONE)
    return record if record is not None and record.get("host") == host_name() else None


class _OnWorkerEnd:
    """What a worker's own exit record asks of the launcher.

    ``bad_input``: restarting cannot help, so end the launch once (torchrun's agent stops its
    workers on the launcher's SIGTERM; the outcome reports the worker's line).
    ``drained`` (``runtime.drain``), once every local rank said so: this host leaves the job at
    once, without torchrun's shutdown, which would close the rendezvous the other hosts re-form
    the job through (its exit barrier would also hold this launcher for minutes)."""

    def __init__(self, run_dir: Path, watch: Path, *, local_ranks: int) -> None:
        self.run_dir, self.watch, self.local_ranks = run_dir, watch, local_ranks
        self.sent = False
        self.drained: set[int] = set()
        self.probe: _ProbeProcess | None = None  # stopped before leaving (no finally runs)

    def __call__(self, obs: Observation) -> None:
        if obs.kind == "exit" and obs.reason == "bad_input" and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        if obs.kind == "exit" and obs.reason == "drained":
            self.drained.add(obs.rank)
            if len(self.drained) >= self.local_ranks:
                self._leave(obs.step)

    def _leave(self, step: int) -> None:
        if self.probe is not None:
            self.probe.stop()
        log_launch(self.run_dir, "launch_end", outcome="drained", step=step)
        shutil.rmtree(self.watch, ignore_errors=True)
        print(_DRAINED_LINE.format(step=step), flush=True)
        sys.stderr.flush()
        os._exit(0)


def _check_options(inject: str | None, elastic: dict[str, Any] | None, callbacks, *, config,
                   plan: Plan) -> str:
    """Validate everything the workers would only find wrong after seconds of start-up;
    returns the fault spec with any ``chaos:`` part expanded."""
    spec = ""
    if inject:
        from trainpilot.runtime.faults import expand_chaos, parse_faults

        spec = expand_chaos(inject, num_steps=config.steps, world_size=plan.world_size,
                            seed=config.seed)
        parse_faults(spec, world_size=plan.world_size, num_steps=config.steps)
    if elastic:
        from trainpilot.runtime.elastic import ElasticConfig

        ElasticConfig(**elastic)
    for ref in callbacks:
        _check_callback(ref)
    return spec


def _check_callback(ref: str) -> None:
    import importlib

    module_name, sep, attr = ref.partition(":")
    try:
        ok = bool(sep) and callable(getattr(importlib.import_module(module_name), attr, None))
    except Exception:  # noqa: BLE001 - any import failure is the user's module's
        ok = False
    if not ok:
        raise SpecError("--callback", ref, "not an importable 'package.module:factory'")


def _device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _apply_defaults(args: argparse.Namespace, run_dir: Path, *, recovery: bool,
                    options: argparse.Namespace | dict | None) -> None:
    """Fault tolerance on by default, and the workers' output in files (C++ stack frames of a
    recovered failure belong in a log, not in the user's terminal)."""
    given = vars(options) if isinstance(options, argparse.Namespace) else dict(options or {})
    if not recovery:
        args.max_restarts = 0
    elif given.get("max_restarts") is None:  # not given: trainpilot's default, not torchrun's 0
        args.max_restarts = DEFAULT_MAX_RESTARTS
    if not given.get("log_dir"):
        args.log_dir = str(run_dir / "logs")
    if given.get("redirects") in (None, "0") and given.get("tee") in (None, "0"):
        args.redirects = "3"


def _worker_env(args: argparse.Namespace, watch: Path, signals: tuple[str, ...]) -> dict[str, str]:
    env = {ENV_DIR: str(watch), ENV_LAUNCHER: str(os.getpid())}
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # one thread per rank: no oversubscription
    if int(args.max_restarts) > 0:
        # Restarted workers otherwise may read the previous attempt's addresses from the shared
        # rendezvous store and fail to connect (pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # torchrun's agent forwards the signals it handles to the workers: make sure the
    # preemption signals are among them.
    handled = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    names = [n.strip() for n in handled.split(",") if n.strip()]
    names += [f"SIG{s}" for s in signals if f"SIG{s}" not in names]
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(names)
    if not args.standalone:
        env[ENV_RDZV_DEAD_S] = f"{rendezvous_dead_s(args.rdzv_conf):g}"
    return env


ENV_RDZV_DEAD_S = "TRAINPILOT_RDZV_DEAD_S"


def rendezvous_dead_s(rdzv_conf: str | None) -> float:
    """How long torchrun's c10d rendezvous takes to drop a host that went silent: its
    keep-alive interval times the attempts it allows (``--rdzv-conf``; torch's defaults 5 s
    and 3)."""
    conf = dict(part.split("=", 1) for part in (rdzv_conf or "").split(",") if "=" in part)
    try:
        return float(conf.get("keep_alive_interval", 5)) * float(
            conf.get("keep_alive_max_attempt", 3))
    except ValueError:
        return 15.0


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _agent_logs_to(path: Path, *extra: Any) -> Iterator[None]:
    """torchrun's agent logs (its restarts, the signals it sends) into ``path`` instead of the
    terminal: the final line says what happened."""
    import logging

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(path)
    except OSError:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    names = ["torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"]
    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.handlers[:], logger.propagate, logger.level))
        logger.handlers = [handler, *extra]
        logger.propagate = False
        logger.setLevel(logging.INFO)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic.") and name not in names:
            sub = logging.getLogger(name)
            saved.append((sub, sub.handlers[:], sub.propagate, sub.level))
            sub.handlers = []
            sub.propagate = True
    try:
        yield
    finally:
        for logger, handlers, propagate, level in saved:
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)
        handler.close()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _left_job(run_dir: Path, why: str, args: argparse.Namespace) -> dict[str, Any]:
    """A multi-node host whose agent left the rendezvous: fine (exit 0) when the job completed
    on the others (the summary says so); otherwise a failure that says why, in one line."""
    summary = _read_json(run_dir / "summary.json")
    job = _read_json(run_dir / "job.json") or {}
    target = (job.get("config") or {}).get("steps")
    if (summary is not None and target is not None and summary.get("steps", 0) >= target
            and not summary.get("stopped")):
        return dict(summary, left_job=f"this host left the job: {why}; the job completed on "
                                      "the other hosts")
    raise TrainingFailed(f"this host left the job: {why}; the job did not complete here (the "
                         f"other hosts may go on without it; logs: {args.log_dir})")


def _outcome(run_dir: Path, watch: Path, dog: Watchdog, failure: BaseException | None,
             args: argparse.Namespace) -> dict[str, Any]:
    """The run's summary, or the exception that says how it ended."""
    preempted = _read_json(run_dir / PREEMPTED)
    if preempted is not None:
        sig = preempted.get("signal") or "SIGTERM"
        raise RunPreempted(f"preempted by {sig}: step {preempted['step']} saved "
                           f"({preempted.get('checkpoint') or 'checkpoints/'}); the same command "
                           "resumes from it", int(preempted.get("exit_code", 143)),
                           preempted.get("step"))
    bad = [o for o in dog.observations if o.kind == "exit" and o.reason == "bad_input"]
    if bad:
        raise WorkerBadInput(bad[0].message)
    summary = _read_json(run_dir / "summary.json") or _read_json(watch / "summary.json")
    if failure is None and summary is not None:
        summary["watchdog"] = [o.line() for o in dog.faults()]
        return summary
    from torch.distributed.elastic.multiprocessing import SignalException

    if isinstance(failure, SignalException):
        code = 128 + int(failure.sigval)
        raise RunPreempted(f"stopped by {signal_name(int(failure.sigval))} before a last-moment "
                           f"checkpoint was saved; the newest checkpoint stands (logs: "
                           f"{args.log_dir})", code, None)
    raise TrainingFailed(failure_message(dog, failure, run_dir, args))


def failure_message(dog: Watchdog, failure: BaseException | None, run_dir: Path,
                    args: argparse.Namespace) -> str:
    """One line: the root cause (the earliest fault, whichever rank), the restarts used, where
    the logs are."""
    first = dog.first_failure()
    restarts = int(args.max_restarts)
    used = max((o.attempt for o in dog.observations), default=0)
    if first is not None:
        cause = first.line()
        if first.kind == "exit" and first.reason == "bad_input":
            return cause  # a worker's one-line error (e.g. no valid checkpoint)
    elif failure is not None:
        cause = _first_failure(failure)
    else:
        cause = "the workers ended without a summary"
    tried = (f"; restarts used: {used} of {restarts}" if restarts else
             "; no restarts (--no-recovery or --max-restarts 0)")
    return f"training failed: {cause}{tried}; logs: {args.log_dir}"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _first_failure(err) -> str:
    """The earliest failure torchrun reports (by time, not by rank number)."""
    failures = getattr(err, "failures", {}) or {}
    if not failures:
        return str(err).splitlines()[0]
    rank, failure = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    message = failure.message
    message = message if isinstance(message, str) else json.dumps(message)
    how = (f"killed by {signal_name(-failure.exitcode)}" if failure.exitcode < 0
           else f"exited with code {failure.exitcode}")
    return f"rank {rank} {how}" + (
        f" ({message.splitlines()[0][:200]})" if message and message != "<N/A>" else "")


class _Tail:
    """Follow JSON-lines files written by another process (the first of ``paths`` that
    exists: the node-local stream, else the run's metrics file); call ``callback`` per
    record and ``note`` for warnings worth a line (a full disk)."""

    def __init__(self, paths: list[Path], callback: Callable[[dict], None] | None,
                 note: Callable[[str], None] | None = None, *, period_s: float = 0.2):
        self.paths, self.callback, self.note, self.period_s = paths, callback, note, period_s
        self.path: Path | None = None
        self._stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        if self.path is None:
            self.path = next((p for p in self.paths if p.exists()), None)
            if self.path is None:
                return
            if self.path.name == "metrics.jsonl":
                self._offset = 0
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            while True:
                line = handle.readline()
                if not line.endswith(b"\n"):  # a line still being written: read it next time
                    break
                self._offset += len(line)
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line torn by a full disk
                self._deliver(record)

    def _deliver(self, record: dict) -> None:
        if self.note is not None and record.get("kind") in ("disk_full", "store_recovered",
                                                           "checkpoint_failed"):
            self.note(_warning_line(record))
        if self.callback is not None:
            self.callback(record)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._poll()
            except OSError:
                pass
            time.sleep(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self._poll()  # the last lines
        except OSError:
            pass


def _warning_line(record: dict) -> str:
    kind = record.get("kind")
    if kind == "disk_full":
        return f"warning: disk full: {record.get('message')}"
    if kind == "store_recovered":
        return (f"the run store writes again after {record.get('after_s')} s "
                f"({record.get('mount')})")
    err = record.get("error", "")
    if record.get("errno") in (28, 122):
        from trainpilot.runtime.degrade import describe_disk

        where = describe_disk(record) if record.get("mount") else "the checkpoint disk"
        return (f"warning: disk full: {where}: checkpoint step {record.get('step')} was not "
                "written to storage; it is kept in host memory and a peer's only")
    return f"warning: checkpoint step {record.get('step')} failed: {err}"
