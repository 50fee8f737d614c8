"""The checkpoint manager of a user's own loop: cadence plus a dict of ``Stateful`` states.

The shape of torchtitan's ``CheckpointManager``: the loop hands over what must survive (model,
optimizer, scheduler, sampler, monitor: anything with ``state_dict``/``load_state_dict``) once,
calls :meth:`CheckpointManager.load` before its first step and :meth:`maybe_save` after each
step; the manager owns the interval, the storage cadence, overlap and retention (one
``CheckpointPolicy`` of specs/plan.py, the same the Trainer reads), and the step number.

    manager = CheckpointManager(dict(model=model.module, optimizer=optimizer, sampler=sampler),
                                root_dir="runs/x/ckpt", policy=CheckpointPolicy(interval_steps=50))
    start = manager.load()                      # 0 on a fresh start
    for step in range(start + 1, steps + 1):
        ...                                     # forward, backward
        manager.wait_for_staging()              # only with overlap: before optimizer.step()
        optimizer.step()
        manager.maybe_save(step, last=step == steps)
    manager.close()
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from trainpilot.runtime.checkpoint.checkpointer import Checkpointer, SaveHandle
from trainpilot.runtime.checkpoint.config import CheckpointConfig
from trainpilot.specs.errors import SpecError
from trainpilot.specs.plan import CheckpointPolicy

STEP_KEY = "step"


def to_storage(step: int, interval: int, storage_every: int) -> bool:
    """Whether the save of ``step`` (on the ``interval``) goes to storage: every
    ``storage_every``-th interval, the first included. Counted by step, not by saves made: a
    restarted run keeps the uninterrupted run's storage cadence, whatever it restored."""
    return (step // interval - 1) % storage_every == 0


@runtime_checkable
class Stateful(Protocol):
    """What the manager saves and restores (``torch.distributed.checkpoint.stateful``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


class CheckpointManager:
    """Saves ``states`` every ``policy.interval_steps`` steps (to storage every
    ``storage_every``-th save, the others to the in-memory peer tier only) and restores them.

    ``overlap``: a save returns before the tensors are copied; call :meth:`wait_for_staging`
    before anything changes them (the optimizer step). ``checkpointer``: an existing one (the
    Trainer's, a test's); otherwise one is built from ``policy`` under ``root_dir``."""

    def __init__(self, states: Mapping[str, Stateful], *, root_dir: str | os.PathLike | None = None,
                 policy: CheckpointPolicy | None = None, storage_every: int = 1,
                 overlap: bool = False, faults: Any = None,
                 checkpointer: Checkpointer | None = None, **config: Any):
        if STEP_KEY in states:
            raise SpecError("states", STEP_KEY, f"'{STEP_KEY}' is the manager's own entry; "
                            "valid: any other name")
        for name, state in states.items():
            if not isinstance(state, Stateful):
                raise SpecError(f"states.{name}", type(state).__name__,
                                "valid: an object with state_dict() and load_state_dict()")
        if storage_every < 1:
            raise SpecError("storage_every", storage_every, "valid: an integer >= 1")
        self.policy = policy or CheckpointPolicy()
        if checkpointer is None:
            if root_dir is None:
                raise SpecError("root_dir", None, "valid: a folder for the checkpoints")
            checkpointer = Checkpointer(CheckpointConfig.from_policy(self.policy, root_dir,
                                                                     **config), faults=faults)
        self.checkpointer = checkpointer
        self.states = dict(states)
        self.storage_every, self.overlap = storage_every, overlap
        self.step = 0  # the step the states are at (the newest one saved or restored)
        self.last: SaveHandle | None = None

    def state_dict(self) -> dict[str, Any]:
        """Every state's ``state_dict()`` plus the step (what one checkpoint holds)."""
        out: dict[str, Any] = {name: state.state_dict() for name, state in self.states.items()}
        out[STEP_KEY] = self.step
        return out

    def load(self, **restore: Any) -> int:
        """Restore the newest intact checkpoint into the states (collective); returns its step,
        0 when there is none. ``restore``: ``Checkpointer.restore_latest`` options (source,
        max_step)."""
        restored = self.checkpointer.restore_latest(self.state_dict(), **restore)
        if restored is None:
            return 0
        for name, state in self.states.items():
            state.load_state_dict(restored.state[name])
        self.step = int(restored.state[STEP_KEY])
        return self.step

    def due(self, step: int) -> bool:
        return step % self.policy.interval_steps == 0

    def maybe_save(self, step: int, *, last: bool = False) -> SaveHandle | None:
        """Save when ``step`` is on the interval, or is the ``last`` one (then to storage).
        Collective: every rank calls it every step with the same arguments."""
        if not (last or self.due(step)):
            return None
        storage = last or to_storage(step, self.policy.interval_steps, self.storage_every)
        self.step = step
        self.last = self.checkpointer.save(step, self.state_dict(), to_storage=storage,
                                           overlap=self.overlap)
        return self.last

    def wait_for_staging(self) -> float:
        """Wait until the newest save's host snapshot is complete (instant without overlap);
        returns the seconds waited."""
        return self.checkpointer.fence()

    def close(self) -> None:
        """Wait for the save in flight (its errors are raised here) and release the group."""
        try:
            self.checkpointer.wait()
        finally:
            self.checkpointer.close()
