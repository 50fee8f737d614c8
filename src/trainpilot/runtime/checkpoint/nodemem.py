"""The node's memory tier: host-memory snapshots that outlive the worker process.

On a multi-node job torchrun replaces a lost node by restarting *every* worker (a standby node
joins the next rendezvous round), so the survivors' in-process memory tier, which holds the
lost node's ring copy, dies with them and the job falls back to storage. The launcher of each
node outlives its workers, and so does a folder in the node's RAM (``/dev/shm``, under the
launcher's own watch folder). :class:`NodeMemory` spills every completed snapshot there (this
rank's own, and the copy it holds for its ring peer) and loads it back into a new worker's
:class:`~trainpilot.runtime.checkpoint.peer.MemoryTier`; the existing recovery collective then
restores every rank from memory: its own snapshot from its node, the lost node's from the
survivor that holds its copy, sent **over the network** to the standby that took its place.

Files, per local rank (``local<L>/``): ``<kind>.<step>.<owner>.<world>.bin`` (the packed
buffer) and ``.json`` (its header), ``kind`` being ``own`` or ``held``. The header is written
last (atomically): a pair without it is an interrupted spill and is ignored. The newest
``NUM_SLOTS`` of each kind are kept. A new launch of the same run starts a new folder (a rerun
of the command resumes from storage, as it should: the folder belonged to a launch that
ended), so nothing survives the launch that wrote it. Costs: one memory copy of each snapshot
in the writer thread (RAM to RAM), and node RAM equal to the memory tier's size.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from trainpilot.fsio import atomic_write_text
from trainpilot.runtime.checkpoint.peer import NUM_SLOTS, MemoryTier
from trainpilot.runtime.checkpoint.snapshot import HostSnapshot

KINDS = ("own", "held")


class NodeMemory:
    """Spill and reload one local rank's snapshots in ``directory`` (node-local RAM)."""

    def __init__(self, directory: str | os.PathLike, *, local_rank: int):
        self.dir = Path(directory) / f"local{local_rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.spilled_bytes = 0

    def _name(self, kind: str, snap: HostSnapshot) -> str:
        return f"{kind}.{snap.step:010d}.{snap.rank}.{snap.world_size}"

    def spill(self, snap: HostSnapshot, *, kind: str) -> None:
        """Write ``snap`` (complete) as this rank's ``kind`` snapshot; drop older ones."""
        if kind not in KINDS:
            raise ValueError(f"kind: got {kind!r}; valid: {', '.join(KINDS)}")
        name = self._name(kind, snap)
        tmp = self.dir / f".{name}.bin.tmp"
        with open(tmp, "wb") as handle:
            handle.write(snap.buffer.numpy().data)  # no copy
        os.replace(tmp, self.dir / f"{name}.bin")
        atomic_write_text(self.dir / f"{name}.json", snap.header().decode())
        self.spilled_bytes += snap.nbytes
        self._trim(kind)

    def _entries(self, kind: str) -> list[tuple[int, str]]:
        """(step, stem) of the complete snapshots of ``kind``, oldest first."""
        out = []
        for path in self.dir.glob(f"{kind}.*.json"):
            stem = path.name[: -len(".json")]
            if (self.dir / f"{stem}.bin").is_file():
                out.append((int(stem.split(".")[1]), stem))
        return sorted(out)

    def _trim(self, kind: str) -> None:
        entries = self._entries(kind)
        for _, stem in entries[:-NUM_SLOTS]:
            self._remove(stem)

    def _remove(self, stem: str) -> None:
        for suffix in (".json", ".bin"):
            try:
                os.unlink(self.dir / f"{stem}{suffix}")
            except FileNotFoundError:
                pass

    def drop_after(self, step: int) -> None:
        """Forget snapshots newer than ``step`` (an abandoned timeline after a rollback)."""
        for kind in KINDS:
            for s, stem in self._entries(kind):
                if s > step:
                    self._remove(stem)

    def load(self, tier: MemoryTier, *, rank: int) -> int:
        """Put the spilled snapshots into ``tier``: those of ``rank`` as its own, every other
        one as a copy held for its owner (ranks may be numbered differently in the new
        world). Returns how many were loaded."""
        found: list[HostSnapshot] = []
        for kind in KINDS:
            for _, stem in self._entries(kind):
                try:
                    header = (self.dir / f"{stem}.json").read_bytes()
                    raw = (self.dir / f"{stem}.bin").read_bytes()
                    buffer = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                    found.append(HostSnapshot.from_header(header, buffer))
                except (OSError, ValueError):
                    continue  # a damaged spill is only a lost shortcut: storage remains
        for snap in sorted(found, key=lambda s: s.step):
            target = tier.own if snap.rank == rank else tier.held
            if all(s.step != snap.step or s.rank != snap.rank for s in target):
                target.append(snap)
        return len(found)

    def inventory(self) -> dict[str, list[int]]:
        return {kind: [s for s, _ in self._entries(kind)] for kind in KINDS}


def node_memory_dir_for(watch_dir: str | os.PathLike | None) -> Path | None:
    """Where a worker started by trainpilot's launcher spills its snapshots: under the
    launcher's node-local watch folder, on a multi-node job (``WORLD_SIZE`` larger than
    ``LOCAL_WORLD_SIZE``: a restart there may bring a standby node whose state must come from
    a survivor's memory). None otherwise: on one node a restart reloads from storage, as
    before."""
    if watch_dir is None:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return Path(watch_dir) / "memory" if world > local else None
