"""Writers that degrade instead of ending training when the disk refuses them (full, quota,
read-only, I/O error): the run store, the metrics file, the worker's own output.

Training is what matters; its records are kept in memory and written again once the disk takes
them. Each refusal is announced once per kind with the disk it concerns (mount point, free
space) through ``on_degraded`` (the Trainer's events reach the launcher through its node-local
stream, which does not live on that disk).
"""

from __future__ import annotations

import errno
import json
import os
import sqlite3
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)


def is_disk_error(err: BaseException) -> bool:
    """An error that says the disk refused a write (not a bug in the caller)."""
    if isinstance(err, OSError):
        return err.errno in DISK_ERRNOS
    if isinstance(err, sqlite3.Error):
        text = str(err).lower()
        return any(s in text for s in ("full", "disk i/o", "readonly", "read-only",
                                       "unable to open", "no transaction is active"))
    return False


def disk_of(path: str | os.PathLike) -> dict[str, Any]:
    """The mount point holding ``path`` and its free/total bytes (best effort)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    mount = p
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    free: int | None
    total: int | None
    try:
        st = os.statvfs(p)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError:
        free = total = None
    return dict(path=str(path), mount=str(mount), free_bytes=free, total_bytes=total)


def describe_disk(info: dict[str, Any]) -> str:
    def mib(n: int | None) -> str:
        return "?" if n is None else f"{n / 2**20:.1f} MiB"

    return (f"{info['mount']} ({mib(info['free_bytes'])} free of {mib(info['total_bytes'])}; "
            f"writing {info['path']})")


class TolerantStore:
    """Wraps a run store: a write the disk refuses is queued and replayed, in order, on a
    later write (at most every ``retry_s``); reads pass through. Never raises a disk error."""

    WRITES = ("log_metrics", "log_rank_timings", "log_event", "log_forecast", "log_knowledge",
              "set_document", "set_status", "flush")

    def __init__(self, store: Any, *, retry_s: float = 2.0, max_queued: int = 200_000,
                 on_degraded: Callable[[str, dict[str, Any]], None] | None = None):
        self._store, self.retry_s, self.on_degraded = store, retry_s, on_degraded
        self._queue: deque[tuple[str, tuple, dict]] = deque()
        self.max_queued, self.dropped = max_queued, 0
        self._last_try = 0.0
        self.degraded_since: float | None = None
        self.failures = 0

    @property
    def inner(self) -> Any:
        """The store it wraps."""
        return self._store

    @property
    def queued(self) -> int:
        return len(self._queue)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in self.WRITES:
            return attr

        def write(*args: Any, **kwargs: Any) -> Any:
            if name in ("log_metrics", "log_event") and kwargs.get("time_s") is None:
                kwargs["time_s"] = time.time()  # a replayed row keeps its real time
            return self._write(name, args, kwargs)

        return write

    def _write(self, name: str, args: tuple, kwargs: dict) -> Any:
        if self._queue:
            self._queue.append((name, args, kwargs))
            self._trim()
            self._replay()
            return None
        try:
            return getattr(self._store, name)(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - judged below
            if not is_disk_error(err):
                raise
            self._queue.append((name, args, kwargs))
            self._failed(err)
            return None

    def _replay(self) -> None:
        now = time.monotonic()
        if now - self._last_try < self.retry_s:
            return
        self._last_try = now
        while self._queue:
            name, args, kwargs = self._queue[0]
            try:
                getattr(self._store, name)(*args, **kwargs)
            except Exception as err:  # noqa: BLE001
                if not is_disk_error(err):
                    raise
                self._failed(err)
                return
            self._queue.popleft()
        if self.degraded_since is not None and self.on_degraded is not None:
            self.on_degraded("store_recovered", dict(
                what="run store", after_s=round(time.time() - self.degraded_since, 3),
                dropped=self.dropped, **disk_of(self._store.path)))
        self.degraded_since = None

    def _trim(self) -> None:
        while len(self._queue) > self.max_queued:
            self._queue.popleft()
            self.dropped += 1

    def _failed(self, err: BaseException) -> None:
        self.failures += 1
        self._last_try = time.monotonic()
        if self.degraded_since is None:
            self.degraded_since = time.time()
            if self.on_degraded is not None:
                info = disk_of(self._store.path)
                self.on_degraded("disk_full", dict(
                    what="run store", error=str(err)[:200], **info,
                    message=f"the run store cannot write ({err}): {describe_disk(info)}; rows "
                            "are kept in memory and written when the disk takes them"))

    def close(self, status: str | None = None) -> None:
        """Write what is queued (one last try), then close the store."""
        self._last_try = 0.0
        try:
            self._replay()
            self._store.close(status=status)
        except Exception as err:  # noqa: BLE001
            if not is_disk_error(err):
                raise
            print(f"warning: the run store could not be closed ({err}); {len(self._queue)} "
                  "writes lost", file=sys.stderr)


class QuietStream:
    """A text stream (stdout/stderr of a worker) that drops writes the disk refuses instead
    of raising into the training loop: a full disk must not turn a print into a crash."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.dropped = 0

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as err:
            if err.errno not in DISK_ERRNOS:
                raise
            self.dropped += len(text)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as err:
            if err.errno not in DISK_ERRNOS:
                raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class LineFile:
    """Append JSON lines to a file; lines the disk refuses are kept and written (in order)
    before the next one. ``on_degraded`` is told once when writes start failing."""

    def __init__(self, path: Path, *, on_degraded: Callable[[str, dict[str, Any]], None] | None
                 = None):
        self.path, self.on_degraded = path, on_degraded
        self._handle: TextIO | None = None
        self._pending: list[str] = []
        self._warned = False

    def write(self, data: dict[str, Any]) -> None:
        self._pending.append(json.dumps(data) + "\n")
        try:
            if self._handle is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._handle = open(self.path, "a", encoding="utf-8")
            self._handle.write("".join(self._pending))
            self._handle.flush()
            self._pending = []
            self._warned = False
        except OSError as err:
            if err.errno not in DISK_ERRNOS:
                raise
            self._reopen()
            if not self._warned and self.on_degraded is not None:
                self._warned = True
                info = disk_of(self.path)
                self.on_degraded("disk_full", dict(
                    what=self.path.name, error=str(err)[:200], **info,
                    message=f"{self.path.name} cannot be written ({err.strerror}): "
                            f"{describe_disk(info)}; lines kept in memory"))

    def _reopen(self) -> None:
        # A failed buffered write leaves part of it in the handle's buffer: start a new one
        # (at worst a line is written twice; readers keep the last value of a step).
        if self._handle is not None:
            try:
                self._handle.close()
            except OSError:
                pass
            self._handle = None

    def close(self) -> None:
        if self._handle is not None:
            try:
                self._handle.close()
            except OSError:
                pass
            self._handle = None
