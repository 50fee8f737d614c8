"""Where the same command resumes from (runtime.rundir), on real checkpoint folders written by
the project's checkpointer in one process."""

from __future__ import annotations

import pytest
import torch

from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer
from trainpilot.runtime.rundir import check_same_job, check_usable, decide, inspect
from trainpilot.runtime.workerjob import WorkerJob
from trainpilot.specs import SpecError, load_model, load_plan

PLAN = "dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64"


def _job(run_dir, **config) -> dict:
    from trainpilot.runtime.config import TrainConfig

    return WorkerJob(model=load_model("tiny-gpt"), plan=load_plan(PLAN), run_dir=str(run_dir),
                     config=TrainConfig(steps=20, **config)).to_dict()


def _saved_run(run_dir, steps=(3, 6, 9)) -> None:
    WorkerJob.model_validate(_job(run_dir)).write()
    ckpt = Checkpointer(CheckpointConfig(root_dir=run_dir / "checkpoints", keep_last=10))
    try:
        for step in steps:
            ckpt.save(step, {"w": torch.full((4,), float(step))}).result()
    finally:
        ckpt.close()


def test_fresh_folder_and_unusable_paths(tmp_path):
    assert decide(inspect(tmp_path / "new"), "auto", _job(tmp_path / "new")).fresh
    (tmp_path / "file").write_text("x")
    with pytest.raises(SpecError, match="is a file"):
        check_usable(tmp_path / "file")
    with pytest.raises(SpecError, match="is a file"):
        check_usable(tmp_path / "file" / "run")
    check_usable(tmp_path / "a" / "b")  # creatable, and nothing was created
    assert not (tmp_path / "a").exists()


def test_auto_picks_the_newest_valid_and_reports_what_it_skipped(tmp_path):
    _saved_run(tmp_path)
    root = tmp_path / "checkpoints"
    (root / "step_0000000009" / "data_r0_0.bin").write_bytes(b"short")
    (root / "step_0000000003" / "manifest.json").unlink()
    decision = decide(inspect(tmp_path), "auto", _job(tmp_path))
    assert not decision.fresh and decision.checkpoint == "step_0000000006"
    text = "\n".join(decision.notes)
    assert "step_0000000003 has no manifest" in text
    assert "step_0000000009 is invalid" in text and "resuming from step 6" in text


def test_all_invalid_is_refused_and_never_moves_the_run_aside(tmp_path):
    _saved_run(tmp_path, steps=(3,))
    (tmp_path / "checkpoints" / "step_0000000003" / "data_r0_0.bin").write_bytes(b"")
    with pytest.raises(SpecError, match="all 1 checkpoint.*--resume never"):
        decide(inspect(tmp_path), "auto", _job(tmp_path))
    decision = decide(inspect(tmp_path), "never", _job(tmp_path))
    assert decision.fresh and decision.previous_dir is not None
    assert (decision.previous_dir / "checkpoints" / "step_0000000003").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["previous"]


def test_resume_from_a_step_sets_newer_checkpoints_aside(tmp_path):
    _saved_run(tmp_path)
    decision = decide(inspect(tmp_path), "6", _job(tmp_path))
    assert decision.checkpoint == "step_0000000006" and decision.set_aside == ["step_0000000009"]
    assert not (tmp_path / "checkpoints" / "step_0000000009").exists()
    assert any((tmp_path / "checkpoints" / "abandoned").iterdir())
    with pytest.raises(SpecError, match="no checkpoint at step 7; valid: 6, 3"):
        decide(inspect(tmp_path), "7", _job(tmp_path))


def test_a_different_job_is_refused_by_the_field_that_changed(tmp_path):
    saved = _job(tmp_path)
    with pytest.raises(SpecError, match=r"config\.seed: got 4; .* started with 0"):
        check_same_job(saved, _job(tmp_path, seed=4))
    wider = dict(saved, model=dict(saved["model"], hidden_size=192))
    with pytest.raises(SpecError, match=r"model\.hidden_size"):
        check_same_job(saved, wider)
    # What may change on resume: the world size (DCP reshards), checkpoint cadence, faults.
    check_same_job(saved, dict(saved, plan=dict(saved["plan"], dp=4),
                               config=dict(saved["config"], checkpoint_every=5)))
