"""Health configuration: rules (alerts) and interventions, loaded from a small YAML file.

Defaults live in ``rules.yaml`` beside this module (the issue's defaults); every field is
validated on construction and unknown keys are errors.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Literal

import pydantic
import yaml

from trainpilot.specs.errors import from_pydantic
from trainpilot.specs.loading import read_document

Severity = Literal["info", "warning", "critical"]


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class Rule(_Strict):
    enabled: bool = True
    severity: Severity = "warning"


class ThresholdRule(Rule):
    threshold: float = pydantic.Field(gt=0)


class CommStallRule(Rule):
    threshold_s: float = pydantic.Field(gt=0)


class DivergenceRule(Rule):
    window: int = pydantic.Field(ge=4, le=4096)
    min_points: int = pydantic.Field(ge=3)
    z: float = pydantic.Field(gt=0)
    rise: float = pydantic.Field(gt=0)  # fraction above trend: 0.30 = 30 %
    patience: int = pydantic.Field(ge=1)  # consecutive flagged steps that make a divergence

    @pydantic.model_validator(mode="after")
    def _points_fit(self) -> DivergenceRule:
        if self.min_points > self.window:
            raise ValueError(f"min_points ({self.min_points}) must be <= window ({self.window})")
        return self


class PlateauRule(Rule):
    window: int = pydantic.Field(ge=8)
    min_rel_improvement: float = pydantic.Field(ge=0, lt=1)


class StragglerRule(Rule):
    ratio: float = pydantic.Field(gt=1)
    window: int = pydantic.Field(ge=1)
    min_fraction: float = pydantic.Field(gt=0, le=1)
    z: float = pydantic.Field(gt=0)  # robust z-score also required when >= 4 ranks


class Rules(_Strict):
    grad_explosion: ThresholdRule
    non_finite: Rule
    comm_stall: CommStallRule
    divergence_risk: DivergenceRule
    slow_convergence: PlateauRule
    memory_pressure: ThresholdRule
    vanishing_gradients: ThresholdRule
    straggler: StragglerRule


class ClipConfig(_Strict):
    enabled: bool = False
    trigger_norm: float = pydantic.Field(gt=0)
    max_norm: float | None = pydantic.Field(default=None, gt=0)

    @property
    def clip_to(self) -> float:
        return self.max_norm if self.max_norm is not None else self.trigger_norm


class HalveLRConfig(_Strict):
    enabled: bool = False
    factor: float = pydantic.Field(gt=0, lt=1)
    min_lr: float = pydantic.Field(ge=0)
    cooldown_steps: int = pydantic.Field(ge=1)


class SkipBatchConfig(_Strict):
    enabled: bool = False
    on_non_finite: bool = True


class RollbackConfig(_Strict):
    enabled: bool = False
    rewind_steps: int = pydantic.Field(ge=0)  # restore a checkpoint at least this far back
    skip_batches: int = pydantic.Field(ge=0)  # data batches skipped after restoring


class Interventions(_Strict):
    clip: ClipConfig
    halve_lr_on_plateau: HalveLRConfig
    skip_batch_on_spike: SkipBatchConfig
    rollback_on_divergence: RollbackConfig


class HealthConfig(_Strict):
    """Everything the HealthMonitor is told: rules, interventions and cadences."""

    rules: Rules
    interventions: Interventions
    alert_cooldown_steps: int = pydantic.Field(ge=1)
    detail_every: int = pydantic.Field(ge=1)
    forecast_interval_s: float = pydantic.Field(gt=0)

    def with_interventions(self, **enabled: bool) -> HealthConfig:
        """A copy with the named interventions switched on or off (``clip=True, ...``)."""
        data = self.model_dump()
        for name, on in enabled.items():
            if name not in data["interventions"]:
                from trainpilot.specs.errors import SpecError

                raise SpecError(f"interventions.{name}", on,
                                f"valid: {', '.join(data['interventions'])}")
            data["interventions"][name]["enabled"] = on
        return HealthConfig.model_validate(data)

    def updated(self, section: str, name: str, **fields) -> HealthConfig:
        """A copy with ``section.name`` fields replaced (validated)."""
        data = self.model_dump()
        data[section][name].update(fields)
        try:
            return HealthConfig.model_validate(data)
        except pydantic.ValidationError as err:
            raise from_pydantic(err, doc="health", model_cls=HealthConfig) from None


def load_health_config(path: str | os.PathLike | None = None) -> HealthConfig:
    """The shipped defaults, or a YAML file of the same shape (every key required)."""
    if path is None:
        data = yaml.safe_load(resources.files("trainpilot.health").joinpath("rules.yaml")
                              .read_text())
        source = "rules.yaml"
    else:
        data, source = read_document(path, doc="health"), str(path)
    try:
        return HealthConfig.model_validate(data)
    except pydantic.ValidationError as err:
        raise from_pydantic(err, doc="health", model_cls=HealthConfig, source=source) from None
