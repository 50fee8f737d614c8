"""``RunStore``: the SQLite database in a run directory (WAL mode, one writer, many readers).

Durability contract: metrics and rank timings are buffered and written in batches, one
transaction per batch; events, documents, forecasts and knowledge rows are committed at once.
A SIGKILL loses at most the batch not yet flushed and never corrupts the file: SQLite's WAL
makes every commit atomic, and with ``synchronous=NORMAL`` a committed transaction survives the
death of the process (not a power cut; pass ``durable=True`` for ``synchronous=FULL``).
Readers open the file with ``mode=ro`` and see every committed batch while training writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import sqlite3
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainpilot.records import RankTiming  # noqa: F401 (part of the store's API)
from trainpilot.specs.errors import SpecError
from trainpilot.store import rollup
from trainpilot.store.schema import DDL, KIND_SQL, LEGACY_KINDS, SCHEMA_VERSION, STORE_FILENAME


class Exporter(Protocol):
    """Receives every metric batch the writer logs (TensorBoard, Prometheus, ...)."""

    def export(self, step: int, metrics: Mapping[str, float], *,
               time_s: float | None = None) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Event:
    """One row of the events table; ``payload`` is the decoded JSON."""

    id: int
    time: float
    step: int | None
    kind: str
    severity: str
    name: str
    message: str
    payload: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    run_id: str
    name: str | None
    status: str
    started_time: float
    ended_time: float | None
    world_size: int
    host: str | None
    info: dict[str, Any] = field(default_factory=dict)


def store_path(run_dir: str | os.PathLike) -> Path:
    """The database file of a run directory."""
    return Path(run_dir) / STORE_FILENAME


def _connect_writer(path: Path, *, durable: bool) -> sqlite3.Connection:
    if path.parent.exists() and not path.parent.is_dir():
        raise SpecError("run_dir", str(path.parent), "valid: a directory (this is a file)")
    if path.exists() and not path.is_file():
        raise SpecError("run_dir", str(path.parent), f"valid: a run directory whose "
                        f"{STORE_FILENAME} is a file")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        conn.executescript(DDL)
        _upgrade(conn)
    except sqlite3.DatabaseError as err:
        raise SpecError("run_dir", str(path.parent),
                        f"its {STORE_FILENAME} is not a trainpilot store ({err})") from None
    return conn


def _upgrade(conn: sqlite3.Connection) -> None:
    """A store written before schema 2 gets its summaries built from its rows (once)."""
    row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    if row is None or int(row[0]) >= SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        rollup.rebuild(conn)
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                     (str(SCHEMA_VERSION),))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _num(value: Any) -> float | None:
    """SQLite has no NaN: store it as NULL (read back as NaN)."""
    value = float(value)
    return None if math.isnan(value) else value


def _val(value: float | None) -> float:
    return math.nan if value is None else value


class RunStore:
    """A run's store. Build with :meth:`create` (the writer, rank 0) or :meth:`open_readonly`."""

    def __init__(self, conn: sqlite3.Connection, path: Path, *, writable: bool, run_id: str,
                 flush_every_steps: int = 200, flush_interval_s: float = 2.0):
        self._conn: sqlite3.Connection | None = conn  # None once closed
        self.path = path
        self.writable = writable
        self.run_id = run_id
        self.flush_every_steps = flush_every_steps
        self.flush_interval_s = flush_interval_s
        self.flushed_step: int | None = None  # last metrics step known to be committed
        self.resumed = False
        self._lock = threading.RLock()
        self._pending_metrics: list[tuple] = []
        self._pending_timings: list[tuple] = []
        self._pending_steps: dict[int, float] = {}  # step -> time first logged
        self._last_flush = time.monotonic()
        self._exporters: list[Exporter] = []
        self.has_rollups = True  # schema 2 (a writer upgrades older stores when it opens them)

    # ----------------------------------------------------------------------------- opening
    @classmethod
    def create(cls, run_dir: str | os.PathLike, *, name: str | None = None, world_size: int = 1,
               info: Mapping[str, Any] | None = None, flush_every_steps: int = 200,
               flush_interval_s: float = 2.0, durable: bool = False) -> RunStore:
        """Open the run's store for writing, creating it if needed (rank 0 only).

        Reopening an existing store (a restarted or re-run job) keeps its rows, marks the run
        running again and records a ``run_resumed`` event (not ``restart``: whether training
        restarted from a checkpoint is the trainer's to say). ``flush_every_steps`` (>= 1) and
        ``flush_interval_s`` (> 0) bound how much a crash can lose: whichever is reached first
        flushes the batch.
        """
        if flush_every_steps < 1:
            raise SpecError("flush_every_steps", flush_every_steps, "valid: an integer >= 1")
        if not flush_interval_s > 0:
            raise SpecError("flush_interval_s", flush_interval_s, "valid: seconds > 0")
        path = store_path(run_dir)
        conn = _connect_writer(path, durable=durable)
        existing = conn.execute("SELECT run_id, status FROM runs LIMIT 1").fetchone()
        now = time.time()
        if existing:
            run_id = existing[0]
            conn.execute("UPDATE runs SET status='running', ended_time=NULL WHERE run_id=?",
                         (run_id,))
        else:
            run_id = uuid.uuid4().hex[:12]
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
            conn.execute("INSERT INTO runs VALUES (?, ?, 'running', ?, NULL, ?, ?, ?)",
                         (run_id, name, now, world_size, socket.gethostname(),
                          json.dumps(dict(info or {}))))
        store = cls(conn, path, writable=True, run_id=run_id,
                    flush_every_steps=flush_every_steps, flush_interval_s=flush_interval_s)
        store.resumed = existing is not None
        payload: dict[str, Any] = {"pid": os.getpid(), "world_size": world_size}
        if existing:
            # When the job's process came back and what the run was before; the trainer's own
            # ``restart`` event (with ``restored_step``) says whether and what it restored.
            store.log_event("run_resumed", None, dict(payload, previous_status=existing[1]),
                            name="run_resumed",
                            message=f"run store reopened by pid {os.getpid()} "
                                    f"(was {existing[1]})")
        else:
            store.log_event("run_start", None, payload, name="run_start")
        return store

    @classmethod
    def append(cls, run_dir: str | os.PathLike, *, status_if_new: str = "external") -> RunStore:
        """Open a store for writing after (or outside) the run — e.g. ``trainpilot diagnose
        --store`` adding a diagnosis — without marking the run as running again. A missing
        store is created with ``status_if_new``."""
        path = store_path(run_dir)
        conn = _connect_writer(path, durable=False)
        row = conn.execute("SELECT run_id FROM runs LIMIT 1").fetchone()
        if row is None:
            run_id = uuid.uuid4().hex[:12]
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
            conn.execute("INSERT INTO runs VALUES (?, NULL, ?, ?, ?, 1, ?, '{}')",
                         (run_id, status_if_new, time.time(), time.time(),
                          socket.gethostname()))
        else:
            run_id = row[0]
        return cls(conn, path, writable=True, run_id=run_id)

    END_STATUSES = ("completed", "failed", "crashed", "interrupted", "preempted")

    @classmethod
    def close_run(cls, run_dir: str | os.PathLike, *, status: str, reason: str = "",
                  exit_code: int | None = None) -> bool:
        """Close a run whose writer could not: it was killed, crashed, or its launcher gave up
        (call from the launcher or agent after the workers have exited). Sets the status and end
        time and logs a ``run_end`` event with the reason; does nothing to a run already closed
        (returns False) and refuses a directory without a store (SpecError)."""
        if status not in cls.END_STATUSES:
            raise SpecError("status", status, f"valid: {', '.join(cls.END_STATUSES)}")
        cls.open_readonly(run_dir).close()  # exists and is a store
        store = cls.append(run_dir)
        try:
            run = store.run()
            if run is not None and run.status != "running":
                return False
            store.set_status(status)
            store.log_event("run_end", store.latest_step(), dict(
                status=status, reason=reason, exit_code=exit_code, closed_by=os.getpid()),
                severity="critical" if status in ("failed", "crashed") else "info",
                name="run_end", message=f"run closed as {status}" + (
                    f": {reason}" if reason else ""))
            return True
        finally:
            store.close()

    @classmethod
    def open_readonly(cls, run_dir: str | os.PathLike) -> RunStore:
        """Open a run's store for reading while (or after) training writes it."""
        path = store_path(run_dir)
        if not path.is_file():
            raise SpecError("run_dir", str(run_dir),
                            f"valid: a run directory containing {STORE_FILENAME}")
        uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
        conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=30)
        try:
            tables = {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type='table'")}
            if "runs" not in tables or "metrics" not in tables:
                raise sqlite3.DatabaseError("no runs or metrics table")
            row = conn.execute("SELECT run_id FROM runs LIMIT 1").fetchone()
        except sqlite3.DatabaseError as err:
            conn.close()
            raise SpecError("run_dir", str(run_dir),
                            f"its {STORE_FILENAME} is not a readable trainpilot store ({err})"
                            ) from None
        store = cls(conn, path, writable=False, run_id=row[0] if row else "")
        store.has_rollups = {"rollups", "series", "batches"} <= tables
        return store

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if self.writable:
            self.close(status="failed" if exc_type else "completed")
        else:
            self.close()

    @property
    def _db(self) -> sqlite3.Connection:
        """The open connection (using a closed store fails with AttributeError, as it did)."""
        conn = self._conn
        if conn is None:
            raise AttributeError(f"{self.path}: the run store is closed")
        return conn

    # ----------------------------------------------------------------------------- writing
    def _require_writer(self) -> None:
        if not self.writable:
            raise PermissionError(f"{self.path} was opened read-only")

    def add_exporter(self, exporter: Exporter) -> None:
        """Forward every metric batch to ``exporter`` too (users keep TensorBoard/Prometheus)."""
        self._exporters.append(exporter)

    def set_document(self, kind: str, body: Mapping[str, Any]) -> None:
        """Record a resolved job document (``model``, ``cluster``, ``plan``, ``job``, ...)."""
        self._require_writer()
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO documents VALUES (?, ?, ?)",
                             (kind, json.dumps(body, default=str), time.time()))

    def set_status(self, status: str) -> None:
        self._require_writer()
        ended = None if status == "running" else time.time()
        with self._lock:
            self._db.execute("UPDATE runs SET status=?, ended_time=? WHERE run_id=?",
                             (status, ended, self.run_id))

    def log_metrics(self, step: int, metrics: Mapping[str, float], *,
                    time_s: float | None = None) -> None:
        """Buffer one step's metrics (name -> value); a later row for the same (name, step)
        replaces the earlier one (a rolled-back run re-logs the steps it repeats)."""
        self._require_writer()
        now = time.time() if time_s is None else time_s
        with self._lock:
            step = int(step)
            self._pending_metrics.extend((n, step, _num(v)) for n, v in metrics.items())
            self._pending_steps[step] = now
            for exporter in self._exporters:
                exporter.export(int(step), metrics, time_s=now)  # the step's own wall time
            self._maybe_flush()

    def log_rank_timings(self, timings: Iterable[RankTiming]) -> None:
        """Buffer per-rank timings (rank 0 logs what it gathered from every rank)."""
        self._require_writer()
        now = time.time()
        with self._lock:
            for t in timings:
                self._pending_timings.append(
                    (t.step, t.rank, *(None if v is None else _num(v)
                                       for v in (t.step_s, t.compute_s, t.comm_s, t.data_s)), now))
                self._pending_steps.setdefault(t.step, now)
            self._maybe_flush()

    def log_event(self, kind: str, step: int | None, payload: Mapping[str, Any] | None = None, *,
                  severity: str = "info", name: str = "", message: str = "",
                  time_s: float | None = None) -> int:
        """Record an event and commit it at once (with any buffered metrics before it, so the
        order on disk is the order of logging). Returns the event id (monotonic; readers poll
        with ``events(since_id=...)``). ``time_s``: when it happened (unix seconds; default
        now), for an event learnt of later, e.g. a fault on a rank that died before it could
        report it."""
        self._require_writer()
        with self._lock:
            self._flush_locked()
            cur = self._db.execute(
                "INSERT INTO events (time, step, kind, severity, name, message, payload_json) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (time.time() if time_s is None else float(time_s), step, kind, severity, name,
                 message,
                 json.dumps(dict(payload or {}), default=str)))
            rowid = cur.lastrowid
            assert rowid is not None  # an INSERT through this cursor always sets it
            return int(rowid)

    def log_forecast(self, step: int, payload: Mapping[str, Any]) -> None:
        """Record a convergence forecast made at ``step`` (JSON: prediction, interval, band)."""
        self._require_writer()
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO forecasts VALUES (?, ?, ?)",
                             (step, time.time(), json.dumps(dict(payload), default=str)))

    def log_knowledge(self, anomaly: str, action: str, outcome: str, *, evidence: str = "",
                      payload: Mapping[str, Any] | None = None) -> None:
        """Add an (anomaly, action, outcome) row to the knowledge base later runs consult."""
        self._require_writer()
        with self._lock:
            self._db.execute(
                "INSERT INTO knowledge (time, run_id, anomaly, action, outcome, evidence, "
                "payload_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (time.time(), self.run_id, anomaly, action, outcome, evidence,
                 json.dumps(dict(payload or {}), default=str)))

    def _maybe_flush(self) -> None:
        if (len(self._pending_steps) >= self.flush_every_steps
                or time.monotonic() - self._last_flush >= self.flush_interval_s):
            self._flush_locked()

    def flush(self) -> None:
        """Commit the buffered batch now (one transaction)."""
        if self.writable:
            with self._lock:
                self._flush_locked()

    def _flush_locked(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending_metrics and not self._pending_timings:
            return
        conn = self._db
        conn.execute("BEGIN")
        try:
            conn.executemany("INSERT OR REPLACE INTO metrics VALUES (?, ?, ?)",
                             self._pending_metrics)
            conn.executemany("INSERT OR REPLACE INTO steps VALUES (?, ?)",
                             sorted(self._pending_steps.items()))
            conn.executemany("INSERT OR REPLACE INTO rank_timings VALUES (?, ?, ?, ?, ?, ?, ?)",
                             self._pending_timings)
            self._write_summaries(conn)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if self._pending_steps:
            self.flushed_step = max(self._pending_steps)
        self._pending_metrics, self._pending_timings = [], []
        self._pending_steps = {}

    def _write_summaries(self, conn: sqlite3.Connection) -> None:
        """The batch's rollups, series rows and cursor row (trainpilot.store.rollup)."""
        touched: dict[str, set[int]] = {}
        last: dict[str, tuple[int, int, float | None]] = {}  # name -> (first, last, value)
        for name, step, value in self._pending_metrics:
            touched.setdefault(rollup.metric_key(name), set()).add(step)
            first, top, top_value = last.get(name, (step, step, value))
            if step >= top:
                top, top_value = step, value
            last[name] = (min(first, step), top, top_value)
        timing_steps = set()
        for row in self._pending_timings:
            step, rank = row[0], row[1]
            timing_steps.add(step)
            for column in rollup.TIMING_COLUMNS:
                touched.setdefault(rollup.timing_key(rank, column), set()).add(step)
        rollup.update(conn, touched)
        conn.executemany(
            "INSERT INTO series VALUES (?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
            "first_step=min(first_step, excluded.first_step), "
            "last_value=CASE WHEN excluded.last_step >= last_step THEN excluded.last_value "
            "ELSE last_value END, last_step=max(last_step, excluded.last_step)",
            [(n, f, t, v) for n, (f, t, v) in last.items()])
        metric_steps = [s for _, s, _ in self._pending_metrics]
        conn.execute("INSERT INTO batches (time, metric_lo, metric_hi, timing_lo, timing_hi) "
                     "VALUES (?, ?, ?, ?, ?)",
                     (time.time(), min(metric_steps, default=None),
                      max(metric_steps, default=None), min(timing_steps, default=None),
                      max(timing_steps, default=None)))

    def close(self, status: str | None = None) -> None:
        """Flush, record the final status (writer) and close. Safe to call twice."""
        if self._conn is None:
            return
        if self.writable:
            self.flush()
            if status:
                self.set_status(status)
                self.log_event("run_end", self.flushed_step, {"status": status})
            for exporter in self._exporters:
                exporter.close()
        self._conn.close()
        self._conn = None

    # ----------------------------------------------------------------------------- reading
    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def run(self) -> RunInfo | None:
        rows = self._rows("SELECT * FROM runs LIMIT 1")
        if not rows:
            return None
        r = rows[0]
        return RunInfo(run_id=r[0], name=r[1], status=r[2], started_time=r[3], ended_time=r[4],
                       world_size=r[5], host=r[6], info=json.loads(r[7] or "{}"))

    def documents(self) -> dict[str, dict[str, Any]]:
        return {k: json.loads(b) for k, b in self._rows("SELECT kind, body_json FROM documents")}

    @contextlib.contextmanager
    def snapshot(self):
        """Reads inside this block see one committed state of the file (a read transaction;
        other threads sharing this store wait). Nested blocks join the outer one."""
        with self._lock:
            if self._db.in_transaction:
                yield self
                return
            self._db.execute("BEGIN")
            try:
                yield self
            finally:
                self._db.execute("COMMIT")

    def metric_names(self, prefix: str = "") -> list[str]:
        """Every metric name (under ``prefix``), sorted. O(names), not O(rows)."""
        if self.has_rollups:
            rows = self._rows("SELECT name FROM series WHERE name >= ? AND name < ? "
                              "ORDER BY name", (prefix, prefix + "\U0010ffff"))
            return [r[0] for r in rows]
        # A schema-1 store: hop from name to name along the (name, step) key.
        names, current = [], prefix
        with self._lock:
            row = self._db.execute("SELECT name FROM metrics WHERE name >= ? ORDER BY name "
                                   "LIMIT 1", (current,)).fetchone()
            while row is not None and row[0].startswith(prefix):
                names.append(row[0])
                row = self._db.execute("SELECT name FROM metrics WHERE name > ? ORDER BY "
                                       "name LIMIT 1", (row[0],)).fetchone()
        return names

    def metrics(self, names: Iterable[str] | None = None, *, since_step: int | None = None,
                until_step: int | None = None) -> dict[str, list[tuple[int, float]]]:
        """``{name: [(step, value), ...]}`` in step order; steps in ``(since_step, until_step]``.

        ``names=None`` means every name. NaN values (stored as NULL) come back as NaN.
        """
        lo = -1 << 62 if since_step is None else since_step
        hi = 1 << 62 if until_step is None else until_step
        wanted = list(self.metric_names() if names is None else names)
        out: dict[str, list[tuple[int, float]]] = {}
        for name in wanted:
            rows = self._rows("SELECT step, value FROM metrics WHERE name=? AND step>? AND "
                              "step<=? ORDER BY step", (name, lo, hi))
            out[name] = [(s, _val(v)) for s, v in rows]
        return out

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """One metric as (steps, values)."""
        rows = self.metrics([name])[name]
        return [s for s, _ in rows], [v for _, v in rows]

    def latest_step(self) -> int | None:
        return self._rows("SELECT MAX(step) FROM steps")[0][0]

    def step_times(self, *, since_step: int | None = None) -> list[tuple[int, float]]:
        """(step, unix time it was logged) in step order."""
        return self._rows("SELECT step, time FROM steps WHERE step > ? ORDER BY step",
                          (-1 << 62 if since_step is None else since_step,))

    def latest_metrics(self, prefix: str = "") -> tuple[int | None, dict[str, float]]:
        """(latest step, each metric's most recent value), optionally for names under a prefix."""
        if self.has_rollups:
            rows = self._rows("SELECT name, last_value FROM series WHERE name >= ? AND name < ?",
                              (prefix, prefix + "\U0010ffff"))
            return self.latest_step(), {n: _val(v) for n, v in rows}
        rows = self._rows(
            "SELECT m.name, m.value FROM metrics m JOIN (SELECT name, MAX(step) AS s FROM metrics "
            "WHERE name >= ? AND name < ? GROUP BY name) last ON m.name = last.name AND "
            "m.step = last.s", (prefix, prefix + "\U0010ffff"))
        return self.latest_step(), {n: _val(v) for n, v in rows}

    def events(self, *, since_id: int = 0, kinds: Iterable[str] | None = None,
               limit: int | None = None) -> list[Event]:
        """Events with id > ``since_id`` (oldest first); ``limit`` keeps the newest ones.

        Kinds are as :data:`~trainpilot.store.schema.KIND_SQL` reads them (a legacy reopening
        comes back as ``run_resumed``, never as ``restart``)."""
        sql = (f"SELECT id, time, step, {KIND_SQL}, severity, name, message, payload_json "
               "FROM events WHERE id > ?")
        args: list[Any] = [since_id]
        kinds = list(kinds or [])
        if kinds:
            # The stored kinds first (the (kind, id) index), then the kinds as read.
            stored = sorted(set(kinds) | {LEGACY_KINDS[k] for k in kinds if k in LEGACY_KINDS})
            sql += (f" AND kind IN ({','.join('?' * len(stored))})"
                    f" AND {KIND_SQL} IN ({','.join('?' * len(kinds))})")
            args += stored + kinds
        sql += " ORDER BY id DESC" + (f" LIMIT {int(limit)}" if limit else "")
        rows = self._rows(sql, args)[::-1]
        return [Event(id=r[0], time=r[1], step=r[2], kind=r[3], severity=r[4], name=r[5],
                      message=r[6], payload=json.loads(r[7] or "{}")) for r in rows]

    def batch_cursor(self) -> int:
        """The id of the last committed batch (0 before any, or for a schema-1 store)."""
        if not self.has_rollups:
            return 0
        return self._rows("SELECT COALESCE(MAX(id), 0) FROM batches")[0][0]

    def batches_since(self, since_id: int) -> tuple[int, tuple[int, int] | None,
                                                    tuple[int, int] | None]:
        """(last batch id, metric step range, timing step range) of the batches committed
        after ``since_id``: every row written since lies in those ranges (ranges None: none)."""
        row = self._rows("SELECT MAX(id), MIN(metric_lo), MAX(metric_hi), MIN(timing_lo), "
                         "MAX(timing_hi) FROM batches WHERE id > ?", (since_id,))[0]
        if row[0] is None:
            return since_id, None, None
        metric = None if row[1] is None else (row[1], row[2])
        timing = None if row[3] is None else (row[3], row[4])
        return row[0], metric, timing

    def window(self, key: str, lo: int, hi: int, max_points: int, *, mode: str = "m4",
               ) -> tuple[list[tuple[int, float | None]], bool]:
        """(points, downsampled) of one series (``rollup.metric_key(name)`` or
        ``rollup.timing_key(rank, column)``) in steps [lo, hi]; see trainpilot.store.rollup."""
        with self._lock:
            return rollup.read_window(self._db, key, lo, hi, max_points, mode=mode,
                                      have_rollups=self.has_rollups)

    def step_range(self) -> tuple[int | None, int | None]:
        """(first, last) step logged."""
        # Two queries: SQLite answers a lone MIN or MAX from the key in O(log n), both at once
        # by a scan (0.4 s on a million steps).
        return (self._rows("SELECT MIN(step) FROM steps")[0][0],
                self._rows("SELECT MAX(step) FROM steps")[0][0])

    def step_at_time(self, when: float) -> int | None:
        """The last step logged at or before unix time ``when`` (the first step if ``when`` is
        earlier; None before any step). Steps' times increase with steps: a binary search over
        the step key, O(log steps) lookups."""
        first, last = self.step_range()
        if first is None or last is None:  # no steps yet (the two are None together)
            return None

        def time_at(step: int) -> float:
            return self._rows("SELECT time FROM steps WHERE step >= ? ORDER BY step LIMIT 1",
                              (step,))[0][0]

        if when < time_at(first):
            return first
        lo, hi = first, last
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if time_at(mid) <= when:
                lo = mid
            else:
                hi = mid - 1
        found = self._rows("SELECT step FROM steps WHERE step <= ? ORDER BY step DESC LIMIT 1",
                           (lo,))
        return found[0][0] if found else first

    def ranks(self) -> list[int]:
        """The ranks with timings. O(ranks) on a schema-2 store."""
        if self.has_rollups:
            rows = self._rows("SELECT DISTINCT CAST(substr(key, 3, instr(substr(key, 3), '/') - 1)"
                              " AS INTEGER) FROM rollups WHERE key >= 'r/' AND key < 'r0' AND "
                              "width = ?", (rollup.WIDTHS[-1],))
            return sorted(r[0] for r in rows)
        return [r[0] for r in self._rows("SELECT DISTINCT rank FROM rank_timings ORDER BY rank")]

    def rank_timings(self, *, since_step: int | None = None,
                     until_step: int | None = None) -> list[RankTiming]:
        """Timings with steps in (since_step, until_step], by step then rank."""
        rows = self._rows("SELECT step, rank, step_s, compute_s, comm_s, data_s FROM "
                          "rank_timings WHERE step > ? AND step <= ? ORDER BY step, rank",
                          (-1 << 62 if since_step is None else since_step,
                           1 << 62 if until_step is None else until_step))
        return [RankTiming(step=r[0], rank=r[1], step_s=r[2], compute_s=r[3], comm_s=r[4],
                           data_s=r[5]) for r in rows]

    def forecasts(self) -> list[tuple[int, dict[str, Any]]]:
        """Every forecast as (step made, payload), oldest first."""
        return [(s, json.loads(p)) for s, p in
                self._rows("SELECT step, payload_json FROM forecasts ORDER BY step")]

    def latest_forecast(self) -> dict[str, Any] | None:
        rows = self._rows("SELECT payload_json FROM forecasts ORDER BY step DESC LIMIT 1")
        return json.loads(rows[0][0]) if rows else None

    def knowledge(self, anomaly: str | None = None) -> list[dict[str, Any]]:
        sql, args = "SELECT time, run_id, anomaly, action, outcome, evidence, payload_json " \
                    "FROM knowledge", []
        if anomaly:
            sql, args = sql + " WHERE anomaly = ?", [anomaly]
        rows = self._rows(sql + " ORDER BY id", args)
        return [dict(time=r[0], run_id=r[1], anomaly=r[2], action=r[3], outcome=r[4],
                     evidence=r[5], payload=json.loads(r[6])) for r in rows]

    def integrity_check(self) -> str:
        """SQLite's own ``PRAGMA integrity_check`` ('ok' when the file is sound)."""
        return self._rows("PRAGMA integrity_check")[0][0]
