"""``Group``: what the ZeRO / recompute / sequence-parallel variants of one layout share, and
the memory and time arithmetic over its distinct stage signatures (see ``estimator.py`` for the
step formula). The layout search builds one per (tp, cp, pp, split, ep, micro-batch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainpilot.perf.layer import ACT_BYTES, LayerCost
from trainpilot.perf.memory import bytes_per_param
from trainpilot.perf.stages import (
    MODE_INDEX,
    OPT_BYTES_PER_PARAM,
    Layout,
    StageNumbers,
    add_edges,
    add_layers,
    pipeline_bubble,
)

if TYPE_CHECKING:
    from trainpilot.perf.estimator import Estimator

def pp_transfer_s(p2p: float, m: int, p: int, v: int) -> float:
    """Activation/gradient transfers between stages on the critical path per step. 1F1B
    (Megatron's blocking batched send/recv): every one of the ``2 (m + p - 2)``; interleaved
    (Megatron overlaps them with the next chunk's compute, ``--overlap-p2p-comm``, the default
    with virtual stages, as the step simulator's asynchronous links do): only the ``2 (p - 1)``
    of the pipeline's fill and drain."""
    if p <= 1:
        return 0.0
    if v > 1:
        return 2 * p2p * (p - 1)
    return 2 * p2p * (m + p - 2)


class Group:
    """What the ZeRO / recompute / sequence-parallel variants of one layout share: spans,
    stage signatures, parameters, in-flight counts, pipeline transfers, per-layer costs.
    The layout search builds one per (tp, cp, pp, split, ep, micro-batch) and costs its
    variants through it; ``Estimator.evaluate`` uses the same code for a single plan."""

    def __init__(self, est: Estimator, lay: Layout, like: Group | None = None):
        """``like``: a group of the same layout at another micro-batch size, whose spans,
        signatures and parameters are reused."""
        self.est, self.base = est, lay
        if like is None:
            self.spans = est.spans(lay)
            self.sg = est.signatures(lay)
            self.params = est.sig_params(lay)
            self.dev = est.lay_device(lay)
        else:
            self.spans, self.sg, self.params, self.dev = like.spans, like.sg, like.params, \
                like.dev
        self.flight = est.flights(lay, self.sg)
        self.p2p = est.p2p(lay, self.spans)
        self.tokens = lay.micro_batch_size * lay.seq_len / lay.cp
        self.shards = (lay.dp_shard or lay.dp) * lay.cp
        self.expert_shards = max(1, self.shards // lay.ep)
        self._sp_layouts: dict[bool, Layout] = {lay.sequence_parallel: lay}
        self._layers: dict[bool, tuple[LayerCost, LayerCost]] = {}
        self._edges: dict[tuple[bool, int], tuple[float, float, float, float]] = {}
        # Memory coefficients are per sample: groups of one layout at other micro-batch sizes
        # share them.
        self._coeffs: dict[tuple, list[tuple]] = like._coeffs if like is not None else {}
        self._bounds: dict[tuple[bool, str], float] = {}

    def _sp_layout(self, sp: bool) -> Layout:
        found = self._sp_layouts.get(sp)
        if found is None:
            found = self._sp_layouts[sp] = self.variant(self.base.zero, self.base.recompute, sp)
        return found

    def variant(self, zero: int, recompute: str, sp: bool) -> Layout:
        b = self.base
        return Layout(tp=b.tp, pp=b.pp, dp=b.dp, ep=b.ep, cp=b.cp, vp=b.vp, zero=zero,
                      micro_batch_size=b.micro_batch_size,
                      global_batch_size=b.global_batch_size, seq_len=b.seq_len,
                      recompute=recompute, sequence_parallel=sp, precision=b.precision,
                      schedule=b.schedule, stage_layers=b.stage_layers, dp_shard=b.dp_shard,
                      overlap=b.overlap, hierarchical=b.hierarchical, bucket_mb=b.bucket_mb,
                      etp=b.etp, rank_order=b.rank_order, algorithm=b.algorithm, rt=b.rt)

    def layers(self, sp: bool) -> tuple[LayerCost, LayerCost]:
        """(dense, MoE) layer costs with or without sequence parallelism."""
        found = self._layers.get(sp)
        if found is None:
            lay = self._sp_layout(sp)
            dense = self.est.layer(lay, False, self.spans)
            moe = self.est.layer(lay, True, self.spans) if self.est.model.is_moe else dense
            found = self._layers[sp] = (dense, moe)
        return found

    def edges(self, sp: bool, k: int) -> tuple[float, float, float, float]:
        key = (sp, k)
        found = self._edges.get(key)
        if found is None:
            sig = self.sg.sigs[k]
            found = self._edges[key] = self.est._edges(self._sp_layout(sp), self.spans,
                                                       sig.first, sig.last)
        return found

    # -- memory ----------------------------------------------------------------------------
    def peak(self, zero: int, mode: str, sp: bool, micro_batch_size: int | None = None
             ) -> tuple[float, int]:
        """(peak bytes, its pipeline rank) without building any per-stage object;
        ``micro_batch_size`` evaluates the same layout at another micro-batch size."""
        lay = self.base
        mb = micro_batch_size or lay.micro_batch_size
        m = lay.global_batch_size // (mb * lay.dp)
        peak, peak_stage = -1.0, 0
        unsharded = lay.rt.sync_for(zero) == "step" and m > 1
        for k, (_, _, _, static, act, edge) in enumerate(
                self._coefficients(zero, mode, sp, unsharded)):
            i = self.sg.first_index[k]
            flight = self.flight[k] if mb == lay.micro_batch_size else \
                self.est.flight(lay.schedule, i, lay.pp, lay.vp, m, self.sg.sigs[k].chunks)
            total = static[0] + mb * (static[1] + edge + flight * act)
            if total > peak:
                peak, peak_stage = total, i
        return peak, peak_stage

    def memory(self, lay: Layout) -> tuple[list[StageNumbers], float, int]:
        """Per-signature StageNumbers with their bytes, the peak bytes and its rank."""
        out: list[StageNumbers] = []
        mb = lay.micro_batch_size
        unsharded = lay.rt.sync_for(lay.zero) == "step" and lay.num_micro_batches > 1
        coeffs = self._coefficients(lay.zero, lay.recompute, lay.sequence_parallel, unsharded)
        for k, (weights, grads, optim, static, act, edge) in enumerate(coeffs):
            st = StageNumbers(index=k, layers=len(self.sg.sigs[k].ids), params=self.params[k],
                              static_bytes=static[0] + mb * static[1], act_bytes=mb * act,
                              act_edge_bytes=mb * edge)
            st.memory = dict(weights=weights, grads=grads, optimizer=optim,
                             other=st.static_bytes - weights - grads - optim)
            out.append(st)
        peak, stage = self.peak(lay.zero, lay.recompute, lay.sequence_parallel)
        return out, peak, stage

    def _coefficients(self, zero: int, mode: str, sp: bool, unsharded: bool = False
                      ) -> list[tuple]:
        """Per signature: (weights, grads, optimizer, (fixed, per-sample) static bytes,
        activation bytes per in-flight micro-batch per sample, output-layer bytes per sample).
        Activations, logits and the re-materialised layer are exactly linear in the
        micro-batch size, so a peak at any size is arithmetic on these."""
        key = (zero, mode, sp, unsharded)
        found = self._coeffs.get(key)
        if found is not None:
            return found
        est, lay, sg = self.est, self.base, self.sg
        gb = lay.rt.grad_bytes
        (w_d, g_d, o_d), (w_e, g_e, o_e) = (
            bytes_per_param(zero, self.shards, gb, unsharded),
            bytes_per_param(zero, self.expert_shards, gb, unsharded))
        dense = est.layer_act(lay, False, sp, 1)  # (none, selective, full, op) at mb = 1
        moe = est.layer_act(lay, True, sp, 1) if est.model.is_moe else dense
        pick = MODE_INDEX[mode]
        h, t = est.model.hidden_size, lay.tp
        tokens = lay.seq_len / lay.cp  # per sample
        tokens_sp = tokens / t if sp else tokens
        reserved = self.dev.curve.reserved_gib * 2**30
        grad_bytes = lay.rt.grad_bytes
        found = []
        for k, sig in enumerate(sg.sigs):
            params = self.params[k]
            act = (len(sig.ids) - sig.n_moe) * dense[pick] + sig.n_moe * moe[pick]
            if sig.first and lay.rt.dropout:  # embedding dropout mask
                act += tokens_sp * h
            edge = 0.0
            if sig.last:  # final norm and output-layer inputs, fp32 logits for the loss
                edge = 2 * ACT_BYTES * tokens_sp * h + 4.0 * tokens * est.model.vocab_size / t
            fixed, per_sample = reserved, 0.0
            if mode != "none" and sig.ids:  # the backward re-materialises one layer
                worst = moe if sig.n_moe else dense
                per_sample += worst[0] - worst[pick]
            if zero == 3:  # FSDP: the layer in use and the prefetched one (16-bit), the
                # layer's 16-bit gradients and their copy in the reduce dtype being scattered
                fixed += (3 * ACT_BYTES + grad_bytes) * params.largest_layer
            weights = w_d * params.dense + w_e * params.expert
            grads = g_d * params.dense + g_e * params.expert
            optim = o_d * params.dense + o_e * params.expert
            found.append((weights, grads, optim, (weights + grads + optim + fixed, per_sample),
                          act, edge))
        self._coeffs[key] = found
        return found

    # -- time ------------------------------------------------------------------------------
    def quick(self, zero: int, mode: str, sp: bool, limit_bytes: float | None = None
              ) -> tuple[float | None, float]:
        """(step seconds, peak bytes) of one variant; no step when it does not fit."""
        peak, _ = self.peak(zero, mode, sp)
        if limit_bytes is not None and peak > limit_bytes:
            return None, peak
        lay = self.variant(zero, mode, sp)
        stages, _, _ = self.memory(lay)
        self.fill(lay, stages)
        return self.pipeline(lay, stages)[0], peak

    def lower_bound(self, sp: bool, recompute: str = "none") -> float:
        """A step time no ZeRO variant (and, with ``recompute="none"``, no recompute variant)
        can beat: the pipeline with that recomputation and no data-parallel traffic, plus the
        smallest (sharded) optimizer step. Every term left out is >= 0, and recomputation
        only adds time."""
        key = (sp, recompute)
        found = self._bounds.get(key)
        if found is None:
            found = self._bounds[key] = self._lower_bound(sp, recompute)
        return found

    def bubble_bound(self, sp: bool) -> float:
        """The pipeline bubble with no recomputation and no CP transfers. No larger
        micro-batch has a smaller one: a micro-batch's time never falls as it grows."""
        if self.base.pp == 1:
            return 0.0
        key = (sp, "bubble")
        found = self._bounds.get(key)
        if found is None:
            found = self._bounds[key] = self._bubble_bound(sp)
        return found

    def _bubble_bound(self, sp: bool) -> float:
        dense, moe = self.layers(sp)
        d = dense.fwd_compute_s + dense.bwd_compute_s + dense.tp_fwd_s + dense.tp_bwd_s + \
            dense.ep_fwd_s + dense.ep_bwd_s
        e = moe.fwd_compute_s + moe.bwd_compute_s + moe.tp_fwd_s + moe.tp_bwd_s + \
            moe.ep_fwd_s + moe.ep_bwd_s
        periods, wgrads = self._rank_periods(d, e, dense.wgrad_s, moe.wgrad_s, sp)
        return pipeline_bubble(self.base.schedule, periods, wgrads, self.base.vp)

    def _rank_periods(self, d: float, e: float, wd: float, we: float, sp: bool
                      ) -> tuple[list[float], list[float]]:
        """Per pipeline rank: (period, weight-gradient seconds) from per-layer dense/MoE
        periods ``d``/``e`` and weight-gradient times ``wd``/``we``, with the edge stages'
        embedding and output layer."""
        periods, wgrads = [], []
        for k in self.sg.of_stage:
            sig = self.sg.sigs[k]
            n_d = len(sig.ids) - sig.n_moe
            periods.append(n_d * d + sig.n_moe * e + sum(self.edges(sp, k)))
            wgrads.append(n_d * wd + sig.n_moe * we)
        return periods, wgrads

    def per_sample_bound(self, sp: bool, recompute: str = "none") -> float:
        """Seconds per sequence (per data-parallel replica) that no smaller micro-batch of this
        layout can beat under ``recompute``: the slowest stage's compute, recompute and TP/EP
        communication per micro-batch, divided by the micro-batch size. Every op's time per
        sample is non-increasing in the micro-batch size in this model (GEMM efficiency never
        falls with size; byte, latency and host terms amortise), except the exposed
        context-parallel transfers, left out."""
        dense, moe = self.layers(sp)
        d = dense.fwd_compute_s + dense.bwd_compute_s + dense.tp_fwd_s + dense.tp_bwd_s + \
            dense.ep_fwd_s + dense.ep_bwd_s + sum(dense.recompute_s(recompute))
        e = moe.fwd_compute_s + moe.bwd_compute_s + moe.tp_fwd_s + moe.tp_bwd_s + \
            moe.ep_fwd_s + moe.ep_bwd_s + sum(moe.recompute_s(recompute))
        crit = 0.0
        for k, sig in enumerate(self.sg.sigs):
            period = (len(sig.ids) - sig.n_moe) * d + sig.n_moe * e + sum(self.edges(sp, k))
            crit = max(crit, period)
        return crit / self.base.micro_batch_size

    def layer_sample_time(self, sp: bool) -> tuple[float, float]:
        """(all decoder layers, the cheaper single layer): compute and TP/EP communication
        per sample at this layout's micro-batch size, no recomputation (the search's coarse
        bound)."""
        dense, moe = self.layers(sp)
        d = dense.fwd_compute_s + dense.bwd_compute_s + dense.tp_fwd_s + dense.tp_bwd_s + \
            dense.ep_fwd_s + dense.ep_bwd_s
        e = moe.fwd_compute_s + moe.bwd_compute_s + moe.tp_fwd_s + moe.tp_bwd_s + \
            moe.ep_fwd_s + moe.ep_bwd_s
        num_moe = self.est.model.num_moe_layers
        layers = self.est.model.num_hidden_layers
        cheapest = min(d, e) if num_moe else d
        mb = self.base.micro_batch_size
        return ((layers - num_moe) * d + num_moe * e) / mb, cheapest / mb

    def min_optimizer_s(self) -> float:
        """The optimizer step of the busiest stage with its state fully sharded."""
        dev, out = self.dev, 0.0
        for params in self.params:
            opt = params.dense / self.shards + params.expert / self.expert_shards
            out = max(out, dev.memory_s(OPT_BYTES_PER_PARAM * opt), 4 * dev.host_s)
        return out

    def _lower_bound(self, sp: bool, recompute: str) -> float:
        lay, sg, dev = self.base, self.sg, self.dev
        dense, moe = self.layers(sp)
        d_period = dense.fwd_s + dense.bwd_s(recompute)
        m_period = moe.fwd_s + moe.bwd_s(recompute)
        shards, expert_shards = self.shards, self.expert_shards
        crit = busy = opt_max = 0.0
        for k, sig in enumerate(sg.sigs):
            f, b, tf, tb = self.edges(sp, k)
            period = (len(sig.ids) - sig.n_moe) * d_period + sig.n_moe * m_period + \
                f + b + tf + tb
            crit = period if period > crit else crit
            busy += sg.count[k] * period
            params = self.params[k]
            opt = params.dense / shards + params.expert / expert_shards
            opt_max = max(opt_max, dev.memory_s(OPT_BYTES_PER_PARAM * opt), 4 * dev.host_s)
        m, p, v = lay.num_micro_batches, lay.pp, lay.vp
        if lay.schedule == "zero_bubble":
            periods, wgrads = self._rank_periods(d_period, m_period, dense.wgrad_s,
                                                 moe.wgrad_s, sp)
            bubble = pipeline_bubble(lay.schedule, periods, wgrads, v)
        else:
            bubble = (busy - crit) / v if p > 1 else 0.0
        pp_comm = pp_transfer_s(self.p2p, m, p, v)
        return m * crit + bubble + pp_comm + opt_max

    def fill(self, lay: Layout, stages: list[StageNumbers]) -> None:
        """Time of each signature: layers, edges, pipeline transfer, data-parallel traffic."""
        sp, mode = lay.sequence_parallel, lay.recompute
        dense, moe = self.layers(sp)
        for k, (st, sig) in enumerate(zip(stages, self.sg.sigs)):
            n_dense = len(sig.ids) - sig.n_moe
            if n_dense:
                add_layers(st, dense, n_dense, mode)
            if sig.n_moe:
                add_layers(st, moe, sig.n_moe, mode)
            add_edges(st, self.edges(sp, k))
            st.p2p_s = self.p2p
            self.est.data_parallel(lay, self.spans, st, sig)

    def pipeline(self, lay: Layout, stages: list[StageNumbers], *, dp: bool = True
                 ) -> tuple[float, dict[str, float]]:
        """Step time and breakdown from per-signature numbers (see the module docstring)."""
        sg = self.sg
        m, p, v = lay.num_micro_batches, lay.pp, lay.vp
        crit = max(stages, key=lambda s: s.period_s)
        ranks = [stages[k] for k in sg.of_stage]
        bubble = pipeline_bubble(lay.schedule, [st.period_s for st in ranks],
                                 [st.wgrad_s for st in ranks], v)
        pp_comm = pp_transfer_s(self.p2p, m, p, v)
        # Stage i finishes its last backward sum_{j<i} B_j / v before stage 0 does and starts
        # its first forward sum_{j<i} F_j / v after it: slack that hides data-parallel traffic.
        # Identical ranks expose the most at their first occurrence.
        best_end, last, dp_exposed = -1.0, stages[0], 0.0
        for k, st in enumerate(stages):
            slack_end = slack_start = 0.0
            for j, n in enumerate(sg.before[k]):
                if n:
                    slack_end += n * stages[j].bwd_s
                    slack_start += n * stages[j].fwd_s
            exposed_s = 0.0
            if dp:
                exposed_s = max(0.0, st.dp_tail_rs_s - slack_end / v) + \
                    max(0.0, st.dp_tail_ag_s - slack_start / v)
            if exposed_s + st.optimizer_s > best_end:
                best_end, last, dp_exposed = exposed_s + st.optimizer_s, st, exposed_s
        step = m * crit.period_s + bubble + pp_comm + best_end
        breakdown = dict(
            compute=m * crit.compute_s, recompute=m * crit.recompute_s, tp_comm=m * crit.tp_s,
            pp_comm=pp_comm, pp_bubble=bubble,
            dp_comm_exposed=m * crit.fsdp_exposed_s + dp_exposed, ep_comm=m * crit.ep_s,
            cp_comm=m * crit.cp_s, optimizer=last.optimizer_s,
        )
        return step, breakdown

    def expand(self, lay: Layout, stages: list[StageNumbers]) -> list[StageNumbers]:
        """Per-rank copies of the signature numbers, with each rank's activations and exposed
        data-parallel traffic."""
        est, v = self.est, lay.vp
        out, slack_end, slack_start = [], 0.0, 0.0
        for i, k in enumerate(self.sg.of_stage):
            src = stages[k]
            st = StageNumbers(**{f: getattr(src, f) for f in StageNumbers.__slots__})
            st.index = i
            st.dp_exposed_s = max(0.0, st.dp_tail_rs_s - slack_end) + \
                max(0.0, st.dp_tail_ag_s - slack_start)
            act = st.act_edge_bytes + est.in_flight(lay, i) * st.act_bytes
            st.memory = dict(src.memory, activations=act)
            st.memory["total"] = st.static_bytes + act
            slack_end += st.bwd_s / v
            slack_start += st.fwd_s / v
            out.append(st)
        return out
