"""``--dry-run``: build the layout without training and report what each rank would hold.

Each reported rank is built for real, with the same code as a training run, on the meta device
(no memory) under a fake process group (no communication): the DeviceMesh, the pipeline cut,
``parallelize_module`` shards, expert sharding and FSDP2 ``fully_shard``. Parameters are counted
from the resulting local shards, so the counts are what the run would allocate, not a formula.
"""

from __future__ import annotations

from typing import Any

from trainpilot.specs import ModelSpec, Plan

# Bytes per parameter of the model states the reference trainer keeps: fp32 weights, fp32
# gradients, AdamW's two fp32 moments. Activations are not included (see trainpilot.perf).
BYTES_PER_PARAM = dict(params=4, grads=4, optimizer=8)


def representative_ranks(plan: Plan, *, all_up_to: int = 4) -> list[int]:
    """Ranks to build: all of them for small worlds, else one per pipeline stage (tp, ep and dp
    peers hold the same counts: check_job makes every shard even; FSDP's last shard may be
    smaller by rounding, never larger)."""
    if plan.world_size <= all_up_to:
        return list(range(plan.world_size))
    per_stage = plan.world_size // plan.pp  # pp is the outermost mesh axis
    return [stage * per_stage for stage in range(plan.pp)]


def _local_numel(param) -> int:
    from torch.distributed.tensor import DTensor

    return (param.to_local() if isinstance(param, DTensor) else param).numel()


def dry_run(model: ModelSpec, plan: Plan, *, ranks: list[int] | None = None) -> dict[str, Any]:
    """Per-rank parameter counts and model-state memory for ``plan`` (no training).

    Must run in a process without an initialised process group.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from trainpilot.perf.flops import count_params
    from trainpilot.runtime.layout import build_layout, check_runtime, mesh_axes
    from trainpilot.runtime.parallelize import parallelize

    # The plan is checked for its target cluster, not for this machine (fp16 on a CPU).
    check_runtime(model, plan, backend="fake", world_size=plan.world_size)
    rows = []
    for rank in ranks if ranks is not None else representative_ranks(plan):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
        try:
            layout = build_layout(plan, model=model)
            pm = parallelize(model, layout, seed=0, max_seq_len=plan.seq_len, materialize=False)
            local = sum(_local_numel(p) for p in pm.parameters())
            coords = {axis: layout.coord(axis) for axis in ("pp", "dp", "tp", "ep")}
            layers = sorted(int(k) for m in pm.modules
                            for k, _ in m.get_submodule("layers").named_children())
        finally:
            dist.destroy_process_group()
        memory = {k: local * b / 2**30 for k, b in BYTES_PER_PARAM.items()}
        rows.append(dict(rank=rank, **coords, params=local, layers=_ranges(layers),
                         params_gib=memory["params"], grads_gib=memory["grads"],
                         optimizer_gib=memory["optimizer"], model_states_gib=sum(memory.values()),
                         data_parallel=pm.data_parallel))
    names, sizes, _ = mesh_axes(plan)
    return dict(model=model.name, total_params=count_params(model).total,
                mesh=dict(zip(names, sizes)), world_size=plan.world_size, ranks=rows,
                bytes_per_param=BYTES_PER_PARAM,
                note="model states only (fp32 weights, grads, AdamW moments); activations "
                     "and temporary buffers are not included")


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    parts, start = [], None
    for i, value in enumerate(ids):
        if start is None:
            start = value
        if i + 1 == len(ids) or ids[i + 1] != value + 1:
            parts.append(f"{start}-{value}" if value != start else str(value))
            start = None
    return ",".join(parts)
