"""``HealthMonitor``: metrics, rules, alerts, interventions, forecasts and the health score of a
training run, as a Trainer callback or inside a plain PyTorch loop.

Plain loop (what the Trainer does through its callback protocol)::

    monitor = HealthMonitor(store=RunStore.create(run_dir), model=model, optimizer=opt)
    for step in range(1, num_steps + 1):
        loss = loss_fn(model(x), y); loss.backward()
        monitor.observe_loss(step, loss)      # before opt.step(): lets "skip batch" act
        opt.step(); opt.zero_grad()           # optimizer hooks: gradient stats, clip, skip
        directive = monitor.end_step(StepRecord(step=step, loss=loss.item(), tokens=n))
        if directive.rollback_to is not None: ...  # restored; skip directive.skip_batches

Gradient statistics and the gradient interventions run in optimizer step pre/post hooks
(``register_step_pre_hook``), so they see exactly the gradients the optimizer would apply.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainpilot.health.alerts import AlertManager
from trainpilot.health.collector import GradStats, MetricsCollector, host_memory
from trainpilot.health.config import HealthConfig, load_health_config
from trainpilot.health.detectors import PlateauDetector, TrendDetector, TrendScore
from trainpilot.health.forecast import ConvergenceForecaster, Forecast
from trainpilot.health.interventions import (
    InterventionLog,
    RestoreFn,
    clip_gradients,
    drop_gradients,
)
from trainpilot.health.loss_actions import LossActions
from trainpilot.health.records import Directive, StepRecord
from trainpilot.health.score import (
    LEARN_AFTER_STEPS,
    SPIKE_MEMORY_STEPS,
    HealthScore,
    ScoreInputs,
    health_score,
)
from trainpilot.health.stragglers import StragglerDetector
from trainpilot.store.runstore import RunStore


@dataclass(kw_only=True)
class StepState:
    """What the monitor knows of the step in progress (loss judged, gradients read, skip)."""

    step: int
    loss_score: TrendScore | None = None
    grads: GradStats | None = None
    skip_reason: str | None = None
    skipped: bool = False
    update_ratio: tuple[float, dict[str, float]] | None = None
    given_norms: tuple[list[torch.Tensor], torch.Tensor] | None = None  # observe_grad_norms
    done: bool = False


FAULT_MEMORY_STEPS = 100  # a fault event lowers the hardware score for this many steps


class HealthMonitor(LossActions):
    """Watches one run. ``store`` is rank 0's (``None`` elsewhere: a monitor on every rank fed
    the same global loss takes the same decisions, so DDP replicas stay equal).

    ``flops_per_step`` (model FLOPs of one optimizer step, all ranks) and ``peak_flops`` (FLOP/s
    of all devices) give MFU; ``total_steps`` (and optionally the planned schedule ``lr_at(step)``
    and a ``target_loss``) turn on the convergence forecast; ``restore(step)`` reloads the
    checkpoint saved at ``step`` for the rollback intervention; ``scheduler`` has its
    ``base_lrs`` scaled with the LR.
    """

    def __init__(self, *, store: RunStore | None = None, config: HealthConfig | None = None,
                 model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, scheduler: Any | None = None,
                 flops_per_step: float | None = None, peak_flops: float | None = None,
                 total_steps: int | None = None, lr_at: Callable[[int], float] | None = None,
                 target_loss: float | None = None, restore: RestoreFn | None = None):
        self.store = store
        self.config = config or load_health_config()
        rules = self.config.rules
        self.flops_per_step, self.peak_flops = flops_per_step, peak_flops
        self.total_steps, self.target_loss, self.restore = total_steps, target_loss, restore
        self.scheduler = scheduler
        self.alerts = AlertManager(store, cooldown_steps=self.config.alert_cooldown_steps)
        self.interventions = InterventionLog(store)
        d = rules.divergence_risk
        self.trend = TrendDetector(window=d.window, min_points=d.min_points, z_threshold=d.z,
                                   rise=d.rise)
        p = rules.slow_convergence
        self.plateau = PlateauDetector(window=p.window, min_rel_improvement=p.min_rel_improvement)
        s = rules.straggler
        self.stragglers = StragglerDetector(ratio=s.ratio, window=s.window,
                                            min_fraction=s.min_fraction, z=s.z)
        self.forecaster = (ConvergenceForecaster(total_steps=total_steps, lr_at=lr_at)
                           if total_steps else None)
        self.forecast: Forecast | None = None
        self.last_score: HealthScore | None = None
        self.good_steps: list[int] = []
        self.collector: MetricsCollector | None = None
        self._hooks: list[Any] = []
        self._state: StepState | None = None
        self._consecutive_flags = 0
        self._first_flag_step: int | None = None
        self._grad_norms: deque[float] = deque(maxlen=64)
        self._losses: list[tuple[int, float, float | None]] = []  # (step, loss, lr)
        self._segment_from = 0  # the forecast fits steps >= this (after a damaging spike)
        self._improvement: float | None = None  # the plateau window's last judgement
        self._last_end: float | None = None  # perf_counter() at the last step's end
        self._last_forecast = time.monotonic()
        self._last_lr_change = -10**9
        self._last_fault_step: int | None = None
        self._last_spike_step: int | None = None  # a flagged loss whose update was applied
        self._first_losses: list[float] = []  # the run's first 20 finite losses
        self._last_step = 0
        # False when another writer (the runtime's RunRecorder) records the runtime's events.
        self.log_events = True
        if model is not None and optimizer is not None:
            self.attach(model, optimizer)

    # ------------------------------------------------------------------ wiring
    def attach(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Register the optimizer step hooks that collect gradient statistics and intervene."""
        self.detach()
        self.model, self.optimizer = model, optimizer
        self.collector = MetricsCollector(model, optimizer)
        self._hooks = [optimizer.register_step_pre_hook(self._pre_step),
                       optimizer.register_step_post_hook(self._post_step)]

    def detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    # Trainer callback protocol -------------------------------------------------------
    def on_train_start(self, trainer: Any = None) -> None:
        """Attach to ``trainer.model``/``trainer.optimizer`` if not attached yet, and consult
        the knowledge base of the runs beside this one (logged as a ``note`` event; each
        intervention's event then carries how that action fared before)."""
        if self.collector is None and trainer is not None:
            model, opt = getattr(trainer, "model", None), getattr(trainer, "optimizer", None)
            if model is not None and opt is not None:
                self.attach(model, opt)
        if self.store is not None:
            from trainpilot.store.knowledge import consult

            past = [e for e in consult(self.store.path.parent.parent)
                    if e.anomaly in type(self.config.rules).model_fields]
            self.interventions.experience = {(e.anomaly, e.action): e for e in past}
            if past:
                self.store.log_event("note", None, {"knowledge": [
                    dict(anomaly=e.anomaly, action=e.action, tried=e.num_tried,
                         recovered=e.num_recovered, runs=e.num_runs) for e in past]},
                    name="knowledge", message=f"{len(past)} past (anomaly, action) pairs")
        self._last_end = time.perf_counter()

    def on_step_end(self, trainer: Any, record: Any) -> Directive:
        return self.end_step(StepRecord.from_any(record))

    def on_event(self, kind: str, payload: Mapping[str, Any] | None = None) -> None:
        """Events from the runtime: ``checkpoint`` ({"step"}) marks a rollback target; ``fault``
        and ``restart`` are recorded (and faults lower the hardware score for a while)."""
        payload = dict(payload or {})
        step = payload.get("step")
        if kind == "checkpoint" and step is not None:
            self.mark_checkpoint(int(step), log=False)
        if kind == "fault":
            self._last_fault_step = step if step is not None else self._current_step()
        if self.store is not None and self.log_events:
            self.store.log_event(kind, step, payload,
                                 severity="critical" if kind == "fault" else "info")

    def on_train_end(self, trainer: Any = None, summary: Mapping[str, Any] | None = None) -> None:
        self._maybe_forecast(force=True)
        if self.store is not None:
            self.store.flush()
        self.detach()

    def mark_checkpoint(self, step: int, *, log: bool = True) -> bool:
        """Note a checkpoint saved at ``step``; it is a rollback target if the run was healthy
        then (no critical alert active, last loss not flagged). Returns whether it is good."""
        good = not self.alerts.critical_active() and self._consecutive_flags == 0
        if good:
            self.good_steps.append(step)
        if log and self.store is not None:
            self.store.log_event("checkpoint", step, {"good": good})
        return good

    # ------------------------------------------------------------------ checkpointed state
    def state_dict(self) -> dict[str, Any]:
        """What the monitor's next judgements depend on, as plain data: the detectors'
        windows, active alerts and cooldowns, the checkpoints it judged good (rollback
        targets), the loss curve the forecast fits. Checkpointed per rank with the run (only
        rank 0's straggler window is fed), so a restarted job's monitor goes on where it was
        instead of refilling its windows. Not kept: an intervention outcome still due (it is
        judged one step after the intervention), wall-clock timers."""
        return {
            "trend": self.trend.state_dict(), "plateau": self.plateau.state_dict(),
            "stragglers": self.stragglers.state_dict(), "alerts": self.alerts.state_dict(),
            "good_steps": list(self.good_steps), "consecutive_flags": self._consecutive_flags,
            "first_flag_step": self._first_flag_step, "grad_norms": list(self._grad_norms),
            "losses": [[s, loss, lr] for s, loss, lr in self._losses],
            "segment_from": self._segment_from, "improvement": self._improvement,
            "last_lr_change": self._last_lr_change, "last_fault_step": self._last_fault_step,
            "last_spike_step": self._last_spike_step, "first_losses": list(self._first_losses),
            "last_step": self._last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (a restarted job, or an in-process recovery: the
        monitor is rewound with the run)."""
        self.trend.load_state_dict(state["trend"])
        self.plateau.load_state_dict(state["plateau"])
        self.stragglers.load_state_dict(state["stragglers"])
        self.alerts.load_state_dict(state["alerts"])
        self.good_steps = [int(s) for s in state["good_steps"]]
        self._consecutive_flags = int(state["consecutive_flags"])
        self._first_flag_step = state["first_flag_step"]
        self._grad_norms = deque((float(g) for g in state["grad_norms"]),
                                 maxlen=self._grad_norms.maxlen)
        self._losses = [(int(s), float(loss), lr) for s, loss, lr in state["losses"]]
        self._segment_from = int(state["segment_from"])
        self._improvement = state["improvement"]
        self._last_lr_change = int(state["last_lr_change"])
        self._last_fault_step = state["last_fault_step"]
        self._last_spike_step = state.get("last_spike_step")
        self._first_losses = [float(x) for x in state.get("first_losses", [])]
        self._last_step = int(state["last_step"])
        self._state = None

    def _current_step(self) -> int:
        return self._state.step if self._state else self._last_step

    def _state_for(self, step: int | None = None) -> StepState:
        """This step's state: the open one (relabelled to ``step``), or a new one."""
        if self._state is None or self._state.done or (
                step is not None and self._state.loss_score is not None
                and self._state.step != step):
            self._state = StepState(step=self._last_step + 1 if step is None else step)
        elif step is not None:
            self._state.step = step
        return self._state

    # ------------------------------------------------------------------ before the update
    def observe_loss(self, step: int, loss: float | torch.Tensor) -> bool:
        """Judge this step's loss before ``optimizer.step()``; returns True when this batch's
        update will be skipped (a spike or non-finite loss, with ``skip_batch_on_spike`` on)."""
        state = self._state_for(step)
        value = float(loss.detach()) if torch.is_tensor(loss) else float(loss)
        state.loss_score = self.trend.score(step, value)
        if state.loss_score.flagged:
            self._consecutive_flags += 1
            self._first_flag_step = self._first_flag_step or step
            if self._consecutive_flags >= self.trend.window // 2 and not (
                    self.config.interventions.rollback_on_divergence.enabled):
                # A lasting level shift, not a spike: re-learn the trend from here on (the
                # alert has fired; flagged points are never accepted, so it would never end).
                self.trend.truncate(-1)
                self._consecutive_flags, self._first_flag_step = 0, None
        else:
            self._consecutive_flags, self._first_flag_step = 0, None
        skip = self.config.interventions.skip_batch_on_spike
        rollback_due = (self.config.interventions.rollback_on_divergence.enabled
                        and self._consecutive_flags >= self.config.rules.divergence_risk.patience)
        if state.loss_score.flagged and skip.enabled and not rollback_due:
            state.skip_reason = ("non_finite" if not math.isfinite(value) else "divergence_risk")
        return state.skip_reason is not None

    def observe_grad_norms(self, params: list[torch.Tensor], norms: torch.Tensor) -> None:
        """This step's gradient norms per parameter, measured by whoever clips them before
        ``optimizer.step()`` (the step guard's ``on_grad_norms``): the monitor judges the
        unclipped norms, as in the Trainer, and does not measure them again."""
        self._state_for().given_norms = (params, norms)

    def _pre_step(self, optimizer, args, kwargs) -> None:
        collector = self.collector
        assert collector is not None  # attach() sets it before it registers this hook
        state = self._state_for()
        detailed = state.step % self.config.detail_every == 0
        given, state.given_norms = state.given_norms, None
        state.grads = stats = collector.grad_stats(detailed=detailed, given=given)
        skip_cfg = self.config.interventions.skip_batch_on_spike
        if not stats.finite and skip_cfg.enabled and skip_cfg.on_non_finite:
            state.skip_reason = state.skip_reason or "non_finite"
        if state.skip_reason:
            self._skip_update(state, collector, stats, state.skip_reason)
            return
        clip = self.config.interventions.clip
        if clip.enabled and stats.finite and stats.grad_norm > clip.trigger_norm:
            before, after = clip_gradients(collector.params, clip.clip_to)
            rec = self.interventions.record("clip", "grad_explosion"
                                            if before > self.config.rules.grad_explosion.threshold
                                            else "grad_norm_trigger", state.step,
                                            {"grad_norm": before}, {"grad_norm": after})
            self.interventions.expect(rec, state.step + 1, self._loss_ok_check(state.step + 1))
        if detailed:
            collector.snapshot()

    def _post_step(self, optimizer, args, kwargs) -> None:
        collector = self.collector
        assert collector is not None  # attach() sets it before it registers this hook
        if self._state is not None and not self._state.skipped:
            self._state.update_ratio = collector.update_ratios()

    def _skip_update(self, state: StepState, collector: MetricsCollector, stats: GradStats,
                     reason: str) -> None:
        """Drop this step's gradients (``stats``: theirs; ``reason``: the skip's trigger)."""
        score = state.loss_score
        before: dict[str, Any] = {"grad_norm": stats.grad_norm, "nonfinite_grads":
                                  stats.num_nonfinite}
        if score is not None:
            before.update(loss=score.value, trend=score.prediction, z=score.z)
        drop_gradients(collector.params)
        state.skipped = True
        rec = self.interventions.record("skip_batch", reason, state.step, before,
                                        {"update_applied": False})
        self.interventions.expect(rec, state.step + 1, self._loss_ok_check(state.step + 1))

    def _loss_ok_check(self, step: int):
        def check() -> tuple[str, dict[str, Any]]:
            s = self._state.loss_score if self._state and self._state.step == step else None
            if s is None:
                return "unknown", {}
            ok = math.isfinite(s.value) and not s.flagged
            return ("recovered" if ok else "not_recovered"), {"next_loss": s.value,
                                                               "next_z": s.z}
        return check

    # ------------------------------------------------------------------ after the update
    def end_step(self, record: StepRecord | None = None, **fields: Any) -> Directive:
        """Finish a step: rules, alerts, LR/rollback interventions, score, store, forecast."""
        rec = record or StepRecord(**fields)
        now = time.perf_counter()
        if rec.step_time_s is None and self._last_end is not None:
            rec.step_time_s = now - self._last_end
        self._last_end = now
        state = self._state_for(rec.step)
        if state.loss_score is None:
            self.observe_loss(rec.step, rec.loss)
        lr = rec.lr if rec.lr is not None else self._lr()
        metrics = self._metrics(rec, state, lr)
        directive = Directive(skipped_update=state.skipped)
        self._loss_rules(rec, state)
        self._gradient_rules(rec.step, state)
        self._system_rules(rec, metrics)
        self._plateau(rec, state)
        if self._divergence_due():
            directive = self._rollback(rec.step, state) or directive
        else:
            if state.loss_score and not state.loss_score.flagged:
                self.trend.accept(rec.step, rec.loss)
                self._losses.append((rec.step, rec.loss, lr))  # the forecast's curve: no spikes
            elif state.loss_score and not state.skipped:
                # A flagged loss whose update landed changes the curve's regime: refit after it.
                self._segment_from = rec.step + 1
                self._last_spike_step = rec.step
        if len(self._first_losses) < 20 and math.isfinite(rec.loss):
            self._first_losses.append(rec.loss)
        score = self._score(rec, state, metrics)
        metrics.update(score.as_metrics())
        self.last_score = score
        self.alerts.end_step(rec.step)
        self.interventions.settle(rec.step)
        state.done = True
        self._last_step = directive.rollback_to if directive.rollback_to is not None else rec.step
        if self.store is not None:
            self.store.log_metrics(rec.step, metrics)
            if rec.rank_timings:
                self.store.log_rank_timings(rec.rank_timings)
        self._maybe_forecast()
        return directive

    def _lr(self) -> float | None:
        opt = getattr(self, "optimizer", None)
        return float(opt.param_groups[0]["lr"]) if opt is not None else None

    def _metrics(self, rec: StepRecord, state: StepState, lr: float | None) -> dict[str, float]:
        m: dict[str, float] = {"loss": rec.loss}
        if lr is not None:
            m["lr"] = lr
        if state.loss_score is not None and state.loss_score.prediction is not None:
            m["loss_trend"] = state.loss_score.prediction
        g = state.grads
        if g is not None:
            m.update(grad_norm=g.grad_norm, nonfinite_grads=g.num_nonfinite,
                     skipped_update=float(state.skipped))
            # Per-layer rows on detail steps (and whenever a gradient rule has something to
            # show): they are most of the rows and the store's main per-step cost.
            if rec.step % self.config.detail_every == 0 or not g.finite or state.skipped:
                m.update({f"grad_norm/{k}": v for k, v in g.layer_norms.items()})
            if g.zero_grad_frac is not None:
                m["zero_grad_frac"] = g.zero_grad_frac
        if state.update_ratio is not None:
            m["update_ratio"] = state.update_ratio[0]
            m.update({f"update_ratio/{k}": v for k, v in state.update_ratio[1].items()})
        for key in ("step_time_s", "data_time_s", "compute_time_s", "comm_time_s", "comm_max_s",
                    "predicted_step_time_s"):
            value = getattr(rec, key)
            if value is not None:
                m[key] = float(value)
        if rec.tokens and rec.step_time_s:
            m["tokens_per_s"] = rec.tokens / rec.step_time_s
        if self.flops_per_step and self.peak_flops and rec.step_time_s:
            m["mfu"] = self.flops_per_step / (rec.step_time_s * self.peak_flops)
        if rec.step % self.config.detail_every == 0:
            mem = self.collector.memory() if self.collector else host_memory()
            m["peak_mem_gib"] = mem.peak_mem_gib
            if mem.mem_frac is not None:
                m["mem_frac"] = mem.mem_frac
        return m

    def _loss_rules(self, rec: StepRecord, state: StepState) -> None:
        rules, s = self.config.rules, state.loss_score
        if rules.non_finite.enabled:
            self.alerts.evaluated("non_finite")
            grads_bad = state.grads is not None and not state.grads.finite
            if not math.isfinite(rec.loss) or grads_bad:
                what = "loss" if not math.isfinite(rec.loss) else "gradients"
                n = state.grads.num_nonfinite if state.grads else 0
                self.alerts.fire("non_finite", rules.non_finite.severity, rec.step,
                                 f"non-finite {what} (loss {rec.loss}, {n} non-finite gradient "
                                 f"elements)", loss=rec.loss, nonfinite_grads=n)
        if rules.divergence_risk.enabled:
            self.alerts.evaluated("divergence_risk")
            if s is not None and s.flagged and math.isfinite(rec.loss):
                self.alerts.fire("divergence_risk", rules.divergence_risk.severity, rec.step,
                                 f"loss {rec.loss:.4g} is {s.ratio:.2f}x its trend "
                                 f"{s.prediction:.4g} (z={s.z:.1f})", loss=rec.loss,
                                 trend=s.prediction, z=s.z, ratio=s.ratio)

    def _gradient_rules(self, step: int, state: StepState) -> None:
        rules, g = self.config.rules, state.grads
        if g is None:
            return
        if rules.grad_explosion.enabled:
            self.alerts.evaluated("grad_explosion")
            if math.isfinite(g.grad_norm) and g.grad_norm > rules.grad_explosion.threshold:
                self.alerts.fire("grad_explosion", rules.grad_explosion.severity, step,
                                 f"gradient norm {g.grad_norm:.3g} > "
                                 f"{rules.grad_explosion.threshold:.3g}", grad_norm=g.grad_norm)
        if rules.vanishing_gradients.enabled:
            self.alerts.evaluated("vanishing_gradients")
            low = sorted(k for k, v in g.layer_norms.items()
                         if v < rules.vanishing_gradients.threshold)
            if low:
                self.alerts.fire("vanishing_gradients", rules.vanishing_gradients.severity, step,
                                 f"{len(low)} layer(s) with gradient norm < "
                                 f"{rules.vanishing_gradients.threshold:.0e}: "
                                 f"{', '.join(low[:5])}", layers=low)
        if g.finite and g.grad_norm > 0:
            self._grad_norms.append(g.grad_norm)

    def _system_rules(self, rec: StepRecord, metrics: dict[str, float]) -> None:
        rules = self.config.rules
        if rules.comm_stall.enabled and rec.comm_max_s is not None:
            self.alerts.evaluated("comm_stall")
            if rec.comm_max_s > rules.comm_stall.threshold_s:
                self.alerts.fire("comm_stall", rules.comm_stall.severity, rec.step,
                                 f"one collective took {rec.comm_max_s:.1f} s",
                                 comm_max_s=rec.comm_max_s)
        if rules.memory_pressure.enabled and "mem_frac" in metrics:
            self.alerts.evaluated("memory_pressure")
            if metrics["mem_frac"] > rules.memory_pressure.threshold:
                self.alerts.fire("memory_pressure", rules.memory_pressure.severity, rec.step,
                                 f"memory {100 * metrics['mem_frac']:.0f}% used",
                                 mem_frac=metrics["mem_frac"])
        if rules.straggler.enabled and rec.rank_timings:
            self.alerts.evaluated("straggler")
            times = [t.compute_s for t in sorted(rec.rank_timings, key=lambda t: t.rank)]
            known = [t for t in times if t is not None]
            if len(known) == len(times):  # every rank's compute time
                for s in self.stragglers.update(known):
                    self.alerts.fire("straggler", rules.straggler.severity, rec.step,
                                     f"rank {s.rank} compute is {s.slowdown:.2f}x slower than "
                                     f"the median of the other ranks ({s.num_flagged}/{s.window}"
                                     f" steps)", rank=s.rank, slowdown=s.slowdown)

    # ------------------------------------------------------------------ score and forecast
    def _score(self, rec: StepRecord, state: StepState, metrics: dict[str, float]):
        rules, g, s = self.config.rules, state.grads, state.loss_score
        timings = tuple(t.compute_s for t in rec.rank_timings or () if t.compute_s is not None)
        recent_fault = (self._last_fault_step is not None
                        and 0 <= rec.step - self._last_fault_step <= FAULT_MEMORY_STEPS)
        recent_spike = (self._last_spike_step is not None
                        and 0 <= rec.step - self._last_spike_step <= SPIKE_MEMORY_STEPS)
        learned = None
        recent = [loss for _, loss, _ in self._losses[-20:]]
        if len(self._losses) >= LEARN_AFTER_STEPS and len(self._first_losses) == 20 and recent:
            first = statistics.median(self._first_losses)
            learned = (first - statistics.median(recent)) / abs(first) if first else 0.0
        inputs = ScoreInputs(
            finite=math.isfinite(rec.loss) and (g is None or g.finite),
            grad_norm=g.grad_norm if g else None,
            median_grad_norm=statistics.median(self._grad_norms) if self._grad_norms else None,
            explosion_threshold=rules.grad_explosion.threshold,
            num_layers=len(g.layer_norms) if g else 0,
            num_vanishing_layers=sum(v < rules.vanishing_gradients.threshold
                                     for v in g.layer_norms.values()) if g else 0,
            step_s=rec.step_time_s, comm_s=rec.comm_time_s, comm_max_s=rec.comm_max_s,
            stall_threshold_s=rules.comm_stall.threshold_s, mem_frac=metrics.get("mem_frac"),
            mem_threshold=rules.memory_pressure.threshold, compute_s_by_rank=timings,
            recent_fault=recent_fault,
            loss_z=s.z if s and s.prediction is not None else None,
            loss_above_trend=bool(s and s.prediction is not None and s.value > s.prediction),
            z_threshold=rules.divergence_risk.z,
            improvement=self._improvement,
            min_rel_improvement=rules.slow_convergence.min_rel_improvement,
            learned_rel=learned, recent_spike=recent_spike)
        return health_score(inputs)

    def _maybe_forecast(self, *, force: bool = False) -> None:
        if self.forecaster is None or len(self._losses) < 40:
            return
        if not force and time.monotonic() - self._last_forecast < self.config.forecast_interval_s:
            return
        curve = [x for x in self._losses if x[0] >= self._segment_from]
        if len(curve) < 40:
            return
        self._last_forecast = time.monotonic()
        fc = self.forecaster.forecast([s for s, _, _ in curve], [loss for _, loss, _ in curve],
                                      lrs=[lr if lr is not None else math.nan
                                           for _, _, lr in curve],
                                      target_loss=self.target_loss)
        if fc is None:
            return
        self.forecast = fc
        if self.store is not None:
            self.store.log_forecast(fc.made_at_step, fc.to_dict())
