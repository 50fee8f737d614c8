"""DCP storage layer: incremental, optionally zstd-compressed, checksummed, no pickles.

DCP plans who writes what (deduplicating replicated tensors, chunking DTensors, resharding on
load); this module decides how the bytes land on disk. Every chunk is stored as its raw bytes
(or a zstd frame of them) at a byte offset in a per-rank data file. A chunk whose SHA-256 equals
a chunk of the previous committed checkpoint is not written again: its location points into
the older folder (incremental save). The coordinator commits with the manifest (layout.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import (
    StorageReader,
    StorageWriter,
    WriteResult,
)
from torch.futures import Future

from trainpilot.runtime.checkpoint import dcp_json, interop, layout

CODECS = ("raw", "zstd")


@dataclass(kw_only=True)
class WriteStats:
    """Per-rank bytes of one save. ``raw`` counts every chunk, ``written`` what hit the disk."""

    num_items: int = 0
    num_referenced: int = 0
    bytes_raw: int = 0
    bytes_written: int = 0
    bytes_referenced: int = 0
    files: list[str] = field(default_factory=list)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` in row-major order (a copy only if it is not contiguous)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    # An ndarray has the buffer protocol; numpy's stubs declare it for Python >= 3.12 only.
    return memoryview(flat.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]


class _DataFile:
    """A data file being appended to, with its running SHA-256."""

    def __init__(self, path: Path, rel: str):
        self.rel, self.size = rel, 0
        self.handle = open(path, "wb")
        self.digest = hashlib.sha256()

    def write(self, data: memoryview | bytes) -> None:
        self.handle.write(data)
        self.digest.update(data)
        self.size += len(data)

    def close(self) -> dict[str, Any]:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        return {"bytes": self.size, "sha256": self.digest.hexdigest()}


class _DataFiles:
    """One rank's data files of one checkpoint, rolled over at ``max_bytes``.

    ``point(name, file_index)`` is the fault hook: ``write`` fires half-way through a chunk,
    ``data`` after each file is closed (fsync'd)."""

    def __init__(self, root: Path, prefix: str, max_bytes: int, point: Callable[[str, int], None]):
        self.root, self.prefix, self.max_bytes, self.point = root, prefix, max_bytes, point
        self.current: _DataFile | None = None
        self.closed: dict[str, dict[str, Any]] = {}

    def append(self, data: memoryview | bytes, *, before: bytes = b"",
               after: bytes = b"") -> tuple[str, int, int]:
        """Write ``before``, ``data``, ``after`` (a torch.save envelope, interop.py); returns
        (file relative to root, byte offset of ``data``, byte offset of ``before``)."""
        total = len(before) + len(data) + len(after)
        if self.current is None or (self.current.size
                                    and self.current.size + total > self.max_bytes):
            self._close_current()
            rel = f"{self.prefix}_{len(self.closed)}.bin"
            self.current = _DataFile(self.root / rel, rel)
        start = self.current.size
        self.current.write(before)
        pos, half = self.current.size, len(data) // 2
        self.current.write(data[:half])
        self.point("write", len(self.closed))  # a disk-full fault fires mid-chunk, as for real
        self.current.write(data[half:])
        self.current.write(after)
        return self.current.rel, pos, start

    def _close_current(self) -> None:
        if self.current is not None:
            self.closed[self.current.rel] = self.current.close()
            self.current = None
            self.point("data", len(self.closed))

    def close(self) -> dict[str, dict[str, Any]]:
        """Close the last file; returns ``{relative path: {"bytes", "sha256"}}``."""
        self._close_current()
        return self.closed


class CheckpointWriter(StorageWriter):
    """Writes one checkpoint folder ``root/step_<step>``; the coordinator commits it.

    ``base`` maps a chunk's SHA-256 to its location in ``base_name``, an older committed
    checkpoint (incremental); ``faults`` is a FaultInjector (runtime.faults) or None.
    ``guard`` returns a context manager that raises when this save no longer belongs to the
    run's current timeline (the checkpointer's group was rebuilt while it ran) and holds off a
    rebuild while it is open: the writer touches the folders under it, so an abandoned save
    whose collectives complete late never sets aside, deletes or commits anything the new
    timeline is writing.
    """

    def __init__(self, *, root: Path, step: int, compression: str = "raw", zstd_level: int = 3,
                 max_file_bytes: int = 256 << 20, base: dict[str, dict] | None = None,
                 base_name: str | None = None, faults: Any = None,
                 extra_body: dict | None = None,
                 guard: Callable[[], AbstractContextManager[Any]] | None = None):
        super().__init__()
        self._guard = guard or nullcontext
        if compression not in CODECS:
            raise ValueError(f"compression {compression!r} not in {CODECS}")
        self.root, self.step, self.name = root, step, layout.step_dir_name(step)
        self.compression, self.zstd_level = compression, zstd_level
        self.max_file_bytes, self.base, self.faults = max_file_bytes, base or {}, faults
        self.base_name = base_name if base else None
        self.used_base = False
        self.extra_body = extra_body or {}
        self.rank, self.is_coordinator = 0, True
        self.stats = WriteStats()
        self.index: dict[str, dict] = {}  # sha256 -> location, for the next incremental save
        self.manifest_body: dict | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator, self.rank = is_coordinator, int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes: set aside the abandoned timeline,
        # delete torn folders, then create ours.
        with self._guard():
            layout.set_aside_from(self.root, self.step)
            (self.root / self.name).mkdir(parents=True, exist_ok=True)
        # References are safe only into a checkpoint that is still committed (its manifest
        # protects every file it needs); the coordinator decides for all ranks.
        use_base = (self.base_name is not None and self.base_name != self.name
                    and (self.root / self.base_name / layout.MANIFEST).is_file())
        return [dataclasses.replace(p, storage_data={"use_base": use_base}) for p in plans]

    def _point(self, point: str, file_index: int = 0) -> None:
        if self.faults is not None:
            self.faults.checkpoint_point(point, step=self.step, rank=self.rank,
                                         file_index=file_index, step_dir=self.root / self.name)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with self._guard():
            (self.root / self.name).mkdir(parents=True, exist_ok=True)
        self._point("start")
        compress = None
        if self.compression == "zstd":
            import zstandard

            compress = zstandard.ZstdCompressor(level=self.zstd_level).compress
        base = self.base if (plan.storage_data or {}).get("use_base") else {}
        self.used_base = bool(base)
        files = _DataFiles(self.root, f"{self.name}/data_r{self.rank}", self.max_file_bytes,
                           self._point)
        pending: list[tuple[MetadataIndex, int, dict]] = []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise TypeError(f"{item.index.fqn}: non-tensor DCP item (trainpilot stores "
                                "non-tensor state as JSON, never pickled)")
            tensor = cast(torch.Tensor, planner.resolve_data(item))  # BYTE_IO refused above
            raw = tensor_bytes(tensor)
            digest = hashlib.sha256(raw).hexdigest()
            self.stats.num_items += 1
            self.stats.bytes_raw += len(raw)
            hit = base.get(digest)
            if hit is not None and hit["loc"]["raw"] == len(raw):
                self.stats.num_referenced += 1
                self.stats.bytes_referenced += len(raw)
                pending.append((item.index, len(raw), hit))
                continue
            data: bytes | memoryview
            if compress is None and interop.supported(tensor.dtype):
                # Raw chunks go inside a torch.save envelope, so stock DCP reads them too.
                before, after = interop.envelope(tensor.dtype, tuple(tensor.shape), len(raw),
                                                 zlib.crc32(raw))
                rel, pos, start = files.append(raw, before=before, after=after)
                data = raw
                envelope = {"dcp": [start, len(before) + len(raw) + len(after)]}
            else:
                data = compress(raw) if compress is not None else raw
                rel, pos, _ = files.append(data)
                envelope = {}
            loc = {"file": rel, "pos": pos, "stored": len(data), "raw": len(raw),
                   "codec": self.compression, "sha256": digest, **envelope}
            self.stats.bytes_written += len(data)
            pending.append((item.index, len(raw), {"loc": loc, "file": None}))
        closed = files.close()
        self.stats.files = sorted(closed)
        results = []
        for index, nbytes, entry in pending:
            stored = {"loc": entry["loc"], "file": entry["file"] or closed[entry["loc"]["file"]]}
            self.index[entry["loc"]["sha256"]] = stored
            results.append(WriteResult(index=index, size_in_bytes=nbytes, storage_data=stored))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_data: dict[MetadataIndex, dict] = {}
        files: dict[str, dict] = {}
        totals = {"bytes_raw": 0, "bytes_written": 0, "bytes_referenced": 0}
        for rank_results in results:
            for result in rank_results:
                loc = result.storage_data["loc"]
                storage_data[result.index] = loc
                files[loc["file"]] = result.storage_data["file"]
                totals["bytes_raw"] += loc["raw"]
                if loc["file"].startswith(self.name + "/"):
                    totals["bytes_written"] += loc["stored"]
                else:
                    totals["bytes_referenced"] += loc["raw"]
        self._point("manifest")
        with self._guard():
            # DCP's own metadata beside the manifest (for stock dcp.load; we never read it).
            dcp_readable = interop.write_dcp_metadata(self.root / self.name, metadata,
                                                      storage_data, self.name)
            body = {
                "step": self.step, "world_size": len(results), "created_unix_s": time.time(),
                "compression": self.compression, "files": files, "stats": totals,
                "metadata": dcp_json.encode_metadata(metadata, storage_data),
                "dcp_readable": dcp_readable, **self.extra_body,
            }
            layout.write_manifest(self.root / self.name, body)
        self._point("latest")
        with self._guard():
            layout.write_latest(self.root, self.name)
        self.manifest_body = body
        self._point("commit")

    def storage_meta(self) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


def index_from_manifest(body: dict) -> dict[str, dict]:
    """``sha256 -> location`` for every chunk of a committed checkpoint (incremental base)."""
    out = {}
    for loc in body["metadata"]["locations"]:
        loc = {k: v for k, v in loc.items() if k not in ("fqn", "offset")}
        out[loc["sha256"]] = {"loc": loc, "file": body["files"][loc["file"]]}
    return out


class CheckpointReader(StorageReader):
    """Reads a verified checkpoint: raw bytes (or zstd frames) into DCP's target tensors.

    Never unpickles: a chunk is ``torch.frombuffer`` of its bytes with the dtype and shape the
    JSON metadata records. ``verify_chunks`` re-checks each chunk's SHA-256 as it is read.
    """

    def __init__(self, *, root: Path, body: dict, verify_chunks: bool = False):
        super().__init__()
        self.root, self.verify_chunks = root, verify_chunks
        self.metadata, self.locations = dcp_json.decode_metadata(body["metadata"])
        self.tensors = dcp_json.tensor_entries(self.metadata)
        self.chunk_sizes = {
            (fqn, tuple(c.offsets)): tuple(c.sizes)
            for fqn, md in self.tensors.items() for c in md.chunks
        }

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_chunk(self, index: MetadataIndex, handle_for: Callable[[str], Any]) -> torch.Tensor:
        """The whole stored chunk at ``index`` as a tensor of its recorded dtype and shape."""
        loc = self.locations[index]
        handle = handle_for(loc["file"])
        handle.seek(loc["pos"])
        data = handle.read(loc["stored"])
        if len(data) != loc["stored"]:
            raise layout.CorruptCheckpoint(loc["file"], "short read")
        if loc["codec"] == "zstd":
            import zstandard

            data = zstandard.ZstdDecompressor().decompress(data, max_output_size=loc["raw"])
        if len(data) != loc["raw"] or (
                self.verify_chunks and hashlib.sha256(data).hexdigest() != loc["sha256"]):
            raise layout.CorruptCheckpoint(loc["file"], f"chunk {index.fqn} is damaged")
        md = self.tensors[index.fqn]
        sizes = self.chunk_sizes[(index.fqn, tuple(index.offset or ()))]
        if not data:
            return torch.empty(sizes, dtype=md.properties.dtype)
        return torch.frombuffer(bytearray(data), dtype=md.properties.dtype).view(sizes)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        handles: dict[str, Any] = {}

        def handle_for(rel: str) -> Any:
            if rel not in handles:
                handles[rel] = open(self.root / rel, "rb")
            return handles[rel]

        try:
            order = sorted(plan.items, key=lambda r: (self.locations[r.storage_index]["file"],
                                                      self.locations[r.storage_index]["pos"]))
            for req in order:
                if req.type == LoadItemType.BYTE_IO:
                    raise TypeError(f"{req.storage_index.fqn}: pickled DCP items are refused")
                chunk = self.read_chunk(req.storage_index, handle_for)
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    chunk = chunk.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != chunk.size():
                    raise ValueError(f"{req.storage_index.fqn}: stored chunk "
                                     f"{list(chunk.size())} vs target {list(target.size())}")
                target.copy_(chunk)
                planner.commit_tensor(req, target)
        finally:
            for handle in handles.values():
                handle.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True
