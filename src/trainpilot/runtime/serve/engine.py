"""A batch-invariant, expert-parallel decoding engine for the project's MoE model.

The weights are those of ``runtime.models.gpt.GPT`` built from a ModelSpec (tiny-moe in the
tests); the forward is our own, one token row at a time, so a row's numbers never depend on
which other rows share its pass, on which rank serves its request, or on which rank holds its
experts: every linear map is applied to a ``[1, dim]`` row, attention of the row at position
``p`` reads the cached keys and values ``[0, p]`` of its own sequence, an expert computes each
routed row on its own, and the ``k`` expert outputs of a token are summed in routing order on the
token's rank. A request re-prefilled on another rank after a failure (its prompt and the tokens
already streamed) therefore reproduces the same cache and the same next token: that is what
makes "output identical to a fault-free run" a property of the construction, which the tests
check rather than hope for.

Expert parallelism: ``ExpertPlacement`` maps every (layer, expert) to the rank holding it; a
pass dispatches each routed row to its expert's rank and back with two ``alltoall_base`` calls on
a ``ProcessGroupGloo`` (counts first). Attention and the dense parts are replicated on every rank
(DP attention): each rank decodes its own requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from trainpilot.runtime.models.gpt import GPT, Block, apply_rope
from trainpilot.runtime.models.moe import MoE


@dataclass
class Sequence:
    """One request being decoded: its tokens so far and its KV cache (per layer, rows)."""

    request_id: int
    tokens: list[int]  # prompt, then the generated tokens
    prompt_len: int
    max_new_tokens: int
    cache_k: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][pos] [kvh, d]
    cache_v: list[list[torch.Tensor]] = field(default_factory=list)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens

    @property
    def cached(self) -> int:
        return len(self.cache_k[0]) if self.cache_k else 0


@dataclass
class ExpertPlacement:
    """(layer, expert) -> rank holding it, and each rank's experts' weights (w1, w2, w3)."""

    owner: dict[tuple[int, int], int]
    weights: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]

    def experts_of(self, rank: int) -> list[tuple[int, int]]:
        return sorted(k for k, r in self.owner.items() if r == rank)


def _block(model: GPT, layer: int) -> Block:
    return cast(Block, model.layers[str(layer)])  # GPT's layers are Blocks


def _moe(block: Block) -> MoE:
    return cast(MoE, block.feed_forward)  # on the layers ModelSpec.is_moe_layer names


def expert_weights(model: GPT, key: tuple[int, int]):
    """Clones of expert ``key`` = (layer, expert)'s weights from the full model."""
    layer, e = key
    ex = _moe(_block(model, layer)).experts
    w3 = ex.w3[e].detach().clone() if ex.w3 is not None else None
    return ex.w1[e].detach().clone(), ex.w2[e].detach().clone(), w3


class Engine:
    """Runs passes of rows for this rank's sequences; ``moe_exchange`` does the dispatch."""

    def __init__(self, model: GPT, placement: ExpertPlacement, rank: int):
        self.model = model
        self.spec = model.spec
        if model.tok_embeddings is None or model.norm is None:
            raise ValueError("Engine needs the whole model (a pipeline stage lacks the "
                             "embedding or the final norm)")
        self.tok_embeddings: nn.Embedding = model.tok_embeddings
        self.norm: nn.Module = model.norm
        self.placement = placement
        self.rank = rank
        self.head_dim = self.spec.head_size
        self.rep = self.spec.num_attention_heads // self.spec.kv_heads

    # ------------------------------------------------------------------ rows
    def _attention(self, block, seq: Sequence, layer: int, x: torch.Tensor, pos: int):
        att = block.attention
        d = self.head_dim
        q = F.linear(x, att.wq.weight).view(1, 1, -1, d)
        k = F.linear(x, att.wk.weight).view(1, 1, -1, d)
        v = F.linear(x, att.wv.weight).view(1, 1, -1, d)
        rope_cos, rope_sin = self.model.get_buffer("rope_cos"), self.model.get_buffer("rope_sin")
        cos, sin = rope_cos[pos:pos + 1], rope_sin[pos:pos + 1]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        seq.cache_k[layer].append(k[0, 0])
        seq.cache_v[layer].append(v[0, 0])
        keys = torch.stack(seq.cache_k[layer][:pos + 1])  # [p+1, kvh, d]
        vals = torch.stack(seq.cache_v[layer][:pos + 1])
        keys = keys.repeat_interleave(self.rep, dim=1)
        vals = vals.repeat_interleave(self.rep, dim=1)
        scores = torch.einsum("hd,phd->hp", q[0, 0], keys) / math.sqrt(d)
        out = torch.einsum("hp,phd->hd", scores.softmax(dim=-1), vals)
        return F.linear(out.reshape(1, -1), att.wo.weight)

    @staticmethod
    def _mlp(mlp, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, mlp.w1.weight)
        h = F.silu(h) * F.linear(x, mlp.w3.weight) if mlp.w3 is not None else F.gelu(
            h, approximate="tanh")
        return F.linear(h, mlp.w2.weight)

    @staticmethod
    def expert_row(w, x: torch.Tensor) -> torch.Tensor:
        """One routed row through one expert (``[1, dim]``)."""
        w1, w2, w3 = w
        h = x @ w1
        h = F.silu(h) * (x @ w3) if w3 is not None else F.gelu(h, approximate="tanh")
        return h @ w2

    # ------------------------------------------------------------------ a pass
    def forward(self, rows: list[tuple[Sequence, int, int]], moe_exchange) -> list[int]:
        """``rows`` = (sequence, token, position) in position order per sequence; returns the
        greedy next token of each row. ``moe_exchange(layer, rows_x, experts)`` returns each
        routed copy's expert output (it is collective: every rank calls it every MoE layer)."""
        spec = self.spec
        xs = [self.tok_embeddings.weight[tok].view(1, -1) for _, tok, _ in rows]
        for seq, _, _ in rows:
            while len(seq.cache_k) < spec.num_layers:
                seq.cache_k.append([])
                seq.cache_v.append([])
        for layer in range(spec.num_layers):
            block = _block(self.model, layer)
            xs = [x + self._attention(block, seq, layer, block.attention_norm(x), pos)
                  for x, (seq, _, pos) in zip(xs, rows)]
            normed = [block.ffn_norm(x) for x in xs]
            if not spec.is_moe_layer(layer):
                xs = [x + self._mlp(block.feed_forward, h) for x, h in zip(xs, normed)]
                continue
            moe = _moe(block)
            picks = []
            for h in normed:
                probs = F.linear(h, moe.router.weight).float().softmax(dim=-1)[0]
                top_p, top_i = probs.topk(moe.top_k)
                picks.append(((top_p / top_p.sum()).to(h.dtype), top_i.tolist()))
            routed = moe_exchange(layer, normed, [experts for _, experts in picks])
            new = []
            for x, h, (weights, _), outs in zip(xs, normed, picks, routed):
                acc = torch.zeros_like(h)
                for j, y in enumerate(outs):  # routing order: placement-independent sums
                    acc = acc + weights[j] * y
                if moe.shared is not None:
                    acc = acc + self._mlp(moe.shared, h)
                new.append(x + acc)
            xs = new
        head = self.model.output.weight if self.model.output is not None else \
            self.tok_embeddings.weight
        return [int(F.linear(self.norm(x), head)[0].argmax()) for x in xs]
