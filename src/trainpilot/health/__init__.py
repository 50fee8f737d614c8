"""Observes training runs: metrics, rules -> alerts, interventions, convergence forecasts,
stragglers, the health score and fault diagnosis from logs. See docs/health.md.

Heavy pieces (torch, scipy) load on first use: ``from trainpilot.health import HealthMonitor``.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "HealthMonitor": "trainpilot.health.monitor",
    "StepRecord": "trainpilot.health.records",
    "Directive": "trainpilot.health.records",
    "HealthConfig": "trainpilot.health.config",
    "load_health_config": "trainpilot.health.config",
    "Diagnoser": "trainpilot.health.diagnosis",
    "Diagnosis": "trainpilot.health.diagnosis",
    "diagnose": "trainpilot.health.diagnosis",
    "ConvergenceForecaster": "trainpilot.health.forecast",
    "Forecast": "trainpilot.health.forecast",
    "StragglerDetector": "trainpilot.health.stragglers",
    "gather_rank_timings": "trainpilot.health.stragglers",
    "health_score": "trainpilot.health.score",
    "demo_health": "trainpilot.health.demo",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'trainpilot.health' has no attribute {name!r}")
