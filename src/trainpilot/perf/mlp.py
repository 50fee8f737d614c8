"""The feed-forward block of one layer on one rank: a dense MLP, or an MoE layer's router,
token permutation, experts and expert communication.

Expert layers (MoE parallel folding, ``placement.py``): a rank routes ``m_r`` token rows (its
sequence-parallel shard, ``m / tp``, when tp > 1), sends ``m_r x top_k`` token copies over its EP
group and receives as many (times the busiest rank's imbalance); with expert tensor parallelism
of size ``etp`` the copies are gathered over the expert-TP group, so each rank computes
``etp x m_r x top_k`` rows on ``width / etp`` slices of its ``experts / ep`` local experts. With
``etp = tp`` (the classic layout) that is ``m x top_k`` rows on ``width / tp``.

Dropless routing (``runtime.moe_capacity_factor`` unset) needs the per-expert token counts on
the host before the experts run: the forward syncs there (``Ops.sync``), and the host's issue
time of the kernels after it adds to the GPU's instead of hiding behind it. With a capacity
factor the expert inputs are padded to it: static shapes, no sync, and every expert computes
the capacity's rows.

Dispatch: NCCL's all-to-all sends each copy to its destination GPU, the ``(n - g)/n`` share off
the node over the NIC. DeepEP (and Megatron's HybridEP; ``runtime.ep_dispatcher = deepep``)
sends a token once per destination *node* over the network and once per destination *GPU* over
NVLink (the receiving GPU holds several experts): for ``top_k`` experts uniform over ``N`` nodes a
token reaches ``(N - 1)(1 - (1 - 1/N)^k)`` other nodes on average, and over NVLink ``D (g - 1)/g``
copies travel, ``D`` the distinct GPUs it reaches (``distinct_reached``). Group-limited routing
(``moe.topk_groups`` of ``moe.num_expert_groups`` groups laid contiguously over the EP ranks)
picks the groups first, so the nodes and GPUs a token reaches follow from the groups it picks:
with several groups per node, the distinct nodes among ``topk_groups`` groups drawn without
replacement; with a group spanning several nodes, the distinct nodes its ``k / topk_groups``
experts land on. Checked against Megatron-Core's measured dispatch and combine times for
DeepSeek-V3's shapes on H100 (``perf/data/ep_dispatch_h100.yaml``; tests/perf/test_comm.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainpilot.perf.hardware import Device
from trainpilot.perf.layer import ACT_BYTES, BWD_MEM, LayerSetup, Ops, fp8_linear_extras, graphed
from trainpilot.perf.topology import GroupSpan, Network
from trainpilot.specs import ModelSpec


@dataclass(frozen=True)
class MlpComm:
    tp_fwd_s: float  # expert-TP gathers and scatters, per forward
    ep_fwd_s: float  # dispatch + combine all-to-all, per forward
    routed_gemm_s: float = 0.0  # the routed experts' forward GEMMs (grouped, per forward)


def expert_rows(model: ModelSpec, st: LayerSetup, m: float) -> float:
    """Token copies one rank's experts process per micro-batch (balanced routing)."""
    assert model.moe is not None
    m_route = m / st.tp if st.tp > 1 else m
    return st.expert_tp * m_route * model.moe.top_k


def distinct_reached(model: ModelSpec, units: int) -> float:
    """Expected distinct units (nodes, or GPUs) of the EP group, laid out as ``units`` equal
    contiguous parts, that one token's ``top_k`` experts fall on (balanced routing).

    Without group limits the experts are uniform: ``U (1 - (1 - 1/U)^k)``. With ``topk_groups``
    of ``G`` groups the token picks its groups first (uniformly, as balanced routing does) and
    spreads its ``k / M`` experts per group inside them: with ``G >= U`` (whole groups per unit)
    the distinct units among ``M`` groups drawn without replacement, ``U (1 - C(G - G/U, M) /
    C(G, M))``; with ``G < U`` (a group spans ``U/G`` units) ``M (U/G)(1 - (1 - G/U)^(k/M))``."""
    moe = model.moe
    assert moe is not None
    k, u = moe.top_k, units
    if u <= 1:
        return 1.0
    groups, picked = moe.num_expert_groups, moe.topk_groups
    if picked is None or groups <= 1 or picked >= groups:
        return u * (1 - (1 - 1 / u) ** k)
    if groups >= u:
        per = groups // u
        miss = math.comb(groups - per, picked) / math.comb(groups, picked)
        return u * (1 - miss)
    span = u / groups
    return picked * span * (1 - (1 - 1 / span) ** (k / picked))


def remote_copies(model: ModelSpec, span: GroupSpan, dispatcher: str) -> float:
    """Token copies a rank sends off its node per routed token, over top_k."""
    moe = model.moe
    assert moe is not None
    n, g, nodes = span.size, span.per_node, span.nodes
    if nodes <= 1:
        return 0.0
    if dispatcher != "deepep":
        return (n - g) / n
    # One copy per other node reached: the token's own node is among the reached ones with
    # probability reach / N (symmetry), so the others number reach (N - 1) / N.
    other = distinct_reached(model, nodes) * (nodes - 1) / nodes
    return min(other, moe.top_k * (n - g) / n) / moe.top_k


def nvlink_copies(model: ModelSpec, span: GroupSpan, dispatcher: str) -> float:
    """Token copies a rank moves over NVLink per routed token, over top_k: NCCL's all-to-all
    the ``(g - 1)/n`` of its copies bound for the node's other GPUs; DeepEP one per distinct
    destination GPU other than the one that holds the token (on its own node, or the GPU that
    received it over the network on a remote one)."""
    moe = model.moe
    assert moe is not None
    n, g = span.size, span.per_node
    if dispatcher != "deepep":
        return (g - 1) / n
    reached = distinct_reached(model, n)
    return min(reached * (g - 1) / g, moe.top_k * (g - 1) / g) / moe.top_k


def mlp_cost(model: ModelSpec, moe_layer: bool, st: LayerSetup, dev: Device, net: Network,
             spans: dict[str, GroupSpan], m: float, fwd: Ops, bwd: Ops) -> MlpComm:
    """Add the block's kernels to ``fwd``/``bwd`` and return its communication."""
    h, rt = model.hidden_size, st.rt
    gate = 2 if model.activation == "swiglu" else 1
    act_kind = "swiglu" if gate == 2 else "gelu"
    act_bytes_per = ACT_BYTES * (3 if gate == 2 else 2)  # read (2 inputs if gated), write

    def dense(rows: float, width: float, tp: int, experts: float = 1.0,
              norm_fed: bool = False) -> float:
        """Add an MLP's kernels; return its forward GEMM seconds. ``norm_fed``: FC1's input
        is a norm's output that carries its amax (a dense MLP under Transformer Engine)."""
        # One launch per GEMM (and per fp8 cast), or per local expert when the stack runs a
        # rank's experts one by one (runtime.expert_gemm; perf/runtime.py).
        n = max(1, round(experts)) if rt.expert_gemm == "per_expert" else 1
        gemms = fwd.add_gemm(experts * dev.gemm_s(rows, gate * width / tp, h, linear=True),
                             launches=n)
        fwd.add_elementwise(experts * dev.memory_s(act_bytes_per * rows * width / tp),
                            act_kind, rt)
        if model.activation_clamp is not None:
            # The clamped GLU (GPT-OSS): each half of FC1's output clamped by its own kernel
            # before the activation, then (Megatron-Core's weighted_bias_quick_geglu_impl) put
            # back together with torch.cat for the fused kernel; backward masks each half's
            # gradient.
            glu = experts * ACT_BYTES * rows * gate * width / tp
            cat = rt.stack == "megatron"
            fwd.add(dev.memory_s((4.0 if cat else 2.0) * glu), 3 if cat else 2)
            bwd.add(dev.memory_s(1.5 * glu), 2)
        gemms += fwd.add_gemm(experts * dev.gemm_s(rows, h, width / tp, linear=True), launches=n)
        bwd.add_gemm(experts * dev.gemm_s(rows, gate * width / tp, h, linear=True),
                     backward=True, launches=n)
        bwd.add_elementwise(BWD_MEM * experts * dev.memory_s(act_bytes_per * rows * width / tp),
                            act_kind, rt, backward=True)
        bwd.add_gemm(experts * dev.gemm_s(rows, h, width / tp, linear=True), backward=True,
                     launches=n)
        if dev.fp8:  # quantize each GEMM's input (forward) and output gradient (backward)
            # Per-expert inputs are quantized one expert at a time unless the stack casts
            # every expert's slice in one kernel (Runtime.grouped_cast_fused).
            q = 1 if rt.grouped_cast_fused else n
            casts = 2 * q * dev.fp8_cast_kernels(rt.fp8_recipe)
            fwd.add(dev.fp8_cast_s(experts * rows * h, rt.fp8_recipe, norm_fed=norm_fed)
                    + dev.fp8_cast_s(experts * rows * width / tp, rt.fp8_recipe),
                    q * (dev.fp8_cast_kernels(rt.fp8_recipe, norm_fed=norm_fed)
                         + dev.fp8_cast_kernels(rt.fp8_recipe)))
            bwd.add(dev.fp8_cast_s(experts * rows * (gate * width / tp + h), rt.fp8_recipe),
                    casts)
            fp8_linear_extras(dev, rt, fwd, bwd, rows, gate * width / tp, h, count=experts,
                              launches=n)
            fp8_linear_extras(dev, rt, fwd, bwd, rows, h, width / tp, count=experts,
                              launches=n)
        return gemms

    if not moe_layer:
        with graphed(rt.graphed("mlp"), fwd, bwd):
            dense(m, model.ffn_size, st.tp, norm_fed=rt.norm_amax_fused)
        return MlpComm(0.0, 0.0)
    moe = model.moe
    assert moe is not None
    t, etp = st.tp, st.expert_tp
    m_route = m / t if t > 1 else m  # Megatron routes sequence-parallel shards when tp > 1
    # The busiest rank's expert rows: the mean times the routing imbalance (dropless), or
    # exactly the capacity when token dropping pads the expert inputs to it.
    load = rt.capacity_factor if rt.capacity_factor is not None else st.ep_imbalance
    rows = expert_rows(model, st, m) * load
    with graphed(rt.graphed("moe_router"), fwd, bwd):
        fwd.add(dev.gemm_s(m_route, moe.num_experts, h))  # router
        fwd.add(dev.memory_s(3 * 4 * m_route * moe.num_experts))  # softmax + top-k in fp32
    if rt.moe_host_sync(st.ep):
        fwd.sync()  # the per-expert token counts come back to the host (dropless)
    with graphed(rt.graphed("moe"), fwd, bwd):
        local = moe.num_experts / st.ep
        # Gather the token copies into expert order and scatter them back: one pass over
        # ``rows x h`` each way; an all-to-all dispatcher with several local experts sorts the
        # received chunks by local expert and unsorts them before the return all-to-all, two
        # passes more (Megatron-Core's "Permutation 2" / sort_chunks_by_idxs; DeepEP's
        # dispatch lands tokens grouped by rank, and one permute groups them by expert).
        passes = 4 if st.ep > 1 and local > 1 and rt.ep_dispatcher == "alltoall" else 2
        permute = passes * ACT_BYTES * 2 * (rows / etp) * h
        fwd.add(dev.memory_s(permute), passes)
        bwd.add(BWD_MEM * dev.memory_s(permute), passes)
        routed = dense(rows / local, moe.expert_intermediate_size, etp, experts=local)
        if model.bias and rt.stack == "megatron":
            # Megatron-Core's TEGroupedMLP adds FC2's per-expert bias outside the grouped GEMM
            # (``_apply_bias``): per local expert, the bias times its tokens' routing
            # probabilities added to that expert's slice of the output, the slices
            # concatenated: three passes over the output forward (product, sum, concatenation),
            # four backward (both products' gradients and the split's concatenation). FC1's
            # bias is in its GEMM.
            out = ACT_BYTES * rows * h
            n_local = max(1, round(local))
            fwd.add(dev.memory_s(6 * out), 2 * n_local + 1)
            bwd.add(dev.memory_s(8 * out), 4 * n_local + 1)
        if moe.num_shared_experts:
            dense(m, moe.shared_width, t)
    coll = dev.host_coll_s
    a2a = 0.0
    if st.ep > 1:
        span = spans["ep"]
        share = remote_copies(model, span, rt.ep_dispatcher)
        sent = ACT_BYTES * m_route * moe.top_k * h * load
        a2a = 2 * max(net.all_to_all_s(span, sent, remote_share=share,
                                       intra_share=nvlink_copies(model, span, rt.ep_dispatcher)),
                      coll)
    tp_gather = 0.0
    if etp > 1:  # expert tensor parallelism: gather routed tokens, scatter results back
        msg = ACT_BYTES * rows * h
        span = spans.get("etp", spans["tp"])
        tp_gather = max(net.all_gather_s(span, msg), coll) + \
            max(net.reduce_scatter_s(span, msg), coll)
    return MlpComm(tp_gather, a2a, routed)
