"""``trainpilot diagnose``: classify failure logs (PyTorch, NCCL, CUDA, driver, launcher)."""

from __future__ import annotations

import argparse
import sys

from rich.table import Table

from trainpilot.cli.common import add_json_arg, add_verb, console, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "diagnose", help="find the root cause of a failed run in its logs",
        description="Read the logs of a failed job (one per rank or host, plus kernel logs such "
                    "as `dmesg -T`) and name one category, the evidence line, the likely root "
                    "cause and an action. A hardware cause outranks the NCCL timeouts it "
                    "produces; across ranks the first failure in time wins. Categories: "
                    "device_oom, host_oom, gpu_hardware, gpu_memory_ecc, network, "
                    "collective_timeout, hang, rendezvous, collective_mismatch, numerical, "
                    "storage, dataloader, user_code, straggler, unknown.",
        examples="  trainpilot diagnose logs/rank*.log /var/log/kern.log\n"
                 "  trainpilot diagnose job.err.gz --json          # gzip/zstd/bzip2/xz too\n"
                 "  trainpilot diagnose logs/*.log --store runs/exp1   # record it in the run's "
                 "knowledge base\n"
                 "  trainpilot diagnose --validate                 # accuracy on the shipped "
                 "real logs",
    )
    parser.add_argument("logs", nargs="*", metavar="LOGFILE",
                        help="log files of one job (plain, gzip, zstd, bzip2 or xz)")
    parser.add_argument("--validate", action="store_true",
                        help="diagnose the shipped corpus of real failure logs from public issue "
                             "threads and print the accuracy per split (authoring / held out) "
                             "and category; exits 1 below the held-out target")
    parser.add_argument("--store", metavar="RUN_DIR",
                        help="record the diagnosis in this run's store and show what earlier "
                             "runs beside it did about the same category")
    parser.add_argument("--skew-s", type=float, default=60.0,
                        help="seconds within which failures on different hosts count as "
                             "simultaneous (clock skew); default 60")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainpilot.health.diagnosis import Diagnoser
    from trainpilot.specs.errors import SpecError

    if not args.skew_s >= 0:
        raise SpecError("--skew-s", args.skew_s, "valid: seconds >= 0")
    if args.validate:
        if args.logs or args.store:
            raise SpecError("--validate", True, "valid: alone (it reads the shipped corpus, not "
                            "LOGFILE or --store)")
        return _validate(args)
    if not args.logs:
        raise SpecError("LOGFILE", None, "valid: one or more log files (or --validate)")
    if args.store:
        _check_store(args.store)
    result = Diagnoser(skew_s=args.skew_s).diagnose_files(args.logs)
    history = _record(args.store, result) if args.store else []
    for warning in result.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.json:
        print_json(result.to_dict())
        return 0
    table = Table(show_header=False, title="diagnosis", title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in result.to_dict().items():
        table.add_row(key, str(value))
    for exp in history:
        table.add_row("seen before", f"{exp.action}: {exp.num_recovered}/{exp.num_tried} "
                                     f"recovered over {exp.num_runs} run(s)")
    console.print(table)
    return 0


def _check_store(run_dir: str) -> None:
    """--store names an existing run (a typo must not create a new, empty store)."""
    from trainpilot.store import RunStore

    RunStore.open_readonly(run_dir).close()


def _validate(args: argparse.Namespace) -> int:
    from trainpilot.health.corpus import HELD_OUT_TARGET, validate

    report = validate()
    held, total = report.accuracy("held_out")
    ok = total > 0 and held / total >= HELD_OUT_TARGET
    if args.json:
        print_json(report.to_dict())
        return 0 if ok else 1
    table = Table(title="diagnosis accuracy on real failure logs (public issue threads)",
                  title_justify="left")
    for col in ("category", "authoring", "held out"):
        table.add_column(col, justify="right" if col != "category" else "left")
    authoring, held_out = report.by_category("authoring"), report.by_category("held_out")
    for cat in sorted(set(authoring) | set(held_out)):
        cells = []
        for part in (authoring, held_out):
            a, b = part.get(cat, (0, 0))
            cells.append(f"{a}/{b}" if b else "-")
        table.add_row(cat, *cells)
    a, b = report.accuracy("authoring")
    table.add_row("all", f"{a}/{b} ({100 * a / max(b, 1):.0f}%)",
                  f"{held}/{total} ({100 * held / max(total, 1):.0f}%)", style="bold")
    console.print(table)
    for batch in report.batches():
        a, b = report.accuracy("held_out", batch=batch)
        console.print(f"held out, batch {batch}: {a}/{b} ({100 * a / max(b, 1):.0f}%)",
                      markup=False)
    for o in report.outcomes:
        if not o.correct:
            console.print(f"miss ({o.case.split}, batch {o.case.batch}) {o.case.id}: "
                          f"expected {o.case.category}, got {o.got}  {o.case.url}",
                          markup=False, soft_wrap=True)
    console.print(f"held-out target {100 * HELD_OUT_TARGET:.0f}%: "
                  f"{'met' if ok else 'NOT met'}", markup=False)
    return 0 if ok else 1


def _record(run_dir: str, result) -> list:
    from pathlib import Path

    from trainpilot.store import RunStore, consult

    history = consult(Path(run_dir).resolve().parent, result.category)
    store = RunStore.append(run_dir)
    try:
        store.log_event("diagnosis", None, result.to_dict(), severity="critical",
                        name=result.category, message=result.root_cause[:200])
        store.log_knowledge(result.category, result.action, "diagnosed",
                            evidence=result.evidence, payload=result.to_dict())
    finally:
        store.close()
    return history
