"""Runs under a root directory: discovery, read-only stores, and the index rows.

A run is a directory holding the store file (``trainpilot.db``). Its key is its path relative to
the root ("." for the root itself). The server resolves keys only through the discovered set, so
no request can name a file outside the root: a key is looked up, never joined to a path.
"""

from __future__ import annotations

import math
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainpilot.specs.errors import SpecError
from trainpilot.store import STORE_FILENAME, RunStore

MAX_DEPTH = 4  # directories below the root that are searched for runs
MAX_DIRS = 20_000  # a bound on the walk, for a root that is a large tree by mistake
SKIP_DIRS = {"checkpoints", "ckpt", "__pycache__", "node_modules"}
REFRESH_S = 5.0  # the folder is walked again at most this often (the index polls every 5 s)
UNKNOWN_KEY_REFRESH_S = 1.0  # a request for a key not seen yet walks again after this long


@dataclass(frozen=True, kw_only=True)
class RunRef:
    key: str  # posix path relative to the root; "." is the root
    path: Path


def discover_runs(root: Path, *, max_depth: int = MAX_DEPTH) -> dict[str, RunRef]:
    """Every run directory under ``root`` (itself included), keyed by relative path, sorted.

    Hidden directories and checkpoint folders are not searched; at most ``MAX_DIRS``
    directories are visited."""
    root = root.resolve()
    found: dict[str, RunRef] = {}
    visited = 0
    for current, dirs, files in os.walk(root):
        visited += 1
        here = Path(current)
        depth = len(here.relative_to(root).parts)
        if STORE_FILENAME in files:
            key = here.relative_to(root).as_posix()
            found[key] = RunRef(key=key, path=here)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                         and depth < max_depth and not os.path.islink(here / d))
        if visited >= MAX_DIRS:
            break
    return dict(sorted(found.items()))


class RunIndex:
    """The runs under ``root``, each store opened read-only once and reused (thread-safe)."""

    def __init__(self, root: str | os.PathLike):
        root = Path(root)
        if not root.is_dir():
            raise SpecError("run_dir", str(root), "valid: an existing directory (a run "
                            f"directory holding {STORE_FILENAME}, or a folder of them)")
        self.root = root.resolve()
        self._lock = threading.Lock()
        self._refs: dict[str, RunRef] = {}
        self._stores: dict[str, RunStore] = {}
        self._walked_at = -math.inf
        self.num_walks = 0
        self.refresh(force=True)

    @property
    def is_single_run(self) -> bool:
        """The root is itself a run directory."""
        return (self.root / STORE_FILENAME).is_file()

    def refresh(self, *, force: bool = False, max_age_s: float = REFRESH_S,
                ) -> dict[str, RunRef]:
        """The discovered runs, walking the folder again only when the last walk is older than
        ``max_age_s`` (a root with thousands of folders is not walked on every poll)."""
        if not force and time.monotonic() - self._walked_at < max_age_s:
            return self._refs
        refs = discover_runs(self.root)
        with self._lock:
            self._refs = refs
            self._walked_at = time.monotonic()
            self.num_walks += 1
            for key in [k for k in self._stores if k not in refs]:
                self._stores.pop(key).close()
        return refs

    def keys(self) -> list[str]:
        return list(self._refs)

    def store(self, key: str) -> RunStore | None:
        """The read-only store of run ``key``; None for a key that is not a discovered run."""
        if key not in self._refs:
            self.refresh(max_age_s=UNKNOWN_KEY_REFRESH_S)  # a run started after the server did
        ref = self._refs.get(key)
        if ref is None:
            return None
        with self._lock:
            store = self._stores.get(key)
            if store is None:  # SpecError (not a store, or not yet one) when it cannot open
                store = self._stores[key] = RunStore.open_readonly(ref.path)
            return store

    def forget(self, key: str) -> None:
        """Drop the open store of ``key`` (it failed: it is reopened on the next request)."""
        with self._lock:
            store = self._stores.pop(key, None)
        if store is not None:
            store.close()

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()

    def rows(self) -> list[dict[str, Any]]:
        """One row per run for the index page: status, steps, last loss, health."""
        out = []
        for key in list(self.refresh()):
            try:
                store = self.store(key)
                if store is None:
                    continue
                out.append(dict(key=key, error=None, **run_row(store)))
            except (SpecError, sqlite3.Error) as err:
                self.forget(key)
                out.append(dict(key=key, status="broken", error=_why(err), name=None,
                                run_id=None, world_size=None, started_time=None,
                                ended_time=None, step=None, loss=None, health=None))
        return out


def _why(err: Exception) -> str:
    """One line on why a store cannot be read (for the index's "broken" rows)."""
    text = str(err)
    if isinstance(err, SpecError) and "; " in text:
        text = text.split("; ", 1)[1]
    return text[:300]


def run_row(store: RunStore) -> dict[str, Any]:
    """Status, timing, last step, last loss and health score of a run."""
    run = store.run()
    step, latest = store.latest_metrics()
    return dict(
        name=run.name if run else None, run_id=run.run_id if run else None,
        status=run.status if run else "unknown", world_size=run.world_size if run else None,
        started_time=run.started_time if run else None,
        ended_time=run.ended_time if run else None, step=step,
        loss=finite(latest.get("loss")), health=finite(latest.get("health/score")))


def finite(value: float | None) -> float | None:
    """JSON has no NaN or infinity: those become null (plotly draws a gap)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None
