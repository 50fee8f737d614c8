"""The node's memory folder (checkpoint/nodemem.py) in one process: snapshots spilled there
come back byte for byte in a new memory tier (own vs held by owner rank), only the newest
slots are kept, a rollback forgets newer ones, and an interrupted or damaged spill is ignored."""

from __future__ import annotations

import torch

from trainpilot.runtime.checkpoint.nodemem import NodeMemory, node_memory_dir_for
from trainpilot.runtime.checkpoint.peer import NUM_SLOTS, MemoryTier
from trainpilot.runtime.checkpoint.snapshot import fill_snapshot, prepare_snapshot


def _snap(step: int, rank: int, value: float):
    state = {"model": {"w": torch.full((4, 3), float(value)), "b": torch.arange(5.0) + value}}
    snap, pending = prepare_snapshot(step, state, {"mine": rank}, rank=rank, world_size=2)
    fill_snapshot(snap, pending)
    return snap


def _same(a, b) -> bool:
    """The same tensors (the buffer's alignment padding is not part of a snapshot)."""
    return ([e.key for e in a.entries] == [e.key for e in b.entries]
            and all(torch.equal(a.view(x), b.view(y)) for x, y in zip(a.entries, b.entries)))


def test_spilled_snapshots_come_back_in_a_new_tier(tmp_path):
    memory = NodeMemory(tmp_path, local_rank=0)
    for step in (3, 6, 9):
        memory.spill(_snap(step, 0, step), kind="own")
        memory.spill(_snap(step, 1, -step), kind="held")
    assert memory.inventory() == {"own": [6, 9][-NUM_SLOTS:], "held": [6, 9][-NUM_SLOTS:]}
    tier = MemoryTier()
    assert NodeMemory(tmp_path, local_rank=0).load(tier, rank=0) == 2 * NUM_SLOTS
    own, held = tier.find(9, 0, held=False), tier.find(9, 1, held=True)
    assert own is not None and held is not None
    assert _same(own, _snap(9, 0, 9)) and own.rank_tree == b'{"mine":0}'
    assert _same(held, _snap(9, 1, -9))
    assert not _same(own, held)  # the comparison can fail

    # Ranks renumbered after a membership change: rank 1's copy is this process's own now.
    tier = MemoryTier()
    NodeMemory(tmp_path, local_rank=0).load(tier, rank=1)
    assert tier.find(9, 1, held=False) is not None and tier.find(9, 0, held=True) is not None


def test_rollback_and_damaged_spills(tmp_path):
    memory = NodeMemory(tmp_path, local_rank=1)
    memory.spill(_snap(3, 0, 1.0), kind="own")
    memory.spill(_snap(6, 0, 2.0), kind="own")
    memory.drop_after(3)
    assert memory.inventory()["own"] == [3]
    # A spill cut short before its header: ignored. A header with a truncated buffer: ignored.
    memory.spill(_snap(9, 0, 3.0), kind="own")
    (memory.dir / "own.0000000009.0.2.json").unlink()
    memory.spill(_snap(12, 0, 4.0), kind="own")
    (memory.dir / "own.0000000012.0.2.bin").write_bytes(b"\0" * 7)
    tier = MemoryTier()
    memory.load(tier, rank=0)
    assert [s.step for s in tier.own] == [3]
    assert node_memory_dir_for(None) is None


def test_only_a_multi_node_job_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert node_memory_dir_for(tmp_path) is None  # one node: a restart reloads from storage
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_memory_dir_for(tmp_path) == tmp_path / "memory"
