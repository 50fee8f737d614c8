"""One error type for bad input, and its one-line rendering.

Every validation failure in trainpilot is a :class:`SpecError` (a ``ValueError``) that names the
field, the offending value and what would be valid, so the CLI can print one line and exit 2.
"""

from __future__ import annotations

from typing import Any

import pydantic


class SpecError(ValueError):
    """Bad user input: ``field`` had ``value``; ``valid`` says what would be accepted."""

    def __init__(self, field: str, value: Any, valid: str, *, source: str | None = None):
        self.field = field
        self.value = value
        self.valid = valid
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{field}: got {_show(value)}; {valid}")


def _show(value: Any) -> str:
    """``value`` as the line shows it: at most 80 characters, its start and its end (a long
    path keeps its file name and line number)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:36] + "..." + text[-41:]


def _known_keys(model_cls: type | None, loc: tuple) -> list[str]:
    """The keys accepted at the parent of ``loc`` (for an 'unknown key' message)."""
    cls = model_cls
    for part in loc[:-1]:
        if cls is None or not hasattr(cls, "model_fields") or part not in cls.model_fields:
            return []
        cls = _model_in(cls.model_fields[part].annotation)
    if cls is None or not hasattr(cls, "model_fields"):
        return []
    return sorted(cls.model_fields)


def _model_in(annotation: Any) -> type | None:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def from_pydantic(
    err: pydantic.ValidationError,
    *,
    doc: str,
    model_cls: type | None = None,
    source: str | None = None,
) -> SpecError:
    """Turn pydantic's multi-line report into one SpecError naming the first bad field."""
    first = err.errors(include_url=False)[0]
    loc = tuple(p for p in first["loc"] if p != "__root__")
    path = ".".join(str(p) for p in loc)
    field = f"{doc}.{path}" if path else doc
    kind = first["type"]
    value = first.get("input")
    original = (first.get("ctx") or {}).get("error")
    if isinstance(original, SpecError):
        # Our validators name their field: absolute ("plan.tp", from cross-document rules) or
        # relative to the model they validate ("top_k" inside "model.moe").
        name = original.field
        if name.split(".")[0] not in ("model", "cluster", "plan", "job"):
            name = ".".join(filter(None, (doc, path, name)))
        return SpecError(name, original.value, original.valid, source=source)
    if kind == "extra_forbidden":
        keys = _known_keys(model_cls, loc)
        valid = "unknown key" + (f"; valid keys: {', '.join(keys)}" if keys else "")
        return SpecError(field, value, valid, source=source)
    msg = first["msg"]
    # pydantic prefixes our own ValueErrors with "Value error, "; keep only what we wrote.
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind == "missing":
        return SpecError(field, "<missing>", "this key is required", source=source)
    return SpecError(field, value, msg[0].lower() + msg[1:] if msg else msg, source=source)
