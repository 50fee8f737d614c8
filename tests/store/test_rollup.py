"""The store's per-bucket summaries equal the raw rows they summarise (rewrites and NaN
included), downsampled reads keep every extreme, and the batch cursor covers every row."""

from __future__ import annotations

import math
import random
import sqlite3

import pytest

from trainpilot.store import RankTiming, RunStore, rollup
from trainpilot.store.rollup import WIDTHS, metric_key, summarise, timing_key


def _brute(conn, key, width):
    """Summaries computed from scratch from the raw rows."""
    rows = rollup.raw_reader(conn)(key, -(1 << 62), 1 << 62)
    by: dict[int, list] = {}
    for s, v in rows:
        by.setdefault(s // width, []).append((s, v))
    return {b: summarise(r) for b, r in by.items()}


def _stored(conn, key, width):
    rows = conn.execute(f"SELECT bucket, {rollup.BUCKET_COLUMNS} FROM rollups WHERE key=? AND "
                        "width=?", (key, width)).fetchall()
    return {r[0]: rollup.Bucket.from_row(r[1:]) for r in rows}


def _write(tmp_path, num_steps=5000, seed=0):
    rng = random.Random(seed)
    store = RunStore.create(tmp_path, world_size=2, flush_every_steps=37, flush_interval_s=3600)
    for step in range(1, num_steps + 1):
        loss = math.nan if step % 997 == 0 else 3.0 + rng.random()
        store.log_metrics(step, {"loss": loss})
        if step % 25 == 0:
            store.log_metrics(step, {"grad_norm/embed": rng.random()})  # a second call, same step
        store.log_rank_timings([RankTiming(step=step, rank=r, compute_s=0.1 + 0.1 * r
                                           + 0.01 * rng.random()) for r in (0, 1)])
    store.flush()
    for step in range(1200, 1300):  # a rollback re-logs steps behind the newest
        store.log_metrics(step, {"loss": 100.0 if step == 1250 else 1.0})
    store.close(status="completed")
    return tmp_path


def test_summaries_equal_the_raw_rows_after_appends_rewrites_and_nans(tmp_path):
    _write(tmp_path)
    conn = sqlite3.connect(tmp_path / "trainpilot.db")
    for key in (metric_key("loss"), metric_key("grad_norm/embed"), timing_key(1, "compute_s")):
        for width in WIDTHS:
            assert _stored(conn, key, width) == _brute(conn, key, width), (key, width)
    # Negative control: the comparison sees a stale bucket.
    conn.execute("UPDATE metrics SET value = 5.0 WHERE name='loss' AND step=10")
    assert _stored(conn, metric_key("loss"), 64) != _brute(conn, metric_key("loss"), 64)


def test_downsampled_window_keeps_the_extremes_and_gaps(tmp_path):
    _write(tmp_path)
    with RunStore.open_readonly(tmp_path) as store:
        points, down = store.window(metric_key("loss"), 1, 5000, 400)
        assert down and len(points) <= 400 + 400 // 4
        steps = [s for s, _ in points]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)
        assert (1250, 100.0) in points  # the one-step spike survives
        assert {s for s, v in points if v is None} == {997, 1994, 2991, 3988, 4985}
        assert points[0][0] == 1 and points[-1][0] == 5000
        # A narrow window comes back raw, every row.
        raw, down = store.window(metric_key("loss"), 100, 199, 400)
        assert not down and [s for s, _ in raw] == list(range(100, 200))
        # Sparse series (every 25 steps) over the whole run: 200 rows, raw.
        layer, down = store.window(metric_key("grad_norm/embed"), 1, 5000, 400)
        assert not down and len(layer) == 200
        assert store.metric_names() == ["grad_norm/embed", "loss"]
        assert store.latest_metrics()[1]["loss"] == pytest.approx(
            store.series("loss")[1][-1])
        assert store.ranks() == [0, 1]


def test_batch_cursor_ranges_cover_every_row_written_since(tmp_path):
    writer = RunStore.create(tmp_path, flush_every_steps=3, flush_interval_s=3600)
    reader = RunStore.open_readonly(tmp_path)
    cursor = reader.batch_cursor()
    for step in range(1, 10):
        writer.log_metrics(step, {"loss": 1.0})
    writer.flush()
    last, metric, timing = reader.batches_since(cursor)
    assert metric == (1, 9) and timing is None and last > cursor
    writer.log_metrics(4, {"extra": 2.0})  # a late row for an old step
    writer.flush()
    last2, metric, _ = reader.batches_since(last)
    assert metric == (4, 4) and last2 > last
    assert reader.batches_since(last2) == (last2, None, None)
    writer.close()


def test_a_schema_1_store_reopened_for_writing_gets_its_summaries(tmp_path):
    _write(tmp_path, num_steps=300)
    conn = sqlite3.connect(tmp_path / "trainpilot.db")
    conn.executescript("DROP TABLE rollups; DROP TABLE series; DROP TABLE batches; "
                       "UPDATE meta SET value='1' WHERE key='schema_version';")
    conn.close()
    old = RunStore.open_readonly(tmp_path)
    assert not old.has_rollups and old.metric_names() == ["grad_norm/embed", "loss"]
    points, _ = old.window(metric_key("loss"), 1, 300, 1000)
    assert len(points) == 300
    old.close()
    RunStore.append(tmp_path).close()
    conn = sqlite3.connect(tmp_path / "trainpilot.db")
    for width in WIDTHS:
        assert _stored(conn, metric_key("loss"), width) == _brute(conn, metric_key("loss"), width)
    assert conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == ("2",)


def test_vectorised_downsampling_gives_the_points_of_the_per_bucket_summaries():
    rng = random.Random(3)
    rows = [(s, None if s % 53 == 0 else (math.inf if s == 77 else rng.random()))
            for s in range(1, 3001)]
    points, down = rollup.downsample_rows(rows, 400)
    assert down
    size = math.ceil(len(rows) / 100)
    expected = []
    for i in range(0, len(rows), size):
        rollup._m4(expected, summarise(rows[i:i + size]))
    assert points == expected
    heat, _ = rollup.downsample_rows(rows, 100, mode="max")
    assert heat[0] == (1, max(v for s, v in rows[:30] if v is not None and math.isfinite(v)))


def test_vectorised_combination_equals_combining_bucket_by_bucket(tmp_path):
    _write(tmp_path, num_steps=5000)
    conn = sqlite3.connect(tmp_path / "trainpilot.db")
    rows = conn.execute(f"SELECT {rollup.BUCKET_COLUMNS} FROM rollups WHERE key=? AND width=64 "
                        "ORDER BY bucket", (metric_key("loss"),)).fetchall()
    for group, mode in ((3, "m4"), (7, "m4"), (5, "max")):
        expected: list = []
        buckets = [rollup.Bucket.from_row(r) for r in rows]
        for i in range(0, len(buckets), group):
            rollup._emit(expected, rollup.combine(buckets[i:i + group]), mode)
        assert rollup._combine_rows(rows, group, mode) == expected
