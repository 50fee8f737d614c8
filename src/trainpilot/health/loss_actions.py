"""The HealthMonitor's loss-curve actions: the plateau rule with its LR halving, and the
divergence rollback (see ``interventions.py`` for what each does and how it is judged).

A mixin of :class:`trainpilot.health.monitor.HealthMonitor`; it uses the monitor's detectors,
alert manager, intervention log, optimizer, store and ``restore`` callable.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from trainpilot.health.interventions import pick_rollback_step, scale_lr
from trainpilot.health.records import Directive

if TYPE_CHECKING:
    import torch

    from trainpilot.health.alerts import AlertManager
    from trainpilot.health.config import HealthConfig
    from trainpilot.health.detectors import PlateauDetector, PlateauScore, TrendDetector
    from trainpilot.health.interventions import InterventionLog, RestoreFn
    from trainpilot.health.monitor import StepState
    from trainpilot.health.records import StepRecord
    from trainpilot.store.runstore import RunStore


class LossActions:
    # What the mixin uses of the HealthMonitor (set in its __init__; ``optimizer`` by attach).
    config: HealthConfig
    store: RunStore | None
    alerts: AlertManager
    interventions: InterventionLog
    trend: TrendDetector
    plateau: PlateauDetector
    optimizer: torch.optim.Optimizer
    scheduler: Any
    restore: RestoreFn | None
    good_steps: list[int]
    _losses: list[tuple[int, float, float | None]]  # (step, loss, lr)
    _improvement: float | None
    _last_lr_change: int
    _consecutive_flags: int
    _first_flag_step: int | None

    # ------------------------------------------------------------------ convergence
    def _plateau(self, rec: StepRecord, state: StepState) -> PlateauScore | None:
        rule = self.config.rules.slow_convergence
        if not rule.enabled or (state.loss_score and state.loss_score.flagged):
            return None
        evaluate = rec.step % self.config.detail_every == 0
        result = self.plateau.update(rec.loss, evaluate=evaluate)
        if not evaluate:
            return None
        self._improvement = result.improvement  # the score uses it until the next judgement
        self.alerts.evaluated("slow_convergence")
        if not result.flagged or result.improvement is None:  # flagged: always judged
            return result
        self.alerts.fire("slow_convergence", rule.severity, rec.step,
                         f"loss improved {100 * result.improvement:.2f}% over the last "
                         f"{rule.window} steps (< {100 * rule.min_rel_improvement:.2f}%)",
                         improvement=result.improvement)
        halve = self.config.interventions.halve_lr_on_plateau
        opt = getattr(self, "optimizer", None)
        cooled = rec.step - self._last_lr_change >= halve.cooldown_steps
        if halve.enabled and opt is not None and cooled:
            self._halve_lr(rec.step, result.improvement)
        return result

    def _halve_lr(self, step: int, improvement: float) -> None:
        cfg = self.config.interventions.halve_lr_on_plateau
        window = self.config.rules.slow_convergence.window
        recent = [loss for _, loss, _ in self._losses[-(window // 4):]]
        before, after = scale_lr(self.optimizer, cfg.factor, cfg.min_lr, self.scheduler)
        self._last_lr_change = step
        self.plateau.reset()
        self._improvement = None
        rec = self.interventions.record(
            "halve_lr", "slow_convergence", step,
            {"lr": before, "improvement": improvement, "median_loss": statistics.median(recent)},
            {"lr": after})
        if self.store is not None:
            self.store.log_event("lr_change", step, {"before": before, "after": after},
                                 name="halve_lr")

        threshold = self.config.rules.slow_convergence.min_rel_improvement

        def check() -> tuple[str, dict[str, Any]]:
            # Counterfactual: on a plateau the loss would have stayed at the plateau's median.
            later = [loss for s, loss, _ in self._losses if s > step]
            if not later:
                return "unknown", {}
            after_median = statistics.median(later[-(window // 4):])
            gain = (rec.before["median_loss"] - after_median) / abs(rec.before["median_loss"])
            ok = gain >= threshold
            return ("recovered" if ok else "not_recovered"), {
                "median_loss": after_median, "gain_vs_plateau": gain,
                "threshold": threshold, "counterfactual": "the plateau's median loss"}

        self.interventions.expect(rec, step + max(8, window // 4), check)

    # ------------------------------------------------------------------ divergence
    def _divergence_due(self) -> bool:
        cfg = self.config.interventions.rollback_on_divergence
        return cfg.enabled and (self._consecutive_flags
                                >= self.config.rules.divergence_risk.patience)

    def _rollback(self, step: int, state: StepState) -> Directive | None:
        cfg = self.config.interventions.rollback_on_divergence
        first_bad = self._first_flag_step or step
        s = state.loss_score
        before = {"step": step, "first_bad_step": first_bad, "loss": s.value if s else None,
                  "trend": s.prediction if s else None, "z": s.z if s else None,
                  "consecutive_flagged": self._consecutive_flags}
        target = pick_rollback_step(self.good_steps, first_bad, cfg.rewind_steps)
        if target is None or self.restore is None:
            why = "no good checkpoint before the divergence" if target is None else \
                "no restore callable was given"
            self.interventions.record("rollback", "divergence_risk", step, before,
                                      {"restored": False, "reason": why}, outcome="not_possible")
            self._consecutive_flags, self._first_flag_step = 0, None
            return None
        self.restore(target)
        self.trend.truncate(target)
        self.plateau.reset()
        self._improvement = None
        self._losses = [x for x in self._losses if x[0] <= target]
        self.good_steps = [g for g in self.good_steps if g <= target]
        self.interventions.drop_after(target)
        self._consecutive_flags, self._first_flag_step = 0, None
        rec = self.interventions.record("rollback", "divergence_risk", step, before,
                                        {"restored_step": target, "skip_batches": cfg.skip_batches})
        if self.store is not None:
            self.store.log_event("restart", step, {"reason": "rollback", "restored_step": target,
                                                    "skip_batches": cfg.skip_batches})
        patience = self.config.rules.divergence_risk.patience
        due = target + max(4 * patience, 10)

        resumed_from = len(self.alerts.log)

        def check() -> tuple[str, dict[str, Any]]:
            flagged = [a for a in self.alerts.log[resumed_from:] if a.rule == "divergence_risk"]
            ok = not flagged and not self._consecutive_flags
            return ("recovered" if ok else "not_recovered"), {
                "steps_after_resume": due - target, "divergence_alerts_after": len(flagged),
                "threshold": "no flagged loss in the steps after resuming"}

        # Judged once due - target steps have really run after the restore (not at once: the
        # step counter was rewound below `due`).
        self.interventions.expect(rec, due, check, min_steps=due - target)
        return Directive(skipped_update=state.skipped, rollback_to=target,
                         skip_batches=cfg.skip_batches)
