"""Software assumptions the documents do not carry: attention kernel, dropout, MoE imbalance."""

from __future__ import annotations

from dataclasses import dataclass

from trainpilot.perf.hardware import EfficiencyCurve
from trainpilot.specs import ModelSpec, SpecError


@dataclass(frozen=True, kw_only=True)
class CostOptions:
    """What the training software does, where the plan does not say.

    ``flash_attention``: fused attention (no s^2 score tensor in memory or HBM traffic); off for
    the 2021-2022 Megatron runs the validation reproduces. ``dropout``: None means Megatron's
    GPT default (0.1) for GPT-style models with learned positions and none for RoPE models.
    ``ep_imbalance``: tokens on the busiest expert rank over the mean (expert GEMMs and the
    all-to-all run at the busiest rank's pace). ``grad_reduce_bytes``: bytes per gradient element
    in the data-parallel reduction; None means fp32 for bf16/fp8 (Megatron accumulates and reduces
    main gradients in fp32) and fp16 for fp16 runs. ``curve``: replaces the device's bundled
    efficiency data (calibration uses it). ``host_us_per_kernel``: replaces the curve's host
    time per kernel (the A100 value was calibrated on a Python-heavy Megatron-DeepSpeed stack).
    """

    flash_attention: bool = True
    dropout: bool | None = None
    ep_imbalance: float = 1.1
    grad_reduce_bytes: int | None = None
    curve: EfficiencyCurve | None = None
    host_us_per_kernel: float | None = None

    def __post_init__(self) -> None:
        if self.host_us_per_kernel is not None and self.host_us_per_kernel < 0:
            raise SpecError("options.host_us_per_kernel", self.host_us_per_kernel, "valid: >= 0")
        if self.ep_imbalance < 1:
            raise SpecError("options.ep_imbalance", self.ep_imbalance, "valid: >= 1")
        if self.grad_reduce_bytes not in (None, 1, 2, 4):
            raise SpecError("options.grad_reduce_bytes", self.grad_reduce_bytes,
                            "valid: 1, 2 or 4")

    def dropout_for(self, model: ModelSpec) -> bool:
        if self.dropout is not None:
            return self.dropout
        return model.position_embedding == "learned"

    def grad_bytes_for(self, precision: str) -> int:
        if self.grad_reduce_bytes is not None:
            return self.grad_reduce_bytes
        return 2 if precision == "fp16" else 4
