"""FSDP2 gradient communication (``trainpilot.runtime.comm.fsdp``): the plan's ``comm`` options
are honoured with ``zero >= 1`` instead of silently ignored.

Tier 1: the refusal of top-k/PowerSGD (``check_runtime``, CLI exit 2) and the reduce dtype.
Tier 3 (4 gloo ranks placed as 2 nodes x 2, one spawn): the hierarchical reduce-scatter equals
gloo's bit for bit on integer-valued float64; FSDP2 zero=3 and zero=1 trained with it match flat
FSDP2; the counting wrapper leaves FSDP2's numerics bit-identical; bytes match the kernel's
count; fp16/bf16 reduce dtypes train close to fp32. Negative control: a wrong chunk order in the
same reduce-scatter moves the weights far outside the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm._launch import run_ranks
from tests.conftest import run_cli
from trainpilot.cli.main import main
from trainpilot.runtime.comm.fsdp import fsdp_mp_policy
from trainpilot.runtime.layout import check_runtime
from trainpilot.specs import CommOptions, SpecError, load_model, load_plan

PLAN = "dp=2,micro_batch_size=8,global_batch_size=16,seq_len=64"
# As tests/runtime/test_dist.py: parameters after full AdamW steps (lr 3e-3) within 2e-4.
PARAM_TOL = 2e-4


@pytest.mark.parametrize("compression", ["topk", "powersgd"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_fsdp_refuses_sparse_and_low_rank_compression(zero, compression):
    plan = load_plan(f"{PLAN},zero={zero},comm.compression={compression}")
    with pytest.raises(SpecError, match="topk and powersgd need zero=0 \\(DDP\\)") as err:
        check_runtime(load_model("tiny-gpt"), plan, backend="gloo", world_size=2)
    assert err.value.field == "plan.comm.compression"
    # DDP runs them.
    check_runtime(load_model("tiny-gpt"), load_plan(f"{PLAN},zero=0,comm.compression="
                                                    f"{compression}"), backend="gloo",
                  world_size=2)


def test_cli_refuses_topk_with_fsdp_exit_2(capsys):
    code = main(["train", "--dry-run", "--model", "tiny-gpt", "--plan",
                 f"{PLAN},zero=1,comm.compression=topk"])
    err = capsys.readouterr().err
    assert code == 2 and "plan.comm.compression" in err and "Traceback" not in err
    # The launching path refuses before any process starts: one line, exit 2.
    result = run_cli("train", "--model", "tiny-gpt", "--plan",
                     f"{PLAN},zero=3,comm.compression=powersgd")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0 and "zero>=1" in result.stderr


def test_reduce_dtype_follows_compression():
    assert fsdp_mp_policy(CommOptions(compression="fp16")).reduce_dtype == torch.float16
    assert fsdp_mp_policy(CommOptions(compression="bf16")).reduce_dtype == torch.bfloat16
    policy = fsdp_mp_policy(CommOptions())
    assert policy.reduce_dtype is None and policy.param_dtype is None  # as before: fp32
    with pytest.raises(SpecError):
        fsdp_mp_policy(CommOptions(compression="topk"))


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_fsdp_hierarchical_reduce_scatter(tmp_path):
    results = run_ranks("fsdp", 4, tmp_path, timeout_s=130, module="tests.comm._fsdp_worker")
    out = results[0]
    # The collective alone, against gloo's reduce_scatter.
    for o in results:
        assert o["f64int.equal"] and o["f64int.avg_max_rel"] == 0
        assert o["f32.max_rel"] < 1e-6 and o["f32.avg_max_rel"] < 1e-6  # summation order
        assert not o["wrong_order.equal"]  # negative control: the oracle can fail
        assert o["one_node.levels"] == [4] and o["one_node.equal"]
        assert "needs a cluster" in o["no_cluster.error"]
        for label in ("hier", "flat"):  # the byte model against the kernel's count
            assert o[f"wire.{label}.measured"] == pytest.approx(o[f"wire.{label}.model"],
                                                                rel=2e-3)
        # 4 MiB input: hierarchical = all-to-all of 4 MiB in the node + 2 MiB across nodes;
        # a quarter of the input leaves the node on every rank.
        assert o["wire.hier.model"] == 3 * 2**20 and o["wire.hier.collectives"] == 2
        assert o["wire.hier.off_node"] == 2**20
    # gloo's reduce-scatter is a ring all-reduce (1.5 x input): ranks 1 and 3 send it all across.
    assert [o["wire.flat.off_node"] for o in results] == [0, 6 * 2**20, 0, 6 * 2**20]

    # Training: 3 AdamW steps of tiny-gpt, dp=4 on 2 nodes x 2.
    for zero in ("zero3", "zero1"):
        flat, hier = f"{zero}.flat", f"{zero}.hier"
        assert out[f"{flat}.kind"] == "CountedReduceScatter"
        assert out[f"{hier}.kind"] == "HierarchicalReduceScatter"
        # One reduce-scatter per FSDP module (4 blocks + root) per step: it was really used.
        assert out[f"{hier}.calls"] == out[f"{hier}.num_fsdp_modules"] * 3 == 15
        assert out[f"{hier}.max_diff"] <= PARAM_TOL and out[f"{hier}.loss_diff"] < 1e-5
        assert out[f"{hier}.rel_update_diff"] < 1e-4
        # Bytes per step: hierarchical sends half of gloo's flat reduce-scatter.
        flat_step, hier_step = out[f"{flat}.comm"][-1], out[f"{hier}.comm"][-1]
        assert hier_step["dense_bytes"] == flat_step["dense_bytes"] > 0
        assert flat_step["wire_bytes"] == 1.5 * flat_step["dense_bytes"]
        assert hier_step["wire_bytes"] == 0.75 * hier_step["dense_bytes"]
        assert hier_step["off_node_bytes"] == 0.25 * hier_step["dense_bytes"]
        assert out[f"{hier}.comm_bytes"] == [hier_step["wire_bytes"]] * 3  # in StepRecords
    # Counting does not change FSDP2's numerics: bit-identical to no wrapper at all.
    assert out["zero3.native.kind"] is None and out["zero3.native.max_diff"] == 0
    assert out["zero3.native.loss_diff"] == 0
    # Reduce in fp16 / bf16 (bf16 with the hierarchy): half the bytes, close to fp32, not equal.
    for name, bound in (("zero3.fp16", 0.05), ("zero3.bf16.hier", 0.1)):
        assert out[f"{name}.finite"]
        assert 1e-4 < out[f"{name}.rel_update_diff"] < bound, name
        assert out[f"{name}.loss_diff"] < 1e-3
        assert out[f"{name}.comm"][-1]["dense_bytes"] * 2 == out["zero3.flat.comm"][-1][
            "dense_bytes"]
    assert out["zero3.bf16.hier.kind"] == "HierarchicalReduceScatter"
    # Negative control: the same reduce-scatter with the chunks sent to the wrong ranks.
    wrong = out["zero3.hier.wrong.rel_update_diff"]
    assert out["zero3.hier.wrong.calls"] == 15 and wrong > 0.5
    assert out["zero3.hier.wrong.max_diff"] > 10 * PARAM_TOL
