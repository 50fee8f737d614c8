"""Bring your own model: a Hugging Face ``transformers`` causal LM built from its
``config.json`` on disk (no hub download), as a module that maps tokens to logits.

Supported families (``model_type``): llama, mistral, qwen2, qwen3 (dense); mixtral, qwen2_moe,
qwen3_moe (MoE). The model is built by ``transformers`` itself (``AutoModelForCausalLM.
from_config``) on the meta device; :func:`init_hf_parameters` then fills it in one of two ways:

* random: every parameter drawn in full from a generator seeded by (seed, parameter name), the
  distribution HF's own ``_init_weights`` uses for these families (linear, embedding and expert
  weights N(0, ``initializer_range``), norms 1, biases 0), and each rank keeps its slice (TP
  shard, local experts). So every layout starts from the same numbers as one process;
* from a local safetensors checkpoint (``model.safetensors`` or a sharded
  ``model.safetensors.index.json``): each rank reads only its slice of each tensor.

:class:`CausalLM` keeps HF's own submodules under their HF names (``model.layers.0.self_attn.
q_proj.weight``, ``lm_head.weight``), so checkpoints and state dicts use the names HF does.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainpilot.specs.errors import SpecError

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
SUPPORTED_TYPES = DENSE_TYPES + MOE_TYPES


def load_hf_config(source: Any) -> Any:
    """A ``transformers`` config from a ``config.json`` path, a folder holding one, a dict, or
    a config object; unsupported families are a SpecError."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        config = source
    else:
        if isinstance(source, (str, os.PathLike)):
            path = Path(source)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise SpecError("model", str(path), "no such file; valid: a Hugging Face "
                                "config.json")
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise SpecError("model", str(path), f"not JSON ({err.msg})") from None
        else:
            data = dict(source)
        model_type = data.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise SpecError("model.model_type", model_type,
                            f"valid: {', '.join(SUPPORTED_TYPES)}")
        data = {k: v for k, v in data.items() if k not in ("model_type", "architectures")}
        config = AutoConfig.for_model(model_type, **data)
    if config.model_type not in SUPPORTED_TYPES:
        raise SpecError("model.model_type", config.model_type,
                        f"valid: {', '.join(SUPPORTED_TYPES)}")
    config.use_cache = False  # training: no KV cache
    config._attn_implementation = "sdpa"
    return config


def is_moe(config: Any) -> bool:
    return config.model_type in MOE_TYPES


def num_experts(config: Any) -> int:
    return int(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0))


def hf_model_spec(config: Any) -> Any:
    """The ModelSpec of an HF config (what the pipeline split and the cost model read), by
    :func:`trainpilot.specs.hf.model_from_hf_config`."""
    from trainpilot.specs import load_model
    from trainpilot.specs.hf import model_from_hf_config

    return load_model(model_from_hf_config(config.to_dict()))


class CausalLM(nn.Module):
    """An HF ``*ForCausalLM``'s decoder (``model``) and head (``lm_head``) under their HF
    names; ``forward(tokens [b, s]) -> logits [b, s, vocab]``.

    MoE models add HF's own load-balancing loss (``load_balancing_loss_func``, times
    ``router_aux_loss_coef``) to the backward pass without changing the logits
    (Megatron's ``MoEAuxLossAutoScaler``); ``aux_scale`` averages it over micro-batches as the
    main loss is (the builder sets it to 1 / micro-batches).
    """

    def __init__(self, hf_model: Any):
        super().__init__()
        # ``hf_model``: a transformers ``*ForCausalLM``. Its config and decoder (LlamaModel,
        # MixtralModel, ...) differ by architecture; the code reads their HF attribute names.
        self.config: Any = hf_model.config
        self.model: Any = hf_model.model
        self.lm_head: nn.Linear = hf_model.lm_head
        self.moe = is_moe(self.config)
        self.aux_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None  # the newest balance loss, detached

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Positions from the tokens, not from the embedding's output, which sequence
        # parallelism shards over the sequence.
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        if not self.moe:
            hidden = self.model(input_ids=tokens, position_ids=positions,
                                use_cache=False).last_hidden_state
            return self.lm_head(hidden)
        out = self.model(input_ids=tokens, position_ids=positions, use_cache=False,
                         output_router_logits=True)
        logits = self.lm_head(out.last_hidden_state)
        coeff = float(getattr(self.config, "router_aux_loss_coef", 0.0) or 0.0)
        if out.router_logits and self.training and torch.is_grad_enabled():
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            from trainpilot.runtime.models.moe import AuxLossScaler

            aux = load_balancing_loss_func(out.router_logits, num_experts(self.config),
                                           self.config.num_experts_per_tok, None)
            if not isinstance(aux, torch.Tensor):  # HF returns 0 for logits it cannot read
                raise TypeError(f"no load-balancing loss from router logits of type "
                                f"{type(out.router_logits).__name__}")
            self.last_aux_loss = aux.detach().float()
            if coeff:
                logits = AuxLossScaler.apply(logits, aux * (coeff * self.aux_scale))
        return logits


def build_meta(config: Any) -> CausalLM:
    """The HF model on the meta device (no memory), as a :class:`CausalLM`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return CausalLM(hf_model)


def build_plain(config: Any, *, seed: int = 0, weights: str | os.PathLike | None = None
                ) -> CausalLM:
    """The whole model in one process (what a one-process reference trains), filled as
    :func:`init_hf_parameters` fills any layout."""
    model = build_meta(config)
    model.to_empty(device="cpu")
    tie_embeddings(model)
    init_hf_parameters(model, seed=seed, weights=weights)
    return model


def tie_embeddings(model: CausalLM) -> None:
    """Share the embedding with the head again (``to_empty`` and TP give each its own)."""
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight


def _generator(seed: int, name: str) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


def _norm_params(model: nn.Module) -> set[str]:
    """Names of parameters that belong to normalisation layers (initialised to 1 / 0)."""
    out: set[str] = set()
    for mod_name, module in model.named_modules():
        if "Norm" in type(module).__name__:
            out.update(f"{mod_name}.{p}" for p, _ in module.named_parameters(recurse=False))
    return out


def full_value(name: str, shape: tuple[int, ...], *, seed: int, std: float, norm: bool,
               padding_idx: int | None = None) -> torch.Tensor:
    """The full initial value of parameter ``name`` (fp32, CPU)."""
    leaf = name.rsplit(".", 1)[-1]
    if norm:
        return (torch.ones if leaf == "weight" else torch.zeros)(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    value = torch.empty(shape).normal_(0.0, std, generator=_generator(seed, name))
    if padding_idx is not None:
        value[padding_idx] = 0.0
    return value


def _local_index(param: torch.Tensor, full_shape: tuple[int, ...], expert_range: tuple[int, int]
                 | None) -> tuple[slice, ...]:
    """The slice of the full tensor this rank holds: its DTensor shard and/or its experts."""
    from torch.distributed.tensor import DTensor

    index = [slice(0, s) for s in full_shape]
    if isinstance(param, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(
            torch.Size(full_shape), param.device_mesh, param.placements)
        index = [slice(o, o + s) for o, s in zip(offset, shape)]
    if expert_range is not None:
        index[0] = slice(*expert_range)
    return tuple(index)


@torch.no_grad()
def init_hf_parameters(model: nn.Module, *, seed: int,
                       weights: str | os.PathLike | None = None) -> None:
    """Fill every parameter of ``model`` (a :class:`CausalLM`, plain, tensor-parallel or with
    local experts; after ``to_empty``) with its layout-independent value: seeded random, or
    this rank's slice of the safetensors checkpoint ``weights``. Rotary tables are rebuilt."""
    from torch.distributed.tensor import DTensor

    config = model.config
    std = float(getattr(config, "initializer_range", None) or 0.02)
    norms = _norm_params(model)
    experts = {f"{n}.{p}": m for n, m in model.named_modules() if hasattr(m, "expert_offset")
               for p, _ in m.named_parameters(recurse=False)}
    pads = {f"{n}.weight": m.padding_idx for n, m in model.named_modules()
            if isinstance(m, nn.Embedding) and m.padding_idx is not None}
    reader = SafetensorsReader(weights) if weights is not None else None
    for name, param in model.named_parameters():
        full_shape = tuple(param.shape)
        owner = experts.get(name)
        expert_range = None
        if owner is not None:
            full_shape = (owner.num_global_experts,) + full_shape[1:]
            expert_range = (owner.expert_offset, owner.expert_offset + owner.num_local_experts)
        index = _local_index(param, full_shape, expert_range)
        if reader is not None:
            value = reader.read(name, full_shape, index)
        else:
            value = full_value(name, full_shape, seed=seed, std=std, norm=name in norms,
                               padding_idx=pads.get(name))[index]
        target = param.to_local() if isinstance(param, DTensor) else param
        target.copy_(value)
    rebuild_buffers(model)


def rebuild_buffers(model: nn.Module) -> None:
    """Recompute the buffers HF derives from the config (rotary ``inv_freq``), which the meta
    device left empty; any other buffer is refused rather than left uninitialised."""
    for mod_name, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            raise SpecError("model", f"{mod_name} ({type(module).__name__})",
                            f"has buffers {sorted(own)} this runtime cannot initialise")
        with torch.device("cpu"):
            fresh = type(module)(config=module.config)
        for key, buf in own.items():
            buf.copy_(getattr(fresh, key).to(buf.device))


class SafetensorsReader:
    """Reads slices of named tensors from ``model.safetensors`` or a sharded checkpoint
    (``model.safetensors.index.json``), a file or a folder, without loading whole files."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        files: dict[str, Path] = {}
        if path.is_dir():
            index = path / "model.safetensors.index.json"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {name: path / f for name, f in weight_map.items()}
                path = None  # type: ignore[assignment]
            else:
                path = path / "model.safetensors"
        if path is not None:
            if not path.is_file():
                raise SpecError("weights", str(path), "no such file; valid: a .safetensors "
                                "file or a folder with model.safetensors(.index.json)")
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                files = {name: path for name in handle.keys()}
        self.files = files

    def read(self, name: str, full_shape: tuple[int, ...], index: tuple[slice, ...]
             ) -> torch.Tensor:
        """``tensor[index]`` of checkpoint tensor ``name`` (fp32), checked against
        ``full_shape``. A missing ``lm_head.weight`` of a tied model is not asked for (the
        parameter is the embedding's)."""
        from safetensors import safe_open

        if name not in self.files:
            raise SpecError("weights", name, "missing from the checkpoint (names must be the "
                            "ones this transformers version's model uses)")
        with safe_open(str(self.files[name]), framework="pt") as handle:
            tensor = handle.get_slice(name)
            shape = tuple(tensor.get_shape())
            if shape != full_shape:
                raise SpecError("weights", name, f"shape {shape} in the checkpoint, the config "
                                f"gives {full_shape}")
            return tensor[index].float()
