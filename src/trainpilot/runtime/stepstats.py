"""The step's statistics all-reduce, in flight.

One small all-reduce per step carries (loss, MoE aux loss, non-finite flag, preemption
flag). The Trainer issues
it asynchronously after the gradient norm and collects it after the optimizer update, so it
overlaps the update instead of being a sync point before it. Every rank decides alone whether
the gradient is finite (from the norm of the reduced gradients, the same on every rank); the
flag's sum checks that they agreed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from trainpilot.runtime.elastic.retry import CollectiveFailure, NonfiniteDisagreement


class StepStats:
    """The step's (loss, aux loss, non-finite flag) all-reduce in flight; ``wait`` returns
    (global-batch mean loss, mean MoE aux loss) and checks that every rank made the same
    non-finite decision (``strict``; under fp16 the loss scaler agrees on its own)."""

    def __init__(self, stats: torch.Tensor, *, nonfinite: bool, num_moe: int, strict: bool):
        self.stats, self.nonfinite, self.num_moe, self.strict = stats, nonfinite, num_moe, strict
        self.work: Any = None
        self.replicas, self.world, self.retries = 1, 1, 0
        self.phase: Callable[[str], None] | None = None
        self._result: tuple[float, float | None] | None = None
        self.num_preempted = 0  # ranks that received a preemption signal (see runtime.preempt)
        self.num_drain = 0  # 1 when rank 0 saw a drain request (see runtime.drain)
        self.wait_s = 0.0  # how long this rank waited for the all-reduce (a slow peer shows)

    def wait(self, step: int) -> tuple[float, float | None]:
        if self._result is not None:
            return self._result
        if self.work is not None:
            if self.phase is not None:
                self.phase("collective")
            start = time.perf_counter()
            try:
                self.work.wait()
            except RuntimeError as err:  # on the wire: the group is broken, recover
                raise CollectiveFailure(f"collective at step {step} failed on the wire: {err}",
                                        step=step, attempts=self.retries + 1, cause=err) from err
            self.wait_s = time.perf_counter() - start
            if self.phase is not None:
                self.phase("compute")
        stats = self.stats.cpu()
        num_bad = round(float(stats[2]))
        if self.strict and num_bad != (self.world if self.nonfinite else 0):
            raise NonfiniteDisagreement(
                f"step {step}: {num_bad} of {self.world} ranks saw a non-finite gradient norm "
                f"(this rank: {'non-finite' if self.nonfinite else 'finite'}); the reduced "
                "gradients differ between ranks (changed after the reduction?)")
        self.num_preempted = round(float(stats[3])) if stats.numel() > 3 else 0
        self.num_drain = round(float(stats[4])) if stats.numel() > 4 else 0
        aux = float(stats[1]) / self.replicas / self.num_moe if self.num_moe else None
        self._result = float(stats[0]) / self.replicas, aux
        return self._result
