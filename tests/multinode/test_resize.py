"""A host added to a running job and one removed, on a cluster of network namespaces:
``--nnodes 1:2``; node0 trains alone (dp=1, two micro-batches per step), node1 joins (torchrun
re-forms the job at dp=2: node0's worker saves a last-moment checkpoint as it is stopped, so
the grow loses no step), then node1 is lost (the job shrinks back to dp=1 at once; the survivor
does not wait for a replacement that cannot come). The global batch is kept, so the run is
the same run: every step's loss, the weights and AdamW state equal the uninterrupted 2-rank
run's, and every step's sample count is exactly the global batch (no sample read twice or
skipped across the world changes)."""

from __future__ import annotations

import json
import time

import pytest

from tests.external.harness import STEPS2, assert_same_run, events
from tests.multinode.harness import cluster_faults, kill_host, launch

pytestmark = [pytest.mark.multinode, pytest.mark.dist]

GLOBAL_BATCH = 16
# node0 alone is held at step 5 for 12 s, long enough for node1's launcher to start and join.
HOLD = ("--inject", "slow:rank=0,step=5,factor=2,seconds=12")


@pytest.mark.timeout(300)
def test_a_host_added_then_removed_keeps_state_and_data_exactly_once(ref2, cluster, tmp_path):
    with launch(cluster, tmp_path / "run", steps=STEPS2, every=3, nnodes="1:2",
                extra=HOLD) as run:
        run.start("node0")
        run.wait_step(4)
        run.start("node1")  # added: max nodes not reached, torchrun takes it in
        assert run.wait_ranks(2) == {"node0": [0], "node1": [1]}, run.outputs()
        run.wait_step(8)
        fault = kill_host(run, "node1")  # removed: every process of node1 gone
        assert fault["pids"]
        t0 = time.monotonic()
        assert run.wait(["node0"], timeout=120) == {"node0": 0}, run.outputs()
        shrink_s = time.monotonic() - t0
    restarts = [e.payload for e in events(run.run_dir, ["restart"])]
    assert [r["world_size"] for r in restarts] == [2, 1]
    assert (restarts[0]["saved_world_size"], restarts[0]["restored_step"]) == (1, 5)  # the grow:
    # node0's last-moment checkpoint. The shrink restores the newest committed one: step 6,
    # saved at 2 ranks, or step 5 when the step-6 write was still in flight at the kill.
    assert (restarts[1]["saved_world_size"], restarts[1]["restored_step"]) in ((2, 6), (1, 5))
    assert shrink_s < 45, f"the shrink took {shrink_s:.0f} s"  # not join_timeout_s (60 s)
    assert [f["kind"] for f in cluster_faults(run.run_dir)] == ["node_lost"]

    lines = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r.get("kind") == "step"]
    last = {r["step"]: r for r in steps}  # a step trained again after the shrink replaces it
    assert sorted(last) == list(range(1, STEPS2 + 1))
    assert all(last[s]["samples_seen"] == s * GLOBAL_BATCH for s in last)  # exactly once
    # The shrink replayed steps (the fault had an effect: the steps after the restored one were
    # trained at 2 ranks, then again at 1), and each replay read the same samples: the same
    # loss to the last bit at the other world size (a sampler off by one sample, or resharded
    # by the wrong world size, changes it).
    replayed = [r for r in steps if r is not last[r["step"]]]
    assert replayed and all(r["step"] > restarts[1]["restored_step"] for r in replayed)
    assert all(r["loss"] == last[r["step"]]["loss"] for r in replayed), replayed
    assert_same_run(run.run_dir, ref2, step=9, num_steps=STEPS2)
