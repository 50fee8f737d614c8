"""A host lost on a cluster of network namespaces: ``trainpilot train`` launched once per host
through torchrun's c10d rendezvous, every process of one host SIGKILLed, the spare host that
waits in the rendezvous (torchrun's redundancy list) takes its place, and its state comes from
the survivor's memory copy over the network, not from storage. The run ends bit-identical to
the uninterrupted single-host run (weights, AdamW state, every loss)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.external.harness import STEPS2, assert_same_run, events, losses
from tests.multinode.harness import cluster_faults, kill_host, launch, wait_standby

pytestmark = [pytest.mark.multinode, pytest.mark.dist]

# Memory copies at 3, 6, 9, 12; storage at 3 and 9 only: a restore of step 6 can only be the
# memory tier's (the survivor's node memory and the ring copy it holds for the lost host).
EXTRA = ("--storage-every", "2")


def _lose_node1(net, run_dir, *, drop_node_memory: bool = False):
    with launch(net, run_dir, steps=STEPS2, every=3, extra=EXTRA) as run:
        run.start("node0")
        run.wait_rendezvous_host()
        run.start("node1")
        assert run.wait_ranks(2) == {"node0": [0], "node1": [1]}
        run.start("spare")
        wait_standby(run, "spare")  # in the rendezvous, not training
        assert "spare" not in run.ranks()
        run.wait_step(7)
        fault = kill_host(run, "node1")
        assert fault["pids"], "node1 had no process to kill"
        if drop_node_memory:  # the survivor's copies gone with it: only storage is left
            folders = _memory_dirs(run.jobs["node0"].proc.pid)
            assert folders, "node0 kept no node memory"
            for folder in folders:
                shutil.rmtree(folder)
        codes = run.wait(["node0", "spare"])
        assert codes == {"node0": 0, "spare": 0}, run.outputs()
        assert run.jobs["node1"].proc.wait(10) == -9  # the lost host's launcher
        assert "joining the job launched on node0" in run.jobs["node1"].output()
        return run


def _memory_dirs(launcher_pid: int) -> list[Path]:
    """The node memory folders of one launcher (under its watch folder in /dev/shm)."""
    return sorted(Path("/dev/shm").glob(f"trainpilot-{launcher_pid}-*/memory"))


@pytest.mark.timeout(300)
def test_node_lost_the_standby_joins_with_state_from_the_survivors_memory(ref2, cluster,
                                                                          tmp_path):
    run = _lose_node1(cluster, tmp_path / "run")
    assert_same_run(run.run_dir, ref2, step=9, num_steps=STEPS2)
    [fault] = cluster_faults(run.run_dir)  # the fault fired and is on record
    assert fault["kind"] == "node_lost" and fault["host"] == "node1"
    [restart] = [e.payload for e in events(run.run_dir, ["restart"])]
    assert (restart["source"], restart["restored_step"]) == ("memory", 6), restart
    assert restart["reason"] == "membership"  # a new member, not a torchrun restart
    assert [e.payload["source"] for e in events(run.run_dir, ["fault"])] == ["external"]

    # Negative control: the survivor's node memory removed once the host is lost. The
    # standby can then only restore from storage (step 3, three more steps recomputed); the
    # run is still exact, so it is the restored step that tells the two paths apart.
    control = _lose_node1(cluster, tmp_path / "control", drop_node_memory=True)
    [restart] = [e.payload for e in events(control.run_dir, ["restart"])]
    assert (restart["source"], restart["restored_step"]) == ("storage", 3), restart
    assert losses(control.run_dir) == losses(ref2)
