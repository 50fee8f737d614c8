"""A flaky, then degrading host, drained to the standby before it fails, by the hosts' own
link probes. Every launcher probes the others' links (``--probe-links 0.5``; the standby's
too, while it waits). node1's link is first down for 2 s (absorbed: the step is committed
once, nothing restarts, and the probe judge does not count the failed probes: the 60 s
partition in test_partitions.py is the same cut past every timeout, which does restart), then
slowed to 40 Mbit/s. node1's probes to node0 and to the spare are then slow while node0's to
the spare are not: node1 is flagged (under 0.2 x the others' speed, ``--slow-link-ratio``),
and after 3 rounds (``--drain-slow-links``) asks for its
own drain: after its next step every rank saves that step, node1's launcher leaves, the spare
waiting in the rendezvous joins and restores the drained step from node0's memory; then
node1 is killed (nothing of the job is left there). Zero steps lost: no step is trained twice,
and the run ends bit-identical to the uninterrupted single-host run. (The same host lost
without a drain costs the steps since the last checkpoint: test_node_loss.py, where step 7 is
trained twice.)"""

from __future__ import annotations

import json
import statistics
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
from trainpilot.runtime.elastic.linkprobe import read_probes
from trainpilot.ui.cluster import cluster_section

pytestmark = [pytest.mark.multinode, pytest.mark.dist]


@pytest.mark.timeout(300)
def test_a_degraded_host_drained_to_the_standby_loses_no_step(ref2, cluster, tmp_path):
    # Under a loaded suite the healthy links' probes vary 10x (and the first probes after the
    # 2 s blip come back a few times slower): flag only a 5x gap; the degraded link is 25x.
    probes = ("--probe-links", "0.5", "--drain-slow-links", "--slow-link-ratio", "0.2")
    # The 2 s blip must stay under every failure timeout with room for TCP's retransmission
    # backoff (the first retransmit after the link is back can come a few seconds later): the
    # harness's 2.5 s heartbeat timeout once declared node1 silent in CI, which restarted the
    # job without node0 in its first round (node1 came back as rank 0). 6 s heartbeats and
    # 10 s collectives here; test_partitions.py covers a cut past them. torchrun's rendezvous
    # too: the harness's 3 missed keep-alives of 1 s declared node1 dead after the blip in 1
    # of 6 runs beside a busy loop (rounds churned for 15 s and the job restarted twice); 15
    # of 1 s here, as test_partitions.py's patient setting.
    timeouts = ("--heartbeat-timeout", "6", "--collective-timeout", "10")
    patient = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=15"
    with launch(cluster, tmp_path / "run", steps=STEPS2, every=3, rdzv_conf=patient,
                extra=("--storage-every", "2", *probes, *timeouts)) as run:
        start_with_standby(run)
        run.wait_step(2)
        # First a blip shorter than the timeouts (2 s against 6 and 10 s): TCP retransmits
        # inside the collective, the step takes the blip and is committed once, nothing restarts.
        journal_fault(run.run_dir, "link_down", host="node1",
                      step=completed_steps(run.run_dir) + 1, duration_s=2.0)
        cluster.link_down("node1")
        assert not cluster.link_is_up("node1")  # the fault fired
        time.sleep(2.0)
        cluster.link_up("node1")
        run.wait_step(4)
        journal_fault(run.run_dir, "degraded_link", host="node1",
                      step=completed_steps(run.run_dir) + 1, rate_mbit=40)
        degraded = time.time()
        cluster.shape("node1", 40.0)
        assert run.jobs["node1"].proc.wait(90) == 0, run.outputs()  # left, not failed
        left = run.jobs["node1"].output()
        assert "this host was drained after step" in left
        assert cluster.kill_node("node1") == []  # the failure it got ahead of: nothing left
        assert run.wait(["node0", "spare"]) == {"node0": 0, "spare": 0}, run.outputs()
    done = json.loads((run.run_dir / "drained.json").read_text())
    restarts = [e.payload for e in events(run.run_dir, ["restart"])]
    assert len(restarts) == 1, restarts  # the drain's own: the blip restarted nothing
    assert done["host"] == "node1" and done["drained_ranks"] == [1]
    assert done["reason"].startswith("link: node1's links at"), done
    # The probes saw it: node1 flagged 3 rounds in a row after the slowdown. Negative control,
    # under the same noise (probes on 2 busy cores vary 10x): no other host, and no host
    # before the slowdown (the 2 s blip included), was flagged for as many rounds.
    flags = [r for r in read_probes(run.run_dir) if r.get("kind") == "link_degraded"]
    drains = [f for f in flags if f["rounds"] >= 3]
    assert drains and {f["host"] for f in drains} == {"node1"}, flags
    assert min(f["t"] for f in drains) > degraded, (degraded, flags)
    assert done["requested_unix_s"] - degraded < 30
    slow = [r for r in read_probes(run.run_dir) if r.get("kind") == "probe" and r["ok"]
            and r["t"] > degraded + 1 and "node1" in (r["src"], r["dst"])]
    assert slow and max(r["mbit_s"] for r in slow) < 60, slow  # the 40 Mbit/s link, measured
    # The dashboard's cluster view of this run: three hosts, node1 drained, its links slowest.
    view = cluster_section(run.run_dir, restarts=[
        dict(e.payload, step=e.step) for e in events(run.run_dir, ["restart"])])
    hosts = {h["host"]: h for h in view["hosts"]}
    assert sorted(hosts) == ["node0", "node1", "spare"]
    assert hosts["node1"]["state"] == "drained" and hosts["node0"]["state"] == "completed"
    assert len(view["links"]) == 3
    assert {"fault: degraded_link", "link_degraded", "drain_requested", "drained",
            "restart"} <= {e["kind"] for e in view["events"]}
    done = json.loads((run.run_dir / "drained.json").read_text())
    assert done["host"] == "node1" and done["drained_ranks"] == [1]
    assert not (run.run_dir / "drain.json").exists()  # not drained again by the next attempt
    [restart] = restarts
    assert (restart["source"], restart["restored_step"]) == ("memory", done["step"]), restart
    lines = (run.run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r["step"] for r in map(json.loads, lines) if r.get("kind") == "step"]
    assert steps == list(range(1, STEPS2 + 1))  # zero steps lost: none trained twice
    records = [r for r in map(json.loads, lines) if r.get("kind") == "step"]
    # Before the link was degraded, exactly one step took the blip (later ones may be slow for
    # the degradation itself: step 7 took over 2 s once, in a loaded suite).
    degraded_at = [f for f in cluster_faults(run.run_dir) if f["kind"] == "degraded_link"][0]
    before = [r for r in records if r["step"] < degraded_at["step"]]
    # The 2 s blip on top of a step's usual time (the median, ~0.2 s here; ~2 s where bf16
    # autocast is emulated, which made a plain 2.0 s threshold count ordinary steps).
    usual = statistics.median(r["step_time_s"] for r in before)
    blip = [r["step"] for r in before if r["step_time_s"] >= usual + 1.5]
    assert len(blip) == 1 and blip[0] <= 4, [(r["step"], r["step_time_s"]) for r in records]
    # It was real: every step run wholly on the degraded link, and the drained step (it ends
    # after the drain request, itself 3 probe rounds after the slowdown, so it spends at least
    # those rounds on the slow link), took the slowdown. The drained step can be the one in
    # flight when the link was slowed (the journal's step): then no step runs wholly on it
    # (seen once in a fresh-clone CI run, where the window after the journal's step was empty).
    assert done["step"] >= degraded_at["step"], (done, degraded_at)
    slow_steps = [r for r in records
                  if degraded_at["step"] < r["step"] <= done["step"] or r["step"] == done["step"]]
    assert slow_steps and min(r["step_time_s"] for r in slow_steps) > 0.4, slow_steps
    assert [f["kind"] for f in cluster_faults(run.run_dir)] == ["link_down", "degraded_link"]
    assert_same_run(run.run_dir, ref2, step=9, num_steps=STEPS2)
