"""Overrides of what the documents say, for callers that explore "what if" (calibration, the
validation's negative controls, ``--no-flash-attention``).

Everything that changes a prediction lives in the documents (ModelSpec, ClusterSpec, Plan and
its RuntimeProfile); a ``CostOptions`` field left ``None`` defers to them, so ``predict`` on the
documents alone reproduces any validation row.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainpilot.perf.hardware import EfficiencyCurve
from trainpilot.specs import ModelSpec, SpecError


@dataclass(frozen=True, kw_only=True)
class CostOptions:
    """Overrides (``None``: the documents' value).

    ``flash_attention``: replaces ``plan.runtime``'s. ``dropout``: replaces the model's.
    ``ep_imbalance``: replaces ``plan.runtime.moe_imbalance`` (busiest expert rank's tokens over
    the mean). ``grad_reduce_bytes``: bytes per gradient element in the data-parallel reduction
    (the documents say it through ``plan.comm.compression`` and the precision). ``curve``:
    replaces the device's efficiency data (calibration uses it). ``host_us_per_kernel``:
    replaces the host time per kernel.
    """

    flash_attention: bool | None = None
    dropout: bool | None = None
    ep_imbalance: float | None = None
    grad_reduce_bytes: int | None = None
    curve: EfficiencyCurve | None = None
    host_us_per_kernel: float | None = None

    def __post_init__(self) -> None:
        if self.host_us_per_kernel is not None and self.host_us_per_kernel < 0:
            raise SpecError("options.host_us_per_kernel", self.host_us_per_kernel, "valid: >= 0")
        if self.ep_imbalance is not None and self.ep_imbalance < 1:
            raise SpecError("options.ep_imbalance", self.ep_imbalance, "valid: >= 1")
        if self.grad_reduce_bytes not in (None, 1, 2, 4):
            raise SpecError("options.grad_reduce_bytes", self.grad_reduce_bytes,
                            "valid: 1, 2 or 4")

    def dropout_for(self, model: ModelSpec) -> bool:
        """Whether training applies dropout (the override, else the model's)."""
        if self.dropout is not None:
            return self.dropout
        return model.has_dropout
