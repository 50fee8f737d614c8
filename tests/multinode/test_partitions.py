"""The network between hosts fails, on a cluster of network namespaces.

* 60 s, node0 and node1 cut from each other: longer than every timeout, so the job goes on with
  the spare, its state from node0's memory; node1 leaves with one line once the partition
  heals. It ends bit-identical to the uninterrupted single-host run.
* 10 s, with torchrun's keep-alive allowing 30 s: past the collective timeout (5 s), so the
  step in flight fails on both hosts, but no host is dropped. The ranks rebuild their group in
  process once the cut heals (the rendezvous waits for it), restore the newest memory copy and
  re-run the steps after it: no process restarts, each step committed once, bit-exact.

(A 2 s link down, absorbed inside the collective, is in test_drain.py.)"""

from __future__ import annotations

import json
import time

import pytest

from tests.external.harness import STEPS2, assert_same_run, events
from tests.multinode.harness import (
    cluster_faults,
    completed_steps,
    journal_fault,
    launch,
    rank_warnings,
    start_with_standby,
    wait_for_spill,
)

pytestmark = [pytest.mark.multinode, pytest.mark.dist]

EXTRA = ("--storage-every", "2")  # memory copies at 3, 6, 9, 12; storage at 3 and 9


@pytest.mark.timeout(300)
def test_partition_for_60_s_recovers_with_the_spare_bit_exact(ref2, cluster, tmp_path):
    with launch(cluster, tmp_path / "run", steps=STEPS2, every=3, extra=EXTRA) as run:
        start_with_standby(run)
        run.wait_step(5)
        # The spare restores from node0's memory folder: step 3's copies must be in it (a
        # fresh-clone run once restarted from `initial`, the first spill not yet landed).
        wait_for_spill(run.jobs["node0"].proc.pid, step=3)
        journal_fault(run.run_dir, "partition", host="node1",
                      step=completed_steps(run.run_dir) + 1, peer="node0", duration_s=60.0)
        cut = time.monotonic()
        cluster.partition("node0", "node1")
        assert run.wait(["node0", "spare"], timeout=120) == {"node0": 0, "spare": 0}, \
            run.outputs()
        finished = time.monotonic() - cut
        assert run.jobs["node1"].proc.poll() is None  # still cut off, waiting
        time.sleep(max(0.0, 60.0 - (time.monotonic() - cut)))
        dropped = cluster.dropped("node0") + cluster.dropped("node1")
        cluster.heal("node0", "node1")
        # Healed, node1 finds the rendezvous gone and leaves: one line, no traceback.
        node1 = run.jobs["node1"]
        assert node1.proc.wait(90) == 0, node1.output()[-3000:]
        said = node1.output()
    assert dropped > 0, "the partition dropped nothing"  # the fault fired
    assert finished < 60.0  # the job did not wait for the partition to heal
    assert said.strip().splitlines()[-1].startswith("this host left the job"), said[-2000:]
    assert "Traceback" not in said
    restarts = [e.payload for e in events(run.run_dir, ["restart"])]
    assert len(restarts) == 1, (restarts, rank_warnings(run.run_dir))
    [restart] = restarts
    assert restart["source"] == "memory" and restart["reason"] == "membership", restart
    assert [f["kind"] for f in cluster_faults(run.run_dir)] == ["partition"]
    assert_same_run(run.run_dir, ref2, step=9, num_steps=STEPS2)


# Dead-host detection in torchrun's rendezvous: 30 missed keep-alives of 1 s (the default is
# 3 of 5 s), so a 10 s cut is the training group's business, not torchrun's.
PATIENT = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=30"


@pytest.mark.timeout(300)
def test_partition_for_10_s_is_recovered_in_process_bit_exact(ref2, cluster, tmp_path):
    with launch(cluster, tmp_path / "run", steps=STEPS2, every=3, rdzv_conf=PATIENT,
                extra=EXTRA) as run:
        run.start("node0")
        run.wait_rendezvous_host()
        run.start("node1")
        assert run.wait_ranks(2) == {"node0": [0], "node1": [1]}, run.outputs()
        run.wait_step(4)
        at = completed_steps(run.run_dir) + 1
        journal_fault(run.run_dir, "partition", host="node1", step=at, peer="node0",
                      duration_s=10.0)
        cluster.partition("node0", "node1")
        time.sleep(10.0)
        dropped = cluster.dropped("node0") + cluster.dropped("node1")
        cluster.heal("node0", "node1")
        assert run.wait() == {"node0": 0, "node1": 0}, run.outputs()
    assert dropped > 0, "the partition dropped nothing"  # the fault fired
    restarts = [e.payload for e in events(run.run_dir, ["restart"])]
    assert len(restarts) == 1, (restarts, rank_warnings(run.run_dir))
    [restart] = restarts
    assert restart["reason"] == "in_process" and restart["source"] == "memory", restart
    assert "Timed out" in restart["error"]  # the collective timed out on the cut
    assert restart["restored_step"] == 3 and restart["failed_step"] >= at - 1, restart
    assert restart["rendezvous_s"] > 2.0  # it waited for the heal, not for a new host
    # No process restarted: one attempt per host (torchrun never re-formed the job).
    launcher = [json.loads(line) for line in
                (run.run_dir / "launcher.jsonl").read_text().splitlines()]
    assert [r["attempt"] for r in launcher if r["kind"] == "attempt_start"] == [0, 0]
    assert not [r for r in launcher if r["kind"] == "worker_end"], launcher
    # Each step committed once: the steps after the restored copy ran twice, the second time
    # on the same samples to the last bit (the first run's updates were rolled back).
    lines = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r.get("kind") == "step"]
    last = {r["step"]: r for r in steps}
    replayed = [r for r in steps if r is not last[r["step"]]]
    assert sorted(last) == list(range(1, STEPS2 + 1))
    assert replayed and {r["step"] for r in replayed} <= set(range(4, restart["failed_step"] + 1))
    assert all(r["loss"] == last[r["step"]]["loss"] for r in replayed), replayed
    assert [f["kind"] for f in cluster_faults(run.run_dir)] == ["partition"]
    assert_same_run(run.run_dir, ref2, step=9, num_steps=STEPS2)
