"""The step timeline: a hand-built schedule, the closed-form bubble, and where they differ."""

from __future__ import annotations

import json

import pytest

from trainpilot.sim.step import (
    chrome_trace,
    explain,
    simulate_plan,
    step_spec_from_prediction,
    write_chrome_trace,
)
from trainpilot.sim.timeline import TRACK_COMPUTE, TRACK_DP, StageCosts, StepSpec, simulate_step
from trainpilot.specs import load_job, stage_layers

UNIFORM = StageCosts(fwd_s=1.0, bwd_s=2.0)


def _compute(result, rank):
    return [(name, start) for r, track, name, start, _ in result.events
            if r == rank and track == TRACK_COMPUTE]


def test_hand_built_two_stages_four_micro_batches():
    """1F1B, F = 1 s, B = 2 s, free links. Worked by hand: rank 1 (last) alternates F, B from
    t=1; rank 0 warms up with one extra forward, then waits for each gradient."""
    result = simulate_step(StepSpec(stages=(UNIFORM, UNIFORM), num_micro_batches=4))
    assert _compute(result, 0) == [
        ("F0", 0.0), ("F1", 1.0), ("B0", 4.0), ("F2", 6.0), ("B1", 7.0), ("F3", 9.0),
        ("B2", 10.0), ("B3", 13.0), ("optimizer", 15.0)]
    assert _compute(result, 1) == [
        ("F0", 1.0), ("B0", 2.0), ("F1", 4.0), ("B1", 5.0), ("F2", 7.0), ("B2", 8.0),
        ("F3", 10.0), ("B3", 11.0), ("optimizer", 13.0)]
    assert result.step_time_s == 15.0
    assert result.bubble_fraction == 0.25 == result.closed_form_bubble  # (2-1)/4
    idle = [r.to_dict(result.step_time_s)["idle_s"] for r in result.ranks]
    assert idle == [3.0, 3.0]  # rank 1 finishes its 12 s of work at 13 s, then waits for rank 0


@pytest.mark.parametrize("schedule,vp", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                         ("interleaved", 4)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 32)])
def test_uniform_stages_match_the_closed_form_bubble(schedule, vp, pp, m):
    result = simulate_step(StepSpec(stages=(UNIFORM,) * pp, num_micro_batches=m,
                                    schedule=schedule, vp=vp))
    assert result.bubble_fraction == pytest.approx((pp - 1) / (vp * m), abs=1e-12)
    assert result.step_time_s == pytest.approx(3.0 * m * (1 + (pp - 1) / (vp * m)))


def test_the_bubble_check_distinguishes_schedules():
    """Negative control: interleaving really changes the simulated bubble, so equality with
    (p-1)/(v m) above is not an accident of the formula."""
    plain = simulate_step(StepSpec(stages=(UNIFORM,) * 4, num_micro_batches=8))
    inter = simulate_step(StepSpec(stages=(UNIFORM,) * 4, num_micro_batches=8,
                                   schedule="interleaved", vp=2))
    assert plain.bubble_fraction == pytest.approx(3 / 8)
    assert inter.bubble_fraction == pytest.approx(3 / 16)


def test_where_they_differ_heavier_last_stage_links_and_the_dp_tail():
    heavy = StageCosts(fwd_s=1.5, bwd_s=3.0, p2p_s=0.1, dp_comm_s=4.0,
                       dp_bucket_bytes=(25e6,) * 8)
    light = StageCosts(fwd_s=1.0, bwd_s=2.0, p2p_s=0.1, dp_comm_s=4.0,
                       dp_bucket_bytes=(25e6,) * 8)
    spec = StepSpec(stages=(light, light, light, heavy), num_micro_batches=8)
    result = simulate_step(spec)
    assert result.bubble_fraction != pytest.approx(result.closed_form_bubble, abs=0.01)
    notes = " ".join(explain(result, spec))
    assert "uneven" in notes and "transfer" in notes and "gradient tail" in notes
    tails = [r.to_dict(result.step_time_s)["exposed_dp_s"] for r in result.ranks]
    # Buckets start during the last backward, so less than the 4 s of traffic is exposed.
    assert all(0 < tail < 4.0 for tail in tails)
    no_overlap = simulate_step(StepSpec(stages=spec.stages, num_micro_batches=8,
                                        dp_overlap=False))
    assert [r.to_dict(no_overlap.step_time_s)["exposed_dp_s"] for r in no_overlap.ranks] == \
        pytest.approx([4.0] * 4)
    assert no_overlap.step_time_s > result.step_time_s


def test_shared_nic_contention_delays_pipeline_sends():
    """Buckets and sends on one NIC: a send that finds a bucket on the wire waits for it."""
    stage = StageCosts(fwd_s=1.0, bwd_s=2.0, p2p_s=0.05, dp_comm_s=8.0,
                       dp_bucket_bytes=(1.0,) * 4)
    split = simulate_step(StepSpec(stages=(stage,) * 4, num_micro_batches=4))
    shared = simulate_step(StepSpec(stages=(stage,) * 4, num_micro_batches=4, shared_nic=True))
    assert shared.pipeline_end_s > split.pipeline_end_s
    buckets = [(s, s + d) for r, t, _, s, d in shared.events if t == TRACK_DP and r == 3]
    sends = [s for r, t, n, s, _ in shared.events if r == 3 and n.startswith("send B3")]
    assert any(start < sends[0] for start, _ in buckets)  # a bucket went first
    assert any(end == pytest.approx(sends[0]) for _, end in buckets)  # the send waited


def test_zero_bubble_defers_weight_gradients_into_the_bubble():
    stage = StageCosts(fwd_s=1.0, bwd_s=2.0, weight_grad_share=0.5)
    one = simulate_step(StepSpec(stages=(stage,) * 4, num_micro_batches=8))
    zb = simulate_step(StepSpec(stages=(stage,) * 4, num_micro_batches=8,
                                schedule="zero_bubble"))
    names = [n for r, t, n, _, _ in zb.events if r == 0 and t == TRACK_COMPUTE]
    assert sum(n.startswith("W") for n in names) == 8
    assert zb.bubble_fraction < one.bubble_fraction
    # Measured: (p-1)(F + B_input) of bubble, 2/3 of 1F1B's (p-1)(F + B); the hand-tuned
    # ZB-H1 schedule of Qi et al. reaches (p-1)(F + B_input - W).
    assert zb.pipeline_end_s - 24.0 == pytest.approx(3 * 2.0)


def test_expert_all_to_alls_block_compute():
    stage = StageCosts(fwd_s=1.0, bwd_s=2.0, ep_comm_s=0.4)
    result = simulate_step(StepSpec(stages=(stage,) * 2, num_micro_batches=4))
    assert result.ranks[0].blocking_comm_s == pytest.approx(4 * 0.4)
    assert result.step_time_s == pytest.approx(5 * 3.4)
    assert any("a2a" in n for _, _, n, _, _ in result.events)


def test_chrome_trace_is_valid_json(tmp_path):
    result = simulate_step(StepSpec(stages=(UNIFORM, UNIFORM), num_micro_batches=4))
    path = tmp_path / "step.json"
    write_chrome_trace(result, path)
    data = json.loads(path.read_text())
    slices = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(result.events)
    assert {"name", "ph", "pid", "tid", "ts", "dur"} <= set(slices[0])
    assert max(e["ts"] + e["dur"] for e in slices) == pytest.approx(15e6)
    assert chrome_trace(result)["otherData"]["step_time_s"] == 15.0


@pytest.mark.parametrize("name", ["gpt3-175b-a100-1024", "llama3-405b-h100-16384",
                                  "deepseek-v3-h800-2048"])
def test_from_the_cost_model_agrees_with_its_step_time(name):
    """The preset jobs (GPT-3: uniform 3-D; Llama 3: interleaved with uneven first/last
    chunks; DeepSeek-V3: EP=64 and uneven stages): the timeline and the cost model's own step
    time agree within 2%, and the bubble is near (p-1)/(v m) — within 10% when every rank holds
    the same layers, and otherwise within 25% (lighter edge stages shorten the fill and drain,
    heavier ones lengthen them), with the unevenness named in the explanation."""
    job = load_job(name)
    result, pred = simulate_plan(job.model, job.cluster, job.plan)
    assert abs(result.step_time_s - pred.step_time_s) / pred.step_time_s < 0.02
    assert len(result.ranks) == job.plan.pp
    layers = stage_layers(job.model, job.plan)
    if len(set(layers)) == 1:
        assert result.bubble_fraction == pytest.approx(result.closed_form_bubble, rel=0.1)
    else:
        assert result.bubble_fraction == pytest.approx(result.closed_form_bubble, rel=0.25)
        notes = explain(result, step_spec_from_prediction(pred, job.plan))
        assert any("stages are uneven" in note for note in notes), notes
    if job.model.is_moe:
        assert all(r.blocking_comm_s > 0 for r in result.ranks[1:])  # the all-to-alls


def test_bad_input_names_the_field():
    from trainpilot.specs.errors import SpecError

    with pytest.raises(SpecError, match="stage.fwd_s"):
        StageCosts(fwd_s=-1.0, bwd_s=1.0)
    with pytest.raises(SpecError, match="num_micro_batches"):
        simulate_step(StepSpec(stages=(UNIFORM,) * 4, num_micro_batches=6,
                               schedule="interleaved", vp=2))
