"""LocalSupervisor: the ranks of a job on this machine, each replaced when it dies.

torchrun's agent restarts *every* worker when one fails, so nothing survives in memory. A
per-replica launcher (torchft's model: one supervisor per replica group) replaces only the dead
process, and the survivors recover in process. This class is that launcher for one machine:
it hosts the job's TCPStore (as torchrun's agent does), starts ``world_size`` ranks with
torchrun's environment variables, and when a rank dies either starts a replacement for it
(``policy="replace"``) or kills and restarts every rank under a new attempt number
(``policy="restart_all"``: what torchrun does), at most ``max_restarts`` times.

It is used by the tests, the recovery benchmarks and the demo. Multi-node jobs use torchrun.
Ranks are forked from this process by default, after it imported the training stack
(``preload``): a replacement starts like a warm spare process, without seconds of imports;
``start_method="spawn"`` pays the cold start (a new interpreter importing torch).
"""

from __future__ import annotations

import datetime
import importlib
import multiprocessing
import os
import signal
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.distributed as dist


@dataclass(kw_only=True)
class RankProcess:
    rank: int
    attempt: int
    incarnation: int
    process: Any
    started_at: float
    exitcode: int | None = None


@dataclass(kw_only=True)
class SupervisorReport:
    """What happened: exit code of every process started, and each replacement's start."""

    processes: list[RankProcess] = field(default_factory=list)
    replacements: list[dict[str, Any]] = field(default_factory=list)
    ok: bool = False
    wall_s: float = 0.0


def _child(target: Callable, rank: int, env: dict[str, str], args: tuple) -> None:
    os.environ.update(env)
    code = 0
    try:
        target(rank, *args)
    except BaseException:  # noqa: BLE001 - report and exit hard (a half-dead group may hang)
        traceback.print_exc()
        code = 1
    os._exit(code)


# The training stack a rank imports (DCP, FSDP, DTensor, the Trainer): seconds of imports.
PRELOAD = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.checkpoint.state_dict", "trainpilot.runtime.trainer",
           "trainpilot.runtime.checkpoint", "trainpilot.runtime.elastic.session",
           "trainpilot.app.rank", "trainpilot.health.monitor", "trainpilot.store")


class LocalSupervisor:
    """Run ``target(rank, *args)`` on ``world_size`` local processes (see module doc)."""

    def __init__(self, target: Callable, world_size: int, *, args: tuple = (),
                 policy: Literal["replace", "restart_all"] = "replace", max_restarts: int = 3,
                 start_method: str = "fork", env: dict[str, str] | None = None,
                 preload: tuple[str, ...] = PRELOAD):
        if start_method == "fork":
            # A warm spare: what a forked rank would import is imported once, here.
            for module in preload:
                importlib.import_module(module)
        self.target, self.world_size, self.args = target, world_size, args
        self.policy, self.max_restarts = policy, max_restarts
        self.ctx = multiprocessing.get_context(start_method)
        self._store_host, self.port = _start_store_host()
        self.run_id = uuid.uuid4().hex[:8]
        self.extra_env = dict(env or {})
        self.report = SupervisorReport()
        self.attempt = 0
        self._incarnations = {r: 0 for r in range(world_size)}
        self.live: dict[int, RankProcess] = {}

    def _env(self, rank: int) -> dict[str, str]:
        return dict(self.extra_env, RANK=str(rank), LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(self.world_size), LOCAL_WORLD_SIZE=str(self.world_size),
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port),
                    TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID=self.run_id,
                    TORCHELASTIC_RESTART_COUNT=str(self.attempt), OMP_NUM_THREADS="1")

    def _start(self, rank: int) -> RankProcess:
        self._incarnations[rank] += 1
        # typeshed's BaseContext (what get_context(str) is typed as) lacks the Process class
        # every concrete context has.
        proc = self.ctx.Process(  # type: ignore[attr-defined]
            target=_child, args=(self.target, rank, self._env(rank), self.args), daemon=False)
        proc.start()
        entry = RankProcess(rank=rank, attempt=self.attempt,
                            incarnation=self._incarnations[rank], process=proc,
                            started_at=time.time())
        self.report.processes.append(entry)
        self.live[rank] = entry
        return entry

    def run(self, *, timeout_s: float) -> SupervisorReport:
        """Start every rank and supervise until all exit 0, restarts run out, or the timeout
        (then every process is killed by its id). ``report.ok``: every rank finished."""
        start = time.monotonic()
        for rank in range(self.world_size):
            self._start(rank)
        restarts = 0
        try:
            while self.live and time.monotonic() - start < timeout_s:
                for rank, entry in list(self.live.items()):
                    code = entry.process.exitcode
                    if code is None:
                        continue
                    entry.exitcode = code
                    del self.live[rank]
                    if code == 0:
                        continue
                    if restarts >= self.max_restarts:
                        raise _GiveUp(f"rank {rank} exited with {code}; no restarts left")
                    restarts += 1
                    self._handle_death(rank, code)
                time.sleep(0.01)
            self.report.ok = not self.live and all(
                p.exitcode == 0 for p in self.report.processes
                if p.incarnation == self._incarnations[p.rank] and p.attempt == self.attempt)
        except _GiveUp:
            self.report.ok = False
        finally:
            self.kill_all()
            self.report.wall_s = time.monotonic() - start
            self.close()
        return self.report

    def close(self) -> None:
        """Stop the store's host process."""
        if self._store_host.is_alive():
            self._store_host.kill()
        self._store_host.join(5)

    def _handle_death(self, rank: int, code: int) -> None:
        died_at = time.time()
        if self.policy == "replace":
            entry = self._start(rank)
            self.report.replacements.append(dict(rank=rank, exitcode=code, died_at=died_at,
                                                 started_at=entry.started_at, attempt=self.attempt,
                                                 incarnation=entry.incarnation))
            return
        self.kill_all()  # torchrun's semantics: every worker goes, a new attempt starts
        self.attempt += 1
        self._incarnations = {r: 0 for r in range(self.world_size)}
        for r in range(self.world_size):
            self._start(r)
        self.report.replacements.append(dict(rank=rank, exitcode=code, died_at=died_at,
                                             started_at=time.time(), attempt=self.attempt,
                                             incarnation=1, restart_all=True))

    def kill_all(self) -> None:
        """SIGKILL every live process by its id, and reap it."""
        for entry in list(self.live.values()):
            if entry.process.is_alive():
                try:
                    os.kill(entry.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            entry.process.join(5)
            entry.exitcode = entry.process.exitcode
        self.live.clear()


class _GiveUp(Exception):
    pass


def _host_store(conn: Any, supervisor_pid: int) -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=300),
                          wait_for_workers=False)
    conn.send(store.port)
    while os.getppid() == supervisor_pid:  # until killed, or the supervisor is gone
        time.sleep(0.5)
    os._exit(0)


def _start_store_host() -> tuple[Any, int]:
    """Host the job's TCPStore in a process of its own. The store's server thread must not
    live in the process that forks the ranks: a fork taken while that thread holds a libc lock
    (it resolves the address of each client that connects) leaves the child with the lock
    held for ever (seen: a rank stuck in ``gethostbyaddr`` before joining, about one start in
    twenty). Forked before any rank, from a process with no such thread."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    host = ctx.Process(target=_host_store, args=(child, os.getpid()), daemon=True)
    host.start()
    child.close()
    if not parent.poll(60):
        host.kill()
        raise RuntimeError("the local TCPStore host did not start within 60 s")
    port = int(parent.recv())
    parent.close()
    return host, port
