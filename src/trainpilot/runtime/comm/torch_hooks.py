"""Wrappers around PyTorch's own DDP hooks (fp16/bf16 casting, PowerSGD), counted, so users can
compare them with top-k under the same counters.

Gloo caveats (measured with torch 2.13.0, see /work/shared/TORCH_CPU_FACTS.md):

* ``bf16_compress_hook`` is refused at registration unless NCCL supports bf16 (DDP checks the
  hook function's name). ``trainpilot_comm_hook`` calls it under its own name, which gloo runs.
* ``powerSGD_hook`` issues collectives inside ``.then()`` callbacks, which run on gloo's two
  worker threads: with more than one bucket it deadlocks or aborts. We enforce one bucket on
  gloo: ``ddp_kwargs`` sizes ``bucket_cap_mb`` to hold the whole model, and a second bucket
  raises a RuntimeError instead of hanging.
* ``batched_powerSGD_hook`` fails in ``_orthogonalize`` on torch 2.13.0 and is not offered.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainpilot.runtime.comm.counters import CommCounters, now_s

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from trainpilot.runtime.comm.topology import Subgroup


def cast_hook(dtype_name: str, flat: Subgroup, bucket: dist.GradBucket,
              counters: CommCounters) -> torch.futures.Future:
    """PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook`` on ``bucket`` over the group
    of ``flat``, counted."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = {"fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook}[dtype_name]
    buffer = bucket.buffer()
    counters.add_collective("all_reduce", buffer.numel() * 2, flat)
    return _timed(inner(flat.group, bucket), buffer, counters)


class PowerSGD:
    """PyTorch's ``powerSGD_hook`` with its state, counted, refusing a second bucket on gloo.

    ``start_iter`` is PyTorch's ``start_powerSGD_iter`` (plain all-reduce before it; at least 2
    with error feedback or warm start, PyTorch's own rule).
    """

    def __init__(self, *, group: dist.ProcessGroup, rank: int, error_feedback: bool,
                 start_iter: int = 2, seed: int = 0):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        self.group = group
        self.on_gloo = dist.get_backend(group) == "gloo"
        self.state = psgd.PowerSGDState(
            process_group=group, matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter, use_error_feedback=error_feedback,
            warm_start=True, random_seed=seed,
        )

    def __call__(self, bucket: dist.GradBucket, flat: Subgroup, counters: CommCounters,
                 ) -> torch.futures.Future:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        if self.on_gloo and bucket.index() > 0:
            raise RuntimeError(
                "PowerSGD on gloo needs a single DDP bucket (its collectives inside .then() "
                "deadlock with several); build DDP with trainpilot.runtime.comm.ddp_kwargs(...) "
                "or bucket_cap_mb >= the model's gradient size")
        buffer = bucket.buffer()
        before = self.state.total_numel_after_compression
        compressing = self.state.iter >= self.state.start_powerSGD_iter
        future = psgd.powerSGD_hook(self.state, bucket)
        # PyTorch counts P and Q elements (and uncompressed tensors) as it plans the exchange.
        numel = self.state.total_numel_after_compression - before if compressing \
            else buffer.numel()
        counters.add_collective("all_reduce", numel * buffer.element_size(), flat)
        return _timed(future, buffer, counters)

    def state_dict(self) -> dict[str, Any]:
        """Iteration, error and warm-start memories, RNG: what a bit-exact restart needs."""
        state = self.state.__getstate__()
        return {k: v for k, v in state.items() if k != "process_group"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self.state, key, value)
        self.state.process_group = self.group


def _timed(future: torch.futures.Future, buffer: torch.Tensor, counters: CommCounters,
           ) -> torch.futures.Future:
    start = now_s()
    dense = buffer.numel() * buffer.element_size()

    def record(fut):
        counters.add_bucket(dense, start, now_s())
        return fut.value()

    return future.then(record)
