"""The serving cost model: one forward pass of a decode or prefill batch on a serving instance,
op by op, from FLOPs, HBM bytes (weights and KV cache) and collectives on the topology.

Every op costs max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)) and is
booked under the bound that set it (compute, HBM weights, HBM KV cache); collectives cost what
``perf.topology.Network`` says for their group's span; each layer pays its kernels' launch gaps
and each pass a host step overhead. Nothing here is fitted to a case: the efficiency knobs are
in ``ServeEfficiency`` with their sources, and ``trainpilot.sim.serve_validation`` calibrates
some of them on the calibration sources only.

Per layer, on one device of an attention group of ``tp`` devices with ``rows`` query tokens:

* attention projections: ``2 rows P_attn / tp`` FLOPs over ``P_attn / tp`` weight bytes (MLA's
  absorbed decode reads the same matrices, so the same count);
* attention core: decode reads each sequence's KV cache once per step, ``seqs x context x
  kv_bytes_per_token``, and does ``2 rows context heads (d_qk + d_v)`` FLOPs (MLA absorbed:
  d_qk = kv_lora + rope, d_v = kv_lora, on the latent cache); prefill is FlashAttention,
  ``2 pairs heads (d_qk + d_v)`` FLOPs over the causal query-key pairs;
* dense MLP: like the projections; MoE: the instance's ``dp_attention x rows`` tokens make
  ``k`` assignments each, spread over ``ep`` expert groups: ``dp x rows x k / ep`` rows per device
  (times the load imbalance), and every local expert that receives a token is read from HBM
  (``1 - (1 - k/E)^tokens`` of them); shared experts run on the group's own rows;
* collectives: two all-reduces of ``rows x h`` 16-bit values per layer in the TP group (the
  attention output, and the MLP output unless an all-to-all returns it); MoE layers with
  attention groups > 1 dispatch ``rows/tp x k x h`` (1-byte with fp8 weights) and combine the same
  in 16-bit over the instance (``_all_to_all_s``: per-node deduplication in prefill, direct in
  decode, on the cluster's NVLink and network tiers). With two-batch overlap each pass is
  two half passes and the all-to-alls hide behind the other half's compute (only the excess is
  exposed).

KV cache per token: GQA ``layers x 2 x ceil(kv_heads / tp) x head_dim x bytes`` per device; MLA
``layers x (kv_lora + rope) x bytes``, replicated over the TP group (which is why DP attention
serves MLA models). Weights per device follow the same split; the embedding and output head are
kept 16-bit and split over ``tp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from trainpilot.perf.flops import attention_params, mlp_params
from trainpilot.perf.hardware import curve_for
from trainpilot.perf.topology import GroupSpan, Network
from trainpilot.specs import ClusterSpec, ModelSpec, SpecError
from trainpilot.specs.serve import DTYPE_BYTES, InstanceLayout, ServePlan

GIB = 2**30
CATEGORIES = ("compute", "hbm_weights", "hbm_kv", "hbm_activations", "tp_collectives",
              "all_to_all", "overhead")


@dataclass(frozen=True, kw_only=True)
class ServeEfficiency:
    """Achieved fractions and fixed costs of a serving stack (units in the names).

    Defaults and their sources: ``hbm_efficiency`` None uses the device curve's (0.75 for the
    H100 family; FlashMLA reports 3,000 of 3,350 GB/s, 0.90, on H800 for memory-bound decode
    attention); ``decode_attention_efficiency`` 0.59 of the 16-bit peak is FlashMLA's
    compute-bound figure (580 TFLOP/s on H800); ``prefill_attention_efficiency`` None uses the
    curve's FlashAttention figure (0.42 on H100: FlashAttention-2); 8-bit GEMMs run at
    ``fp8_gemm_scale`` x the 16-bit curve's fraction of their own (doubled) peak; a CUDA-graph
    replay leaves ``kernel_gap_us`` between consecutive kernels, ``kernels_per_layer`` of them;
    ``step_overhead_s`` is host time per pass not hidden by asynchronous scheduling;
    ``moe_imbalance`` is the busiest device's expert rows over the mean (1: perfect balance).
    """

    hbm_efficiency: float | None = None
    decode_attention_efficiency: float = 0.59
    prefill_attention_efficiency: float | None = None
    fp8_gemm_scale: float = 1.0
    kernel_gap_us: float = 2.0
    kernels_per_layer: int = 12
    step_overhead_s: float = 0.0
    moe_imbalance: float = 1.0
    workspace_gib: float = 2.0  # activations, CUDA graphs, communication buffers

    def __post_init__(self) -> None:
        for name in ("decode_attention_efficiency", "fp8_gemm_scale"):
            if not 0 < getattr(self, name) <= 2:
                raise SpecError(name, getattr(self, name), "valid: (0, 2]")
        for name in ("hbm_efficiency", "prefill_attention_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise SpecError(name, value, "valid: (0, 1]")
        if self.moe_imbalance < 1:
            raise SpecError("moe_imbalance", self.moe_imbalance, "valid: >= 1")
        for name in ("kernel_gap_us", "step_overhead_s", "workspace_gib"):
            if getattr(self, name) < 0:
                raise SpecError(name, getattr(self, name), "valid: >= 0")

    def replace(self, **changes) -> ServeEfficiency:
        return replace(self, **changes)


@dataclass
class PassCost:
    """Seconds of one forward pass by category, and the bound that dominates it."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    flops: float = 0.0  # per device
    hbm_bytes: float = 0.0  # per device

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def reason(self) -> str:
        """The category with the most time: compute, HBM (weights or KV), TP collectives,
        all-to-all, or overhead (launch gaps and host time)."""
        return max(self.seconds, key=self.seconds.get)

    def add(self, category: str, seconds: float, times: float = 1.0) -> None:
        self.seconds[category] += seconds * times

    def scaled(self, factor: float) -> PassCost:
        return PassCost({k: v * factor for k, v in self.seconds.items()}, self.flops * factor,
                        self.hbm_bytes * factor)

    def merged(self, other: PassCost) -> PassCost:
        return PassCost({k: self.seconds[k] + other.seconds[k] for k in CATEGORIES},
                        self.flops + other.flops, self.hbm_bytes + other.hbm_bytes)

    def to_dict(self) -> dict:
        return dict(total_s=self.total_s, reason=self.reason, seconds=dict(self.seconds),
                    flops=self.flops, hbm_bytes=self.hbm_bytes)


@dataclass(frozen=True)
class _Hw:
    """The device and wires as the serving model uses them."""

    peak_16: float
    peak_gemm: float
    hbm_bw: float
    hbm_bytes: float
    reserved_bytes: float
    curve: object
    net: Network
    devices_per_node: int
    nodes_per_rack: int
    gemm_scale: float
    prefill_attn_eff: float


def _hw(cluster: ClusterSpec, plan: ServePlan, eff: ServeEfficiency) -> _Hw:
    curve = curve_for(cluster)
    dev = cluster.device
    eight_bit = plan.weight_dtype in ("fp8", "fp4")
    peak_gemm = dev.peak_flops("fp8" if eight_bit else "bf16")
    hbm_eff = eff.hbm_efficiency if eff.hbm_efficiency is not None else curve.hbm_efficiency
    return _Hw(
        peak_16=dev.peak_flops("bf16"), peak_gemm=peak_gemm,
        hbm_bw=dev.hbm_gbytes_per_s * 1e9 * hbm_eff, hbm_bytes=dev.hbm_gib * GIB,
        reserved_bytes=curve.reserved_gib * GIB,
        curve=curve, net=Network.of(cluster, curve.collective_library),
        devices_per_node=cluster.devices_per_node, nodes_per_rack=int(cluster.nodes_per_rack),
        gemm_scale=eff.fp8_gemm_scale if eight_bit else 1.0,
        prefill_attn_eff=(eff.prefill_attention_efficiency
                          if eff.prefill_attention_efficiency is not None
                          else curve.flash_attention_efficiency),
    )


def _span(hw: _Hw, size: int) -> GroupSpan:
    per_node = min(size, hw.devices_per_node)
    nodes = math.ceil(size / per_node)
    return GroupSpan(size, per_node, nodes, math.ceil(nodes / hw.nodes_per_rack))


def _gemm(cost: PassCost, hw: _Hw, rows: float, params: float, weight_bytes: float, *,
          times: float = 1.0, pieces: int = 1) -> None:
    """``rows`` token rows through a ``params``-weight linear map (``pieces`` GEMMs of equal
    size): compute at the curve's efficiency for one piece's FLOPs, or the weights' bytes."""
    if rows <= 0 or params <= 0:
        return
    flops = 2.0 * rows * params
    one = flops / pieces
    compute = flops / (hw.peak_gemm * min(1.0, hw.curve.gemm_efficiency(one) * hw.gemm_scale))
    num_bytes = params * weight_bytes + 2.0 * 2.0 * rows * math.sqrt(params) * pieces
    memory = num_bytes / hw.hbm_bw
    cost.add("compute" if compute >= memory else "hbm_weights", max(compute, memory), times)
    cost.flops += flops * times
    cost.hbm_bytes += num_bytes * times


def _all_to_all_s(hw: _Hw, size: int, tokens: float, top_k: int, token_bytes: float, *,
                  dedup: bool) -> float:
    """One MoE dispatch (or combine) over ``size`` devices: each device sends ``tokens``
    tokens of ``token_bytes`` to the devices of their ``top_k`` experts (uniformly spread).

    ``dedup`` (DeepEP's normal kernels, used for prefill; DeepSeek-V3 report sec. 3.2.2): a
    token crosses the network once per remote *node* it needs, then NVLink forwards it to the
    experts' devices there; the expected number of distinct remote nodes of ``k`` picks over
    ``N`` nodes is (N - 1)(1 - (1 - 1/N)^k). Otherwise (the low-latency decode kernels) every
    copy goes straight to its expert's device: ``k (n - g) / n`` copies leave the node."""
    g = min(size, hw.devices_per_node)
    nodes = math.ceil(size / g)
    if size <= 1 or tokens <= 0:
        return 0.0
    intra_copies = top_k * (g - 1) / size
    if nodes == 1:
        return tokens * intra_copies * token_bytes / hw.net.intra_bw + hw.net.intra_lat
    if dedup:
        remote = (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** top_k)
        intra_copies = top_k * (g - 1) / g  # forwarding inside the receiving nodes
    else:
        remote = top_k * (size - g) / size
    bw = hw.net.rack_bw if nodes > hw.nodes_per_rack else hw.net.inter_bw
    lat = hw.net.rack_lat if nodes > hw.nodes_per_rack else hw.net.inter_lat
    ib = tokens * remote * token_bytes / bw
    nvl = tokens * intra_copies * token_bytes / hw.net.intra_bw
    return max(ib, nvl) + lat + hw.net.intra_lat


def kv_bytes_per_token(model: ModelSpec, layout: InstanceLayout, kv_dtype: str) -> float:
    """KV-cache bytes one token occupies on one device (all layers)."""
    b = DTYPE_BYTES[kv_dtype]
    if model.mla is not None:
        return model.num_layers * (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * b
    per_device = math.ceil(model.kv_heads / layout.tp)
    return model.num_layers * 2 * per_device * int(model.head_dim) * b


def weight_bytes_per_device(model: ModelSpec, layout: InstanceLayout, weight_dtype: str) -> float:
    """Weights on one device: attention, dense MLPs and shared experts split over ``tp``,
    routed experts over ``ep`` groups (each split ``expert_tp`` ways), 16-bit embedding and
    output head over ``tp``."""
    wb, t = DTYPE_BYTES[weight_dtype], layout.tp
    total = model.vocab_size * model.hidden_size * 2.0 / t
    if not model.tie_word_embeddings:
        total *= 2
    attn = attention_params(model) * wb / t
    for i in range(model.num_layers):
        total += attn
        if model.is_moe_layer(i):
            moe = model.moe
            expert = mlp_params(model, moe.expert_intermediate_size)
            local = (moe.num_experts + layout.num_redundant_experts) / layout.ep
            total += local * expert * wb / layout.expert_tp
            if moe.num_shared_experts:
                total += mlp_params(model, moe.shared_width) * wb / t
            total += model.hidden_size * moe.num_experts * 2.0
        else:
            total += mlp_params(model, int(model.intermediate_size)) * wb / t
    return total


def _attention_dims(model: ModelSpec, decode: bool) -> tuple[int, int]:
    """(d_qk, d_v) per head of the attention core; MLA decode runs on the absorbed latent."""
    if model.mla is not None:
        m = model.mla
        if decode:
            return m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return int(model.head_dim), int(model.head_dim)


@dataclass(frozen=True, kw_only=True)
class PassShape:
    """One forward pass on one attention group: ``decode_seqs`` sequences decoding
    ``decode_rows`` query tokens against ``context`` cached tokens each, plus ``prefill_rows``
    prompt tokens with ``prefill_pairs`` causal query-key pairs (``prefill_seqs`` prompts)."""

    decode_seqs: float = 0.0
    decode_rows: float = 0.0
    context: float = 0.0
    prefill_rows: float = 0.0
    prefill_pairs: float = 0.0
    prefill_seqs: float = 0.0

    @property
    def rows(self) -> float:
        return self.decode_rows + self.prefill_rows

    def halved(self) -> PassShape:
        return PassShape(**{k: v / 2 for k, v in self.__dict__.items() if k != "context"},
                         context=self.context)


def _layer(model: ModelSpec, layout: InstanceLayout, plan: ServePlan, hw: _Hw,
           eff: ServeEfficiency, shape: PassShape, moe_layer: bool) -> tuple[PassCost, float]:
    """(compute-stream cost of one layer, its all-to-all seconds) on one device."""
    cost = PassCost()
    t, d, rows = layout.tp, layout.dp_attention, shape.rows
    wb = DTYPE_BYTES[plan.weight_dtype]
    h, heads = model.hidden_size, model.num_attention_heads / t
    _gemm(cost, hw, rows, attention_params(model) / t, wb, pieces=2)
    # Attention core: decode (latent/KV streaming) and prefill (FlashAttention).
    kv_layer = kv_bytes_per_token(model, layout, plan.kv_dtype) / model.num_layers
    if shape.decode_rows:
        dqk, dv = _attention_dims(model, decode=True)
        flops = 2.0 * shape.decode_rows * shape.context * heads * (dqk + dv)
        num_bytes = shape.decode_seqs * shape.context * kv_layer
        compute = flops / (hw.peak_16 * eff.decode_attention_efficiency)
        memory = num_bytes / hw.hbm_bw
        cost.add("compute" if compute >= memory else "hbm_kv", max(compute, memory))
        cost.flops += flops
        cost.hbm_bytes += num_bytes
    if shape.prefill_rows:
        dqk, dv = _attention_dims(model, decode=False)
        flops = 2.0 * shape.prefill_pairs * heads * (dqk + dv)
        cost.add("compute", flops / (hw.peak_16 * hw.prefill_attn_eff))
        cost.add("hbm_kv", shape.prefill_rows * kv_layer / hw.hbm_bw)  # writing the new cache
        cost.flops += flops
    a2a = 0.0
    if moe_layer:
        moe = model.moe
        expert = mlp_params(model, moe.expert_intermediate_size)
        tokens = d * rows  # distinct tokens in the instance
        imbalance = plan.moe_imbalance if plan.moe_imbalance is not None else eff.moe_imbalance
        dev_rows = tokens * moe.top_k / layout.ep * imbalance
        local = (moe.num_experts + layout.num_redundant_experts) / layout.ep
        active = 1.0 - (1.0 - moe.top_k / moe.num_experts) ** tokens
        per_expert = dev_rows / max(local * active, 1e-9)
        params = expert / layout.expert_tp
        flops = 2.0 * dev_rows * params
        one = 2.0 * per_expert * params / 3  # one of an expert's three GEMMs
        compute = flops / (hw.peak_gemm * min(1.0, hw.curve.gemm_efficiency(one)
                                              * hw.gemm_scale))
        num_bytes = local * active * params * wb
        memory = num_bytes / hw.hbm_bw
        cost.add("compute" if compute >= memory else "hbm_weights", max(compute, memory))
        cost.flops += flops
        cost.hbm_bytes += num_bytes
        if moe.num_shared_experts:
            _gemm(cost, hw, rows, mlp_params(model, moe.shared_width) / t, wb, pieces=3)
        _gemm(cost, hw, rows, h * moe.num_experts, 2.0)  # router, 16-bit
        if d > 1:
            # Each TP rank of a group sends its share of the rows; the busiest device receives
            # ``imbalance`` x the mean, and the all-to-all ends when it has.
            tokens_dev = rows / t * imbalance
            a2a = (_all_to_all_s(hw, layout.num_devices, tokens_dev, moe.top_k,
                                 h * (1.03 if wb < 2 else 2.0), dedup=bool(shape.prefill_rows))
                   + _all_to_all_s(hw, layout.num_devices, tokens_dev, moe.top_k, h * 2.0,
                                   dedup=bool(shape.prefill_rows)))
    else:
        _gemm(cost, hw, rows, mlp_params(model, int(model.intermediate_size)) / t, wb, pieces=3)
    # Memory-bound kernels on the activations (16-bit): two norms (read + write h), two
    # residual adds (read 2h, write h), the attention and MLP intermediates written and read
    # back once, and for MoE the permute / un-permute of the k copies and their weighted sum.
    attn_dim = (heads * sum(_attention_dims(model, decode=False))
                + 2 * math.ceil(model.kv_heads / t) * int(model.head_dim))
    if moe_layer:
        moe = model.moe
        width = (moe.top_k * moe.expert_intermediate_size / layout.expert_tp
                 + moe.shared_width / t)
        extra = 6 * moe.top_k * h * (d / layout.ep if d > 1 else 1.0)
    else:
        width, extra = int(model.intermediate_size) / t, 0.0
    act_bytes = rows * 2.0 * (10 * h + 2 * attn_dim + 6 * width + extra)
    cost.add("hbm_activations", act_bytes / hw.hbm_bw)
    cost.hbm_bytes += act_bytes
    if t > 1:
        reduces = 1 if (moe_layer and d > 1) else 2
        cost.add("tp_collectives", hw.net.all_reduce_s(_span(hw, t), rows * h * 2.0), reduces)
    cost.add("overhead", eff.kernels_per_layer * eff.kernel_gap_us * 1e-6)
    return cost, a2a


def pass_cost(model: ModelSpec, cluster: ClusterSpec, plan: ServePlan, layout: InstanceLayout,
              shape: PassShape, eff: ServeEfficiency = ServeEfficiency()) -> PassCost:
    """Seconds of one forward pass of ``shape`` (per attention group) on ``layout``."""
    hw = _hw(cluster, plan, eff)
    halves = 2 if (plan.two_batch_overlap and layout.dp_attention > 1 and model.is_moe) else 1
    part = shape.halved() if halves == 2 else shape
    total = PassCost()
    for moe_layer, count in ((False, model.num_layers - model.num_moe_layers),
                             (True, model.num_moe_layers)):
        if not count:
            continue
        layer, a2a = _layer(model, layout, plan, hw, eff, part, moe_layer)
        if halves == 2:  # the other half's compute hides each half's all-to-all
            exposed = max(0.0, a2a - layer.total_s)
            layer = layer.scaled(2.0)
            layer.add("all_to_all", 2 * exposed)
        else:
            layer.add("all_to_all", a2a)
        total = total.merged(layer.scaled(count))
    # Output head: every decode row, the last token of each prompt.
    head_rows = shape.decode_rows + shape.prefill_seqs
    _gemm(total, hw, head_rows, model.vocab_size * model.hidden_size / layout.tp, 2.0)
    if plan.speculative.num_draft_tokens and plan.speculative.draft == "mtp" and shape.decode_rows:
        # One MTP module (a decoder layer) per draft token, on the decode rows.
        draft = PassShape(decode_seqs=shape.decode_seqs, decode_rows=shape.decode_seqs,
                          context=shape.context)
        layer, a2a = _layer(model, layout, plan, hw, eff, draft, model.is_moe)
        layer.add("all_to_all", a2a)
        total = total.merged(layer.scaled(plan.speculative.num_draft_tokens))
    total.add("overhead", eff.step_overhead_s)
    return total


def check_serve(model: ModelSpec, plan: ServePlan) -> None:
    """SpecErrors for layouts the model cannot take."""
    for name, layout in (("decode", plan.decode), ("prefill", plan.prefill)):
        if layout is None:
            continue
        if model.num_attention_heads % layout.tp:
            raise SpecError(f"{name}.tp", layout.tp, f"does not divide num_attention_heads="
                            f"{model.num_attention_heads}; valid: a divisor")
        if model.moe is None and (layout.ep > 1 or layout.num_redundant_experts):
            raise SpecError(f"{name}.ep", layout.ep, "the model has no experts; valid: 1")
        if model.moe is not None and (model.moe.num_experts + layout.num_redundant_experts) \
                % layout.ep:
            raise SpecError(f"{name}.ep", layout.ep,
                            f"does not divide num_experts + num_redundant_experts = "
                            f"{model.moe.num_experts + layout.num_redundant_experts}")


def kv_capacity_tokens(model: ModelSpec, cluster: ClusterSpec, plan: ServePlan,
                       layout: InstanceLayout, eff: ServeEfficiency = ServeEfficiency(),
                       ) -> float:
    """Tokens of KV cache one attention group can hold (0 when the weights do not fit)."""
    free = (cluster.device.hbm_gib * GIB - weight_bytes_per_device(model, layout,
                                                                   plan.weight_dtype)
            - curve_for(cluster).reserved_gib * GIB - eff.workspace_gib * GIB)
    if free <= 0:
        return 0.0
    return free * plan.kv_mem_fraction / kv_bytes_per_token(model, layout, plan.kv_dtype)
