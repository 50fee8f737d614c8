"""A reopened store logs ``run_resumed``; only the trainer's ``restart`` counts as a restart in the
report and the goodput, for stores written now and for stores written before ``run_resumed``
existed (their reopening was a ``restart`` event named ``store_reopened``)."""

from __future__ import annotations

import os
import sqlite3
import time

import pytest

from trainpilot.store import RunStore, store_path
from trainpilot.ui.data import run_data
from trainpilot.ui.goodput import measured_goodput
from trainpilot.ui.report import faults_and_recoveries, summary

STEP_S = 0.005
FAULT_STEP, RESTORED_STEP = 8, 5


def _crashed_then_reopened(run_dir, *, legacy: bool, trainer_restart: bool):
    """Steps 1-8 (5 ms each), a checkpoint at step 5, a fault at step 8, the process dies;
    a new process reopens the store and logs steps 6-10.

    ``legacy``: the reopening is written as stores did before ``run_resumed`` existed.
    ``trainer_restart``: the trainer restored step 5 and said so (``restart``, ``restored_step``).
    """
    first = RunStore.create(run_dir, world_size=2)
    for step in range(1, FAULT_STEP + 1):
        first.log_metrics(step, {"step_time_s": STEP_S, "loss": 1.0 / step})
        if step == RESTORED_STEP:
            first.log_event("checkpoint", step, {"step": step, "stall_s": 0.0})
    first.log_event("fault", FAULT_STEP, {}, severity="critical", name="rank_crash")
    first.close(status="failed")
    time.sleep(0.01)  # the restart comes measurably after the fault
    if legacy:  # exactly what RunStore.create wrote on reopening before run_resumed
        again = RunStore.append(run_dir)
        again.set_status("running")
        again.log_event("restart", None, {"pid": os.getpid(), "world_size": 2},
                        name="store_reopened", message=f"run store reopened by pid {os.getpid()}")
    else:
        again = RunStore.create(run_dir, world_size=2)
    if trainer_restart:  # as RunRecorder.on_event records the trainer's event
        again.log_event("restart", RESTORED_STEP,
                        {"reason": "torchrun", "restored_step": RESTORED_STEP,
                         "source": "storage"}, severity="warning", name="restart")
    for step in range(RESTORED_STEP + 1, 11):
        again.log_metrics(step, {"step_time_s": STEP_S, "loss": 1.0 / step})
    again.close(status="completed")
    return run_dir


def test_reopening_logs_run_resumed_not_restart(tmp_path):
    with RunStore.create(tmp_path, world_size=2):
        pass
    with RunStore.create(tmp_path, world_size=2) as again:
        assert again.resumed
    r = RunStore.open_readonly(tmp_path)
    assert [e.kind for e in r.events()] == ["run_start", "run_end", "run_resumed", "run_end"]
    resumed = r.events(kinds=["run_resumed"])
    assert len(resumed) == 1 and resumed[0].severity == "info"
    assert resumed[0].payload == {"pid": os.getpid(), "world_size": 2,
                                  "previous_status": "completed"}
    assert r.events(kinds=["restart"]) == []


@pytest.mark.parametrize("legacy", [False, True], ids=["new-store", "legacy-store"])
@pytest.mark.parametrize("trainer_restart", [False, True], ids=["no-restart", "restart"])
def test_only_the_trainers_restart_counts(tmp_path, legacy, trainer_restart):
    """The cases with a trainer restart are the negative control: the same readers count it."""
    run = _crashed_then_reopened(tmp_path, legacy=legacy, trainer_restart=trainer_restart)
    with RunStore.open_readonly(run) as store:
        data = run_data(store)
        measured = measured_goodput(store)
        events = {e.kind: e for e in store.events()}
        num_resumed = len(store.events(kinds=["run_resumed"], limit=5))
    assert num_resumed == 1 and "run_resumed" in [e["kind"] for e in data["events"]]
    assert summary(data)["num_restarts"] == int(trainer_restart)
    [fault] = faults_and_recoveries(data["events"])
    assert fault["fault"] == "rank_crash"
    if trainer_restart:
        assert fault["restored_step"] == RESTORED_STEP
        recovery_s = events["restart"].time - events["fault"].time
        assert fault["recovery_s"] == pytest.approx(recovery_s) and recovery_s > 0
        assert measured["lost_steps"] == FAULT_STEP - RESTORED_STEP
        assert measured["seconds"]["recovery"] == pytest.approx(recovery_s)
    else:
        assert fault["restored_step"] is None and fault["recovery_s"] is None
        assert measured["lost_steps"] == 0 and measured["seconds"]["recovery"] == 0.0
    if legacy:  # the row on disk is unchanged: the store maps it when reading
        with sqlite3.connect(store_path(run)) as conn:
            raw = conn.execute("SELECT kind FROM events WHERE name='store_reopened'").fetchall()
        assert raw == [("restart",)]
