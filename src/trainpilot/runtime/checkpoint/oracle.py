"""The equality oracle: two training states are equal only if every bit is.

Tensors are compared byte for byte (stricter than ``torch.equal``: NaN equals the same NaN,
-0.0 differs from 0.0), after dtype and shape; DTensors by their local shard, placements and
global shape (``full=True`` gathers them instead: collective). Other leaves compare with ``==``
(NaN-aware). The result lists the differing paths, so a failing test says what diverged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from trainpilot.runtime.checkpoint.snapshot import is_dtensor


def diff_states(a: Any, b: Any, *, full: bool = False, path: str = "state",
                limit: int = 20) -> list[str]:
    """Paths where ``a`` and ``b`` differ (empty: bit-identical), at most ``limit`` of them."""
    out: list[str] = []
    _diff(a, b, path, out, full, limit)
    return out


def _diff(a: Any, b: Any, path: str, out: list[str], full: bool, limit: int) -> None:
    if len(out) >= limit:
        return
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
        elif (problem := tensor_diff(a, b, full=full)) is not None:
            out.append(f"{path}: {problem}")
        return
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            out.append(f"{path}: keys differ: only left {sorted(map(str, set(a) - set(b)))[:5]}"
                       f", only right {sorted(map(str, set(b) - set(a)))[:5]}")
        for key in a:
            if key in b:
                _diff(a[key], b[key], f"{path}.{key}", out, full, limit)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            out.append(f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, full, limit)
        return
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    if type(a) is not type(b) or a != b:
        out.append(f"{path}: {a!r} vs {b!r}")


def tensor_diff(a: torch.Tensor, b: torch.Tensor, *, full: bool = False) -> str | None:
    """Why two tensors differ, or None if they are bit-identical."""
    if is_dtensor(a) != is_dtensor(b):
        return "DTensor vs plain tensor"
    if is_dtensor(a) and is_dtensor(b):  # both or neither, by the check above
        if tuple(a.shape) != tuple(b.shape):
            return f"global shape {list(a.shape)} vs {list(b.shape)}"
        if full:
            a, b = a.full_tensor(), b.full_tensor()
        else:
            if a.placements != b.placements:
                return f"placements {a.placements} vs {b.placements}"
            a, b = a.to_local(), b.to_local()
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    if tuple(a.shape) != tuple(b.shape):
        return f"shape {list(a.shape)} vs {list(b.shape)}"
    left, right = _bits(a), _bits(b)
    if torch.equal(left, right):
        return None
    if left.dim() == 2:  # bytes of element sizes without an integer type (complex128)
        mismatched = int((left != right).any(dim=1).sum())
    else:
        mismatched = int((left != right).sum())
    return f"{mismatched} of {a.numel()} elements differ"


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """One integer per element holding its bit pattern (or a row of bytes per element)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        return flat.view(torch.uint8)
    size = flat.element_size()
    if size in _INT_OF_SIZE:
        return flat.view(_INT_OF_SIZE[size])
    return flat.view(torch.uint8).view(-1, size)
