"""ModelSpec, the "what" document: the shape of a decoder-only transformer (dense or MoE)."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import NonNegativeInt, PositiveFloat, PositiveInt

from trainpilot.specs.base import Spec
from trainpilot.specs.errors import SpecError


class MoESpec(Spec):
    """Mixture-of-experts feed-forward layers (Mixtral, DeepSeek, Qwen MoE)."""

    num_experts: PositiveInt
    top_k: PositiveInt
    expert_intermediate_size: PositiveInt
    num_shared_experts: NonNegativeInt = 0
    # Width of each shared expert; DeepSeek and Qwen use the routed experts' width.
    shared_expert_intermediate_size: PositiveInt | None = None
    # DeepSeek-V3 keeps its first 3 layers dense (`first_k_dense_replace`).
    first_k_dense_layers: NonNegativeInt = 0
    # After the dense prefix every `layer_freq`-th layer is MoE (1 = all of them).
    layer_freq: PositiveInt = 1
    # Auxiliary load-balancing loss weight (Switch Transformer; Mixtral uses 0.02).
    aux_loss_coeff: float = pydantic.Field(default=0.01, ge=0)
    # How the router scores experts: softmax over experts (Mixtral, Qwen) or a per-expert
    # sigmoid (DeepSeek-V3), and whether the top-k weights are renormalised to sum to 1.
    router_score: Literal["softmax", "sigmoid"] = "softmax"
    router_norm_topk: bool = True
    # DeepSeek-V3's aux-loss-free balancing: a per-expert bias added to the scores for the
    # choice only (`e_score_correction_bias`).
    router_expert_bias: bool = False
    # Factor on the routed experts' weighted sum (DeepSeek-V3: 2.5).
    router_scaling_factor: PositiveFloat | None = None
    # Group-limited routing (DeepSeek's n_group / topk_group): experts in this many groups, a
    # token routed within its best ``topk_groups`` groups (node-limited when groups are nodes).
    num_expert_groups: PositiveInt = 1
    topk_groups: PositiveInt | None = None

    @pydantic.model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.topk_groups is not None and self.topk_groups > self.num_expert_groups:
            raise SpecError("topk_groups", self.topk_groups,
                            f"exceeds num_expert_groups={self.num_expert_groups}")
        if self.num_experts % self.num_expert_groups:
            raise SpecError("num_expert_groups", self.num_expert_groups,
                            f"does not divide num_experts={self.num_experts}")
        if self.top_k > self.num_experts:
            raise SpecError("top_k", self.top_k,
                            f"top_k={self.top_k} exceeds num_experts={self.num_experts}; "
                            f"valid: 1 <= top_k <= {self.num_experts}")
        return self

    @property
    def shared_width(self) -> int:
        """Total width of the shared experts (0 without them)."""
        width = self.shared_expert_intermediate_size or self.expert_intermediate_size
        return self.num_shared_experts * width


class MLASpec(Spec):
    """DeepSeek multi-head latent attention: low-rank compressed queries, keys and values."""

    q_lora_rank: NonNegativeInt = 0  # 0: queries are not compressed (DeepSeek-V2-Lite)
    kv_lora_rank: PositiveInt
    qk_nope_head_dim: PositiveInt
    qk_rope_head_dim: PositiveInt
    v_head_dim: PositiveInt


class RopeScaling(Spec):
    """RoPE frequency scaling for long context, as Hugging Face's ``rope_scaling``:
    ``llama3`` (Llama 3.1: factor, low/high frequency factors, original context) or ``yarn``
    (DeepSeek-V3, Qwen: factor, original context, beta_fast/slow, mscale)."""

    type: Literal["llama3", "yarn", "linear"]
    factor: PositiveFloat
    original_max_position_embeddings: PositiveInt | None = None
    low_freq_factor: PositiveFloat | None = None  # llama3
    high_freq_factor: PositiveFloat | None = None  # llama3
    beta_fast: PositiveFloat | None = None  # yarn
    beta_slow: PositiveFloat | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn


class ModelSpec(Spec):
    """A decoder-only transformer. Sizes are counts; see the README for the defaults."""

    name: str = "custom"
    num_hidden_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt | None = None  # default: num_attention_heads (MHA)
    head_dim: PositiveInt | None = None  # default: hidden_size / num_attention_heads
    intermediate_size: PositiveInt | None = None  # default: 4 * hidden_size
    vocab_size: PositiveInt
    activation: Literal["gelu", "swiglu"] = "gelu"
    tie_word_embeddings: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    bias: bool = False  # biases on the linear layers (GPT-2/3 style; GPT-OSS's experts)
    # GPT-OSS's clamped SwiGLU (config.json ``swiglu_limit``): the gate clamped from above and
    # the linear half on both sides to this value before the activation (swiglu only).
    activation_clamp: PositiveFloat | None = None
    position_embedding: Literal["rope", "learned"] = "rope"
    max_position_embeddings: PositiveInt = 131072
    # RoPE base (Llama 2 / GPT-NeoX: 10,000; Llama 3: 500,000) and long-context scaling.
    rope_theta: PositiveFloat = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: PositiveFloat = 1e-5
    # RMSNorm on each head's queries and keys before RoPE (Qwen3, OLMo 2).
    qk_norm: bool = False
    # DeepSeek-V3 multi-token prediction modules (not priced by the cost model, as in the
    # DeepSeek-V3 report's 671B count; exported to frameworks that build them).
    num_mtp_layers: NonNegativeInt = 0
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    # Attention and hidden dropout probability in training. None: Megatron's GPT default (0.1)
    # for learned-position (GPT-style) models, none for RoPE models.
    dropout: float | None = pydantic.Field(default=None, ge=0.0, lt=1.0)
    # Sliding-window attention (GPT-OSS, Mistral): tokens attend to the previous
    # ``sliding_window`` only, on layers whose index is a multiple of ``sliding_window_every``
    # (1: every layer; 2: every other layer, starting with the first).
    sliding_window: PositiveInt | None = None
    sliding_window_every: PositiveInt = 1

    @pydantic.model_validator(mode="after")
    def _defaults_and_checks(self) -> ModelSpec:
        heads = self.num_attention_heads
        kv = self.num_key_value_heads if self.num_key_value_heads is not None else heads
        if heads % kv:
            raise SpecError("num_key_value_heads", kv,
                            f"does not divide num_attention_heads={heads}; valid: a divisor")
        if self.head_dim is None and self.hidden_size % heads:
            raise SpecError("hidden_size", self.hidden_size,
                            f"not a multiple of num_attention_heads={heads}; "
                            "valid: a multiple, or set head_dim")
        if self.moe and self.moe.first_k_dense_layers >= self.num_hidden_layers:
            raise SpecError("moe.first_k_dense_layers", self.moe.first_k_dense_layers,
                            f"leaves no MoE layer; valid: < num_hidden_layers="
                            f"{self.num_hidden_layers}")
        if self.activation_clamp is not None and self.activation != "swiglu":
            raise SpecError("activation_clamp", self.activation_clamp,
                            f"clamps a gated activation; valid: with activation swiglu "
                            f"(this model: {self.activation}), or unset")
        # Fill the defaults in so a dumped file is explicit and round-trips.
        object.__setattr__(self, "num_key_value_heads", kv)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // heads)
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        return self

    # Derived shape facts used by every layer above.
    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def kv_heads(self) -> int:
        return _filled(self.num_key_value_heads, "num_key_value_heads")

    @property
    def head_size(self) -> int:
        """Width of one attention head (``head_dim``, filled in by the validator)."""
        return _filled(self.head_dim, "head_dim")

    @property
    def ffn_size(self) -> int:
        """Width of the dense feed-forward block (``intermediate_size``, filled in by the
        validator)."""
        return _filled(self.intermediate_size, "intermediate_size")

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` (0-based) has an MoE feed-forward block."""
        if self.moe is None:
            return False
        k = self.moe.first_k_dense_layers
        return index >= k and (index - k) % self.moe.layer_freq == 0

    def attention_span(self, index: int, seq_len: int) -> int:
        """Keys a query attends to at most in layer ``index`` (the window, or the sequence)."""
        if self.sliding_window is not None and index % self.sliding_window_every == 0:
            return min(seq_len, self.sliding_window)
        return seq_len

    @property
    def has_dropout(self) -> bool:
        """Whether training applies dropout (see ``dropout``)."""
        if self.dropout is not None:
            return self.dropout > 0
        return self.position_embedding == "learned"

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))


def _filled(value: int | None, field: str) -> int:
    """A ModelSpec field its validator fills in; None only on an unvalidated instance."""
    if value is None:
        raise RuntimeError(f"ModelSpec.{field} is unset: build specs with validation")
    return value
