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
