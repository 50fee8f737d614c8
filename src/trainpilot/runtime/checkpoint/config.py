"""Checkpointer settings and the reports it returns."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainpilot.specs.errors import SpecError


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """How the :class:`~trainpilot.runtime.checkpoint.Checkpointer` saves and restores.

    ``keep_every`` keeps checkpoints whose step is a multiple of it (Orbax's keep_period);
    ``keep_last`` the newest ones; folders a kept checkpoint references are kept too.
    ``full_every``: with ``incremental``, every Nth storage save rewrites everything, which
    bounds how far back a checkpoint's files may reach. ``peer_offset``: ring distance of the
    in-memory copy (None: ranks per node from LOCAL_WORLD_SIZE, or 1 on a single node).
    ``node_memory_dir``: a node-local RAM folder that outlives the worker process (the
    launcher's); every snapshot is also spilled there and a restarted worker restores from it
    (``nodemem.py``). None: the memory tier lives and dies with the process.
    """

    root_dir: str | os.PathLike
    async_save: bool = True
    in_memory_peer: bool = True
    incremental: bool = False
    full_every: int = 10
    compress: bool = False
    zstd_level: int = 3
    keep_last: int = 3
    keep_every: int | None = None
    max_file_bytes: int = 256 << 20
    peer_offset: int | None = None
    capture_rng: bool = True
    verify: bool = True
    on_write_error: Literal["raise", "warn"] = "raise"
    group_timeout_s: float = 600.0  # per collective of the checkpointer's own gloo group
    drain_timeout_s: float = 60.0  # wait this long for a save in flight before abandoning it
    node_memory_dir: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "root_dir", Path(self.root_dir))
        for name in ("full_every", "keep_last", "max_file_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"checkpoint.{name}", value, "valid: an integer >= 1")
        if self.keep_every is not None and (not isinstance(self.keep_every, int)
                                            or self.keep_every < 1):
            raise SpecError("checkpoint.keep_every", self.keep_every, "valid: null or >= 1")
        if self.peer_offset is not None and (not isinstance(self.peer_offset, int)
                                             or self.peer_offset < 1):
            raise SpecError("checkpoint.peer_offset", self.peer_offset, "valid: null or >= 1")
        for name in ("group_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise SpecError(f"checkpoint.{name}", value, "valid: seconds > 0")
        if not 1 <= self.zstd_level <= 22:
            raise SpecError("checkpoint.zstd_level", self.zstd_level, "valid: 1 to 22")
        if self.on_write_error not in ("raise", "warn"):
            raise SpecError("checkpoint.on_write_error", self.on_write_error,
                            "valid: raise, warn")

    @classmethod
    def from_policy(cls, policy: Any, root_dir: str | os.PathLike, **overrides: Any,
                    ) -> CheckpointConfig:
        """From a Plan's ``CheckpointPolicy`` (specs.plan), plus overrides."""
        values = {"async_save": policy.async_save, "in_memory_peer": policy.in_memory_peer,
                  "incremental": policy.incremental, "compress": policy.compress,
                  "keep_last": policy.keep_last, "keep_every": policy.keep_every}
        return cls(root_dir=root_dir, **{**values, **overrides})


@dataclass(kw_only=True)
class SaveReport:
    """What one save cost this rank. Bytes are this rank's; ``manifest_stats`` (coordinator
    only) totals all ranks: bytes_raw (a full save), bytes_written, bytes_referenced."""

    step: int
    stall_s: float  # time save() and fence() blocked the caller (includes wait_s, fence_s)
    wait_s: float  # of which: waiting for the previous save to finish
    snapshot_bytes: int
    overlapped: bool = False  # the tensor copy ran on the writer thread (save(overlap=True))
    copy_s: float = 0.0  # that copy's duration, off the caller's thread
    fence_s: float = 0.0  # of stall_s: fence() waiting for that copy
    exchange_s: float = 0.0
    write_s: float = 0.0
    to_storage: bool = False
    incremental: bool = False
    bytes_raw: int = 0
    bytes_written: int = 0
    bytes_referenced: int = 0
    path: str | None = None
    removed: list[str] = field(default_factory=list)
    manifest_stats: dict[str, int] | None = None


@dataclass(kw_only=True)
class Restored:
    """A restored state. ``source``: "memory" (own or a peer's host copy) or "storage".

    ``rank_state`` is None when the checkpoint has no entry for this rank (it was written at a
    smaller world size); ``skipped`` lists checkpoints passed over, with the reason.
    """

    step: int
    state: Any
    rank_state: Any
    source: Literal["memory", "storage"]
    path: str | None
    saved_world_size: int
    restore_s: float
    rng_restored: bool
    skipped: list[str] = field(default_factory=list)


class CheckpointWriteError(RuntimeError):
    """A save failed on at least one rank; ``failures`` maps rank -> original exception."""

    def __init__(self, step: int, failures: dict[int, BaseException]):
        self.step, self.failures = step, failures
        detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in failures.items())
        super().__init__(f"checkpoint at step {step} was not committed ({detail})")

    @property
    def errno(self) -> int | None:
        """The errno of the first OSError among the failures (ENOSPC for a full disk)."""
        for err in self.failures.values():
            if isinstance(err, OSError):
                return err.errno
        return None
