"""Per-series summaries kept beside the raw rows, so a reader can draw a million-step run fast.

Each series (a metric, or one column of one rank's timings) has, per bucket of ``width``
consecutive steps (widths 64, 1024 and 16384), the count of rows, the count of NaN rows, the
minimum and maximum with the steps where they occur, and the first and last rows. The writer
recomputes the buckets a batch touched inside that batch's transaction (64-step buckets from
the raw rows, wider ones from the 64-step ones), so the summaries are exactly as current as the
raw rows: a rolled-back run that rewrites steps rewrites its buckets too.

Reading a window of steps at ``max_points``: fewer raw rows than that come back as they are;
otherwise the window is cut into ``max_points // 4`` buckets and each contributes its first,
minimum, maximum and last points (M4 aggregation, Jugel et al., VLDB 2014: the drawn line's
extremes are the data's, so a one-step spike survives) plus a gap (None) where it held a NaN.
Large windows are read from the widest summaries that still give enough buckets, so the cost is
O(buckets), not O(steps).
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import cast

WIDTHS = (64, 1024, 16384)
FAN = 16  # each width is FAN times the one before
POINTS_PER_BUCKET = 4  # first, min, max, last
RAW_LIMIT = 50_000  # steps in a window below which raw rows are read when summaries are coarse
TIMING_COLUMNS = ("step_s", "compute_s", "comm_s", "data_s")

ROLLUP_DDL = """
CREATE TABLE IF NOT EXISTS series (      -- one row per metric name: what the index and names need
    name       TEXT PRIMARY KEY,
    first_step INTEGER NOT NULL,
    last_step  INTEGER NOT NULL,
    last_value REAL                      -- the value at last_step (NULL: NaN)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rollups (     -- per-bucket summaries (trainpilot.store.rollup)
    key        TEXT NOT NULL,            -- 'm/<metric name>' or 'r/<rank>/<column>'
    width      INTEGER NOT NULL,         -- steps per bucket: 64, 1024, 16384
    bucket     INTEGER NOT NULL,         -- floor(step / width)
    num        INTEGER NOT NULL,
    num_nan    INTEGER NOT NULL,
    lo REAL, lo_step INTEGER, hi REAL, hi_step INTEGER,
    first_step INTEGER NOT NULL, first_value REAL,
    last_step  INTEGER NOT NULL, last_value REAL,
    nan_step   INTEGER,
    PRIMARY KEY (key, width, bucket)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS batches (     -- one row per committed batch: the readers' cursor
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    time       REAL NOT NULL,
    metric_lo  INTEGER, metric_hi INTEGER,   -- steps of the metric rows it wrote
    timing_lo  INTEGER, timing_hi INTEGER    -- steps of the rank timings it wrote
);
"""


def metric_key(name: str) -> str:
    return "m/" + name


def timing_key(rank: int, column: str) -> str:
    return f"r/{int(rank)}/{column}"


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """Summary of the rows of one bucket (values None are NaN)."""

    num: int
    num_nan: int
    lo: float | None
    lo_step: int | None
    hi: float | None
    hi_step: int | None
    first_step: int
    first_value: float | None
    last_step: int
    last_value: float | None
    nan_step: int | None

    def row(self, key: str, width: int, bucket: int) -> tuple:
        return (key, width, bucket, self.num, self.num_nan, self.lo, self.lo_step, self.hi,
                self.hi_step, self.first_step, self.first_value, self.last_step,
                self.last_value, self.nan_step)

    @classmethod
    def from_row(cls, r: Sequence) -> Bucket:
        return cls(num=r[0], num_nan=r[1], lo=r[2], lo_step=r[3], hi=r[4], hi_step=r[5],
                   first_step=r[6], first_value=r[7], last_step=r[8], last_value=r[9],
                   nan_step=r[10])


BUCKET_COLUMNS = ("num, num_nan, lo, lo_step, hi, hi_step, first_step, first_value, last_step, "
                  "last_value, nan_step")


def summarise(rows: Sequence[tuple[int, float | None]]) -> Bucket:
    """The bucket of ``rows`` ((step, value), steps ascending, at least one)."""
    lo = hi = None
    lo_step = hi_step = nan_step = None
    num_nan = 0
    for step, value in rows:
        if value is None or not math.isfinite(value):  # NaN and infinities: a gap when drawn
            num_nan += 1
            nan_step = step if nan_step is None else nan_step
            continue
        if lo is None or value < lo:
            lo, lo_step = value, step
        if hi is None or value > hi:
            hi, hi_step = value, step
    first, last = rows[0], rows[-1]
    return Bucket(num=len(rows), num_nan=num_nan, lo=lo, lo_step=lo_step, hi=hi,
                  hi_step=hi_step, first_step=first[0], first_value=_num(first[1]),
                  last_step=last[0], last_value=_num(last[1]), nan_step=nan_step)


def combine(parts: Sequence[Bucket]) -> Bucket:
    """One bucket from consecutive buckets (ascending)."""
    lo_parts = [p for p in parts if p.lo is not None]  # a bucket sets lo and hi together
    lo = min(lo_parts, key=lambda p: cast(float, p.lo)) if lo_parts else None
    hi = max(lo_parts, key=lambda p: cast(float, p.hi)) if lo_parts else None
    nans = [p.nan_step for p in parts if p.nan_step is not None]
    return Bucket(num=sum(p.num for p in parts), num_nan=sum(p.num_nan for p in parts),
                  lo=lo.lo if lo else None, lo_step=lo.lo_step if lo else None,
                  hi=hi.hi if hi else None, hi_step=hi.hi_step if hi else None,
                  first_step=parts[0].first_step, first_value=parts[0].first_value,
                  last_step=parts[-1].last_step, last_value=parts[-1].last_value,
                  nan_step=nans[0] if nans else None)


def _num(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _runs(buckets: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted buckets as contiguous (first, last) runs."""
    out: list[list[int]] = []
    for b in sorted(set(buckets)):
        if out and b == out[-1][1] + 1:
            out[-1][1] = b
        else:
            out.append([b, b])
    return [(a, b) for a, b in out]


RawReader = Callable[[str, int, int], list[tuple[int, float | None]]]


def raw_reader(conn: sqlite3.Connection) -> RawReader:
    """Reads (step, value) rows of a series key in [lo, hi] from the raw tables."""

    def read(key: str, lo: int, hi: int) -> list[tuple[int, float | None]]:
        kind, _, rest = key.partition("/")
        if kind == "m":
            return conn.execute("SELECT step, value FROM metrics WHERE name=? AND step>=? AND "
                                "step<=? ORDER BY step", (rest, lo, hi)).fetchall()
        rank, _, column = rest.partition("/")
        if column not in TIMING_COLUMNS:
            raise ValueError(f"unknown timing column {column!r}")
        return conn.execute(f"SELECT step, {column} FROM rank_timings WHERE step>=? AND "
                            "step<=? AND rank=? ORDER BY step", (lo, hi, int(rank))).fetchall()
    return read


def update(conn: sqlite3.Connection, touched: dict[str, set[int]]) -> None:
    """Recompute the buckets of every width that hold the ``touched`` steps of each series
    key (called inside the writer's transaction, after the raw rows are written)."""
    read = raw_reader(conn)
    rows_out: list[tuple] = []
    for key, steps in touched.items():
        buckets = {s // WIDTHS[0] for s in steps}
        for first, last in _runs(buckets):
            w = WIDTHS[0]
            raw = read(key, first * w, (last + 1) * w - 1)
            by_bucket: dict[int, list] = {}
            for step, value in raw:
                by_bucket.setdefault(step // w, []).append((step, value))
            for b in range(first, last + 1):
                if b in by_bucket:
                    rows_out.append(summarise(by_bucket[b]).row(key, w, b))
                else:  # every row of the bucket was replaced away (cannot happen today)
                    conn.execute("DELETE FROM rollups WHERE key=? AND width=? AND bucket=?",
                                 (key, w, b))
        conn.executemany("INSERT OR REPLACE INTO rollups VALUES "
                         "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows_out)
        rows_out.clear()
        for finer, width in zip(WIDTHS, WIDTHS[1:]):
            buckets = {b // FAN for b in buckets}
            for first, last in _runs(buckets):
                parts = conn.execute(
                    f"SELECT bucket, {BUCKET_COLUMNS} FROM rollups WHERE key=? AND width=? AND "
                    "bucket>=? AND bucket<=? ORDER BY bucket",
                    (key, finer, first * FAN, (last + 1) * FAN - 1)).fetchall()
                grouped: dict[int, list[Bucket]] = {}
                for r in parts:
                    grouped.setdefault(r[0] // FAN, []).append(Bucket.from_row(r[1:]))
                rows_out += [combine(g).row(key, width, b) for b, g in grouped.items()]
            conn.executemany("INSERT OR REPLACE INTO rollups VALUES "
                             "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows_out)
            rows_out.clear()


def rebuild(conn: sqlite3.Connection) -> None:
    """Build every summary and the series table from the raw rows (a store written before
    they existed, reopened for writing)."""
    conn.execute("DELETE FROM rollups")
    conn.execute("DELETE FROM series")
    names = [r[0] for r in conn.execute("SELECT DISTINCT name FROM metrics")]
    for name in names:
        steps = {s for (s,) in conn.execute("SELECT step FROM metrics WHERE name=?", (name,))}
        update(conn, {metric_key(name): steps})
        first, last = min(steps), max(steps)
        value = conn.execute("SELECT value FROM metrics WHERE name=? AND step=?",
                             (name, last)).fetchone()[0]
        conn.execute("INSERT OR REPLACE INTO series VALUES (?, ?, ?, ?)",
                     (name, first, last, value))
    by_rank: dict[int, set[int]] = {}
    for step, rank in conn.execute("SELECT step, rank FROM rank_timings"):
        by_rank.setdefault(rank, set()).add(step)
    update(conn, {timing_key(r, c): steps for r, steps in by_rank.items()
                  for c in TIMING_COLUMNS})


# --------------------------------------------------------------------------------- reading
def _m4(points: list[tuple[int, float | None]], bucket: Bucket) -> None:
    """Append the bucket's first, min, max, last (and a NaN gap) in step order."""
    chosen = {bucket.first_step: bucket.first_value, bucket.last_step: bucket.last_value}
    if bucket.lo_step is not None:
        assert bucket.hi_step is not None  # a bucket sets lo and hi together
        chosen[bucket.lo_step] = bucket.lo
        chosen[bucket.hi_step] = bucket.hi
    if bucket.nan_step is not None:
        chosen[bucket.nan_step] = None
    points.extend(sorted(chosen.items()))


def downsample_rows(rows: Sequence[tuple[int, float | None]], max_points: int, *,
                    mode: str = "m4") -> tuple[list[tuple[int, float | None]], bool]:
    """(points, whether downsampled) of raw rows: as they are when few enough, else M4 over
    ``max_points // 4`` buckets of equal row counts (``mode='max'``: one point per bucket,
    its first step and its largest value: aligned columns for a heatmap). Vectorised: the
    same points :func:`summarise` per bucket would give."""
    import numpy as np

    per = POINTS_PER_BUCKET if mode == "m4" else 1
    if len(rows) <= max_points:
        return [(s, _num(v)) for s, v in rows], False
    n = len(rows)
    steps = np.fromiter((r[0] for r in rows), dtype=np.int64, count=n)
    values = np.fromiter((np.nan if r[1] is None else r[1] for r in rows), dtype=np.float64,
                         count=n)
    num_buckets = max(1, max_points // per)
    size = math.ceil(n / num_buckets)
    starts = np.arange(0, n, size)
    gap = ~np.isfinite(values)
    index = np.arange(n)
    lo_v = np.minimum.reduceat(np.where(gap, np.inf, values), starts)
    hi_v = np.maximum.reduceat(np.where(gap, -np.inf, values), starts)
    if mode != "m4":
        return [(int(steps[i]), float(h) if np.isfinite(h) else None)
                for i, h in zip(starts, hi_v)], True
    counts = np.diff(np.append(starts, n))
    at_lo = ~gap & (values == np.repeat(lo_v, counts))
    at_hi = ~gap & (values == np.repeat(hi_v, counts))
    first_lo = np.minimum.reduceat(np.where(at_lo, index, n), starts)
    first_hi = np.minimum.reduceat(np.where(at_hi, index, n), starts)
    first_gap = np.minimum.reduceat(np.where(gap, index, n), starts)
    chosen = np.concatenate([starts, starts + counts - 1, first_lo, first_hi, first_gap])
    chosen = np.unique(chosen[chosen < n])
    return [(int(steps[i]), None if gap[i] else float(values[i])) for i in chosen], True


def _emit(out: list, bucket: Bucket, mode: str) -> None:
    if mode == "m4":
        _m4(out, bucket)
    else:
        out.append((bucket.first_step, bucket.hi if bucket.num_nan == 0 or bucket.hi is not None
                    else None))


def read_window(conn: sqlite3.Connection, key: str, lo: int, hi: int, max_points: int, *,
                mode: str = "m4", have_rollups: bool = True,
                ) -> tuple[list[tuple[int, float | None]], bool]:
    """(points, downsampled) of series ``key`` for steps in [lo, hi], at most about
    ``max_points`` (see the module docstring). Steps may round out to bucket edges when
    summaries are used."""
    per = POINTS_PER_BUCKET if mode == "m4" else 1
    target = max(1, max_points // per)
    span = hi - lo + 1
    width = None
    if have_rollups:
        # The widest summaries that still give every bucket wanted; past RAW_LIMIT steps (a
        # long run's overview), a quarter of them will do (raw rows cost O(steps)).
        need = target if span <= RAW_LIMIT else max(1, target // 4)
        for w in reversed(WIDTHS):
            if span // w >= need:
                width = w
                break
    if width is None:
        return downsample_rows(raw_reader(conn)(key, lo, hi), max_points, mode=mode)
    rows = conn.execute(f"SELECT {BUCKET_COLUMNS} FROM rollups WHERE key=? AND width=? AND "
                        "bucket>=? AND bucket<=? ORDER BY bucket",
                        (key, width, lo // width, hi // width)).fetchall()
    if sum(r[0] for r in rows) <= max_points:  # sparse series (per-layer rows every N steps)
        return downsample_rows(raw_reader(conn)(key, lo, hi), max_points, mode=mode)
    return _combine_rows(rows, max(1, math.ceil(len(rows) / target)), mode), True


def _combine_rows(rows: list[tuple], group: int, mode: str) -> list[tuple[int, float | None]]:
    """M4 (or per-bucket max) points of consecutive summary rows merged ``group`` at a time:
    what :func:`combine` then :func:`_emit` give, vectorised (a long run's window is thousands
    of rows per series)."""
    import numpy as np

    a = np.array([[np.nan if v is None else v for v in r] for r in rows], dtype=np.float64)
    n = len(a)
    starts = np.arange(0, n, group)
    ends = np.minimum(starts + group, n) - 1
    index = np.arange(n, dtype=np.float64)
    lo, hi = a[:, 2], a[:, 4]
    with np.errstate(invalid="ignore"):
        g_lo = np.fmin.reduceat(lo, starts)
        g_hi = np.fmax.reduceat(hi, starts)
        size = np.diff(np.append(starts, n))
        at_lo = np.where(lo == np.repeat(g_lo, size), index, np.inf)
        at_hi = np.where(hi == np.repeat(g_hi, size), index, np.inf)
    i_lo = np.minimum.reduceat(at_lo, starts)
    i_hi = np.minimum.reduceat(at_hi, starts)
    nan_step = np.fmin.reduceat(a[:, 10], starts)
    first_step, first_val = a[starts, 6], a[starts, 7]
    last_step, last_val = a[ends, 8], a[ends, 9]
    has = np.isfinite(i_lo)
    lo_step = np.where(has, a[np.where(has, i_lo, 0).astype(int), 3], np.nan)
    has_hi = np.isfinite(i_hi)
    hi_step = np.where(has_hi, a[np.where(has_hi, i_hi, 0).astype(int), 5], np.nan)
    num_nan = np.add.reduceat(a[:, 1], starts)
    if mode != "m4":
        return [(int(st), None if not math.isfinite(v) else float(v))
                for st, v in zip(first_step.tolist(), g_hi.tolist())]
    groups = len(starts)
    # Candidates in insertion order (first, last, min, max, NaN): a later one at the same step
    # wins, as in the dict of _m4.
    steps = np.stack([first_step, last_step, lo_step, hi_step, nan_step], axis=1)
    values = np.stack([first_val, last_val, g_lo, g_hi, np.full(groups, np.nan)], axis=1)
    valid = np.stack([np.ones(groups, bool), np.ones(groups, bool), has, has_hi,
                      (num_nan > 0) & np.isfinite(nan_step)], axis=1)
    owner = np.repeat(np.arange(groups), 5).reshape(groups, 5)  # each candidate's group
    priority = np.tile(np.arange(5), (groups, 1))
    steps, values, owner, priority = (x[valid] for x in (steps, values, owner, priority))
    order = np.lexsort((priority, steps, owner))
    steps, values, owner = steps[order], values[order], owner[order]
    last_of_run = np.ones(len(steps), bool)
    last_of_run[:-1] = (owner[1:] != owner[:-1]) | (steps[1:] != steps[:-1])
    return [(int(st), None if not math.isfinite(v) else float(v))
            for st, v in zip(steps[last_of_run].tolist(), values[last_of_run].tolist())]


def _nan_none(value: float) -> float | None:
    return None if not math.isfinite(value) else float(value)
