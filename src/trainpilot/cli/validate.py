"""``trainpilot validate``: the cost model against published and measured runs, per row."""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path

from rich.table import Table

from trainpilot.cli.common import EXIT_FAILURE, add_json_arg, add_verb, console, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "validate", help="check the cost model against published measurements",
        description="Predict every published row and print predicted vs measured with the "
                    "error. Held-out sources (src/trainpilot/perf/validation/sources/*.yaml: "
                    "Megatron-LM, MosaicML llm-foundry, torchtitan, NeMo AutoModel, the "
                    "Megatron MoE model zoo, Megatron-Core MoE, MT-NLG, DeepSeek-V3), never "
                    "fitted to, are summarised per source and pooled, dense and MoE apart. The "
                    "calibration sources (NVIDIA's DGX Cloud recipes for the H100 data, the even "
                    "rows of vTrain's measured iterations for the A100 data, read from "
                    "../shared/validation/vtrain or $TRAINPILOT_VTRAIN_DIR) and the development "
                    "papers (Narayanan 2021, Korthikanti 2022, Llama 3) have their own gates. "
                    "Exits 1 when a gate breaks.",
        examples="  trainpilot validate\n"
                 "  trainpilot validate --source llm_foundry --all-rows\n"
                 "  trainpilot validate --json > validation.json\n"
                 "  trainpilot validate --dump-row 'GPT-3 175B t4 p8 v12 128 GPUs' "
                 "--output row.yaml && trainpilot predict --job row.yaml\n"
                 "  trainpilot validate --calibrate h100 --write efficiency-h100.yaml",
    )
    parser.add_argument("--vtrain-dir", type=Path, default=None,
                        help="folder with vTrain's ground_truth_*.csv (default: found beside the "
                             "repository)")
    parser.add_argument("--source", action="append", default=None, metavar="NAME",
                        help="only this dataset/source (repeatable)")
    parser.add_argument("--all-rows", action="store_true",
                        help="print every row of the large tables, not a summary")
    parser.add_argument("--dump-row", metavar="LABEL",
                        help="write the row's model, cluster and plan as one job document "
                             "(free fields settled) for `trainpilot predict --job`")
    parser.add_argument("--output", type=Path, default=None,
                        help="with --dump-row: the file to write (default: print it)")
    parser.add_argument("--calibrate", nargs="?", const="a100", default=None,
                        metavar="DEVICE",
                        help="refit a device family's efficiency data (a100, the default, or "
                             "h100) on its calibration source first")
    parser.add_argument("--max-evals", type=int, default=900,
                        help="objective evaluations for --calibrate (default 900)")
    parser.add_argument("--write", type=Path, default=None,
                        help="with --calibrate: write the fitted curve as YAML to this file")
    parser.add_argument("--part", choices=["all", "training", "serving", "diagnosis"],
                        default="all",
                        help="what to validate: the training cost model, the serving "
                             "simulator (Sim2Infer), log diagnosis, or all three (default)")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainpilot.fsio import atomic_write_text
    from trainpilot.perf.hardware import load_curves
    from trainpilot.perf.validation import (
        HELD_OUT_GATES,
        THRESHOLDS,
        all_cases,
        failures,
        run,
        summarize,
    )
    from trainpilot.perf.validation import vtrain as vt
    from trainpilot.specs import SpecError

    folder = args.vtrain_dir if args.vtrain_dir else vt.locate()
    if args.vtrain_dir and not (args.vtrain_dir / vt.FILES["vtrain_single"]).exists():
        raise SpecError("--vtrain-dir", str(args.vtrain_dir),
                        f"has no {vt.FILES['vtrain_single']}")
    if args.output and not args.dump_row:
        raise SpecError("--output", str(args.output), "needs --dump-row")
    cases = all_cases(folder, find_vtrain=False)
    if args.source:
        known = sorted({c.dataset for c in cases})
        bad = [s for s in args.source if s not in known]
        if bad:
            raise SpecError("--source", bad[0], f"valid: {', '.join(known)}")
        cases = [c for c in cases if c.dataset in args.source]
    if args.dump_row:
        return _dump_row(cases, args.dump_row, args.output)
    curve = None
    if args.calibrate:
        import yaml

        from trainpilot.perf.validation.calibrate import CALIBRATION_SOURCES, calibrate

        name = args.calibrate
        if name not in CALIBRATION_SOURCES:
            raise SpecError("--calibrate", name, f"valid: {', '.join(CALIBRATION_SOURCES)}")
        with console.status(f"calibrating the {name} data on its calibration rows..."):
            fit = calibrate(cases, load_curves()[name], max_evals=args.max_evals)
        curve = fit.curve
        text = yaml.safe_dump({name: curve.to_dict()}, sort_keys=False)
        if args.write:
            atomic_write_text(args.write, text)
        if not args.json:
            console.print(f"calibration: {fit.rows} rows, {fit.evaluations} evaluations, "
                          f"MAPE {fit.start_mape:.1%} -> {fit.mape:.1%}")
            console.print(text, markup=False)
    others = _other_parts(args.part)
    if args.part != "all" and args.part != "training":
        return _report_others(others, args.json)
    results = run(cases, curve)
    summaries = summarize(results)
    subset = bool(args.source)
    failed = failures(summaries, subset=subset) + others["failures"]
    if args.json:
        print_json(dict(**{k: v for k, v in others.items() if k != "failures"},
            vtrain_dir=str(folder) if folder else None, thresholds=THRESHOLDS,
            held_out_gates=HELD_OUT_GATES,
            summaries=[s.to_dict() for s in summaries], failures=failed,
            rows=[dict(dataset=r.case.dataset, label=r.case.label, split=r.case.split,
                       kind=r.case.kind, metric=r.case.metric, convention=r.case.convention,
                       measured=r.case.measured, predicted=r.predicted,
                       error=None if r.predicted is None else r.error, refused=r.refused)
                  for r in results],
        ))
        return EXIT_FAILURE if failed else 0
    if folder is None:
        console.print(f"[yellow]vTrain measurements not found[/] (looked beside the repository "
                      f"for shared/validation/vtrain; set {vt.ENV}); validating the published "
                      "sources only.")
    else:
        console.print(f"vTrain measurements: {folder}")
    _print_rows(results, args.all_rows)
    _print_summary(summaries, THRESHOLDS, HELD_OUT_GATES, subset=subset)
    if subset:
        console.print("the pooled and per-batch gates apply to a run over every source (no "
                      "--source); this run shows the chosen sources' errors only")
    _print_others(others)
    for line in failed:
        console.print(f"[bold red]FAIL[/] {line}")
    if not failed:
        console.print("[bold green]PASS[/] every gate holds")
    return EXIT_FAILURE if failed else 0


def _other_parts(part: str) -> dict:
    """The serving simulator's and the log diagnosis's held-out validation (sim/, health/):
    summaries, and the gates that failed."""
    out: dict = {"failures": []}
    if part in ("all", "serving"):
        from trainpilot.sim.serve_validation import gates_line, validate_serving

        serving = validate_serving()["summary"]
        out["serving"] = serving
        if not serving["passed"]:
            out["failures"].append(f"serving held-out gates: {gates_line(serving)}")
    if part in ("all", "diagnosis"):
        from trainpilot.health.corpus import HELD_OUT_GATE, validate

        report = validate()
        right, total = report.accuracy("held_out")
        out["diagnosis"] = dict(report.to_dict(), held_out_gate=HELD_OUT_GATE)
        if total and right / total < HELD_OUT_GATE:
            out["failures"].append(f"diagnosis held-out accuracy {right}/{total} < gate "
                                   f"{HELD_OUT_GATE:.0%}")
    return out


def _print_others(others: dict) -> None:
    if "serving" in others:
        from trainpilot.sim.serve_validation import batches_line, gates_line

        s = others["serving"]
        held, cal = s["held_out"], s["calibration"]
        console.print(
            f"serving (Sim2Infer, `trainpilot simulate serve --validate` for every row): "
            f"held-out mean error {held['mean_abs_error']:.1%} over {held['rows']} rows from "
            f"{held['num_sources']} sources ({batches_line(s)}; gates {gates_line(s)}, "
            f"target {s['target']:.0%}: {'met' if s['target_met'] else 'not met'}); "
            f"calibration "
            f"{cal['mean_abs_error']:.1%} over {cal['rows']} rows")
    if "diagnosis" in others:
        d = others["diagnosis"]["splits"]["held_out"]
        console.print(f"log diagnosis (`trainpilot diagnose --validate` for every log): "
                      f"held-out {d['correct']}/{d['total']} real failure logs right "
                      f"(gate {others['diagnosis']['held_out_gate']:.0%}, target "
                      f"{others['diagnosis']['held_out_target']:.0%})")


def _report_others(others: dict, as_json: bool) -> int:
    if as_json:
        print_json(others)
    else:
        _print_others(others)
        for line in others["failures"]:
            console.print(f"[bold red]FAIL[/] {line}")
        if not others["failures"]:
            console.print("[bold green]PASS[/] every gate holds")
    return EXIT_FAILURE if others["failures"] else 0


def _dump_row(cases, label: str, output: Path | None) -> int:
    import yaml

    from trainpilot.fsio import atomic_write_text
    from trainpilot.perf.estimator import Estimator
    from trainpilot.perf.validation.runner import settle_free
    from trainpilot.specs import SpecError

    found = [c for c in cases if c.label == label]
    if not found:
        raise SpecError("--dump-row", label, "no row has this label; `trainpilot validate "
                        "--json` lists them")
    case = found[0]
    case = settle_free(case, Estimator(case.model, case.cluster, case.options))
    job = dict(name=f"{case.dataset}: {case.label}", model=case.model.to_dict(),
               cluster=case.cluster.to_dict(), plan=case.plan.to_dict())
    head = (f"# {case.dataset} row {case.label!r}: measured {case.measured:g} "
            f"({case.metric}{', ' + case.convention if case.convention else ''})\n")
    text = head + yaml.safe_dump(job, sort_keys=False)
    if output:
        atomic_write_text(output, text)
        console.print(f"wrote {output}")
    else:
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
    return 0


_UNITS = {"step_time_s": "s/step", "tflops_per_gpu": "TFLOP/s/GPU",
          "tokens_per_s_per_gpu": "tok/s/GPU",
          "weights_optimizer_gib": "GiB", "activations_gib": "GiB"}
_LARGE = 40  # tables with more rows print grouped unless --all-rows


def _print_rows(results, all_rows: bool) -> None:
    by_set = defaultdict(list)
    for r in results:
        by_set[r.case.dataset].append(r)
    for dataset, rows in by_set.items():
        if len(rows) > _LARGE and not all_rows:
            _print_grouped(dataset, rows)
            continue
        table = Table(title=f"{dataset} ({rows[0].case.split}): {rows[0].case.source[:90]}",
                      title_justify="left")
        for col in ("row", "kind", "measured", "predicted", "error", "unit"):
            table.add_column(col, justify="left" if col in ("row", "kind", "unit") else "right")
        for r in rows:
            unit = _UNITS[r.case.metric] + (f" ({r.case.convention})" if r.case.convention
                                            else "")
            pred = "refused" if r.predicted is None else f"{r.predicted:.4g}"
            table.add_row(r.case.label, r.case.kind, f"{r.case.measured:.4g}", pred,
                          "" if r.predicted is None else _err(r.error), unit)
        console.print(table)


def _group_key(r) -> tuple:
    p, m = r.case.plan, r.case.model
    return (m.name, r.case.cluster.device.name, p.tp, p.pp, p.micro_batch_size)


def _print_grouped(dataset, rows) -> None:
    groups = defaultdict(list)
    for r in rows:
        groups[_group_key(r)].append(r)
    table = Table(title=f"{dataset}: {len(rows)} rows by (model, device, tp, pp, micro-batch); "
                        "--all-rows prints each", title_justify="left")
    for col in ("model", "device", "tp", "pp", "mb", "rows", "mean |error|", "max |error|",
                "speed bias"):
        table.add_column(col, justify="right" if col not in ("model", "device") else "left")
    for key in sorted(groups, key=str):
        done = [r for r in groups[key] if r.predicted is not None]
        if not done:
            continue
        errs = [r.error for r in done]
        table.add_row(*map(str, key), str(len(errs)), f"{_mean_abs(errs):.1%}",
                      f"{max(map(abs, errs)):.1%}",
                      _err(sum(r.speed_error for r in done) / len(done)))
    console.print(table)
    worst = sorted((r for r in rows if r.predicted is not None), key=lambda r: -abs(r.error))
    table = Table(title=f"{dataset}: the 10 largest errors", title_justify="left")
    for col in ("row", "measured", "predicted", "error"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for r in worst[:10]:
        table.add_row(r.case.label, f"{r.case.measured:.4g}", f"{r.predicted:.4g}",
                      _err(r.error))
    console.print(table)


def _print_summary(summaries, thresholds, gates, *, subset: bool = False) -> None:
    from trainpilot.perf.validation import POOLED, is_pooled
    from trainpilot.perf.validation.runner import batch_gate

    table = Table(title="mean and max |error| per source (held out: dense and MoE apart)",
                  title_justify="left",
                  caption="speed bias: mean of predicted / measured speed - 1 (+: predicted "
                          "faster than measured, optimistic; a step time counts inverted)",
                  caption_justify="left")
    for col in ("dataset", "split", "kind", "rows", "mean", "max", "speed bias", "gate"):
        table.add_column(col, justify="left" if col in ("dataset", "split", "kind") else "right",
                         no_wrap=True)
    for s in summaries:
        if not s.count and not s.refused:
            continue
        kind = s.model_kind if s.kind == "time" else "memory"
        split = {"calibration": "calib.", "development": "dev.", "held_out": "held-out"}[s.split]
        if s.split != "held_out":
            from trainpilot.perf.validation import DATASET_THRESHOLDS

            limit = DATASET_THRESHOLDS.get(s.dataset, thresholds[s.kind])
            gate = f"{limit:.0%} {'ok' if s.mape <= limit else 'FAIL'}"
        elif not subset and s.dataset == POOLED and s.model_kind in gates:
            from trainpilot.perf.validation import TARGETS

            limit = gates[s.model_kind]
            gate = f"{limit:.0%} {'ok' if s.mape <= limit else 'FAIL'}" + \
                (f" (target {TARGETS[s.model_kind]:.0%}: " +
                 ("met)" if s.mape <= TARGETS[s.model_kind] else "not met)"))
        elif not subset and (batch_limit := batch_gate(s)) is not None:
            limit = batch_limit
            gate = f"{limit:.0%} {'ok' if s.mape <= limit else 'FAIL'}"
        else:
            gate = ""
        name = f"[bold]{s.dataset}[/]" if is_pooled(s.dataset) else s.dataset
        rows = f"{s.count}" + (f" (+{s.refused} refused)" if s.refused else "")
        mean = "n/a" if math.isnan(s.mape) else f"{s.mape:.1%}"
        table.add_row(name, split, kind, rows, mean,
                      "n/a" if math.isnan(s.max_ape) else f"{s.max_ape:.1%}",
                      "n/a" if math.isnan(s.bias) else _err(s.bias), gate)
    console.print(table)


def _mean_abs(errs) -> float:
    return sum(map(abs, errs)) / len(errs)


def _err(e: float) -> str:
    return f"{e:+.1%}"
