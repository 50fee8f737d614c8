"""Checkpoints damaged between runs: a deleted manifest and a bogus ``latest`` are reported
and skipped; when every checkpoint is invalid the same command stops with one line (exit 2)
instead of silently starting over, whether the damage shows in the files' sizes (seen before
any process starts) or only in their checksums (seen by the workers, which then stop the
launch without restarts); ``--resume never`` starts over (the old run moved aside) and ends
exactly like a fresh run (the optimizer's step counter included)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.external.conftest import STEPS2
from tests.external.harness import assert_same_run, job, launcher_records, train_args
from trainpilot.runtime.faults import damage_file

pytestmark = [pytest.mark.dist, pytest.mark.external]


@pytest.mark.timeout(300)
def test_damaged_checkpoints_between_runs(ref2, tmp_path):
    run = tmp_path / "run"
    args = train_args(run, steps=STEPS2)
    ckpts = run / "checkpoints"
    with job(args) as j:
        j.wait_step(7)
        os.kill(j.pid, signal.SIGTERM)
        assert j.wait() == 143, j.output()[-3000:]
    steps = sorted(int(p.name[5:]) for p in ckpts.glob("step_*"))
    oldest = ckpts / f"step_{steps[0]:010d}"
    (oldest / "manifest.json").unlink()
    (ckpts / "latest").write_text("step_0000009999\n")
    with job(args) as j:
        # Stopped as soon as its workers run, so that the run stays unfinished (12 steps are
        # done in about 2 s: a later signal can come after the end).
        j.wait_registered(attempt=0, n=2)
        os.kill(j.pid, signal.SIGTERM)
        assert j.wait() == 143, j.output()[-3000:]
        out = j.output()
    assert f"checkpoints/{oldest.name} has no manifest" in out
    assert "checkpoints/latest names 'step_0000009999', not a valid checkpoint" in out

    for data in ckpts.glob("step_*/data_*.bin"):
        damage_file(data, "corrupt")  # same sizes: only the checksums can tell
    attempts_before = sum(r["kind"] == "attempt_start" for r in launcher_records(run))
    with job(args) as j:
        assert j.wait() == 2, j.output()[-3000:]
        assert "no valid checkpoint in" in j.output() and "--resume never" in j.output()
        assert "Traceback" not in j.output()
    attempts = sum(r["kind"] == "attempt_start" for r in launcher_records(run))
    assert attempts == attempts_before + 1  # refused once: no restart loop

    for data in ckpts.glob("step_*/data_r0_0.bin"):
        damage_file(data, "truncate")
    with job(args) as j:
        assert j.wait() == 2
        assert "are invalid" in j.output() and "--resume never" in j.output()

    with job([*args, "--resume", "never"]) as j:
        assert j.wait() == 0, j.output()[-3000:]
    previous = list((run / "previous").iterdir())
    assert len(previous) == 1 and (previous[0] / "checkpoints").is_dir()
    assert_same_run(run, ref2, step=STEPS2)  # a true fresh start: AdamW's step counts too
