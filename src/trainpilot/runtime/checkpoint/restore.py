"""Restoring: pick the newest intact checkpoint (memory or storage) consistently on all ranks.

Every decision that could differ between ranks is made collectively on the checkpointer's
group: the coordinator lists the committed folders and broadcasts the list, each rank verifies
a share of the files and an all-reduce agrees on the verdict, and every rank computes the same
memory-recovery plan from the gathered inventories.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex

from trainpilot.runtime.checkpoint import codec, layout
from trainpilot.runtime.checkpoint.peer import (
    MemoryTier,
    RecoveryPlan,
    execute_recovery,
    plan_recovery,
)
from trainpilot.runtime.checkpoint.snapshot import (
    GLOBAL,
    RANK_PREFIX,
    TREE_KEY,
    HostSnapshot,
    local_part,
)
from trainpilot.runtime.checkpoint.storage import CheckpointReader


class TemplateMismatch(ValueError):
    """The template given to restore does not match the checkpoint (keys, shapes, dtypes)."""


@dataclass(kw_only=True)
class Group:
    """The checkpointer's process group (None for a single process without one)."""

    pg: Any
    rank: int
    world_size: int

    def all_true(self, flag: bool) -> bool:
        if self.pg is None:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(t.item())

    def broadcast(self, obj: Any) -> Any:
        if self.pg is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if self.pg is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out


# -- storage ---------------------------------------------------------------------------------
def storage_candidates(root: Path, group: Group) -> list[tuple[int, str]]:
    """Committed folders, newest first, as the coordinator sees them."""
    return group.broadcast(layout.committed(root) if group.rank == 0 else None)


def verify(root: Path, name: str, group: Group, *, check_files: bool) -> tuple[dict | None, str]:
    """The manifest body if every rank finds its share of the files intact, else a reason."""
    reason = ""
    body = None
    try:
        body = layout.read_manifest(root, name)
        if check_files:
            share = sorted(body["files"])[group.rank::group.world_size]
            problems = layout.verify_files(root, body["files"], share)
            reason = "; ".join(problems)
    except layout.CorruptCheckpoint as err:
        reason = err.reason
    ok = group.all_true(not reason)
    if not ok:
        return None, reason or "another rank found a damaged file"
    return body, ""


def load_storage(root: Path, body: dict, template: dict[str, torch.Tensor], group: Group, *,
                 strict: bool, chunks_verified: bool) -> tuple[Any, Any]:
    """Load a verified checkpoint through DCP into ``template``'s tensors (resharding as
    needed). Returns ``(state, rank_state)``; rank_state is None if this rank had none."""
    import torch.distributed.checkpoint as dcp

    reader = CheckpointReader(root=root, body=body, verify_chunks=not chunks_verified)
    meta = reader.tensors
    handles: dict[str, Any] = {}

    def handle_for(rel: str) -> Any:
        handles.setdefault(rel, open(root / rel, "rb"))
        return handles[rel]

    try:
        tree = codec.loads(reader.read_chunk(MetadataIndex(TREE_KEY, (0,)), handle_for)
                           .numpy().tobytes())
        rank_key = f"{RANK_PREFIX}/{group.rank}/{TREE_KEY}"
        rank_tree = None
        if rank_key in meta:
            raw = reader.read_chunk(MetadataIndex(rank_key, (0,)), handle_for).numpy().tobytes()
            rank_tree = codec.loads(raw)
    finally:
        for handle in handles.values():
            handle.close()
    keys = codec.tensor_keys(tree)
    if strict and (extra := sorted(set(template) - set(keys))):
        raise TemplateMismatch(f"template tensors not in the checkpoint: {extra[:5]}")
    targets: dict[str, torch.Tensor] = {}
    for key in keys:
        md = meta[key]
        target = template.get(key)
        if target is None:
            target = torch.empty(md.size, dtype=md.properties.dtype)
        elif tuple(target.shape) != tuple(md.size) or target.dtype != md.properties.dtype:
            raise TemplateMismatch(f"{key}: checkpoint {md.properties.dtype}{list(md.size)}, "
                                   f"template {target.dtype}{list(target.shape)}")
        targets[key] = target
    rank_targets: dict[str, torch.Tensor] = {}
    if rank_tree is not None:
        for key in codec.tensor_keys(rank_tree):
            md = meta[f"{RANK_PREFIX}/{group.rank}/{key}"]
            rank_targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
    flat = dict(targets)
    flat.update({f"{RANK_PREFIX}/{group.rank}/{k}": v for k, v in rank_targets.items()})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.load(flat, storage_reader=reader, process_group=group.pg, no_dist=group.pg is None)
    state = codec.join_state(tree, targets)
    rank_state = codec.join_state(rank_tree, rank_targets) if rank_tree is not None else None
    return state, rank_state


# -- memory ----------------------------------------------------------------------------------
def memory_plan(tier: MemoryTier, group: Group, *, max_step: int | None = None,
                ) -> RecoveryPlan | None:
    inventory = tier.inventory()
    if max_step is not None:  # a rollback: only snapshots at or before the target step
        inventory = {k: [e for e in v if e[0] <= max_step] for k, v in inventory.items()}
    return plan_recovery(group.all_gather(inventory), group.world_size)


def fits(snap: HostSnapshot, template: dict[str, torch.Tensor], *, strict: bool) -> bool:
    """Whether ``snap`` can be copied into ``template`` (same keys, local shapes and dtypes)."""
    keys = {e.key for e in snap.entries if e.scope == GLOBAL}
    if strict and set(template) - keys:
        return False
    for entry in snap.entries:
        if entry.scope != GLOBAL or entry.key not in template:
            if entry.global_shape is not None and entry.key not in template:
                return False
            continue
        local = local_part(template[entry.key])
        if tuple(local.shape) != entry.shape or codec.dtype_name(local.dtype) != entry.dtype:
            return False
    return True


def fetch_memory(tier: MemoryTier, plan: RecoveryPlan, group: Group) -> HostSnapshot:
    """This rank's snapshot at ``plan.step``: its own, or the copy a peer sends back."""
    if group.pg is None:
        snap = tier.find(plan.step, 0, held=False)
        assert snap is not None
        return snap
    return execute_recovery(tier, plan, group=group.pg)
