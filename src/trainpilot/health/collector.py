"""Gradient, update and memory statistics of a plain ``nn.Module`` + optimizer.

Per step (cheap: one fused ``_foreach_norm`` over the gradients and one device-to-host copy):
global and per-layer gradient L2 norms, and the number of non-finite gradient elements (counted
only when a norm is non-finite, since a finite norm proves there are none). Every
``detail_every`` steps (one extra pass over the gradients and a copy of the parameters): the share
of zero or near-zero gradient elements, the update-to-weight ratio ``||w_after - w_before|| /
||w_before||`` (global and per layer) and memory. A "layer" is the module that owns a parameter
(``blocks.0.attn.qkv``), so zeroing one ``nn.Linear``'s gradients shows under its own name.
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass, field

import torch

GIB = 1024**3


@dataclass(kw_only=True)
class GradStats:
    """Gradient statistics of one step, before the optimizer applies them."""

    grad_norm: float
    layer_norms: dict[str, float]
    num_nonfinite: int = 0
    zero_grad_frac: float | None = None  # detail steps only

    @property
    def finite(self) -> bool:
        return self.num_nonfinite == 0 and math.isfinite(self.grad_norm)


@dataclass(kw_only=True)
class MemoryStats:
    peak_mem_gib: float
    mem_frac: float | None  # used / capacity, None when the capacity is unknown
    device: str = "cpu"
    extra: dict[str, float] = field(default_factory=dict)


def reduced_sums(tensors: list[torch.Tensor], local_fn) -> list[float]:
    """``local_fn`` (a list of tensors -> a list of 0-d tensors or one vector, each entry a
    sum over the elements of one tensor: a squared norm, a count) applied to whole tensors,
    also when they are DTensors sharded over ranks (FSDP2, TP): each rank evaluates its shards,
    values of replicated dimensions are divided by their replication, and one all-reduce per
    mesh dimension sums them. Every rank of a mesh must call this with the same tensors in the
    same order (true for the parameters of one pipeline stage)."""
    from torch.distributed.tensor import DTensor, Replicate

    plain = [i for i, t in enumerate(tensors) if not isinstance(t, DTensor)]
    if len(plain) == len(tensors):  # no DTensor (DDP, one process): no bookkeeping
        return _stacked(local_fn(tensors)).tolist()
    out: list[float | None] = [None] * len(tensors)
    if plain:
        values = _stacked(local_fn([tensors[i] for i in plain]))
        for i, v in zip(plain, values.tolist()):
            out[i] = v
    groups: dict[int, list[tuple[int, DTensor]]] = {}  # mesh -> (index, DTensor) on it
    for i, t in enumerate(tensors):
        if isinstance(t, DTensor):
            groups.setdefault(id(t.device_mesh), []).append((i, t))
    for group in groups.values():
        members = [i for i, _ in group]
        mesh = group[0][1].device_mesh
        locals_, scales = [], []
        for _, dt in group:
            if any(p.is_partial() for p in dt.placements):
                dt = dt.redistribute(dt.device_mesh, [Replicate() if p.is_partial() else p
                                                      for p in dt.placements])
            locals_.append(dt.to_local())
            copies = 1
            for dim, placement in enumerate(dt.placements):
                if placement.is_replicate():
                    copies *= mesh.size(dim)
            scales.append(1.0 / copies)
        values = _stacked(local_fn(locals_))
        values = values * torch.tensor(scales, dtype=torch.float64, device=values.device)
        for dim in range(mesh.ndim):
            if mesh.size(dim) > 1:
                torch.distributed.all_reduce(values, group=mesh.get_group(dim))
        for i, v in zip(members, values.tolist()):
            out[i] = v
    return out  # type: ignore[return-value]  # every slot is filled: plain, then per mesh


def _stacked(values: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """``local_fn``'s answer as one float64 vector (one kernel, not one per tensor)."""
    return (values if isinstance(values, torch.Tensor) else torch.stack(values)).double()


def squared_norms(tensors: list[torch.Tensor]) -> list[float]:
    """Squared L2 norm of each (whole) tensor: one fused norm kernel per kind of tensor, then
    one conversion and one square over the stacked norms."""
    def local(ts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(torch._foreach_norm(ts, 2, dtype=torch.float32)).double().square()
    return reduced_sums(tensors, local)


def _layer_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


class MetricsCollector:
    """Reads gradients and parameters of ``model`` as updated by ``optimizer``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 zero_eps: float = 0.0):
        self.model, self.optimizer, self.zero_eps = model, optimizer, zero_eps
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        layers: dict[str, list[int]] = {}
        for index, name in enumerate(self.names):
            layers.setdefault(_layer_of(name), []).append(index)
        self.layers = layers
        self.layer_names = list(layers)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        owner = {i: k for k, members in enumerate(layers.values()) for i in members}
        self._owner = [owner[i] for i in range(len(self.params))]  # param index -> layer index
        self._index = {id(p): i for i, p in enumerate(self.params)}  # id(param) -> its index
        self._before: list[torch.Tensor] | None = None

    def _grads(self) -> tuple[list[int], list[torch.Tensor]]:
        # .grad never requires grad itself (no create_graph here): no detach needed.
        pairs = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        return [i for i, _ in pairs], [g for _, g in pairs]

    def grad_stats(self, *, detailed: bool = False,
                   given: tuple[list[torch.Tensor], torch.Tensor] | None = None) -> GradStats:
        """Norms (and on detail steps the zero share) of the gradients present now.
        ``given``: (parameters, their gradients' L2 norms) measured already this step (by the
        step guard, before it clipped): used instead of measuring again, when they cover
        exactly the parameters that have a gradient now."""
        index, grads = self._grads()
        if not grads:
            return GradStats(grad_norm=0.0, layer_norms={})
        norms = self._given_norms(index, given) if given is not None else None
        if norms is None:
            # One fused norm kernel and one copy to the host; the per-layer sums are a few
            # dozen floats, cheaper in Python than as more small kernels.
            norms = [math.sqrt(sq) for sq in squared_norms(grads)]
        squares = [0.0] * len(self.layer_names)
        present = [False] * len(self.layer_names)
        for i, norm in zip(index, norms):
            k = self._owner[i]
            squares[k] += norm * norm
            present[k] = True
        # Layers whose parameters got no gradient at all (unused, frozen) are left out.
        layer_norms = {name: math.sqrt(sq) for name, sq, p in
                       zip(self.layer_names, squares, present) if p}
        total = math.sqrt(math.fsum(n * n for n in norms))
        stats = GradStats(grad_norm=total, layer_norms=layer_norms)
        if not math.isfinite(total):
            stats.num_nonfinite = int(sum(reduced_sums(
                grads, lambda ts: [(~torch.isfinite(t)).sum() for t in ts])))
        if detailed:
            num = sum(g.numel() for g in grads)  # a DTensor's numel is the whole tensor's
            eps = self.zero_eps
            if eps > 0:
                zeros = sum(reduced_sums(grads, lambda ts: [(t.abs() <= eps).sum() for t in ts]))
            else:  # exact zeros: one counting kernel per tensor
                zeros = num - sum(reduced_sums(grads, lambda ts: [torch.count_nonzero(t)
                                                                   for t in ts]))
            stats.zero_grad_frac = round(zeros) / num if num else 0.0
        return stats

    def _given_norms(self, index: list[int],
                     given: tuple[list[torch.Tensor], torch.Tensor]) -> list[float] | None:
        params, values = given
        order = [self._index.get(id(p), -1) for p in params]
        if sorted(order) != index:  # not the same set of gradients: measure them here
            return None
        by_index = dict(zip(order, values.double().tolist()))
        return [by_index[i] for i in index]

    def snapshot(self) -> None:
        """Copy the parameters before the optimizer step (detail steps only)."""
        self._before = [p.detach().clone() for p in self.params]

    def update_ratios(self) -> tuple[float, dict[str, float]] | None:
        """Global and per-layer ``||delta w|| / ||w||`` since :meth:`snapshot` (then cleared)."""
        if self._before is None:
            return None
        before, self._before = self._before, None
        delta = [math.sqrt(v) for v in squared_norms(
            [p.detach() - b for p, b in zip(self.params, before)])]
        weight = [math.sqrt(v) for v in squared_norms(before)]
        per_layer = {}
        for name, members in self.layers.items():
            w = math.sqrt(sum(weight[i] ** 2 for i in members))
            d = math.sqrt(sum(delta[i] ** 2 for i in members))
            per_layer[name] = d / w if w > 0 else 0.0
        w_all = math.sqrt(sum(w * w for w in weight))
        d_all = math.sqrt(sum(d * d for d in delta))
        return (d_all / w_all if w_all > 0 else 0.0), per_layer

    def memory(self) -> MemoryStats:
        """Peak memory (CUDA allocator on a GPU, else this process's peak RSS) and pressure."""
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            return MemoryStats(peak_mem_gib=torch.cuda.max_memory_allocated(self.device) / GIB,
                               mem_frac=torch.cuda.memory_reserved(self.device) / total,
                               device=str(self.device))
        return host_memory()


def host_memory() -> MemoryStats:
    """This process's peak RSS and current RSS over the memory it may use (cgroup limit or
    MemTotal)."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rss = _current_rss_bytes()
    capacity = _memory_capacity_bytes()
    frac = rss / capacity if rss is not None and capacity else None
    return MemoryStats(peak_mem_gib=peak_kib * 1024 / GIB, mem_frac=frac)


def _current_rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return None


def _memory_capacity_bytes() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
            if text.isdigit() and int(text) < 1 << 60:
                return int(text)
        except OSError:
            pass
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None
