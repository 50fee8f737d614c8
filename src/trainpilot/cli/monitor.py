"""``trainpilot monitor``: a live terminal view of a run's store (metrics, alerts, health)."""

from __future__ import annotations

import argparse
import time

from trainpilot.cli.common import add_json_arg, add_verb, console, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "monitor", help="live view of a run's metrics, alerts and health score",
        description="Open a run directory's store read-only (safe while training writes it) "
                    "and show the latest metrics, the health score and its four parts, active "
                    "alerts, interventions, the convergence forecast and stragglers; refreshes "
                    "until Ctrl-C.",
        examples="  trainpilot monitor runs/exp1\n"
                 "  trainpilot monitor runs/exp1 --once          # print once and exit\n"
                 "  trainpilot monitor runs/exp1 --json          # one snapshot as JSON",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding trainpilot.db")
    parser.add_argument("--once", action="store_true", help="print one view and exit")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="seconds between refreshes (default 1)")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.live import Live

    from trainpilot.health.view import render, snapshot
    from trainpilot.specs.errors import SpecError
    from trainpilot.store import RunStore

    if not args.interval > 0:
        raise SpecError("--interval", args.interval, "valid: seconds > 0")
    store = RunStore.open_readonly(args.run_dir)
    try:
        if args.json:
            print_json(snapshot(store))
            return 0
        if args.once:
            console.print(render(snapshot(store), title=args.run_dir))
            return 0
        with Live(render(snapshot(store), title=args.run_dir), console=console,
                  refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(snapshot(store), title=args.run_dir))
    finally:
        store.close()
