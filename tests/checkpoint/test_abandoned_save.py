"""A save abandoned by ``rebind`` (stuck on the old group when in-process recovery rebuilt
it) must not carry on over the new group: its collectives would interleave with the new
saves' and break the new group too (CI's 10 s partition test: the step-3 save in flight when
the cut came; its storage write then ran on the rebuilt group, out of step with the step-9
save there, and both timed out after 60 s). One gloo rank in a forked process: the step-3
save is held before its storage write starts, the checkpointer rebinds (abandoning it), then
the save is released; the DCP call it makes is recorded."""

from __future__ import annotations

import threading

from tests.checkpoint import dist_util
from tests.checkpoint.tiny import trained


def rank_main(rank: int, rendezvous: str, root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer, checkpointer

    dist_util.init_gloo(rank, 1, rendezvous, timeout_s=30)
    held, entered = threading.Event(), threading.Event()
    calls: list[tuple[int, bool]] = []  # (step, on the checkpointer's current group)
    real_writer, real_save = checkpointer.CheckpointWriter, dcp.save

    class HeldWriter(real_writer):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            if kwargs["step"] == 3:  # the first save waits here, before its collectives
                entered.set()
                held.wait(30)
            super().__init__(*args, **kwargs)

    def recording_save(state, *, storage_writer, process_group, **kwargs):
        current = process_group is ckpt.group.pg
        calls.append((storage_writer.step, current))
        if not current:  # the old group is destroyed: its collectives fail
            raise RuntimeError("the old group is gone")
        return real_save(state, storage_writer=storage_writer, process_group=process_group,
                         **kwargs)

    checkpointer.CheckpointWriter = HeldWriter
    dcp.save = recording_save
    run = trained(3)
    ckpt = Checkpointer(CheckpointConfig(root_dir=root, in_memory_peer=False))
    first = ckpt.save(3, run.state_dict())
    assert entered.wait(30)
    ckpt.rebind(drain_timeout_s=0)  # in-process recovery: abandon the stuck save
    held.set()
    try:
        first.result(30)
        first_error = ""
    except Exception as err:  # noqa: BLE001 (reported, then asserted on)
        first_error = str(err)
    run.train_step()
    ckpt.save(6, run.state_dict()).result(30)
    out = dict(calls=calls, first_error=first_error,
               reports=[r.step for r in ckpt.reports], storage_saves=ckpt._num_storage_saves)
    ckpt.close()
    dist.destroy_process_group()
    return out


def test_a_save_abandoned_by_rebind_never_runs_on_the_new_group(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = dist_util.start(rank_main, 0, out, dist_util.rendezvous(tmp_path), str(tmp_path / "ckpt"),
                           hang_dump_s=60)
    assert dist_util.join_all([proc], deadline_s=90) == [0]
    result = dist_util.results(out, ["rank0"])["rank0"]
    # The abandoned save's storage write went to its own (old, gone) group, not the new one;
    # the old code read self.group at that moment and ran it over the new group: [3, True].
    assert result["calls"] == [[3, False], [6, True]], result
    assert result["first_error"], result  # it failed, and reported it
    assert result["reports"] == [6] and result["storage_saves"] == 1, result


def test_an_abandoned_save_that_plans_late_leaves_the_folders_alone(tmp_path):
    """The other half of the same failure: the abandoned save's collectives on the old group
    can complete after the partition heals, and its coordinator then plans late. Planning sets
    aside newer folders and deletes those without a manifest, which by then include the new
    timeline's save in progress (CI's 10 s partition test once ended with a committed step 9
    whose data files were gone, and an empty step 3 folder the late planning had created). A
    stale save's writer must raise and touch nothing; the current one plans as before.
    Negative control: the same late planning without the guard deletes the new save's data."""
    import pytest
    from torch.distributed.checkpoint.planner import SavePlan

    from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer
    from trainpilot.runtime.checkpoint.storage import CheckpointWriter

    root = tmp_path / "ckpt"
    ckpt = Checkpointer(CheckpointConfig(root_dir=root, in_memory_peer=False))
    stale = ckpt._generation
    ckpt.rebind(drain_timeout_s=0)  # in-process recovery: the save of ``stale`` is abandoned
    current = CheckpointWriter(root=root, step=6, guard=lambda: ckpt._current(ckpt._generation))
    current.prepare_global_plan([SavePlan([])])
    assert (root / "step_0000000006").is_dir()

    def save_in_progress():
        folder = root / "step_0000000009"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "data_r0_0.bin").write_bytes(b"the new timeline's step 9")
        return folder / "data_r0_0.bin"

    data = save_in_progress()
    late = CheckpointWriter(root=root, step=3, guard=lambda: ckpt._current(stale))
    with pytest.raises(RuntimeError, match="abandoned"):
        late.prepare_global_plan([SavePlan([])])
    with pytest.raises(RuntimeError, match="abandoned"):
        late.write_data(SavePlan([]), None)
    assert data.read_bytes() == b"the new timeline's step 9"
    assert not (root / "step_0000000003").exists()
    ckpt.close()
    unguarded = CheckpointWriter(root=root, step=3)
    unguarded.prepare_global_plan([SavePlan([])])
    assert not data.exists() and (root / "step_0000000003").is_dir()
