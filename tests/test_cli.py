"""The CLI surface is frozen: a new verb or flag is a conscious change to tests/data/cli_surface.txt
(regenerate with TRAINPILOT_UPDATE_SURFACE=1 pytest tests/test_cli.py)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tests.conftest import run_cli
from trainpilot.cli.main import build_parser

SURFACE = Path(__file__).parent / "data" / "cli_surface.txt"


def _walk(parser: argparse.ArgumentParser, prefix: str, lines: list[str]) -> None:
    """One line per (sub-)command with its sorted flags, recursing into sub-commands."""
    flags = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in sorted(action.choices.items()):
                _walk(child, f"{prefix} {name}".strip(), lines)
            continue
        flags.append("/".join(action.option_strings or [action.dest]))
    if prefix:
        lines.append(f"{prefix}: {' '.join(sorted(flags))}")


def surface() -> str:
    lines: list[str] = []
    _walk(build_parser(), "", lines)
    return "\n".join(sorted(lines)) + "\n"


def test_cli_surface_is_frozen():
    current = surface()
    if os.environ.get("TRAINPILOT_UPDATE_SURFACE"):
        SURFACE.parent.mkdir(exist_ok=True)
        SURFACE.write_text(current)
    assert current == SURFACE.read_text(), "CLI changed: update tests/data/cli_surface.txt"


def test_every_verb_has_examples():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for verb, verb_parser in sub.choices.items():
        assert "examples:" in (verb_parser.epilog or ""), verb


def test_demo_prints_the_preset_summary():
    result = run_cli("demo", timeout=600)
    assert result.returncode == 0, result.stderr
    assert "gpt3-175b-a100-1024" in result.stdout
    assert "175.24 B" in result.stdout  # parameters
    assert "1.076e+12" in result.stdout  # model FLOPs per token at s=2048


def test_show_json_for_moe():
    result = run_cli("show", "--model", "mixtral-8x7b", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert round(info["params"] / 1e9, 1) == 46.7
    assert round(info["active_params"] / 1e9, 1) == 12.9


def test_presets_json_lists_every_kind():
    result = run_cli("presets", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert {"model", "device", "cluster", "job"} <= set(data)
    assert any(m["name"] == "deepseek-v3" for m in data["model"])


def test_no_verb_prints_help():
    result = run_cli()
    assert result.returncode == 2
    assert "plans, simulates, runs and watches" in result.stdout
