"""The health score separates what it should: a run that learns nothing and a run with a
damaging loss spike score clearly below clean runs (the bands of docs/health.md), measured on
the real toy training loop, with clean runs of several seeds as the reference."""

from __future__ import annotations

import logging
import statistics

import pytest
import torch

from tests.health.toyrun import ToyTrainer
from trainpilot.health.monitor import HealthMonitor
from trainpilot.health.score import band

pytestmark = pytest.mark.timeout(240)
logging.getLogger("trainpilot.health").setLevel(logging.ERROR)
STEPS = 220


def scores(*, seed=0, lr=3e-3, spike_at=None):
    torch.set_num_threads(1)
    trainer = ToyTrainer(seed=seed, lr=lr)
    monitor = HealthMonitor(model=trainer.model, optimizer=trainer.optimizer)
    out = {}

    def hook(step, loss):
        return loss * 30 if step == spike_at else loss

    original = monitor.end_step

    def end_step(record=None, **fields):
        directive = original(record, **fields)
        out[monitor._last_step] = monitor.last_score.score
        return directive

    monitor.end_step = end_step
    trainer.train(monitor, STEPS, loss_hook=hook if spike_at else None)
    return out


def test_non_learning_and_spiked_runs_score_clearly_below_clean_runs():
    clean = [scores(seed=s) for s in (0, 1, 2)]
    tail = [min(v for k, v in run.items() if k > 120) for run in clean]
    assert min(tail) >= 90, tail  # the worst step of a clean run after warm-up: healthy
    frozen = scores(lr=0.0)  # no learning: the optimizer changes nothing
    late = [v for k, v in frozen.items() if k > 120]
    assert max(late) <= 75 and band(statistics.median(late)) == "act", max(late)
    spiked = scores(spike_at=150)
    after = [v for k, v in spiked.items() if 150 <= k <= 190]
    assert max(after) <= 85 and band(max(after)) in ("watch", "act"), after[:5]
    # The spike's memory ends: 60 steps later the run is healthy again.
    assert min(v for k, v in spiked.items() if k > 205) >= 90
