"""What the dashboard and the report draw, read from a run's store as JSON-ready dicts.

Every answer is read inside one read transaction (``RunStore.snapshot``): one committed state.

**Cursor (live updates).** The store numbers every committed batch and records the step range
of the rows it wrote (``batches``). The page passes the id of the last batch it saw and gets,
for every series, all rows in the step range of the batches committed since, with that range
(``lo``, ``hi``): it replaces its points in [lo, hi] with them. So a row is never skipped, however
the writer splits a step's metrics over calls and flushes (the runtime's recorder and the
health monitor log one step in two calls; a flush between them used to move a step cursor past
the second half), and a rolled-back run's rewritten steps arrive as a replacement of their range.
Stores written before the ``batches`` table (schema 1) fall back to a step cursor that stays one
step behind the newest step, so the newest step, which may be incomplete, is read again.

**Resolution.** A series with more than ``max_points`` rows in the range read comes back
downsampled (``trainpilot.store.rollup``: first/min/max/last per bucket, NaN kept as a gap, from
the store's per-bucket summaries, O(buckets)), flagged ``downsampled``; the page asks for a
window (``lo``/``hi``) when the user zooms, which comes back at full resolution once it holds
fewer rows than ``max_points``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from trainpilot.specs.errors import SpecError
from trainpilot.store import RunStore
from trainpilot.store.rollup import TIMING_COLUMNS, metric_key, timing_key
from trainpilot.ui.runs import finite

# Per-step series the panels draw (a run may have any subset).
SERIES = ("loss", "loss_trend", "lr", "grad_norm", "step_time_s", "data_time_s",
          "compute_time_s", "comm_time_s", "comm_max_s", "tokens_per_s", "mfu", "peak_mem_gib",
          "mem_frac", "update_ratio", "zero_grad_frac", "nonfinite_grads", "skipped_update",
          "health/score", "health/gradient_flow", "health/communication", "health/hardware",
          "health/convergence")
LAYER_PREFIX = "grad_norm/"
TIMELINE_KINDS = ("alert", "alert_cleared", "intervention", "fault", "restart", "checkpoint",
                  "diagnosis", "lr_change", "run_start", "run_resumed", "run_end", "note",
                  "recovered")
STRAGGLER_RATIO = 1.2  # the default straggler rule (health rules.yaml): >= 1.2x the others
DEFAULT_MAX_POINTS = 1200  # per series: M4 over 300 buckets, about one per two pixels of a chart
MAX_POINTS_LIMIT = 200_000
MAX_RANKS_DRAWN = 64  # per-rank lines beyond this many ranks are not sent
STEP_LIMIT = 1 << 62  # steps are SQLite integers; parameters past this are refused


def natural_key(name: str) -> list[Any]:
    """Sort 'blocks.10' after 'blocks.9'."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def clean(value: Any) -> Any:
    """``value`` with every NaN or infinity (event payloads may hold a NaN loss) made null, so
    it is valid JSON."""
    if isinstance(value, float):
        return finite(value)
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def run_info(store: RunStore) -> dict[str, Any] | None:
    run = store.run()
    if run is None:
        return None
    return dict(run_id=run.run_id, name=run.name, status=run.status,
                started_time=run.started_time, ended_time=run.ended_time,
                world_size=run.world_size, host=run.host, info=clean(run.info))


def _series(points: list[tuple[int, float | None]], lo: int | None, hi: int | None,
            down: bool) -> dict[str, Any]:
    return {"steps": [s for s, _ in points], "values": [finite(v) for _, v in points],
            "lo": lo, "hi": hi, "downsampled": down}


def window_data(store: RunStore, lo: int | None, hi: int | None, *,
                max_points: int = DEFAULT_MAX_POINTS, timing_lo: int | None = None,
                timing_hi: int | None = None, metrics: bool = True,
                timings: bool = True) -> dict[str, Any]:
    """Series, per-layer norms and per-rank timings with steps in [lo, hi] (each at most about
    ``max_points``; None bounds: the whole run). Timings use [timing_lo, timing_hi] when
    given."""
    first, last = store.step_range()
    if first is None or last is None:  # no steps yet (the two are None together)
        return dict(series={}, layers={"names": [], "series": {}}, ranks={})
    lo = first if lo is None else max(lo, first)
    hi = last if hi is None else min(hi, last)
    out: dict[str, Any] = dict(series={}, layers={"names": [], "series": {}}, ranks={})
    if metrics and lo <= hi:
        names = store.metric_names()
        wanted = [n for n in SERIES if n in set(names)]
        for name in wanted:
            points, down = store.window(metric_key(name), lo, hi, max_points)
            out["series"][name] = _series(points, lo, hi, down)
        layers = sorted((n for n in names if n.startswith(LAYER_PREFIX)), key=natural_key)
        for name in layers:
            points, down = store.window(metric_key(name), lo, hi, max_points, mode="max")
            out["layers"]["series"][name[len(LAYER_PREFIX):]] = _series(points, lo, hi, down)
        out["layers"]["names"] = [n[len(LAYER_PREFIX):] for n in layers]
    t_lo = lo if timing_lo is None else timing_lo
    t_hi = hi if timing_hi is None else timing_hi
    if timings and t_lo <= t_hi:
        out["ranks"] = rank_series(store, t_lo, t_hi, max_points=max_points)
    return out


def tokens_per_step(store: RunStore) -> float | None:
    """Tokens of one optimizer step (all ranks): the latest ``tokens_per_s * step_time_s``."""
    _, latest = store.latest_metrics()
    tps, step_s = finite(latest.get("tokens_per_s")), finite(latest.get("step_time_s"))
    return tps * step_s if tps and step_s else None


def rank_series(store: RunStore, lo: int, hi: int, *, max_points: int = DEFAULT_MAX_POINTS,
                ) -> dict[str, dict[str, Any]]:
    """Per rank (as a string): each timing column and tokens/s as series in [lo, hi].

    Tokens/s per rank is the step's tokens split evenly across ranks (data-parallel shards)
    over the rank's ``step_s``."""
    run = store.run()
    world = max(1, run.world_size if run else 1)
    tokens = tokens_per_step(store)
    out: dict[str, dict[str, Any]] = {}
    for rank in store.ranks()[:MAX_RANKS_DRAWN]:
        cols: dict[str, Any] = {}
        for column in TIMING_COLUMNS:
            points, down = store.window(timing_key(rank, column), lo, hi, max_points)
            cols[column] = _series(points, lo, hi, down)
        step_s = cols["step_s"]
        cols["tokens_per_s"] = dict(step_s, values=[
            finite(tokens / world / v) if tokens and v else None for v in step_s["values"]])
        out[str(rank)] = cols
    return out


MAX_PLACED_BY_TIME = 200  # events without a step placed on the step axis by their time


def event_dicts(store: RunStore, *, since_id: int = 0,
                kinds: Iterable[str] = TIMELINE_KINDS) -> list[dict[str, Any]]:
    """Events after ``since_id``. ``x_step``: where the timeline draws it: its step, or for an
    event without one (run start/end, a diagnosis) the step being trained when it happened,
    with ``placed_by_time`` true; None where neither is known (then it is not drawn)."""
    out, placed = [], 0
    for e in store.events(since_id=since_id, kinds=list(kinds)):
        x_step, by_time = e.step, False
        if x_step is None and placed < MAX_PLACED_BY_TIME:
            x_step, by_time = store.step_at_time(e.time), True
            placed += 1
        out.append(dict(id=e.id, time=e.time, step=e.step, x_step=x_step,
                        placed_by_time=by_time and x_step is not None, kind=e.kind,
                        severity=e.severity, name=e.name, message=e.message,
                        payload=clean(e.payload)))
    return out


def stragglers(store: RunStore) -> dict[str, float]:
    """Per rank: median over the last 20 steps of compute time / median of the other ranks."""
    from trainpilot.health.view import straggler_ratios

    return {str(rank): ratio for rank, ratio in straggler_ratios(store).items()}


def check_int(name: str, value: int | None, *, low: int = 0, high: int = STEP_LIMIT) -> None:
    """A bounded integer parameter (the API's cursors, windows and point counts)."""
    if value is not None and not low <= value <= high:
        raise SpecError(name, value, f"valid: an integer in [{low}, {high}]")


def run_data(store: RunStore, *, since_batch: int | None = None, since_step: int | None = None,
             since_event: int = 0, max_points: int = DEFAULT_MAX_POINTS,
             ) -> dict[str, Any]:
    """Everything the run page draws that changed after the cursors (None/0: everything).

    Keys: run, cursor {batch, step, event, mode}, series {name: {steps, values, lo, hi,
    downsampled}}, layers {names, series}, ranks {rank: {column: series}}, stragglers {rank:
    ratio}, straggler_ratio, forecast (latest, whole), events (new ones), incremental. Values
    are floats or null (NaN and infinities become null). An incremental answer's series each
    replace the page's points in their [lo, hi]."""
    check_int("since_batch", since_batch, low=0)
    check_int("since_step", since_step, low=-STEP_LIMIT)
    check_int("since_event", since_event, low=0)
    check_int("max_points", max_points, low=16, high=MAX_POINTS_LIMIT)
    with store.snapshot():
        latest = store.latest_step()
        if store.has_rollups:
            batch = store.batch_cursor()
            if since_batch is None:
                data = window_data(store, None, None, max_points=max_points)
            else:
                _, metric, timing = store.batches_since(since_batch)
                data = window_data(
                    store, *(metric or (1, 0)), max_points=max_points,
                    timing_lo=timing[0] if timing else 1, timing_hi=timing[1] if timing else 0,
                    metrics=metric is not None, timings=timing is not None)
            cursor = dict(mode="batch", batch=batch, step=latest)
        else:  # schema 1: a step cursor held one step behind the newest step
            lo = None if since_step is None else since_step + 1
            data = window_data(store, lo, None, max_points=max_points)
            held = None if latest is None else latest - 1
            if since_step is not None and held is not None:
                held = max(held, since_step)
            cursor = dict(mode="step", batch=None, step=held)
        events = event_dicts(store, since_id=since_event)
        cursor["event"] = events[-1]["id"] if events else since_event
        return dict(
            run=run_info(store), cursor=cursor, latest_step=latest,
            incremental=since_batch is not None or since_step is not None, **data,
            stragglers=clean(stragglers(store)), straggler_ratio=STRAGGLER_RATIO,
            forecast=clean(store.latest_forecast()), events=events)


def compare_data(stores: dict[str, RunStore], name: str = "loss", *,
                 max_points: int = DEFAULT_MAX_POINTS) -> dict[str, Any]:
    """One metric (default the loss) of several runs, for the index page's comparison chart."""
    check_int("max_points", max_points, low=16, high=MAX_POINTS_LIMIT)
    out = {}
    for key, store in stores.items():
        with store.snapshot():
            run = store.run()
            first, last = store.step_range()
            points, down = ([], False) if first is None or last is None else store.window(
                metric_key(name), first, last, max_points)
            out[key] = dict(name=run.name if run else key, status=run.status if run else None,
                            **_series(points, first, last, down))
    return {"metric": name, "runs": out}


def csv_rows(store: RunStore, names: list[str]) -> Iterable[str]:
    """The named metrics at full resolution as CSV lines (step, one column per name; empty
    where a metric has no row or is NaN), streamed name by name join on step."""
    yield "step," + ",".join(_csv_field(n) for n in names) + "\n"
    with store.snapshot():
        cols = store.metrics(names)
    merged: dict[int, list[str]] = {}
    for i, name in enumerate(names):
        for step, value in cols[name]:
            row = merged.setdefault(step, [""] * len(names))
            v = finite(value)
            row[i] = "" if v is None else repr(v)
    for step in sorted(merged):
        yield f"{step}," + ",".join(merged[step]) + "\n"


def _csv_field(text: str) -> str:
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text
