"""Checkpointer on one process (no process group): bit-exact resume from memory and storage,
the negative control, snapshot isolation, incremental and zstd saves, retention, no pickles."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

from tests.checkpoint.tiny import Tiny, trained
from trainpilot.runtime.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    TemplateMismatch,
    committed,
    diff_states,
)
from trainpilot.runtime.faults import FaultInjector


def make(tmp_path, **kw) -> Checkpointer:
    return Checkpointer(CheckpointConfig(root_dir=tmp_path / "ckpt", **kw))


def resume(ckpt: Checkpointer, source: str, **kw) -> tuple[Tiny, object]:
    """A fresh run with a different seed, restored from ``ckpt``."""
    fresh = Tiny(seed=123)
    restored = ckpt.restore_latest(fresh.state_dict(), source=source, **kw)
    fresh.load_state_dict(restored.state)
    return fresh, restored


@pytest.mark.parametrize("source", ["memory", "storage"])
def test_resume_is_bit_exact_and_the_oracle_can_fail(tmp_path, source):
    run = trained(3)
    with make(tmp_path) as ckpt:
        ckpt.save(3, run.state_dict()).result()
        for _ in range(4):
            run.train_step()
        # Storage restores go through a new checkpointer: nothing in host memory.
        reader = ckpt if source == "memory" else make(tmp_path)
        again, restored = resume(reader, source)
        assert (restored.step, restored.source, restored.rng_restored) == (3, source, True)
        for _ in range(4):
            again.train_step()
        assert diff_states(again.state_dict(), run.state_dict()) == []
        assert again.losses == run.losses[3:]

        # Negative control: the same restore without the RNG state must diverge.
        control, restored = resume(reader, source, restore_rng=False)
        assert not restored.rng_restored
        for _ in range(4):
            control.train_step()
        differences = diff_states(control.state_dict(), run.state_dict())
        assert any(d.startswith("state.model.") for d in differences), differences
        assert control.losses != run.losses[3:]


def test_oracle_sees_one_flipped_bit_and_nan_payloads():
    a = {"w": torch.tensor([1.0, float("nan"), -0.0]), "meta": (1, "x")}
    b = copy.deepcopy(a)
    assert diff_states(a, b) == []
    b["w"][2] = 0.0  # -0.0 vs 0.0: equal as numbers, different bits
    assert diff_states(a, b) == ["state.w: 1 of 3 elements differ"]
    b = copy.deepcopy(a)
    b["meta"] = [1, "x"]
    assert diff_states(a, b) == ["state.meta: tuple[2] vs list[2]"]


def test_snapshot_isolation_mutation_after_save_does_not_leak(tmp_path):
    run = trained(2)
    expected = copy.deepcopy(run.state_dict())
    # Hold the writer for a moment so the mutation below happens while the write is in flight.
    faults = FaultInjector("slow:rank=0,step=2,at=checkpoint,seconds=0.5")
    with make(tmp_path) as ckpt:
        ckpt.faults = faults
        handle = ckpt.save(2, run.state_dict())
        assert not handle.done()
        with torch.no_grad():
            for p in run.model.parameters():
                p.add_(1.0)
            for state in run.opt.state.values():
                state["exp_avg"].mul_(-3.0)
        handle.result()
        assert faults.fired("slow"), "the writer was not held: the test proves nothing"
        mutated = run.state_dict()
        assert diff_states(mutated, expected) != []  # the mutation really happened
        for source, reader in (("memory", ckpt), ("storage", make(tmp_path))):
            restored = reader.restore_latest(Tiny(9).state_dict(), source=source)
            assert diff_states(restored.state, expected) == [], source


def _mutate(run) -> None:
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)


@pytest.mark.parametrize("fenced", [True, False])
def test_overlapped_copy_is_isolated_once_fenced(tmp_path, fenced):
    """save(overlap=True) returns before the copy; fence() waits for it. The writer is gated
    so the copy is certainly still pending when the caller goes on. Negative control: changing
    the state before the fence leaks into the checkpoint (the copy really was deferred)."""
    run = trained(2)
    expected = copy.deepcopy(run.state_dict())
    gate = threading.Event()
    with make(tmp_path) as ckpt:
        ckpt._executor.submit(gate.wait)  # the writer thread is busy until the gate opens
        handle = ckpt.save(2, run.state_dict(), overlap=True)
        assert handle.report.overlapped and not handle.staged.done()
        if fenced:
            threading.Timer(0.3, gate.set).start()
            waited = ckpt.fence()
            assert waited >= 0.2 and handle.report.fence_s == waited  # it really waited
            assert handle.stall_s >= waited and ckpt.fence() == 0.0  # counted once
            _mutate(run)
        else:
            _mutate(run)  # breaks the contract: changes the state before the fence
            gate.set()
        handle.result()
        assert diff_states(run.state_dict(), expected) != []  # the mutation really happened
        restored = ckpt.restore_latest(Tiny(9).state_dict(), source="memory")
        leaked = diff_states(restored.state, expected)
        assert (leaked == []) if fenced else any(d.startswith("state.model.") for d in leaked)


def test_incremental_references_unchanged_tensors(tmp_path):
    run = Tiny(0, frozen_first=True)
    frozen_bytes = sum(t.numel() * t.element_size() for t in run.model[0].parameters())
    with make(tmp_path, incremental=True, full_every=3, keep_last=1) as ckpt:
        reports, states = [], {}
        for step in range(1, 6):
            run.train_step()
            reports.append(ckpt.save(step, run.state_dict()).result())
            states[step] = copy.deepcopy(run.state_dict())
        assert [r.incremental for r in reports] == [False, True, True, False, True]
        first, second = reports[0], reports[1]
        assert first.bytes_referenced == 0 and first.bytes_written == first.bytes_raw
        # Frozen weights (and anything else unchanged) are referenced, not rewritten.
        assert second.bytes_referenced >= frozen_bytes
        assert second.bytes_written + second.bytes_referenced == second.bytes_raw
        assert second.manifest_stats["bytes_written"] == second.bytes_written
        # keep_last=1 keeps step 5 and the full save it references (step 4), nothing else.
        assert [s for s, _ in committed(ckpt.root)] == [5, 4]
        restored = make(tmp_path).restore_latest(Tiny(7, frozen_first=True).state_dict(),
                                                 source="storage")
        assert restored.step == 5 and diff_states(restored.state, states[5]) == []


def test_zstd_round_trip_and_bytes(tmp_path):
    run = trained(2)
    state = {**run.state_dict(), "zeros": torch.zeros(16384)}
    with make(tmp_path, compress=True) as ckpt:
        report = ckpt.save(2, state).result()
    assert report.bytes_written < report.bytes_raw - 60_000  # 64 KiB of zeros compress away
    restored = make(tmp_path).restore_latest(
        {**Tiny(5).state_dict(), "zeros": torch.ones(16384)}, source="storage")
    assert diff_states(restored.state, state) == []


def test_retention_keeps_last_k_and_every_nth(tmp_path):
    with make(tmp_path, keep_last=2, keep_every=4, async_save=False) as ckpt:
        for step in range(1, 10):
            ckpt.save(step, {"x": torch.full((4,), float(step))}).result()
    assert [s for s, _ in committed(tmp_path / "ckpt")] == [9, 8, 4]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_0000000009"


def test_loading_never_unpickles(tmp_path, monkeypatch):
    run = trained(2)
    with make(tmp_path) as ckpt:
        ckpt.save(2, run.state_dict()).result()
    # DCP's pickled .metadata is written beside the manifest for stock dcp.load
    # (runtime/checkpoint/interop.py); our restore must not read it.
    assert list((tmp_path / "ckpt").rglob(".metadata"))

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling during restore")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    restored = make(tmp_path).restore_latest(Tiny(3).state_dict(), source="storage")
    assert diff_states(restored.state, run.state_dict()) == []


def test_template_mismatch_is_an_error_not_a_silent_load(tmp_path):
    with make(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.zeros(3, 4)}).result()
    with pytest.raises(TemplateMismatch, match="w"):
        make(tmp_path).restore_latest({"w": torch.zeros(4, 3)}, source="storage")
    with pytest.raises(TemplateMismatch, match="not in the checkpoint"):
        make(tmp_path).restore_latest({"w": torch.zeros(3, 4), "b": torch.zeros(1)},
                                      source="storage")


def test_nothing_to_restore_returns_none(tmp_path):
    assert make(tmp_path).restore_latest({"w": torch.zeros(2)}) is None


def test_saving_after_a_rollback_sets_the_abandoned_timeline_aside(tmp_path):
    with make(tmp_path) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"x": torch.full((2,), float(step))}).result()
        # Rolled back to step 2 (say step 3 was damaged): the new step 2 replaces the old 2
        # and 3, which must never be restored again; they are moved aside, not deleted.
        ckpt.save(2, {"x": torch.full((2,), -2.0)}).result()
    root = tmp_path / "ckpt"
    assert [s for s, _ in committed(root)] == [2, 1]
    assert sorted(p.name.split("-")[0] for p in (root / "abandoned").iterdir()) == [
        "step_0000000002", "step_0000000003"]
    restored = make(tmp_path).restore_latest({"x": torch.zeros(2)}, source="storage")
    assert restored.step == 2 and restored.state["x"].tolist() == [-2.0, -2.0]


@pytest.mark.timeout(60)
def test_one_rank_gloo_group(tmp_path):
    """Tier 2: the same round trip through a real (one-rank) gloo group and DCP collectives."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        run = trained(2)
        with make(tmp_path) as ckpt:
            assert ckpt.group.pg is not None and ckpt.world_size == 1
            ckpt.save(2, run.state_dict()).result()
            for source in ("memory", "storage"):
                restored = ckpt.restore_latest(Tiny(4).state_dict(), source=source)
                assert restored.source == source
                assert diff_states(restored.state, run.state_dict()) == []
    finally:
        dist.destroy_process_group()


def test_retention_runs_under_the_rebind_lock_and_a_stale_save_skips_it(tmp_path, monkeypatch):
    """A save's tail after the commit (the incremental base, retention's deletions) holds off
    a rebind, and a save whose group was rebuilt after it committed deletes nothing: otherwise
    an abandoned save's retention could delete folders of the new timeline."""
    import torch.distributed.checkpoint as dcp

    from trainpilot.runtime.checkpoint import CheckpointWriteError, layout

    calls: list[bool] = []
    real_retention = layout.apply_retention

    def retention(*args, **kwargs):
        calls.append(ckpt._generation_lock.locked())
        return real_retention(*args, **kwargs)

    monkeypatch.setattr(layout, "apply_retention", retention)
    ckpt = make(tmp_path, keep_last=1, async_save=False)
    with ckpt:
        ckpt.save(1, {"x": torch.zeros(2)}).result()
        assert calls == [True]  # retention ran, with a rebind held off

        real_save = dcp.save

        def save_then_rebind(*args, **kwargs):
            out = real_save(*args, **kwargs)
            with ckpt._generation_lock:  # a rebind lands right after the commit
                ckpt._generation += 1
            return out

        monkeypatch.setattr(dcp, "save", save_then_rebind)
        with pytest.raises(CheckpointWriteError, match="abandoned"):
            ckpt.save(2, {"x": torch.ones(2)}).result()
    assert calls == [True]  # the stale save never reached retention
    # Negative control: the same save with no rebind does reach it (keep_last=1 deletes 1).
    monkeypatch.setattr(dcp, "save", real_save)
    with make(tmp_path, keep_last=1, async_save=False) as fresh:
        ckpt = fresh
        fresh.save(3, {"x": torch.ones(2)}).result()
    assert calls == [True, True]
    assert [s for s, _ in committed(tmp_path / "ckpt")] == [3]
