"""``trainpilot export-metrics``: a run store's metrics as TensorBoard events / Prometheus text."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainpilot.cli.common import add_json_arg, add_verb, console, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "export-metrics",
        help="write a run's metrics as TensorBoard event files and/or Prometheus text",
        description="Read RUN_DIR's run store (read-only; a running job keeps writing) and "
                    "write every metric: TensorBoard event files (each step at the wall time "
                    "the store recorded for it) and/or a Prometheus text file with the latest "
                    "values (node_exporter's textfile collector), or serve them on a port "
                    "until interrupted. `trainpilot train --export-metrics` does the same live.",
        examples="  trainpilot export-metrics runs/tiny --tensorboard runs/tiny/tb\n"
                 "  tensorboard --logdir runs/tiny/tb\n"
                 "  trainpilot export-metrics runs/tiny --prometheus /var/lib/node_exporter/"
                 "tiny.prom\n"
                 "  trainpilot export-metrics runs/tiny --prometheus 9400   # serve /metrics",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a trainpilot run directory")
    parser.add_argument("--tensorboard", metavar="DIR", help="TensorBoard log directory")
    parser.add_argument("--prometheus", metavar="FILE|PORT",
                        help="Prometheus text file to write, or a port to serve /metrics on")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainpilot.specs import SpecError
    from trainpilot.store.exporters import PrometheusExporter, export_metrics
    from trainpilot.store.runstore import RunStore

    parts = [f"tensorboard={args.tensorboard}" if args.tensorboard else "",
             f"prometheus={args.prometheus}" if args.prometheus else ""]
    if not any(parts):
        raise SpecError("export-metrics", str(args.run_dir),
                        "needs --tensorboard DIR and/or --prometheus FILE|PORT")
    if not (args.run_dir / "trainpilot.db").is_file():
        raise SpecError("RUN_DIR", str(args.run_dir), "has no run store (trainpilot.db)")
    serving = export_metrics(args.run_dir, ",".join(p for p in parts if p))
    store = RunStore.open_readonly(args.run_dir)
    try:
        steps = len(store.step_times())
        values = sum(1 for rows in store.metrics().values() for _, v in rows if v == v)
    finally:
        store.close()
    summary = {"run_dir": str(args.run_dir), "steps": steps, "values": values,
               "tensorboard": args.tensorboard, "prometheus": args.prometheus}
    if args.json:
        print_json(summary)
    else:
        console.print(f"{values:,} values of {steps:,} steps -> "
                      + ", ".join(p for p in parts if p))
    for exporter in serving:
        if isinstance(exporter, PrometheusExporter):
            console.print(f"serving {exporter.url} (Ctrl-C to stop)")
            try:
                exporter.join()
            except KeyboardInterrupt:
                pass
            finally:
                exporter.close()
    return 0
