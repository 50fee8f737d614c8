"""Entry point: ``trainpilot <verb> ...``. Exit codes: 0 ok, 1 failure, 2 bad input."""

from __future__ import annotations

import argparse
import importlib
import sys

from trainpilot import __version__
from trainpilot.cli.common import EXIT_BAD_INPUT, Formatter, err_console
from trainpilot.specs.errors import SpecError

# Each verb lives in its own module under trainpilot.cli with a `register(subparsers)`
# function; heavy imports (torch) happen inside the verb, so `--help` stays fast.
VERBS = [
    "demo",
    "presets",
    "show",
    "simulate",
    "diagnose",
    "monitor",
    "train",
    "drain",
    "dashboard",
    "report",
    "predict",
    "plan",
    "validate",
    "export-weights",
    "export-metrics",
]

DESCRIPTION = """\
trainpilot plans, simulates, runs and watches large-model training on PyTorch.

Documents: --model (what), --cluster (where), --plan (how). Each takes a preset name or a
YAML/JSON file; a plan may also be inline ('tp=8,pp=16,dp=8,global_batch_size=1536,seq_len=2048').
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainpilot", description=DESCRIPTION, formatter_class=Formatter,
        epilog="examples:\n  trainpilot demo\n  trainpilot presets\n"
               "  trainpilot show --job gpt3-175b-a100-1024",
    )
    parser.add_argument("--version", action="version", version=f"trainpilot {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="<verb>")
    for verb in VERBS:
        importlib.import_module(f"trainpilot.cli.{verb.replace('-', '_')}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return int(args.func(args) or 0)
    except SpecError as err:
        # Bad input: one line naming the field, the value and what is valid; no traceback.
        err_console.print(f"[bold red]error:[/] {err}", soft_wrap=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


def run() -> None:
    code = main()
    if "torch" in sys.modules:
        # Leave without the interpreter's teardown of torch (1-1.5 s of every `train`): the
        # same exit otherwise (threads joined, atexit handlers run, streams flushed).
        from trainpilot.runtime.procexit import end_process

        end_process(code or 0)
    sys.exit(code)


if __name__ == "__main__":
    run()
