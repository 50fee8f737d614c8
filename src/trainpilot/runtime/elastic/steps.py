"""The checkpoint and recovery steps of the Trainer's loop (``Trainer.fit`` calls these).

* :func:`resume` — at the start: restore the newest checkpoint if there is one anywhere (a
  process restarted by torchrun, or a replacement process, picks up where the run was).
* :func:`save_if_due` — after a step: snapshot every ``checkpoint_every`` steps to host memory
  (and a peer's), every ``storage_every``-th of them also to storage, in the background.
* :func:`recover_or_raise` — on an error: recover in process through the elastic session when
  the error means "a peer or the group failed", else re-raise (torchrun then restarts).
* :func:`restore` — the restore itself: the template is the live state (so sharded tensors
  are filled in place and resharded by DCP), the per-rank comm state follows.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainpilot.runtime.checkpoint.layout import committed
from trainpilot.runtime.checkpoint.manager import to_storage
from trainpilot.runtime.preempt import Preempted
from trainpilot.specs.errors import SpecError

if TYPE_CHECKING:
    from trainpilot.runtime.trainer import Trainer


class NoValidCheckpoint(SpecError):
    """Checkpoints exist but none of them can be restored: the run must not silently start
    over from step 0 (the user says so with ``--resume never``)."""

    def __init__(self, root: Any, skipped: list[str]):
        self.skipped = skipped
        detail = "; ".join(skipped[:3]) or "none passed verification"
        super().__init__("--resume", "auto", f"no valid checkpoint in {root} ({detail}); "
                         "valid: --resume never to start over (the old run is moved to "
                         "previous/), or repair them")


def _anything_to_restore(trainer: Trainer) -> bool:
    """Whether any rank holds a snapshot in memory or storage has a committed checkpoint.
    Decided collectively (every rank gets the same answer). Asked first because building a
    restore template initialises a fresh optimizer's state, which a fresh run must not do."""
    ckpt = trainer.checkpointer
    local = bool(committed(ckpt.root)) or bool(ckpt.memory.own) or bool(ckpt.memory.held)
    return not ckpt.group.all_true(not local)


def _restarted_in_this_launch() -> bool:
    """Whether this launcher already ran a worker that is gone: torchrun re-formed the job
    without counting a restart (a membership change: a node lost and a standby joined, or a
    node added). The launcher's node-local watch folder keeps every worker's beacon."""
    watch = os.environ.get("TRAINPILOT_WATCH_DIR")
    if not watch:
        return False
    for path in Path(watch).glob("rank*.beat.*"):
        pid = int(path.name.rsplit(".", 1)[1])
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            return True
    return False


def resume(trainer: Trainer) -> Any:
    """Restore the newest checkpoint at the start of ``fit`` (None on a fresh run: nothing is
    touched). A replacement process runs the same collectives here as its peers in
    :meth:`ElasticSession.recover`."""
    if trainer.checkpointer is None:
        return None
    restored = restore(trainer, reset=False, fail_if_none=True)
    elastic = trainer.elastic
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    replacement = elastic is not None and elastic.is_replacement
    reason = ("replacement" if replacement else "torchrun" if restarts > 0
              else "membership" if _restarted_in_this_launch() else "resume")
    if restored is None:
        if reason != "resume":  # restarted before any checkpoint was committed: from scratch
            trainer.emit("restart", dict(reason=reason, restored_step=0, source="initial",
                                         restore_s=0.0, world_size=trainer.layout.world_size,
                                         attempt=restarts, skipped=[]))
        return None
    trainer.emit("restart", dict(reason=reason, restored_step=restored.step,
                                 source=restored.source, restore_s=restored.restore_s,
                                 saved_world_size=restored.saved_world_size,
                                 world_size=trainer.layout.world_size, attempt=restarts,
                                 skipped=restored.skipped))
    return restored


def save_if_due(trainer: Trainer) -> Any:
    """Save at every ``checkpoint_every``-th step (default: the plan's interval)."""
    ckpt = trainer.checkpointer
    if ckpt is None:
        return None
    every = trainer.config.checkpoint_every or trainer.plan.checkpoint.interval_steps
    if trainer.step % every:
        return None
    storage = to_storage(trainer.step, every, trainer.config.storage_every)
    report_failed_save(trainer)
    previous = _written(trainer.last_save)
    trainer.set_phase("collective")  # the save waits for the previous one's collectives
    handle = ckpt.save(trainer.step, trainer.state_dict(rng=False),
                       rank_state=trainer.rank_state(), to_storage=storage,
                       overlap=trainer.overlap_checkpoint_copy)
    trainer.set_phase("compute")
    trainer.num_saves += 1
    trainer.last_save = handle
    # Overlapped: the copy's remaining wait, if any, is the next step's checkpoint_wait_s.
    trainer.emit("checkpoint", dict(step=trainer.step, stall_s=handle.stall_s,
                                    wait_s=handle.wait_s, to_storage=storage,
                                    in_memory_peer=ckpt.config.in_memory_peer,
                                    previous=previous, overlapped=handle.report.overlapped))
    report_failed_save(trainer)  # a synchronous save has already finished
    return handle


def save_now(trainer: Trainer) -> Any:
    """Save this step to storage and wait until it is durable (the last-moment checkpoint of
    a preemption). Reuses a save of this very step that already went to storage."""
    ckpt = trainer.checkpointer
    if ckpt is None or trainer.step == 0:
        return None
    # The save in flight first: its writer thread runs collectives on the checkpointer's group,
    # and this thread's must not interleave with them.
    trainer.set_phase("collective")
    report_failed_save(trainer, wait=True)
    # Which signal it was: the rank that received it may not be this one.
    mine = trainer.preempt.signal_name if trainer.preempt is not None else ""
    trainer.preempt_signal = next((s for s in ckpt.group.all_gather(mine) if s), "")
    last = trainer.last_save
    if (last is not None and last.step == trainer.step and last.report.to_storage
            and last.done() and last.future.exception() is None):
        trainer.set_phase("compute")
        trainer.preempt_checkpoint = last.report.path
        return last
    handle = ckpt.save(trainer.step, trainer.state_dict(rng=False),
                       rank_state=trainer.rank_state(), to_storage=True, overlap=False)
    trainer.num_saves += 1
    trainer.last_save = handle
    report = ckpt.wait()
    trainer.set_phase("compute")
    trainer.preempt_checkpoint = report.path if report is not None else None
    trainer.emit("checkpoint", dict(step=trainer.step, stall_s=handle.stall_s,
                                    wait_s=handle.wait_s, to_storage=True, last_moment=True,
                                    in_memory_peer=ckpt.config.in_memory_peer,
                                    previous=None, overlapped=False))
    return handle


def _written(handle: Any) -> dict[str, Any] | None:
    """How long the previous save took to become durable in the background (peer copy,
    storage write) and what it wrote; None if it is still running or failed."""
    if handle is None or not handle.done() or handle.future.exception() is not None:
        return None
    rep = handle.future.result()
    return dict(step=rep.step, exchange_s=rep.exchange_s, write_s=rep.write_s,
                bytes_written=rep.bytes_written, bytes_raw=rep.bytes_raw)


def report_failed_save(trainer: Trainer, *, wait: bool = False) -> None:
    """Emit ``checkpoint_failed`` once for the last save if it failed (training goes on: the
    next save may succeed, and restores use the newest intact checkpoint). ``wait``: let it
    finish first (the end of training)."""
    handle = trainer.last_save
    if handle is None or handle.reported:
        return
    if wait:
        trainer.checkpointer.wait() if trainer.checkpointer.config.on_write_error == "raise" \
            else handle.future.exception()
    if not handle.done():
        return
    handle.reported = True
    err = handle.future.exception()
    if err is not None:
        from trainpilot.runtime.degrade import disk_of

        code = getattr(err, "errno", None)
        where = disk_of(trainer.checkpointer.root) if code in (28, 122) else {}
        trainer.emit("checkpoint_failed", dict(step=handle.step, error=str(err)[:300],
                                               errno=code, **where))


def restore(trainer: Trainer, *, max_step: int | None = None, source: str = "auto",
            reset: bool = True, monitor: bool = True, fail_if_none: bool | None = None) -> Any:
    """Restore the newest checkpoint at or before ``max_step``; None when nothing was saved
    yet (then, with ``reset``, the initial state is rebuilt). ``monitor``: also the health
    monitor's state (not for the monitor's own rollback). Collective.

    When checkpoints exist but none restores, :class:`NoValidCheckpoint` is raised
    (``fail_if_none``, the default unless ``max_step`` is given: a rollback to before the first
    checkpoint is a rollback to the initial state)."""
    ckpt = trainer.checkpointer
    if ckpt is None or not _anything_to_restore(trainer):
        if reset:
            trainer.reset()
        return None
    restored = ckpt.restore_latest(trainer.state_dict(rng=False), source=source,
                                   max_step=max_step)
    if restored is None:
        if fail_if_none if fail_if_none is not None else max_step is None:
            raise NoValidCheckpoint(ckpt.root, list(getattr(ckpt, "last_skipped", None) or []))
        # The template above initialised the optimizer's state: build it afresh.
        trainer.reset()
        return None
    trainer.load_state_dict(restored.state)
    trainer.load_rank_state(restored.rank_state, monitor=monitor)
    if monitor and trainer.monitor is not None and restored.step not in trainer.monitor.good_steps:
        # Its state was saved before this checkpoint's own event marked it: judge it now, as
        # the monitor did then (the same alerts and flags).
        trainer.monitor.mark_checkpoint(restored.step, log=False)
    return restored


def recover_or_raise(trainer: Trainer, err: BaseException) -> None:
    """Recover from ``err`` in process, or re-raise it. A failure during the recovery itself
    (another rank died meanwhile) starts the next one (the session bounds how many)."""
    from trainpilot.runtime.elastic.retry import is_recoverable
    from trainpilot.runtime.elastic.session import JoinTimeout

    guard = trainer.preempt
    while True:
        if (trainer.elastic is None or not trainer.elastic.can_recover()
                or not is_recoverable(err) or isinstance(err, JoinTimeout)):
            raise err
        try:
            with guard.during_failure() if guard is not None else contextlib.nullcontext():
                info = trainer.elastic.recover(trainer, err)
        except Exception as again:  # noqa: BLE001 - judged by the loop
            if isinstance(again, Preempted):
                raise
            err = again
            continue
        trainer.emit("restart", info)
        return
