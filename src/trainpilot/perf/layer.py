"""One decoder layer on one rank, per micro-batch: seconds by part and activation bytes.

Time is built op by op. Every GEMM costs ``Device.gemm_s`` (size-dependent efficiency, roofline
against HBM traffic); every memory-bound kernel (norms, residual adds, activation functions,
softmax, dropout, RoPE, permutes) costs its bytes over achieved HBM bandwidth; every kernel takes
at least the host's per-kernel issue time. The backward of a GEMM is two GEMMs of the same size
(data and weight gradients); the backward of a memory-bound kernel moves 1.5x its forward bytes
(reads the saved input and the incoming gradient, writes one gradient). FlashAttention's
backward does 2.5x its forward FLOPs (five matmuls against two).

Activation bytes follow Korthikanti et al. 2022 (16-bit activations, 1-byte dropout masks),
generalised to GQA, MLA, SwiGLU and MoE by the actual tensor shapes:

* kept whole on every TP rank (divided by tp under sequence parallelism): the two norm inputs,
  the QKV and fc1 inputs (4 x 2 bytes x tokens x h) and two dropout masks (2 x 1 byte);
* divided by tp: Q, K, V and the output-projection input; the activation-function input and
  the fc2 input (for GPT's 4h GELU MLP these give Korthikanti's 24/t);
* attention scores without FlashAttention: softmax output (2), dropout mask (1) and output (2)
  bytes per score, ``5 a s^2 b / t``;
* selective recompute drops the scores; full recompute keeps only the layer input, ``2sbh``
  (``/t`` with sequence parallelism);
* under fp8 the saved inputs of the GEMMs (QKV, output projection, fc1, fc2, the permuted
  expert inputs, MLA's latents) are kept as their 1-byte quantized copies, as Transformer
  Engine does and DeepSeek-V3 reports (sec. 3.3.3); norm inputs, attention inputs (Q, K, V)
  and activation-function inputs stay 16-bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from trainpilot.perf.hardware import Device
from trainpilot.perf.runtime import Runtime
from trainpilot.perf.topology import GroupSpan, Network
from trainpilot.specs import ModelSpec

ACT_BYTES = 2  # 16-bit activations (bf16/fp16; fp8 GEMM inputs are transient)
BWD_MEM = 1.5  # backward bytes / forward bytes of a memory-bound kernel
FLASH_BWD = 2.5  # FlashAttention backward FLOPs / forward FLOPs
CAUSAL = 0.5  # share of the score square a causal FlashAttention kernel computes


@dataclass(frozen=True, kw_only=True)
class LayerSetup:
    """Everything one layer's cost depends on, besides the model and the hardware."""

    tp: int
    cp: int
    ep: int
    micro_batch_size: int
    seq_len: int
    sequence_parallel: bool
    flash_attention: bool
    dropout: bool
    ep_imbalance: float = 1.0
    gemm_input_bytes: float = ACT_BYTES  # bytes per saved GEMM input element (1 under fp8)
    etp: int = 0  # expert tensor parallel size (0: tp)
    rt: Runtime = Runtime()
    # Keys a query attends to, averaged over the model's layers, over the causal half of the
    # sequence (1.0 without sliding windows): scales the attention core.
    window_factor: float = 1.0
    num_micro_batches: int = 1  # in flight per stage: >= 2 lets EP overlap pair micro-batches

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Seconds per micro-batch for one layer on one rank, by part, and its activation bytes
    under each recompute mode.

    TP parts include MoE expert-TP gathers; CP parts are the ring-attention transfers not hidden
    behind attention; EP parts are the dispatch + combine all-to-alls. ``attn_core_s`` is the
    attention core (what selective recompute re-runs); full recompute re-runs the whole forward
    with its TP and EP communication."""

    fwd_compute_s: float
    bwd_compute_s: float
    attn_core_s: float
    tp_fwd_s: float
    tp_bwd_s: float
    ep_fwd_s: float
    ep_bwd_s: float
    cp_fwd_s: float
    cp_bwd_s: float
    act_none_bytes: float  # everything the backward needs
    act_selective_bytes: float  # without the attention scores
    act_input_bytes: float  # the layer input only (full recompute)
    act_op_bytes: float  # what torchtitan's per-op selective checkpointing saves
    num_kernels: int
    wgrad_s: float = 0.0  # weight-gradient GEMMs inside bwd_compute_s (zero-bubble's W)
    op_recompute_s: float = 0.0  # what torchtitan's per-op selective checkpointing re-runs
    op_recompute_tp_s: float = 0.0  # ... and the TP collectives outside its save list

    def act_bytes(self, recompute: str) -> float:
        """Bytes kept per in-flight micro-batch under ``recompute``."""
        if recompute == "full":
            return self.act_input_bytes
        if recompute == "op":
            return self.act_op_bytes
        return self.act_selective_bytes if recompute == "selective" else self.act_none_bytes

    def recompute_s(self, recompute: str) -> tuple[float, float, float]:
        """(compute, TP, EP) seconds re-run before the backward under ``recompute``."""
        if recompute == "full":
            return self.fwd_compute_s, self.tp_fwd_s, self.ep_fwd_s
        if recompute == "selective":
            return self.attn_core_s, 0.0, 0.0
        if recompute == "op":
            return self.op_recompute_s, self.op_recompute_tp_s, self.ep_fwd_s
        return 0.0, 0.0, 0.0

    @property
    def fwd_s(self) -> float:
        return self.fwd_compute_s + self.tp_fwd_s + self.ep_fwd_s + self.cp_fwd_s

    def bwd_s(self, recompute: str) -> float:
        """Backward including recomputation and its communication."""
        return (self.bwd_compute_s + self.tp_bwd_s + self.ep_bwd_s + self.cp_bwd_s
                + sum(self.recompute_s(recompute)))


class Ops:
    """Accumulates the kernels of one pass over a layer as the host issues them and the GPU
    runs them. The host issues asynchronously, ahead of the GPU, so a run of kernels takes
    max(their GPU time, the host's time to issue them); a host synchronization (``sync``: the
    host waits on a device-to-host copy, as a dropless MoE layer's token counts) ends a run,
    since the host cannot issue past it and the GPU idles while the host issues what follows,
    so the runs on either side of it add."""

    def __init__(self, host_s: float):
        self.host_s = host_s
        self.gpu = 0.0  # GPU seconds of the open run
        self.host = 0.0  # host issue seconds of the open run
        self.closed = 0.0  # seconds of the runs ended by a sync
        self.kernels = 0
        self.syncs = 0
        self.graphed = False  # inside a captured CUDA graph: kernels cost no issue time
        self.gemm = 0.0  # GEMM seconds (what TP overlap hides collectives behind)
        self.wgrad = 0.0  # weight-gradient GEMM seconds (backward only)

    @property
    def total(self) -> float:
        return self.closed + max(self.gpu, self.host)

    def add(self, gpu_s: float, kernels: int = 1) -> float:
        """``kernels`` kernels taking ``gpu_s`` on the GPU; returns ``gpu_s``."""
        self.gpu += gpu_s
        if not self.graphed:
            self.host += kernels * self.host_s
        self.kernels += kernels
        return gpu_s

    @contextmanager
    def graph(self, on: bool) -> Iterator[None]:
        """Kernels added inside run as one replayed CUDA graph when ``on``: the host issues
        the graph (one launch), not its kernels."""
        if not on or self.graphed:
            yield
            return
        self.host += self.host_s
        self.graphed = True
        try:
            yield
        finally:
            self.graphed = False

    def sync(self) -> None:
        """The host waits for the GPU here (a device-to-host copy it needs)."""
        self.closed += max(self.gpu, self.host)
        self.gpu = self.host = 0.0
        self.syncs += 1

    def absorb(self, other: Ops) -> None:
        """Append ``other``'s kernels (issued by the same host, no sync among them)."""
        assert not other.syncs, "absorb a run without syncs"
        self.gpu += other.gpu
        self.host += other.host
        self.kernels += other.kernels
        self.gemm += other.gemm
        self.wgrad += other.wgrad

    def add_gemm(self, gpu_s: float, *, backward: bool = False, launches: int = 1) -> float:
        """A GEMM (forward) or its data- and weight-gradient GEMMs (``backward``: two
        kernels of ``gpu_s`` each); ``launches``: kernels it is issued as (one per expert
        when a rank's experts run one by one), sharing ``gpu_s``."""
        t = self.add(2 * gpu_s, 2 * launches) if backward else self.add(gpu_s, launches)
        self.gemm += t
        if backward:
            self.wgrad += t / 2
        return t

    def add_elementwise(self, gpu_s: float, kind: str, rt: Runtime, backward: bool = False
                        ) -> float:
        """A norm / activation / RoPE kernel: fused, one kernel moving its bytes once;
        unfused (eager PyTorch), the chain of kernels the framework issues, moving
        ``rt.traffic(kind)`` times the bytes (``perf/runtime.py``)."""
        kernels = rt.kernels(kind) * (2 if backward else 1)
        return self.add(gpu_s * rt.traffic(kind), kernels)


def _attention_gemms(model: ModelSpec, tp: int) -> list[tuple[float, float]]:
    """(n, k) of each attention projection GEMM per token row on one TP rank."""
    h, a = model.hidden_size, model.num_attention_heads
    if model.mla is not None:
        m = model.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = [(m.q_lora_rank, h), (a * qk / tp, m.q_lora_rank)] if m.q_lora_rank else \
            [(a * qk / tp, h)]
        kv_gemms = [(m.kv_lora_rank + m.qk_rope_head_dim, h),
                    (a * (m.qk_nope_head_dim + m.v_head_dim) / tp, m.kv_lora_rank)]
        return q + kv_gemms + [(h, a * m.v_head_dim / tp)]
    d, kv = model.head_size, model.kv_heads
    return [((a + 2 * kv) * d / tp, h), (h, a * d / tp)]


def weight_tensors(model: ModelSpec) -> int:
    """Weight matrices of one dense decoder layer as the cost model counts its GEMMs: the
    attention projections and the MLP's two (gate and up fused into one FC1, as Megatron
    stores them)."""
    return len(_attention_gemms(model, 1)) + 2


def op_sac_linears(model: ModelSpec, moe_layer: bool, tp: int) -> list[tuple[float, float]]:
    """(n, k) per token row of each ``aten.mm`` one layer's forward runs on one TP rank, in
    torchtitan's order (wq, wk, wv, wo or MLA's projections; the MLP's w1, w3, w2, or an MoE
    layer's shared experts; the routed experts run as grouped GEMMs, not ``mm``)."""
    if model.mla is not None:
        out = list(_attention_gemms(model, tp))
    else:
        h, a, d, kv = model.hidden_size, model.num_attention_heads, model.head_size, \
            model.kv_heads
        out = [(a * d / tp, h), (kv * d / tp, h), (kv * d / tp, h), (h, a * d / tp)]
    if moe_layer:
        assert model.moe is not None  # an MoE layer implies the MoE spec
        width = model.moe.shared_width
    else:
        width = model.ffn_size
    if width:
        h = model.hidden_size
        ins = [(width / tp, h)] * (2 if model.activation == "swiglu" else 1)
        out += ins + [(h, width / tp)]
    return out


def graphed(on: bool, *ops: Ops) -> ExitStack:
    """Run the kernels added inside as CUDA graphs in each of ``ops`` when ``on``."""
    stack = ExitStack()
    for o in ops:
        stack.enter_context(o.graph(on))
    return stack


def op_sac_split(model: ModelSpec, moe_layer: bool, tp: int
                 ) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(saved, re-run) linears of ``op_sac_linears`` by torchtitan's rule: the outputs of the
    odd ``mm`` of a layer are saved, every second one is recomputed."""
    linears = op_sac_linears(model, moe_layer, tp)
    return linears[0::2], linears[1::2]


def _op_sac_recompute(model: ModelSpec, moe_layer: bool, st: LayerSetup, dev: Device,
                      host: float, m: float, elementwise_s: float, routed_s: float) -> float:
    """Seconds torchtitan's per-op selective activation checkpointing re-runs before a layer's
    backward: its policy saves the outputs of ``aten.mm``, the attention kernels, reduce-
    scatters and ``max`` except every second ``mm`` of the layer; every other op is
    recomputed: the elementwise kernels (norms, RoPE, activation, residuals, casts, the
    router), every second 16-bit linear, and ops outside the list: the routed experts'
    grouped GEMMs and, under fp8, every linear (``aten._scaled_mm``)."""
    saved, rerun = op_sac_split(model, moe_layer, st.tp)
    ops = Ops(host)
    for n, k in (saved + rerun if dev.fp8 else rerun):
        ops.add_gemm(dev.gemm_s(m, n, k, linear=True))
    return ops.total + elementwise_s + routed_s


def _head_dims(model: ModelSpec) -> tuple[int, int, int]:
    """(query-key dim, value dim, key-value heads) of the attention core."""
    if model.mla is not None:
        m = model.mla
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, model.num_attention_heads
    d = model.head_size
    return d, d, model.kv_heads


def fp8_linear_extras(dev: Device, rt: Runtime, fwd: Ops, bwd: Ops, m: float, n: float,
                      k: float, *, count: float = 1.0, launches: int = 1) -> None:
    """What an FP8 linear layer of ``count`` GEMMs of (m x k) @ (k x n) costs beyond its GEMMs
    and input casts: its weight's quantization when the stack casts weights in every pass
    (``Runtime.weight_cast_per_pass``; charged to the forward) and the rescale of the
    backward's two outputs (m x k, n x k) under row-wise scaling; ``launches`` kernels each."""
    if not dev.fp8:
        return
    if rt.weight_cast_per_pass:
        seconds, kernels = dev.fp8_weight_cast(count * n * k, rt.fp8_recipe,
                                               gathered=rt.fp8_param_gather)
        fwd.add(seconds, launches * kernels)
    seconds, kernels = dev.fp8_rescale(count * (m + n) * k, rt.fp8_recipe)
    if kernels:
        bwd.add(seconds, 2 * launches * kernels)


def layer_cost(model: ModelSpec, moe_layer: bool, setup: LayerSetup, dev: Device,
               net: Network, spans: dict[str, GroupSpan]) -> LayerCost:
    """Cost of one decoder layer (dense or MoE) for ``setup`` on ``dev``/``net``, with the
    numbers every recompute mode needs."""
    from trainpilot.perf.mlp import mlp_cost

    st, rt = setup, setup.rt
    t, b = st.tp, st.micro_batch_size
    s_loc = st.seq_len / st.cp
    m = b * s_loc  # token rows on this rank
    m_sp = m / t if st.sequence_parallel else m  # rows of norms / residuals under SP
    h, a = model.hidden_size, model.num_attention_heads
    qk, vd, kvh = _head_dims(model)
    a_t, kv_t = a / t, kvh / t
    # Ops on tensor-parallel (DTensor) tensors pay the sharding dispatch on the host too.
    host = dev.host_s + (dev.host_sharded_s if t > 1 else 0.0)
    fwd, bwd = Ops(host), Ops(host)

    # Attention projections, core, input norm, residual and RoPE: Megatron's "attn" CUDA-graph
    # scope.
    core = Ops(host)
    core.graphed = rt.graphed("attn")  # replayed inside the attention block's graph
    with graphed(rt.graphed("attn"), fwd, bwd):
        for i, (n, k) in enumerate(_attention_gemms(model, t)):
            fwd.add_gemm(dev.gemm_s(m, n, k, linear=True))
            bwd.add_gemm(dev.gemm_s(m, n, k, linear=True), backward=True)
            if dev.fp8:  # quantize the input (forward) and the output's gradient (backward)
                # The QKV projection's input is the norm's output (TE's LayerNormLinear; MLA's
                # down-projections follow a separate norm module).
                fed = i == 0 and model.mla is None and rt.norm_amax_fused
                fwd.add(dev.fp8_cast_s(m * k, rt.fp8_recipe, norm_fed=fed),
                        dev.fp8_cast_kernels(rt.fp8_recipe, norm_fed=fed))
                casts = dev.fp8_cast_kernels(rt.fp8_recipe)
                bwd.add(dev.fp8_cast_s(m * n, rt.fp8_recipe), casts)
                fp8_linear_extras(dev, rt, fwd, bwd, m, n, k)

        # Attention core (sliding windows: fewer keys per query, ``window_factor``).
        if st.flash_attention:
            flops = 2.0 * b * a_t * s_loc * st.seq_len * (qk + vd) * CAUSAL * st.window_factor
            core.add(dev.attention_s(flops, rt.attention_kernel))
            bwd.add(dev.attention_s(FLASH_BWD * flops, rt.attention_kernel))
        else:
            batch = b * a_t
            keys = st.seq_len * min(1.0, st.window_factor * 2) if st.window_factor < 1 \
                else st.seq_len
            scores = batch * s_loc * keys
            core.add(dev.gemm_s(s_loc, keys, qk, batch=batch))  # QK^T
            core.add(dev.memory_s(2 * ACT_BYTES * scores))  # fused scale-mask-softmax
            if st.dropout:
                core.add(dev.memory_s((2 * ACT_BYTES + 1) * scores))
            core.add(dev.gemm_s(s_loc, vd, keys, batch=batch))  # AV
            core.add(dev.memory_s(2 * ACT_BYTES * m * a_t * vd))  # context permute to [s, b, h]
            bwd.add(2 * dev.gemm_s(s_loc, keys, qk, batch=batch), 2)
            bwd.add(2 * dev.gemm_s(s_loc, vd, keys, batch=batch), 2)
            bwd.add(BWD_MEM * dev.memory_s(2 * ACT_BYTES * scores) * (2.25 if st.dropout else 1),
                    2)
            bwd.add(BWD_MEM * dev.memory_s(2 * ACT_BYTES * m * a_t * vd))
        fwd.absorb(core)

    # Memory-bound kernels around the GEMMs: 2 norms, 2 residual adds (+dropout), RoPE. The
    # first norm and residual belong to the attention block, the second to the MLP (the MoE
    # router's graph scope).
    norm = ACT_BYTES * 2 * m_sp * h
    resid = (ACT_BYTES * 3 + (1 if st.dropout else 0)) * m_sp * h
    for scope in ("attn", "moe_router" if moe_layer else "mlp"):
        with graphed(rt.graphed(scope), fwd, bwd):
            fwd.add_elementwise(dev.memory_s(norm), model.norm, rt)
            bwd.add_elementwise(BWD_MEM * dev.memory_s(norm), model.norm, rt, backward=True)
            fwd.add(dev.memory_s(resid))
            bwd.add(BWD_MEM * dev.memory_s(resid))
    if model.position_embedding == "rope":
        rope = ACT_BYTES * 2 * m * (a_t + kv_t) * (qk if model.mla is None else
                                                    model.mla.qk_rope_head_dim)
        with graphed(rt.graphed("attn"), fwd, bwd):
            fwd.add_elementwise(dev.memory_s(rope), "rope", rt)
            bwd.add_elementwise(BWD_MEM * dev.memory_s(rope), "rope", rt, backward=True)

    # Feed-forward block (dense MLP, or router, experts and their communication).
    mlp = mlp_cost(model, moe_layer, st, dev, net, spans, m, fwd, bwd)

    # Tensor-parallel collectives: 2 per block pass (all-reduce, or all-gather + reduce-scatter
    # under sequence parallelism), the same in the backward. With TP overlap (Megatron's
    # --tp-comm-overlap) each is pipelined with its GEMM in tp chunks: only what the GEMMs
    # cannot cover, and at least the first chunk, is exposed, and the covered GEMMs slow down.
    tp_fwd = tp_bwd = 0.0
    if t > 1:
        msg = ACT_BYTES * m * h
        span = spans["tp"]
        if st.sequence_parallel:
            one = net.all_gather_s(span, msg) + net.reduce_scatter_s(span, msg)
            kernels = 2
        else:
            one = net.all_reduce_s(span, msg)
            kernels = 1
        one = max(one, kernels * dev.host_coll_s)
        tp_fwd = tp_bwd = 2 * one
        if rt.tp_overlap:
            tp_fwd = _overlapped(tp_fwd, fwd.gemm, t, dev.curve.overlap_slowdown)
            tp_bwd = _overlapped(tp_bwd, bwd.gemm - bwd.wgrad, t, dev.curve.overlap_slowdown)
    tp_fwd += mlp.tp_fwd_s
    tp_bwd += mlp.tp_fwd_s

    # Context parallelism: ring exchange of K and V, hidden behind each attention chunk.
    cp_fwd = cp_bwd = 0.0
    if st.cp > 1:
        step = net.p2p_s(spans["cp"], ACT_BYTES * b * s_loc * kv_t * (qk + vd))
        chunk = core.total / st.cp
        cp_fwd = (st.cp - 1) * max(0.0, step - chunk)
        cp_bwd = (st.cp - 1) * max(0.0, 2 * step - FLASH_BWD * chunk)  # K, V and dK, dV

    # Expert all-to-alls, overlapped with the other micro-batch's compute when the runtime
    # pairs micro-batches (Megatron's --overlap-moe-expert-parallel-comm, DualPipe).
    ep_fwd = ep_bwd = mlp.ep_fwd_s
    if rt.ep_overlap and mlp.ep_fwd_s and st.num_micro_batches >= 2:
        both = _overlapped(2 * mlp.ep_fwd_s, fwd.total + bwd.total, 1,
                           dev.curve.overlap_slowdown)
        ep_fwd = ep_bwd = both / 2

    act_none, act_sel, act_input, act_op = _activation_bytes(model, moe_layer, st, m, m_sp,
                                                             s_loc)
    op_recompute = _op_sac_recompute(model, moe_layer, st, dev, host, m,
                                     max(0.0, fwd.total - fwd.gemm - core.total),
                                     mlp.routed_gemm_s)
    # Per-op checkpointing keeps reduce-scatter outputs only: under sequence parallelism the
    # two all-gathers (and expert TP's gather) run again, without it both all-reduces; the
    # expert all-to-alls (outside the 2024-25 save list, their routed GEMMs re-run) too.
    dense_tp = tp_fwd - mlp.tp_fwd_s
    op_tp = dense_tp * (0.5 if st.sequence_parallel else 1.0) + 0.5 * mlp.tp_fwd_s
    return LayerCost(
        fwd_compute_s=fwd.total, bwd_compute_s=bwd.total, attn_core_s=core.total,
        tp_fwd_s=tp_fwd, tp_bwd_s=tp_bwd, ep_fwd_s=ep_fwd, ep_bwd_s=ep_bwd,
        cp_fwd_s=cp_fwd, cp_bwd_s=cp_bwd, act_none_bytes=act_none,
        act_selective_bytes=act_sel, act_input_bytes=act_input, act_op_bytes=act_op,
        num_kernels=fwd.kernels + bwd.kernels, wgrad_s=bwd.wgrad, op_recompute_s=op_recompute,
        op_recompute_tp_s=op_tp,
    )


def _overlapped(comm: float, window: float, chunks: int, slowdown: float) -> float:
    """Seconds of ``comm`` left on the critical path when it runs beside ``window`` seconds of
    independent compute split into ``chunks`` pieces (the first piece cannot overlap), plus
    the slowdown of the compute it overlaps (SM and HBM contention)."""
    if comm <= 0:
        return 0.0
    hidden = min(comm * (1 - 1 / chunks) if chunks > 1 else comm, window)
    return comm - hidden + (slowdown - 1.0) * hidden


def activation_bytes(model: ModelSpec, moe_layer: bool, setup: LayerSetup
                     ) -> tuple[float, float, float, float]:
    """(no recompute, selective, full, per-op) bytes one layer keeps per micro-batch."""
    s_loc = setup.seq_len / setup.cp
    m = setup.micro_batch_size * s_loc
    m_sp = m / setup.tp if setup.sequence_parallel else m
    return _activation_bytes(model, moe_layer, setup, m, m_sp, s_loc)


def _activation_bytes(model: ModelSpec, moe_layer: bool, st: LayerSetup, m: float,
                      m_sp: float, s_loc: float) -> tuple[float, float, float, float]:
    """(no recompute, selective, full, per-op) activation bytes of one layer, one
    micro-batch."""
    h, a, t = model.hidden_size, model.num_attention_heads, st.tp
    qk, vd, kvh = _head_dims(model)
    g = st.gemm_input_bytes  # saved GEMM inputs (1 under fp8: the quantized copy is kept)
    masks = 2 * m_sp * h if st.dropout else 0.0
    replicated = (2 * ACT_BYTES + 2 * g) * m_sp * h + masks  # norm inputs; QKV, fc1 inputs
    sharded = (ACT_BYTES * (a * qk + kvh * qk + kvh * vd) + g * a * vd) * m / t
    if model.mla is not None:  # latent inputs of the up-projections, not split by TP
        replicated += g * m * (model.mla.q_lora_rank + model.mla.kv_lora_rank
                               + model.mla.qk_rope_head_dim)
    gate = 2 if model.activation == "swiglu" else 1
    per_width = gate * ACT_BYTES + g  # activation-function input, fc2 input

    if moe_layer:
        moe = model.moe
        assert moe is not None
        pairs = st.expert_tp * (m / t if t > 1 else m) * moe.top_k  # this rank's copies
        sharded += g * pairs * h  # permuted expert inputs
        sharded += pairs * moe.expert_intermediate_size * per_width / st.expert_tp
        if moe.num_shared_experts:
            sharded += m * moe.shared_width * per_width / t
    else:
        sharded += m * model.ffn_size * per_width / t
    b = st.micro_batch_size
    if st.flash_attention:
        scores = 4.0 * b * (a / t) * s_loc  # fp32 log-sum-exp per query row
    else:
        scores = (2 * ACT_BYTES + 1 if st.dropout else ACT_BYTES) * b * (a / t) * s_loc * \
            st.seq_len
    selective = replicated + sharded
    # torchtitan's per-op checkpointing keeps the layer's input, the outputs of the matmuls it
    # saves (the odd ones of the layer; none under fp8, whose ``_scaled_mm`` is outside its
    # save list), the attention output with its log-sum-exp, and under sequence parallelism
    # the two reduce-scatter outputs; everything else is re-run (``_op_sac_recompute``).
    fp8 = g < ACT_BYTES
    op = ACT_BYTES * m_sp * h + ACT_BYTES * m * (a / t) * vd + 4.0 * b * (a / t) * s_loc
    if not fp8:
        op += sum(ACT_BYTES * m * n for n, _ in op_sac_split(model, moe_layer, t)[0])
    if st.sequence_parallel and t > 1:
        op += 2 * ACT_BYTES * m_sp * h
    return selective + scores, selective, ACT_BYTES * m_sp * h, op
