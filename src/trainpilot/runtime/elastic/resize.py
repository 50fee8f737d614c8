"""The plan at another world size, for elastic runs (torchrun ``--nnodes=MIN:MAX``).

When torchrun re-forms the job with fewer or more nodes, the model-parallel shape (tp, pp, cp,
ep) stays and data parallelism absorbs the change: ``dp = world / (tp * pp * cp)``. The global
batch is kept, so the optimizer sees the same batch size at every world size: each dp rank
takes ``global_batch / dp`` sequences and accumulates over ``global_batch / (micro_batch * dp)``
micro-batches (the micro-batch is made smaller only when it no longer divides). The sampler's
state is global (epoch, position), so the new dp ranks split the same next samples: each sample
is still seen exactly once.
"""

from __future__ import annotations

from trainpilot.specs import Plan, SpecError


def plan_for_world(plan: Plan, world_size: int) -> Plan:
    """``plan`` with ``dp`` (and, if needed, ``micro_batch_size``) fitted to ``world_size``
    processes, the global batch unchanged. Raises SpecError when no such plan exists."""
    model_parallel = plan.tp * plan.pp * plan.cp
    if world_size == plan.world_size:
        return plan
    if world_size % model_parallel:
        raise SpecError("world_size", world_size, f"not a multiple of tp*pp*cp = "
                        f"{model_parallel}; valid: a multiple of it")
    dp = world_size // model_parallel
    gbs = plan.global_batch_size
    if gbs % dp:
        raise SpecError("world_size", world_size, f"gives dp={dp}, which does not divide "
                        f"global_batch_size={gbs}")
    mbs = plan.micro_batch_size
    while (gbs // dp) % mbs:
        mbs -= 1
    if plan.ep > 1 and (dp * plan.cp) % plan.ep:
        raise SpecError("world_size", world_size, f"gives dp={dp}, not divisible by ep={plan.ep}")
    updates: dict = dict(dp=dp, micro_batch_size=mbs)
    if plan.dp_shard is not None and dp % plan.dp_shard:
        updates["dp_shard"] = None if dp < plan.dp_shard else plan.dp_shard
        if updates["dp_shard"] is None:
            raise SpecError("world_size", world_size, f"gives dp={dp}, not divisible by "
                            f"dp_shard={plan.dp_shard}")
    return Plan.model_validate({**plan.to_dict(), **updates})
