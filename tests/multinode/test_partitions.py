"""The network between hosts fails, on a cluster of network namespaces: node0 and node1 cut
from each other for 60 s (longer than every timeout: the job goes on with the spare, its state from
node0's memory; node1 leaves with one line once the partition heals). It ends bit-identical
to the uninterrupted single-host run. (A 2 s link down, absorbed, is in test_drain.py.)"""

from __future__ import annotations

import time

import pytest

from tests.external.harness import STEPS2, assert_same_run, events
from tests.multinode.harness import (
    cluster_faults,
    completed_steps,
    journal_fault,
    launch,
    start_with_standby,
)

pytestmark = [pytest.mark.multinode, pytest.mark.dist]

EXTRA = ("--storage-every", "2")  # memory copies at 3, 6, 9, 12; storage at 3 and 9


@pytest.mark.timeout(300)
def test_partition_for_60_s_recovers_with_the_spare_bit_exact(ref2, cluster, tmp_path):
    with launch(cluster, tmp_path / "run", steps=STEPS2, every=3, extra=EXTRA) as run:
        start_with_standby(run)
        run.wait_step(5)
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
    [restart] = [e.payload for e in events(run.run_dir, ["restart"])]
    assert restart["source"] == "memory" and restart["reason"] == "membership", restart
    assert [f["kind"] for f in cluster_faults(run.run_dir)] == ["partition"]
    assert_same_run(run.run_dir, ref2, step=9, num_steps=STEPS2)
