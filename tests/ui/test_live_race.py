"""The live API never drops a point: a writer process commits each step in pieces while a
reader polls the real dashboard server as fast as it can; merging the answers as the page does
gives every step of every series. Negative control: the step cursor the page used before
(advance to the newest step, read up to it) loses steps against the same writer."""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
import time
import urllib.request

from tests.ui import helpers
from trainpilot.store import RunStore

NUM_STEPS = 300


def replace_range(target: dict, s: dict) -> None:
    """The page's merge (dashboard.js replaceRange): s replaces target's points in [lo, hi]."""
    a = bisect.bisect_left(target["steps"], s["lo"])
    b = bisect.bisect_right(target["steps"], s["hi"])
    target["steps"][a:b] = s["steps"]
    target["values"][a:b] = s["values"]


def merge(state: dict, answer: dict) -> None:
    for name, s in answer["series"].items():
        if not answer["incremental"] or name not in state["series"]:
            state["series"][name] = {"steps": list(s["steps"]), "values": list(s["values"])}
        else:
            replace_range(state["series"][name], s)
    for rank, cols in answer["ranks"].items():
        mine = state["ranks"].setdefault(rank, {})
        for col, s in cols.items():
            if not answer["incremental"] or col not in mine:
                mine[col] = {"steps": list(s["steps"]), "values": list(s["values"])}
            else:
                replace_range(mine[col], s)
    state["cursor"] = answer["cursor"]


def old_step_cursor_read(store: RunStore, since_step: int | None) -> tuple[int | None, dict]:
    """What the page did before: cursor = newest step in ``steps``, then every series up to it."""
    until = store.latest_step()
    if until is None:
        until = since_step
    names = store.metric_names()
    return until, store.metrics(names, since_step=since_step, until_step=until)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def test_a_reader_racing_the_writer_sees_every_step(tmp_path):
    run_dir, go = tmp_path / "race", tmp_path / "go"
    writer = subprocess.Popen([sys.executable, "-m", "tests.ui._race_writer", str(run_dir),
                               str(NUM_STEPS), str(go)], cwd=helpers.REPO,
                              start_new_session=True)
    deadline = time.monotonic() + 60
    while not (run_dir / "trainpilot.db").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc, url = helpers.start_dashboard(run_dir)
    old_reader = RunStore.open_readonly(run_dir)
    state = {"series": {}, "ranks": {}, "cursor": None}
    old_cursor, old_seen = None, {"loss": set(), "step_time_s": set()}
    polls = 0
    try:
        base = url.split("?")[0].rstrip("/")
        go.write_text("go")
        while True:
            done = writer.poll() is not None
            q = "" if state["cursor"] is None else f"&since_batch={state['cursor']['batch']}"
            merge(state, get(f"{base}/api/run?key=.{q}"))
            old_cursor, rows = old_step_cursor_read(old_reader, old_cursor)
            for name in old_seen:
                old_seen[name].update(s for s, _ in rows.get(name, []))
            polls += 1
            if done:
                break
        assert writer.returncode == 0
    finally:
        helpers.kill_tree(proc)
        helpers.kill_tree(writer)
        old_reader.close()
    every = list(range(1, NUM_STEPS + 1))
    assert polls > 20  # the reader really raced the writer
    for name in ("loss", "lr", "health/score", "step_time_s", "tokens_per_s"):
        assert state["series"][name]["steps"] == every, name
    assert state["series"]["loss"]["values"][99] == 5.0 / 100 ** 0.5
    for rank in ("0", "1"):
        assert state["ranks"][rank]["compute_s"]["steps"] == every
    # Negative control: the old cursor, racing the same writer, lost steps of the half of each
    # step that was committed after the cursor had already moved past it.
    lost = set(every) - old_seen["loss"] | set(every) - old_seen["step_time_s"]
    print(f"polls {polls}, steps the old cursor lost: {len(lost)} of {NUM_STEPS}")
    assert lost, "the old step cursor lost nothing: the race did not happen"
