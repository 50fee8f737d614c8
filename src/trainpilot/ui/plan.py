"""The plan panel: the run's layout, and its step time as predicted next to as measured.

The prediction is taken, in order, from what the run recorded (a ``prediction`` or ``summary``
document, the run's info, a ``predicted_step_time_s`` metric, the runtime's ``summary.json``),
else computed by the cost model (``trainpilot.perf.predict``) from the stored model, cluster and
plan documents; otherwise the panel says it is not available and why. Measured: the median step
time of the run, first step (warm-up) excluded.
"""

from __future__ import annotations

import json
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from trainpilot.store import RunStore
from trainpilot.ui.runs import finite

LAYOUT_KEYS = ("dp", "tp", "pp", "vp", "ep", "cp", "zero", "micro_batch_size",
               "global_batch_size", "seq_len", "recompute", "precision")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_yaml(path: Path) -> dict[str, Any] | None:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


class _Values:
    """A metric's values after its first step, kept per open store and extended with only the
    rows of batches committed since (a live dashboard asks every few seconds)."""

    def __init__(self):
        self.batch, self.last_step, self.first_step = -1, None, None
        self.values = np.empty(0)


_CACHE: weakref.WeakKeyDictionary[RunStore, dict[str, _Values]] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def values_after_first(store: RunStore, name: str) -> np.ndarray:
    """Finite values of metric ``name`` at every step after its first (warm-up) step; O(new
    rows) per call on a store with batches (schema 2), O(rows) otherwise."""
    with _CACHE_LOCK:
        cache = _CACHE.setdefault(store, {}).setdefault(name, _Values())
    with store.snapshot():
        batch = store.batch_cursor()
        if store.has_rollups and cache.last_step is not None:
            _, metric, _ = store.batches_since(cache.batch)
            if metric is None:
                return cache.values
            if metric[0] > cache.last_step:  # only new steps: extend
                rows = store.metrics([name], since_step=cache.last_step)[name]
                return _extend(cache, rows, batch)
        rows = store.metrics([name])[name]
        cache.values, cache.last_step, cache.first_step = np.empty(0), None, None
        if rows:
            cache.first_step = rows[0][0]
            rows = rows[1:]
            cache.last_step = cache.first_step
        return _extend(cache, rows, batch)


def _extend(cache: _Values, rows: list[tuple[int, float]], batch: int) -> np.ndarray:
    if rows:
        new = np.fromiter((v for _, v in rows), dtype=np.float64, count=len(rows))
        cache.values = np.concatenate([cache.values, new[np.isfinite(new)]])
        cache.last_step = rows[-1][0]
    cache.batch = batch
    return cache.values


def measured_step_time(store: RunStore) -> tuple[float | None, int]:
    """(median step time in seconds over steps after the first, number of steps used). O(n):
    a selection (``np.median`` partitions), never a sort inside a loop."""
    timed = values_after_first(store, "step_time_s")
    if not len(timed):
        steps, values = store.series("step_time_s")
        timed = np.asarray([v for v in values if finite(v) is not None], dtype=np.float64)
    if not len(timed):
        per_rank = [t.step_s for t in store.rank_timings() if t.rank == 0 and t.step_s]
        timed = np.asarray(per_rank[1:] or per_rank, dtype=np.float64)
    return (float(np.median(timed)) if len(timed) else None), int(len(timed))


def recorded_prediction(store: RunStore, docs: dict[str, Any], run_dir: Path | None,
                        ) -> tuple[float | None, str | None]:
    """A predicted step time the run recorded, with where it was found."""
    for kind, key in (("prediction", "step_time_s"), ("prediction", "predicted_step_time_s"),
                      ("summary", "predicted_step_time_s")):
        value = finite((docs.get(kind) or {}).get(key))
        if value:
            return value, f"recorded by the run (document '{kind}')"
    run = store.run()
    value = finite((run.info if run else {}).get("predicted_step_time_s"))
    if value:
        return value, "recorded by the run (run info)"
    steps, values = store.series("predicted_step_time_s")
    if values and finite(values[-1]):
        return values[-1], "recorded by the run (metric predicted_step_time_s)"
    summary = (_read_json(run_dir / "summary.json") if run_dir else None) or {}
    value = finite(summary.get("predicted_step_time_s"))
    if value:
        note = summary.get("prediction_note")
        return value, "the runtime's summary.json" + (f" ({note})" if note else "")
    return None, None


def computed_prediction(docs: dict[str, Any]) -> tuple[float | None, str]:
    """The cost model's step time for the stored model, cluster and plan documents."""
    missing = [k for k in ("model", "cluster", "plan") if k not in docs]
    if missing:
        names = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " or " + missing[-1]
        return None, f"not available: the run recorded no {names} document"
    try:
        from trainpilot.perf.predict import predict
        from trainpilot.specs import ClusterSpec, ModelSpec, Plan

        prediction = predict(ModelSpec.model_validate(docs["model"]),
                             ClusterSpec.model_validate(docs["cluster"]),
                             Plan.model_validate(docs["plan"]))
    except (ValueError, ImportError) as err:  # SpecError and pydantic errors are ValueErrors
        return None, f"not available: the stored documents do not load ({str(err)[:160]})"
    return prediction.step_time_s, "trainpilot.perf.predict on the stored documents"


def plan_section(store: RunStore, run_dir: str | Path | None = None) -> dict[str, Any]:
    """Layout, documents and predicted vs measured step time (seconds) of a run."""
    run_dir = Path(run_dir) if run_dir else None
    docs = store.documents()
    for kind in ("plan", "model", "cluster"):
        if kind not in docs and run_dir is not None:
            loaded = _read_yaml(run_dir / f"{kind}.yaml")
            if loaded:
                docs[kind] = loaded
    plan = docs.get("plan") or {}
    layout = {k: plan[k] for k in LAYOUT_KEYS if k in plan}
    predicted, source = recorded_prediction(store, docs, run_dir)
    if predicted is None:
        predicted, source = computed_prediction(docs)
    measured, num_steps = measured_step_time(store)
    out = dict(layout=layout, model=_brief(docs.get("model")), cluster=_brief(docs.get("cluster")),
               predicted_step_time_s=predicted, prediction_source=source,
               measured_step_time_s=measured, num_steps_measured=num_steps,
               measured_over_predicted=None, error_pct=None)
    if predicted and measured:
        out["measured_over_predicted"] = measured / predicted
        out["error_pct"] = 100.0 * (predicted - measured) / measured
    return out


def _brief(doc: dict[str, Any] | None) -> dict[str, Any] | None:
    """Scalar fields of a document (nested tables are left out of the panel)."""
    if not doc:
        return None
    return {k: v for k, v in doc.items() if isinstance(v, (str, int, float, bool))}
