"""A tiny, real training loop watched by the HealthMonitor — for tests, benchmarks and anyone
who needs a run store from a short real run (the dashboard's tests).

The model is a small residual MLP language model (embedding, ``num_layers`` MLP blocks, output
head) trained with AdamW on next-token prediction over a seeded first-order Markov chain, so the
loss falls like a real LM's toward a known floor (the chain's entropy rate). One process, CPU,
a few milliseconds per step. Faults are injected through hooks: ``loss_hook`` (scale a loss),
``grad_hook`` (NaN or zero gradients), ``poison`` (corrupt a data window).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainpilot.health.monitor import Directive, HealthMonitor, StepRecord


class ToyLM(nn.Module):
    """Embedding -> ``num_layers`` x (LayerNorm, Linear, GELU, Linear, residual) -> head."""

    def __init__(self, *, vocab_size: int = 32, dim: int = 32, num_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim),
                                                  nn.GELU(), nn.Linear(2 * dim, dim))
                                    for _ in range(num_layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class MarkovData:
    """Batch ``i`` is a pure function of ``(seed, i)``: a rollback replays exact batches."""

    def __init__(self, *, vocab_size: int, seq_len: int, batch_size: int, seed: int = 0):
        rng = np.random.default_rng([seed, 7])
        self.transition = rng.dirichlet(np.full(vocab_size, 0.2), size=vocab_size)
        self.cdf = np.cumsum(self.transition, axis=1)
        self.cdf[:, -1] = 1.0
        self.vocab_size, self.seq_len, self.batch_size, self.seed = (vocab_size, seq_len,
                                                                     batch_size, seed)

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, 11, index])
        u = rng.random((self.batch_size, self.seq_len + 1))
        tokens = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        tokens[:, 0] = rng.integers(0, self.vocab_size, self.batch_size)
        for t in range(1, self.seq_len + 1):
            tokens[:, t] = (self.cdf[tokens[:, t - 1]] < u[:, t, None]).sum(axis=1)
        data = torch.from_numpy(tokens)
        return data[:, :-1], data[:, 1:]


@dataclass(kw_only=True)
class ToyResult:
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss of its last run
    directives: dict[int, Directive] = field(default_factory=dict)
    batches_used: list[tuple[int, int]] = field(default_factory=list)  # (step, data index) of
    # every update applied, in order (a rollback repeats steps)
    restored: list[int] = field(default_factory=list)


class ToyTrainer:
    """The loop a user would write, with in-memory checkpoints for the rollback intervention."""

    def __init__(self, *, seed: int = 0, vocab_size: int = 32, dim: int = 32,
                 num_layers: int = 2, seq_len: int = 32, batch_size: int = 16, lr: float = 3e-3):
        torch.manual_seed(seed)
        self.model = ToyLM(vocab_size=vocab_size, dim=dim, num_layers=num_layers)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0,
                                           foreach=True)
        self.data = MarkovData(vocab_size=vocab_size, seq_len=seq_len, batch_size=batch_size,
                               seed=seed)
        self.tokens_per_step = seq_len * batch_size
        self.cursor = 0  # next data batch index
        self.checkpoints: dict[int, tuple] = {}
        self.result = ToyResult()

    def save(self, step: int) -> None:
        self.checkpoints[step] = (copy.deepcopy(self.model.state_dict()),
                                  copy.deepcopy(self.optimizer.state_dict()), self.cursor)

    def restore(self, step: int) -> None:
        """The ``restore(step)`` callable the rollback intervention is given."""
        model_state, opt_state, cursor = self.checkpoints[step]
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(opt_state)
        self.cursor = cursor
        self.result.restored.append(step)

    def train(self, monitor: HealthMonitor, num_steps: int, *,
              loss_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
              grad_hook: Callable[[int, nn.Module], None] | None = None,
              poison: Callable[[int], bool] | None = None,
              checkpoint_every: int | None = None, max_iterations: int | None = None) -> ToyResult:
        """Train to ``num_steps`` (a rollback repeats steps; ``max_iterations`` bounds the work)."""
        step, iterations = 1, 0
        limit = max_iterations or 4 * num_steps
        while step <= num_steps and iterations < limit:
            iterations += 1
            index = self.cursor
            x, y = self.data.batch(index)
            self.cursor += 1
            if poison is not None and poison(index):
                y = torch.zeros_like(y)  # a corrupted window: every target is token 0
            loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            if loss_hook is not None:
                loss = loss_hook(step, loss)
            loss.backward()
            if grad_hook is not None:
                grad_hook(step, self.model)
            skipped = monitor.observe_loss(step, loss)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            directive = monitor.end_step(StepRecord(step=step, loss=float(loss.detach()),
                                                    tokens=self.tokens_per_step))
            self.result.losses[step] = float(loss.detach())
            self.result.directives[step] = directive
            if not (skipped or directive.skipped_update):
                self.result.batches_used.append((step, index))
            if directive.rollback_to is not None:
                self.cursor += directive.skip_batches
                step = directive.rollback_to + 1
                continue
            if checkpoint_every and step % checkpoint_every == 0:
                self.save(step)
                monitor.mark_checkpoint(step)
            step += 1
        return self.result


def run_toy_training(run_dir: str | os.PathLike, *, num_steps: int = 200, seed: int = 0,
                     spike_at: int | None = None, config=None) -> ToyResult:
    """Train the toy model for ``num_steps`` with a HealthMonitor writing ``run_dir``'s store
    (optionally a 1e4 loss spike at ``spike_at``). Returns the loop's result."""
    from trainpilot.store.runstore import RunStore

    trainer = ToyTrainer(seed=seed)
    store = RunStore.create(run_dir, name="toy")
    store.set_document("model", {"name": "toy-lm", "vocab_size": 32, "dim": 32, "num_layers": 2})
    monitor = HealthMonitor(store=store, config=config, model=trainer.model,
                            optimizer=trainer.optimizer, total_steps=num_steps,
                            restore=trainer.restore)
    monitor.on_train_start()
    hook = None
    if spike_at is not None:
        def hook(step, loss):
            return loss * 1e4 if step == spike_at else loss
    try:
        result = trainer.train(monitor, num_steps, loss_hook=hook, checkpoint_every=50)
        monitor.on_train_end()
        store.close(status="completed")
    except BaseException:
        store.close(status="failed")
        raise
    return result
