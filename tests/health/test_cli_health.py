"""`trainpilot monitor` and the demo's health report, on a store written by a real toy run."""

from __future__ import annotations

import io
import json
import logging

import pytest
from rich.console import Console

from tests.conftest import run_cli
from tests.health.toyrun import run_toy_training
from trainpilot.health.config import load_health_config
from trainpilot.health.demo import demo_health
from trainpilot.store import RunStore

logging.getLogger("trainpilot.health").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "toy"
    config = load_health_config().with_interventions(skip_batch_on_spike=True)
    run_toy_training(path, num_steps=120, spike_at=100, config=config)
    return path


def test_monitor_json_snapshot(run_dir):
    result = run_cli("monitor", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    snap = json.loads(result.stdout)
    assert snap["step"] == 120 and snap["run"]["status"] == "completed"
    assert 0 <= snap["health"]["score"] <= 100
    assert snap["health"]["band"] in ("healthy", "watch", "act", "failing")
    assert set(snap["health"]) == {"score", "band", "gradient_flow", "communication", "hardware",
                                   "convergence"}
    assert {"loss", "grad_norm", "tokens_per_s"} <= set(snap["metrics"])
    skip = [i for i in snap["interventions"] if i["action"] == "skip_batch"]
    assert skip[0]["step"] == 100 and skip[-1]["outcome"] == "recovered"
    assert snap["forecast"]["total_steps"] == 120


def test_monitor_once_renders_while_a_writer_is_open(tmp_path):
    writer = RunStore.create(tmp_path, flush_every_steps=1)
    writer.log_metrics(7, {"loss": 2.5, "health/score": 88.0, "health/hardware": 0.52})
    writer.log_event("alert", 7, {}, severity="critical", name="comm_stall",
                     message="one collective took 6.0 s")
    result = run_cli("monitor", str(tmp_path), "--once")
    writer.close(status="completed")
    assert result.returncode == 0, result.stderr
    for text in ("step 7", "health 88/100", "comm_stall", "one collective took 6.0 s", "2.5"):
        assert text in result.stdout


def test_monitor_bad_run_dir_is_one_line_and_exit_2(tmp_path):
    result = run_cli("monitor", str(tmp_path / "nope"), "--once")
    assert result.returncode == 2
    assert "run_dir" in result.stderr and "Traceback" not in result.stderr


def test_demo_health_prints_the_report(run_dir):
    out = io.StringIO()
    snap = demo_health(Console(file=out, width=140), run_dir)
    text = out.getvalue()
    assert "health" in text and "skip_batch" in text and "recovered" in text
    assert "divergence_risk" in text and snap["step"] == 120


def test_active_alerts_end_with_the_process_that_raised_them(tmp_path):
    from trainpilot.health.view import active_alerts

    store = RunStore.create(tmp_path, world_size=1)
    store.log_event("alert", 5, {}, severity="warning", name="loss_spike", message="spike")
    store.log_event("alert", 6, {}, severity="critical", name="non_finite", message="nan")
    store.log_event("alert_cleared", 7, {}, name="loss_spike")
    store.log_event("restart", 8, {"restored_step": 5})  # in process: the monitor lives on
    store.close(status="failed")
    reader = RunStore.open_readonly(tmp_path)
    assert [a["rule"] for a in active_alerts(reader)] == ["non_finite"]
    reader.close()
    # A re-run process reopens the store: its fresh monitor never clears the old alert.
    store = RunStore.create(tmp_path, world_size=1)
    store.log_event("alert", 9, {}, severity="warning", name="slow_rank", message="rank 1")
    store.close(status="completed")
    reader = RunStore.open_readonly(tmp_path)
    assert [a["rule"] for a in active_alerts(reader)] == ["slow_rank"]
