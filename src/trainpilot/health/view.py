"""A run's health at a glance, read from its store: a JSON-ready snapshot and rich renderables
(used by ``trainpilot monitor`` and the demo)."""

from __future__ import annotations

import math
import time
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from trainpilot.health.score import band
from trainpilot.store.runstore import RunStore

KEY_METRICS = ("loss", "loss_trend", "lr", "grad_norm", "update_ratio", "zero_grad_frac",
               "nonfinite_grads", "step_time_s", "data_time_s", "comm_time_s", "tokens_per_s",
               "mfu", "peak_mem_gib", "mem_frac")
PARTS = ("gradient_flow", "communication", "hardware", "convergence")
TIMELINE_KINDS = ("alert", "intervention", "fault", "restart", "checkpoint", "diagnosis",
                  "lr_change")


def active_alerts(store: RunStore) -> list[dict[str, Any]]:
    """Alerts raised and not cleared since (newest first). A new process (``run_start``,
    ``run_resumed``) has a fresh monitor that never clears its predecessor's alerts (it raises
    them again if their condition holds), so those are dropped there; an in-process restart
    keeps the monitor and its alerts."""
    active: dict[str, dict[str, Any]] = {}
    for e in store.events(kinds=["alert", "alert_cleared", "run_start", "run_resumed"]):
        if e.kind == "alert":
            active[e.name] = dict(rule=e.name, severity=e.severity, step=e.step,
                                  message=e.message)
        elif e.kind == "alert_cleared":
            active.pop(e.name, None)
        else:
            active.clear()
    return sorted(active.values(), key=lambda a: -(a["step"] or 0))


def straggler_ratios(store: RunStore, *, last_steps: int = 20) -> dict[int, float]:
    """Per rank: median over the last steps of compute time / median of the other ranks."""
    latest = store.latest_step() or 0
    rows = store.rank_timings(since_step=latest - last_steps)
    by_step: dict[int, dict[int, float]] = {}
    for t in rows:
        if t.compute_s is not None:
            by_step.setdefault(t.step, {})[t.rank] = t.compute_s
    ratios: dict[int, list[float]] = {}
    for times in by_step.values():
        for rank, value in times.items():
            others = sorted(v for r, v in times.items() if r != rank)
            if others:
                mid = len(others) // 2
                med = others[mid] if len(others) % 2 else 0.5 * (others[mid - 1] + others[mid])
                ratios.setdefault(rank, []).append(value / med if med > 0 else 1.0)
    return {r: sorted(v)[len(v) // 2] for r, v in sorted(ratios.items())}


def snapshot(store: RunStore, *, num_events: int = 12) -> dict[str, Any]:
    """Latest metrics, health score and parts, active alerts, recent timeline, forecast."""
    run = store.run()
    step, latest = store.latest_metrics()
    events = store.events(kinds=TIMELINE_KINDS, limit=num_events)
    return dict(
        run=None if run is None else dict(run_id=run.run_id, name=run.name, status=run.status,
                                          started_time=run.started_time,
                                          world_size=run.world_size),
        step=step,
        metrics={k: latest[k] for k in KEY_METRICS if k in latest},
        health={"score": latest.get("health/score"),
                "band": band(latest.get("health/score")),
                **{p: latest.get(f"health/{p}") for p in PARTS}},
        active_alerts=active_alerts(store),
        events=[dict(id=e.id, step=e.step, kind=e.kind, severity=e.severity, name=e.name,
                     message=e.message, time=e.time) for e in events],
        interventions=[dict(step=e.step, action=e.name, **{k: e.payload.get(k) for k in
                            ("trigger", "before", "after", "outcome", "phase",
                             "intervention_step")})
                       for e in store.events(kinds=["intervention"])],
        forecast=_forecast_brief(store.latest_forecast()),
        stragglers=straggler_ratios(store),
    )


def _forecast_brief(fc: dict[str, Any] | None) -> dict[str, Any] | None:
    if not fc:
        return None
    keys = ("made_at_step", "total_steps", "model", "final_loss", "final_lo", "final_hi",
            "target_loss", "target_step", "target_lo", "target_hi", "reliable", "note",
            "interval_source")
    return {k: fc.get(k) for k in keys}


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.4g}"
    return str(value)


def _bar(fraction: float | None, width: int = 20) -> Text:
    if fraction is None:
        return Text("-")
    filled = int(round(max(0.0, min(1.0, fraction)) * width))
    colour = "green" if fraction >= 0.8 else "yellow" if fraction >= 0.5 else "red"
    return Text("█" * filled + "░" * (width - filled), style=colour)


def render(snap: dict[str, Any], *, title: str = "") -> Group:
    """Rich renderables for a snapshot: score, metrics, alerts and the recent timeline."""
    health = snap["health"]
    score = health.get("score")
    head = Text(f"{title}  step {_fmt(snap['step'])}  ", style="bold")
    head.append(f"health {score:.0f}/100 ({health.get('band', band(score))})"
                if score is not None else "health -",
                style="bold green" if (score or 0) >= 80 else "bold yellow"
                if (score or 0) >= 50 else "bold red")
    parts = Table(show_header=False, box=None, padding=(0, 1))
    for part in PARTS:
        value = health.get(part)
        parts.add_row(part, _bar(value), _fmt(None if value is None else 25 * value) + " / 25")
    metrics = Table("metric", "latest", box=None, padding=(0, 1))
    for key, value in snap["metrics"].items():
        metrics.add_row(key, _fmt(value))
    if snap.get("forecast"):
        fc = snap["forecast"]
        text = (f"{_fmt(fc['final_loss'])} [{_fmt(fc['final_lo'])}, "
                f"{_fmt(fc['final_hi'])}] at step {fc['total_steps']}")
        if fc.get("reliable") is False:
            text += f" (unreliable: {fc.get('note')})"
        metrics.add_row("forecast final loss", text)
    for rank, ratio in (snap.get("stragglers") or {}).items():
        if ratio >= 1.2:
            metrics.add_row(f"straggler rank {rank}", f"{ratio:.2f}x", style="yellow")
    alerts = Table("severity", "rule", "step", "message", box=None, padding=(0, 1),
                   title="active alerts", title_justify="left")
    for a in snap["active_alerts"]:
        alerts.add_row(a["severity"], a["rule"], _fmt(a["step"]), a["message"],
                       style="red" if a["severity"] == "critical" else "yellow")
    timeline = Table("step", "kind", "name", "message", box=None, padding=(0, 1),
                     title="recent events", title_justify="left")
    for e in snap["events"]:
        timeline.add_row(_fmt(e["step"]), e["kind"], e["name"], e["message"][:90])
    return Group(Panel(Group(head, parts), title="trainpilot monitor", title_align="left"),
                 metrics, alerts, timeline,
                 Text(time.strftime("updated %H:%M:%S"), style="dim"))
