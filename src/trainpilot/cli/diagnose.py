"""``trainpilot diagnose``: classify failure logs (PyTorch, NCCL, CUDA, driver, launcher)."""

from __future__ import annotations

import argparse

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
                 "  trainpilot diagnose job.err --json\n"
                 "  trainpilot diagnose logs/*.log --store runs/exp1   # record it in the run's "
                 "knowledge base",
    )
    parser.add_argument("logs", nargs="+", metavar="LOGFILE", help="log files of one job")
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

    if args.skew_s < 0:
        raise SpecError("--skew-s", args.skew_s, "valid: seconds >= 0")
    result = Diagnoser(skew_s=args.skew_s).diagnose_files(args.logs)
    history = _record(args.store, result) if args.store else []
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
