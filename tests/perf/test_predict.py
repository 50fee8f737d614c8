"""predict(): the contract other layers code against, and physical sanity of the answers."""

from __future__ import annotations

import pytest

from trainpilot.perf import CostOptions, Estimator, Prediction, StageCost, layout_of, predict
from trainpilot.specs import Plan, SpecError, load_cluster, load_job, load_model

ISSUE_KEYS = {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "hfu", "memory_gib",
              "breakdown_s", "fits"}
BREAKDOWN = {"compute", "recompute", "tp_comm", "pp_comm", "pp_bubble", "dp_comm_exposed",
             "ep_comm", "cp_comm", "optimizer"}
STAGE_MEMORY = {"weights", "grads", "optimizer", "activations", "other", "total"}


@pytest.mark.parametrize("job", ["gpt3-175b-a100-1024", "llama3-405b-h100-16384",
                                 "deepseek-v3-h800-2048", "llama3-8b-h100-8", "tiny-gpt-cpu-2"])
def test_contract_and_breakdown_sums_to_the_step(job):
    j = load_job(job)
    pred = predict(j.model, j.cluster, j.plan)
    assert isinstance(pred, Prediction)
    data = pred.to_dict()
    assert set(data) >= ISSUE_KEYS
    assert set(data["breakdown_s"]) == BREAKDOWN
    assert {"peak", "peak_stage", "per_stage"} <= set(data["memory_gib"])
    assert len(data["memory_gib"]["per_stage"]) == j.plan.pp
    assert all(set(s) == STAGE_MEMORY for s in data["memory_gib"]["per_stage"])
    assert sum(pred.breakdown_s.values()) == pytest.approx(pred.step_time_s, rel=1e-9)
    assert all(v >= 0 for v in pred.breakdown_s.values())
    peak = max(s["total"] for s in data["memory_gib"]["per_stage"])
    assert data["memory_gib"]["peak"] == pytest.approx(peak)
    tokens = j.plan.global_batch_size * j.plan.seq_len
    assert pred.tokens_per_s == pytest.approx(tokens / pred.step_time_s)
    assert 0 < pred.mfu <= pred.hfu < 1
    stage = pred.stages[0]
    assert isinstance(stage, StageCost) and stage.layers > 0 and stage.fwd_s > 0
    assert stage.bwd_s > stage.fwd_s
    grad_bytes = 2 if j.plan.precision == "fp16" or j.plan.comm.compression in ("fp16", "bf16") \
        else 4
    assert sum(stage.dp_bucket_bytes) == int(grad_bytes * stage.params)


def test_an_impossible_plan_names_the_constraint():
    model, cluster = load_model("gpt3-175b"), load_cluster("a100-80gb-x1024")
    bad = Plan(tp=5, pp=16, dp=8, global_batch_size=1520, seq_len=2048)
    with pytest.raises(SpecError, match="plan.tp"):
        predict(model, cluster, bad)
    wrong_size = Plan(tp=8, pp=8, dp=8, global_batch_size=1536, seq_len=2048)
    with pytest.raises(SpecError, match="1024 devices"):
        predict(model, cluster, wrong_size)


def _gpt3(**changes):
    plan = dict(tp=8, pp=16, dp=8, micro_batch_size=1, global_batch_size=1536, seq_len=2048,
                recompute="none", sequence_parallel=True)
    plan.update(changes)
    return predict(load_model("gpt3-175b"), load_cluster("a100-80gb-x1024"), Plan(**plan))


def test_recompute_trades_time_for_memory():
    none, sel, full = (_gpt3(recompute=r) for r in ("none", "selective", "full"))
    assert none.step_time_s < sel.step_time_s < full.step_time_s
    assert none.memory_gib["peak"] > sel.memory_gib["peak"] > full.memory_gib["peak"]
    assert full.breakdown_s["recompute"] > sel.breakdown_s["recompute"] > 0
    assert none.breakdown_s["recompute"] == 0
    assert full.hfu > full.mfu and none.hfu == pytest.approx(none.mfu)


def test_sharding_optimizer_state_saves_memory():
    z0, z1, z3 = (_gpt3(zero=z) for z in (0, 1, 3))
    assert z0.memory_gib["per_stage"][1]["optimizer"] > z1.memory_gib["per_stage"][1]["optimizer"]
    assert z1.memory_gib["peak"] > z3.memory_gib["peak"]


def test_uniform_pipeline_bubble_is_narayanans():
    # Uniform stages (no edge layers): the bubble is (p-1)/(v m) of the busy time.
    model = load_model("gpt3-175b").replace(vocab_size=8, max_position_embeddings=2048)
    cluster = load_cluster("a100-80gb-x1024")
    for vp in (1, 2):
        plan = Plan(tp=8, pp=16, vp=vp, dp=8, global_batch_size=1536, seq_len=2048,
                    recompute="full")
        costing = Estimator(model, cluster).evaluate(layout_of(model, plan))
        m, p = plan.num_micro_batches, plan.pp
        busy = max(s.period_s for s in costing.stages)
        assert costing.breakdown_s["pp_bubble"] == pytest.approx(busy * (p - 1) / vp, rel=0.01)
        assert costing.breakdown_s["compute"] + costing.breakdown_s["recompute"] + \
            costing.breakdown_s["tp_comm"] == pytest.approx(m * busy, rel=1e-6)


def test_uneven_edge_stages_hold_fewer_layers():
    j = load_job("llama3-405b-h100-16384")
    pred = predict(j.model, j.cluster, j.plan)
    assert [s.layers for s in pred.stages] == [7] + [8] * 14 + [7]


def test_legacy_attention_stores_scores():
    j = load_job("gpt3-175b-a100-1024")
    plan = j.plan.replace(recompute="none", sequence_parallel=True)
    flash = predict(j.model, j.cluster, plan)
    legacy = predict(j.model, j.cluster, plan, options=CostOptions(flash_attention=False))
    assert legacy.memory_gib["peak"] > flash.memory_gib["peak"]
    assert legacy.step_time_s > flash.step_time_s


def test_overlapping_gradient_traffic_hides_it():
    overlapped = _gpt3(zero=1)
    exposed = _gpt3(zero=1, comm=dict(overlap=False))
    assert exposed.breakdown_s["dp_comm_exposed"] > overlapped.breakdown_s["dp_comm_exposed"]
    assert exposed.stages[0].dp_comm_s == pytest.approx(overlapped.stages[0].dp_comm_s)


def test_rank_map_covers_every_device():
    j = load_job("gpt3-175b-a100-1024")
    pred = predict(j.model, j.cluster, j.plan)
    rows = pred.rank_map()
    assert len(rows) == 1024 and len({(r["node"], r["device"]) for r in rows}) == 1024
    coords = {(r["tp"], r["cp"], r["dp"], r["pp"]) for r in rows}
    assert len(coords) == 1024
