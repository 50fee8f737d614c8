"""Shared base for the job documents: strict, frozen, keyword-only pydantic models."""

from __future__ import annotations

from typing import Any

import pydantic


class Spec(pydantic.BaseModel):
    """Base of every document: unknown keys are errors, instances are immutable."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, validate_default=True)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/YAML-ready), omitting ``None`` so files stay short."""
        return self.model_dump(mode="json", exclude_none=True)

    def replace(self, **changes: Any):
        """A validated copy with ``changes`` applied (pydantic's ``model_copy`` skips validation)."""
        data = self.model_dump(mode="python")
        data.update(changes)
        return type(self).model_validate(data)
