"""The last step of ``trainpilot demo``: write the run's report, print the dashboard command."""

from __future__ import annotations

import shlex
from pathlib import Path

from rich.console import Console

from trainpilot.store import STORE_FILENAME


def demo_report(console: Console, run_dir: str | Path) -> Path | None:
    """Write ``RUN_DIR/report.html`` for the demo's run and print how to open the live dashboard
    on it. Returns the report's path, or None (with a note) when the run wrote no store."""
    from trainpilot.ui.report import write_report

    run_dir = Path(run_dir)
    if not (run_dir / STORE_FILENAME).is_file():
        console.print(f"[dim]No run store in {run_dir} ({STORE_FILENAME}): no report or "
                      "dashboard for this run.[/]")
        return None
    out = write_report(run_dir, run_dir / "report.html")["html"]
    size_mb = out.stat().st_size / 1e6
    console.print(f"Report: [bold]{out}[/] ({size_mb:.1f} MB, self-contained: open it in any "
                  "browser, offline). PDF: "
                  f"[bold]trainpilot report {shlex.quote(str(run_dir))} -o "
                  f"{shlex.quote(str(out))} --pdf[/]")
    console.print("Live dashboard of this run (Ctrl-C stops it): "
                  f"[bold]trainpilot dashboard {shlex.quote(str(run_dir))}[/]  -> "
                  "http://127.0.0.1:10400/")
    return out
