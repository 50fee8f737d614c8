"""The HealthMonitor on a real (tiny) training loop: each anomaly is injected, its detection is
asserted within a stated number of steps, and each intervention's effect is compared with the
same run without it (the negative control)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from tests.health.toyrun import ToyTrainer
from trainpilot.health.config import load_health_config
from trainpilot.health.monitor import HealthMonitor, StepRecord
from trainpilot.store import RunStore

pytestmark = pytest.mark.timeout(120)
logging.getLogger("trainpilot.health").setLevel(logging.ERROR)


def make(store=None, config=None, **interventions):
    torch.set_num_threads(1)
    config = (config or load_health_config()).with_interventions(**interventions)
    trainer = ToyTrainer(seed=0)
    monitor = HealthMonitor(store=store, config=config, model=trainer.model,
                            optimizer=trainer.optimizer, restore=trainer.restore)
    return trainer, monitor


def params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def alerts(monitor, rule):
    return [a for a in monitor.alerts.log if a.rule == rule]


def test_a_clean_run_raises_no_critical_alert():
    trainer, monitor = make()
    trainer.train(monitor, 150)
    assert [a for a in monitor.alerts.log if a.severity == "critical"] == []
    assert monitor.last_score.score > 90


@pytest.mark.parametrize("skip", [True, False])
def test_loss_spike_is_detected_at_once_and_its_batch_skipped(skip):
    """Scale one batch's loss by 1e4 at step 120: detected at step 120 (0 steps late)."""
    snaps = {}

    def hook(step, loss):
        snaps[step] = params(trainer.model)  # the weights this step starts from
        return loss * 1e4 if step == 120 else loss

    trainer, monitor = make(skip_batch_on_spike=skip)
    result = trainer.train(monitor, 135, loss_hook=hook)
    hit = alerts(monitor, "divergence_risk")
    assert hit and hit[0].step == 120 and hit[0].payload["ratio"] > 1000
    unchanged = torch.equal(snaps[120], snaps[121])
    if skip:
        rec = monitor.interventions.records[0]
        assert (rec.action, rec.trigger, rec.step) == ("skip_batch", "divergence_risk", 120)
        assert rec.before["loss"] > 1e4 and rec.after["update_applied"] is False
        assert rec.outcome == "recovered" and rec.after["next_z"] < 6
        assert unchanged  # the update was skipped
        assert result.losses[130] < 1.1 * result.losses[119]
    else:  # negative control: the spike's update lands and damages the model
        assert not unchanged and monitor.interventions.records == []
        assert result.losses[130] > 1.2 * result.losses[119]


@pytest.mark.parametrize("skip", [True, False])
def test_nan_gradient_is_detected_at_once_and_skipped(skip):
    def grad_hook(step, model):
        if step == 100:
            model.blocks[0][1].weight.grad[0, 0] = math.nan

    trainer, monitor = make(skip_batch_on_spike=skip)
    trainer.train(monitor, 105, grad_hook=grad_hook)
    hit = alerts(monitor, "non_finite")
    assert hit and hit[0].step == 100 and hit[0].payload["nonfinite_grads"] == 1
    assert monitor.last_score is not None
    finite = all(torch.isfinite(p).all() for p in trainer.model.parameters())
    if skip:
        assert finite
        rec = monitor.interventions.records[0]
        assert (rec.action, rec.trigger, rec.step) == ("skip_batch", "non_finite", 100)
    else:  # negative control: AdamW writes the NaN into the weights
        assert not finite


def test_zeroed_layer_is_reported_as_vanishing_at_once():
    def grad_hook(step, model):
        if step >= 80:
            for p in model.blocks[1][3].parameters():
                p.grad.zero_()

    trainer, monitor = make()
    trainer.train(monitor, 85, grad_hook=grad_hook)
    hit = alerts(monitor, "vanishing_gradients")
    assert len(hit) == 1 and hit[0].step == 80 and hit[0].payload["layers"] == ["blocks.1.3"]
    assert monitor.last_score.gradient_flow < 1.0


def test_clip_intervention_clips_only_past_its_trigger():
    trainer, monitor = make(clip=True)
    monitor.config = monitor.config.updated("interventions", "clip", trigger_norm=5.0)
    trainer.train(monitor, 95, loss_hook=lambda s, loss: loss * 1e3 if s == 90 else loss)
    clips = [r for r in monitor.interventions.records if r.action == "clip"]
    assert [r.step for r in clips] == [90]
    assert clips[0].before["grad_norm"] > 5.0
    assert clips[0].after["grad_norm"] == pytest.approx(5.0, rel=1e-4)


def test_plateau_halves_the_learning_rate_once_per_cooldown(tmp_path):
    store = RunStore.create(tmp_path)
    config = (load_health_config().updated("rules", "slow_convergence", window=40)
              .updated("interventions", "halve_lr_on_plateau", cooldown_steps=60))
    trainer, monitor = make(store=store, config=config, halve_lr_on_plateau=True)
    trainer.train(monitor, 260)
    halvings = [r for r in monitor.interventions.records if r.action == "halve_lr"]
    assert halvings, "the toy loss flattens near its floor within 260 steps"
    first = halvings[0]
    assert first.before["lr"] == [3e-3] and first.after["lr"] == [1.5e-3]
    assert first.before["improvement"] < 0.01
    assert all(b.step - a.step >= 60 for a, b in zip(halvings, halvings[1:]))
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.5 ** len(halvings))
    assert first.outcome in ("recovered", "not_recovered")
    store.close(status="completed")
    reader = RunStore.open_readonly(tmp_path)
    assert reader.events(kinds=["lr_change"])[0].step == first.step
    assert reader.knowledge("slow_convergence")[0]["action"] == "halve_lr"


@pytest.mark.parametrize("enabled", [True, False])
def test_divergence_rolls_back_and_skips_the_bad_data_window(enabled):
    """Batches 150-159 are corrupted (every target token 0). Detected at step 151 (the first
    bad batch); 3 consecutive flagged steps trigger a rollback to the checkpoint of step 140
    (>= 10 steps before) and 30 batches are skipped, so the bad window is never trained on."""
    trainer, monitor = make(skip_batch_on_spike=enabled, rollback_on_divergence=enabled)
    monitor.config = monitor.config.updated("interventions", "rollback_on_divergence",
                                            rewind_steps=10, skip_batches=30)
    result = trainer.train(monitor, 200, poison=lambda i: 150 <= i < 160, checkpoint_every=10)
    assert alerts(monitor, "divergence_risk")[0].step == 151
    after = [np for np in result.losses.items() if 161 <= np[0] <= 165]
    mean_after = sum(loss for _, loss in after) / len(after)
    if enabled:
        assert result.restored == [140]
        rollback = next(r for r in monitor.interventions.records if r.action == "rollback")
        assert rollback.step == 153 and rollback.before["first_bad_step"] == 151
        assert rollback.after["restored_step"] == 140 and rollback.outcome == "recovered"
        resumed = result.batches_used.index((141, 170))  # first update after the rollback
        assert all(not 150 <= i < 160 for _, i in result.batches_used[resumed:])
        assert mean_after < 1.1 * result.losses[140]
    else:  # negative control: the window is trained on and the model is damaged after it
        assert result.restored == [] and monitor.interventions.records == []
        assert mean_after > 1.3 * result.losses[140]


def test_rollback_without_a_good_checkpoint_is_logged_as_not_possible():
    trainer, monitor = make(rollback_on_divergence=True)
    trainer.train(monitor, 60, poison=lambda i: 40 <= i < 50)  # no checkpoints saved
    rec = next(r for r in monitor.interventions.records if r.action == "rollback")
    assert rec.outcome == "not_possible" and rec.after["restored"] is False


def test_system_rules_comm_stall_memory_and_stragglers():
    from trainpilot.store import RankTiming

    trainer, monitor = make()
    monitor.config = monitor.config.updated("rules", "memory_pressure", threshold=1e-6)
    for step in range(1, 27):
        slow = [RankTiming(step=step, rank=r, step_s=0.1, compute_s=0.05 if r != 2 else 0.08)
                for r in range(4)]
        monitor.end_step(StepRecord(step=step, loss=2.0, comm_max_s=6.0 if step == 3 else 0.1,
                                    step_time_s=0.1, comm_time_s=0.01, rank_timings=slow))
    assert [a.step for a in alerts(monitor, "comm_stall")] == [3]
    assert [a.step for a in alerts(monitor, "memory_pressure")] == [25]  # a detail step
    straggler = alerts(monitor, "straggler")
    assert straggler[0].step == 10 and straggler[0].payload["rank"] == 2  # window of 10 steps
    assert straggler[0].payload["slowdown"] == pytest.approx(1.6)
    assert monitor.last_score.hardware < 0.7


def test_trainer_protocol_records_are_read_by_field_name(tmp_path):
    store = RunStore.create(tmp_path)
    monitor = HealthMonitor(store=store)
    monitor.on_train_start(None)
    for step in range(1, 4):  # a mapping, like the Trainer's StepRecord.to_dict()
        monitor.on_step_end(None, dict(step=step, loss=2.0 / step, lr=1e-3, data_wait_s=0.01,
                                       step_time_s=0.1, tokens=512))
    monitor.on_event("checkpoint", {"step": 3})
    monitor.on_train_end(None, {"steps": 3})
    store.close(status="completed")
    reader = RunStore.open_readonly(tmp_path)
    latest = reader.latest_metrics()[1]
    assert latest["data_time_s"] == 0.01 and latest["tokens_per_s"] == pytest.approx(5120)
    assert reader.events(kinds=["checkpoint"])[0].step == 3
    assert monitor.good_steps == [3]


def test_a_later_run_consults_what_earlier_runs_learned(tmp_path):
    def spike(step, loss):
        return loss * 1e4 if step == 60 else loss

    for name in ("first", "second"):
        store = RunStore.create(tmp_path / name)
        trainer, monitor = make(store=store, skip_batch_on_spike=True)
        monitor.on_train_start()
        trainer.train(monitor, 62, loss_hook=spike)
        store.close(status="completed")
    second = RunStore.open_readonly(tmp_path / "second")
    note = second.events(kinds=["note"])[0].payload["knowledge"]
    assert note == [dict(anomaly="divergence_risk", action="skip_batch", tried=1, recovered=1,
                         runs=1)]
    skip = second.events(kinds=["intervention"])[0]
    assert skip.payload["history"] == {"tried": 1, "recovered": 1}


def test_collector_handles_mixed_dtypes_and_unused_layers():
    from trainpilot.health.collector import MetricsCollector

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].to(torch.bfloat16)
    unused = torch.nn.Linear(2, 2)  # registered but never used: no gradient
    model.add_module("unused", unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    collector = MetricsCollector(model, opt)
    x = torch.randn(3, 4)
    model[1](model[0](x).to(torch.bfloat16)).float().sum().backward()
    stats = collector.grad_stats(detailed=True)
    assert set(stats.layer_norms) == {"0", "1"}  # the unused layer is left out
    expected = torch.cat([p.grad.float().flatten() for p in model.parameters()
                          if p.grad is not None]).norm()
    assert stats.grad_norm == pytest.approx(float(expected), rel=1e-3)
    assert 0 <= stats.zero_grad_frac < 1 and stats.finite


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_gradient_stats_are_global_under_fsdp2_and_tp(tmp_path):
    """Sharded gradients (DTensors) give the same global and per-layer norms as DDP's full
    ones; the clip intervention reaches its target over shards. Negative control: the norm of
    one rank's shards alone is far from the global norm under ZeRO-3 and TP."""
    from tests.runtime.harness import spawn

    results = spawn("health_stats", 2, tmp_path)
    ddp = results[0]["ddp"]
    for rank in results:
        for name in ("ddp", "zero3", "zero1", "tp"):
            got = rank[name]
            assert got["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-4), name
            assert got["layer_norms"].keys() == ddp["layer_norms"].keys(), name
            for layer, norm in ddp["layer_norms"].items():
                assert got["layer_norms"][layer] == pytest.approx(norm, rel=1e-4, abs=1e-7)
            assert got["zero_frac"] == pytest.approx(ddp["zero_frac"], abs=1e-6), name
            before, after = got["clip"]
            assert before == pytest.approx(ddp["grad_norm"], rel=1e-4)
            assert after == pytest.approx(before / 2, rel=1e-4), name
        for name in ("zero3", "tp"):
            assert rank[name]["local_only"] < 0.9 * ddp["grad_norm"], name
        assert rank["ddp"]["local_only"] == pytest.approx(ddp["grad_norm"], rel=1e-5)


def test_a_fault_event_lowers_the_hardware_part_for_its_memory_and_then_not():
    """What the runtime must do for faults to count: call on_event("fault", {"step": s})."""
    monitor = HealthMonitor()
    parts = {}
    for step in range(1, 260):
        if step == 20:
            monitor.on_event("fault", {"step": 20, "kind": "crash", "rank": 1})
        monitor.end_step(StepRecord(step=step, loss=3.0 / step ** 0.3))
        parts[step] = monitor.last_score.hardware
    assert parts[19] == 1.0 and parts[20] == parts[120] == 0.5 and parts[121] == 1.0
    # Negative control: the same run without the event keeps the part whole.
    quiet = HealthMonitor()
    for step in range(1, 60):
        quiet.end_step(StepRecord(step=step, loss=3.0 / step ** 0.3))
    assert quiet.last_score.hardware == 1.0
