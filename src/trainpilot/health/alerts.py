"""Alert bookkeeping: an alert is logged when its rule becomes active, repeated at most every
``cooldown_steps`` while it stays active, and an ``alert_cleared`` event is logged when a rule
that was evaluated this step no longer fires."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from trainpilot.store.runstore import RunStore

log = logging.getLogger("trainpilot.health")


@dataclass(kw_only=True)
class Alert:
    rule: str
    severity: str
    step: int
    message: str
    payload: dict[str, Any] = field(default_factory=dict)


class AlertManager:
    """Deduplicates rule hits into alert events (in the store, and in ``self.log``)."""

    def __init__(self, store: RunStore | None, *, cooldown_steps: int = 100):
        self.store, self.cooldown_steps = store, cooldown_steps
        self.active: dict[str, Alert] = {}
        self._last_logged: dict[str, int] = {}
        self.log: list[Alert] = []  # every alert logged, oldest first
        self._fired: set[str] = set()
        self._evaluated: set[str] = set()

    def evaluated(self, rule: str) -> None:
        """Note that ``rule`` was checked this step (so it can clear if it did not fire)."""
        self._evaluated.add(rule)

    def fire(self, rule: str, severity: str, step: int, message: str, **payload: Any) -> bool:
        """Record a hit; returns True when it was logged (new, or past the cooldown)."""
        self._evaluated.add(rule)
        self._fired.add(rule)
        alert = Alert(rule=rule, severity=severity, step=step, message=message, payload=payload)
        self.active[rule] = alert
        last = self._last_logged.get(rule)
        if last is not None and step - last < self.cooldown_steps and step >= last:
            return False
        self._last_logged[rule] = step
        self.log.append(alert)
        log.log(logging.CRITICAL if severity == "critical" else logging.WARNING,
                "alert %s at step %d: %s", rule, step, message)
        if self.store is not None:
            self.store.log_event("alert", step, dict(payload, message=message),
                                 severity=severity, name=rule, message=message)
        return True

    def end_step(self, step: int) -> None:
        """Clear evaluated rules that did not fire this step."""
        for rule in sorted(self._evaluated - self._fired):
            if rule in self.active:
                del self.active[rule]
                self._last_logged.pop(rule, None)
                if self.store is not None:
                    self.store.log_event("alert_cleared", step, {}, name=rule,
                                         message=f"{rule} cleared")
        self._fired.clear()
        self._evaluated.clear()

    def state_dict(self) -> dict[str, Any]:
        """Active alerts (without payloads) and when each rule last logged (its cooldown)."""
        return {"active": [[a.rule, a.severity, a.step, a.message]
                           for a in self.active.values()],
                "last_logged": [[rule, step] for rule, step in self._last_logged.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.active = {rule: Alert(rule=rule, severity=severity, step=int(step), message=msg)
                       for rule, severity, step, msg in state["active"]}
        self._last_logged = {rule: int(step) for rule, step in state["last_logged"]}

    def critical_active(self) -> bool:
        return any(a.severity == "critical" for a in self.active.values())
