"""Every rank's timings of one step, gathered on rank 0 (for the health monitor's straggler
rule): one small all-gather, on the CPU over gloo and on the rank's own device elsewhere."""

from __future__ import annotations

from trainpilot.records import RankTiming


def gather_rank_timings(step: int, *, step_s: float, compute_s: float, comm_s: float = 0.0,
                        data_s: float = 0.0, group=None) -> list[RankTiming] | None:
    """All-gather one step's timings of every rank; rank 0 gets the list, others ``None``.

    One ``all_gather_into_tensor`` of 4 float64 per rank (works on gloo and NCCL). Call it on
    every rank of ``group`` (a collective), e.g. every N steps to keep its cost negligible.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    device = torch.device("cpu")
    if dist.get_backend(group) != "gloo":  # nccl, hccl, xccl: tensors on this rank's device
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is None:
            raise RuntimeError(f"backend {dist.get_backend(group)!r} needs an accelerator, "
                               "and this process has none")
        device = torch.device(accelerator.type, torch.accelerator.current_device_index())
    mine = torch.tensor([step_s, compute_s, comm_s, data_s], dtype=torch.float64, device=device)
    out = torch.empty(world * 4, dtype=torch.float64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)
    if dist.get_rank(group) != 0:
        return None
    rows = out.view(world, 4).tolist()
    return [RankTiming(step=step, rank=r, step_s=row[0], compute_s=row[1], comm_s=row[2],
                       data_s=row[3]) for r, row in enumerate(rows)]
