"""The cost model's engine: a plan's layout -> per-stage seconds and bytes, with caches.

``predict`` wraps this for one plan; the layout search calls it for many thousands. Nothing here
builds pydantic objects: a ``Layout`` is a plain frozen dataclass; per-layer costs, spans and
parameter counts are cached by the few fields they depend on; and stages that hold the same
layers (every middle stage of an even split) are costed once.

Step time (``p`` stages, ``m`` micro-batches, ``v`` virtual stages per rank):
``m * t_c + bubble + transfers + max_i(tail_i)``, where ``t_i`` is stage i's forward + backward
(+ exposed ZeRO-2/3 traffic) per micro-batch, ``t_c`` the slowest stage's, and ``tail_i`` the
data-parallel traffic and optimizer step stage i cannot hide. The bubble is
``stages.pipeline_bubble``: ``(sum_i t_i - t_c) / v`` (Narayanan's ``(p-1)/(v m)`` for uniform
stages), for zero-bubble the same with each stage's weight-gradient GEMMs taken out (the step
simulator's result). Transfers are ``group.pp_transfer_s``: every one of the ``2 (m + p - 2)``
for 1F1B, only the fill and drain's ``2 (p - 1)`` when interleaved (overlapped p2p).
"""

from __future__ import annotations

from trainpilot.perf.dataparallel import Traffic, exposed, grad_sync_window, per_unit, traffic
from trainpilot.perf.flops import hardware_flops_per_token, model_flops_per_token
from trainpilot.perf.group import Group
from trainpilot.perf.hardware import Device, curve_for, device_model
from trainpilot.perf.layer import (
    ACT_BYTES,
    BWD_MEM,
    LayerCost,
    LayerSetup,
    activation_bytes,
    layer_cost,
    weight_tensors,
)
from trainpilot.perf.memory import RankParams, in_flight, stage_rank_params
from trainpilot.perf.options import CostOptions
from trainpilot.perf.stages import (  # noqa: F401 (re-exported: the cost model's records)
    BREAKDOWN_KEYS,
    OPT_BYTES_PER_PARAM,
    Costing,
    Layout,
    Sig,
    Sigs,
    StageNumbers,
    layout_of,
)
from trainpilot.perf.topology import GroupSpan, Network, Placement
from trainpilot.specs import ClusterSpec, ModelSpec
from trainpilot.specs.job import chunk_layers


class Estimator:
    """Costs layouts of one model on one cluster; caches what layouts share."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec,
                 options: CostOptions | None = None):
        self.model, self.cluster = model, cluster
        self.options = options or CostOptions()
        curve = self.options.curve or curve_for(cluster)
        self.net = Network.of(cluster, curve.collective_library)
        self._moe = [model.is_moe_layer(i) for i in range(model.num_hidden_layers)]
        self._devices: dict[tuple[str, float | None, str | None], Device] = {}
        self._layers: dict[tuple, LayerCost] = {}
        self._spans: dict[tuple, dict[str, GroupSpan]] = {}
        self._params: dict[tuple, list[RankParams]] = {}
        self._sigs: dict[tuple, Sigs] = {}
        self._flops: dict[tuple, tuple[float, float]] = {}
        self._edge_cache: dict[tuple, tuple[float, float, float, float]] = {}
        self._traffic: dict[tuple, Traffic] = {}
        self._flight: dict[tuple, float] = {}
        self._flights: dict[tuple, tuple[float, ...]] = {}
        self._p2p_cache: dict[tuple, float] = {}
        self._acts: dict[tuple, tuple[float, float, float, float]] = {}
        self._windows: dict[int, float] = {}

    # -- cached pieces ---------------------------------------------------------------------
    def device(self, precision: str, host_us: float | None = None,
               stack: str | None = None) -> Device:
        """The device at ``precision``; ``host_us`` replaces the host time per kernel (the
        runtime profile's, else the CostOptions override, else the device data's for
        ``stack``)."""
        host_us = self.options.host_us_per_kernel if host_us is None else host_us
        key = (precision, host_us, stack)
        found = self._devices.get(key)
        if found is None:
            curve = self.options.curve or curve_for(self.cluster)
            if host_us is None and stack is not None:
                host_us = curve.host_us_for(stack)
            if host_us is not None:
                curve = curve.replace(host_us_per_kernel=host_us)
            found = self._devices[key] = device_model(self.cluster, precision, curve)
        return found

    def lay_device(self, lay: Layout) -> Device:
        return self.device(lay.precision, lay.rt.host_us, lay.rt.stack)

    def placement(self, lay: Layout) -> Placement:
        return Placement.build(tp=lay.tp, cp=lay.cp, dp=lay.dp, pp=lay.pp, ep=lay.ep,
                               etp=lay.etp, order=lay.rank_order,
                               devices_per_node=self.cluster.devices_per_node,
                               nodes_per_rack=self.cluster.rack_nodes)

    def spans(self, lay: Layout) -> dict[str, GroupSpan]:
        key = (lay.tp, lay.cp, lay.ep, lay.pp, lay.dp, lay.dp_shard, lay.etp, lay.rank_order)
        found = self._spans.get(key)
        if found is None:
            place = self.placement(lay)
            found = place.groups()
            if lay.dp_shard:
                axes = ("cp", "dp_ep", "dp")
                found["dp_shard"] = place.sub_span(axes, lay.dp_shard * lay.cp,
                                                   stride_part=False)
                found["dp_replicate"] = place.sub_span(axes, lay.dp_shard * lay.cp,
                                                       stride_part=True)
            self._spans[key] = found
        return found

    def stage_ids(self, lay: Layout) -> list[list[int]]:
        """Decoder layer indices on each pipeline rank (all its virtual chunks)."""
        sg = self.signatures(lay)
        return [list(sg.sigs[k].ids) for k in sg.of_stage]

    def signatures(self, lay: Layout) -> Sigs:
        """The stage signatures of ``lay``'s split (cached by split and interleaving)."""
        key = (lay.stage_layers, lay.vp)
        found = self._sigs.get(key)
        if found is None:
            found = self._sigs[key] = self._make_sigs(lay)
        return found

    def _make_sigs(self, lay: Layout) -> Sigs:
        p, v = lay.pp, lay.vp
        chunks = chunk_layers(lay.stage_layers, v, field="vp")
        # Model order is chunk-major (chunk 0 of every rank, then chunk 1, ...).
        ids: list[list[int]] = [[] for _ in range(p)]
        start = 0
        for k in range(v):
            for i in range(p):
                ids[i] += range(start, start + chunks[i][k])
                start += chunks[i][k]
        sigs: list[Sig] = []
        index: dict[tuple, int] = {}
        of_stage: list[int] = []
        for i, stage in enumerate(ids):
            n_moe = sum(self._moe[j] for j in stage)
            # The same layer count, MoE count, chunk split and edge role cost the same.
            sig_key = (len(stage), n_moe, tuple(chunks[i]), i == 0, i == p - 1)
            if sig_key not in index:
                index[sig_key] = len(sigs)
                sigs.append(Sig(tuple(stage), n_moe, i == 0, i == p - 1, tuple(chunks[i])))
            of_stage.append(index[sig_key])
        first = [of_stage.index(k) for k in range(len(sigs))]
        count = [of_stage.count(k) for k in range(len(sigs))]
        before = [tuple(of_stage[:first[k]].count(j) for j in range(len(sigs)))
                  for k in range(len(sigs))]
        return Sigs(tuple(sigs), tuple(of_stage), tuple(first), tuple(count), tuple(before))

    def _setup(self, lay: Layout, sp: bool | None = None) -> LayerSetup:
        return LayerSetup(
            tp=lay.tp, cp=lay.cp, ep=lay.ep, micro_batch_size=lay.micro_batch_size,
            seq_len=lay.seq_len,
            sequence_parallel=lay.sequence_parallel if sp is None else sp,
            flash_attention=lay.rt.flash_attention, dropout=lay.rt.dropout,
            ep_imbalance=lay.rt.moe_imbalance if lay.ep > 1 else 1.0,
            gemm_input_bytes=_gemm_input_bytes(lay.precision), etp=lay.etp or 0, rt=lay.rt,
            window_factor=self.window_factor(lay.seq_len),
            num_micro_batches=min(lay.num_micro_batches, 2),
        )

    def window_factor(self, seq_len: int) -> float:
        """Keys per query averaged over the layers, relative to the causal half of the
        sequence (1.0 without sliding windows)."""
        found = self._windows.get(seq_len)
        if found is None:
            total = 0.0
            for index in range(self.model.num_hidden_layers):
                span = self.model.attention_span(index, seq_len)
                total += 1.0 if span >= seq_len else span * (1 - span / (2 * seq_len)) / \
                    (seq_len / 2)
            found = self._windows[seq_len] = total / self.model.num_hidden_layers
        return found

    def layer_act(self, lay: Layout, moe_layer: bool, sp: bool,
                  micro_batch_size: int | None = None) -> tuple[float, float, float, float]:
        """(none, selective, full, op) activation bytes per layer and micro-batch (memory checks
        need no time model); ``micro_batch_size`` overrides the layout's."""
        mb = micro_batch_size or lay.micro_batch_size
        key = (moe_layer, lay.tp, lay.cp, mb, lay.seq_len, sp, lay.precision,
               lay.rt.flash_attention, lay.rt.dropout, lay.etp)
        found = self._acts.get(key)
        if found is None:
            setup = LayerSetup(
                tp=lay.tp, cp=lay.cp, ep=lay.ep, micro_batch_size=mb, seq_len=lay.seq_len,
                sequence_parallel=sp, flash_attention=lay.rt.flash_attention,
                dropout=lay.rt.dropout, gemm_input_bytes=_gemm_input_bytes(lay.precision),
                etp=lay.etp or 0)
            found = self._acts[key] = activation_bytes(self.model, moe_layer, setup)
        return found

    def layer(self, lay: Layout, moe_layer: bool, spans: dict[str, GroupSpan]) -> LayerCost:
        # A dense layer does not see expert parallelism: leave it out of the key.
        ep, ep_span = (lay.ep, spans["ep"]) if moe_layer else (1, None)
        etp = (lay.etp, spans.get("etp")) if moe_layer else None
        key = (moe_layer, lay.tp, lay.cp, ep, lay.micro_batch_size, lay.seq_len,
               lay.sequence_parallel, lay.precision, spans["tp"], spans["cp"], ep_span, lay.rt,
               etp, lay.num_micro_batches >= 2)
        found = self._layers.get(key)
        if found is None:
            found = self._layers[key] = layer_cost(self.model, moe_layer, self._setup(lay),
                                                   self.lay_device(lay), self.net, spans)
        return found

    def params(self, lay: Layout, sig: Sig) -> RankParams:
        return self.sig_params(lay)[self.signatures(lay).sigs.index(sig)]

    def sig_params(self, lay: Layout) -> list[RankParams]:
        """Parameters on one rank of each signature of ``lay``'s split."""
        sg = self.signatures(lay)
        key = (id(sg), lay.tp, lay.ep)  # signature sets live as long as the cache
        found = self._params.get(key)
        if found is None:
            found = self._params[key] = [
                stage_rank_params(self.model, sig.ids, tp=lay.tp, ep=lay.ep, first=sig.first,
                                  last=sig.last, pp=lay.pp) for sig in sg.sigs]
        return found

    def flops_per_token(self, seq_len: int, recompute: str) -> tuple[float, float]:
        key = (seq_len, recompute)
        if key not in self._flops:
            self._flops[key] = (model_flops_per_token(self.model, seq_len),
                                hardware_flops_per_token(self.model, seq_len, recompute))
        return self._flops[key]

    def in_flight(self, lay: Layout, stage: int, m: int | None = None) -> float:
        """Stage-equivalents of activations rank ``stage`` holds at its peak (``m``: another
        micro-batch count than the layout's)."""
        sg = self.signatures(lay)
        return self.flight(lay.schedule, stage, lay.pp, lay.vp, m or lay.num_micro_batches,
                           sg.sigs[sg.of_stage[stage]].chunks)

    def flights(self, lay: Layout, sg: Sigs) -> tuple[float, ...]:
        """In-flight stage-equivalents at each signature's first rank (cached by signature
        set, schedule and micro-batch count)."""
        key = (id(sg), lay.schedule, lay.num_micro_batches)  # sg lives as long as the cache
        found = self._flights.get(key)
        if found is None:
            m = lay.num_micro_batches
            found = self._flights[key] = tuple(
                self.flight(lay.schedule, i, lay.pp, lay.vp, m, sig.chunks)
                for i, sig in zip(sg.first_index, sg.sigs))
        return found

    def flight(self, schedule: str, stage: int, pp: int, vp: int, m: int,
               chunks: tuple[int, ...]) -> float:
        """``memory.in_flight``, cached (only the interleaved count takes any work)."""
        if vp == 1 or schedule != "interleaved":
            if pp == 1:
                return 1.0
            return float(m) if schedule == "gpipe" else float(min(pp - stage, m))
        key = (stage, pp, vp, m, chunks)
        found = self._flight.get(key)
        if found is None:
            found = self._flight[key] = in_flight(schedule, stage, pp, vp, m, chunks)
        return found

    # -- costing ---------------------------------------------------------------------------
    def group(self, lay: Layout) -> Group:
        """The context ``lay`` shares with its ZeRO / recompute / sequence-parallel variants."""
        return Group(self, lay)

    def peak_bytes(self, lay: Layout) -> float:
        """Peak memory per device (bytes) over the pipeline ranks."""
        return self.group(lay).peak(lay.zero, lay.recompute, lay.sequence_parallel)[0]

    def quick(self, lay: Layout, limit_bytes: float | None = None
              ) -> tuple[float | None, float]:
        """(step seconds, peak bytes); the step is None when the peak passes ``limit_bytes``
        (memory is checked before any time is costed)."""
        return self.group(lay).quick(lay.zero, lay.recompute, lay.sequence_parallel,
                                     limit_bytes)

    def lower_bound(self, lay: Layout) -> float:
        """A step time no ZeRO or recompute variant of ``lay`` can beat (see Group)."""
        return self.group(lay).lower_bound(lay.sequence_parallel)

    def evaluate(self, lay: Layout) -> Costing:
        """Full costing of ``lay``: memory and time per pipeline rank, step time, breakdown."""
        g = self.group(lay)
        stages, peak, peak_stage = g.memory(lay)
        g.fill(lay, stages)
        step, breakdown = g.pipeline(lay, stages)
        per_stage = g.expand(lay, stages)
        model_fpt, hw_fpt = self.flops_per_token(lay.seq_len, lay.recompute)
        tokens_step = lay.global_batch_size * lay.seq_len
        return Costing(
            layout=lay, stages=per_stage, step_time_s=step, breakdown_s=breakdown,
            peak_bytes=peak, peak_stage=peak_stage, model_flops_per_step=model_fpt * tokens_step,
            hardware_flops_per_step=hw_fpt * tokens_step, peak_flops=g.dev.nominal_flops,
            hbm_bytes=g.dev.hbm_bytes, spans=g.spans,
        )

    def p2p(self, lay: Layout, spans: dict[str, GroupSpan]) -> float:
        """Seconds of one activation (or gradient) transfer between pipeline stages."""
        if lay.pp == 1:
            return 0.0
        key = (lay.micro_batch_size * lay.seq_len / (lay.cp * lay.tp), spans["pp"],
               lay.precision, lay.rt.host_us)
        found = self._p2p_cache.get(key)
        if found is None:
            # Megatron sends 1/tp of the activation per TP rank (scatter-gather optimisation).
            num_bytes = ACT_BYTES * key[0] * self.model.hidden_size
            found = self._p2p_cache[key] = max(self.net.p2p_s(spans["pp"], num_bytes),
                                               self.lay_device(lay).host_coll_s)
        return found

    def _edges(self, lay: Layout, spans: dict[str, GroupSpan], first: bool,
               last: bool) -> tuple[float, float, float, float]:
        """(fwd compute, bwd compute, fwd TP, bwd TP) seconds per micro-batch for the
        embedding (first stage) and final norm, output layer and loss (last stage)."""
        if not (first or last):
            return 0.0, 0.0, 0.0, 0.0
        key = (lay.tp, lay.cp, lay.micro_batch_size, lay.seq_len, lay.sequence_parallel,
               lay.precision, first, last, spans["tp"], lay.rt)
        found = self._edge_cache.get(key)
        if found is None:
            found = self._edge_cache[key] = self._edges_uncached(lay, spans, first, last)
        return found

    def _edges_uncached(self, lay: Layout, spans: dict[str, GroupSpan], first: bool,
                        last: bool) -> tuple[float, float, float, float]:
        dev = self.lay_device(lay)
        h, t, v = self.model.hidden_size, lay.tp, self.model.vocab_size
        tokens = lay.micro_batch_size * lay.seq_len / lay.cp
        tokens_sp = tokens / t if lay.sequence_parallel else tokens
        host, coll, net, span = dev.host_s, dev.host_coll_s, self.net, spans["tp"]
        if t > 1:  # ops on tensor-parallel (DTensor) tensors
            host += dev.host_sharded_s
        f = b = tf = tb = 0.0
        msg = ACT_BYTES * tokens * h
        sp = lay.sequence_parallel
        if first:
            f += max(dev.memory_s(2 * ACT_BYTES * tokens * h), host)
            b += max(dev.memory_s(2 * 4 * tokens * h), host)  # fp32 scatter-add of the grads
            if t > 1:  # vocab-parallel embedding: sum the partial lookups
                tf += max(net.reduce_scatter_s(span, msg) if sp else net.all_reduce_s(span, msg),
                          coll)
                tb += max(net.all_gather_s(span, msg), coll) if sp else 0.0
        if last:
            f += max(dev.memory_s(2 * ACT_BYTES * tokens_sp * h), host)
            b += max(BWD_MEM * dev.memory_s(2 * ACT_BYTES * tokens_sp * h), host)
            f += max(dev.gemm_s(tokens, v / t, h), host)
            b += max(2 * dev.gemm_s(tokens, v / t, h), 2 * host)
            # fp32 vocab-parallel loss; eager PyTorch's log_softmax + nll moves more (runtime)
            loss = lay.rt.traffic("loss")
            f += max(loss * dev.memory_s(12.0 * tokens * v / t), lay.rt.kernels("loss") * host)
            b += max(loss * dev.memory_s(8.0 * tokens * v / t), 2 * host)
            if t > 1:
                tf += 3 * max(net.all_reduce_s(span, 4.0 * tokens), coll)
                if sp:
                    tf += max(net.all_gather_s(span, msg), coll)
                    tb += max(net.reduce_scatter_s(span, msg), coll)
        return f, b, tf, tb

    def data_parallel(self, lay: Layout, spans: dict[str, GroupSpan], st: StageNumbers,
                      sig: Sig) -> None:
        """The stage's gradient/parameter traffic, its exposure and the optimizer step."""
        dev = self.lay_device(lay)
        gbytes = lay.rt.grad_bytes
        tied = self.model.tie_word_embeddings and lay.pp > 1 and (sig.first or sig.last)
        units = per_unit(lay.rt.stack, lay.zero)
        sync = lay.rt.sync_for(lay.zero)
        per_param = lay.zero == 3 and lay.rt.zero3_per_param
        tensors = weight_tensors(self.model) if per_param else 0
        regather = per_param and lay.recompute == "full"
        key = (lay.zero, gbytes, st.params, spans["dp"], spans["expert_dp"], spans["pp"],
               spans.get("dp_shard"), lay.hierarchical, lay.bucket_mb, lay.dp_shard, tied,
               len(sig.ids), units, sync, lay.algorithm, lay.rt.param_gather_bytes, tensors,
               regather, dev.host_s)
        tr = self._traffic.get(key)
        if tr is None:
            tied_bytes = gbytes * self.model.vocab_size * self.model.hidden_size / lay.tp \
                if tied else 0.0
            tr = self._traffic[key] = traffic(
                self.net.with_algorithm(lay.algorithm), zero=lay.zero, params=st.params,
                grad_bytes=gbytes, spans=spans, hierarchical=lay.hierarchical,
                bucket_bytes=lay.bucket_mb * 1e6, dp_shard=lay.dp_shard, tied_bytes=tied_bytes,
                num_layers=len(sig.ids), units=units, sync=sync,
                param_bytes=lay.rt.param_gather_bytes, weight_tensors=tensors,
                chunk_issue_s=dev.host_s, recompute_gather=regather)
        # DeepSpeed's per-parameter gathers each follow a device synchronize: nothing overlaps.
        ov, sigma = lay.overlap and not per_param, dev.curve.overlap_slowdown
        st.fsdp_fwd_s = exposed(tr.mb_fwd_s, st.fwd_s, tr.mb_edge_s, overlap=ov, slowdown=sigma)
        st.fsdp_bwd_s = exposed(tr.mb_bwd_s, st.bwd_s, tr.mb_edge_s, overlap=ov, slowdown=sigma)
        window = st.bwd_s * grad_sync_window(lay.rt.stack, lay.vp, lay.pp,
                                             lay.num_micro_batches)
        st.dp_tail_rs_s = exposed(tr.step_grad_s, window, tr.step_grad_edge_s, overlap=ov,
                                  slowdown=sigma) + \
            exposed(tr.replicate_s, st.bwd_s, tr.replicate_s, overlap=ov, slowdown=sigma) + \
            tr.tied_s
        st.dp_tail_ag_s = exposed(tr.step_gather_s, st.fwd_s, tr.step_gather_edge_s,
                                  overlap=ov, slowdown=sigma)
        st.dp_comm_s = tr.step_s
        grad_bytes = int(gbytes * st.params.total)
        size = max(1, int(lay.bucket_mb * 1e6))
        if units:
            size = max(1, int(gbytes * st.params.largest_layer))
        full, rest = divmod(grad_bytes, size)
        st.bucket_bytes = tuple([size] * full + ([rest] if rest else []))
        shards = (lay.dp_shard or lay.dp) * lay.cp
        p = st.params
        opt = p.dense + p.expert if lay.zero == 0 else \
            p.dense / shards + p.expert / max(1, shards // lay.ep)
        st.optimizer_s = max(dev.memory_s(OPT_BYTES_PER_PARAM * opt), 4 * dev.host_s)


def _gemm_input_bytes(precision: str) -> float:
    """Bytes per element of a GEMM input saved for the backward."""
    return 1.0 if precision == "fp8" else float(ACT_BYTES)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
