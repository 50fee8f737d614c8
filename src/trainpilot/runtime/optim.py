"""Optimizer pieces a user can call from their own loop: AdamW with decay/no-decay groups,
warmup + cosine learning rate, a global gradient norm / clip that is correct under every
layout (DTensor shards, expert shards, pipeline stages), and the fp16 loss scaler."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor


class WarmupCosine:
    """LR multiplier: linear warmup 0 -> 1 over ``warmup_steps``, then cosine to ``min_ratio`` at
    ``total_steps``; a picklable object so ``LambdaLR.state_dict`` keeps it."""

    def __init__(self, *, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
        if warmup_steps < 0 or total_steps < 1 or not 0 <= min_ratio <= 1:
            raise ValueError("need warmup_steps >= 0, total_steps >= 1, 0 <= min_ratio <= 1")
        self.warmup_steps, self.total_steps, self.min_ratio = warmup_steps, total_steps, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _is_dtensor(t: torch.Tensor | None) -> TypeGuard[DTensor]:
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def build_optimizer(named_params: Iterable[tuple[str, nn.Parameter]], *, lr: float,
                    weight_decay: float, betas: tuple[float, float] = (0.9, 0.95),
                    eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms, biases). Groups never mix DTensor and
    plain tensors (expert weights), which the foreach kernels refuse."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = defaultdict(list)
    for _, p in named_params:
        if p.requires_grad:
            groups[(p.ndim >= 2, _is_dtensor(p))].append(p)
    param_groups = [dict(params=ps, weight_decay=weight_decay if decay else 0.0)
                    for (decay, _), ps in sorted(groups.items())]
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                       min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, WarmupCosine(warmup_steps=warmup_steps, total_steps=total_steps,
                                min_ratio=min_ratio))


def global_grad_norm(params: list[nn.Parameter], *, expert_params: Sequence[nn.Parameter] = (),
                     ep_group=None, pp_group=None) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, identical on every rank.

    DTensor gradients (TP, FSDP) are reduced over their mesh; expert gradients (disjoint over
    ``ep``) are summed over ``ep_group``; pipeline stages are summed over ``pp_group``.
    Replicated plain gradients count once.
    """
    expert_ids = {id(p) for p in expert_params}
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    plain: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in params:
        if p.grad is None:
            continue
        if id(p) in expert_ids:
            expert.append(p.grad)
        elif _is_dtensor(p.grad):
            by_mesh[(p.grad.device_mesh, tuple(p.grad.placements))].append(p.grad)
        else:
            plain.append(p.grad)
    device = _local(params[0]).device if params else torch.device("cpu")
    squared = torch.zeros((), device=device, dtype=torch.float32)
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        squared = squared + (norm.full_tensor() if _is_dtensor(norm) else norm).float() ** 2
    if plain:
        squared = squared + torch.nn.utils.get_total_norm(plain).float() ** 2
    if ep_group is not None:
        part = (torch.nn.utils.get_total_norm(expert).float() ** 2 if expert
                else torch.zeros((), device=device))
        dist.all_reduce(part, group=ep_group)
        squared = squared + part
    elif expert:
        squared = squared + torch.nn.utils.get_total_norm(expert).float() ** 2
    if pp_group is not None:
        dist.all_reduce(squared, group=pp_group)
    return squared.sqrt()


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float | None, **groups) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (None: only measure);
    returns the norm before clipping. ``groups``: as :func:`global_grad_norm`."""
    total = global_grad_norm(params, **groups)
    if max_norm is not None and max_norm > 0:
        with_grad = [p for p in params if p.grad is not None]
        # Separate calls: one foreach kernel cannot mix DTensor and plain tensors.
        for kind in (True, False):
            subset = [p for p in with_grad if _is_dtensor(p.grad) == kind]
            if subset:
                torch.nn.utils.clip_grads_with_norm_(subset, max_norm, total)
    return total


def build_grad_scaler(precision: str, device: torch.device, *, distributed: bool
                      ) -> torch.amp.GradScaler:
    """Dynamic loss scaling for ``precision == "fp16"`` (a disabled scaler otherwise, whose
    ``scale``/``step``/``update`` pass through unchanged).

    torch's defaults: initial scale 2**16, halved on a step with a non-finite gradient (the
    update is then skipped), doubled after 2000 clean steps. Distributed, the skip decision is
    global: see :class:`WorldGradScaler`.
    """
    enabled = precision == "fp16"
    if not enabled:
        return torch.amp.GradScaler(device.type, enabled=False)
    scaler: torch.amp.GradScaler
    if distributed:
        scaler = WorldGradScaler(device.type, process_group=None)  # None: the default (world)
    else:
        scaler = torch.amp.GradScaler(device.type)
    # The scale tensor is created by the first scale() call; pipeline ranks without the last
    # stage never scale a loss (their gradients arrive scaled) but unscale and update too.
    scaler.scale(torch.zeros((), device=device))
    return scaler


class WorldGradScaler(ShardedGradScaler):
    """FSDP's ``ShardedGradScaler`` (it all-reduces the found-inf flag over its group, here the
    world, so every rank skips or steps together whatever it holds: a pipeline stage, an expert
    shard, an FSDP shard), with the inf check and unscale run on each gradient's local tensor.

    Why the override: the stock check passes one foreach list per device and dtype, and torch
    2.13 refuses a list that mixes DTensor and plain gradients (TP leaves norms plain; expert
    weights are plain beside FSDP2's DTensors). Local tensors are enough because the flag is
    all-reduced anyway.
    """

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool = True,
                        ) -> dict[torch.device, torch.Tensor]:
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(
            lambda: defaultdict(list))
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not allow_fp16 and p.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                local = _local(p.grad)
                by_device[local.device][local.dtype].append(local)
        found: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for device, per_dtype in by_device.items():
                found[device] = found_inf.to(device).clone()
                inv = inv_scale.to(device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv)
        if not found:  # no gradient here: still take part in the all-reduce
            assert self._scale is not None  # build_grad_scaler's first scale() made it
            found[self._scale.device] = found_inf.clone()
        return found
