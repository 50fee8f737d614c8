"""What a user mistypes or points at the wrong place: one line, exit 2, nothing started and
nothing touched — a run directory that is a file or on a read-only disk, a model changed under
an existing run, a plan the cost model says cannot fit in memory, a fault that could never
fire."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli
from tests.external.harness import tmpfs
from trainpilot.runtime.workerjob import WorkerJob
from trainpilot.specs import load_model, load_plan

PLAN = "dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64"
BASE = ["train", "--model", "tiny-gpt", "--steps", "6", "--no-predict", "--plan", PLAN]

pytestmark = [pytest.mark.external]


def _one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_run_dir_that_is_a_file(tmp_path):
    target = tmp_path / "run"
    target.write_text("not a folder")
    line = _one_line_error(run_cli(*BASE, "--run-dir", str(target)))
    assert "--run-dir" in line and "is a file" in line
    assert target.read_text() == "not a folder"


def test_run_dir_on_a_read_only_disk(tmp_path):
    with tmpfs(tmp_path / "ro", "size=1m,ro", "a read-only tmpfs") as mount:
        line = _one_line_error(run_cli(*BASE, "--run-dir", str(mount / "run")))
        assert "not writable" in line and "Read-only file system" in line


def test_a_changed_model_on_resume_is_refused(tmp_path):
    run = tmp_path / "run"
    # The job document a previous run of tiny-gpt left (the launcher writes it at start).
    WorkerJob(model=load_model("tiny-gpt"), plan=load_plan(PLAN), run_dir=str(run)).write()
    other = tmp_path / "model.yaml"
    other.write_text(load_model("tiny-gpt").replace(name="tiny-gpt-wide",
                                                    hidden_size=192).model_dump_json())
    args = ["train", "--model", str(other), "--steps", "6", "--no-predict", "--plan", PLAN,
            "--run-dir", str(run)]
    line = _one_line_error(run_cli(*args))
    assert "model." in line and "--resume never" in line
    assert sorted(p.name for p in run.iterdir()) == ["job.json"]


def test_a_plan_that_cannot_fit_is_refused_before_launch(tmp_path):
    args = ["train", "--model", "llama3-8b", "--no-predict", "--plan",
            "dp=2,zero=0,micro_batch_size=1,global_batch_size=2,seq_len=1024", "--run-dir",
            str(tmp_path / "run")]
    line = _one_line_error(run_cli(*args))
    assert "GiB per rank" in line and "--skip-memory-check" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("inject, match", [
    ("crash:rank=5,step=3", "the job has 2 rank(s); valid: 0-1"),
    ("crash:rank=1,step=60", "the run has 6 steps; valid: 1-6"),
    ("chaos:rate=2", "faults per step; valid: 0 < rate <= 1"),
    ("chaos:rate=0.1,kinds=meteor", "unknown chaos fault"),
])
def test_faults_that_could_never_fire(inject, match, tmp_path):
    line = _one_line_error(run_cli(*BASE, "--run-dir", str(tmp_path / "r"), "--inject", inject))
    assert match in line
