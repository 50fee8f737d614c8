"""``trainpilot simulate`` end to end, in a fresh process each."""

from __future__ import annotations

import json

from tests.conftest import run_cli


def test_availability_json_keys_and_agreement():
    result = run_cli("simulate", "availability", "--nodes", "2048", "--days", "54",
                     "--trials", "200", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in ("ettr", "ettr_ci95", "interruptions", "badput_h", "optimal_interval_min",
                "mtbf_h"):
        assert key in data, key
    assert set(data["badput_h"]) >= {"checkpoint_stall", "lost_progress", "detection",
                                     "restart", "restore", "spare_wait"}
    assert abs(data["interruptions"] - 419) < 15
    assert abs(data["mtbf_h"] - 54 * 24 / 419) < 1e-9
    cf = data["closed_form"]
    low, high = data["ettr_ci95"]
    sigma = (high - low) / 2 / 1.96
    assert abs(data["ettr"] - cf["ettr"]) <= 3 * sigma  # within Monte-Carlo error


def test_step_writes_a_trace(tmp_path):
    trace = tmp_path / "step.json"
    result = run_cli("simulate", "step", "--model", "llama3-8b", "--cluster", "h100-sxm-x16",
                     "--plan", "tp=4,pp=4,global_batch_size=16,seq_len=4096",
                     "--trace", str(trace), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["schedule"] == "1f1b" and data["num_micro_batches"] == 16
    assert abs(data["step_time_s"] - data["cost_model_step_time_s"]) / data["step_time_s"] < 0.05
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) > 4 * 16 * 2


def test_scaling_json():
    result = run_cli("simulate", "scaling", "--model", "llama3-8b", "--cluster", "h100-sxm-x64",
                     "--devices", "64,128", "--global-batch-size", "512", "--seq-len", "8192",
                     "--tokens", "1e12", "--price", "2.5", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["rows"]
    assert [r["num_devices"] for r in rows] == [64, 128]
    assert rows[0]["cost_usd"] > 0 and rows[0]["wall_days"] > rows[0]["train_days"]


def test_bad_input_is_one_line_and_exit_2():
    result = run_cli("simulate", "availability", "--nodes", "16", "--interval-min", "0.1",
                     "--durable-s", "600")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: checkpoint.interval_min: got 0.1")
    assert "Traceback" not in result.stderr
    result = run_cli("simulate", "step", "--model", "llama3-8b")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    result = run_cli("simulate", "availability", "--nodes", "16", "--correlated", "2")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: failures.correlated_fraction: got 2.0")
    result = run_cli("simulate", "step", "--job", "gpt3-175b-a100-1024", "--schedule",
                     "interleaved")
    assert result.returncode == 2 and "pp_schedule" in result.stderr
