"""Heartbeats through the job's torch.distributed store, and what they are used to decide.

Every rank runs one daemon thread with its own store connection. Each beat writes
``hb/<rank>`` = {count, pid, host, incarnation, gen, step} and reads every other rank's. A
watcher judges peers by its own monotonic clock (no cross-host clock comparison):

* **silent**: a peer's ``count`` has not changed for ``heartbeat_timeout_s`` (the process is
  dead, stopped by SIGSTOP, or frozen);
* **hung**: a peer is alive but still in an older generation ``hang_grace_s`` after the
  watcher moved to a newer one. A peer that reports being inside a collective (``phase``) gets
  ``collective_timeout_s`` more: gloo cannot abort a group, so a rank blocked on a peer that
  left (alive) only notices at its collective timeout; after that it is hung too.

The lowest-ranked live rank acts on a verdict: it records it (``failed/<rank>``), asks the
peer's own thread to exit (``kill/<rank>/<incarnation>``: the path that works across hosts
while the peer's threads still run), and sends SIGKILL to its pid when it runs on this host
(the path that works for a stopped process). A killed rank is then replaced by the supervisor
(torchrun restarts every rank; the local supervisor replaces that one).

A verdict names the generation the peer was in. A peer that was only cut off (a partition past
the collective timeout, on another host) times out of that generation itself and joins the
next: a kill issued for an older generation than the one it is in or joining is stale, and it
ignores it; the watcher withdraws a verdict (and its keys) once that same process reports a
newer generation, so it can be judged afresh later. A stopped or frozen process resumes in
its old generation and obeys.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainpilot.runtime.elastic.rendezvous import host_name

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PeerView:
    """What one watcher knows about one peer (times on the watcher's monotonic clock)."""

    count: int = -1
    changed_at: float = field(default_factory=time.monotonic)
    behind_since: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    rank: int
    reason: str  # "silent" | "hung"
    waited_s: float
    pid: int | None
    host: str | None
    incarnation: int | None
    gen: int | None
    step: int | None


class Heartbeat:
    """The heartbeat thread of one rank. ``store``: a dedicated client connection (prefixed
    with the job's namespace). ``on_verdict`` is called (from the thread) for each peer this
    rank declares failed."""

    def __init__(self, store: Any, *, rank: int, world_size: int, incarnation: int,
                 interval_s: float, timeout_s: float, hang_grace_s: float,
                 collective_timeout_s: float = 0.0, kill: bool = True,
                 on_verdict: Callable[[Verdict], None] | None = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.incarnation = incarnation
        self.interval_s, self.timeout_s, self.hang_grace_s = interval_s, timeout_s, hang_grace_s
        self.collective_timeout_s = collective_timeout_s
        self.kill, self.on_verdict = kill, on_verdict
        self.gen = 0
        self.step = 0
        self.phase = "start"
        self.count = 0
        self.peers = {r: PeerView() for r in range(world_size) if r != rank}
        self.verdicts: list[Verdict] = []
        self._acted: set[tuple[int, int | None]] = set()  # (rank, incarnation) already handled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._beat()
        self._thread.start()
        return self

    def update(self, *, gen: int | None = None, step: int | None = None,
               phase: str | None = None) -> None:
        """Called by the training loop: the generation it is in, the step it finished, and
        whether it may be blocked on its peers (``phase="collective"``) or not."""
        if gen is not None:
            self.gen = gen
        if step is not None:
            self.step = step
        if phase is not None:
            self.phase = phase

    def stop(self) -> None:
        """Stop beating; the last beat says ``done``, so peers still finishing their own work
        do not take the silence for a failure."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)
        self.phase = "done"
        try:
            self._beat()
        except Exception as err:  # noqa: BLE001 - the store is already gone: nobody watches
            log.debug("heartbeat: final beat failed: %s", err)

    # -- the thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                self._obey_kill()
                self._watch()
            except Exception as err:  # noqa: BLE001 - the store went away: the job is ending
                log.debug("heartbeat: %s", err)
                if self._stop.is_set():
                    return

    def _beat(self) -> None:
        self.count += 1
        self.store.set(f"hb/{self.rank}", json.dumps(dict(
            count=self.count, pid=os.getpid(), host=host_name(), incarnation=self.incarnation,
            gen=self.gen, step=self.step, phase=self.phase)))

    def _obey_kill(self) -> None:
        key = f"kill/{self.rank}/{self.incarnation}"
        if self.store.check([key]):
            raw = self.store.get(key).decode()
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                declared_gen = json.loads(raw).get("gen")
                if declared_gen is not None and self.gen > int(declared_gen):
                    log.warning("rank %d: a kill for generation %s is stale (this rank is in "
                                "%d): ignored", self.rank, declared_gen, self.gen)
                    return
            log.error("rank %d: declared failed by a peer (%s); exiting", self.rank, raw)
            os.kill(os.getpid(), signal.SIGKILL)

    def _withdraw_stale(self, rank: int, info: dict[str, Any]) -> None:
        """Drop verdicts on ``rank`` that its same process has outlived (see the module doc)."""
        stale = [v for v in self.verdicts if v.rank == rank and v.gen is not None
                 and v.incarnation == info.get("incarnation") and info["gen"] > v.gen]
        for verdict in stale:
            self.verdicts.remove(verdict)
            self._acted.discard((rank, verdict.incarnation))
            for prefix in ("kill", "failed"):
                with contextlib.suppress(Exception):
                    self.store.delete_key(f"{prefix}/{rank}/{verdict.incarnation}")
            log.warning("rank %d: rank %d, declared %s in generation %d, joined generation %d: "
                        "verdict withdrawn", self.rank, rank, verdict.reason, verdict.gen,
                        info["gen"])

    def _watch(self) -> None:
        now = time.monotonic()
        keys = [f"hb/{r}" for r in self.peers]
        if not self.store.check(keys):
            present = [r for r in self.peers if self.store.check([f"hb/{r}"])]
        else:
            present = list(self.peers)
        values = self.store.multi_get([f"hb/{r}" for r in present]) if present else []
        for r, raw in zip(present, values):
            info = json.loads(raw)
            view = self.peers[r]
            marker = (info["incarnation"], info["count"])
            if marker != (view.info.get("incarnation"), view.count):
                view.count, view.changed_at = info["count"], now
            if info["gen"] < self.gen:
                view.behind_since = view.behind_since or now
            else:
                view.behind_since = None
            view.info = info
            if self.verdicts:
                self._withdraw_stale(r, info)
        judged = []
        for r in present:
            view = self.peers[r]
            if view.info.get("phase") == "done":
                continue  # finished and said so
            silent = now - view.changed_at
            allow = self.hang_grace_s + (self.collective_timeout_s
                                         if view.info.get("phase") == "collective" else 0.0)
            if silent > self.timeout_s:
                judged.append((r, "silent", silent))
            elif view.behind_since is not None and now - view.behind_since > allow:
                judged.append((r, "hung", now - view.behind_since))
        if judged and self._is_actor({r for r, _, _ in judged}):
            for r, reason, waited in judged:
                self._declare(r, reason, waited)

    def _is_actor(self, failed: set[int]) -> bool:
        """Act only on the lowest-ranked rank that is not itself judged failed."""
        alive = [r for r in range(self.world_size) if r not in failed]
        return bool(alive) and alive[0] == self.rank

    def _declare(self, rank: int, reason: str, waited_s: float) -> None:
        info = self.peers[rank].info
        ident = (rank, info.get("incarnation"))
        if ident in self._acted:
            return
        self._acted.add(ident)
        verdict = Verdict(rank=rank, reason=reason, waited_s=waited_s, pid=info.get("pid"),
                          host=info.get("host"), incarnation=info.get("incarnation"),
                          gen=info.get("gen"), step=info.get("step"))
        self.verdicts.append(verdict)
        body = json.dumps(dict(by=self.rank, reason=reason, waited_s=round(waited_s, 3),
                               gen=verdict.gen))
        self.store.set(f"failed/{rank}/{verdict.incarnation}", body)
        if self.kill:
            self.store.set(f"kill/{rank}/{verdict.incarnation}", body)
            if verdict.host == host_name() and verdict.pid:
                try:
                    os.kill(verdict.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # already gone (a crash): nothing to kill
        log.warning("rank %d declared rank %d failed (%s for %.1f s)", self.rank, rank, reason,
                    waited_s)
        if self.on_verdict is not None:
            self.on_verdict(verdict)
