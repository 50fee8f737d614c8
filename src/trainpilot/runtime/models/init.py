"""Layout-independent parameter initialisation.

Each parameter is drawn in full from a generator seeded by (seed, parameter name) and each rank
keeps only its slice of it: its tensor-parallel shard (DTensor placements), its experts (EP), its
pipeline stage (names are global). So a model initialised under TP=2, PP=2 or EP=2 holds exactly
the numbers the single-process model holds, which is what makes layouts comparable bit for bit,
and no rank ever communicates or holds more than one full parameter at a time.
"""

from __future__ import annotations

import zlib
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from trainpilot.runtime.models.gpt import param_std
from trainpilot.specs import ModelSpec


@runtime_checkable
class _RebuildsBuffers(Protocol):
    """A module with non-parameter state to rebuild after ``to_empty`` (GPT's RoPE tables)."""

    def init_buffers(self) -> None: ...


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


def full_init(name: str, shape: tuple[int, ...], spec: ModelSpec, seed: int,
              device: torch.device) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: norms 1, biases 0, weights
    N(0, std) with GPT-2's residual scaling; fp32."""
    leaf = name.rsplit(".", 1)[-1]
    if "norm" in name.rsplit(".", 2)[-2] and leaf in ("weight", "bias"):
        fill = torch.ones if leaf == "weight" else torch.zeros
        return fill(shape, device=device)
    if leaf == "bias":
        return torch.zeros(shape, device=device)
    std = param_std(name, spec)
    gen = _generator(seed, name, device)
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


def _local_slice(name: str, param: torch.Tensor, full_shape: tuple[int, ...], spec: ModelSpec,
                 seed: int) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    device = (param.to_local() if isinstance(param, DTensor) else param).device
    full = full_init(name, full_shape, spec, seed, device)
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            full.shape, param.device_mesh, param.placements)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        return full[index]
    return full


@torch.no_grad()
def init_parameters(model: nn.Module, spec: ModelSpec, *, seed: int) -> None:
    """Fill every parameter of ``model`` (a whole model or a stage, plain or tensor-parallel,
    with local experts) with its layout-independent initial value. Buffers are rebuilt too."""
    from torch.distributed.tensor import DTensor

    from trainpilot.runtime.models.moe import GroupedExperts

    experts = {f"{mod_name}.{p}": mod for mod_name, mod in model.named_modules()
               if isinstance(mod, GroupedExperts) for p in ("w1", "w2", "w3")}
    for name, param in model.named_parameters():
        full_shape = tuple(param.shape)
        owner = experts.get(name)
        if owner is not None:
            full_shape = (owner.num_global_experts,) + full_shape[1:]
        value = _local_slice(name, param, full_shape, spec, seed)
        if owner is not None:
            value = value[owner.expert_offset:owner.expert_offset + owner.num_local_experts]
        target = param.to_local() if isinstance(param, DTensor) else param
        target.copy_(value)
    for module in model.modules():
        if isinstance(module, _RebuildsBuffers):
            module.init_buffers()
