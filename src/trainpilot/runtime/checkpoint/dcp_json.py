"""DCP's global ``Metadata`` as JSON, so loading a checkpoint never unpickles anything.

DCP's own ``FileSystemReader`` reads ``.metadata`` with ``pickle.load``; ours keeps the same
information (tensor sizes, dtypes, chunk offsets, where each chunk's bytes live) in the
manifest as plain JSON and rebuilds the dataclasses from it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from trainpilot.runtime.checkpoint import codec


def encode_metadata(metadata: Metadata, storage_data: dict[MetadataIndex, dict]) -> dict:
    """JSON-ready form of ``metadata``; ``storage_data`` maps each chunk to its location."""
    tensors = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            raise TypeError(f"{fqn}: non-tensor DCP items are not stored (they are JSON)")
        tensors[fqn] = {
            "dtype": codec.dtype_name(md.properties.dtype),
            "requires_grad": bool(md.properties.requires_grad),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    locations = [{"fqn": index.fqn, "offset": list(index.offset or ()), **loc}
                 for index, loc in storage_data.items()]
    return {"version": metadata.version, "tensors": tensors, "locations": locations}


def tensor_entries(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """``metadata``'s items by name, each a tensor (the only kind :func:`encode_metadata`
    stores)."""
    out: dict[str, TensorStorageMetadata] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"{fqn}: non-tensor DCP items are not stored (they are JSON)")
        out[fqn] = md
    return out


def decode_metadata(data: dict) -> tuple[Metadata, dict[MetadataIndex, dict]]:
    """Inverse of :func:`encode_metadata`: ``(Metadata, {MetadataIndex: location})``."""
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for fqn, md in data["tensors"].items():
        state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=codec.dtype_from_name(md["dtype"]),
                                        requires_grad=md["requires_grad"]),
            size=torch.Size(md["size"]),
            chunks=[ChunkStorageMetadata(offsets=torch.Size(c["offsets"]),
                                         sizes=torch.Size(c["sizes"])) for c in md["chunks"]],
        )
    storage: dict[MetadataIndex, dict[str, Any]] = {}
    for loc in data["locations"]:
        loc = dict(loc)
        index = MetadataIndex(loc.pop("fqn"), loc.pop("offset"))
        storage[index] = loc
    metadata = Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage,
                        version=data["version"])
    return metadata, storage
