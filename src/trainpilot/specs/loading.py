"""Load and dump the job documents: a preset name, a YAML/JSON file, a Hugging Face
``config.json``, or (plans) an inline ``key=value,...`` string."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from trainpilot.fsio import atomic_write_text
from trainpilot.specs import presets
from trainpilot.specs.base import Spec
from trainpilot.specs.cluster import ClusterSpec
from trainpilot.specs.errors import SpecError, from_pydantic
from trainpilot.specs.hf import looks_like_hf_config, model_from_hf_config
from trainpilot.specs.job import TrainJob
from trainpilot.specs.model import ModelSpec
from trainpilot.specs.plan import Plan

T = TypeVar("T", bound=Spec)

Ref = str | os.PathLike | dict | Spec


def read_document(path: str | os.PathLike, *, doc: str = "file") -> dict[str, Any]:
    """Parse a YAML or JSON file into a mapping; SpecError on anything else."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError(doc, str(path), f"cannot read the file ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise SpecError(doc, str(path), f"valid: a UTF-8 YAML/JSON text file (byte "
                        f"{err.start} is not UTF-8)") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise SpecError(doc, str(path), f"malformed {_format(path)}: {_yaml_where(err)}") from None
    if not isinstance(data, dict):
        raise SpecError(doc, str(path), f"expected a mapping of keys, got {type(data).__name__}")
    return data


def _format(path: Path) -> str:
    return "JSON" if path.suffix == ".json" else "YAML"


def _yaml_where(err: Exception) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at line {err.lineno}, column {err.colno}"
    return problem


def _inline_items(text: str) -> list[str]:
    """``text`` split at the commas outside brackets (``a=1,b=[x,y]`` -> two items)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_inline(text: str, *, doc: str = "plan") -> dict[str, Any]:
    """``"tp=8,pp=16,comm.bucket_mb=25,runtime.cuda_graph_scope=[attn,moe_router]"`` -> nested
    dict; values parsed as YAML (scalars, or a bracketed list)."""
    data: dict[str, Any] = {}
    for item in _inline_items(text):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(doc, item, "inline documents are key=value pairs separated by commas")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = data
        *parents, leaf = key.strip().split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return data


def validate(cls: type[T], data: dict[str, Any], *, doc: str, source: str | None = None) -> T:
    """``cls.model_validate`` with errors turned into one-line SpecErrors."""
    try:
        return cls.model_validate(data)
    except pydantic.ValidationError as err:
        raise from_pydantic(err, doc=doc, model_cls=cls, source=source) from None


def _load(cls: type[T], ref: Ref, *, doc: str, preset: dict[str, Any] | None,
          valid_presets: list[str], inline: bool = False) -> T:
    if isinstance(ref, cls):
        return ref
    if isinstance(ref, dict):
        return validate(cls, ref, doc=doc)
    if isinstance(ref, Spec):
        raise TypeError(f"{doc}: expected a {cls.__name__}, got a {type(ref).__name__}")
    text = os.fspath(ref)
    if preset is not None:
        return validate(cls, preset, doc=doc, source=text)
    path = Path(text)
    if path.suffix in (".yaml", ".yml", ".json") or path.exists():
        data = read_document(path, doc=doc)
        if cls is ModelSpec and looks_like_hf_config(data):
            data = model_from_hf_config(data, default_name=path.parent.name or path.stem)
        return validate(cls, data, doc=doc, source=str(path))
    if inline and "=" in text:
        return validate(cls, parse_inline(text, doc=doc), doc=doc)
    hint = " or inline key=value pairs" if inline else ""
    raise SpecError(
        doc, text, f"not a preset or a file{hint}; valid presets: {', '.join(valid_presets)}"
    )


def load_model(ref: Ref) -> ModelSpec:
    """A ModelSpec from a preset name, a YAML/JSON file or a Hugging Face config.json."""
    preset = presets.MODELS.get(ref) if isinstance(ref, str) else None
    return _load(ModelSpec, ref, doc="model", preset=preset,
                 valid_presets=list(presets.MODELS))


def load_cluster(ref: Ref) -> ClusterSpec:
    """A ClusterSpec from a preset ("selene", "<device>-x<N>") or a YAML/JSON file."""
    found = presets.cluster_preset(ref) if isinstance(ref, str) else None
    valid = list(presets.NAMED_CLUSTERS) + ["<device>-x<N> with device in " + "|".join(presets.DEVICES)]
    return _load(ClusterSpec, ref, doc="cluster", preset=found, valid_presets=valid)


def load_plan(ref: Ref) -> Plan:
    """A Plan from a YAML/JSON file or inline ``tp=8,pp=16,...``."""
    return _load(Plan, ref, doc="plan", preset=None, valid_presets=["(plans have no presets)"],
                 inline=True)


def load_job(ref: Ref) -> TrainJob:
    """A TrainJob from a preset name or a YAML/JSON file whose documents may be presets."""
    preset = presets.JOBS.get(ref) if isinstance(ref, str) else None
    return _load(TrainJob, ref, doc="job", preset=preset,
                 valid_presets=list(presets.JOBS))


def dump(spec: Spec, path: str | os.PathLike | None = None) -> str:
    """YAML (or JSON when ``path`` ends in .json) text of ``spec``; written atomically to
    ``path`` when given."""
    data = spec.to_dict()
    as_json = path is not None and os.fspath(path).endswith(".json")
    text = json.dumps(data, indent=2) + "\n" if as_json else yaml.safe_dump(data, sort_keys=False)
    if path is not None:
        atomic_write_text(path, text)
    return text
