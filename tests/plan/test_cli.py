"""The predict / plan verbs end to end (subprocesses, as a user runs them)."""

from __future__ import annotations

import json

from tests.conftest import run_cli

ISSUE_KEYS = {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "hfu", "memory_gib",
              "breakdown_s", "fits"}


def test_predict_json_is_the_prediction():
    result = run_cli("predict", "--job", "gpt3-175b-a100-1024", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert set(data) >= ISSUE_KEYS and len(data["memory_gib"]["per_stage"]) == 16


def test_predict_impossible_plan_exits_2_with_one_line():
    result = run_cli("predict", "--model", "gpt3-175b", "--cluster", "a100-80gb-x1024",
                     "--plan", "tp=5,pp=16,dp=8,global_batch_size=1520,seq_len=2048")
    assert result.returncode == 2
    err = result.stderr.strip()
    assert "plan.tp" in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_plan_json_and_export(tmp_path):
    result = run_cli("plan", "--model", "llama3-8b", "--cluster", "h100-sxm-x16",
                     "--global-batch-size", "64", "--seq-len", "4096", "--top", "3", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert {"enumerated", "feasible", "wall_s"} <= set(data["search"])
    assert len(data["plans"]) == 3 and set(data["plans"][0]) >= ISSUE_KEYS
    assert data["plans"][0]["plan"]["dp"] * data["plans"][0]["plan"]["tp"] * \
        data["plans"][0]["plan"]["pp"] * data["plans"][0]["plan"]["cp"] == 16
    out = tmp_path / "best.sbatch"
    result = run_cli("plan", "--model", "llama3-8b", "--cluster", "h100-sxm-x16",
                     "--global-batch-size", "64", "--seq-len", "4096", "--export", "slurm",
                     "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert "--nnodes=2" in out.read_text()


def test_plan_with_no_fit_exits_1_with_the_shortfall():
    result = run_cli("plan", "--model", "llama3-405b", "--cluster", "h100-sxm-x8",
                     "--global-batch-size", "8", "--seq-len", "8192")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no plan fits" in result.stdout and "more devices" in result.stdout
