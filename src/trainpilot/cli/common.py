"""Helpers shared by the CLI verbs: document arguments, output, exit codes."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2

def _width() -> int | None:
    """Rich wraps at 80 columns when stdout is not a terminal (CI logs, `| less`); tables of
    breakdowns need more. A real terminal or $COLUMNS still decides when present."""
    import os

    if os.environ.get("COLUMNS") or sys.stdout.isatty():
        return None
    return 150


console = Console(highlight=False, width=_width())
err_console = Console(stderr=True, highlight=False)


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples in each verb's epilog as written."""


def add_verb(subparsers: Any, name: str, *, help: str, description: str, examples: str,
             ) -> argparse.ArgumentParser:
    """A sub-command with a description and an examples epilog (shown by --help)."""
    return subparsers.add_parser(
        name, help=help, description=description, epilog="examples:\n" + examples.rstrip(),
        formatter_class=Formatter,
    )


def add_doc_args(parser: argparse.ArgumentParser, *, model: bool = True, cluster: bool = True,
                 plan: bool = True, required: bool = True) -> None:
    """--model/--cluster/--plan: each a preset name or a file (plans also inline)."""
    if model:
        parser.add_argument("--model", required=required,
                            help="model preset, YAML/JSON file, or Hugging Face config.json")
    if cluster:
        parser.add_argument("--cluster", required=required,
                            help="cluster preset (e.g. a100-80gb-x1024, selene) or YAML/JSON file")
    if plan:
        parser.add_argument("--plan", required=required,
                            help="plan YAML/JSON file or inline 'tp=8,pp=16,dp=8,...'")


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def human(value: float, unit: str = "") -> str:
    """1.75e11 -> '175.0 B' style (K, M, B, T) for counts."""
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f} {suffix}{unit}"
    return f"{value:.0f} {unit}".rstrip()
