"""Elastic resize under torchrun itself: two agents on this machine emulate two nodes sharing a
c10d rendezvous (``--nnodes=1:2``, one process each). Agent B and its worker are killed (a node
lost): agent A restarts its worker alone (world 1), which restores the world-2 checkpoint from
storage, resharded, and trains with the global batch kept (4 micro-batches instead of 2). A
third agent then joins (a node added): A's worker is restarted with it (world 2), both restore
the world-1 checkpoint. Every step of the run's final history trained on exactly the next 16
samples of the global order: none skipped, none repeated, across both changes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.elastic.helpers import store_events
from trainpilot.store import RunStore

pytestmark = [pytest.mark.dist]

STEPS = 80


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers (torchrun starts workers in their own sessions)."""
    for pid in [*_children(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"kind": "step"') if path.exists() else 0


def _wait_for(predicate, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.2)


@pytest.mark.timeout(240)
def test_node_lost_then_added_under_torchrun(tmp_path):
    run = tmp_path / "run"
    port = _free_port()
    args = [sys.executable, "-m", "trainpilot", "train", "--nnodes", "1:2", "--nproc-per-node",
            "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "elastic-test", "--rdzv-conf", "last_call_timeout=1",
            "--max-restarts", "3", "--recovery", "restart", "--model", "tiny-gpt",
            "--steps", str(STEPS), "--checkpoint-every", "2", "--no-predict", "--no-health",
            "--plan", "dp=2,zero=0,micro_batch_size=4,global_batch_size=16,seq_len=64",
            "--run-dir", str(run), "--json"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def agent(name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    agents = {"a": agent("a")}
    try:
        # The first agent up hosts the rendezvous store (the head node): let it be A, which
        # stays; the store would go down with B.
        _wait_for(lambda: _listening(port), 60)
        agents["b"] = agent("b")
        _wait_for(lambda: _steps_done(run) >= 8, 90)
        _kill_tree(agents["b"])  # a node is lost
        _wait_for(lambda: _steps_done(run) >= 24, 90)
        agents["c"] = agent("c")  # a node joins
        agents["a"].wait(120)
        agents["c"].wait(30)
        assert agents["a"].returncode == 0, (tmp_path / "a.log").read_text()[-3000:]
        assert agents["c"].returncode == 0, (tmp_path / "c.log").read_text()[-3000:]
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                _kill_tree(proc)

    restarts = [e.payload for e in store_events(run, ["restart"]) if "restored_step" in e.payload]
    # If A formed a world of one before B joined, torchrun's agent stopped A's worker with
    # SIGTERM when B came: it saved its step (a last-moment checkpoint) and the world of two
    # resumed from it. Then the node loss (2 -> 1) and the node added (1 -> 2).
    worlds = [(r["saved_world_size"], r["world_size"]) for r in restarts]
    assert worlds[-2:] == [(2, 1), (1, 2)] and set(worlds[:-2]) <= {(1, 2)}, worlds
    assert all(r["source"] == "storage" for r in restarts)
    store = RunStore.open_readonly(run)
    try:
        seen = dict(zip(*store.series("samples_seen")))
        assert sorted(seen) == list(range(1, STEPS + 1))
        assert all(seen[s] == 16 * s for s in seen)  # the sampler's position after each step
        assert store.run().status == "completed"
    finally:
        store.close()
    recovered = [e.payload for e in store_events(run, ["recovered"])]
    assert len(recovered) == len(restarts) and all(r["recovery_s"] > 0 for r in recovered)
