"""The launcher's watchdog on real processes: a stopped one is killed and journaled as an
external hang, a killed one is named with its signal, one that says why it exits is not a
fault, and one whose fault the injector fired is not called external."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from trainpilot.runtime.watchdog import Watchdog

CHILD = """
import os, sys, time
from trainpilot.runtime.watchdog import Beacon
b = Beacon(int(sys.argv[1]), directory=sys.argv[2]).start()
b.update(step=7)
mode = sys.argv[3]
go = os.path.join(sys.argv[2], "go")
while not os.path.exists(go):
    time.sleep(0.02)
if mode == "exit":
    b.record_exit(0, "completed")
    sys.exit(0)
if mode == "injected":
    from trainpilot.runtime.faults import FaultInjector
    f = FaultInjector("crash:rank=0,step=8", journal_path=sys.argv[4])
    f.on_step(8, rank=0)
time.sleep(60)
"""


def _child(rank: int, watch, mode: str, journal) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(rank), str(watch), mode,
                             str(journal)], start_new_session=True)


def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.mark.timeout(90)
def test_watchdog_classifies_real_process_ends(tmp_path):
    watch, run = tmp_path / "watch", tmp_path / "run"
    watch.mkdir()
    run.mkdir()
    dog = Watchdog(watch, run_dir=run, timeout_s=1.0).start()
    procs = [_child(r, watch, mode, run / "faults.jsonl")
             for r, mode in enumerate(("stop", "kill", "exit", "injected"))]
    try:
        _until(lambda: len(dog.workers) == 4 and all(v.last_step == 7
                                                     for v in dog.workers.values()))
        (watch / "go").write_text("")
        os.kill(procs[0].pid, signal.SIGSTOP)
        os.kill(procs[1].pid, signal.SIGKILL)
        _until(lambda: len(dog.observations) == 4)
    finally:
        dog.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    seen = {o.rank: o for o in dog.observations}
    assert seen[0].kind == "hang" and seen[0].external and "stopped (SIGSTOP" in seen[0].evidence
    assert procs[0].returncode == -signal.SIGKILL  # the watchdog killed the stopped one
    assert seen[1].kind == "crash" and seen[1].external and "SIGKILL" in seen[1].evidence
    assert seen[2].kind == "exit" and seen[2].reason == "completed" and not seen[2].external
    assert seen[3].kind == "crash" and not seen[3].external  # the injector's own fault
    external = [json.loads(line) for line in (run / "faults.jsonl").read_text().splitlines()
                if json.loads(line).get("source") == "external"]
    assert sorted((r["kind"], r["rank"], r["step"]) for r in external) == [
        ("crash", 1, 8), ("hang", 0, 8)]
    assert dog.first_failure().rank in (0, 1)
