"""What the dashboard and the report draw, read from a run's store as JSON-ready dicts.

Incremental reads (live updates): the page passes the cursor of its last answer and gets only
what was committed since. Cursors stay consistent with the store's write pattern: all of one
step's metrics are committed in one batch, and so are all ranks' timings of one step, so the
metric cursor is the largest step visible when the read starts (every series is read up to it),
and the rank cursor is the largest step in the one query that read the timings. A rolled-back
run rewrites steps behind the cursor; it also logs a ``restart`` event, on which the page reloads
everything. So does a ``run_resumed`` event: a re-run process without a checkpoint to restore logs
from step 1 again, and only the store's reopening marks it.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from trainpilot.store import RunStore
from trainpilot.ui.runs import finite

# Per-step series the panels draw (a run may have any subset).
SERIES = ("loss", "loss_trend", "lr", "grad_norm", "step_time_s", "data_time_s",
          "compute_time_s", "comm_time_s", "comm_max_s", "tokens_per_s", "mfu", "peak_mem_gib",
          "mem_frac", "update_ratio", "zero_grad_frac", "nonfinite_grads", "skipped_update",
          "health/score", "health/gradient_flow", "health/communication", "health/hardware",
          "health/convergence")
LAYER_PREFIX = "grad_norm/"
TIMELINE_KINDS = ("alert", "alert_cleared", "intervention", "fault", "restart", "checkpoint",
                  "diagnosis", "lr_change", "run_start", "run_resumed", "run_end", "note")
STRAGGLER_RATIO = 1.2  # the default straggler rule (health rules.yaml): >= 1.2x the others


def natural_key(name: str) -> list[Any]:
    """Sort 'blocks.10' after 'blocks.9'."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _columns(rows: Iterable[tuple[int, float]]) -> dict[str, list]:
    steps, values = [], []
    for step, value in rows:
        steps.append(step)
        values.append(finite(value))
    return {"steps": steps, "values": values}


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


def series(store: RunStore, *, since_step: int | None, until_step: int | None,
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(series by name, per-layer gradient norms) with steps in (since_step, until_step]."""
    names = store.metric_names()
    wanted = [n for n in SERIES if n in names]
    layers = sorted((n for n in names if n.startswith(LAYER_PREFIX)), key=natural_key)
    read = store.metrics(wanted + layers, since_step=since_step, until_step=until_step)
    out = {n: _columns(read[n]) for n in wanted}
    layer_out = {n[len(LAYER_PREFIX):]: _columns(read[n]) for n in layers}
    return out, {"names": list(layer_out), "series": layer_out}


def rank_columns(store: RunStore, *, since_step: int | None) -> dict[str, Any]:
    """Per-rank timings as columns, plus tokens/s per rank where the step's global tokens are
    known (``tokens_per_s * step_time_s``, split evenly across ranks: data-parallel shards)."""
    rows = store.rank_timings(since_step=since_step)
    cols: dict[str, list] = {k: [] for k in ("step", "rank", "step_s", "compute_s", "comm_s",
                                             "data_s", "tokens_per_s")}
    if not rows:
        return dict(cols, cursor=since_step)
    lo, hi = rows[0].step, rows[-1].step
    run = store.run()
    world = max(1, run.world_size if run else 1)
    metrics = store.metrics(["tokens_per_s", "step_time_s"], since_step=lo - 1, until_step=hi)
    step_time = dict(metrics["step_time_s"])
    tokens = {s: tps * step_time[s] for s, tps in metrics["tokens_per_s"]
              if s in step_time and finite(tps) is not None and finite(step_time[s]) is not None}
    for t in rows:
        cols["step"].append(t.step)
        cols["rank"].append(t.rank)
        for key in ("step_s", "compute_s", "comm_s", "data_s"):
            cols[key].append(finite(getattr(t, key)))
        per_rank = tokens.get(t.step)
        cols["tokens_per_s"].append(
            finite(per_rank / world / t.step_s) if per_rank and t.step_s else None)
    return dict(cols, cursor=hi)


def event_dicts(store: RunStore, *, since_id: int = 0,
                kinds: Iterable[str] = TIMELINE_KINDS) -> list[dict[str, Any]]:
    return [dict(id=e.id, time=e.time, step=e.step, kind=e.kind, severity=e.severity,
                 name=e.name, message=e.message, payload=clean(e.payload))
            for e in store.events(since_id=since_id, kinds=list(kinds))]


def stragglers(store: RunStore) -> dict[str, float]:
    """Per rank: median over the last 20 steps of compute time / median of the other ranks."""
    from trainpilot.health.view import straggler_ratios

    return {str(rank): ratio for rank, ratio in straggler_ratios(store).items()}


def run_data(store: RunStore, *, since_step: int | None = None, since_rank_step: int | None = None,
             since_event: int = 0) -> dict[str, Any]:
    """Everything the run page draws that changed after the given cursors (None/0: all).

    Keys: run, cursor {step, rank_step, event}, series {name: {steps, values}}, layers {names,
    series}, ranks (columns), stragglers {rank: ratio}, straggler_ratio, forecast (latest, whole),
    events (new ones). Values are floats or null (NaN and infinities become null)."""
    until = store.latest_step()
    if until is None:
        until = since_step
    metric_series, layers = series(store, since_step=since_step, until_step=until)
    ranks = rank_columns(store, since_step=since_rank_step)
    events = event_dicts(store, since_id=since_event)
    return dict(
        run=run_info(store),
        cursor=dict(step=until, rank_step=ranks.pop("cursor"),
                    event=events[-1]["id"] if events else since_event),
        series=metric_series, layers=layers, ranks=ranks, stragglers=clean(stragglers(store)),
        straggler_ratio=STRAGGLER_RATIO, forecast=clean(store.latest_forecast()), events=events)


def compare_data(stores: dict[str, RunStore], name: str = "loss") -> dict[str, Any]:
    """One metric (default the loss) of several runs, for the index page's comparison chart."""
    out = {}
    for key, store in stores.items():
        run = store.run()
        out[key] = dict(name=run.name if run else key, status=run.status if run else None,
                        **_columns(store.metrics([name])[name]))
    return {"metric": name, "runs": out}
