"""The Trainer wired to the pieces around it, in one process: the run store (documents, metrics,
events) written through the RunRecorder and the HealthMonitor, checkpoints on schedule, and the
monitor's directives honoured — a corrupted data window makes the loss diverge, the rollback
intervention restores an earlier checkpoint through the Trainer's checkpointer and the Trainer
skips the window. The store renders as the HTML report."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.small import SMALL_GPT, SMALL_PLAN
from trainpilot.health.config import load_health_config
from trainpilot.health.monitor import HealthMonitor
from trainpilot.runtime.callbacks import RunRecorder
from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer
from trainpilot.runtime.config import TrainConfig
from trainpilot.runtime.data import MarkovCorpus
from trainpilot.runtime.sampler import ResumableSampler
from trainpilot.runtime.trainer import Trainer
from trainpilot.specs import load_model, load_plan
from trainpilot.store import RunStore

SMALL = SMALL_GPT
PLAN = SMALL_PLAN
BAD_STEPS = range(41, 47)  # the data window that is corrupted


class CorruptWindow:
    """The Markov corpus, except that the samples of ``BAD_STEPS`` have random targets."""

    def __init__(self, base: MarkovCorpus, bad: set[int]):
        self.base, self.bad = base, bad
        self.seq_len, self.num_samples = base.seq_len, base.num_samples

    def get_batch(self, indices):
        inputs, targets = self.base.get_batch(indices)
        rows = [i for i, idx in enumerate(indices) if int(idx) in self.bad]
        if rows:
            gen = torch.Generator().manual_seed(int(indices[rows[0]]))
            targets[rows] = torch.randint(0, 64, targets[rows].shape, generator=gen)
        return inputs, targets


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


@pytest.mark.timeout(120)
def test_store_checkpoints_and_rollback_directive(tmp_path):
    base = MarkovCorpus(vocab_size=64, seq_len=32, seed=0, num_samples=4096, concentration=0.05)
    order = ResumableSampler(4096, seed=0)
    batches = [order.next_indices(16) for _ in range(80)]
    bad = {int(i) for s in BAD_STEPS for i in batches[s - 1]}
    health = load_health_config()
    rollback = health.interventions.rollback_on_divergence.model_copy(
        update=dict(enabled=True, rewind_steps=0, skip_batches=len(BAD_STEPS)))
    health = health.model_copy(update=dict(interventions=health.interventions.model_copy(
        update=dict(rollback_on_divergence=rollback))))
    store = RunStore.create(tmp_path, name="wiring", world_size=1)
    monitor = HealthMonitor(store=store, config=health, total_steps=60)
    monitor.log_events = False
    ckpt = Checkpointer(CheckpointConfig(root_dir=tmp_path / "checkpoints", keep_last=20))
    config = TrainConfig(steps=60, lr=1e-2, warmup_steps=5, predict=False, checkpoint_every=5)
    trainer = Trainer(model=load_model(SMALL), plan=load_plan(PLAN), config=config,
                      dataset=CorruptWindow(base, bad), checkpointer=ckpt, monitor=monitor,
                      callbacks=[RunRecorder(store, rank=0)])
    summary = trainer.fit()
    ckpt.close()
    store.close(status="completed")

    reader = RunStore.open_readonly(tmp_path)
    events = reader.events()
    kinds = [e.kind for e in events]
    rollbacks = [e.payload for e in events if e.kind == "intervention" and e.name == "rollback"
                 and e.payload.get("phase") != "outcome"]
    assert len(rollbacks) == 1, [(e.kind, e.name, e.payload) for e in events][-20:]
    outcome = [e.payload["outcome"] for e in events if e.kind == "intervention"
               and e.payload.get("phase") == "outcome"]
    assert outcome == ["recovered"]  # no flagged step after resuming past the window
    target = rollbacks[0]["after"]["restored_step"]
    assert target % 5 == 0 and target < BAD_STEPS[0]  # a checkpoint before the window
    assert "data_skipped" in kinds and kinds.count("checkpoint") >= 12
    # Every copy overlapped the next step (the model has no buffers).
    assert all(e.payload["overlapped"] for e in events if e.kind == "checkpoint")
    # After the rollback the window was skipped: the sampler is ahead by exactly its batches.
    assert trainer.sampler.state_dict()["position"] == (60 + len(BAD_STEPS)) * 16
    steps, losses = reader.series("loss")
    assert steps == list(range(1, 61))  # every step stored once (replayed steps replaced)
    assert np.isfinite(losses).all() and summary["last_loss"] < losses[0] - 1.0
    names = set(reader.metric_names())
    assert {"loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "samples_seen",
            "health/score"} <= names
    assert max(reader.series("grad_norm")[1]) > 1.0  # the pre-clip norm (clip is at 1.0)
    reader.close()

    from trainpilot.ui.report import write_report

    out = write_report(tmp_path, tmp_path / "r.html")["html"]
    assert out.stat().st_size > 10_000


def _monitored_run(tmp_path, steps: int, *, bad: set[int], load_monitor: bool = True):
    """The small GPT with a health monitor (skip_batch_on_spike on) and a checkpoint every
    10 steps, trained to ``steps`` (resuming from tmp_path's checkpoints if any)."""
    base = MarkovCorpus(vocab_size=64, seq_len=32, seed=0, num_samples=4096, concentration=0.05)
    monitor = HealthMonitor(config=load_health_config().with_interventions(
        skip_batch_on_spike=True), total_steps=50)
    if not load_monitor:  # the negative control: a restarted monitor that forgot everything
        monitor.load_state_dict = lambda state: None
    ckpt = Checkpointer(CheckpointConfig(root_dir=tmp_path / "checkpoints"))
    trainer = Trainer(model=load_model(SMALL), plan=load_plan(PLAN), monitor=monitor,
                      config=TrainConfig(steps=50, lr=1e-2, warmup_steps=5, predict=False,
                                         checkpoint_every=10),
                      dataset=CorruptWindow(base, bad), checkpointer=ckpt)
    trainer.fit(steps)
    ckpt.close()
    alerts = [(a.rule, a.step) for a in monitor.alerts.log]
    skips = [r.step for r in monitor.interventions.records if r.action == "skip_batch"]
    return trainer, alerts, skips


@pytest.mark.timeout(120)
def test_monitor_state_survives_a_restart(tmp_path):
    """A job restarted from its step-30 checkpoint: its new monitor continues with the old
    one's windows, so it flags and skips a corrupted batch at step 33 exactly as a monitor that
    never stopped did (same alerts, same skips, bit-identical weights). Negative control: a
    restarted monitor without that state has too short a window to judge step 33."""
    order = ResumableSampler(4096, seed=0)
    batches = [order.next_indices(16) for _ in range(50)]
    bad = {int(i) for i in batches[33 - 1]}
    reference, ref_alerts, ref_skips = _monitored_run(tmp_path / "a", 50, bad=bad)
    assert ref_skips == [33] and ("divergence_risk", 33) in ref_alerts

    _monitored_run(tmp_path / "b", 30, bad=bad)
    resumed, alerts, skips = _monitored_run(tmp_path / "b", 50, bad=bad)
    assert resumed.monitor.good_steps[:3] == [10, 20, 30]  # rollback targets from before
    assert skips == ref_skips and alerts == [a for a in ref_alerts if a[1] > 30]
    a, b = reference.state_dict()["model"], resumed.state_dict()["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)

    _monitored_run(tmp_path / "c", 30, bad=bad)
    forgot, alerts, skips = _monitored_run(tmp_path / "c", 50, bad=bad, load_monitor=False)
    assert skips == [] and ("divergence_risk", 33) not in alerts
    c = forgot.state_dict()["model"]
    assert not all(torch.equal(a[k], c[k]) for k in a)
