"""Split a training state into tensors and a JSON tree, and put it back together.

A checkpoint never stores pickles: tensors go through DCP as raw bytes, everything else (ints,
floats, strings, tuples, dicts with int keys, dtypes) is encoded here as *tagged JSON*, which
round-trips exactly (Python prints the shortest float repr that reads back to the same bits).
Tensors are replaced in the tree by ``{"__tensor__": key}`` placeholders.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch

from trainpilot.specs.errors import SpecError

_TAGS = ("__tensor__", "__tuple__", "__dict__", "__dtype__", "__float__")
_VALID = ("valid: tensors, None, bool, int, float, str, torch.dtype, and lists, tuples and "
          "dicts of those")


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def split_state(state: Any, *, root: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """Return ``(tree, tensors)``: a JSON-ready tree with tensor placeholders, and the tensors.

    Keys are the '/'-joined path of each tensor (``model/layers.0.weight``); two paths that
    render to the same key (a dict with both ``0`` and ``"0"``) are refused.
    """
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, (), tensors, root)
    return tree, tensors


def _encode(value: Any, path: tuple[str, ...], tensors: dict, root: str) -> Any:
    if is_tensor(value):
        key = "/".join(path) if path else "_"
        if key in tensors:
            raise SpecError(f"{root}.{key}", "duplicate path", "paths must be unique after "
                            "joining with '/' (a dict has both 0 and '0'?)")
        tensors[key] = value
        return {"__tensor__": key}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        # JSON's NaN/Infinity are not portable; tag them so any reader gets the same bits.
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, torch.Size)):
        return {"__tuple__": [_encode(v, (*path, str(i)), tensors, root)
                              for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, (*path, str(i)), tensors, root) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(k, str) and k not in _TAGS for k in value):
            return {k: _encode(v, (*path, k), tensors, root) for k, v in value.items()}
        # Non-string keys (optimizer state is keyed by int) keep their type in a pair list.
        return {"__dict__": [[_encode(k, (*path, "key"), {}, root),
                              _encode(v, (*path, str(k)), tensors, root)]
                             for k, v in value.items()]}
    where = f"{root}.{'/'.join(path)}" if path else root
    raise SpecError(where, type(value).__name__, _VALID)


def join_state(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of :func:`split_state`: placeholders are replaced by ``tensors[key]``."""
    if isinstance(tree, list):
        return [join_state(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if "__tensor__" in tree:
        return tensors[tree["__tensor__"]]
    if "__tuple__" in tree:
        return tuple(join_state(v, tensors) for v in tree["__tuple__"])
    if "__dict__" in tree:
        return {join_state(k, {}): join_state(v, tensors) for k, v in tree["__dict__"]}
    if "__dtype__" in tree:
        return dtype_from_name(tree["__dtype__"])
    if "__float__" in tree:
        return float(tree["__float__"])
    return {k: join_state(v, tensors) for k, v in tree.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``; anything that is not a dtype is refused."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dumps(tree: Any) -> bytes:
    """Canonical JSON bytes of an encoded tree (``allow_nan`` off: floats are tagged)."""
    return json.dumps(tree, allow_nan=False, separators=(",", ":"), sort_keys=False).encode()


def loads(data: bytes | bytearray | memoryview) -> Any:
    return json.loads(bytes(data))


def bytes_tensor(data: bytes) -> torch.Tensor:
    """A uint8 tensor holding ``data`` (used to carry JSON trees through DCP and send/recv)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tensor_keys(tree: Any) -> list[str]:
    """The tensor keys a tree's placeholders name, in order."""
    out: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if "__tensor__" in node:
                out.append(node["__tensor__"])
            elif "__dict__" in node:
                for _, v in node["__dict__"]:
                    walk(v)
            else:
                for v in node.values():
                    walk(v)

    walk(tree)
    return out
