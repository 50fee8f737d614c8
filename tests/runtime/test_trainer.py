"""The Trainer in one process: it learns the corpus down toward its entropy floor, seeded runs
are bit-identical, a restored state continues bit-exactly (and does not without the sampler
position), user models/datasets/callbacks plug in."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from torch import nn

from tests.small import SMALL_GPT, SMALL_PLAN
from trainpilot.runtime.callbacks import Callback
from trainpilot.runtime.config import TrainConfig
from trainpilot.runtime.data import MarkovCorpus
from trainpilot.runtime.trainer import Trainer
from trainpilot.specs import SpecError, load_model, load_plan

SMALL = SMALL_GPT
PLAN = SMALL_PLAN


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def make(steps=4, seed=0, plan=PLAN, **config):
    config.setdefault("autocast", "off")  # fp32, even where "auto" would pick native CPU bf16
    cfg = TrainConfig(steps=steps, seed=seed, warmup_steps=min(2, steps), lr=1e-2,
                      predict=False, **config)
    return Trainer(model=load_model(SMALL), plan=load_plan(plan), config=cfg)


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_learns_the_chain_toward_its_entropy_floor():
    trainer = make(steps=40, data_concentration=0.05)
    summary = trainer.fit()
    floor = trainer.dataset.entropy_rate_nats
    assert summary["first_loss"] == pytest.approx(np.log(64), abs=0.15)  # knows nothing yet
    # 40 steps of 512 tokens: most of the gap to the floor closes, and nothing beats it.
    gap = summary["first_loss"] - floor
    assert floor - 0.05 < summary["last_loss"] < floor + 0.25 * gap


def test_seeded_runs_are_bit_identical_and_seeds_matter():
    a, b, c = make(seed=1), make(seed=1), make(seed=2)
    for t in (a, b, c):
        t.fit()
    pa, pb, pc = params(a), params(b), params(c)
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not all(torch.equal(pa[n], pc[n]) for n in pa)  # control: the check can fail


def _snapshot(trainer) -> dict:
    buffer = io.BytesIO()  # the state dict references live tensors: serialise to freeze it
    torch.save(trainer.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_restore_continues_bit_exactly_and_needs_the_sampler():
    straight = make(steps=6)
    straight_losses = [straight.train_step().loss for _ in range(6)]

    first = make(steps=6)
    [first.train_step() for _ in range(3)]
    state = _snapshot(first)
    resumed = make(steps=6)
    resumed.load_state_dict(state)
    assert resumed.step == 3
    losses = [resumed.train_step().loss for _ in range(3)]
    assert losses == straight_losses[3:]
    expected = params(straight)
    assert all(torch.equal(p, expected[n]) for n, p in params(resumed).items())

    # Negative control: the same restore without the data position replays seen samples.
    state["sampler"] = make(steps=6).sampler.state_dict()
    bad = make(steps=6)
    bad.load_state_dict(state)
    assert [bad.train_step().loss for _ in range(3)] != straight_losses[3:]


def test_gradient_accumulation_matches_one_big_micro_batch():
    acc = make(steps=3, plan="micro_batch_size=4,global_batch_size=16,seq_len=32")
    big = make(steps=3, plan="micro_batch_size=16,global_batch_size=16,seq_len=32")
    la = [acc.train_step().loss for _ in range(3)]
    lb = [big.train_step().loss for _ in range(3)]
    np.testing.assert_allclose(la, lb, rtol=1e-5)
    pb = params(big)
    for n, p in params(acc).items():
        torch.testing.assert_close(p, pb[n], rtol=0, atol=1e-4)


class Recorder(Callback):
    def __init__(self, stop_at=None):
        self.records, self.events, self.ended, self.stop_at = [], [], None, stop_at

    def on_step_end(self, trainer, record):
        self.records.append(record)
        if record.step == self.stop_at:
            trainer.request_stop("enough")

    def on_event(self, kind, payload):
        self.events.append(kind)

    def on_train_end(self, trainer, summary):
        self.ended = summary


def test_callbacks_see_every_step_and_can_stop():
    rec = Recorder(stop_at=2)
    cfg = TrainConfig(steps=5, warmup_steps=1, predict=False)
    trainer = Trainer(model=load_model(SMALL), plan=load_plan(PLAN), config=cfg, callbacks=[rec],
                      predicted_step_time_s=0.5)
    summary = trainer.fit()
    assert [r.step for r in rec.records] == [1, 2] and summary["stopped"] == "enough"
    first = rec.records[0]
    assert first.tokens == 16 * 32 and first.tokens_per_s == pytest.approx(
        first.tokens / first.step_time_s)
    assert 0 <= first.data_wait_s < first.step_time_s and first.grad_norm > 0
    assert first.lr == pytest.approx(1e-3 * 3)  # warmup step 1 of 1 -> peak (default lr 3e-3)
    assert first.predicted_step_time_s == 0.5 and "autocast" in rec.events
    assert rec.ended is summary


class Bigram(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.table = nn.Embedding(vocab, vocab)

    def forward(self, tokens):
        return self.table(tokens)


def test_user_model_and_dataset():
    data = MarkovCorpus(vocab_size=32, seq_len=16, seed=1, num_samples=512)
    cfg = TrainConfig(steps=40, warmup_steps=0, lr=0.1, weight_decay=0.0, predict=False)
    trainer = Trainer(model_factory=lambda: Bigram(32), dataset=data, config=cfg,
                      plan=load_plan("micro_batch_size=16,global_batch_size=32,seq_len=16"))
    summary = trainer.fit()
    assert summary["last_loss"] < summary["first_loss"] - 0.5


def test_user_model_refuses_model_parallel_plans():
    with pytest.raises(SpecError, match="data parallel only"):
        Trainer(model_factory=lambda: Bigram(8), plan=load_plan("tp=2," + PLAN),
                config=TrainConfig(predict=False))


def test_bf16_autocast_runs_and_stays_close_to_fp32():
    """Forced here; "auto" picks bf16 only on a CPU with native bf16 matmuls, and says why."""
    auto = make(steps=2, autocast="auto")
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert auto.autocast_dtype == torch.bfloat16 and "native" in auto.autocast_note
    else:
        assert auto.autocast_dtype is None and "fp32" in auto.autocast_note
    off = make(steps=2, autocast="off")
    fp32 = [off.train_step().loss for _ in range(2)]
    bf16 = make(steps=2, autocast="bf16")
    assert bf16.autocast
    losses = [bf16.train_step().loss for _ in range(2)]
    np.testing.assert_allclose(losses, fp32, atol=2e-2)  # bf16 keeps ~3 significant digits
    assert losses != fp32  # it really ran in bf16
