"""Host-memory snapshots: the only part of a save the training loop waits for.

A snapshot copies every tensor of the state (the local shard of a DTensor) into one packed,
64-byte-aligned host buffer. The buffer is reused by the next snapshot of the same layout, so a
save in steady state is a memcpy (no allocation, no page faults). The packed form is also what
the in-memory tier sends to a peer with one send/recv.

A snapshot is taken in two parts: :func:`prepare_snapshot` (layout, buffer, the non-tensor
leaves serialized) and :func:`fill_snapshot` (the copies; on the caller's thread, or on the
writer's while the next step computes). Invariant: once the fill has returned, the snapshot
shares no memory with the live state, so training may change it (snapshot isolation); before
that, the live tensors must not change.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from trainpilot.runtime.checkpoint import codec

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

ALIGN_BYTES = 64
GLOBAL, RANK = "global", "rank"
TREE_KEY = "__tree__"
RANK_PREFIX = "__rank__"


@functools.cache
def dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed
        return None
    return DTensor


def is_dtensor(value: Any) -> TypeGuard[DTensor]:
    cls = dtensor_type()
    return cls is not None and isinstance(value, cls)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One tensor in the packed buffer. ``global_shape`` is set for DTensors only."""

    key: str
    scope: str  # GLOBAL (shared or sharded across ranks) or RANK (this rank's own)
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes into the buffer
    nbytes: int
    global_shape: tuple[int, ...] | None = None
    global_stride: tuple[int, ...] | None = None

    def signature(self) -> tuple:
        return (self.key, self.scope, self.dtype, self.shape, self.global_shape)


@dataclass(kw_only=True, eq=False)
class HostSnapshot:
    """A rank's state at ``step``, packed in host memory; trees are tagged-JSON bytes."""

    step: int
    rank: int
    world_size: int
    entries: list[Entry]
    buffer: torch.Tensor  # uint8, 1-D
    global_tree: bytes
    rank_tree: bytes
    created_unix_s: float = field(default_factory=time.time)
    # Live (mesh, placements) of DTensors, to rebuild DTensors for DCP; never sent to a peer.
    dist_refs: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def signature(self) -> tuple:
        return tuple(e.signature() for e in self.entries)

    def view(self, entry: Entry) -> torch.Tensor:
        raw = self.buffer[entry.offset:entry.offset + entry.nbytes]
        return raw.view(codec.dtype_from_name(entry.dtype)).view(entry.shape)

    def header(self) -> bytes:
        """Everything but the buffer, as JSON bytes (what a peer needs to interpret it)."""
        return json.dumps({
            "step": self.step, "rank": self.rank, "world_size": self.world_size,
            "entries": [dataclasses.asdict(e) for e in self.entries],
            "global_tree": self.global_tree.decode(), "rank_tree": self.rank_tree.decode(),
            "nbytes": self.nbytes, "created_unix_s": self.created_unix_s,
        }).encode()

    @classmethod
    def from_header(cls, header: bytes, buffer: torch.Tensor) -> HostSnapshot:
        data = json.loads(header)
        entries = [Entry(**{**e, "shape": tuple(e["shape"]),
                            "global_shape": _opt_tuple(e["global_shape"]),
                            "global_stride": _opt_tuple(e["global_stride"])})
                   for e in data["entries"]]
        if buffer.numel() != data["nbytes"]:
            raise ValueError(f"peer buffer has {buffer.numel()} bytes, header says "
                             f"{data['nbytes']}")
        return cls(step=data["step"], rank=data["rank"], world_size=data["world_size"],
                   entries=entries, buffer=buffer, global_tree=data["global_tree"].encode(),
                   rank_tree=data["rank_tree"].encode(), created_unix_s=data["created_unix_s"])

    def dcp_state(self, *, rank: int, is_coordinator: bool) -> dict[str, torch.Tensor]:
        """The flat dict handed to DCP: global keys as-is (DTensors rebuilt around the packed
        local shards), this rank's keys under ``__rank__/<rank>/``, and the JSON trees."""
        from torch.distributed.tensor import DTensor

        out: dict[str, torch.Tensor] = {}
        for entry in self.entries:
            view = self.view(entry)
            if entry.scope == RANK:
                out[f"{RANK_PREFIX}/{rank}/{entry.key}"] = view
            elif entry.global_shape is not None:
                mesh, placements = self.dist_refs[entry.key]
                out[entry.key] = DTensor.from_local(
                    view, mesh, placements, run_check=False,
                    shape=torch.Size(entry.global_shape), stride=entry.global_stride)
            else:
                out[entry.key] = view
        if is_coordinator:
            out[TREE_KEY] = codec.bytes_tensor(self.global_tree)
        out[f"{RANK_PREFIX}/{rank}/{TREE_KEY}"] = codec.bytes_tensor(self.rank_tree)
        return out


def _opt_tuple(value: Any) -> tuple | None:
    return None if value is None else tuple(value)


def _layout(tensors: Mapping[str, torch.Tensor], scope: str, start: int,
            ) -> tuple[list[Entry], int]:
    entries, offset = [], start
    for key, tensor in tensors.items():
        local = local_part(tensor)
        nbytes = local.numel() * local.element_size()
        offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
        gshape = gstride = None
        if is_dtensor(tensor):
            gshape, gstride = tuple(tensor.shape), tuple(tensor.stride())
        entries.append(Entry(key=key, scope=scope, dtype=codec.dtype_name(local.dtype),
                             shape=tuple(local.shape), offset=offset, nbytes=nbytes,
                             global_shape=gshape, global_stride=gstride))
        offset += nbytes
    return entries, offset


def prepare_snapshot(step: int, state: Mapping, rank_state: Mapping, *, rank: int,
                     world_size: int, reuse: HostSnapshot | None = None,
                     ) -> tuple[HostSnapshot, list[tuple[Entry, torch.Tensor]]]:
    """Lay ``state`` (global) and ``rank_state`` (this rank's own) out in one host buffer and
    serialize their non-tensor leaves; returns the snapshot and the copies still to make,
    ``(entry, live tensor)``, for :func:`fill_snapshot`.

    ``reuse``: a snapshot this call may overwrite; its buffer is recycled when the layout is
    unchanged (a save in steady state is then a memcpy: no allocation, no page faults)."""
    global_tree, global_tensors = codec.split_state(state, root="state")
    rank_tree, rank_tensors = codec.split_state(rank_state, root="rank_state")
    entries, end = _layout(global_tensors, GLOBAL, 0)
    more, end = _layout(rank_tensors, RANK, end)
    entries += more
    signature = tuple(e.signature() for e in entries)
    on_device = any(local_part(t).device.type != "cpu"
                    for t in (*global_tensors.values(), *rank_tensors.values()))
    if reuse is not None and reuse.signature() == signature:
        buffer = reuse.buffer
    else:
        # Pinned memory only for a state on an accelerator (fast, asynchronous copies).
        buffer = torch.empty(end, dtype=torch.uint8, pin_memory=on_device)
    snap = HostSnapshot(step=step, rank=rank, world_size=world_size, entries=entries,
                        buffer=buffer, global_tree=codec.dumps(global_tree),
                        rank_tree=codec.dumps(rank_tree))
    pending = []
    for entry in entries:
        src = (global_tensors if entry.scope == GLOBAL else rank_tensors)[entry.key]
        if is_dtensor(src):
            snap.dist_refs[entry.key] = (src.device_mesh, src.placements)
        pending.append((entry, local_part(src).detach()))
    return snap, pending


def fill_snapshot(snap: HostSnapshot, pending: list[tuple[Entry, torch.Tensor]]) -> None:
    """Make the copies :func:`prepare_snapshot` left; returns when every byte is in host
    memory. Safe on another thread: ``copy_`` releases the GIL."""
    with torch.no_grad():
        for entry, local in pending:
            snap.view(entry).copy_(local, non_blocking=local.device.type != "cpu")
    if not on_host(pending):
        torch.accelerator.synchronize()


def on_host(pending: list[tuple[Entry, torch.Tensor]]) -> bool:
    """Whether every tensor still to copy is in host memory (copies need no device sync)."""
    return all(local.device.type == "cpu" for _, local in pending)


class LayoutMismatch(ValueError):
    """A memory snapshot does not fit the template (different sharding or shapes)."""


def restore_tensors(snap: HostSnapshot, template: Mapping[str, torch.Tensor],
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Copy a snapshot into the template's tensors (in place) or into new tensors.

    Returns ``(global_tensors, rank_tensors)`` keyed like :func:`codec.split_state`. A template
    tensor whose local shard differs in shape or dtype raises :class:`LayoutMismatch`.
    """
    out: dict[str, dict[str, torch.Tensor]] = {GLOBAL: {}, RANK: {}}
    with torch.no_grad():
        for entry in snap.entries:
            view = snap.view(entry)
            target = template.get(entry.key) if entry.scope == GLOBAL else None
            if target is None:
                if entry.global_shape is not None:
                    raise LayoutMismatch(f"{entry.key}: a sharded tensor needs a template")
                out[entry.scope][entry.key] = view.clone()
                continue
            local = local_part(target)
            if tuple(local.shape) != entry.shape or codec.dtype_name(local.dtype) != entry.dtype:
                raise LayoutMismatch(f"{entry.key}: snapshot {entry.dtype}{list(entry.shape)}, "
                                     f"template {local.dtype}{list(local.shape)}")
            local.copy_(view)
            out[GLOBAL][entry.key] = target
    return out[GLOBAL], out[RANK]
