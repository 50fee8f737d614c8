"""Published training runs as validation cases, one YAML file per source in ``sources/``.

Each file states where its numbers come from (``citation``, ``url``, ``licence``), what the
runs were (``setup``) and what we had to assume (``assumed``), then its rows. A row is a full
configuration written as the three job documents, so ``trainpilot validate --dump-row``
writes it as a job file that ``trainpilot predict --job`` reproduces exactly:

* ``model``: a preset name, a name from the file's ``models`` mapping, or an inline spec;
* ``cluster``: a preset name, where ``{gpus}`` is replaced by the row's device count, with
  the file's ``cluster_overrides`` merged into it (a device the presets lack, the network as
  measured), then the row's own (when one table of the file ran on other hardware);
* ``plan``: the file's ``defaults.plan`` merged with the row's; ``dp`` is derived from the
  device count when the row leaves it out.

``metric`` (the file's unless a row sets one) is what ``measured`` is: ``step_time_s``,
``tokens_per_s_per_gpu`` or ``tflops_per_gpu`` with a named FLOP ``convention``
(``runner.CONVENTIONS``). Every file here is held out: nothing was fitted to it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from trainpilot.specs import SpecError
from trainpilot.specs.presets import MODELS, cluster_preset

_SOURCE_KEYS = {"name", "title", "citation", "url", "licence", "split", "setup", "assumed",
                "metric", "convention", "models", "defaults", "rows", "cluster_overrides",
                "anchors", "param_counts", "batch"}
_ROW_KEYS = {"label", "gpus", "model", "cluster", "plan", "measured", "metric", "convention",
             "note", "free", "cluster_overrides"}
# Plan fields a source may leave to the model ("free"): the fastest value that fits is used.
FREE_KNOBS = ("micro_batch_size", "vp", "recompute")


@dataclass(frozen=True)
class Source:
    """One published source: where it comes from and its rows (raw documents)."""

    name: str
    title: str
    citation: str
    url: str
    licence: str
    split: str
    setup: str
    assumed: str
    rows: tuple[dict[str, Any], ...]
    param_counts: tuple[tuple[str, int], ...] = ()  # published parameter counts per model
    # The collection the source came in: 1, the sources the model was built beside (held out
    # from every fit, their errors read); 2 on, collected blind and scored once (held out only).
    batch: int = 1


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base`` (nested mappings merge key by key)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _documents(data: dict[str, Any], row: dict[str, Any], where: str) -> dict[str, Any]:
    """The row as {label, model, cluster, plan, metric, convention, measured} documents."""
    unknown = set(row) - _ROW_KEYS
    if unknown:
        raise SpecError(f"{where}.{sorted(unknown)[0]}", "<key>",
                        f"unknown key; valid keys: {', '.join(sorted(_ROW_KEYS))}")
    defaults = data.get("defaults", {})
    unknown = set(defaults) - {"model", "cluster", "plan", "free"}
    if unknown:
        raise SpecError(f"{where}.defaults.{sorted(unknown)[0]}", "<key>",
                        "unknown key; valid keys: cluster, free, model, plan")
    gpus = int(row["gpus"])
    model = row.get("model", defaults.get("model"))
    if isinstance(model, str) and model in data.get("models", {}):
        model = data["models"][model]
    elif isinstance(model, str):
        if model not in MODELS:
            raise SpecError(f"{where}.model", model, "not a preset or a model of this file")
        model = dict(MODELS[model])
    cluster = row.get("cluster", defaults.get("cluster"))
    if isinstance(cluster, str):
        name = cluster.format(gpus=gpus)
        found = cluster_preset(name)
        if found is None:
            raise SpecError(f"{where}.cluster", name, "not a cluster preset")
        cluster = found
    cluster = merge(cluster, data.get("cluster_overrides", {}))
    cluster = merge(cluster, row.get("cluster_overrides", {}))  # one row's hardware facts
    plan = merge(defaults.get("plan", {}), row.get("plan", {}))
    if "dp" not in plan:
        model_par = plan.get("tp", 1) * plan.get("pp", 1) * plan.get("cp", 1)
        plan["dp"] = (gpus - plan.get("idle_devices", 0)) // model_par
    free = tuple(row.get("free", defaults.get("free", ())))
    bad = [k for k in free if k not in FREE_KNOBS]
    if bad:
        raise SpecError(f"{where}.free", bad[0], f"valid: {', '.join(FREE_KNOBS)}")
    return dict(label=str(row["label"]), model=model, cluster=cluster, plan=plan,
                metric=row.get("metric", data.get("metric")),
                convention=row.get("convention", data.get("convention")),
                measured=float(row["measured"]), note=row.get("note", ""), free=free,
                model_key=row.get("model", defaults.get("model")))


def _source(data: dict[str, Any], file: str) -> Source:
    unknown = set(data) - _SOURCE_KEYS
    if unknown:
        raise SpecError(f"{file}.{sorted(unknown)[0]}", "<key>",
                        f"unknown key; valid keys: {', '.join(sorted(_SOURCE_KEYS))}")
    rows = tuple(_documents(data, row, f"{file}.rows[{i}]")
                 for i, row in enumerate(data["rows"]))
    batch = data.get("batch", 1)
    if not isinstance(batch, int) or batch < 1:
        raise SpecError(f"{file}.batch", batch, "a whole number >= 1")
    if batch > 1 and data.get("split", "held_out") != "held_out":
        raise SpecError(f"{file}.split", data.get("split"),
                        "a later batch is collected to test: held_out only")
    return Source(batch=batch, name=data["name"], title=data["title"], citation=data["citation"],
                  url=data["url"], licence=data["licence"], split=data.get("split", "held_out"),
                  setup=data.get("setup", ""), assumed=data.get("assumed", ""), rows=rows,
                  param_counts=tuple(sorted((data.get("param_counts") or {}).items())))


@lru_cache(maxsize=1)
def load_sources() -> tuple[Source, ...]:
    """Every bundled source file, in name order."""
    folder = resources.files("trainpilot.perf.validation").joinpath("sources")
    out = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            out.append(_source(yaml.safe_load(entry.read_text()), entry.name))
    return tuple(out)
