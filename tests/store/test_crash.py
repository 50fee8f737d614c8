"""A SIGKILL during writes loses at most the unflushed batch and never corrupts the store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trainpilot.store import RunStore

NAMES = [f"m{i}" for i in range(40)]
BATCH_STEPS = 25

WRITER = r"""
import sys
from trainpilot.store import RunStore
store = RunStore.create(sys.argv[1], flush_every_steps=%d, flush_interval_s=3600)
names = %r
step = 0
while True:
    step += 1
    store.log_metrics(step, {n: step + i * 1e-3 for i, n in enumerate(names)})
    if store.flushed_step == step:
        print(step, flush=True)  # acknowledged: this batch is committed
""" % (BATCH_STEPS, NAMES)


def _kill_mid_write(run_dir, delay_s: float) -> int:
    """Start a writer, SIGKILL it after ``delay_s``; return the last acknowledged step."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir)], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        first = proc.stdout.readline()  # wait until it is writing
        assert first.strip(), "writer did not start"
        time.sleep(delay_s)
        os.kill(proc.pid, signal.SIGKILL)
        rest = proc.stdout.read().split()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    return int(rest[-1]) if rest else int(first)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay_s", [0.05, 0.3, 0.7])
def test_sigkill_mid_write_keeps_every_acknowledged_batch_and_a_sound_file(tmp_path, delay_s):
    acked = _kill_mid_write(tmp_path, delay_s)
    store = RunStore.open_readonly(tmp_path)
    assert store.integrity_check() == "ok"
    latest = store.latest_step()
    # Nothing acknowledged is lost; at most the batch in flight (never a torn one) is missing.
    assert latest >= acked
    assert latest % BATCH_STEPS == 0, "a partial batch reached the file"
    counts = store._rows("SELECT step, COUNT(*) FROM metrics GROUP BY step")
    assert {c for _, c in counts} == {len(NAMES)} and len(counts) == latest
    assert store.run().status == "running"  # it died: nobody marked it finished


def test_integrity_check_catches_a_corrupted_file(tmp_path):
    """Negative control: the oracle above can fail."""
    with RunStore.create(tmp_path) as store:
        for step in range(1, 400):
            store.log_metrics(step, {n: float(step) for n in NAMES})
    path = tmp_path / "trainpilot.db"
    data = bytearray(path.read_bytes())
    assert len(data) > 64 * 4096
    page = 4096
    for offset in range(20 * page, 40 * page, page):  # scribble over b-tree pages
        data[offset:offset + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    try:
        store = RunStore.open_readonly(tmp_path)
        result = store.integrity_check()
    except Exception as err:  # refused outright (SpecError naming the file): also a detection
        result = f"error: {err}"
    assert result != "ok"


def test_a_crashed_run_is_closed_by_the_launcher_and_a_closed_one_is_left_alone(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    code = ("import sys, time; from trainpilot.store import RunStore\n"
            "s = RunStore.create(sys.argv[1], flush_every_steps=1)\n"
            "for i in range(1, 6): s.log_metrics(i, {'loss': 1.0 / i})\n"
            "s.flush(); print('ready', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    with RunStore.open_readonly(tmp_path) as r:
        assert r.run().status == "running"  # what a killed writer leaves behind
    assert RunStore.close_run(tmp_path, status="crashed", reason="rank 0 killed (SIGKILL)",
                              exit_code=-9)
    with RunStore.open_readonly(tmp_path) as r:
        run = r.run()
        end = r.events(kinds=["run_end"])[-1]
        assert run.status == "crashed" and run.ended_time is not None
        assert end.step == 5 and end.payload["reason"].startswith("rank 0 killed")
    assert not RunStore.close_run(tmp_path, status="failed")  # already closed: unchanged
    with RunStore.open_readonly(tmp_path) as r:
        assert r.run().status == "crashed"
    import pytest as _pytest

    from trainpilot.specs.errors import SpecError
    with _pytest.raises(SpecError):
        RunStore.close_run(tmp_path / "nope", status="crashed")
    with _pytest.raises(SpecError):
        RunStore.close_run(tmp_path, status="exploded")
