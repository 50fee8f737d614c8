"""The Checkpointer: save a training state in one call, restore the newest intact one in one.

    ckpt = Checkpointer(CheckpointConfig(root_dir="runs/x/ckpt"), process_group=pg)
    handle = ckpt.save(step, trainer.state_dict())      # blocks only for the host snapshot
    ...                       # (overlap=True: not even that; call ckpt.fence() before the
    ...                       #  next optimizer step)
    restored = ckpt.restore_latest(trainer.state_dict())  # memory first, then storage
    if restored is not None:
        trainer.load_state_dict(restored.state)

``state`` is global: plain tensors are replicated across ranks (each written once), DTensors
are sharded (each rank writes its shard; DCP reshards on load), non-tensor leaves must be the
same on every rank (rank 0's are stored). ``rank_state`` holds what differs per rank (a per-rank
sampler cursor); RNG states of every rank are captured and restored automatically.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from trainpilot.runtime.checkpoint import codec, layout, restore
from trainpilot.runtime.checkpoint.config import (
    CheckpointConfig,
    CheckpointWriteError,
    Restored,
    SaveReport,
)
from trainpilot.runtime.checkpoint.nodemem import NodeMemory
from trainpilot.runtime.checkpoint.peer import MemoryTier, default_offset, ring_exchange
from trainpilot.runtime.checkpoint.rng import capture_rng_state, restore_rng_state
from trainpilot.runtime.checkpoint.snapshot import (
    GLOBAL,
    HostSnapshot,
    fill_snapshot,
    on_host,
    prepare_snapshot,
    restore_tensors,
)
from trainpilot.runtime.checkpoint.storage import CheckpointWriter, index_from_manifest

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SaveHandle:
    """A save in flight. ``stall_s`` is what the caller paid; :meth:`result` waits for the
    peer copy and the storage write and returns the :class:`SaveReport` (or raises
    :class:`CheckpointWriteError`)."""

    step: int
    stall_s: float
    wait_s: float
    future: Future
    staged: Future  # done when the host snapshot is complete (see Checkpointer.fence)
    report: SaveReport
    error_seen: bool = False  # the caller got the error from result(): do not raise it again
    fenced: bool = False  # fence() has waited for this save's copy (its wait is counted once)
    reported: bool = False  # its outcome was reported (a failure emitted once, by the Trainer)

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> SaveReport:
        try:
            return self.future.result(timeout)
        except CheckpointWriteError:
            self.error_seen = True
            raise


@dataclass(frozen=True, kw_only=True)
class _Bound:
    """What one save runs with, fixed when it is submitted (see ``Checkpointer._write_job``)."""

    group: restore.Group
    peer_offset: int
    generation: int


class Checkpointer:
    """Async, incremental, verified checkpoints with an in-memory peer tier (see module doc).

    ``process_group``: the ranks that checkpoint together (default: the world); the
    checkpointer builds its own gloo group over them, so its background collectives never
    interleave with training's. Construction is collective: over the world, every rank
    constructs it (in the same order as its other ``new_group`` calls); over a subgroup, its
    members do. ``faults``: a FaultInjector, for tests and chaos runs.
    """

    def __init__(self, config: CheckpointConfig, *, process_group: Any = None,
                 faults: Any = None):
        self.config, self.faults = config, faults
        self.root = Path(config.root_dir)  # already a Path (the config normalises it)
        self.memory = MemoryTier()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tp-ckpt")
        self._inflight: SaveHandle | None = None
        self._base: dict | None = None  # sha256 -> location of the last committed checkpoint
        self._base_name: str | None = None  # ... and that checkpoint's folder
        self._num_storage_saves = 0
        self.reports: deque[SaveReport] = deque(maxlen=256)  # the most recent saves
        self.errors: list[CheckpointWriteError] = []
        # Bumped by every rebind: a save abandoned on the old group sees it and stops (its
        # thread cannot be killed), never reaching the new group or the shared state below.
        # The lock orders the bump against a save's disk steps (``_current``).
        self._generation = 0
        self._generation_lock = threading.Lock()
        self.rebind(process_group)
        self.node_memory: NodeMemory | None = None
        if config.node_memory_dir is not None:
            # A restarted worker finds what its predecessor on this node held.
            self.node_memory = NodeMemory(config.node_memory_dir,
                                          local_rank=int(os.environ.get("LOCAL_RANK", "0")))
            self.node_memory.load(self.memory, rank=self.rank)

    # -- group -----------------------------------------------------------------------------
    def rebind(self, process_group: Any = None, *, drain_timeout_s: float | None = None,
               ) -> None:
        """Build the checkpointer's group over ``process_group``'s ranks (after a group was
        rebuilt, e.g. in-process recovery). Host-memory snapshots are kept; a save still in
        flight on the old group gets ``drain_timeout_s`` (default ``config.drain_timeout_s``)
        to finish, then is abandoned (after a failure its collectives cannot complete)."""
        self._drain(raise_errors=False, timeout_s=self.config.drain_timeout_s
                    if drain_timeout_s is None else drain_timeout_s)
        with self._generation_lock:
            self._generation += 1
        self._destroy_group()
        if dist.is_available() and dist.is_initialized():
            pg = process_group if process_group is not None else dist.group.WORLD
            ranks = dist.get_process_group_ranks(pg)
            # Over the whole world: a counter-named group, unique even after a destroy. Over a
            # subgroup only its members can call; torch names such groups by a hash of the
            # ranks and the number of live groups, so a destroyed one's name (and its stale
            # rendezvous keys) could come back: those are never destroyed.
            self._owns_group = len(ranks) == dist.get_world_size()
            timeout = timedelta(seconds=self.config.group_timeout_s)
            if self._owns_group:
                own = dist.new_group(backend="gloo", timeout=timeout)
            else:
                own = dist.new_group(ranks, backend="gloo", timeout=timeout,
                                     use_local_synchronization=True)
            self.group = restore.Group(pg=own, rank=dist.get_rank(own),
                                       world_size=dist.get_world_size(own))
        else:
            self.group = restore.Group(pg=None, rank=0, world_size=1)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
        self.peer_offset = self.config.peer_offset or default_offset(self.group.world_size,
                                                                     local)

    def _destroy_group(self) -> None:
        group = getattr(self, "group", None)
        if group is None or group.pg is None or not self._owns_group:
            return
        try:
            dist.destroy_process_group(group.pg)
        except (ValueError, RuntimeError):
            pass  # already gone with the world it belonged to (destroyed after a failure)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    # -- save ------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, rank_state: Any = None,
             to_storage: bool = True, overlap: bool = False) -> SaveHandle:
        """Snapshot ``state`` to host memory and return; the peer copy and (if
        ``to_storage``) the storage write continue in the background. Collective: every rank
        of the group calls it with the same step. At most one save is in flight: this call
        first waits for the previous one.

        ``overlap``: return before the tensors of ``state`` are copied; the writer thread
        copies them while the caller goes on (the next step's forward and backward, which do
        not change weights or optimizer state), and the caller must call :meth:`fence` before
        it changes any of them (before the optimizer step). ``rank_state`` and the RNG states
        are copied before the call returns either way, as is a state on an accelerator (its
        device-to-host copy is not overlapped yet)."""
        start = time.perf_counter()
        self._drain(raise_errors=self.config.on_write_error == "raise")
        waited = time.perf_counter() - start
        rank_full = {"user": rank_state,
                     "rng": capture_rng_state() if self.config.capture_rng else None}
        reuse = self.memory.recyclable_own()
        if reuse is not None:
            self.memory.own.popleft()  # overwritten below; never keep a half-copied slot
        snap, pending = prepare_snapshot(step, state, rank_full, rank=self.rank,
                                         world_size=self.world_size, reuse=reuse)
        deferred: list = []
        if overlap and self.config.async_save and on_host(pending):
            deferred = [(e, t) for e, t in pending if e.scope == GLOBAL]
            pending = [(e, t) for e, t in pending if e.scope != GLOBAL]
        fill_snapshot(snap, pending)
        self.memory.own.append(snap)  # restores drain the save first: never read half-copied
        report = SaveReport(step=step, stall_s=0.0, wait_s=waited, snapshot_bytes=snap.nbytes,
                            to_storage=to_storage, overlapped=bool(deferred))
        staged: Future = Future()
        if not deferred:
            staged.set_result(0.0)
        if self.config.async_save:
            future = self._executor.submit(self._write_job, snap, report, deferred, staged,
                                           self._bound())
        else:
            future = Future()
            try:
                future.set_result(self._write_job(snap, report, deferred, staged,
                                                  self._bound()))
            except BaseException as err:  # noqa: BLE001 (CheckpointException is a BaseException)
                future.set_exception(err)
        # Measured after the hand-off: the writer thread may hold the GIL for a moment.
        report.stall_s = stall = time.perf_counter() - start
        self._inflight = SaveHandle(step=step, stall_s=stall, wait_s=waited, future=future,
                                    staged=staged, report=report)
        return self._inflight

    def fence(self) -> float:
        """Wait until the snapshot of the newest save is complete; returns the seconds waited
        (added to that save's ``stall_s``). After ``save(overlap=True)``, call it before
        changing any tensor of the saved state. Instant when nothing is being copied."""
        handle = self._inflight
        if handle is None or handle.fenced:
            return 0.0
        start = time.perf_counter()
        wait_futures([handle.staged])  # an error surfaces through result(), not here
        waited = time.perf_counter() - start
        handle.fenced, handle.report.fence_s = True, waited
        handle.stall_s += waited
        handle.report.stall_s += waited
        return waited

    def wait(self) -> SaveReport | None:
        """Block until the save in flight (if any) is done; returns its report."""
        return self._drain(raise_errors=True)

    def _drain(self, *, raise_errors: bool, timeout_s: float | None = None,
               ) -> SaveReport | None:
        handle, self._inflight = getattr(self, "_inflight", None), None
        if handle is None:
            return None
        seen = handle.error_seen
        try:
            return handle.result(timeout_s)
        except FutureTimeout:
            # Stuck in a collective with a dead peer: the thread cannot be killed, so leave it
            # to fail when its group goes away and give later saves a fresh writer thread.
            log.warning("abandoning the save of step %d (still running after %.0f s)",
                        handle.step, timeout_s)
            self._executor.shutdown(wait=False)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tp-ckpt")
            return None
        except CheckpointWriteError as err:
            self.errors.append(err)
            if raise_errors and not seen:
                raise
            log.warning("%s", err)
            return None

    def _bound(self) -> _Bound:
        return _Bound(group=self.group, peer_offset=self.peer_offset,
                      generation=self._generation)

    @contextlib.contextmanager
    def _current(self, generation: int) -> Iterator[None]:
        """Hold off a rebind while a save of ``generation`` touches the checkpoint folders;
        raise if a rebind already made it stale. An abandoned save's collectives on the old
        group can complete after the heal: its coordinator then planned late (setting aside
        and deleting the folders without a manifest, the new timeline's save in progress
        among them: a committed step whose data files were gone, seen once in CI's 10 s
        partition test)."""
        with self._generation_lock:
            if generation != self._generation:
                raise RuntimeError("abandoned: the checkpoint group was rebuilt while this "
                                   "save ran; it leaves the checkpoint folders alone")
            yield

    def _check_current(self, snap: HostSnapshot, bound: _Bound) -> None:
        """Stop a save whose group was replaced while it ran (abandoned by ``rebind``)."""
        if bound.generation != self._generation:
            raise CheckpointWriteError(snap.step, {bound.group.rank: RuntimeError(
                "abandoned: the checkpoint group was rebuilt while this save ran")})

    def _write_job(self, snap: HostSnapshot, report: SaveReport, deferred: list,
                   staged: Future, bound: _Bound) -> SaveReport:
        # Every collective of this save runs on the group it was submitted on (``bound``),
        # never on ``self.group``: after an in-process recovery rebinds, a save abandoned on
        # the old group would otherwise carry on over the new one, out of step with the new
        # saves there (a 60 s gloo timeout that broke the new group for good: seen in CI's
        # 10 s partition test, the step-3 save in flight when the cut came).
        group = bound.group
        if deferred:
            t = time.perf_counter()
            try:
                fill_snapshot(snap, deferred)
            except BaseException as err:
                staged.set_exception(err)
                raise CheckpointWriteError(snap.step, {group.rank: err}) from err
            report.copy_s = time.perf_counter() - t
            staged.set_result(report.copy_s)
        try:
            held = None
            if self.config.in_memory_peer and group.world_size > 1:
                t = time.perf_counter()
                held = ring_exchange(self.memory, snap, group=group.pg,
                                     offset=bound.peer_offset)
                report.exchange_s = time.perf_counter() - t
            self._check_current(snap, bound)
            if self.node_memory is not None:
                self._spill(snap, held)
            if report.to_storage:
                t = time.perf_counter()
                self._write_storage(snap, report, bound)
                report.write_s = time.perf_counter() - t
        except CheckpointWriteError:
            raise
        except Exception as err:  # a failed peer exchange, a bad state, ...
            raise CheckpointWriteError(snap.step, {group.rank: err}) from err
        self._check_current(snap, bound)
        self.reports.append(report)
        return report

    def _spill(self, snap: HostSnapshot, held: HostSnapshot | None) -> None:
        """Copy the completed snapshots into the node's memory folder; a failure there (the
        RAM folder full) costs that shortcut only, never the save."""
        node = self.node_memory
        if node is None:
            return
        try:
            node.spill(snap, kind="own")
            if held is not None:
                node.spill(held, kind="held")
        except OSError as err:
            log.warning("step %d not kept in the node's memory folder: %s", snap.step, err)

    def _write_storage(self, snap: HostSnapshot, report: SaveReport, bound: _Bound) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        cfg = self.config
        full = (not cfg.incremental or self._base is None
                or self._num_storage_saves % cfg.full_every == 0)
        writer = CheckpointWriter(
            root=self.root, step=snap.step, compression="zstd" if cfg.compress else "raw",
            zstd_level=cfg.zstd_level, max_file_bytes=cfg.max_file_bytes,
            base=None if full else self._base, base_name=self._base_name, faults=self.faults,
            guard=lambda: self._current(bound.generation),
        )
        group = bound.group
        state = snap.dcp_state(rank=group.rank, is_coordinator=group.rank == 0)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to")
                dcp.save(state, storage_writer=writer, process_group=group.pg,
                         no_dist=group.pg is None)
        except CheckpointException as err:
            # This save's torn folder is garbage; nothing else is ours to delete. A save
            # abandoned with its group (``rebind``) fails long after a newer timeline started
            # writing its own folders: it leaves the disk alone (the next save's planning
            # clears torn folders).
            if group.rank == 0 and bound.generation == self._generation:
                layout.remove_torn(self.root, writer.name)
            failures = {r: (e[0] if isinstance(e, tuple) else e) for r, e in err.failures.items()}
            raise CheckpointWriteError(snap.step, failures) from None
        # Committed on the old group: keep nothing of it. The check and everything after it
        # (the incremental base, retention's deletions) hold off a rebind, as the writer's
        # disk steps do (``_current``): checked without the lock, a rebind landing between
        # the check and retention would let the old timeline delete the new one's folders.
        with self._generation_lock:
            self._check_current(snap, bound)
            self._num_storage_saves += 1
            self._base = writer.index if cfg.incremental else None
            self._base_name = writer.name
            report.incremental = writer.used_base
            report.path = str(self.root / writer.name)
            report.bytes_raw = writer.stats.bytes_raw
            report.bytes_written = writer.stats.bytes_written
            report.bytes_referenced = writer.stats.bytes_referenced
            if group.rank == 0:
                assert writer.manifest_body is not None  # the coordinator's finish wrote it
                report.manifest_stats = dict(writer.manifest_body["stats"])
                report.removed = layout.apply_retention(self.root, keep_last=cfg.keep_last,
                                                        keep_every=cfg.keep_every)

    # -- restore ---------------------------------------------------------------------------
    def restore_latest(self, template: Any = None, *,
                       source: Literal["auto", "memory", "storage"] = "auto",
                       restore_rng: bool = True, strict: bool = True,
                       max_step: int | None = None) -> Restored | None:
        """Restore the newest intact checkpoint; None when there is none anywhere.

        Collective over the group. ``template``: a state of the same structure whose tensors
        (DTensors included) are filled in place; tensors it lacks are allocated. With
        ``strict``, a template tensor the checkpoint lacks is an error. Memory wins a tie with
        storage; a damaged storage checkpoint is skipped for the next older one.
        ``max_step``: only checkpoints at or before it (a rollback to an earlier step).
        """
        start = time.perf_counter()
        self._drain(raise_errors=False, timeout_s=self.config.drain_timeout_s)
        _, flat_template = codec.split_state(template if template is not None else {},
                                             root="template")
        skipped: list[str] = []
        candidates = ([] if source == "memory"
                      else restore.storage_candidates(self.root, self.group))
        if max_step is not None:
            candidates = [(s, n) for s, n in candidates if s <= max_step]
        plan = None if source == "storage" else restore.memory_plan(self.memory, self.group,
                                                                     max_step=max_step)
        mem_step = plan.step if plan is not None else -1
        for step, name in candidates:
            if step <= mem_step:
                break
            found = self._try_storage(name, flat_template, strict, skipped)
            if found is not None:
                return self._finish(found, "storage", start, restore_rng, skipped)
        if plan is not None:
            snap = restore.fetch_memory(self.memory, plan, self.group)
            if self.group.all_true(restore.fits(snap, flat_template, strict=strict)):
                state_t, rank_t = restore_tensors(snap, flat_template)
                state = codec.join_state(codec.loads(snap.global_tree), state_t)
                rank_state = codec.join_state(codec.loads(snap.rank_tree), rank_t)
                found = (snap.step, state, rank_state, None, snap.world_size)
                return self._finish(found, "memory", start, restore_rng, skipped)
            skipped.append(f"memory step {plan.step}: layout differs from the template")
        for step, name in candidates:
            if step <= mem_step:
                found = self._try_storage(name, flat_template, strict, skipped)
                if found is not None:
                    return self._finish(found, "storage", start, restore_rng, skipped)
        self.last_skipped = skipped  # why nothing restored (read by the caller's message)
        return None

    def _try_storage(self, name: str, template: dict, strict: bool, skipped: list[str]):
        body, reason = restore.verify(self.root, name, self.group, check_files=self.config.verify)
        if body is None:
            skipped.append(f"{name}: {reason}")
            log.warning("skipping checkpoint %s: %s", name, reason)
            return None
        state, rank_state = restore.load_storage(self.root, body, template, self.group,
                                                 strict=strict, chunks_verified=self.config.verify)
        self._base = index_from_manifest(body) if self.config.incremental else None
        self._base_name = name
        return body["step"], state, rank_state, str(self.root / name), body["world_size"]

    def _finish(self, found: tuple, source: Literal["memory", "storage"], start: float, restore_rng: bool,
                skipped: list[str]) -> Restored:
        step, state, rank_state, path, saved_world = found
        if source == "memory":
            self._base = None  # the next storage save is a full one
        self.memory.drop_after(step)
        if self.node_memory is not None:
            self.node_memory.drop_after(step)
        if self.rank == 0:
            layout.remove_uncommitted(self.root)
            if path is not None and layout.read_latest(self.root) != layout.step_dir_name(step):
                layout.write_latest(self.root, layout.step_dir_name(step))  # repair the pointer
        rng = (rank_state or {}).get("rng") if isinstance(rank_state, dict) else None
        if restore_rng and rng is not None:
            restore_rng_state(rng)
        user = rank_state.get("user") if isinstance(rank_state, dict) else None
        return Restored(step=step, state=state, rank_state=user, source=source, path=path,
                        saved_world_size=saved_world, restore_s=time.perf_counter() - start,
                        rng_restored=restore_rng and rng is not None, skipped=skipped)

    # -- lifecycle -------------------------------------------------------------------------
    def drop_memory(self) -> None:
        """Forget every host-memory snapshot (what a process restart does)."""
        self.memory.clear()

    def close(self) -> None:
        """Wait for the save in flight, stop the writer thread and destroy the checkpointer's
        group (every member must close, as they all built it)."""
        try:
            # No timeout: a healthy write may be long; a stuck one fails at the group timeout.
            self._drain(raise_errors=False)
        finally:
            self._executor.shutdown(wait=False)
            self._destroy_group()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
