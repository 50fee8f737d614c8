"""The run store: round trips, batching, read-only readers, restarts, knowledge across runs."""

from __future__ import annotations

import math
import sqlite3

import pytest

from trainpilot.specs.errors import SpecError
from trainpilot.store import RankTiming, RunStore, consult


def test_round_trip_of_every_table(tmp_path):
    with RunStore.create(tmp_path, name="exp", world_size=2, flush_every_steps=1000) as w:
        w.set_document("plan", {"dp": 2})
        w.log_metrics(1, {"loss": 3.0, "grad_norm/blocks.0": 0.5})
        w.log_metrics(2, {"loss": math.nan, "grad_norm/blocks.0": math.inf})
        w.log_rank_timings([RankTiming(step=2, rank=r, step_s=0.1, compute_s=0.05 * (r + 1),
                                       comm_s=0.02, data_s=0.001) for r in range(2)])
        event_id = w.log_event("alert", 2, {"z": 9.0}, severity="critical",
                               name="divergence_risk", message="loss up")
        w.log_forecast(2, {"final_loss": 2.5})
        w.log_knowledge("divergence_risk", "skip_batch", "recovered", evidence="z=9")
        run_id = w.run_id
    r = RunStore.open_readonly(tmp_path)
    assert r.run().status == "completed" and r.run().name == "exp" and r.run_id == run_id
    assert r.documents() == {"plan": {"dp": 2}}
    series = r.metrics(["loss", "grad_norm/blocks.0"])
    assert series["loss"][0] == (1, 3.0) and math.isnan(series["loss"][1][1])  # NaN survives
    assert series["grad_norm/blocks.0"][1] == (2, math.inf)
    assert r.metric_names("grad_norm/") == ["grad_norm/blocks.0"]
    assert r.metrics(["loss"], since_step=1)["loss"][0][0] == 2
    assert [t.compute_s for t in r.rank_timings()] == [0.05, 0.1]
    alerts = r.events(kinds=["alert"])
    assert [(e.id, e.name, e.payload["z"]) for e in alerts] == [(event_id, "divergence_risk", 9.0)]
    assert [e.kind for e in r.events(since_id=event_id)] == ["run_end"]
    assert r.latest_forecast() == {"final_loss": 2.5}
    assert r.knowledge("divergence_risk")[0]["outcome"] == "recovered"
    assert r.integrity_check() == "ok"
    with pytest.raises(PermissionError):
        r.log_metrics(3, {"loss": 1.0})


def test_batches_become_visible_to_a_reader_only_when_flushed(tmp_path):
    w = RunStore.create(tmp_path, flush_every_steps=5, flush_interval_s=3600)
    r = RunStore.open_readonly(tmp_path)
    for step in range(1, 5):
        w.log_metrics(step, {"loss": 1.0 / step})
    assert r.latest_step() is None and w.flushed_step is None  # batch still in memory
    w.log_metrics(5, {"loss": 0.2})  # 5th step completes the batch
    assert r.latest_step() == 5 and w.flushed_step == 5
    w.log_metrics(6, {"loss": 0.1})
    w.log_event("checkpoint", 6)  # an event commits the pending batch first (order on disk)
    assert r.latest_metrics() == (6, {"loss": 0.1})
    w.close(status="completed")


def test_reopening_marks_a_resume_and_keeps_rows(tmp_path):
    first = RunStore.create(tmp_path)
    first.log_metrics(1, {"loss": 2.0})
    first.close(status="failed")
    again = RunStore.create(tmp_path)
    assert again.resumed and again.run_id == first.run_id
    again.log_metrics(1, {"loss": 1.5})  # a repeated step replaces the earlier row
    again.close(status="completed")
    r = RunStore.open_readonly(tmp_path)
    assert r.series("loss") == ([1], [1.5])
    assert [e.kind for e in r.events()] == ["run_start", "run_end", "run_resumed", "run_end"]


def test_bad_arguments_are_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="flush_every_steps"):
        RunStore.create(tmp_path, flush_every_steps=0)
    with pytest.raises(SpecError, match="run_dir"):
        RunStore.open_readonly(tmp_path / "missing")


def test_knowledge_is_consulted_across_sibling_runs(tmp_path):
    for name, outcomes in (("a", ["recovered", "recovered"]), ("b", ["not_recovered"])):
        with RunStore.create(tmp_path / name) as store:
            for outcome in outcomes:
                store.log_knowledge("divergence_risk", "skip_batch", outcome)
            store.log_knowledge("divergence_risk", "rollback", "recovered")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "trainpilot.db").write_text("not a database")  # skipped, not fatal
    found = consult(tmp_path, "divergence_risk")
    by_action = {e.action: e for e in found}
    assert by_action["skip_batch"].num_tried == 3 and by_action["skip_batch"].num_recovered == 2
    assert by_action["skip_batch"].num_runs == 2
    assert found[0].action == "rollback"  # best success rate first
    assert consult(tmp_path, "device_oom") == []


def test_append_does_not_mark_a_finished_run_running(tmp_path):
    with RunStore.create(tmp_path):
        pass
    store = RunStore.append(tmp_path)
    store.log_event("diagnosis", None, {"category": "network"})
    store.close()
    r = RunStore.open_readonly(tmp_path)
    assert r.run().status == "completed"
    assert [e.kind for e in r.events()] == ["run_start", "run_end", "diagnosis"]


def test_readonly_connection_cannot_write_even_through_sql(tmp_path):
    with RunStore.create(tmp_path):
        pass
    r = RunStore.open_readonly(tmp_path)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        r._conn.execute("DELETE FROM events")
