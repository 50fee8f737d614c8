"""The health step of ``trainpilot demo``: a report read back from a run's store."""

from __future__ import annotations

import os

from rich.console import Console
from rich.table import Table

from trainpilot.health.view import render, snapshot
from trainpilot.store import RunStore, consult


def demo_health(console: Console, run_dir: str | os.PathLike) -> dict:
    """Print the run's health report (score and its parts, alerts, interventions with their
    before/after evidence and outcome, forecast) from ``run_dir``'s store; returns the snapshot.
    Read-only: safe while the run still writes."""
    store = RunStore.open_readonly(run_dir)
    try:
        snap = snapshot(store)
        console.print(render(snap, title=str(run_dir)))
        done = [i for i in snap["interventions"] if i.get("phase") == "outcome"]
        if snap["interventions"]:
            table = Table("step", "action", "trigger", "before", "after", "outcome",
                          title="interventions", title_justify="left", box=None,
                          padding=(0, 1))
            for item in snap["interventions"]:
                if item.get("phase") == "outcome":
                    continue
                outcome = next((d["outcome"] for d in done if d["action"] == item["action"]
                                and d.get("intervention_step") == item["step"]),
                               item.get("outcome"))
                table.add_row(str(item["step"]), item["action"], str(item.get("trigger")),
                              _brief(item.get("before")), _brief(item.get("after")),
                              str(outcome or "pending"))
            console.print(table)
        history = consult(os.path.dirname(os.path.abspath(run_dir)))
        if history:
            console.print("knowledge base: " + "; ".join(
                f"{e.anomaly} -> {e.action}: {e.num_recovered}/{e.num_tried} recovered"
                for e in history[:5]))
    finally:
        store.close()
    return snap


def _brief(data) -> str:
    if not data:
        return "-"
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in data.items())[:70]
