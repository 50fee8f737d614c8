"""The preemption guard in real processes: a signal is seen even while the main thread is
blocked; a signal during a failure makes the process leave at once; past the deadline it
leaves whatever it was doing, with ``128 + signal``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

CHILD = """
import json, os, sys, time
from trainpilot.runtime.preempt import PreemptGuard
mode, out = sys.argv[1], sys.argv[2]
def on_exit(code, reason, message):
    open(out, "w").write(json.dumps(dict(code=code, reason=reason)))
guard = PreemptGuard(["TERM", "USR1"], deadline_s=1.5, on_exit=on_exit).install()
r, w = os.pipe()
if mode == "poll":
    print("ready", flush=True)
    while not guard.requested:
        time.sleep(0.01)
    open(out, "w").write(json.dumps(dict(signal=guard.signal_name, code=guard.exit_code)))
    sys.exit(0)
if mode == "failing":
    with guard.during_failure():
        print("ready", flush=True)  # inside the failure: a signal before it raises Preempted
        os.read(r, 1)  # blocked, as in a collective with a dead peer
print("ready", flush=True)
os.read(r, 1)  # blocked and not failing: only the deadline ends it
"""


def _run(mode: str, sig: int, tmp_path) -> tuple[int, dict, float]:
    out = tmp_path / f"{mode}.json"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(out)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    start = time.monotonic()
    proc.send_signal(sig)
    code = proc.wait(timeout=30)
    return code, json.loads(out.read_text()), time.monotonic() - start


@pytest.mark.timeout(60)
def test_guard_in_real_processes(tmp_path):
    code, seen, _ = _run("poll", signal.SIGUSR1, tmp_path)
    assert code == 0 and seen == dict(signal="SIGUSR1", code=128 + signal.SIGUSR1)
    code, seen, took = _run("failing", signal.SIGTERM, tmp_path)
    assert code == 143 and seen["reason"] == "terminated" and took < 1.2  # not the deadline
    code, seen, took = _run("blocked", signal.SIGTERM, tmp_path)
    assert code == 143 and seen["reason"] == "preempt_deadline" and took >= 1.4
