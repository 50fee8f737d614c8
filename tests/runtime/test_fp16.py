"""fp16 with dynamic loss scaling.

This CPU emulates fp16 autocast (check_runtime refuses it for a launched run), so the tests
bypass that check: one short run with real fp16 autocast, the rest with fp32 compute, which
leaves the scaler's logic (scale, unscale, skip on a non-finite gradient, halve, resume)
unchanged. Overflows are forced with the fault injector's NaN gradient. Oracles: a skipped step
leaves every parameter bit-identical and the LR schedule where it was, on every rank; the next
step changes them (the control that the "unchanged" check can fail); with per-rank scalers
instead of the world-reduced one, pipeline ranks disagree (negative control).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.runtime.harness import spawn
from tests.runtime.scenarios import reference
from tests.runtime.test_dist import LOSS_TOL
from tests.small import SMALL_GPT, SMALL_PLAN
from trainpilot.runtime.callbacks import Callback
from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer
from trainpilot.runtime.config import TrainConfig
from trainpilot.runtime.faults import FaultInjector
from trainpilot.runtime.layout import Layout
from trainpilot.runtime.trainer import Trainer
from trainpilot.specs import load_model, load_plan

SMALL = SMALL_GPT
PLAN = SMALL_PLAN


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


class Events(Callback):
    def __init__(self):
        self.events = []

    def on_event(self, kind, payload):
        self.events.append((kind, payload))


def make(precision="fp16", faults=None, callbacks=(), **config):
    plan = load_plan(f"precision={precision}," + PLAN)
    cfg = TrainConfig(**dict(dict(steps=6, seed=0, warmup_steps=4, lr=1e-2, predict=False),
                             **config))
    # An explicit one-process layout skips check_runtime's refusal of emulated fp16.
    return Trainer(model=load_model(SMALL), plan=plan, config=cfg, layout=Layout(plan=plan),
                   faults=faults, callbacks=callbacks)


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_fp16_autocast_with_loss_scaling_stays_close_to_fp32():
    fp32 = make(precision="bf16", autocast="off")
    ref = [fp32.train_step().loss for _ in range(2)]
    fp16 = make()
    assert fp16.autocast_dtype == torch.float16 and fp16.scaler.is_enabled()
    losses = [fp16.train_step().loss for _ in range(2)]
    np.testing.assert_allclose(losses, ref, atol=1e-3)  # observed 6e-5
    assert losses != ref  # it really ran in fp16
    assert fp16.scaler.get_scale() == 2.0**16  # no overflow, no growth yet (2000 steps)
    assert fp16.state_dict()["grad_scaler"]["scale"] == 2.0**16
    assert "grad_scaler" not in fp32.state_dict()  # bf16/fp32: no scaler state


def test_overflow_skips_the_update_halves_the_scale_and_holds_the_lr():
    events = Events()
    faults = FaultInjector("nan:rank=0,step=2")
    trainer = make(autocast="off", faults=faults, callbacks=[events])
    before, records = [], []
    for _ in range(3):
        before.append(params(trainer))
        records.append(trainer.train_step())
    after = params(trainer)
    assert len(faults.fired("nan")) == 1  # the overflow really happened
    assert [r.skipped_update for r in records] == [False, True, False]
    assert [r.attempts for r in records] == [1, 1, 1]  # fp16: skipped, not recomputed
    assert not np.isfinite(records[1].grad_norm)
    # Step 2 changed nothing; step 3 (the control) did.
    assert all(torch.equal(before[2][n], before[1][n]) for n in after)
    assert not all(torch.equal(after[n], before[2][n]) for n in after)
    # The LR schedule did not advance on the skipped step (warm-up: 1/4, 2/4, 2/4).
    assert [r.lr for r in records] == pytest.approx([1e-2 / 4, 1e-2 / 2, 1e-2 / 2])
    assert trainer.scaler.get_scale() == 2.0**15
    skips = [p for kind, p in events.events if kind == "loss_scale_skip"]
    assert [(p["step"], p["new_scale"]) for p in skips] == [(2, 2.0**15)]


def test_scaler_state_survives_a_checkpoint(tmp_path):
    trainer = make(autocast="off", faults=FaultInjector("nan:rank=0,step=2"))
    for _ in range(3):
        trainer.train_step()
    with Checkpointer(CheckpointConfig(root_dir=tmp_path / "ckpt")) as ckpt:
        ckpt.save(3, trainer.state_dict()).result()
    fresh = make(autocast="off")
    assert fresh.scaler.get_scale() == 2.0**16
    with Checkpointer(CheckpointConfig(root_dir=tmp_path / "ckpt")) as reader:
        restored = reader.restore_latest(fresh.state_dict(), source="storage")
    fresh.load_state_dict(restored.state)
    assert fresh.scaler.state_dict() == trainer.scaler.state_dict()
    assert fresh.scaler.get_scale() == 2.0**15  # not the initial 2**16
    trainer.train_step(), fresh.train_step()
    a, b = params(trainer), params(fresh)
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_every_rank_skips_the_same_step(tmp_path):
    res = spawn("fp16_skip", 2, tmp_path, timeout_s=130)
    ref = reference("tiny-gpt")
    for name in ("pp", "tp"):
        assert sum(rank[name]["fired"] for rank in res) == 1, name  # one NaN, on rank 1
        for rank in res:
            run = rank[name]
            assert run["skipped"] == [False, True, False], name
            assert run["scales"] == [2.0**16, 2.0**15, 2.0**15], name
            first, second, third = run["params"]
            assert all(torch.equal(first[k], second[k]) for k in first), name
            assert not all(torch.equal(second[k], third[k]) for k in first), name
            # Steps 1-2 match fp32 without scaling: the loss and gradients were unscaled right.
            assert max(abs(a - b) for a, b in zip(run["losses"][:2], ref["losses"][:2])) \
                <= LOSS_TOL, name
    # Negative control: per-rank scalers let rank 0 step while rank 1 skips.
    local = [rank["pp_local_scaler"] for rank in res]
    assert [run["skipped"][1] for run in local] == [False, True]
    first, second, _ = local[0]["params"]
    assert not all(torch.equal(first[k], second[k]) for k in first)
    # Without a scaler: a NaN computed on rank 1 reaches every replica through the gradient
    # all-reduce, so both ranks compute step 2 again, each deciding alone ...
    assert [rank["dp_backward"]["attempts"] for rank in res] == [[1, 2, 1]] * 2
    assert [rank["dp_backward"]["fired"] for rank in res] == [[], [(1, "backward")]]
    for name in ("fsdp", "tp", "pp"):  # the same holds in every layout, whichever rank
        for bad in (0, 1):
            runs = [rank[f"{name}_backward_{bad}"] for rank in res]
            assert [run["attempts"] for run in runs] == [[1, 2, 1]] * 2, (name, bad, runs)
            assert [run["fired"] for run in runs] == [
                [(bad, "backward")] if r == bad else [] for r in (0, 1)], (name, bad)
    # ... while one changed after the reduction (rank 1 only) makes them disagree: both stop
    # with the error instead of one rank stepping and the other recomputing.
    assert [rank["dp_grad"]["fired"] for rank in res] == [[], [(1, "grad")]]
    for rank in res:
        assert rank["dp_grad"]["attempts"] == [1] and "1 of 2 ranks" in rank["dp_grad"]["error"]
