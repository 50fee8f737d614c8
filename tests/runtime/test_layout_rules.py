"""What the runtime refuses before anything starts, the mesh it builds, and how pipeline stages
are cut (pure logic, no process group)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainpilot.runtime.layout import check_runtime, mesh_axes
from trainpilot.runtime.parallelize import stage_plan
from trainpilot.specs import SpecError, load_model, load_plan

BATCH = "micro_batch_size=1,global_batch_size=8,seq_len=64"


@pytest.mark.parametrize("model, plan, world, match", [
    ("tiny-moe", "cp=2," + BATCH, 2, "context parallelism with the MoE"),
    ("tiny-gpt", "cp=2,dp=2,zero=3,dp_shard=2," + BATCH, 4, "hybrid sharding with context"),
    ("tiny-gpt", "cp=3,seq_len=64,micro_batch_size=1,global_batch_size=8", 3,
     "2 \\* cp = 6 equal chunks"),  # check_job's rule
    ("tiny-gpt", "precision=fp8," + BATCH, 1, "torchao"),
    ("tiny-gpt", "dp=2," + BATCH, 4, "must equal the 4 processes"),
    ("tiny-moe", "tp=2," + BATCH, 2, "expert tensor parallelism"),
    ("tiny-moe", "dp=4,ep=2,zero=3,dp_shard=2," + BATCH, 4, "hybrid sharding with expert"),
    ("tiny-gpt", "pp=2,micro_batch_size=1,global_batch_size=1,seq_len=64", 2,
     "needs at least pp=2"),
    ("deepseek-v3", "tp=1," + BATCH, 1, "latent attention"),
    ("tiny-gpt", "tp=3," + BATCH, 3, "does not divide num_attention_heads"),  # check_job's rule
])
def test_refused_before_start(model, plan, world, match):
    with pytest.raises(SpecError, match=match):
        check_runtime(load_model(model), load_plan(plan), backend="gloo", world_size=world)


def test_fp16_refused_on_a_cpu_that_emulates_it_and_accepted_on_gpus(monkeypatch):
    import trainpilot.runtime.layout as layout

    plan, model = load_plan("precision=fp16," + BATCH), load_model("tiny-gpt")
    monkeypatch.setattr(layout, "cpu_has_native_fp16", lambda: False)
    with pytest.raises(SpecError, match="emulated on this CPU"):
        check_runtime(model, plan, backend="gloo", world_size=1)
    check_runtime(model, plan, backend="nccl", world_size=1)  # GPUs: dynamic loss scaling
    monkeypatch.setattr(layout, "cpu_has_native_fp16", lambda: True)
    check_runtime(model, plan, backend="gloo", world_size=1)  # a CPU with AVX512-FP16/AMX


def test_context_parallel_accepted_with_dense_layouts():
    gpt = load_model("tiny-gpt")
    for plan in ("cp=2", "cp=2,dp=2,zero=3", "cp=2,tp=2,sequence_parallel=true", "cp=2,pp=2"):
        doc = load_plan(plan + "," + BATCH)
        check_runtime(gpt, doc, backend="gloo", world_size=doc.world_size)


def test_tied_embeddings_need_one_stage_and_one_tp_rank():
    tied = load_model("tiny-gpt").replace(tie_word_embeddings=True)
    check_runtime(tied, load_plan("dp=2," + BATCH), backend="gloo", world_size=2)  # fine
    with pytest.raises(SpecError, match="tied embeddings"):
        check_runtime(tied, load_plan("pp=2," + BATCH), backend="gloo", world_size=2)


@pytest.mark.parametrize("plan, names, sizes, flat", [
    # The plan's default rank order, tp-cp-ep-pp-dp: data parallel varies slowest, the
    # pipeline stages sit inside each replica (the first mesh axis varies slowest).
    ("dp=2,tp=2", ["dp", "pp", "tp"], [2, 1, 2], {}),
    ("dp=4,ep=2", ["edp", "pp", "ep", "tp"], [2, 1, 2, 1], {"dp": ("edp", "ep")}),
    ("dp=4,zero=3,dp_shard=2,pp=2", ["dp_replicate", "dp_shard", "pp", "tp"], [2, 2, 2, 1],
     {"dp": ("dp_replicate", "dp_shard")}),
    # cp between data and tp; gradients are averaged over the flattened dp x cp.
    ("dp=2,cp=2,tp=2", ["dp", "pp", "cp", "tp"], [2, 1, 2, 2], {"dp_cp": ("dp", "cp")}),
    # Megatron's default order: the stages vary slowest.
    ("dp=2,pp=2,rank_order=tp-cp-ep-dp-pp", ["pp", "dp", "tp"], [2, 2, 1], {}),
    ("dp=4,ep=2,pp=2,rank_order=tp-cp-ep-dp-pp", ["pp", "edp", "ep", "tp"], [2, 2, 2, 1],
     {"dp": ("edp", "ep")}),
])
def test_mesh_axes(plan, names, sizes, flat):
    assert mesh_axes(load_plan(plan + "," + BATCH)) == (names, sizes, flat)


def _stages(model, plan, pp_rank):
    spec, plan = load_model(model), load_plan(plan)
    return stage_plan(spec, SimpleNamespace(plan=plan, pp_rank=pp_rank))


def test_stage_cut_even_uneven_and_interleaved():
    assert _stages("tiny-gpt", "pp=2," + BATCH, 1) == [(1, [2, 3])]
    uneven = "pp=2,pp_first_stage_layers=1," + BATCH
    assert _stages("tiny-gpt", uneven, 0) == [(0, [0])]
    assert _stages("tiny-gpt", uneven, 1) == [(1, [1, 2, 3])]
    # vp=2: four stages of one layer; rank 0 holds stages 0 and 2 (Megatron's interleaving).
    assert _stages("tiny-gpt", "pp=2,vp=2," + BATCH, 0) == [(0, [0]), (2, [2])]
    assert _stages("tiny-gpt", "pp=2,vp=2," + BATCH, 1) == [(1, [1]), (3, [3])]
