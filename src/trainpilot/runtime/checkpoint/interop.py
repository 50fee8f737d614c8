"""Our checkpoints, readable by stock ``torch.distributed.checkpoint`` too.

DCP's ``FileSystemReader`` finds a checkpoint through ``<folder>/.metadata`` (a pickled
``Metadata``) and reads each tensor chunk as a ``torch.save`` archive at a byte range of a data
file (``torch.load(weights_only=True)``). Our format stores a chunk's raw bytes at an offset,
so the writer wraps each raw chunk in a minimal torch.save zip archive ("envelope"): zip local
headers and ``data.pkl`` before the bytes, the remaining records and the zip central directory
after them, the raw bytes themselves stored uncompressed as ``archive/data/0``. Our reader
still reads only the raw bytes at ``pos`` and trusts only the JSON manifest; ``.metadata`` is
written beside it for DCP, never read by trainpilot (loading never unpickles).

What stock DCP sees: every tensor under its DCP key (``model/layers.0.weight`` becomes
``model.layers.0.weight``, DCP's own flattening, with ``planner_data`` to un-flatten), so
``dcp.load({"model": module.state_dict()}, checkpoint_id=folder)`` and ``dcp_to_torch_save``
work. Not covered: zstd-compressed checkpoints (DCP's zstd extension compresses the whole
archive, ours the raw bytes) and non-tensor state (ours is JSON in the manifest); for those no
``.metadata`` is written.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zlib
from pathlib import Path

import torch

ALIGN = 64  # torch.save aligns tensor data records to 64 bytes
_Z32 = 0xFFFFFFFF
PREFIX = "archive"


class _Storage:
    """Stands for the tensor's storage while pickling ``data.pkl``."""


class _Tensor:
    def __init__(self, storage: _Storage, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol):
        stride, acc = [], 1
        for size in reversed(self.shape):
            stride.append(acc)
            acc *= size
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, tuple(reversed(stride)), False,
                 collections.OrderedDict()))


def data_pkl(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` torch.save writes for a contiguous CPU tensor of ``dtype``/``shape``
    (tests check it byte for byte against torch.save's)."""
    storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
    storage = _Storage()
    numel = 1
    for size in shape:
        numel *= size

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if obj is storage:
                return ("storage", storage_type, "0", "cpu", numel)
            return None

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_Tensor(storage, tuple(shape)))
    return buf.getvalue()


def supported(dtype: torch.dtype) -> bool:
    return dtype in torch.storage._dtype_to_storage_type_map()


def _local_header(name: bytes, crc: int, size: int, pad_to: int | None, start: int,
                  zip64: bool) -> bytes:
    extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    base = 30 + len(name) + len(extra)
    if pad_to:
        pad = (-(start + base + 4)) % pad_to  # a 4-byte header for the padding field itself
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB" padding, as torch does
    size32 = _Z32 if zip64 else size
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, 0x21, crc,
                       size32, size32, len(name), len(extra)) + name + extra


def _central(name: bytes, crc: int, size: int, offset: int, zip64: bool) -> bytes:
    fields = []
    if zip64:
        fields += [size, size]
    if offset >= _Z32 or zip64:
        fields.append(offset)
    extra = struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields) \
        if fields else b""
    size32 = _Z32 if zip64 else size
    off32 = _Z32 if (offset >= _Z32 or zip64) else offset
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45 if zip64 else 20, 0, 0, 0,
                       0x21, crc, size32, size32, len(name), len(extra), 0, 0, 0, 0,
                       off32) + name + extra


def envelope(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, crc: int, *,
             force_zip64: bool = False) -> tuple[bytes, bytes]:
    """``(before, after)``: with the raw bytes between them, a torch.save archive that
    ``torch.load`` reads as the tensor. ``crc``: zlib.crc32 of the raw bytes."""
    small = [("data.pkl", data_pkl(dtype, shape)), (".format_version", b"1"),
             (".storage_alignment", str(ALIGN).encode()), ("byteorder", b"little")]
    before, entries, pos = bytearray(), [], 0
    for member, body in small:
        header = _local_header(f"{PREFIX}/{member}".encode(), zlib.crc32(body), len(body), None,
                               pos, False)
        entries.append((f"{PREFIX}/{member}".encode(), zlib.crc32(body), len(body), pos, False))
        before += header + body
        pos += len(header) + len(body)
    big = force_zip64 or nbytes >= _Z32
    name = f"{PREFIX}/data/0".encode()
    header = _local_header(name, crc, nbytes, ALIGN, pos, big)
    entries.append((name, crc, nbytes, pos, big))
    before += header
    pos += len(header) + nbytes
    after = bytearray()
    version = b"3\n"
    name = f"{PREFIX}/version".encode()
    header = _local_header(name, zlib.crc32(version), len(version), None, pos, False)
    entries.append((name, zlib.crc32(version), len(version), pos, False))
    after += header + version
    pos += len(header) + len(version)
    cd_start = pos
    central = b"".join(_central(*entry) for entry in entries)
    after += central
    cd_size = len(central)
    n = len(entries)
    if big or cd_start >= _Z32:
        eocd64 = pos + cd_size
        after += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, cd_size,
                             cd_start)
        after += struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1)
        after += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _Z32, _Z32, 0)
    else:
        after += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, cd_size, cd_start, 0)
    return bytes(before), bytes(after)


def write_dcp_metadata(step_dir: Path, metadata, storage_data: dict, name: str) -> bool:
    """Write DCP's ``.metadata`` for the checkpoint in ``step_dir`` (folder ``name`` under the
    root); ``storage_data`` maps each chunk's MetadataIndex to its location (with the envelope
    range ``dcp``). False (nothing written) when a chunk has no envelope (zstd, or a chunk
    referenced from a checkpoint written before envelopes) or two keys flatten alike."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    renamed = {fqn: fqn.replace("/", ".") for fqn in metadata.state_dict_metadata}
    if len(set(renamed.values())) != len(renamed):
        return False
    storage = {}
    for index, loc in storage_data.items():
        if "dcp" not in loc:
            return False
        folder, _, rel = loc["file"].partition("/")
        path = rel if folder == name else f"../{folder}/{rel}"
        start, length = loc["dcp"]
        storage[MetadataIndex(renamed[index.fqn], index.offset)] = _StorageInfo(
            relative_path=path, offset=start, length=length)
    body = Metadata(
        state_dict_metadata={renamed[k]: v for k, v in metadata.state_dict_metadata.items()},
        planner_data={renamed[k]: tuple(k.split("/")) for k in metadata.state_dict_metadata},
        storage_data=storage, version="1.0.0")
    from trainpilot.fsio import atomic_write_bytes

    atomic_write_bytes(step_dir / ".metadata", pickle.dumps(body))
    return True
