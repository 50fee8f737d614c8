"""ElasticSession: the process group of a run as a sequence of generations, with heartbeats
and in-process recovery.

    session = ElasticSession(ElasticConfig())          # reads torchrun's environment
    session.start()                                     # joins a generation, starts heartbeats
    trainer = Trainer(..., checkpointer=ckpt, elastic=session)
    trainer.fit()                                       # calls session.recover(...) on failures
    session.close()

Recovery in process (``recover``): the failed generation's groups are aborted (peers blocked
on them fail at once instead of at their timeout), every rank moves to the next generation
(a new group over a fresh store prefix, never the broken one), the checkpointer is rebound to
it (host-memory snapshots survive), the Trainer rebuilds its model, optimizer and hooks on the
new layout, and the newest checkpoint is restored: from host memory when every rank's snapshot
survives (own, or a peer's copy for a replacement process), else from storage. A dead rank must
be replaced by a new process for the generation to form: torchrun restarts every rank (then
nothing is in memory, and all restore from storage); the local supervisor
(:mod:`~trainpilot.runtime.elastic.local`) replaces just that rank, like a per-replica launcher.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from trainpilot.runtime.elastic.config import ElasticConfig
from trainpilot.runtime.elastic.heartbeat import Heartbeat, Verdict
from trainpilot.runtime.elastic.rendezvous import (
    Generations,
    WorkerEnv,
    abort_world,
    base_store,
    client_store,
    host_name,
)

if TYPE_CHECKING:
    from trainpilot.runtime.trainer import Trainer

log = logging.getLogger(__name__)


class JoinTimeout(RuntimeError):
    """A generation did not form within ``join_timeout_s`` (a rank never came back)."""


class ElasticSession:
    """Generations, heartbeats and in-process recovery for one worker process."""

    def __init__(self, config: ElasticConfig = ElasticConfig(), *, backend: str | None = None,
                 env: WorkerEnv | None = None):
        from trainpilot.runtime.layout import default_backend

        self.config = config
        self.env = env or WorkerEnv.from_environ()
        self.backend = backend or default_backend()
        self.store = base_store(self.env, timeout_s=config.join_timeout_s)
        self.gens = Generations(self.store, self.env)
        self.gen = -1
        self.heartbeat: Heartbeat | None = None
        self.num_recoveries = 0
        self.emit: Callable[[str, dict[str, Any]], None] = lambda kind, payload: None
        self.history: list[dict[str, Any]] = []  # one entry per recovery (timings)

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def is_replacement(self) -> bool:
        """This process replaces one that died (same torchrun attempt, same rank)."""
        return self.gens.incarnation > 1

    # -- joining -----------------------------------------------------------------------------
    def start(self) -> int:
        """Join this process's first generation and start the heartbeat; returns the
        generation. Collective with the other ranks joining it."""
        gen = self._join(self.gens.generation_to_join())
        prefixed = dist.PrefixStore(self.env.namespace,
                                    client_store(self.env, self.config.join_timeout_s))
        cfg = self.config
        self.heartbeat = Heartbeat(
            prefixed, rank=self.rank, world_size=self.env.world_size,
            incarnation=self.gens.incarnation, interval_s=cfg.heartbeat_interval_s,
            timeout_s=cfg.heartbeat_timeout_s, hang_grace_s=cfg.hang_grace_s,
            collective_timeout_s=cfg.collective_timeout_s, kill=cfg.kill_hung,
            on_verdict=self._on_verdict)
        self.heartbeat.update(gen=gen)
        self.heartbeat.start()
        return gen

    def _join(self, gen: int) -> int:
        """Meet every rank in generation ``gen`` (or a later one if ``gen`` fails to form) and
        initialise its process group."""
        deadline = time.monotonic() + self.config.join_timeout_s
        while True:
            if self.heartbeat is not None:
                self.heartbeat.update(gen=gen)
            if self._barrier(gen, deadline):
                try:
                    self.gens.join(gen, backend=self.backend,
                                   timeout_s=self.config.collective_timeout_s)
                    self.gen = gen
                    return gen
                except (RuntimeError, dist.DistStoreError) as err:
                    log.warning("generation %d failed to form: %s", gen, err)
                    abort_world()
            if time.monotonic() > deadline:
                raise JoinTimeout(f"rank {self.rank}: no complete generation after "
                                  f"{self.config.join_timeout_s:.0f} s (last tried {gen})")
            gen = self.gens.advance(gen)

    def _barrier(self, gen: int, deadline: float) -> bool:
        """Wait until every rank arrived at ``gen``; False if a newer generation started or
        the deadline passed (the store's own wait would use the short collective timeout)."""
        store, world = self.gens.store, self.env.world_size
        store.add(f"gen{gen}/arrived", 1)
        start = time.monotonic()
        while time.monotonic() < deadline:
            if int(store.add(f"gen{gen}/arrived", 0)) >= world:
                return True
            if self.gens.current() > gen:
                return False
            lost = self._lost_elsewhere(since=start)
            if lost is not None:
                raise JoinTimeout(
                    f"rank {self.rank}: rank {lost.rank} on host {lost.host} is gone "
                    f"({lost.reason} for {lost.waited_s:.1f} s) and nothing on this host can "
                    "replace it: leaving, so that torchrun re-forms the job")
            time.sleep(0.02)
        return False

    def _lost_elsewhere(self, *, since: float) -> Verdict | None:
        """A peer this rank declared failed (silent, or hung: it is killed) that ran on another
        host. Only a supervisor on one machine replaces a single process (``LocalSupervisor``);
        across hosts torchrun re-forms the whole job, and it only does so once a worker here
        fails: waiting out ``join_timeout_s`` for a replacement that cannot come would only
        lose that time. It waits first for torchrun's rendezvous to drop the silent host
        (``TRAINPILOT_RDZV_DEAD_S``, set by the launcher, plus 3 s): a standby waiting there
        then re-forms the job without using one of ``--max-restarts``."""
        if self.heartbeat is None:
            return None
        dead_s = float(os.environ.get("TRAINPILOT_RDZV_DEAD_S", "0")) + 3.0
        if time.monotonic() - since < dead_s:
            return None
        here = host_name()
        for verdict in self.heartbeat.verdicts:
            view = self.heartbeat.peers.get(verdict.rank)
            still = view is not None and view.info.get("incarnation") == verdict.incarnation
            if still and verdict.host not in (None, here):
                return verdict  # that very process, not a replacement that came back since
        return None

    # -- failures ----------------------------------------------------------------------------
    def _on_verdict(self, verdict: Verdict) -> None:
        self.emit("failure_detected", dict(rank=verdict.rank, reason=verdict.reason,
                                           waited_s=round(verdict.waited_s, 3),
                                           gen=verdict.gen, step=verdict.step,
                                           by=self.rank, killed=self.config.kill_hung))

    def phase(self, name: str) -> None:
        """Tell the heartbeat whether this rank may now be blocked on its peers
        (``"collective"``) or is computing on its own (``"compute"``)."""
        if self.heartbeat is not None:
            self.heartbeat.update(phase=name)

    def can_recover(self) -> bool:
        """False when recovery is configured as ``restart`` (the process exits and torchrun
        restarts every rank) or ``max_recoveries`` were used up."""
        return (self.config.recovery == "in_process"
                and self.num_recoveries < self.config.max_recoveries)

    def recover(self, trainer: Trainer, err: BaseException) -> dict[str, Any]:
        """Rebuild the group and restore ``trainer`` from the newest checkpoint, in process
        (re-raises ``err`` when :meth:`can_recover` says no). Returns the recovery's timings
        (seconds)."""
        if not self.can_recover():
            raise err
        failed_at = time.time()
        t0 = time.perf_counter()
        failed_gen, failed_step = self.gen, trainer.step
        self.num_recoveries += 1
        log.warning("rank %d: %s at step %d (generation %d); recovering in process",
                    self.rank, type(err).__name__, failed_step + 1, failed_gen)
        # Announce the move at once: a peer that sees this rank still in the failed generation
        # for long would declare it hung. The heartbeat says so before the store is asked: cut
        # off, that request waits for the heal, and the heartbeat thread's own connection may
        # come back first and find a kill issued for the failed generation, stale only if
        # this rank already reports a newer one (it otherwise killed a rank that was joining).
        if self.heartbeat is not None:
            self.heartbeat.update(gen=failed_gen + 1, phase="recovery")
        target = self.gens.advance(failed_gen)
        if self.heartbeat is not None:
            self.heartbeat.update(gen=target)
        trainer.teardown()
        # Peers blocked on this group notice at their collective timeout (gloo cannot abort a
        # group; a process that died closes its sockets and is noticed at once).
        abort_world()
        gen = self._join(target)
        t_joined = time.perf_counter()
        layout = trainer.new_layout()
        if trainer.checkpointer is not None:
            # A save still in flight on the failed generation cannot finish its collectives
            # (its peers left the group): give it a moment, then abandon it.
            trainer.checkpointer.rebind(drain_timeout_s=self.config.drain_timeout_s)
        trainer.rebuild(layout)
        t_rebuilt = time.perf_counter()
        restored = trainer.restore()
        t_restored = time.perf_counter()
        info = dict(reason="in_process", error=f"{type(err).__name__}: {str(err)[:200]}",
                    failed_gen=failed_gen, gen=gen, failed_step=failed_step + 1,
                    restored_step=restored.step if restored else 0,
                    source=restored.source if restored else "initial",
                    failed_at_unix_s=failed_at, rendezvous_s=t_joined - t0,
                    rebuild_s=t_rebuilt - t_joined, restore_s=t_restored - t_rebuilt,
                    recovery_s=t_restored - t0)
        self.history.append(info)
        return info

    def close(self) -> None:
        """Stop the heartbeat (call after the last collective; every rank should)."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
