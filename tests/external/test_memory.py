"""Memory, as the kernel enforces it: a job started in a memory cgroup smaller than its plan
needs. The launcher's check (the cost model's per-rank peak against what the cgroup leaves)
refuses it with both figures; forced past the check, the OOM killer ends a rank and the final
line says so, naming the killer rather than a bare exit code."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.external]

BIG = """name: big
num_hidden_layers: 8
hidden_size: 1024
num_attention_heads: 8
num_key_value_heads: 8
head_dim: 128
intermediate_size: 4096
vocab_size: 256
"""


@pytest.fixture
def memory_cgroup():
    """A child of this process's memory cgroup (v1) limited to 1.5 GiB."""
    try:
        line = next(entry for entry in Path("/proc/self/cgroup").read_text().splitlines()
                    if ":memory:" in entry)
        group = (Path("/sys/fs/cgroup/memory") / line.split(":", 2)[2].lstrip("/")
                 / f"trainpilot-test-{os.getpid()}")
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(1536 << 20))
    except (StopIteration, OSError) as err:
        pytest.skip(f"no memory cgroup (v1) to make here: {err}")
    try:
        yield group
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.2)


def _train(group: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    model = run_dir.parent / "big.yaml"
    model.write_text(BIG)
    args = [sys.executable, "-m", "trainpilot", "train", "--model", str(model), "--steps", "3",
            "--no-predict", "--plan", "dp=2,zero=0,micro_batch_size=1,global_batch_size=2,"
            "seq_len=64", "--run-dir", str(run_dir), *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=240,
                          preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))


@pytest.mark.timeout(300)
def test_memory_check_and_oom_kill_message(memory_cgroup, tmp_path):
    refused = _train(memory_cgroup, tmp_path / "refused")
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "GiB per rank" in refused.stderr and "host memory available" in refused.stderr
    assert not (tmp_path / "refused").exists()

    killed = _train(memory_cgroup, tmp_path / "killed", "--skip-memory-check", "--no-recovery")
    assert killed.returncode == 1, killed.stderr[-2000:]
    assert "out-of-memory killer" in killed.stderr, killed.stderr[-2000:]
    assert "training failed: rank" in killed.stderr
    oom = (memory_cgroup / "memory.oom_control").read_text()
    assert "oom_kill 0" not in oom  # the kernel did kill: the check above is not vacuous
