"""Processes killed or stopped from outside, as on a cluster: ``kill -9`` of a rank (also while
it starts), of the launcher, of the whole job; SIGSTOP of rank 0 (which hosts the job's store)
and of rank 1. Every run is ``trainpilot train`` as a user types it, with its defaults (restarts
on), and ends bit-identical to the uninterrupted run: weights, AdamW state, every loss. Each
external fault is journaled with its evidence, and the journal is what the run store shows."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.external.conftest import STEPS2, STEPS4
from tests.external.harness import (
    PLAN4,
    alive_workers_of,
    assert_same_run,
    events,
    job,
    journal,
    launcher_records,
    train_args,
)

pytestmark = [pytest.mark.dist, pytest.mark.external]


def _wait_gone(launcher_pid: int, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive_workers_of(launcher_pid):
        time.sleep(0.1)
    return alive_workers_of(launcher_pid)


@pytest.mark.timeout(300)
def test_kill9_of_ranks_and_of_the_launcher_then_the_same_command(ref2, tmp_path):
    run = tmp_path / "run"
    args = train_args(run, steps=STEPS2)
    with job(args) as j:
        j.wait_step(4)
        os.kill(j.workers()[1], signal.SIGKILL)  # a rank dies mid-run
        # torchrun restarts the group; rank 0 of the new attempt is killed while it starts
        os.kill(j.wait_registered(attempt=1, n=2)[0], signal.SIGKILL)
        j.wait_step(8, attempt=2)
        os.kill(j.pid, signal.SIGKILL)  # the launcher dies: its workers must not go on alone
        assert _wait_gone(j.pid) == [], "workers outlived their launcher"
    with job(args) as again:  # the same command resumes
        assert again.wait() == 0, again.output()[-3000:]
        assert "resuming from step" in again.output()
    assert_same_run(run, ref2, step=STEPS2)

    records = journal(run)
    assert [(r["kind"], r.get("rank"), r.get("attempt")) for r in records] == [
        ("crash", 1, 0), ("crash", 0, 1), ("launcher_lost", None, None)]
    assert all("killed by SIGKILL" in r["evidence"] for r in records[:2]), [
        (r["rank"], r["evidence"]) for r in records[:2]]
    assert f"launch of pid {j.pid}" in records[2]["evidence"]  # found by the next launch
    # The start-up death left a record (it never reached a step), and the store has it.
    ends = [r for r in launcher_records(run) if r["kind"] == "worker_end"
            and r["attempt"] == 1 and r["rank"] == 0]
    assert ends and ends[0]["step"] == 0
    assert {e.payload["attempt"] for e in events(run, ["attempt_start"])} >= {0, 1, 2}
    faults = [e.payload for e in events(run, ["fault"])]
    assert [(f["source"], f["rank"]) for f in faults] == [
        ("external", 1), ("external", 0), ("external", None)]
    assert events(run, ["recovered"]), "no recovered event"


@pytest.mark.timeout(300)
def test_sigstop_of_rank0_and_rank1_and_kill_of_the_whole_job(ref2, tmp_path):
    run = tmp_path / "run"
    args = train_args(run, steps=STEPS2)
    with job(args) as j:
        j.wait_step(4)
        os.kill(j.workers()[0], signal.SIGSTOP)  # rank 0 hosts the store the ranks share
        j.wait_step(7, attempt=1)
        os.killpg(j.pid, signal.SIGKILL)  # the whole job, as a node reboot would
        assert _wait_gone(j.pid) == []
    with job(args) as again:
        again.wait_step(9)
        os.kill(again.workers()[1], signal.SIGSTOP)
        assert again.wait() == 0, again.output()[-3000:]
    assert_same_run(run, ref2, step=STEPS2)
    records = journal(run)
    assert [(r["kind"], r["rank"], r["source"]) for r in records] == [
        ("hang", 0, "external"), ("launcher_lost", None, "external"), ("hang", 1, "external")]
    assert all("stopped (SIGSTOP" in r["evidence"] for r in (records[0], records[2]))


@pytest.mark.timeout(300)
def test_kill9_at_four_ranks_is_bit_exact(ref4, tmp_path):
    # At 4 ranks the order in which DDP sums the ranks' gradients depends on its bucket layout;
    # a restarted process must reduce with the same layout as the uninterrupted run
    # (runtime.parallelize.settle_ddp_buckets; tests/runtime/test_ddp_buckets.py shows the
    # drift without it).
    run = tmp_path / "run"
    with job(train_args(run, steps=STEPS4, plan=PLAN4)) as j:
        j.wait_step(5)
        os.kill(j.workers()[2], signal.SIGKILL)
        assert j.wait() == 0, j.output()[-3000:]
    assert_same_run(run, ref4, step=STEPS4)
    assert [(r["kind"], r["rank"]) for r in journal(run)] == [("crash", 2)]
