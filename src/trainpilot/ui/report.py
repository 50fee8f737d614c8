"""``trainpilot report``: one self-contained HTML file about a run (plotly.js, the chart code, the
data and the styles inlined; nothing is fetched when it is opened), optionally printed to PDF.

Sections: summary, the dashboard's charts (drawn by the same ``static/charts.js``), alerts and
interventions, faults and recoveries, goodput by category measured vs simulated, and the plan
with predicted vs measured step time.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

from trainpilot.fsio import atomic_write_text
from trainpilot.store import RunStore
from trainpilot.ui.data import run_data
from trainpilot.ui.goodput import goodput_section
from trainpilot.ui.plan import plan_section
from trainpilot.ui.server import STATIC_DIR, plotly_js_path


def _median(values: list[float | None], *, skip_first: bool = False) -> float | None:
    vals = [v for v in (values[1:] if skip_first and len(values) > 1 else values)
            if v is not None]
    return statistics.median(vals) if vals else None


def summary(data: dict[str, Any], medians: dict[str, float | None] | None = None,
            ) -> dict[str, Any]:
    """The numbers at the top of the report, from a run's data (``run_data``); ``medians``
    (full-resolution medians read from the store) replace those of the drawn, possibly
    downsampled, series."""
    s, events, run = data["series"], data["events"], data["run"] or {}

    def values(name: str) -> list[float | None]:
        return (s.get(name) or {}).get("values", [])

    def count(kind: str) -> int:
        return sum(e["kind"] == kind for e in events)

    losses = [v for v in values("loss") if v is not None]
    alerts = [e for e in events if e["kind"] == "alert"]
    health = {k: (values(f"health/{k}") or [None])[-1]
              for k in ("score", "gradient_flow", "communication", "hardware", "convergence")}
    end = run.get("ended_time")
    medians = medians or {}
    out = dict(
        steps=data.get("latest_step", data["cursor"]["step"]),
        first_loss=losses[0] if losses else None,
        last_loss=losses[-1] if losses else None, min_loss=min(losses) if losses else None,
        median_step_time_s=_median(values("step_time_s"), skip_first=True),
        median_tokens_per_s=_median(values("tokens_per_s"), skip_first=True),
        health=health, median_health=_median(values("health/score")),
        num_alerts={sev: sum(a["severity"] == sev for a in alerts)
                    for sev in ("critical", "warning", "info")},
        num_interventions=sum(e["kind"] == "intervention" and
                              e["payload"].get("phase") != "outcome" for e in events),
        num_checkpoints=count("checkpoint"), num_faults=count("fault"),
        num_restarts=count("restart"),
        duration_s=(end - run["started_time"]) if end and run.get("started_time") else None,
        forecast=data.get("forecast"),
        downsampled=any(v.get("downsampled") for v in s.values()))
    out.update({k: v for k, v in medians.items() if k in out})
    return out


def interventions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Interventions with their before/after evidence and, once known, their outcome."""
    rows: list[dict[str, Any]] = []
    for e in events:
        if e["kind"] != "intervention":
            continue
        p = e["payload"]
        if p.get("phase") == "outcome":
            target = next((r for r in reversed(rows) if r["action"] == e["name"]
                           and r["step"] == p.get("intervention_step")), None)
            if target is not None:
                target["outcome"] = p.get("outcome")
                target["outcome_step"] = e["step"]
                continue
        rows.append(dict(step=e["step"], action=e["name"], trigger=p.get("trigger"),
                         before=_compact(p.get("before")), after=_compact(p.get("after")),
                         outcome=p.get("outcome"), outcome_step=None))
    return rows


def faults_and_recoveries(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each fault with its diagnosis and the restart that followed (seconds to recover)."""
    rows: list[dict[str, Any]] = []
    open_fault: dict[str, Any] | None = None
    for e in events:
        if e["kind"] == "fault":
            open_fault = dict(step=e["step"], time=e["time"], fault=e["name"] or e["message"],
                              message=e["message"], diagnosis=None, restart_step=None,
                              restored_step=None, recovery_s=None)
            rows.append(open_fault)
        elif e["kind"] == "diagnosis" and open_fault is not None:
            open_fault["diagnosis"] = e["payload"].get("category") or e["name"]
        elif e["kind"] == "restart":
            p = e["payload"]
            restored = p.get("restored_step", p.get("resumed_step"))
            if open_fault is not None:
                open_fault.update(restart_step=e["step"], restored_step=restored,
                                  recovery_s=e["time"] - open_fault["time"])
                open_fault = None
            else:  # a restart without a recorded fault (a rollback, a resumed job)
                rows.append(dict(step=e["step"], time=e["time"], fault=p.get("reason", "restart"),
                                 message=e["message"], diagnosis=None, restart_step=e["step"],
                                 restored_step=restored, recovery_s=None))
    return rows


def _compact(value: Any) -> str:
    if not value:
        return ""
    if isinstance(value, dict):
        return ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())
    return _fmt(value)


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}"
    return str(value)


def _script_safe(text: str) -> str:
    """JavaScript source for an inline <script>: '</' could close the element and '<!--' could
    start the parser's double-escaped state, so both are broken up ('<\\/', '<\\!--')."""
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def json_for_script(data: Any) -> str:
    """JSON safe inside any <script> element: every '<', '>' and '&' (only ever inside JSON
    strings) is written as its \\u escape, so store text such as '<!--<script' or
    '</script>' cannot end or re-mode the element; ``JSON.parse`` reads the same value."""
    return (json.dumps(data, allow_nan=False).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))


def _medians(store: RunStore) -> dict[str, float | None]:
    """Medians over every step after the first (full resolution, not the drawn points)."""
    import numpy as np

    from trainpilot.ui.plan import values_after_first

    out = {}
    for key, name in (("median_step_time_s", "step_time_s"),
                      ("median_tokens_per_s", "tokens_per_s")):
        values = values_after_first(store, name)
        out[key] = float(np.median(values)) if len(values) else None
    return out


def build_report(run_dir: str | os.PathLike) -> str:
    """The report of the run in ``run_dir`` as one HTML document (str)."""
    import jinja2

    from trainpilot import __version__

    run_dir = Path(run_dir)
    with RunStore.open_readonly(run_dir) as store:
        data = run_data(store)
        plan = plan_section(store, run_dir)
        goodput = goodput_section(store)
        medians = _medians(store)
    plotly_js = plotly_js_path().read_text(encoding="utf-8")
    if "</script" in plotly_js.lower():
        raise RuntimeError("plotly.min.js contains '</script'; it cannot be inlined as is")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(__file__).parent / "templates")),
        autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined)
    env.filters["fmt"] = _fmt
    env.filters["ms"] = lambda v: "-" if v is None else f"{1e3 * v:.2f} ms"
    env.filters["when"] = lambda t: "-" if not t else datetime.datetime.fromtimestamp(
        t).strftime("%Y-%m-%d %H:%M:%S")
    template = env.get_template("report.html")
    return template.render(
        run=data["run"] or {}, run_dir=str(run_dir), data=data,
        summary=summary(data, medians),
        alerts=[e for e in data["events"] if e["kind"] in ("alert", "diagnosis")],
        interventions=interventions(data["events"]),
        faults=faults_and_recoveries(data["events"]), goodput=goodput, plan=plan,
        version=__version__, generated=datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
        style=(STATIC_DIR / "style.css").read_text(encoding="utf-8"),
        plotly_js=plotly_js, charts_js=_script_safe((STATIC_DIR / "charts.js").read_text()),
        data_json=json_for_script(data))


HTML_SUFFIXES = (".html", ".htm")
PDF_SUFFIX = ".pdf"


def check_output(out: str | os.PathLike, *, also_pdf: bool = False) -> tuple[str, Path]:
    """('html' or 'pdf', path) for an output path, or SpecError: the suffix decides the format
    (.html/.htm or .pdf), a directory or a path under a file is refused."""
    from trainpilot.specs.errors import SpecError

    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in HTML_SUFFIXES + (PDF_SUFFIX,):
        raise SpecError("--output", str(out), "valid: a file name ending in .html, .htm or "
                        ".pdf (the suffix picks the format)")
    if out.is_dir():
        raise SpecError("--output", str(out), "valid: a file path (this is a directory)")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise SpecError("--output", str(out), f"valid: a path in a directory ({parent} "
                                "is a file)")
            break
    if also_pdf and suffix == PDF_SUFFIX:
        raise SpecError("--pdf", True, "valid: with an .html output (a .pdf output is "
                        "already the PDF)")
    return ("pdf" if suffix == PDF_SUFFIX else "html"), out


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike, *,
                 pdf: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write the report (atomically) to ``out``: HTML for .html/.htm, a PDF printed by headless
    Chromium for .pdf (from a temporary HTML file); ``pdf`` also prints an HTML report to that
    path. Returns the paths written by format."""
    import tempfile

    kind, out = check_output(out)
    text = build_report(run_dir)
    if kind == "pdf":
        from trainpilot.ui.browser import print_to_pdf

        with tempfile.TemporaryDirectory(prefix="trainpilot-report-") as tmp:
            html_path = Path(tmp) / "report.html"
            html_path.write_text(text, encoding="utf-8")
            return {"pdf": print_to_pdf(html_path, out)}
    atomic_write_text(out, text)
    paths = {"html": out}
    if pdf is not None:
        from trainpilot.ui.browser import print_to_pdf

        paths["pdf"] = print_to_pdf(out, check_output(pdf)[1])
    return paths
