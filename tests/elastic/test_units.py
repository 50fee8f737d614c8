"""The elastic pieces without a training run: configuration, the plan at another world size,
collective retry, generations and heartbeats over a real TCPStore (in this process), and the
run recorder's fault ingestion."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from trainpilot.runtime.elastic import ElasticConfig, retry_collective
from trainpilot.runtime.elastic.heartbeat import Heartbeat
from trainpilot.runtime.elastic.rendezvous import Generations, WorkerEnv
from trainpilot.runtime.elastic.resize import plan_for_world
from trainpilot.runtime.elastic.retry import CollectiveFailure
from trainpilot.runtime.faults import FaultInjector, InjectedCollectiveError
from trainpilot.specs import SpecError, load_plan


def test_config_is_validated():
    with pytest.raises(SpecError, match="elastic.heartbeat_timeout_s"):
        ElasticConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=1.5)
    with pytest.raises(SpecError, match="elastic.recovery"):
        ElasticConfig(recovery="pray")
    with pytest.raises(SpecError, match="elastic.max_collective_retries"):
        ElasticConfig(max_collective_retries=-1)


def test_plan_for_world_keeps_the_global_batch():
    plan = load_plan("dp=4,zero=3,micro_batch_size=4,global_batch_size=16,seq_len=32")
    half = plan_for_world(plan, 2)
    assert (half.dp, half.micro_batch_size, half.num_micro_batches) == (2, 4, 2)
    assert half.global_batch_size == plan.global_batch_size
    eight = plan_for_world(plan, 8)  # 16 / 8 = 2 per rank: the micro-batch shrinks to fit
    assert (eight.dp, eight.micro_batch_size, eight.num_micro_batches) == (8, 2, 1)
    assert plan_for_world(plan, 4) is plan
    with pytest.raises(SpecError, match="does not divide"):
        plan_for_world(plan, 3)
    with pytest.raises(SpecError, match="multiple of tp"):
        plan_for_world(load_plan("tp=2,dp=2,global_batch_size=16,seq_len=32"), 3)


def test_transient_collective_failure_is_retried_and_issued_once():
    faults = FaultInjector("collective:rank=0,step=3")
    issued, retries = [], []
    out = retry_collective(lambda: issued.append(1) or "done", step=3, max_retries=2,
                           before=lambda: faults.before_collective(3, rank=0),
                           on_retry=lambda n, e: retries.append(n))
    assert out == "done" and issued == [1] and retries == [1]
    assert len(faults.fired("collective")) == 1


def test_retries_run_out_then_escalate():
    faults = FaultInjector(";".join(["collective:rank=0,step=3"] * 3))
    with pytest.raises(CollectiveFailure) as info:
        retry_collective(lambda: "never", step=3, max_retries=2,
                         before=lambda: faults.before_collective(3, rank=0))
    assert info.value.attempts == 3 and isinstance(info.value.cause, InjectedCollectiveError)


def test_an_error_from_the_wire_escalates_at_once():
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("[gloo] Connection closed by peer")

    with pytest.raises(CollectiveFailure, match="on the wire"):
        retry_collective(broken, step=1, max_retries=5)
    assert calls == [1]  # a broken group is not retried


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10),
                         wait_for_workers=False)


def _env(rank: int, port: int) -> WorkerEnv:
    return WorkerEnv(rank=rank, world_size=2, local_rank=rank, master_addr="127.0.0.1",
                     master_port=port, restart_count=0, run_id="unit")


def test_generations_only_move_forward(store):
    a, b = Generations(store, _env(0, store.port)), Generations(store, _env(1, store.port))
    assert (a.incarnation, b.incarnation, a.current()) == (1, 1, 0)
    assert a.advance(0) == 1 and b.advance(0) == 1  # both failed in 0: both meet in 1
    assert b.advance(3) == 4 and a.advance(1) == 4  # a late failure joins the newest
    again = Generations(store, _env(1, store.port))  # a replacement process for rank 1
    assert again.incarnation == 2


def _beats(store, rank, **kw):
    prefixed = dist.PrefixStore("trainpilot/unit/attempt0", store)
    return Heartbeat(prefixed, rank=rank, world_size=2, incarnation=1, interval_s=0.05,
                     timeout_s=0.5, hang_grace_s=0.3, kill=False, **kw)


def test_heartbeat_declares_a_silent_rank_failed(store):
    verdicts = []
    watcher = _beats(store, 0, on_verdict=verdicts.append).start()
    peer = _beats(store, 1).start()
    try:
        time.sleep(0.6)
        assert verdicts == []  # both beating: nobody is declared
        peer._stop.set()  # its thread stops beating, without the final "done" beat:
        peer._thread.join()  # what SIGSTOP or a crash looks like from outside
        deadline = time.monotonic() + 5
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(v.rank, v.reason) for v in verdicts] == [(1, "silent")]
        assert 0.5 <= verdicts[0].waited_s < 2.0
    finally:
        watcher.stop()
        peer.stop()


def test_a_kill_from_an_older_generation_is_stale(store, monkeypatch):
    """A rank cut off past the collective timeout (a partition) is declared silent in its
    generation, times out of it itself and joins the next: the kill issued for the old
    generation is ignored, and the watcher withdraws the verdict once that same process reports
    the newer one. Negative control: a rank still in the declared generation (a stopped process
    resuming) obeys the kill."""
    import os
    import signal

    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    watcher = _beats(store, 0)
    watcher.kill = True
    peer = _beats(store, 1)
    peer._beat()
    watcher._watch()  # it sees the peer beating, in generation 0
    watcher.peers[1].changed_at -= 10  # then nothing for 10 s (the partition)
    watcher._watch()
    assert [(v.rank, v.reason, v.gen) for v in watcher.verdicts] == [(1, "silent", 0)]
    assert killed == [(os.getpid(), signal.SIGKILL)]  # "this host's" pid: the direct path
    killed.clear()
    peer._obey_kill()  # still in generation 0 (the control): it obeys the store's kill
    assert killed == [(os.getpid(), signal.SIGKILL)]
    killed.clear()
    peer.update(gen=1)  # cut off, it timed out of generation 0 and joins generation 1
    peer._obey_kill()
    assert killed == []  # stale: ignored
    peer._beat()
    watcher._watch()  # the same process, in generation 1: the verdict is withdrawn
    assert watcher.verdicts == [] and (1, 1) not in watcher._acted
    assert not watcher.store.check(["kill/1/1"])


def test_a_recovering_rank_reports_the_next_generation_before_it_asks_the_store(
        store, monkeypatch):
    """The race behind a flaky multi-node run: cut off, a rank that timed out of generation 0
    asks the store to advance, and that request waits for the heal; its heartbeat thread's own
    connection may come back first and find the kill issued for generation 0. By then the
    heartbeat must already report generation 1, so the kill is stale. Negative control: the
    same kill obeyed at generation 0 (the order the session used before)."""
    import os
    import signal

    from trainpilot.runtime.elastic.session import ElasticSession

    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    peer = _beats(store, 1)
    peer.store.set("kill/1/1", '{"by": 0, "reason": "silent", "gen": 0}')
    peer._obey_kill()  # the control: in generation 0, the kill is obeyed
    assert killed == [(os.getpid(), signal.SIGKILL)]
    killed.clear()

    class Cut(Exception):
        pass

    class BlockedGenerations:
        def advance(self, failed_gen):  # the heal has not come: the heartbeat gets there first
            peer._obey_kill()
            raise Cut

    session = ElasticSession.__new__(ElasticSession)
    session.config, session.env = ElasticConfig(), _env(1, store.port)
    session.gens, session.heartbeat = BlockedGenerations(), peer
    session.gen, session.num_recoveries = 0, 0
    trainer = type("T", (), {"step": 4})()
    with pytest.raises(Cut):
        session.recover(trainer, RuntimeError("Timed out waiting 5000ms for recv"))
    assert killed == [] and peer.gen == 1 and peer.phase == "recovery"


def test_a_rank_that_finished_is_not_declared_failed(store):
    verdicts = []
    watcher = _beats(store, 0, on_verdict=verdicts.append).start()
    peer = _beats(store, 1).start()
    try:
        time.sleep(0.3)
        peer.stop()  # done: its last beat says so
        time.sleep(1.2)  # more than twice the silence timeout
        assert verdicts == []
    finally:
        watcher.stop()


def test_heartbeat_declares_a_rank_left_behind_hung(store):
    verdicts = []
    watcher = _beats(store, 0, on_verdict=verdicts.append).start()
    peer = _beats(store, 1).start()  # alive (its thread beats) but stuck in generation 0
    try:
        watcher.update(gen=1)  # the others moved on after a failure
        deadline = time.monotonic() + 5
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(v.rank, v.reason) for v in verdicts] == [(1, "hung")]
        body = store.get("trainpilot/unit/attempt0/failed/1/1")
        assert b"hung" in body
    finally:
        watcher.stop()
        peer.stop()


def test_recorder_logs_faults_of_every_rank_with_their_time(tmp_path):
    from trainpilot.runtime.callbacks import RunRecorder
    from trainpilot.store import RunStore

    faults = FaultInjector("slow:rank=1,step=2,factor=1;collective:rank=0,step=3",
                           journal_path=tmp_path / "faults.jsonl")
    faults.on_step(2, rank=1, step_time_s=0.0)  # fires "on rank 1", which cannot write
    with pytest.raises(InjectedCollectiveError):
        faults.before_collective(3, rank=0)
    fired_at = [r["time_unix_s"] for r in faults.fired()]
    time.sleep(0.05)
    with RunStore.create(tmp_path) as store:
        recorder = RunRecorder(store, rank=0, journal=faults)
        recorder.ingest_journal()
        recorder.ingest_journal()  # idempotent
        events = store.events(kinds=["fault"])
        assert [e.payload["kind"] for e in events] == ["slow", "collective"]
        assert [e.time for e in events] == fired_at
    with RunStore.create(tmp_path) as store:  # a restarted rank 0 does not log them again
        RunRecorder(store, rank=0, journal=faults).ingest_journal()
        assert len(store.events(kinds=["fault"])) == 2


def test_chaos_spec_expands_to_the_same_seeded_schedule():
    from trainpilot.runtime.faults import expand_chaos, parse_faults

    spec = "chaos:rate=0.2,kinds=crash+hang,seed=3;collective:rank=0,step=2"
    once = expand_chaos(spec, num_steps=50, world_size=4)
    assert once == expand_chaos(spec, num_steps=50, world_size=4)  # replayable
    faults = parse_faults(once, world_size=4, num_steps=50)
    assert faults[-1].kind == "collective"  # the chaos part expands in place, in order
    drawn = faults[:-1]
    assert 4 <= len(drawn) <= 20 and {f.kind for f in drawn} <= {"crash", "hang"}
    assert all(2 <= f.get("step") <= 50 and 0 <= f.get("rank") < 4 for f in drawn)
    assert once != expand_chaos(spec.replace("seed=3", "seed=4"), num_steps=50, world_size=4)
