"""``trainpilot report``: write a run's self-contained HTML report (and a PDF, with Chromium)."""

from __future__ import annotations

import argparse

from trainpilot.cli.common import (
    EXIT_FAILURE,
    add_json_arg,
    add_verb,
    console,
    err_console,
    print_json,
)


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "report", help="write a run's report as one self-contained HTML file",
        description="Write one HTML file about a run, readable offline (plotly.js inlined): "
                    "summary, the dashboard's plots, alerts and interventions, faults and "
                    "recoveries, goodput by category measured vs simulated, and the plan with "
                    "predicted vs measured step time. The output's suffix picks the format: "
                    ".html/.htm, or .pdf (printed by headless Chromium); any other is refused.",
        examples="  trainpilot report runs/demo -o report.html\n"
                 "  trainpilot report runs/demo -o report.pdf          # the PDF only\n"
                 "  trainpilot report runs/demo -o report.html --pdf   # report.pdf too\n"
                 "  trainpilot report runs/demo -o out/r.html --json",
    )
    parser.add_argument("run_dir", help="a run directory (holding trainpilot.db)")
    parser.add_argument("-o", "--output", default="report.html",
                        help="file to write: .html/.htm or .pdf (default report.html)")
    parser.add_argument("--pdf", action="store_true",
                        help="also print it to PDF beside the HTML (same name, .pdf); needs "
                             "Chromium")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainpilot.store import RunStore
    from trainpilot.ui.report import check_output, write_report

    kind, out = check_output(args.output, also_pdf=args.pdf)
    RunStore.open_readonly(args.run_dir).close()  # a missing or unreadable store: exit 2
    pdf = out.with_suffix(".pdf") if args.pdf else None
    try:
        paths = write_report(args.run_dir, out, pdf=pdf)
    except (FileNotFoundError, RuntimeError) as err:
        if kind == "html" and out.is_file():
            console.print(f"wrote {out}", markup=False)
        err_console.print(f"[bold red]error:[/] {err}", soft_wrap=True)
        return EXIT_FAILURE
    if args.json:
        print_json({k: str(v) for k, v in paths.items()})
    else:
        for kind, path in paths.items():
            size = path.stat().st_size / 1e6
            console.print(f"wrote {kind.upper()} report {path} ({size:.1f} MB)", markup=False)
    return 0
