"""Token shards on disk: raw ``.bin`` files (nanoGPT: uint16/uint32 token ids, no header) and
Megatron-LM's indexed dataset (``prefix.bin`` + ``prefix.idx``), memory-mapped.

The ``.idx`` layout (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``, version 1;
read from its source, the reader and writer here are our own), all little-endian:

========================  ==========================================================
``b"MMIDIDX\\x00\\x00"``  9-byte magic
``<Q`` version            1
``<B`` dtype code         1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
                          7 float32, 8 uint16 (the ``.bin``'s token type)
``<Q`` sequence count     S
``<Q`` document count     D + 1 (document_indices, starting with 0)
int32[S]                  tokens per sequence
int64[S]                  byte offset of each sequence in the ``.bin``
int64[D + 1]              document d is sequences ``[doc_idx[d], doc_idx[d+1])``
int8[S] (optional)        per-sequence modes of multimodal datasets (ignored here)
========================  ==========================================================
"""

from __future__ import annotations

import glob
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from trainpilot.runtime.datasets.packing import PackedDocuments, documents_from_lengths
from trainpilot.specs.errors import SpecError

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                   6: np.float64, 7: np.float32, 8: np.uint16}
_INTEGER_CODES = (1, 3, 4, 5, 8)  # token ids: unsigned or signed integers, never floats
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents


def megatron_prefix(path: str | os.PathLike) -> Path | None:
    """The dataset prefix if ``path`` (``x.bin``, ``x.idx`` or ``x``) has both files, else None."""
    path = Path(path)
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    bin_path, idx_path = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
    return prefix if bin_path.is_file() and idx_path.is_file() else None


def read_megatron_index(idx_path: str | os.PathLike) -> dict:
    """The index's arrays: ``dtype``, ``sequence_lengths`` (int32), ``sequence_pointers``
    (int64, bytes), ``document_indices`` (int64, D + 1 entries). Memory-mapped."""
    idx_path = Path(idx_path)
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    if len(raw) < _HEADER.size:
        raise SpecError("data", str(idx_path), "too short for a Megatron index header")
    magic, version, code, num_seqs, num_docs = _HEADER.unpack(bytes(raw[:_HEADER.size]))
    if magic != MEGATRON_MAGIC:
        raise SpecError("data", str(idx_path), f"bad magic {magic!r}; valid: a Megatron-LM "
                        "indexed dataset (.idx starting with MMIDIDX)")
    if version != 1:
        raise SpecError("data", str(idx_path), f"index version {version}; valid: 1")
    if code not in _INTEGER_CODES:
        raise SpecError("data", str(idx_path), f"dtype code {code} is not an integer token "
                        f"type; valid: {_INTEGER_CODES}")
    offset = _HEADER.size
    need = offset + 4 * num_seqs + 8 * num_seqs + 8 * num_docs
    if len(raw) < need:
        raise SpecError("data", str(idx_path), f"{len(raw)} bytes; the header promises {need}")
    lengths = np.frombuffer(raw, dtype=np.int32, count=num_seqs, offset=offset)
    offset += lengths.nbytes
    pointers = np.frombuffer(raw, dtype=np.int64, count=num_seqs, offset=offset)
    offset += pointers.nbytes
    doc_idx = np.frombuffer(raw, dtype=np.int64, count=num_docs, offset=offset)
    if num_docs < 1 or doc_idx[0] != 0 or doc_idx[-1] != num_seqs or np.any(np.diff(doc_idx) < 0):
        raise SpecError("data", str(idx_path), "document indices must rise from 0 to the "
                        f"sequence count {num_seqs}")
    return dict(dtype=MEGATRON_DTYPES[code], sequence_lengths=lengths,
                sequence_pointers=pointers, document_indices=doc_idx)


def write_megatron(prefix: str | os.PathLike, documents: Sequence[Sequence[int]], *,
                   dtype: str = "uint16") -> Path:
    """Write ``documents`` (token id lists; one sequence per document) as ``prefix.bin`` +
    ``prefix.idx`` in Megatron-LM's format (atomically); returns the prefix."""
    from trainpilot.fsio import atomic_write_bytes

    np_dtype = np.dtype(dtype)
    code = {np.dtype(v): k for k, v in MEGATRON_DTYPES.items()}.get(np_dtype)
    if code not in _INTEGER_CODES:
        raise SpecError("dtype", dtype, "valid: uint8, int16, int32, int64, uint16")
    prefix = Path(prefix)
    arrays = [np.asarray(d, dtype=np.int64) for d in documents]
    info = np.iinfo(np_dtype)
    for i, arr in enumerate(arrays):
        if arr.size and (arr.min() < max(0, info.min) or arr.max() > info.max):
            raise SpecError("tokens", int(arr.max()), f"document {i} out of range for {dtype}")
    lengths = np.array([len(a) for a in arrays], dtype=np.int32)
    pointers = (np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1]])
                * np_dtype.itemsize).astype(np.int64)
    doc_idx = np.arange(len(arrays) + 1, dtype=np.int64)
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    atomic_write_bytes(prefix.with_suffix(".bin"), tokens.astype(np_dtype).tobytes())
    header = _HEADER.pack(MEGATRON_MAGIC, 1, code, len(lengths), len(doc_idx))
    atomic_write_bytes(prefix.with_suffix(".idx"), header + lengths.tobytes() + pointers.tobytes()
                       + doc_idx.tobytes())
    return prefix


def open_megatron(prefix: str | os.PathLike, *, seq_len: int, vocab_size: int,
                  eos_id: int | None) -> PackedDocuments:
    """A Megatron ``.bin`` + ``.idx`` as packed samples. A document is its sequences'
    tokens; ``eos_id`` (None: none added, as when the data was written with Megatron's
    ``--append-eod``) goes after each document."""
    prefix = Path(prefix)
    index = read_megatron_index(prefix.with_suffix(".idx"))
    bin_path = prefix.with_suffix(".bin")
    dtype = np.dtype(index["dtype"])
    size = bin_path.stat().st_size
    if size % dtype.itemsize:
        raise SpecError("data", str(bin_path), f"{size} bytes is not a whole number of {dtype}")
    tokens = (np.memmap(bin_path, dtype=dtype, mode="r") if size
              else np.zeros(0, dtype=dtype))
    lengths = index["sequence_lengths"].astype(np.int64)
    starts = index["sequence_pointers"] // dtype.itemsize
    if np.any(index["sequence_pointers"] % dtype.itemsize) or (
            len(starts) and int(starts[-1] + lengths[-1]) > len(tokens)):
        raise SpecError("data", str(prefix), "sequence pointers fall outside the .bin or off "
                        "token boundaries: .bin and .idx do not belong together")
    doc_idx = index["document_indices"]
    first, last = doc_idx[:-1], doc_idx[1:]
    # A document's sequences are contiguous in files Megatron's builder writes (and merges);
    # refuse an index that scatters them rather than reading them out of order.
    num_seqs = len(starts)
    opens_doc = np.zeros(num_seqs, dtype=bool)
    opens_doc[first[first < num_seqs]] = True
    follows = np.ones(num_seqs, dtype=bool)
    follows[1:] = starts[1:] == starts[:-1] + lengths[:-1]
    if np.any(~follows & ~opens_doc):
        raise SpecError("data", str(prefix), "a document's sequences are not contiguous in "
                        "the .bin; valid: an index written by Megatron's builder")
    cum = np.concatenate([[0], np.cumsum(lengths)])
    doc_length = cum[last] - cum[first]
    keep = doc_length > 0
    if not keep.any():
        raise SpecError("data", str(prefix), f"holds no tokens; need at least seq_len + 1 = "
                        f"{seq_len + 1}")
    doc_start = starts[first[keep]]
    return PackedDocuments([tokens], doc_part=np.zeros(int(keep.sum()), np.int64),
                           doc_start=doc_start, doc_length=doc_length[keep], seq_len=seq_len,
                           vocab_size=vocab_size, eos_id=eos_id, source=str(prefix))


def open_token_shards(pattern: str, *, seq_len: int, vocab_size: int, dtype: str,
                      eos_id: int | None) -> PackedDocuments:
    """Raw token files matching ``pattern`` (a glob, e.g. ``data/train_*.bin``), in sorted
    order, as one stream; each file is a document (``eos_id`` after each, if given)."""
    if dtype not in ("uint16", "uint32"):
        raise SpecError("data_dtype", dtype, "valid: uint16, uint32")
    paths = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
    if not paths:
        raise SpecError("data", pattern, "matches no file; valid: a glob of .bin token files")
    itemsize = np.dtype(dtype).itemsize
    parts = []
    for path in paths:
        size = path.stat().st_size
        if size % itemsize:
            raise SpecError("data", str(path), f"{size} bytes is not a whole number of {dtype} "
                            "tokens")
        parts.append(np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype))
    doc_part = np.arange(len(parts), dtype=np.int64)
    _, _, length = documents_from_lengths([len(p) for p in parts])
    return PackedDocuments(parts, doc_part=doc_part, doc_start=np.zeros(len(parts), np.int64),
                           doc_length=length, seq_len=seq_len, vocab_size=vocab_size,
                           eos_id=eos_id, source=pattern)
