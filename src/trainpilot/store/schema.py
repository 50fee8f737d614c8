"""The run store's tables (SQLite). One database per run directory, written by rank 0 only.

Why long-format metrics (step, name, value) rather than wide rows: per-layer gradient norms and
user metrics add names at run time, and every reader (dashboard, monitor, report) asks for "these
names since that step", which the (name, step) primary key answers with one index range scan.
No second index on metrics: each batch's commit rewrites every B-tree page it touches, and a
step index doubled that; the small ``steps`` table answers "latest step" and "when".
"""

from __future__ import annotations

from trainpilot.store.rollup import ROLLUP_DDL

# 2: the series, rollups and batches tables (trainpilot.store.rollup); a version-1 store reopened
# for writing gets them built from its rows.
SCHEMA_VERSION = 2
STORE_FILENAME = "trainpilot.db"

# Event kinds the readers know how to draw; any other kind is stored as given. ``run_resumed``:
# a writer reopened an existing store (a restarted or re-run job); it says when a process came
# back, not that training restarted: that is ``restart``, which only the trainer (with the
# ``restored_step`` it restored) and a rollback log.
EVENT_KINDS = (
    "run_start", "run_resumed", "run_end", "alert", "alert_cleared", "intervention", "fault",
    "diagnosis", "restart", "checkpoint", "lr_change", "note",
    # the runtime's recovery events (trainpilot.runtime.callbacks.RunRecorder)
    "recovered", "failure_detected", "collective_retry", "checkpoint_failed",
    "nonfinite_recompute",
)

# The kind column as readers see it. Stores written before ``run_resumed`` existed logged a
# reopening as kind ``restart`` named ``store_reopened``; such stores stay on users' disks and are
# opened read-only (no migration possible), so every read maps that one legacy form here, in SQL,
# where the ``kinds`` filter and ``LIMIT`` see it too.
KIND_SQL = ("CASE WHEN kind = 'restart' AND name = 'store_reopened' THEN 'run_resumed' "
            "ELSE kind END")
LEGACY_KINDS = {"run_resumed": "restart"}  # a kind -> the stored kind it was once written as

DDL = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    run_id       TEXT PRIMARY KEY,
    name         TEXT,
    status       TEXT NOT NULL,          -- running | completed | failed | interrupted
    started_time REAL NOT NULL,          -- unix seconds
    ended_time   REAL,
    world_size   INTEGER NOT NULL,
    host         TEXT,
    info_json    TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS documents (
    kind      TEXT PRIMARY KEY,          -- model | cluster | plan | job | config | ...
    body_json TEXT NOT NULL,
    time      REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS metrics (
    name  TEXT NOT NULL,
    step  INTEGER NOT NULL,
    value REAL,                          -- NULL stores NaN (SQLite has no NaN)
    PRIMARY KEY (name, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS steps (       -- one row per step logged: when, and the latest step
    step INTEGER PRIMARY KEY,
    time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    time         REAL NOT NULL,
    step         INTEGER,
    kind         TEXT NOT NULL,
    severity     TEXT NOT NULL DEFAULT 'info',   -- info | warning | critical
    name         TEXT NOT NULL DEFAULT '',       -- rule or action name
    message      TEXT NOT NULL DEFAULT '',
    payload_json TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS events_by_kind ON events (kind, id);
CREATE TABLE IF NOT EXISTS rank_timings (
    step      INTEGER NOT NULL,
    rank      INTEGER NOT NULL,
    step_s    REAL,
    compute_s REAL,                      -- measured before the gradient collective
    comm_s    REAL,
    data_s    REAL,
    time      REAL NOT NULL,
    PRIMARY KEY (step, rank)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS forecasts (
    step         INTEGER PRIMARY KEY,
    time         REAL NOT NULL,
    payload_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS knowledge (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    time         REAL NOT NULL,
    run_id       TEXT,
    anomaly      TEXT NOT NULL,          -- a rule name or a diagnosis category
    action       TEXT NOT NULL,
    outcome      TEXT NOT NULL,          -- recovered | not_recovered | diagnosed | ...
    evidence     TEXT NOT NULL DEFAULT '',
    payload_json TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS knowledge_by_anomaly ON knowledge (anomaly);
""" + ROLLUP_DDL
