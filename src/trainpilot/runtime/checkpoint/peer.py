"""The in-memory tier: each rank's latest snapshots, and a copy of one peer's.

After every save, rank ``r`` sends its packed snapshot to rank ``(r + offset) % W`` and keeps the
one it receives from ``(r - offset) % W`` (a ring over the checkpointer's group; ``offset`` is
the number of ranks per node, so the copy lives on another node). Transfers are
``batch_isend_irecv`` on the checkpointer's own gloo group: one message for the sizes, then
the JSON header and the packed buffer.

Recovery is a collective: every rank publishes what it holds, every rank computes the same
plan (the newest step for which each rank's snapshot survives, on its owner or its holder),
holders send copies to ranks that lost theirs, and everyone restores. With no such step the
plan is ``None`` and the caller falls back to storage.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainpilot.runtime.checkpoint.snapshot import HostSnapshot

NUM_SLOTS = 2  # the newest and the one before: enough for ranks caught mid-exchange


@dataclass(kw_only=True)
class MemoryTier:
    """Host-memory snapshots: this rank's own, and copies held for peers (by owner rank)."""

    own: deque[HostSnapshot] = field(default_factory=lambda: deque(maxlen=NUM_SLOTS))
    held: deque[HostSnapshot] = field(default_factory=lambda: deque(maxlen=NUM_SLOTS))

    def recyclable_own(self) -> HostSnapshot | None:
        """The slot the next snapshot may overwrite (the oldest, once both are full)."""
        return self.own[0] if len(self.own) == NUM_SLOTS else None

    def recyclable_held(self) -> HostSnapshot | None:
        return self.held[0] if len(self.held) == NUM_SLOTS else None

    def inventory(self) -> dict:
        return {
            "own": [[s.step, s.rank, s.world_size] for s in self.own],
            "held": [[s.step, s.rank, s.world_size] for s in self.held],
        }

    def find(self, step: int, owner: int, *, held: bool) -> HostSnapshot | None:
        for snap in (self.held if held else self.own):
            if snap.step == step and snap.rank == owner:
                return snap
        return None

    def drop_after(self, step: int) -> None:
        """Forget snapshots newer than ``step`` (an abandoned timeline after a rollback)."""
        self.own = deque((s for s in self.own if s.step <= step), maxlen=NUM_SLOTS)
        self.held = deque((s for s in self.held if s.step <= step), maxlen=NUM_SLOTS)

    def clear(self) -> None:
        self.own.clear()
        self.held.clear()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in (*self.own, *self.held))


def default_offset(world_size: int, local_world_size: int | None) -> int:
    """Ranks per node when there is more than one node, else 1 (the next rank)."""
    if local_world_size and world_size > local_world_size:
        return local_world_size
    return 1


def _exchange(sends: dict[int, list[torch.Tensor]], recvs: dict[int, list[torch.Tensor]],
              group: dist.ProcessGroup) -> None:
    """Post every send and receive (group ranks) at once and wait; no ordering deadlocks."""
    ops = []
    for peer, tensors in sends.items():
        for t in tensors:
            ops.append(dist.P2POp(dist.isend, t, group=group, group_peer=peer))
    for peer, tensors in recvs.items():
        for t in tensors:
            ops.append(dist.P2POp(dist.irecv, t, group=group, group_peer=peer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _transfer(outgoing: dict[int, HostSnapshot], incoming: list[int], group: dist.ProcessGroup,
              reuse: HostSnapshot | None = None) -> dict[int, HostSnapshot]:
    """Send ``outgoing[peer]`` to each peer and receive one snapshot from each ``incoming`` peer.

    Two rounds: sizes (int64 pairs), then header bytes and the buffer. A received buffer reuses
    ``reuse``'s memory when the size matches.
    """
    headers = {p: torch.frombuffer(bytearray(s.header()), dtype=torch.uint8)
               for p, s in outgoing.items()}
    sizes_out = {p: [torch.tensor([headers[p].numel(), s.nbytes], dtype=torch.int64)]
                 for p, s in outgoing.items()}
    sizes_in = {p: [torch.zeros(2, dtype=torch.int64)] for p in incoming}
    _exchange(sizes_out, sizes_in, group)
    bufs_in = {}
    for p in incoming:
        header_len, nbytes = (int(x) for x in sizes_in[p][0])
        if reuse is not None and reuse.nbytes == nbytes and len(incoming) == 1:
            buffer = reuse.buffer
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        bufs_in[p] = [torch.empty(header_len, dtype=torch.uint8), buffer]
    sends = {p: [headers[p], s.buffer] for p, s in outgoing.items()}
    _exchange(sends, bufs_in, group)
    return {p: HostSnapshot.from_header(bytes(h.numpy()), b) for p, (h, b) in bufs_in.items()}


def ring_exchange(tier: MemoryTier, snap: HostSnapshot, *, group: dist.ProcessGroup,
                  offset: int) -> HostSnapshot:
    """Send ``snap`` to the next peer on the ring and keep the previous peer's snapshot."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dst, src = (rank + offset) % world, (rank - offset) % world
    reuse = tier.recyclable_held()
    if reuse is not None:
        tier.held.popleft()  # its buffer is overwritten below: never keep a half-received copy
    received = _transfer({dst: snap}, [src], group, reuse=reuse)[src]
    tier.held.append(received)
    return received


@dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    """Restore every rank at ``step``; ``moves`` are (holder, owner) copies to send first."""

    step: int
    moves: tuple[tuple[int, int], ...]


def plan_recovery(inventories: list[dict], world_size: int) -> RecoveryPlan | None:
    """The newest step at which every rank's snapshot survives somewhere, or None.

    Only snapshots taken at this world size qualify (a resized world reloads from storage).
    Identical input on every rank gives an identical plan.
    """
    own = {(s, r) for inv in inventories for s, r, w in inv["own"] if w == world_size}
    holders: dict[tuple[int, int], int] = {}
    for holder, inv in enumerate(inventories):
        for s, r, w in inv["held"]:
            if w == world_size:
                holders.setdefault((s, r), holder)
    owned_by_self = {(s, r) for r, inv in enumerate(inventories)
                     for s, rr, w in inv["own"] if rr == r and w == world_size}
    steps = sorted({s for s, _ in own | set(holders)}, reverse=True)
    for step in steps:
        moves = []
        for rank in range(world_size):
            if (step, rank) in owned_by_self:
                continue
            source = holders.get((step, rank))
            if source is None:
                break
            moves.append((source, rank))
        else:
            return RecoveryPlan(step=step, moves=tuple(moves))
    return None


def execute_recovery(tier: MemoryTier, plan: RecoveryPlan, *, group: dist.ProcessGroup,
                     ) -> HostSnapshot:
    """Carry out ``plan`` on this rank and return the snapshot it restores from."""
    rank = dist.get_rank(group)
    outgoing: dict[int, HostSnapshot] = {}
    for holder, owner in plan.moves:
        if holder == rank:
            held = tier.find(plan.step, owner, held=True)
            assert held is not None, "plan_recovery promised a held snapshot"
            outgoing[owner] = held
    incoming = [holder for holder, owner in plan.moves if owner == rank]
    received = _transfer(outgoing, incoming, group)
    if incoming:
        snap = received[incoming[0]]
        tier.own.append(snap)  # it is ours again: a later failure can use it
        return snap
    own = tier.find(plan.step, rank, held=False)
    assert own is not None, "plan_recovery promised an own snapshot"
    return own
