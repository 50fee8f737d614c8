"""examples/: the plain DDP loop runs under torchrun on 2 CPU ranks, and the same loop with
trainpilot's parts survives NaN, crash and hang faults bit-exactly (final weights equal to an
uninterrupted run's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.byo_data import stdlib_files

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.dist


def torchrun(script: str, *args: str, env: dict | None = None, restarts: int = 0,
             timeout_s: float = 150) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", str(restarts), str(REPO / "examples" / script), *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                    **(env or {}))
    def run() -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True,
                              timeout=timeout_s)

    out = run()
    if out.returncode != 0 and "EADDRINUSE" in out.stderr:
        # torchrun picks the workers' MASTER_PORT free, releases it, and rank 0 binds it later;
        # a test running beside this one can take it in between (CI saw it once). That race is
        # torchrun's, not the example's: start the run again from nothing, once.
        if "--run-dir" in args:
            shutil.rmtree(args[args.index("--run-dir") + 1], ignore_errors=True)
        out = run()
    return out


@pytest.fixture
def texts(tmp_path) -> str:
    for path in stdlib_files()[:4]:
        shutil.copy(path, tmp_path / path.name)
    return str(tmp_path / "*.py")


@pytest.mark.timeout(180)
def test_plain_ddp_example_trains_on_two_ranks(texts):
    out = torchrun("plain_ddp.py", "--steps", "4", "--data", texts)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in out.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 4 and all(5.0 < x < 7.0 for x in losses), out.stdout
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_trainpilot_example_survives_nan_crash_and_hang_bit_exactly(tmp_path, texts):
    import json

    import torch

    common = ("--steps", "9", "--save-every", "3", "--data", texts)
    ref = torchrun("ddp_with_trainpilot.py", *common, "--run-dir", str(tmp_path / "ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    # One run, four faults: a NaN in rank 0's backward and one in rank 1's gradients (the step
    # is computed once more), a crash of rank 1 (torchrun restarts, the checkpoint restores) and
    # a hang of rank 1 (SIGSTOP: the session's heartbeats declare it failed, then a restart).
    spec = "nan:rank=0,step=2;nan:rank=1,step=4,at=grad;crash:rank=1,step=5;hang:rank=1,step=8"
    # Two restarts are needed; a third in hand: under a loaded suite a restarted rank was once
    # silent for the heartbeat's 3 s while it started, and was declared failed (that recovery is
    # bit-exact too).
    faulty = torchrun("ddp_with_trainpilot.py", *common, "--run-dir", str(tmp_path / "faulty"),
                      env=dict(TRAINPILOT_INJECT=spec), restarts=3, timeout_s=280)
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    fired = [json.loads(line) for line in
             (tmp_path / "faulty" / "faults.jsonl").read_text().splitlines()]
    assert sorted((f["kind"], f["rank"], f["step"]) for f in fired) == [
        ("crash", 1, 5), ("hang", 1, 8), ("nan", 0, 2), ("nan", 1, 4)]  # each really fired
    a = torch.load(tmp_path / "ref" / "final.pt")
    b = torch.load(tmp_path / "faulty" / "final.pt")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
