"""The reference GPT decoder, built from a ModelSpec.

RMSNorm or LayerNorm, RoPE or learned positions, SwiGLU or GELU MLP, grouped-query attention,
optional tied embeddings, and the MoE feed-forward of :mod:`.moe`. Written so PyTorch's own
parallel APIs apply without rewriting it (torchtitan's convention):

* decoder layers live in a ``ModuleDict`` keyed by their global index, so a pipeline stage is
  the same class with the other layers deleted and parameter names (``layers.3.attention.wq``)
  are identical under every layout;
* attention infers its local head count from the projection width (``view(b, s, -1, d)``), so a
  column-parallel ``wq`` simply yields fewer heads per rank;
* the embedding, final norm and output head may be ``None`` (middle pipeline stages), in which
  case the forward takes and returns hidden states;
* with context parallelism (``GPT.context_parallel``, set by the runtime) the forward takes this
  rank's share of the sequence (:mod:`.context`): RoPE and learned positions use the tokens'
  global positions and attention all-gathers K and V over the cp group.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainpilot.runtime.models.context import ContextParallel
from trainpilot.specs import ModelSpec


def rope_tables(seq_len: int, head_dim: int, *, device=None, theta: float = 10_000.0,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [seq_len, head_dim] for rotate-half RoPE with base
    ``theta`` (the model's ``rope_theta``: 10,000 for Llama 2, 500,000 for Llama 3)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [b, s, heads, d] by position (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return x * cos + rotated * sin


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden_size, eps=spec.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps, bias=spec.bias)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, d = spec.hidden_size, spec.head_size
        self.head_dim = d
        self.rep = spec.num_attention_heads // spec.kv_heads
        self.rope = spec.position_embedding == "rope"
        self.wq = nn.Linear(h, spec.num_attention_heads * d, bias=spec.bias)
        self.wk = nn.Linear(h, spec.kv_heads * d, bias=spec.bias)
        self.wv = nn.Linear(h, spec.kv_heads * d, bias=spec.bias)
        self.wo = nn.Linear(spec.num_attention_heads * d, h, bias=spec.bias)
        self.recompute_core = False  # selective recompute: re-run only QK^T/AV in backward
        self.context_parallel: ContextParallel | None = None  # set by the runtime (cp > 1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.rope:
            q, k = apply_rope(q, cos[:s], sin[:s]), apply_rope(k, cos[:s], sin[:s])
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            out = self._core(q, k, v)
        return self.wo(out.reshape(b, s, -1))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.context_parallel is not None:
            return self.context_parallel.attention(q, k, v, rep=self.rep)
        if self.rep > 1:
            k = k.repeat_interleave(self.rep, dim=2)
            v = v.repeat_interleave(self.rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)


class MLP(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)) or GELU (w2(gelu(w1 x))) feed-forward."""

    def __init__(self, dim: int, width: int, *, swiglu: bool, bias: bool):
        super().__init__()
        self.w1 = nn.Linear(dim, width, bias=bias)
        self.w2 = nn.Linear(width, dim, bias=bias)
        self.w3 = nn.Linear(dim, width, bias=bias) if swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + ffn(norm(x))."""

    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        self.attention_norm = make_norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = make_norm(spec)
        if spec.is_moe_layer(index):
            from trainpilot.runtime.models.moe import MoE

            self.feed_forward: nn.Module = MoE(spec)
        else:
            self.feed_forward = MLP(spec.hidden_size, spec.ffn_size,
                                    swiglu=spec.activation == "swiglu", bias=spec.bias)
        self.recompute_full = False

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.recompute_full and torch.is_grad_enabled():
            return checkpoint(self._inner, x, cos, sin, use_reentrant=False)
        return self._inner(x, cos, sin)

    def _inner(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(tokens [b, s]) -> logits [b, s, vocab]`` on a whole
    model; a pipeline stage without embedding/head maps hidden states to hidden states."""

    rope_cos: torch.Tensor  # buffers (register_buffer): [max_seq_len, head_dim]
    rope_sin: torch.Tensor

    def __init__(self, spec: ModelSpec, *, max_seq_len: int):
        super().__init__()
        self.spec = spec
        self.max_seq_len = max_seq_len
        h = spec.hidden_size
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size, h)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(max_seq_len, h) if spec.position_embedding == "learned" else None)
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.num_layers)})
        self.norm: nn.Module | None = make_norm(spec)
        self.output: nn.Linear | None = (
            None if spec.tie_word_embeddings else nn.Linear(h, spec.vocab_size, bias=False))
        self.is_last_stage = True
        self.context_parallel: ContextParallel | None = None  # see set_context_parallel
        cos, sin = rope_tables(max_seq_len, spec.head_size, theta=spec.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_buffers(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty`` from the meta device)."""
        cos, sin = rope_tables(self.max_seq_len, self.spec.head_size,
                               device=self.rope_cos.device, theta=self.spec.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def _blocks(self) -> list[Block]:
        return [cast(Block, block) for block in self.layers.values()]  # the layers are Blocks

    def set_recompute(self, mode: str) -> None:
        """Activation recomputation: "none", "selective" (attention core) or "full" (layer)."""
        for block in self._blocks():
            block.recompute_full = mode == "full"
            block.attention.recompute_core = mode == "selective"

    def set_context_parallel(self, cp: ContextParallel | None) -> None:
        """Take this rank's share of each sequence (:func:`.context.shard_sequence`) from now
        on: global positions, and attention over the whole sequence through the cp group."""
        self.context_parallel = cp
        for block in self._blocks():
            block.attention.context_parallel = cp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        cos, sin, positions = self.rope_cos, self.rope_sin, None
        if self.context_parallel is not None:
            positions = self.context_parallel.positions(seq, device=x.device)
            cos, sin = cos[positions], sin[positions]
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                if positions is None:
                    positions = torch.arange(seq, device=x.device)
                x = x + self.pos_embeddings(positions)
        for block in self.layers.values():
            x = block(x, cos, sin)
        if not self.is_last_stage:
            return x
        assert self.norm is not None  # only stages before the last drop the final norm
        x = self.norm(x)
        if self.output is not None:
            return self.output(x)
        assert self.tok_embeddings is not None  # tied (checked: needs pp = tp = 1)
        return F.linear(x, self.tok_embeddings.weight)


def build_gpt(spec: ModelSpec, *, max_seq_len: int, device: str | torch.device = "meta") -> GPT:
    """The whole model with uninitialised parameters on ``device`` (default: meta, no memory);
    call :func:`trainpilot.runtime.models.init.init_parameters` after placing it."""
    if max_seq_len <= 0:
        raise ValueError("max_seq_len must be positive")
    with torch.device(device):
        return GPT(spec, max_seq_len=max_seq_len)


def keep_stage(model: GPT, layer_ids: list[int], *, first: bool, last: bool) -> GPT:
    """Cut ``model`` down (in place) to a pipeline stage holding ``layer_ids``."""
    for key in list(model.layers.keys()):
        if int(key) not in layer_ids:
            del model.layers[key]
    if not first:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if not last:
        model.norm = None
        model.output = None
        model.is_last_stage = False
    return model


def param_std(name: str, spec: ModelSpec, base_std: float = 0.02) -> float:
    """Init std: GPT-2's scheme, residual projections (wo, w2) scaled by 1/sqrt(2 * layers)."""
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        return base_std / math.sqrt(2 * spec.num_layers)
    return base_std
