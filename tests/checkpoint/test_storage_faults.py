"""Checkpoint-level faults on one process: damaged files, a full disk. Each must leave no torn
checkpoint, restore must fall back to the newest intact one bit-exactly, and the fault must
be in the journal."""

from __future__ import annotations

import copy
import errno

import pytest
import torch

from tests.checkpoint.tiny import Tiny
from trainpilot.runtime.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointWriteError,
    committed,
    diff_states,
    read_manifest,
)
from trainpilot.runtime.checkpoint.layout import verify_files
from trainpilot.runtime.faults import FaultInjector


def save_three(tmp_path, spec: str, *, frozen: bool = False, **kw,
               ) -> tuple[Checkpointer, FaultInjector, dict]:
    """Steps 1-3, each checkpointed; ``spec`` injects faults. Returns the states by step."""
    faults = FaultInjector(spec, journal_path=tmp_path / "faults.jsonl")
    ckpt = Checkpointer(CheckpointConfig(root_dir=tmp_path / "ckpt", max_file_bytes=2048, **kw),
                        faults=faults)
    run, states = Tiny(0, frozen_first=frozen), {}
    for step in (1, 2, 3):
        run.train_step()
        states[step] = copy.deepcopy(run.state_dict())
        try:
            ckpt.save(step, run.state_dict()).result()
        except CheckpointWriteError as err:
            states[f"error{step}"] = err
    return ckpt, faults, states


def assert_no_torn_checkpoint(root, allow: set[str] = frozenset()) -> None:
    """Every folder that claims to be a checkpoint verifies; every other folder is gone (except
    ``allow``: data a committed checkpoint still references)."""
    for _, name in committed(root):
        body = read_manifest(root, name)
        assert verify_files(root, body["files"], body["files"]) == [], name
    leftovers = {p.name for p in root.iterdir() if p.is_dir()} - {n for _, n in committed(root)}
    assert leftovers == set(allow)


def restore_fresh(tmp_path, *, frozen: bool = False):
    reader = Checkpointer(CheckpointConfig(root_dir=tmp_path / "ckpt"))
    return reader.restore_latest(Tiny(11, frozen_first=frozen).state_dict(), source="storage")


@pytest.mark.parametrize("kind", ["corrupt", "truncate", "missing"])
@pytest.mark.parametrize("which", ["data", "manifest"])
def test_damaged_newest_checkpoint_falls_back(tmp_path, kind, which):
    ckpt, faults, states = save_three(tmp_path, f"{kind}:step=3,file={which}")
    ckpt.close()
    assert [r["step"] for r in faults.fired(kind)] == [3]
    assert len(list((tmp_path / "ckpt" / "step_0000000003").glob("data_r0_*.bin"))) >= 2
    restored = restore_fresh(tmp_path)
    assert restored.step == 2
    assert diff_states(restored.state, states[2]) == []
    if not (kind == "missing" and which == "manifest"):  # no manifest: simply not a checkpoint
        assert restored.skipped and restored.skipped[0].startswith("step_0000000003")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_0000000002"


def test_damaged_base_invalidates_the_incremental_checkpoints_built_on_it(tmp_path):
    """Steps 2 and 3 reference step 1's frozen weights; damaging step 1 breaks all three, and
    restore refuses every one of them rather than load a torn state."""
    ckpt, faults, states = save_three(tmp_path, "corrupt:step=1", incremental=True,
                                      frozen=True)
    ckpt.close()
    body = read_manifest(tmp_path / "ckpt", "step_0000000003")
    assert any(f.startswith("step_0000000001/") for f in body["files"]), "no reference made"
    assert restore_fresh(tmp_path, frozen=True) is None


def test_a_base_that_lost_its_manifest_is_not_garbage_collected(tmp_path):
    """Step 1's manifest disappears after steps 2 and 3 referenced its data files: collecting
    step 1 as an uncommitted folder would break them."""
    ckpt, faults, states = save_three(tmp_path, "", incremental=True, frozen=True)
    ckpt.close()
    root = tmp_path / "ckpt"
    (root / "step_0000000001" / "manifest.json").unlink()
    restored = restore_fresh(tmp_path, frozen=True)
    assert restored.step == 3 and diff_states(restored.state, states[3]) == []
    assert (root / "step_0000000001").is_dir()  # still there after the restore's cleanup
    assert_no_torn_checkpoint(root, allow={"step_0000000001"})


def test_no_reference_into_a_base_that_is_no_longer_committed(tmp_path):
    """Step 1's manifest is gone before step 2 is saved: step 2 must be a full save."""
    ckpt, faults, states = save_three(tmp_path, "missing:step=1,file=manifest",
                                      incremental=True, frozen=True)
    reports = list(ckpt.reports)
    ckpt.close()
    assert [(r.step, r.incremental) for r in reports] == [(1, False), (2, False), (3, True)]
    root = tmp_path / "ckpt"
    assert [s for s, _ in committed(root)] == [3, 2]
    assert_no_torn_checkpoint(root)  # step 1 was collected: nothing needs it
    restored = restore_fresh(tmp_path, frozen=True)
    assert restored.step == 3 and diff_states(restored.state, states[3]) == []


@pytest.mark.parametrize("at", ["data", "manifest"])
def test_disk_full_leaves_no_torn_checkpoint(tmp_path, at):
    ckpt, faults, states = save_three(tmp_path, f"enospc:step=2,at={at}")
    ckpt.close()
    err = states["error2"]
    assert err.errno == errno.ENOSPC and err.step == 2
    assert [r["step"] for r in faults.fired("enospc")] == [2]
    root = tmp_path / "ckpt"
    assert [s for s, _ in committed(root)] == [3, 1]  # 2 never committed; training went on
    assert_no_torn_checkpoint(root)
    restored = restore_fresh(tmp_path)
    assert restored.step == 3 and diff_states(restored.state, states[3]) == []
    # And with step 3 gone too, the newest intact one is step 1.
    (root / "step_0000000003" / "manifest.json").unlink()
    restored = restore_fresh(tmp_path)
    assert restored.step == 1 and diff_states(restored.state, states[1]) == []


def test_write_error_policy_warn_keeps_training(tmp_path):
    faults = FaultInjector("enospc:step=1")
    ckpt = Checkpointer(CheckpointConfig(root_dir=tmp_path / "c", on_write_error="warn"),
                        faults=faults)
    ckpt.save(1, {"w": torch.ones(2)})
    ckpt.save(2, {"w": torch.ones(2)}).result()  # does not raise step 1's error
    assert [e.step for e in ckpt.errors] == [1]
    ckpt.close()


@pytest.mark.parametrize("stale", [True, False])
def test_a_failed_save_deletes_its_own_folder_only(tmp_path, monkeypatch, stale):
    """A save abandoned with its process group (an in-process restart rebinds the
    checkpointer) fails later, while the new timeline writes its own folder: its cleanup must
    not delete that folder (a multi-node CI run lost step 9's data files this way). A current
    save's failure deletes its own torn folder and nothing else."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    ckpt = Checkpointer(CheckpointConfig(root_dir=tmp_path / "ckpt"))
    ckpt.save(1, {"w": torch.ones(2)}).result()
    live = tmp_path / "ckpt" / "step_0000000005"  # the new timeline's save, mid-write

    def failing_save(state, *, storage_writer, **kw):
        (tmp_path / "ckpt" / storage_writer.name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "ckpt" / storage_writer.name / "data_r0_0.bin").write_bytes(b"x")
        live.mkdir(parents=True, exist_ok=True)
        (live / "data_r0_0.bin").write_bytes(b"new timeline")
        if stale:
            ckpt._generation += 1  # what rebind does when the group is replaced
        raise CheckpointException("peer gone", {0: RuntimeError("Timed out")})

    monkeypatch.setattr(dcp, "save", failing_save)
    with pytest.raises(CheckpointWriteError):
        ckpt.save(2, {"w": torch.ones(2)}).result()
    monkeypatch.undo()
    ckpt.close()
    assert (live / "data_r0_0.bin").read_bytes() == b"new timeline"  # never touched
    own = tmp_path / "ckpt" / "step_0000000002"
    assert own.exists() == stale  # a current failure cleans up after itself
    assert [s for s, _ in committed(tmp_path / "ckpt")] == [1]
