"""``trainpilot train``: a real torchrun launch end to end, the dry run, and bad input refused
before anything starts (exit 2, one line)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

from tests.conftest import run_cli
from trainpilot.cli.main import main

PLAN = "dp=2,zero=1,micro_batch_size=8,global_batch_size=16,seq_len=64"


def run_launcher(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``trainpilot ARGS`` in its own session. On a hang: SIGTERM to the launcher first, which
    makes torchrun's agent stop its workers (they run in their own sessions), then SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-m", "trainpilot", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        raise AssertionError(f"trainpilot {' '.join(args)} hung; stderr:\n{err[-3000:]}") \
            from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_train_under_torchrun_writes_the_run(tmp_path):
    run_dir = tmp_path / "run"
    result = run_launcher("train", "--model", "tiny-gpt", "--plan", PLAN, "--steps", "3",
                          "--warmup-steps", "1", "--run-dir", str(run_dir), "--json",
                          timeout_s=200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["steps"] == 3 and summary["layout"]["world_size"] == 2
    assert summary["layout"]["backend"] == "gloo"
    assert summary["first_loss"] == pytest.approx(5.55, abs=0.1)  # ln(256): an untrained model
    assert summary["data"]["entropy_rate_nats"] < summary["first_loss"]
    assert summary["calibration"]["matmul_tflops"] > 0
    assert summary["calibration"]["allreduce_busbw_gbps"] > 0
    assert summary["predicted_step_time_s"] is None or summary["predicted_step_time_s"] > 0
    names = {p.name for p in run_dir.iterdir()}
    assert {"model.yaml", "plan.yaml", "train.yaml", "env.json", "metrics.jsonl",
            "summary.json", "cluster.yaml"} <= names
    assert yaml.safe_load((run_dir / "model.yaml").read_text())["name"] == "tiny-gpt"
    assert yaml.safe_load((run_dir / "plan.yaml").read_text())["dp"] == 2
    steps = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3] and all(s["tokens"] == 1024 for s in steps)
    assert not list(run_dir.glob(".*.tmp*"))  # atomic writes left no temporaries


def test_unrunnable_plan_exits_2_with_one_line():
    result = run_cli("train", "--model", "tiny-moe", "--plan",
                     "cp=2,micro_batch_size=1,global_batch_size=8,seq_len=64")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "plan.cp" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("extra, match", [
    (["--nproc-per-node", "3"], "must equal the 3 processes"),
    (["--steps", "0"], "train.steps"),
    (["--data", "/nonexistent.bin"], "no such file"),
])
def test_bad_launch_input_exits_2(extra, match, capsys, tmp_path):
    argv = ["train", "--model", "tiny-gpt", "--plan", PLAN, "--run-dir", str(tmp_path / "r")]
    code = main(argv + extra)
    assert code == 2 and match in capsys.readouterr().err.replace("\n", " ")
    assert not (tmp_path / "r").exists()  # refused before the run directory was made


def test_resume_from_a_step_without_that_checkpoint_is_refused(tmp_path, capsys):
    # A run directory that holds a run resumes by default (tests/external); asking for a
    # checkpoint it does not have is bad input, refused before anything starts.
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    code = main(["train", "--model", "tiny-gpt", "--plan", PLAN, "--run-dir", str(tmp_path),
                 "--resume", "5"])
    assert code == 2 and "no checkpoint at step 5; valid: none" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_dry_run_reports_each_ranks_share(capsys):
    code = main(["train", "--dry-run", "--json", "--model", "llama3-8b", "--cluster",
                 "h100-sxm-x8", "--plan", "dp=8,zero=3,global_batch_size=64,seq_len=8192"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    # 8 FSDP ranks hold identical shares: one representative rank is built.
    assert [r["params"] for r in report["ranks"]] == [report["total_params"] // 8]
    assert report["ranks"][0]["model_states_gib"] == pytest.approx(
        report["total_params"] / 8 * 16 / 2**30)
    assert report["device_hbm_gib"] == pytest.approx(79.65)  # nvidia-smi: 81,559 MiB

    code = main(["train", "--dry-run", "--json", "--model", "tiny-gpt", "--plan",
                 "tp=2,pp=2,micro_batch_size=1,global_batch_size=8,seq_len=64"])
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["layers"] for r in ranks] == ["0-1", "0-1", "2-3", "2-3"]
    assert [(r["pp"], r["tp"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_help_lists_torchrun_options_without_importing_torch_for_other_verbs():
    code = ("import argparse, sys\n"
            "from trainpilot.cli import train\n"
            "sub = argparse.ArgumentParser().add_subparsers()\n"
            "train.register(sub)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
    result = run_cli("train", "--help")
    assert result.returncode == 0
    for flag in ("--nproc-per-node", "--nnodes", "--rdzv-endpoint", "--max-restarts",
                 "--dry-run", "examples:"):
        assert flag in result.stdout
