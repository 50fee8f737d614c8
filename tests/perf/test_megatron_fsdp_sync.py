"""Megatron-Core's own FSDP (ZeRO-2/3 on the megatron stack) reduce-scatters gradients after
every micro-batch whatever no_sync says, so it never holds a step's unsharded gradients; its
distributed optimizer (ZeRO-1) still reduces once per step, and a plan that names grad_sync is
taken at its word."""

from __future__ import annotations

from trainpilot.perf.estimator import Estimator, layout_of
from trainpilot.perf.runtime import resolve
from trainpilot.specs import Plan, load_cluster, load_model


def _plan(zero: int, stack: str, **runtime) -> Plan:
    return Plan(dp=8, zero=zero, micro_batch_size=1, global_batch_size=64, seq_len=4096,
                runtime=dict(stack=stack, **runtime))


def test_megatron_shards_every_micro_batch_at_zero_2_and_3_only():
    model = load_model("llama3-8b")
    rt = resolve(model, _plan(3, "megatron"))
    assert [rt.sync_for(z) for z in (0, 1, 2, 3)] == ["step", "step", "micro_batch",
                                                       "micro_batch"]
    # Negative controls: a plan that names grad_sync, and the PyTorch stacks' FSDP2 (whose
    # set_requires_gradient_sync does accumulate), keep once per step.
    named = resolve(model, _plan(3, "megatron", grad_sync="step"))
    assert named.sync_for(3) == "step"
    assert resolve(model, _plan(3, "pytorch")).sync_for(3) == "step"


def test_megatron_fsdp_holds_only_the_gradient_shard():
    model = load_model("llama3-8b")
    est = Estimator(model, load_cluster("h100-sxm-x8"))

    def peak(**runtime) -> float:
        plan = _plan(3, "megatron", **runtime)  # 8 micro-batches per step
        return est.evaluate(layout_of(model, plan, est.options)).peak_bytes

    sharded, accumulated = peak(), peak(grad_sync="step")
    # Accumulating holds the full fp32 gradients (8B params x 4 bytes, ~30 GiB) besides the
    # shard: the difference is most of that, not a rounding error.
    assert accumulated - sharded > 20 * 2**30
