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


@pytest.mark.timeout(90)
@pytest.mark.parametrize("rose, cgroup_readable, kind", [
    ("host", True, "crash"),    # another cgroup's OOM kill on this host: not this worker's
    ("cgroup", True, "oom"),    # its own cgroup's count rose: the kernel killed it
    ("host", False, "oom"),     # no cgroup count to read: the host-wide count is all there is
])
def test_a_sigkill_is_an_oom_kill_only_if_the_workers_own_cgroup_counted_one(
        tmp_path, monkeypatch, rose, cgroup_readable, kind):
    """The full suite once ran a memory-cgroup OOM test beside a SIGKILL test: the host-wide
    /proc/vmstat count rose and the SIGKILLed worker was called an OOM kill. The count that
    decides is the worker's own memory cgroup's (the kernel books a kill on the victim's)."""
    from trainpilot.runtime import watchdog as wd

    counter = tmp_path / "memory.oom_control"
    counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    host = [5]
    monkeypatch.setattr(wd, "memcg_oom_file", lambda pid: counter if cgroup_readable else None)
    monkeypatch.setattr(wd, "_oom_kills", lambda: host[0])
    watch, run = tmp_path / "watch", tmp_path / "run"
    watch.mkdir()
    run.mkdir()
    dog = Watchdog(watch, run_dir=run, timeout_s=1.0).start()
    proc = _child(0, watch, "kill", run / "faults.jsonl")
    try:
        _until(lambda: len(dog.workers) == 1)
        if rose == "host":
            host[0] += 1
        else:
            counter.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
        os.kill(proc.pid, signal.SIGKILL)
        _until(lambda: len(dog.observations) == 1)
    finally:
        dog.stop()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    [seen] = dog.observations
    assert seen.kind == kind, seen.evidence
    assert ("out-of-memory" in seen.evidence) == (kind == "oom")


def test_memcg_oom_file_finds_the_workers_own_cgroup(tmp_path):
    from trainpilot.runtime.watchdog import memcg_oom_file, oom_count

    proc, sysfs = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "7").mkdir(parents=True)
    v1 = sysfs / "memory" / "job" / "memory.oom_control"
    v2 = sysfs / "job" / "memory.events.local"
    for f, text in ((v1, "oom_kill_disable 0\noom_kill 3\n"), (v2, "low 0\noom_kill 4\n")):
        f.parent.mkdir(parents=True)
        f.write_text(text)
    (proc / "7" / "cgroup").write_text("12:pids:/job\n4:memory:/job\n0::/job\n")  # hybrid
    assert memcg_oom_file(7, proc=proc, sys_fs=sysfs) == v1 and oom_count(v1) == 3
    (proc / "7" / "cgroup").write_text("0::/job\n")  # unified (v2)
    assert memcg_oom_file(7, proc=proc, sys_fs=sysfs) == v2 and oom_count(v2) == 4
    (proc / "7" / "cgroup").write_text("0::/elsewhere\n")  # no memory files there
    assert memcg_oom_file(7, proc=proc, sys_fs=sysfs) is None
    assert memcg_oom_file(8, proc=proc, sys_fs=sysfs) is None  # no such process
