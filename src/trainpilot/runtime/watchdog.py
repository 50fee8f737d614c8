"""A per-node watchdog outside the workers: what kills, stops or freezes a rank is seen by a
process that cannot itself be stopped with it.

Heartbeats between ranks go through the job's store, which rank 0 may host: a SIGSTOP of rank 0
freezes the store and every heartbeat with it. So each node's launcher (the process that runs
torchrun's agent, and whose children the workers are) also watches its own workers through a
node-local folder (``TRAINPILOT_WATCH_DIR``, in ``/dev/shm`` when it exists):

* each worker registers (``rank<R>.json``: pid, attempt) and a :class:`Beacon` thread bumps a
  counter in ``rank<R>.beat`` every ``interval_s``;
* the :class:`Watchdog` thread reads the process state (``/proc/<pid>/stat``): a rank stopped
  (SIGSTOP, state ``T``) for ``timeout_s``, or frozen (alive, counter unchanged: every thread
  stuck, e.g. a deadlock holding the GIL) for ``max(30 s, 10 x timeout_s)``, is killed
  (SIGKILL), so torchrun restarts the group and every rank restores;
* a worker that ends leaves a child the launcher may look at without reaping it
  (``waitid(..., WNOWAIT)``): its exit code or signal. A worker that ends on its own first writes
  ``rank<R>.exit.json`` (why); one that dies without it was killed from outside (or by the
  kernel: a SIGKILL while the ``oom_kill`` count of the worker's own memory cgroup rose is an
  OOM kill; ``/proc/vmstat``'s host-wide count only where the cgroup's cannot be read).

Every fault seen this way that the fault injector did not cause (its journal names the pid) is
journaled in ``RUN_DIR/faults.jsonl`` as an external fault (kind, rank, time, evidence), and
every attempt torchrun starts, and how it ended, in ``RUN_DIR/launcher.jsonl``: the run store
ingests both.

Workers also die with the launcher: a worker started by it asks the kernel for SIGKILL when its
parent dies (``PR_SET_PDEATHSIG``), so killing the launcher never leaves ranks training
unsupervised.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import select
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainpilot.fsio import atomic_write_text, read_jsonl
from trainpilot.runtime.faults import append_journal

ENV_DIR = "TRAINPILOT_WATCH_DIR"
ENV_LAUNCHER = "TRAINPILOT_LAUNCHER_PID"
LAUNCHER_JOURNAL = "launcher.jsonl"
_PR_SET_PDEATHSIG = 1


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _sweep_dead_launchers(base: Path) -> None:
    """Remove the folders of launchers of this host that are gone (killed by SIGKILL: they
    could not clean up, and on a multi-node job the folder holds snapshots in RAM)."""
    ours = _pid_namespace()
    for folder in base.glob("trainpilot-*-*"):
        try:
            if ours is None or (folder / "pidns").read_text() != ours:
                continue  # a pid of another pid namespace (containers sharing /dev/shm)
            pid = int(folder.name.split("-")[1])
            os.kill(pid, 0)
        except OSError as err:
            if isinstance(err, ProcessLookupError):
                shutil.rmtree(folder, ignore_errors=True)
            continue
        except ValueError:
            continue


def watch_dir_for(launcher_pid: int) -> Path:
    """A new node-local folder for one launch (RAM-backed where possible: it must work when
    the run's disk is full)."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    _sweep_dead_launchers(base)
    path = base / f"trainpilot-{launcher_pid}-{time.time_ns()}"
    path.mkdir(parents=True)
    ns = _pid_namespace()
    if ns is not None:
        (path / "pidns").write_text(ns)
    return path


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


# -- worker side --------------------------------------------------------------------------------
def die_with_launcher() -> None:
    """Ask the kernel to SIGKILL this process when its parent (the launcher) dies; exit at
    once if it is already gone. No-op unless started by trainpilot's launcher (Linux)."""
    expected = os.environ.get(ENV_LAUNCHER)
    if not expected:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the watchdog's parent check below still applies
    if os.getppid() != int(expected):
        os._exit(137)  # the launcher died before the request took effect


class Beacon:
    """This worker's registration and counter in the node's watch folder (no-op without
    ``TRAINPILOT_WATCH_DIR``). ``update(step=, phase=)`` from the training loop."""

    def __init__(self, rank: int, *, interval_s: float = 0.25, directory: str | None = None):
        where = directory or os.environ.get(ENV_DIR)
        self.dir = Path(where) if where else None
        self.rank, self.interval_s = rank, interval_s
        self.step, self.phase, self.count = 0, "start", 0
        self._fd: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-beacon", daemon=True)

    def start(self) -> Beacon:
        if self.dir is None:
            return self
        info = dict(rank=self.rank, pid=os.getpid(),
                    local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                    attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    started_unix_s=time.time())
        self._fd = os.open(self.dir / f"rank{self.rank}.beat.{os.getpid()}",
                           os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._beat()
        atomic_write_text(self.dir / f"rank{self.rank}.json", json.dumps(info))
        self._thread.start()
        return self

    def update(self, *, step: int | None = None, phase: str | None = None) -> None:
        if step is not None:
            self.step = step
        if phase is not None:
            self.phase = phase

    def _beat(self) -> None:
        self.count += 1
        line = f"{self.count} {self.step} {self.phase}\n".ljust(64).encode()
        assert self._fd is not None  # start() opens the file before the first beat
        os.pwrite(self._fd, line, 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except OSError:
                return

    def record_exit(self, code: int, reason: str, message: str = "", **details: Any) -> None:
        """Say why this worker is about to exit (read by the launcher's watchdog)."""
        if self.dir is None:
            return
        body = dict(rank=self.rank, pid=os.getpid(), code=code, reason=reason,
                    message=message[:2000], time_unix_s=time.time(), step=self.step, **details)
        try:
            atomic_write_text(self.dir / f"rank{self.rank}.exit.{os.getpid()}.json",
                              json.dumps(body, default=str))
        except OSError:
            pass  # the node's RAM folder is gone: the launcher is gone too

    def stop(self) -> None:
        self._stop.set()


# -- launcher side ------------------------------------------------------------------------------
@dataclass(kw_only=True)
class WorkerView:
    rank: int
    pid: int
    attempt: int
    started: float
    count: int = -1
    changed_at: float = field(default_factory=time.monotonic)
    stopped_since: float | None = None
    was_stopped: bool = False
    last_step: int = 0
    ended: bool = False
    pidfd: int | None = None  # -1 once closed
    gone_since: float | None = None  # ended, status not read yet
    oom_file: Path | None = None  # its memory cgroup's OOM-kill count (None: not readable)
    oom_at_start: int | None = None


@dataclass(frozen=True, kw_only=True)
class Observation:
    """One thing the watchdog saw: a worker's end, or a hang it acted on."""

    kind: str  # "exit" (ended with its own record), "crash", "oom", "hang", "terminated"
    rank: int
    pid: int
    attempt: int
    time_unix_s: float
    step: int
    external: bool  # not caused by trainpilot's fault injector or by the worker itself
    evidence: str
    code: int | None = None
    reason: str = ""
    message: str = ""

    def line(self) -> str:
        """How the final line of a run names it."""
        if self.kind == "exit":
            return self.message or f"rank {self.rank} exited with code {self.code}"
        return f"rank {self.rank} {self.evidence} (at step {self.step + 1})"


class Watchdog:
    """Watches this node's workers (see the module doc); a daemon thread of the launcher."""

    def __init__(self, directory: Path, *, run_dir: Path, timeout_s: float = 3.0,
                 poll_s: float = 0.25, kill_hung: bool = True,
                 on_observation: Callable[[Observation], None] | None = None):
        self.dir, self.run_dir = directory, run_dir
        self.timeout_s, self.poll_s, self.kill_hung = timeout_s, poll_s, kill_hung
        # A stopped process (state T) is certain; a beacon that stops moving may also be a long
        # operation holding the GIL, so that verdict waits longer.
        self.frozen_timeout_s = max(30.0, 10.0 * timeout_s)
        self.on_observation = on_observation
        self.workers: dict[int, WorkerView] = {}  # pid -> view
        self.observations: list[Observation] = []
        self.attempts: dict[int, dict[str, Any]] = {}
        self._oom_kills = _oom_kills()
        self._reported: dict[int, int] = {}
        self.report_wait_s = 5.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll()  # the last endings

    def _run(self) -> None:
        # Each worker's pidfd becomes readable the moment it exits: the watchdog reads its exit
        # status (without reaping it) before torchrun's agent, which polls every 0.1 s, reaps it.
        poller = select.poll()
        while not self._stop.is_set():
            try:
                with self._lock:
                    for view in self.workers.values():
                        if view.pidfd is None and not view.ended:
                            view.pidfd = _pidfd(view.pid)
                            if view.pidfd is not None:
                                poller.register(view.pidfd, select.POLLIN)
                poller.poll(self.poll_s * 1000)
                self.poll()
                with self._lock:
                    for view in self.workers.values():
                        if view.ended and view.pidfd is not None and view.pidfd >= 0:
                            poller.unregister(view.pidfd)
                            os.close(view.pidfd)
                            view.pidfd = -1
            except Exception as err:  # noqa: BLE001 - the watchdog must never end the launch
                _log(self.run_dir, dict(kind="watchdog_error", error=str(err)[:300]))
                time.sleep(self.poll_s)

    # -- one round -------------------------------------------------------------------------
    def poll(self) -> None:
        with self._lock:
            self._register()
            now = time.monotonic()
            for view in list(self.workers.values()):
                if not view.ended:
                    self._check(view, now)

    def _register(self) -> None:
        for info in registrations(self.dir):
            pid = int(info["pid"])
            if pid in self.workers:
                continue
            view = WorkerView(rank=int(info["rank"]), pid=pid, attempt=int(info["attempt"]),
                              started=float(info["started_unix_s"]))
            view.oom_file = memcg_oom_file(pid)
            view.oom_at_start = oom_count(view.oom_file) if view.oom_file else None
            self.workers[pid] = view
            if view.attempt not in self.attempts:
                self.attempts[view.attempt] = dict(started_unix_s=view.started, ranks=[])
                _log(self.run_dir, dict(kind="attempt_start", attempt=view.attempt,
                                        time_unix_s=view.started))
            self.attempts[view.attempt]["ranks"].append(view.rank)

    def peek_children(self, *_: Any) -> None:
        """SIGCHLD handler (installed by the launcher around torchrun): read the exit status of
        every worker that just ended, before torchrun's agent reaps it. Python runs a signal
        handler in the main thread between two bytecodes, and the agent polls its workers from
        the main thread, so this runs first; a worker killed before this thread registered it
        (within a quarter second of its start) would otherwise end with no signal on record.
        Takes no lock (the main thread may hold it): it only reads beacons and stores codes."""
        for info in registrations(self.dir):
            pid = int(info["pid"])
            if pid in self._reported:
                continue
            ended = _peek_exit(pid)
            if ended is not None and ended != (None, None):
                code, sig = ended
                self._reported[pid] = code if code is not None else -int(sig or 0)

    def report_exit(self, pid: int, exitcode: int) -> None:
        """What torchrun's agent says a worker ended with (its log of the first failure: the
        agent may reap a worker before this thread reads its status)."""
        self._reported.setdefault(pid, exitcode)

    def _check(self, view: WorkerView, now: float) -> None:
        ended = _peek_exit(view.pid)
        if ended == (None, None) or (ended is None and _proc_state(view.pid) is None):
            # Reaped by the agent before this thread saw it: wait a moment for its report.
            view.gone_since = view.gone_since or now
            code = self._reported.get(view.pid)
            if code is not None:
                ended = (code, None) if code >= 0 else (None, -code)
            elif now - view.gone_since < self.report_wait_s:
                return
            else:
                ended = (None, None)
        if ended is not None:
            self._ended(view, *ended)
            return
        state = _proc_state(view.pid)
        beat = _read_beat(self.dir / f"rank{view.rank}.beat.{view.pid}")
        if beat is not None:
            count, step = beat
            view.last_step = step
            if count != view.count:
                view.count, view.changed_at = count, now
        if state in ("T", "t"):
            view.stopped_since = view.stopped_since or now
            view.was_stopped = True
            if now - view.stopped_since > self.timeout_s:
                self._hung(view, f"stopped (SIGSTOP, state {state}) for "
                                 f"{now - view.stopped_since:.1f} s")
            return
        view.stopped_since = None
        if view.count >= 0 and now - view.changed_at > self.frozen_timeout_s:
            self._hung(view, f"frozen: alive (state {state}) but its beacon has not moved for "
                             f"{now - view.changed_at:.1f} s")

    def _hung(self, view: WorkerView, evidence: str) -> None:
        if not self.kill_hung:
            return
        injected = _injected_by(self.run_dir, view.pid)
        self._observe(view, kind="hang", external=injected is None,
                      evidence=f"hung: {evidence}; killed by the watchdog (SIGKILL)")
        try:
            os.kill(view.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        view.was_stopped = False  # its end is this observation's, not a second fault
        view.ended = True

    def _ended(self, view: WorkerView, code: int | None, sig: int | None) -> None:
        view.ended = True
        record = _read_exit(self.dir, view.rank, view.pid)
        if record is not None:
            self._observe(view, kind="exit", external=False, code=record.get("code"),
                          reason=record.get("reason", ""), message=record.get("message", ""),
                          evidence=f"exited with code {record.get('code')} "
                                   f"({record.get('reason')})")
            return
        injected = _injected_by(self.run_dir, view.pid)
        if sig is not None:
            what = f"killed by {signal_name(sig)}"
        elif code is not None:
            what = f"exited with code {code} without saying why"
        else:
            what = "ended (its exit status was collected by torchrun)"
        kind = "crash"
        if view.was_stopped:
            kind, what = "hang", f"was stopped (SIGSTOP), then {what} (declared failed by a peer)"
        elif sig in (signal.SIGKILL, None) and code is None:
            # A SIGKILL nobody here sent, or an end whose status torchrun reaped first: the
            # kernel's OOM killer if the count of the worker's own memory cgroup rose meanwhile
            # (an OOM kill anywhere else on the host, another job's or another cgroup's, is
            # not this worker's); the host-wide count where the cgroup's cannot be read.
            kills = _oom_kills()
            if view.oom_file is not None:
                now = oom_count(view.oom_file)
                if now is not None and view.oom_at_start is not None and now > view.oom_at_start:
                    kind = "oom"
                    what = ("killed by the kernel's out-of-memory killer (its memory cgroup's "
                            f"oom_kill {view.oom_at_start} -> {now}, {view.oom_file})")
            elif kills is not None and self._oom_kills is not None and kills > self._oom_kills:
                kind = "oom"
                what = ("killed by the kernel's out-of-memory killer (/proc/vmstat oom_kill "
                        f"{self._oom_kills} -> {kills})")
            self._oom_kills = kills
        if sig in (signal.SIGTERM, signal.SIGINT) and not view.was_stopped:
            # torchrun's agent ends a group that way (a restart, or its own shutdown); a
            # scheduler's SIGTERM is a preemption, handled as one by the workers.
            self._observe(view, kind="terminated", external=False, code=code, evidence=what)
            return
        self._observe(view, kind=kind, external=injected is None, code=code, evidence=what)

    def _observe(self, view: WorkerView, *, kind: str, external: bool, evidence: str,
                 code: int | None = None, reason: str = "", message: str = "") -> None:
        obs = Observation(kind=kind, rank=view.rank, pid=view.pid, attempt=view.attempt,
                          time_unix_s=time.time(), step=view.last_step, external=external,
                          evidence=evidence, code=code, reason=reason, message=message)
        self.observations.append(obs)
        if kind != "exit" or (code not in (0, None)):
            _log(self.run_dir, dict(_asdict(obs), kind="worker_end", end=obs.kind))
        if external and kind != "exit":
            append_journal(self.run_dir / "faults.jsonl", dict(
                kind=kind, fault=f"external:{kind}:rank={view.rank}", index=-1, source="external",
                rank=view.rank, step=view.last_step + 1, pid=view.pid, attempt=view.attempt,
                time_unix_s=obs.time_unix_s, evidence=evidence))
        if self.on_observation is not None:
            self.on_observation(obs)

    # -- summaries -------------------------------------------------------------------------
    def faults(self) -> list[Observation]:
        """What went wrong, oldest first: ends that were not a clean exit."""
        return [o for o in self.observations if o.kind not in ("exit", "terminated")
                or (o.kind == "exit" and o.code not in (0, None))]

    def first_failure(self) -> Observation | None:
        """The root cause of a failed run: the earliest fault (a rank that ended because a peer
        died comes after the peer's death)."""
        faults = sorted(self.faults(), key=lambda o: o.time_unix_s)
        primary = [o for o in faults if o.kind != "exit" or o.reason not in ("peer_failed",
                                                                               "terminated")]
        found = primary or faults
        return found[0] if found else None


class AgentExitReports(logging.Handler):
    """Reads torchrun's own log of a failed worker ("failed (exitcode: -9) local_rank: 1
    (pid: 123) ...") into the watchdog: the exit status even when the agent reaped it first."""

    def __init__(self, dog: Watchdog):
        super().__init__(logging.ERROR)
        self.dog = dog

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if (str(record.msg).startswith("failed (exitcode") and isinstance(args, tuple)
                and len(args) >= 3):
            values: tuple[Any, ...] = args  # whatever the agent logged: int() may refuse it
            try:
                self.dog.report_exit(int(values[2]), int(values[0]))
            except (TypeError, ValueError):
                pass


def _asdict(obs: Observation) -> dict[str, Any]:
    return {k: getattr(obs, k) for k in obs.__dataclass_fields__}


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _peek_exit(pid: int) -> tuple[int | None, int | None] | None:
    """(exit code, None) or (None, signal) of a child that ended, without reaping it (torchrun
    reaps it); None while it runs. (None, None) when it is not our child."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None if _proc_state(pid) is not None else (None, None)
    if info is None:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status, None
    return None, info.si_status


def _proc_state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state = text.rsplit(")", 1)[1].split()[0]
    return None if state in ("Z", "X") else state


def registrations(directory: Path) -> list[dict[str, Any]]:
    """The registrations (``rank<R>.json``: rank, pid, attempt, start) in ``directory`` that
    can be read now; one being written is seen next time."""
    out: list[dict[str, Any]] = []
    try:
        paths = list(directory.glob("rank*.json"))
    except OSError:
        return out
    for path in paths:
        if ".exit." in path.name:
            continue
        try:
            info = json.loads(path.read_text())
            int(info["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append(info)
    return out


def _read_beat(path: Path) -> tuple[int, int] | None:
    try:
        parts = path.read_text().split()
        return int(parts[0]), int(parts[1])
    except (OSError, ValueError, IndexError):
        return None


def _read_exit(directory: Path, rank: int, pid: int) -> dict[str, Any] | None:
    try:
        return json.loads((directory / f"rank{rank}.exit.{pid}.json").read_text())
    except (OSError, ValueError):
        return None


def _injected_by(run_dir: Path, pid: int) -> dict[str, Any] | None:
    """The injector's journal record of a fault process ``pid`` fired on itself, if any."""
    path = run_dir / "faults.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("pid") == pid and rec.get("source") != "external":
            return rec
    return None


def oom_count(path: Path) -> int | None:
    """The ``oom_kill N`` count in ``path`` (``/proc/vmstat``, a v1 memory cgroup's
    ``memory.oom_control``, a v2 cgroup's ``memory.events.local``); None if unreadable."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _oom_kills() -> int | None:
    return oom_count(Path("/proc/vmstat"))


def memcg_oom_file(pid: int, *, proc: Path = Path("/proc"), sys_fs: Path = Path("/sys/fs/cgroup"),
                   ) -> Path | None:
    """The file that counts OOM kills of ``pid``'s own memory cgroup (the kernel books a kill
    on the victim's cgroup): v1's ``memory/<path>/memory.oom_control``, else v2's
    ``<path>/memory.events.local`` (local: v2's ``memory.events`` also counts descendants);
    None when neither can be read."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if "memory" in controllers.split(","):
            candidates.insert(0, sys_fs / "memory" / rel / "memory.oom_control")
        elif controllers == "":
            candidates.append(sys_fs / rel / "memory.events.local")
    return next((c for c in candidates if oom_count(c) is not None), None)


def log_launch(run_dir: Path, kind: str, *, host: str | None = None, **details: Any) -> None:
    """``launch_start`` / ``launch_end`` (and the launcher's other records: link flags, drain
    requests) of one launcher process in ``launcher.jsonl``; ``host`` defaults to this one."""
    _log(run_dir, dict(kind=kind, pid=os.getpid(), host=host or os.uname().nodename, **details))


def _launch_records(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / LAUNCHER_JOURNAL)


def launches_elsewhere(run_dir: Path) -> list[str]:
    """Hosts other than this one with a launch of this run that has not ended: on a multi-node
    job, the launchers this one joins (the same command runs on every host)."""
    records = _launch_records(run_dir)
    ended = {(r.get("host"), r.get("pid")) for r in records if r.get("kind") == "launch_end"}
    host = os.uname().nodename
    return sorted({r["host"] for r in records if r.get("kind") == "launch_start"
                   and r.get("host") != host and (r.get("host"), r.get("pid")) not in ended})


def journal_lost_launch(run_dir: Path) -> dict[str, Any] | None:
    """A previous launch of this run that started and never ended (its launcher was killed,
    or its machine went away) is an external fault nobody else could journal: journal it now,
    with the last step its workers reported. Returns the record."""
    records = _launch_records(run_dir)
    host = os.uname().nodename
    starts = [r for r in records if r.get("kind") == "launch_start" and r.get("host") == host]
    if not starts:
        return None
    last = starts[-1]
    later = records[records.index(last) + 1:]
    if any(r.get("kind") == "launch_end" and r.get("pid") == last["pid"] for r in later):
        return None
    steps = [r.get("step", 0) for r in later if r.get("kind") == "worker_end"]
    record = dict(kind="launcher_lost", fault=f"external:launcher_lost:pid={last['pid']}",
                  index=-1, source="external", rank=None, step=None, pid=last["pid"],
                  time_unix_s=max([r.get("time_unix_s", 0.0) for r in later]
                                  + [last["time_unix_s"]]),
                  evidence=f"launch of pid {last['pid']} (started "
                           f"{time.strftime('%H:%M:%S', time.localtime(last['time_unix_s']))}) "
                           f"ended without a summary, a preemption or an error: the launcher "
                           f"was killed or its node went away"
                           + (f"; its workers had reached step {max(steps)}" if steps else ""))
    append_journal(run_dir / "faults.jsonl", record)
    _log(run_dir, dict(kind="launch_end", pid=last["pid"], host=host, outcome="lost",
                       found_by=os.getpid()))
    return record


def _log(run_dir: Path, record: dict[str, Any]) -> None:
    append_journal(run_dir / LAUNCHER_JOURNAL, dict(record, time_unix_s=record.get(
        "time_unix_s", time.time())), fsync=False)
