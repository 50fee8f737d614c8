"""What the dashboard and the report draw equals what the store holds (pure logic, no browser)."""

from __future__ import annotations

import json
import math

import pytest

from tests.ui.conftest import NUM_STEPS, STALL_S, STEP_1_S, STEP_S
from trainpilot.store import RankTiming, RunStore
from trainpilot.ui.data import natural_key, run_data
from trainpilot.ui.goodput import goodput_section, measured_goodput
from trainpilot.ui.plan import plan_section
from trainpilot.ui.runs import RunIndex, discover_runs


def test_run_data_equals_the_store(known_run):
    with RunStore.open_readonly(known_run) as store:
        data = run_data(store)
        for name in ("loss", "lr", "step_time_s", "health/score"):
            steps, values = store.series(name)
            got = data["series"][name]
            assert got["steps"] == steps == list(range(1, NUM_STEPS + 1))
            assert [None if math.isnan(v) else v for v in values] == got["values"]
        assert data["series"]["loss"]["values"][6] is None  # the NaN at step 7 is a gap
        # Layers in natural order (blocks.9 before blocks.10), values exact.
        assert data["layers"]["names"] == ["blocks.9.mlp", "blocks.10.mlp", "embed"]
        assert data["layers"]["series"]["blocks.10.mlp"]["values"][4] == pytest.approx(0.05)
        assert sorted(data["ranks"]) == ["0", "1"]
        assert data["ranks"]["0"]["compute_s"]["values"][:2] == [0.04, 0.04]
        assert data["ranks"]["1"]["compute_s"]["values"][:2] == [0.06, 0.06]
        assert data["ranks"]["1"]["compute_s"]["steps"] == list(range(1, NUM_STEPS + 1))
        # tokens/s per rank: the step's tokens (512) split over 2 ranks, over that rank's step.
        assert data["ranks"]["0"]["tokens_per_s"]["values"][2] == pytest.approx(256 / STEP_S)
        assert data["stragglers"] == {"0": pytest.approx(0.04 / 0.06), "1": pytest.approx(1.5)}
        kinds = [e["kind"] for e in data["events"]]
        assert kinds.count("checkpoint") == 3 and "fault" in kinds and "restart" in kinds
        assert data["cursor"] == {"mode": "batch", "batch": store.batch_cursor(),
                                  "step": NUM_STEPS, "event": data["events"][-1]["id"]}
        assert not data["incremental"] and not data["series"]["loss"]["downsampled"]
        json.dumps(data, allow_nan=False)  # the NaN in the alert's payload became null


def test_incremental_reads_return_only_what_is_new(known_run):
    with RunStore.open_readonly(known_run) as reader:
        first = run_data(reader)
        cursor = first["cursor"]
        writer = RunStore.append(known_run)
        writer.log_metrics(NUM_STEPS + 1, {"loss": 0.5, "grad_norm/embed": 2e-3})
        writer.log_rank_timings([RankTiming(step=NUM_STEPS + 1, rank=r, step_s=0.1)
                                 for r in (0, 1)])
        writer.log_event("note", NUM_STEPS + 1, message="late")  # commits the batch too
        writer.close()
        delta = run_data(reader, since_batch=cursor["batch"], since_event=cursor["event"])
    new = NUM_STEPS + 1
    assert delta["incremental"]
    assert delta["series"]["loss"] == {"steps": [new], "values": [0.5], "lo": new, "hi": new,
                                       "downsampled": False}
    assert delta["series"]["lr"]["steps"] == []  # nothing new in [lo, hi]
    assert delta["layers"]["series"]["embed"]["values"] == [2e-3]
    assert delta["ranks"]["1"]["step_s"]["steps"] == [new]
    assert [e["message"] for e in delta["events"]] == ["late"]
    assert delta["cursor"]["step"] == new and delta["cursor"]["batch"] > cursor["batch"]


def test_natural_order():
    names = ["blocks.10", "blocks.9", "embed", "blocks.1"]
    assert sorted(names, key=natural_key) == ["blocks.1", "blocks.9", "blocks.10", "embed"]


def test_goodput_measured_from_the_events(known_run):
    with RunStore.open_readonly(known_run) as store:
        measured = measured_goodput(store)
        events = {e.kind: e for e in store.events(kinds=["fault", "restart"])}
        run = store.run()
        section = goodput_section(store)
    sec = measured["seconds"]
    assert sec["productive"] == pytest.approx(STEP_1_S + 28 * STEP_S)  # step 12 was skipped
    assert sec["skipped_updates"] == pytest.approx(STEP_S)
    assert sec["checkpoint_stall"] == pytest.approx(3 * STALL_S)
    assert measured["lost_steps"] == 5  # fault at step 20, resumed from step 15
    assert sec["lost_progress"] == pytest.approx(5 * STEP_S)  # x the median step time
    assert sec["recovery"] == pytest.approx(events["restart"].time - events["fault"].time)
    assert measured["wall_s"] == pytest.approx(run.ended_time - run.started_time)
    assert sec["other"] > 0
    assert sum(sec.values()) == pytest.approx(measured["wall_s"])
    # The simulator ran on this run's measured inputs (one fault: a measured MTBF).
    assert section["simulated"] is not None, section["sim_note"]
    assert "measured" in section["sim_inputs"]["failures"]
    assert 0 < section["simulated_ettr"] < 1
    assert section["simulated"]["checkpoint_stall"] > 0


def test_goodput_simulator_defaults_without_faults(tmp_path):
    from tests.ui.conftest import write_known_store

    with RunStore.open_readonly(write_known_store(tmp_path / "r", with_fault=False)) as store:
        section = goodput_section(store)
    assert section["measured"]["num_faults"] == 0
    assert "Llama 3" in section["sim_inputs"]["failures"]
    # Without faults the model's only badput at this scale is the checkpoint stall.
    sim = section["simulated"]
    assert sim["lost_progress"] < 1e-6 and sim["recovery"] < 1e-3


def test_plan_predicted_vs_measured(tmp_path):
    from trainpilot.perf.predict import predict
    from trainpilot.specs import load_job

    job = load_job("gpt3-175b-a100-1024")
    store = RunStore.create(tmp_path / "r", name="planned")
    for kind, doc in (("model", job.model), ("cluster", job.cluster), ("plan", job.plan)):
        store.set_document(kind, doc.to_dict())
    for step, seconds in enumerate([30.0, 12.0, 14.0, 13.0], start=1):
        store.log_metrics(step, {"step_time_s": seconds})
    store.close(status="completed")
    with RunStore.open_readonly(tmp_path / "r") as reader:
        section = plan_section(reader, tmp_path / "r")
    expected = predict(job.model, job.cluster, job.plan).step_time_s
    assert section["predicted_step_time_s"] == pytest.approx(expected)
    assert "trainpilot.perf.predict" in section["prediction_source"]
    assert section["measured_step_time_s"] == 13.0  # median of steps 2-4 (warm-up excluded)
    assert section["error_pct"] == pytest.approx(100 * (expected - 13.0) / 13.0)
    assert section["layout"]["tp"] == 8 and section["layout"]["pp"] == 16


def test_plan_recorded_prediction_wins_and_missing_one_is_explained(known_run, tmp_path):
    with RunStore.open_readonly(known_run) as store:
        section = plan_section(store, known_run)
    assert section["predicted_step_time_s"] is None
    assert section["prediction_source"].startswith("not available")
    store = RunStore.append(known_run)
    store.set_document("summary", {"predicted_step_time_s": 0.08})
    store.close()
    with RunStore.open_readonly(known_run) as store:
        section = plan_section(store, known_run)
    assert section["predicted_step_time_s"] == 0.08
    assert section["measured_over_predicted"] == pytest.approx(STEP_S / 0.08)


def test_discovery_finds_runs_and_nothing_else(tmp_path):
    from tests.ui.conftest import write_known_store

    write_known_store(tmp_path / "a", with_fault=False)
    write_known_store(tmp_path / "group" / "b", with_fault=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / ".hidden").mkdir()
    write_known_store(tmp_path / ".hidden" / "c", with_fault=False)
    assert list(discover_runs(tmp_path)) == ["a", "group/b"]
    index = RunIndex(tmp_path)
    assert not index.is_single_run
    assert index.store("../etc") is None and index.store("/etc") is None
    rows = index.rows()
    assert [r["key"] for r in rows] == ["a", "group/b"]
    assert rows[0]["status"] == "completed" and rows[0]["step"] == NUM_STEPS
    index.close()
