"""One step guard for a user's data-parallel loop: clipping and the non-finite decision.

Every rank must take the same decision about a step, or their weights part. The guard clips
the gradient norm and adds "is it finite?" to the loss all-reduce the loop makes anyway (one
collective a step, not two); a non-finite gradient on any rank zeroes every rank's gradients
and the step's forward and backward run again (``retries`` times), then the step is skipped.
It also places the fault injector's NaN hooks, so that a loop that uses it is testable with
``nan:...at=backward`` and ``at=grad`` faults without lines of its own.

    guard = StepGuard(model.parameters(), max_norm=1.0, faults=faults,
                      poison=[model.module.lm_head], on_grad_norms=monitor.observe_grad_norms)
    for attempt in guard.attempts(step):
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        attempt.check(loss)             # clip, vote, fault hooks
    if guard.finite:
        optimizer.step()
    optimizer.zero_grad()
    print(guard.loss.item())            # the mean over ranks

Scope: data parallelism (DDP; FSDP2 and TP through ``runtime.optim.clip_grad_norm_``).
Pipeline stages each see only their own parameters, so the norm is not yet global across pp;
the Trainer keeps its own logic and does not use this guard yet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainpilot.runtime.optim import clip_grad_norm_
from trainpilot.specs.errors import SpecError


class Attempt:
    """One try at a step's backward; call :meth:`check` after it."""

    def __init__(self, guard: StepGuard, hooks: list[Any]):
        self.guard, self.hooks, self.checked = guard, hooks, False

    def check(self, loss: torch.Tensor) -> bool:
        """Clip, and vote with every rank on whether the gradients are finite (in the loss
        all-reduce); returns the decision, the same on every rank."""
        guard = self.guard
        for hook in self.hooks:
            hook.remove()
        if guard.faults is not None:
            guard.faults.poison_gradients(guard.params, guard.step, rank=guard.rank)
        norm = guard.clip()
        stats = torch.stack([loss.detach(), (~torch.isfinite(norm)).to(loss.dtype)])
        if guard.world > 1:
            dist.all_reduce(stats, group=guard.group)
        guard.loss, guard.grad_norm = stats[0] / guard.world, norm
        guard.finite = not bool(stats[1])
        self.checked = True
        return guard.finite


class StepGuard:
    """See the module docstring. ``poison``: the modules a ``nan ... at=backward`` fault hooks
    (the first is used); ``group``: the data-parallel process group (None: the world);
    ``on_grad_norms(params, norms)``: called with each attempt's per-parameter gradient norms
    before clipping (``HealthMonitor.observe_grad_norms``: the monitor then judges unclipped
    gradients and does not measure them twice)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], *, max_norm: float = 1.0,
                 retries: int = 1, faults: Any = None, poison: Iterable[Any] = (),
                 group: Any = None,
                 on_grad_norms: Callable[[list[torch.Tensor], torch.Tensor], None] | None = None):
        if retries < 0:
            raise SpecError("retries", retries, "valid: an integer >= 0")
        self.params = [p for p in params if p.requires_grad]
        self.max_norm, self.retries = max_norm, retries
        self.faults, self.poison, self.group = faults, list(poison), group
        self.on_grad_norms = on_grad_norms
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if initialized else 0
        self.world = dist.get_world_size(group) if initialized else 1
        self.step = 0
        self.loss: torch.Tensor = torch.tensor(float("nan"))
        self.grad_norm: torch.Tensor = torch.tensor(float("nan"))
        self.finite = False
        self.num_retries = 0  # attempts after the first, over the run
        self.num_skipped = 0  # steps whose gradients stayed non-finite

    def clip(self) -> torch.Tensor:
        """Clip to ``max_norm``; returns the norm before. Plain tensors (DDP): the per-tensor
        norms are measured once and handed to ``on_grad_norms`` (the health monitor) before
        clipping, the same arithmetic as torch's ``clip_grad_norm_``; DTensors (FSDP2, TP):
        through the Trainer's ``runtime.optim.clip_grad_norm_`` (each mesh reduced over itself,
        DTensor and plain gradients clipped apart), and nothing is handed on."""
        from torch.distributed.tensor import DTensor

        params: list[torch.Tensor] = [p for p in self.params if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        grads = [p.grad for p in params if p.grad is not None]
        if any(isinstance(g, DTensor) for g in grads):
            return clip_grad_norm_(self.params, self.max_norm)
        norms = torch.stack(torch._foreach_norm(grads, 2.0))
        total = torch.linalg.vector_norm(norms, 2.0)
        if self.on_grad_norms is not None:
            self.on_grad_norms(params, norms)
        torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, total)
        return total

    def attempts(self, step: int) -> Iterator[Attempt]:
        """Yields one :class:`Attempt` per try at ``step``: again after a non-finite vote (the
        gradients zeroed first), at most ``retries`` more times."""
        self.step, self.finite = step, False
        for n in range(self.retries + 1):
            hooks = (self.faults.poison_backward(self.poison, step, rank=self.rank)
                     if self.faults is not None else [])
            attempt = Attempt(self, hooks)
            yield attempt
            if not attempt.checked:
                raise RuntimeError("StepGuard: call attempt.check(loss) after backward()")
            if self.finite:
                return
            for p in self.params:
                p.grad = None
            if n < self.retries:
                self.num_retries += 1
        self.num_skipped += 1
