"""Start a training job under torchrun, in-process.

The launcher reuses ``torch.distributed.run``'s own argument parser (``--nnodes``,
``--nproc-per-node``, ``--rdzv-*``, ``--max-restarts``, ...) and calls
``torch.distributed.run.run`` with the worker module :mod:`trainpilot.runtime.worker`; multi-node
is torchrun's c10d rendezvous. A single-node job with no rendezvous options runs standalone
(torchrun picks a free port). A thread tails the run's ``metrics.jsonl`` to show progress.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError

# torchrun options that do not apply: we always start our own worker module.
_NOT_FORWARDED = {"help", "module", "no_python", "run_path", "training_script",
                  "training_script_args"}
WORKER_MODULE = "trainpilot.runtime.worker"


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
            worker_job: dict[str, Any]) -> argparse.Namespace:
    """Check the plan against the launch (processes, backend) and build torchrun's namespace.
    Raises SpecError before anything starts. ``--nproc-per-node`` defaults to the plan's size
    on one node."""
    from trainpilot.runtime.layout import check_runtime, default_backend

    args = torchrun_namespace(options, ["--job", json.dumps(worker_job)])
    nnodes = _nnodes(args)
    if args.nproc_per_node is None:
        args.nproc_per_node = str(plan.world_size) if nnodes == 1 else "1"
    nproc = _nproc(args)
    world = nproc * nnodes if nproc is not None and nnodes is not None else None
    check_runtime(model, plan, backend=default_backend(), world_size=world)
    config = worker_job.get("config") or {}
    if config.get("data", "markov") != "markov":
        from trainpilot.runtime.data import TokenFileDataset

        # Open it here too: a missing or malformed file is bad input, not a failed run.
        TokenFileDataset(config["data"], seq_len=plan.seq_len, vocab_size=model.vocab_size,
                         dtype=config.get("data_dtype", "uint16"))
    return args


def launch(*, model: ModelSpec, plan: Plan, config, run_dir: str | os.PathLike,
           options: argparse.Namespace | dict | None = None, cluster: ClusterSpec | None = None,
           callbacks: list[str] = (), on_record: Callable[[dict], None] | None = None,
           inject: str | None = None, elastic: dict[str, Any] | None = None,
           health: bool = True, health_config: str | None = None, checkpoint: bool = True,
           ) -> dict[str, Any]:
    """Train under torchrun; returns the run's summary (rank 0's ``summary.json``).

    ``on_record`` is called in this process with each line rank 0 appends to ``metrics.jsonl``
    (steps and events), e.g. to drive a progress bar. ``inject``: faults to inject (the
    ``--inject`` spec of :mod:`trainpilot.runtime.faults`); ``elastic``: ElasticConfig fields;
    ``health=False`` runs without the health monitor, ``checkpoint=False`` without
    checkpoints. Raises SpecError for bad input and RuntimeError when a worker fails.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    run_dir = Path(run_dir).resolve()
    if inject:
        from trainpilot.runtime.faults import parse_faults

        parse_faults(inject)  # bad specs are bad input: exit 2 before anything starts
    if elastic:
        from trainpilot.runtime.elastic import ElasticConfig

        ElasticConfig(**elastic)
    if health_config:
        from trainpilot.health.config import load_health_config

        load_health_config(health_config)
    job = dict(model=model.to_dict(), plan=plan.to_dict(), config=config.to_dict(),
               run_dir=str(run_dir), cluster=cluster.to_dict() if cluster else None,
               callbacks=list(callbacks), inject=inject or "", elastic=dict(elastic or {}),
               health=health, health_config=health_config, checkpoint=checkpoint)
    args = prepare(model=model, plan=plan, options=options, worker_job=job)
    # A single-node run starts in an empty folder. The agents of a multi-node or elastic job
    # (--nnodes, --rdzv-*) share one run directory: a node joining later finds it in use.
    if args.standalone and ((run_dir / "metrics.jsonl").exists()
                            or (run_dir / "summary.json").exists()):
        raise SpecError("--run-dir", str(run_dir), "already holds a run; valid: a new or empty "
                        "folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: no oversubscription
    if int(args.max_restarts) > 0:
        # Restarted workers otherwise may read the previous attempt's addresses from the shared
        # rendezvous store and fail to connect (pytorch#135712).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    watcher = _Tail(run_dir / "metrics.jsonl", on_record) if on_record else None
    try:
        torchrun(args)
    except ChildFailedError as err:
        raise RuntimeError(f"training failed: {_first_failure(err)}; logs: {run_dir}") from None
    finally:
        if watcher:
            watcher.stop()
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        raise RuntimeError(f"training ended without a summary; see {run_dir}")
    return json.loads(summary_path.read_text())


def _first_failure(err) -> str:
    failures = getattr(err, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
        message = failure.message
        message = message if isinstance(message, str) else json.dumps(message)
        return f"rank {rank} exited with code {failure.exitcode}" + (
            f" ({message.splitlines()[0][:200]})" if message and message != "<N/A>" else "")
    return str(err).splitlines()[0]


class _Tail:
    """Follow a JSON-lines file written by another process; call ``callback`` per line."""

    def __init__(self, path: Path, callback: Callable[[dict], None], *, period_s: float = 0.2):
        self.path, self.callback, self.period_s = path, callback, period_s
        self._stop = threading.Event()
        self._offset = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as handle:
            handle.seek(self._offset)
            while True:
                line = handle.readline()
                if not line.endswith(b"\n"):  # a line still being written: read it next time
                    break
                self._offset += len(line)
                self.callback(json.loads(line))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            time.sleep(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()  # the last lines
