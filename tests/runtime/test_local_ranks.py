"""run_local_ranks: every rank reaches the store it hosts, output and exit codes come back, and
a rank hanging past the deadline is killed with what it started."""

from __future__ import annotations

import os
import sys
import time

import pytest

from trainpilot.runtime.local_ranks import run_local_ranks
from trainpilot.specs.errors import SpecError

pytestmark = pytest.mark.dist

# A rank without torch (fast to start): connects to the store's port, says so, exits with
# the code given. ``hang`` starts a child in its session, writes its pid, and sleeps.
RANK = """
import os, socket, subprocess, sys, time
rank, port, code, hang, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), \\
    sys.argv[4] == "1", sys.argv[5]
socket.create_connection(("127.0.0.1", port), timeout=10).close()
print(f"rank {rank} reached {port} with OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
      flush=True)
if hang:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(out, "w").write(str(child.pid))
    time.sleep(120)
sys.exit(code)
"""


def _command(codes, hang_rank=None, pid_file=""):
    def command(rank: int, port: int) -> list[str]:
        return [sys.executable, "-c", RANK, str(rank), str(port), str(codes[rank]),
                "1" if rank == hang_rank else "0", str(pid_file)]
    return command


def _gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie waiting for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


@pytest.mark.timeout(60)
def test_ranks_reach_the_store_and_report_codes_and_output(tmp_path):
    logs = [tmp_path / f"r{r}.log" for r in range(3)]
    result = run_local_ranks(_command([0, 0, 0]), 3, timeout_s=30, logs=logs)
    assert result.ok and result.returncodes == [0, 0, 0] and result.timed_out == []
    ports = {line.split()[3] for line in result.outputs}
    assert len(ports) == 1  # one store for every rank
    assert [o.split()[1] for o in result.outputs] == ["0", "1", "2"]
    assert all("OMP_NUM_THREADS=1" in o for o in result.outputs)
    # Negative control: a failing rank makes the result not ok, with its code.
    failed = run_local_ranks(_command([0, 3]), 2, timeout_s=30, env={"OMP_NUM_THREADS": "2"},
                             logs=logs[:2])
    assert not failed.ok and failed.returncodes == [0, 3] and failed.timed_out == []
    assert "OMP_NUM_THREADS=2" in failed.outputs[1]
    assert "--- rank 1 (exit 3) ---" in failed.describe()


@pytest.mark.timeout(60)
def test_a_rank_past_the_deadline_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    result = run_local_ranks(_command([0, 0], hang_rank=1, pid_file=pid_file), 2, timeout_s=4,
                             logs=[tmp_path / "r0.log", tmp_path / "r1.log"])
    elapsed = time.monotonic() - start
    assert result.timed_out == [1] and not result.ok
    assert result.returncodes == [0, -9]  # rank 1 ended by the SIGKILL, not on its own
    assert 4 <= elapsed < 20
    child = int(pid_file.read_text())  # the hang fired: rank 1 had started its child
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not _gone(child):
        os.kill(child, 9)
        pytest.fail(f"rank 1's child {child} survived the kill")


def test_bad_arguments_are_spec_errors(tmp_path):
    with pytest.raises(SpecError, match="world_size"):
        run_local_ranks(_command([0]), 0, timeout_s=1)
    with pytest.raises(SpecError, match="timeout_s"):
        run_local_ranks(_command([0]), 1, timeout_s=0)
    with pytest.raises(SpecError, match="logs"):
        run_local_ranks(_command([0, 0]), 2, timeout_s=1, logs=[tmp_path / "one.log"])
