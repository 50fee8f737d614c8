"""Token permutation in an expert-parallel MoE layer, as the dispatchers run it: one pass over
the token copies each way to put them in expert order and back, and with an all-to-all
dispatcher and several local experts one more each way to sort the received chunks by local
expert (Megatron-Core's "Permutation 2", torchtitan's permute after its all-to-all)."""

from __future__ import annotations

import pytest

from trainpilot.perf.estimator import Estimator, layout_of
from trainpilot.specs import Plan, load_cluster, load_model


def _moe_layer(ep: int, dispatcher: str):
    model = load_model("qwen3-30b-a3b")
    plan = Plan(dp=8, ep=ep, etp=1, micro_batch_size=2, global_batch_size=64, seq_len=4096,
                runtime=dict(stack="megatron", moe_imbalance=1.0, ep_dispatcher=dispatcher))
    est = Estimator(model, load_cluster("b200-x8"))
    lay = layout_of(model, plan, est.options)
    return est.layer(lay, True, est.spans(lay))


def test_an_all_to_all_dispatcher_sorts_by_local_expert():
    a2a, deepep = _moe_layer(8, "alltoall"), _moe_layer(8, "deepep")
    # Two more kernels each way (forward, and its backward) for the sort and the unsort.
    assert a2a.num_kernels == deepep.num_kernels + 4
    # They move the token copies: the forward grows by their bytes, not by a rounding error.
    assert a2a.fwd_compute_s > deepep.fwd_compute_s * 1.005
    # Negative control: without expert parallelism there is nothing to sort after a
    # collective, and the two dispatchers cost the same.
    one_a2a, one_deepep = _moe_layer(1, "alltoall"), _moe_layer(1, "deepep")
    assert one_a2a.num_kernels == one_deepep.num_kernels
    assert one_a2a.fwd_compute_s == pytest.approx(one_deepep.fwd_compute_s)
