"""The serving cost model: one forward pass of a decode or prefill batch on a serving instance,
op by op, from FLOPs, HBM bytes (weights and KV cache) and collectives on the topology.

GEMMs cost what their kernel class measured (``GemmKernels``: the roofline of compute and
weight streaming, plus what the two fail to overlap near the ridge point and a per-GEMM
latency; constants fitted to DeepGEMM's published table, not to any serving row); the other
ops cost max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)). Each is
booked under the bound that set it (compute, HBM weights, HBM KV cache, HBM activations);
collectives cost what ``perf.topology.Network`` says for their group's span; each layer pays
its kernels' launch gaps (``kernels_per_layer``) and each pass its stack's host time
(``ServeRuntime.host_step_ms``). The plan's
``runtime`` (``specs.serve.ServeRuntime``) says which GEMM kernel class the stack ships and
whether its decode attention shares a KV head's reads across its query heads. Nothing here is
fitted to a case: the knobs are in ``ServeEfficiency`` with their sources, and
``trainpilot.sim.serve_validation`` calibrates three of them on the calibration sources only.

Per layer, on one device of an attention group of ``tp`` devices with ``rows`` query tokens:

* attention projections: ``2 rows P_attn / tp`` FLOPs over ``P_attn / tp`` weight bytes (MLA's
  absorbed decode reads the same matrices, so the same count);
* attention core: decode reads each sequence's KV cache once per step, ``seqs x context x
  kv_bytes_per_token`` (once per query head, ``heads / kv_heads`` times that, on a runtime
  without GQA KV reuse), and does ``2 rows context heads (d_qk + d_v)`` FLOPs (MLA absorbed:
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
  exposed); in prefill the all-to-all kernels hold ``a2a_sm_fraction`` of the SMs, so the
  compute they overlap runs that much slower.

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
class GemmKernels:
    """A GEMM kernel class as measured (``ServeRuntime.gemm_kernels`` names one).

    One GEMM of ``M`` rows (``groups`` of them in a grouped GEMM) takes ``max(c, m) +
    overlap_loss x min(c, m) + latency_us``: ``c`` the FLOPs of the rows padded to the 64-row
    tensor-core tile over ``fp8_efficiency`` x the 8-bit dense peak (16-bit GEMMs:
    ``ServeEfficiency.gemm_efficiency`` x the 16-bit peak), ``m`` the weight and activation
    bytes over ``hbm_efficiency`` x the HBM bandwidth. The plain roofline max is what a GEMM
    would take if streaming and tensor cores overlapped perfectly; near the ridge point (decode
    batches of 100-1,000 rows) they do not, and the per-kernel latency shows in small GEMMs.
    """

    fp8_efficiency: float
    hbm_efficiency: float
    overlap_loss: float
    latency_us: float


# Least-squares fits (log time) to DeepGEMM's published FP8 table on H800 (sim/data/
# serve_gemm.yaml; the 22 shapes with N >= 4,096 and K >= 1,536, 64 to 8,192 rows; refit:
# trainpilot.sim.serve_gemm.fit_gemm): "deepgemm" on DeepGEMM's own times (mean |error| 6.0%),
# "cutlass-3.6" on its times x its speedup column, DeepSeek's tuned CUTLASS 3.6 implementation
# of the same GEMMs (7.3%).
GEMM_KERNELS = {
    "deepgemm": GemmKernels(fp8_efficiency=0.668, hbm_efficiency=0.952, overlap_loss=0.537,
                            latency_us=0.94),
    "cutlass-3.6": GemmKernels(fp8_efficiency=0.570, hbm_efficiency=0.656, overlap_loss=0.302,
                               latency_us=4.79),
    # Least-squares fit (log time) to vLLM's Triton fused-MoE times for DeepSeek-V3's 256
    # block-FP8 experts on H100 (sim/data/serve_moe_triton.yaml: top-8, 128 to 3,072 tokens,
    # experts split 1-8 ways; refit: trainpilot.sim.serve_gemm.fit_moe_triton), mean |error|
    # 11.2%; the routed experts' class only (ServeRuntime.moe_gemm_kernels).
    "triton-moe-2025": GemmKernels(fp8_efficiency=0.0843, hbm_efficiency=0.391,
                                   overlap_loss=0.642, latency_us=16.5),
}
TILE_ROWS = 64  # a Hopper warpgroup MMA's M: rows are computed in multiples of it


def gemm_seconds(kernels: GemmKernels, peak_flops: float, hbm_bytes_per_s: float, *,
                 rows: float, n: float, k: float, weight_bytes: float, act_bytes: float = 2.0,
                 groups: float = 1.0) -> tuple[float, float, bool]:
    """(seconds, HBM bytes, compute-bound?) of ``groups`` GEMMs of ``rows`` x ``k`` activations
    (``act_bytes`` each) by ``k`` x ``n`` weights (``weight_bytes`` each) into 16-bit outputs,
    at ``peak_flops`` x the kernel class's efficiency (``GemmKernels`` has the form)."""
    padded = math.ceil(rows / TILE_ROWS - 1e-9) * TILE_ROWS
    compute = 2.0 * padded * n * k * groups / peak_flops
    num_bytes = (n * k * weight_bytes + rows * k * act_bytes + rows * n * 2.0) * groups
    memory = num_bytes / (hbm_bytes_per_s * kernels.hbm_efficiency)
    seconds = (max(compute, memory) + kernels.overlap_loss * min(compute, memory)
               + kernels.latency_us * 1e-6)
    return seconds, num_bytes, compute >= memory


@dataclass(frozen=True, kw_only=True)
class ServeEfficiency:
    """Achieved fractions and fixed costs of a serving stack (units in the names); the GEMMs'
    are the runtime's kernel class (``GEMM_KERNELS``), measured, not fitted here.

    Defaults and their sources: ``gemm_efficiency`` 0.80 is the large 16-bit GEMM's share of
    the 16-bit peak (~794 TFLOP/s "maximum achievable matmul" of an H100 SXM, Bekman,
    ml-engineering); ``hbm_efficiency`` 0.90 is the achieved share of HBM bandwidth of
    KV-cache streaming and memory-bound elementwise kernels (FlashMLA reports 3,000 of 3,350
    GB/s on H800 for decode attention; the calibration rows cannot tell 0.88 from 0.95, so it
    is not fitted); ``decode_attention_efficiency`` 0.59 of the 16-bit peak is FlashMLA's
    compute-bound figure (580 TFLOP/s on H800);
    ``prefill_attention_efficiency`` None uses the curve's FlashAttention figure (0.42 on H100:
    FlashAttention-2); a CUDA-graph replay leaves ``kernel_gap_us`` between consecutive
    kernels (``kernels_per_layer`` counts them; the host time per pass is the stack's,
    ``ServeRuntime.host_step_ms``); ``moe_imbalance`` is the busiest device's expert rows
    over the mean (1: perfect balance); ``a2a_sm_fraction`` of the SMs run the prefill
    all-to-all while it overlaps compute (20 of an H800's 132 saturate IB and NVLink: DeepSeek-V3
    report, sec. 3.2.2; DeepEP's low-latency decode kernels occupy none).
    """

    hbm_efficiency: float = 0.90
    decode_attention_efficiency: float = 0.59
    prefill_attention_efficiency: float | None = None
    gemm_efficiency: float = 0.80
    kernel_gap_us: float = 2.0
    moe_imbalance: float = 1.0
    a2a_sm_fraction: float = 20 / 132
    workspace_gib: float = 2.0  # activations, CUDA graphs, communication buffers

    def __post_init__(self) -> None:
        if not 0 < self.decode_attention_efficiency <= 2:
            raise SpecError("decode_attention_efficiency", self.decode_attention_efficiency,
                            "valid: (0, 2]")
        for name in ("hbm_efficiency", "prefill_attention_efficiency", "gemm_efficiency"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise SpecError(name, value, "valid: (0, 1]")
        if self.moe_imbalance < 1:
            raise SpecError("moe_imbalance", self.moe_imbalance, "valid: >= 1")
        if not 0 <= self.a2a_sm_fraction < 1:
            raise SpecError("a2a_sm_fraction", self.a2a_sm_fraction, "valid: [0, 1)")
        for name in ("kernel_gap_us", "workspace_gib"):
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
        return max(self.seconds, key=lambda category: self.seconds[category])

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
    """The device, wires and kernels as the serving model uses them."""

    peak_16: float
    gemm_peak: float  # the weights' dtype's dense peak x the kernels' efficiency, FLOP/s
    gemm_peak_16: float  # the same for 16-bit GEMMs (embedding head, router)
    gemm_act_bytes: float  # bytes per activation element a GEMM reads (8-bit GEMMs quantize)
    kernels: GemmKernels
    moe_kernels: GemmKernels  # the routed experts' grouped GEMMs
    moe_gemm_peak: float
    hbm_raw: float  # nominal HBM bytes/s
    hbm_bw: float  # achieved by KV-cache and elementwise kernels
    hbm_bytes: float
    reserved_bytes: float
    net: Network
    devices_per_node: int
    nodes_per_rack: int
    prefill_attn_eff: float
    gqa_kv_reuse: bool


def _hw(cluster: ClusterSpec, plan: ServePlan, eff: ServeEfficiency) -> _Hw:
    curve = curve_for(cluster)
    dev = cluster.device
    kernels = GEMM_KERNELS[plan.runtime.gemm_kernels]
    eight_bit = plan.weight_dtype in ("fp8", "fp4")
    # 4-bit weights on a device with FP4 tensor cores (Blackwell: NVFP4, activations quantized
    # to 4 bits too) run at its FP4 peak; elsewhere (Hopper has none) they are widened to FP8
    # in the GEMM (W4A8), at the FP8 peak. The kernel class's share of the peak is the same.
    native_fp4 = plan.weight_dtype == "fp4" and "fp4" in dev.peak_tflops
    moe_kernels = GEMM_KERNELS[plan.runtime.moe_gemm_kernels or plan.runtime.gemm_kernels]
    peak_8 = dev.peak_flops("fp4" if native_fp4 else "fp8")
    peak_16 = dev.peak_flops("bf16") * eff.gemm_efficiency
    gemm_peak = peak_8 * kernels.fp8_efficiency if eight_bit else peak_16
    hbm = dev.hbm_gbytes_per_s * 1e9
    return _Hw(
        peak_16=dev.peak_flops("bf16"), gemm_peak=gemm_peak,
        gemm_peak_16=peak_16,
        gemm_act_bytes=(DTYPE_BYTES["fp4"] if native_fp4 else 1.0) if eight_bit else 2.0,
        kernels=kernels, moe_kernels=moe_kernels,
        moe_gemm_peak=peak_8 * moe_kernels.fp8_efficiency if eight_bit else peak_16,
        hbm_raw=hbm,
        hbm_bw=hbm * eff.hbm_efficiency, hbm_bytes=dev.hbm_gib * GIB,
        reserved_bytes=curve.reserved_gib * GIB,
        net=Network.of(cluster, curve.collective_library),
        devices_per_node=cluster.devices_per_node, nodes_per_rack=cluster.rack_nodes,
        prefill_attn_eff=(eff.prefill_attention_efficiency
                          if eff.prefill_attention_efficiency is not None
                          else curve.flash_attention_efficiency),
        gqa_kv_reuse=plan.runtime.gqa_kv_reuse,
    )


def _span(hw: _Hw, size: int) -> GroupSpan:
    per_node = min(size, hw.devices_per_node)
    nodes = math.ceil(size / per_node)
    return GroupSpan(size, per_node, nodes, math.ceil(nodes / hw.nodes_per_rack))


def _gemm(cost: PassCost, hw: _Hw, rows: float, params: float, weight_bytes: float, *,
          pieces: int = 1, groups: float = 1.0, experts: bool = False) -> None:
    """``rows`` token rows through a ``params``-weight linear map made of ``pieces`` square
    GEMMs of equal size (``groups`` of them side by side in one grouped GEMM, as an MoE
    layer's experts: ``rows`` and ``params`` are then per group), booked under compute or HBM
    weights by its bound (``gemm_seconds``); ``experts``: the routed experts' kernel class."""
    if rows <= 0 or params <= 0:
        return
    side = math.sqrt(params / pieces)
    eight_bit = weight_bytes < 2
    kernels = hw.moe_kernels if experts else hw.kernels
    peak = (hw.moe_gemm_peak if experts else hw.gemm_peak) if eight_bit else hw.gemm_peak_16
    seconds, num_bytes, bound = gemm_seconds(
        kernels, peak, hw.hbm_raw, rows=rows,
        n=side, k=side, weight_bytes=weight_bytes,
        act_bytes=hw.gemm_act_bytes if eight_bit else 2.0, groups=groups)
    cost.add("compute" if bound else "hbm_weights", seconds, pieces)
    cost.flops += 2.0 * rows * params * groups
    cost.hbm_bytes += num_bytes * pieces


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
    return model.num_layers * 2 * per_device * model.head_size * b


def weight_bytes_per_device(model: ModelSpec, layout: InstanceLayout, plan: ServePlan) -> float:
    """Weights on one device: attention, dense MLPs and shared experts split over ``tp``,
    routed experts over ``ep`` groups (each split ``expert_tp`` ways), 16-bit embedding and
    output head over ``tp``; each layer's attention and MLP in the bytes per weight the plan
    gives them (``ServePlan.weight_bytes``)."""
    t = layout.tp
    total = model.vocab_size * model.hidden_size * 2.0 / t
    if not model.tie_word_embeddings:
        total *= 2
    attn = attention_params(model) / t
    for i in range(model.num_layers):
        total += attn * plan.weight_bytes("attention", i, model.num_layers)
        wb = plan.weight_bytes("mlp", i, model.num_layers)
        if model.is_moe_layer(i):
            moe = model.moe
            assert moe is not None  # an MoE layer implies the MoE spec
            expert = mlp_params(model, moe.expert_intermediate_size)
            local = (moe.num_experts + layout.num_redundant_experts) / layout.ep
            total += local * expert * wb / layout.expert_tp
            if moe.num_shared_experts:
                total += mlp_params(model, moe.shared_width) * wb / t
            total += model.hidden_size * moe.num_experts * 2.0
        else:
            total += mlp_params(model, model.ffn_size) * wb / t
    return total


def _attention_dims(model: ModelSpec, decode: bool) -> tuple[int, int]:
    """(d_qk, d_v) per head of the attention core; MLA decode runs on the absorbed latent."""
    if model.mla is not None:
        m = model.mla
        if decode:
            return m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return model.head_size, model.head_size


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


# A decoder layer as the pass prices it: (MoE layer, attention bytes per weight, MLP bytes
# per weight).
_LayerKind = tuple[bool, float, float]


def layer_kind(model: ModelSpec, plan: ServePlan, index: int, *,
               moe: bool | None = None) -> _LayerKind:
    """Decoder layer ``index`` as the pass prices it (``moe`` overrides whether it is an MoE
    layer: an MTP module is one when the model has experts)."""
    moe_layer = model.is_moe_layer(index) if moe is None else moe
    return (moe_layer, plan.weight_bytes("attention", index, model.num_layers),
            plan.weight_bytes("mlp", index, model.num_layers))


def layer_kinds(model: ModelSpec, plan: ServePlan) -> dict[_LayerKind, int]:
    """How many decoder layers of each kind the model has under ``plan``'s precisions."""
    kinds: dict[_LayerKind, int] = {}
    for i in range(model.num_layers):
        kind = layer_kind(model, plan, i)
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def _layer(model: ModelSpec, layout: InstanceLayout, plan: ServePlan, hw: _Hw,
           eff: ServeEfficiency, shape: PassShape, kind: _LayerKind) -> tuple[PassCost, float]:
    """(compute-stream cost of one layer, its all-to-all seconds) on one device."""
    cost = PassCost()
    t, d, rows = layout.tp, layout.dp_attention, shape.rows
    moe_layer, attn_wb, wb = kind
    h, heads = model.hidden_size, model.num_attention_heads / t
    _gemm(cost, hw, rows, attention_params(model) / t, attn_wb, pieces=2)
    # Attention core: decode (latent/KV streaming) and prefill (FlashAttention).
    kv_layer = kv_bytes_per_token(model, layout, plan.kv_dtype) / model.num_layers
    if shape.decode_rows:
        dqk, dv = _attention_dims(model, decode=True)
        flops = 2.0 * shape.decode_rows * shape.context * heads * (dqk + dv)
        num_bytes = shape.decode_seqs * shape.context * kv_layer
        if not hw.gqa_kv_reuse and model.mla is None:
            # Masked MHA: each query head's thread block streams its KV head's cache.
            num_bytes *= heads / math.ceil(model.kv_heads / t)
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
        assert moe is not None  # an MoE layer implies the MoE spec
        expert = mlp_params(model, moe.expert_intermediate_size)
        tokens = d * rows  # distinct tokens in the instance
        imbalance = plan.moe_imbalance if plan.moe_imbalance is not None else eff.moe_imbalance
        dev_rows = tokens * moe.top_k / layout.ep * imbalance
        local = (moe.num_experts + layout.num_redundant_experts) / layout.ep
        active = 1.0 - (1.0 - moe.top_k / moe.num_experts) ** tokens
        # The busiest device runs each of its ``local x active`` receiving experts' three
        # GEMMs on its share of the rows.
        num_active = local * active
        _gemm(cost, hw, dev_rows / max(num_active, 1e-9), expert / layout.expert_tp, wb,
              pieces=3, groups=num_active, experts=True)
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
        _gemm(cost, hw, rows, mlp_params(model, model.ffn_size) / t, wb, pieces=3)
    # Memory-bound kernels on the activations (16-bit): two norms (read + write h), two
    # residual adds (read 2h, write h), the attention and MLP intermediates written and read
    # back once, and for MoE the permute / un-permute of the k copies and their weighted sum.
    attn_dim = (heads * sum(_attention_dims(model, decode=False))
                + 2 * math.ceil(model.kv_heads / t) * model.head_size)
    if moe_layer:
        moe = model.moe
        assert moe is not None  # an MoE layer implies the MoE spec
        width = (moe.top_k * moe.expert_intermediate_size / layout.expert_tp
                 + moe.shared_width / t)
        extra = 6 * moe.top_k * h * (d / layout.ep if d > 1 else 1.0)
    else:
        width, extra = model.ffn_size / t, 0.0
    act_bytes = rows * 2.0 * (10 * h + 2 * attn_dim + 6 * width + extra)
    cost.add("hbm_activations", act_bytes / hw.hbm_bw)
    cost.hbm_bytes += act_bytes
    if t > 1:
        reduces = 1 if (moe_layer and d > 1) else 2
        cost.add("tp_collectives", hw.net.all_reduce_s(_span(hw, t), rows * h * 2.0), reduces)
    cost.add("overhead", kernels_per_layer(model, moe_layer) * eff.kernel_gap_us * 1e-6)
    return cost, a2a


def kernels_per_layer(model: ModelSpec, moe_layer: bool) -> int:
    """Kernels one decoder layer launches, by its parts: GQA attention 6 (norm, QKV GEMM,
    RoPE and cache write, attention, output GEMM, residual); MLA 12 (norm, q_a GEMM, q norm,
    q_b GEMM, kv_a GEMM, kv norm, RoPE and cache write, the absorbed W_UK product, attention,
    the W_UV product, output GEMM, residual); dense MLP 6 (norm, gate-up GEMM, activation,
    down GEMM, residual, quantize); MoE 14 (norm, router GEMM, top-k, dispatch send and
    receive, two grouped GEMMs, activation, combine send and receive, three shared-expert
    kernels, residual)."""
    return (12 if model.mla is not None else 6) + (14 if moe_layer else 6)


def pass_cost(model: ModelSpec, cluster: ClusterSpec, plan: ServePlan, layout: InstanceLayout,
              shape: PassShape, eff: ServeEfficiency = ServeEfficiency()) -> PassCost:
    """Seconds of one forward pass of ``shape`` (per attention group) on ``layout``."""
    hw = _hw(cluster, plan, eff)
    halves = 2 if (plan.two_batch_overlap and layout.dp_attention > 1 and model.is_moe) else 1
    part = shape.halved() if halves == 2 else shape
    total = PassCost()
    for kind, count in layer_kinds(model, plan).items():
        layer, a2a = _layer(model, layout, plan, hw, eff, part, kind)
        if halves == 2:  # the other half's compute hides each half's all-to-all
            exposed = max(0.0, a2a - layer.total_s)
            # Prefill's dispatch and combine kernels (DeepEP's normal ones) run on SMs, so the
            # compute they overlap runs on the rest; decode's low-latency kernels use none.
            share = eff.a2a_sm_fraction if shape.prefill_rows else 0.0
            slowed = min(a2a, layer.total_s) * share / (1.0 - share)
            layer = layer.scaled(2.0)
            layer.add("all_to_all", 2 * (exposed + slowed))
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
        # An MTP module is quantized as the inner layers are.
        layer, a2a = _layer(model, layout, plan, hw, eff, draft,
                            layer_kind(model, plan, model.num_layers // 2, moe=model.is_moe))
        layer.add("all_to_all", a2a)
        total = total.merged(layer.scaled(plan.speculative.num_draft_tokens))
    total.add("overhead", plan.runtime.host_step_ms * 1e-3)
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
    """Tokens of KV cache one attention group can hold (0 when the weights do not fit): what
    the weights, the reserve and the activations (``plan.profile_tokens`` x
    ``activation_bytes_per_token``, else the runtime's workspace) leave, by
    ``plan.kv_mem_basis``."""
    hbm = cluster.device.hbm_gib * GIB
    workspace = (plan.profile_tokens * activation_bytes_per_token(model, layout)
                 if plan.profile_tokens else eff.workspace_gib * GIB)
    used = (weight_bytes_per_device(model, layout, plan) + curve_for(cluster).reserved_gib * GIB
            + workspace)
    if used >= hbm:
        return 0.0
    kv = (hbm * plan.kv_mem_fraction - used if plan.kv_mem_basis == "total"
          else (hbm - used) * plan.kv_mem_fraction)
    return max(0.0, kv) / kv_bytes_per_token(model, layout, plan.kv_dtype)


def activation_bytes_per_token(model: ModelSpec, layout: InstanceLayout) -> float:
    """Peak 16-bit activation bytes per token of one forward pass on one device, at the MLP:
    the residual stream and the normed input (2 x hidden) beside the gate-up output and the
    activation's output (3 x the MLP's width on the device; for MoE layers the routed
    experts' k copies plus the shared experts)."""
    widths = [model.ffn_size / layout.tp] if model.num_layers > model.num_moe_layers else []
    if model.moe is not None:
        moe = model.moe
        widths.append(moe.top_k * moe.expert_intermediate_size / layout.expert_tp
                      + moe.shared_width / layout.tp)
    return 2.0 * (2 * model.hidden_size + 3 * max(widths))
