"""Pipeline stages of a dense Hugging Face decoder (``pp > 1``).

HF's top-level ``forward`` builds the rotary tables and the causal mask once and runs every
layer; a stage cannot be cut out of it. For the supported dense families (llama, mistral,
qwen2, qwen3) that top level is the same few steps, so :class:`HFStage` runs them itself for its
own layers: embed (first stage), rotary tables from the positions, each kept decoder layer
(HF's own module, with ``attention_mask=None``: SDPA's causal kernel, what HF's mask helper
also leaves to SDPA without padding), final norm and head (last stage). Parameter names stay
HF's (``model.layers.5.self_attn.q_proj.weight``: the kept layers live in a ``ModuleDict``
keyed by their global index), so checkpoints and initial values are layout-independent.

Refused (:func:`check_hf_pipeline`): MoE models (HF's load-balancing loss is one function of
every layer's router logits together and does not split over stages), tied embeddings (the
first and last stage would share a weight), sequence parallelism, and sliding-window attention
(the stage passes no mask).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainpilot.runtime.models.hf import CausalLM, is_moe
from trainpilot.specs import Plan, SpecError


def check_hf_pipeline(config: Any, plan: Plan) -> None:
    if plan.pp == 1:
        return
    reasons = []
    if is_moe(config):
        reasons.append("MoE models (the balance loss spans every layer's router)")
    if getattr(config, "tie_word_embeddings", False):
        reasons.append("tied embeddings (first and last stage would share a weight)")
    if plan.sequence_parallel:
        reasons.append("sequence_parallel")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) \
            and config.sliding_window < plan.seq_len:
        reasons.append(f"sliding-window attention shorter than seq_len ({config.sliding_window})")
    if reasons:
        raise SpecError("plan.pp", plan.pp, "pipeline stages of a Hugging Face model do not "
                        f"support {'; '.join(reasons)}; valid: pp=1")


class _StageDecoder(nn.Module):
    """A stage's share of HF's decoder under HF's attribute names (set by :class:`HFStage`;
    ``embed_tokens`` on the first stage only, ``norm`` on the last)."""

    embed_tokens: nn.Module
    layers: nn.ModuleDict
    norm: nn.Module
    rotary_emb: nn.Module


class HFStage(nn.Module):
    """Decoder layers ``layer_ids`` of a :class:`CausalLM` (and the embedding on the first
    stage, the final norm and head on the last), with HF's names. ``forward``: tokens (first
    stage) or hidden states [b, s, hidden] -> hidden states, or logits on the last stage."""

    def __init__(self, full: CausalLM, layer_ids: list[int], *, first: bool, last: bool):
        super().__init__()
        self.config, self.first, self.last = full.config, first, last
        self.model = _StageDecoder()
        if first:
            self.model.embed_tokens = full.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): full.model.layers[i] for i in layer_ids})
        if last:
            self.model.norm = full.model.norm
            self.lm_head = full.lm_head
        self.model.rotary_emb = full.model.rotary_emb
        self.aux_scale = 1.0  # the builder sets it; dense stages have no balance loss

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.model.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.model.embed_tokens(x) if self.first else x
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        rotary = self.model.rotary_emb(hidden, position_ids=positions)
        for layer in self.model.layers.values():
            hidden = layer(hidden, attention_mask=None, position_ids=positions,
                           position_embeddings=rotary)
        if self.last:
            hidden = self.lm_head(self.model.norm(hidden))
        return hidden
