"""A process killed (SIGKILL or os._exit) inside a checkpoint write, at each of the three
points: between data files, between the data and the manifest, between the manifest and
``latest``. No torn checkpoint is ever restored; restore picks the newest committed one,
bit-exactly."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import torch

from tests.checkpoint.test_storage_faults import assert_no_torn_checkpoint
from tests.checkpoint.tiny import Tiny, trained
from trainpilot.runtime.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    committed,
    diff_states,
)
from trainpilot.runtime.checkpoint.layout import read_latest
from trainpilot.runtime.faults import FaultInjector

POINTS = ("data", "manifest", "latest")
MODES = {"data": "sigkill", "manifest": "exit", "latest": "sigkill"}  # both ways of dying


def crash_child(root: str, journal: str, at: str) -> None:
    """Checkpoint steps 1-3 and die (SIGKILL, or os._exit(1)) inside step 3's write."""
    torch.set_num_threads(1)
    faults = FaultInjector(f"crash:rank=0,step=3,at={at},mode={MODES[at]}",
                           journal_path=journal)
    ckpt = Checkpointer(CheckpointConfig(root_dir=root, max_file_bytes=2048), faults=faults)
    run = Tiny(0)
    for step in (1, 2, 3):
        run.train_step()
        ckpt.save(step, run.state_dict()).result()
    os._exit(3)  # not reached when the crash fires


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """Run the three crashing children at once. They are forked from this process, which
    has torch imported already: a real process and a real SIGKILL, without paying torch's
    import three more times."""
    import torch.distributed.checkpoint  # noqa: F401 (imported once, before the fork)

    base = tmp_path_factory.mktemp("crash")
    ctx = multiprocessing.get_context("fork")
    procs = {at: ctx.Process(target=crash_child, args=(str(base / at / "ckpt"),
                                                       str(base / at / "faults.jsonl"), at))
             for at in POINTS}
    for proc in procs.values():
        proc.start()
    try:
        for proc in procs.values():
            proc.join(timeout=60)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
    return base, {at: proc.exitcode for at, proc in procs.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at", POINTS)
def test_crash_inside_a_checkpoint_write(crashed, at):
    base, outputs = crashed
    assert outputs[at] == (-signal.SIGKILL if MODES[at] == "sigkill" else 1)
    root = base / at / "ckpt"
    (record,) = FaultInjector(journal_path=base / at / "faults.jsonl").fired("crash")
    assert (record["step"], record["point"]) == (3, at)

    torn = root / "step_0000000003"
    if at == "data":
        # Died after its first data file of step 3; step 2 needed several.
        assert len(list((root / "step_0000000002").glob("data_r0_*.bin"))) >= 2
        assert [p.name for p in torn.iterdir()] == ["data_r0_0.bin"]
    if at in ("data", "manifest"):
        assert [s for s, _ in committed(root)] == [2, 1]
        assert read_latest(root) == "step_0000000002"
    else:  # the manifest is the commit: step 3 exists, only the pointer lags
        assert [s for s, _ in committed(root)] == [3, 2, 1]
        assert read_latest(root) == "step_0000000002"

    restored = Checkpointer(CheckpointConfig(root_dir=root)).restore_latest(
        Tiny(5).state_dict())
    expected_step = 3 if at == "latest" else 2
    assert restored.step == expected_step and restored.source == "storage"
    assert diff_states(restored.state, trained(expected_step).state_dict()) == []
    assert read_latest(root) == f"step_{expected_step:010d}"
    assert_no_torn_checkpoint(root)  # the torn folder was collected by the restore
