"""``trainpilot validate``: the cost model against published and measured runs, per row."""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from rich.table import Table

from trainpilot.cli.common import EXIT_FAILURE, add_json_arg, add_verb, console, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "validate", help="check the cost model against published measurements",
        description="Predict every published row (Narayanan et al. 2021 Table 1, Korthikanti "
                    "et al. 2022 Table 5 and Figure 1) and every vTrain measured iteration "
                    "(read from ../shared/validation/vtrain or $TRAINPILOT_VTRAIN_DIR), print "
                    "predicted vs measured with the error, and exit 1 when a dataset's mean "
                    "|error| passes the committed threshold (10% time, 5% memory). Calibration "
                    "rows (even vTrain rows) and held-out rows are reported separately.",
        examples="  trainpilot validate\n"
                 "  trainpilot validate --all-rows\n"
                 "  trainpilot validate --json > validation.json\n"
                 "  trainpilot validate --calibrate --write efficiency-a100.yaml",
    )
    parser.add_argument("--vtrain-dir", type=Path, default=None,
                        help="folder with vTrain's ground_truth_*.csv (default: found beside the "
                             "repository)")
    parser.add_argument("--all-rows", action="store_true",
                        help="print every vTrain single-node row, not a summary by shape")
    parser.add_argument("--calibrate", action="store_true",
                        help="refit the A100 efficiency data on the calibration rows first")
    parser.add_argument("--max-evals", type=int, default=900,
                        help="objective evaluations for --calibrate (default 900)")
    parser.add_argument("--write", type=Path, default=None,
                        help="with --calibrate: write the fitted curve as YAML to this file")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainpilot.fsio import atomic_write_text
    from trainpilot.perf.hardware import load_curves
    from trainpilot.perf.validation import THRESHOLDS, all_cases, failures, run, summarize
    from trainpilot.perf.validation import vtrain as vt
    from trainpilot.specs import SpecError

    folder = args.vtrain_dir if args.vtrain_dir else vt.locate()
    if args.vtrain_dir and not (args.vtrain_dir / vt.FILES["vtrain_single"]).exists():
        raise SpecError("--vtrain-dir", str(args.vtrain_dir),
                        f"has no {vt.FILES['vtrain_single']}")
    cases = all_cases(folder, find_vtrain=False)
    curve = None
    if args.calibrate:
        import yaml

        from trainpilot.perf.validation.calibrate import calibrate

        with console.status("calibrating the A100 curve on the calibration rows..."):
            fit = calibrate(cases, load_curves()["a100"], max_evals=args.max_evals)
        curve = fit.curve
        text = yaml.safe_dump({"a100": curve.to_dict()}, sort_keys=False)
        if args.write:
            atomic_write_text(args.write, text)
        if not args.json:
            console.print(f"calibration: {fit.rows} rows, {fit.evaluations} evaluations, "
                          f"MAPE {fit.start_mape:.1%} -> {fit.mape:.1%}")
            console.print(text, markup=False)
    results = run(cases, curve)
    summaries = summarize(results)
    failed = failures(summaries)
    if args.json:
        print_json(dict(
            vtrain_dir=str(folder) if folder else None, thresholds=THRESHOLDS,
            summaries=[s.to_dict() for s in summaries], failures=failed,
            rows=[dict(dataset=r.case.dataset, label=r.case.label, split=r.case.split,
                       metric=r.case.metric, measured=r.case.measured, predicted=r.predicted,
                       error=r.error) for r in results],
        ))
        return EXIT_FAILURE if failed else 0
    if folder is None:
        console.print(f"[yellow]vTrain measurements not found[/] (looked beside the repository "
                      f"for shared/validation/vtrain; set {vt.ENV}); validating the paper rows "
                      "only.")
    else:
        console.print(f"vTrain measurements: {folder}")
    _print_rows(results, args.all_rows)
    _print_summary(summaries, THRESHOLDS)
    for line in failed:
        console.print(f"[bold red]FAIL[/] {line}")
    if not failed:
        console.print("[bold green]PASS[/] every dataset is within its threshold")
    return EXIT_FAILURE if failed else 0


_UNITS = {"step_time_s": "s/step", "tflops_per_gpu": "TFLOP/s/GPU",
          "causal_tflops_per_gpu": "TFLOP/s/GPU",
          "weights_optimizer_gib": "GiB", "activations_gib": "GiB"}


def _print_rows(results, all_rows: bool) -> None:
    by_set = defaultdict(list)
    for r in results:
        by_set[r.case.dataset].append(r)
    for dataset, rows in by_set.items():
        if dataset == "vtrain_single" and not all_rows:
            _print_grouped(rows)
            continue
        table = Table(title=f"{dataset}: {rows[0].case.source[:90]}", title_justify="left")
        for col in ("row", "split", "measured", "predicted", "error", "unit"):
            table.add_column(col, justify="left" if col in ("row", "split", "unit") else "right")
        for r in rows:
            table.add_row(r.case.label, r.case.split, f"{r.case.measured:.4g}",
                          f"{r.predicted:.4g}", _err(r.error), _UNITS[r.case.metric])
        console.print(table)


def _print_grouped(rows) -> None:
    groups = defaultdict(list)
    for r in rows:
        p, m = r.case.plan, r.case.model
        groups[(m.hidden_size, p.tp, p.pp, p.micro_batch_size)].append(r)
    table = Table(title=f"vtrain_single: {len(rows)} rows by (hidden, tp, pp, micro-batch); "
                        "--all-rows prints each", title_justify="left")
    for col in ("hidden", "tp", "pp", "mb", "rows", "mean |error|", "max |error|", "bias"):
        table.add_column(col, justify="right")
    for key in sorted(groups):
        errs = [r.error for r in groups[key]]
        table.add_row(*map(str, key), str(len(errs)), f"{_mean_abs(errs):.1%}",
                      f"{max(map(abs, errs)):.1%}", _err(sum(errs) / len(errs)))
    console.print(table)
    worst = sorted(rows, key=lambda r: -abs(r.error))[:10]
    table = Table(title="vtrain_single: the 10 largest errors", title_justify="left")
    for col in ("row", "split", "measured s", "predicted s", "error"):
        table.add_column(col, justify="left" if col in ("row", "split") else "right")
    for r in worst:
        table.add_row(r.case.label, r.case.split, f"{r.case.measured:.4g}",
                      f"{r.predicted:.4g}", _err(r.error))
    console.print(table)


def _print_summary(summaries, thresholds) -> None:
    table = Table(title="mean and max |error| per dataset (the gate is on the mean)",
                  title_justify="left")
    for col in ("dataset", "split", "rows", "mean", "max", "bias", "gate"):
        table.add_column(col, justify="left" if col in ("dataset", "split") else "right",
                         no_wrap=True)
    for s in summaries:
        limit = thresholds[s.kind]
        pooled = s.dataset == "all held-out"
        mark = "" if pooled else ("ok" if s.mape <= limit else "FAIL")
        name = f"all held-out {s.kind}" if pooled else s.dataset
        split = "calib." if s.split == "calibration" else "held-out"
        table.add_row(name, split, str(s.count), f"{s.mape:.1%}", f"{s.max_ape:.1%}",
                      _err(s.bias), f"{limit:.0%} {mark}".strip())
    console.print(table)


def _mean_abs(errs) -> float:
    return sum(map(abs, errs)) / len(errs)


def _err(e: float) -> str:
    return f"{e:+.1%}"
