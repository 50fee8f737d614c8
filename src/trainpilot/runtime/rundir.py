"""The run directory before a launch: is it usable, does it hold a run, and where does the
same command resume from.

Resume is the default (``--resume auto``): the same command on an existing run directory
continues from its newest valid checkpoint. ``--resume <step>`` continues from that checkpoint
(newer ones are set aside: they belong to a timeline the user chose to leave). ``--resume
never`` starts over, after moving the previous run into ``RUN_DIR/previous/<time>/`` (nothing
is deleted). A run whose checkpoints are all invalid, or whose documents changed in a way that
makes its checkpoints another job's, stops with one line saying so (exit 2).

The launcher checks what it can cheaply (the manifest of every checkpoint, each file's
size); the workers verify every checksum when they restore, and a worker that finds no valid
checkpoint where there were some stops the run with the same kind of message.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainpilot.runtime.checkpoint import layout
from trainpilot.specs import SpecError

# Files and folders that make a directory "a run" (written by the launcher or rank 0).
RUN_MARKERS = ("job.json", "metrics.jsonl", "summary.json", "trainpilot.db", "model.yaml")
PREVIOUS = "previous"
PREEMPTED = "preempted.json"

# Documents whose change makes the saved checkpoints another job's. Everything else (faults,
# recovery, health, checkpoint cadence, world size: DCP reshards) may change on resume.
FROZEN_PLAN = ("global_batch_size", "seq_len", "precision", "tp", "pp", "vp", "ep", "cp")
FROZEN_CONFIG = ("steps", "lr", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1",
                 "beta2", "grad_clip", "seed", "deterministic", "data", "data_dtype",
                 "data_num_samples", "data_concentration", "shuffle", "autocast",
                 "data_tokenizer", "data_text_field", "data_eos_id")


def check_usable(run_dir: Path) -> None:
    """SpecError (one line) unless ``run_dir`` is, or can become, a writable folder. Creates
    nothing."""
    if run_dir.exists() and not run_dir.is_dir():
        raise SpecError("--run-dir", str(run_dir), "is a file; valid: a folder (new or a run's)")
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise SpecError("--run-dir", str(run_dir), f"{existing} is a file; valid: a folder path")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write-test-"):
            pass
    except OSError as err:
        raise SpecError("--run-dir", str(run_dir), f"{existing} is not writable "
                        f"({err.strerror}); valid: a folder this user can write") from None


@dataclass(kw_only=True)
class CheckpointInfo:
    step: int
    name: str
    problem: str = ""  # empty: the manifest reads and every file has its size


@dataclass(kw_only=True)
class RunState:
    """What an existing run directory holds."""

    run_dir: Path
    has_run: bool
    job: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    checkpoints: list[CheckpointInfo] = field(default_factory=list)  # newest first
    torn: list[str] = field(default_factory=list)  # step folders without a manifest
    latest: str | None = None  # what ``checkpoints/latest`` names

    @property
    def valid(self) -> list[CheckpointInfo]:
        return [c for c in self.checkpoints if not c.problem]


def inspect(run_dir: Path, checkpoint_dir: Path | None = None) -> RunState:
    """Read what ``run_dir`` holds without changing anything."""
    ckpt_root = checkpoint_dir or run_dir / "checkpoints"
    has_run = run_dir.is_dir() and (any((run_dir / m).exists() for m in RUN_MARKERS)
                                    or bool(layout.step_dirs(ckpt_root)))
    state = RunState(run_dir=run_dir, has_run=has_run)
    if not has_run:
        return state
    state.job = _read_json(run_dir / "job.json")
    state.summary = _read_json(run_dir / "summary.json")
    for step, name in layout.step_dirs(ckpt_root):
        if not (ckpt_root / name / layout.MANIFEST).is_file():
            state.torn.append(name)
            continue
        state.checkpoints.append(CheckpointInfo(step=step, name=name,
                                                problem=_structural_problem(ckpt_root, name)))
    state.latest = layout.read_latest(ckpt_root)
    return state


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _structural_problem(root: Path, name: str) -> str:
    """The first reason ``name`` cannot be restored that needs no checksum: an unreadable
    manifest, a missing file or a file of the wrong size."""
    try:
        body = layout.read_manifest(root, name)
    except layout.CorruptCheckpoint as err:
        return err.reason
    for rel, expected in sorted(body.get("files", {}).items()):
        try:
            size = (root / rel).stat().st_size
        except FileNotFoundError:
            return f"{rel}: missing"
        if size != expected.get("bytes"):
            return f"{rel}: {size} bytes, the manifest says {expected.get('bytes')}"
    return ""


@dataclass(kw_only=True)
class ResumeDecision:
    """Where the launch starts: ``step`` 0 is a fresh start. ``notes`` are lines to print."""

    fresh: bool
    complete: bool = False  # the run already did all its steps: nothing to launch
    resume_step: int | None = None  # restore at or before this step (None: the newest)
    checkpoint: str | None = None
    notes: list[str] = field(default_factory=list)
    set_aside: list[str] = field(default_factory=list)  # newer checkpoints moved away
    previous_dir: Path | None = None  # where --resume never moved the old run


def decide(state: RunState, mode: str, job: dict[str, Any], *,
           checkpoint_dir: Path | None = None) -> ResumeDecision:
    """Apply ``--resume MODE`` (``auto``, ``never`` or a step) to ``state``; may move files
    (``never``: the old run; ``<step>``: newer checkpoints). SpecError for bad input."""
    if not state.has_run:
        return ResumeDecision(fresh=True)
    if mode == "never":
        previous = _move_previous(state.run_dir)
        return ResumeDecision(fresh=True, previous_dir=previous,
                              notes=[f"--resume never: the previous run was moved to {previous}"])
    if state.job is not None:
        check_same_job(state.job, job)
    notes = _notes(state)
    if mode == "auto":
        if state.checkpoints and not state.valid:
            raise SpecError("--resume", "auto", _all_invalid(state))
        done = (state.summary or {}).get("steps")
        if done is not None and done >= job["config"]["steps"] and not state.torn:
            notes.append(f"the run is complete ({done} of {job['config']['steps']} steps)")
            return ResumeDecision(fresh=False, complete=True, notes=notes)
        if not state.valid:
            notes.append("no checkpoint yet: starting again from step 0")
            return ResumeDecision(fresh=False, notes=notes)
        newest = state.valid[0]
        notes.append(f"resuming from step {newest.step} ({_where(state, newest)})")
        return ResumeDecision(fresh=False, checkpoint=newest.name, notes=notes)
    try:
        step = int(mode)
    except ValueError:
        raise SpecError("--resume", mode, "valid: auto, never, or a checkpoint step") from None
    match = [c for c in state.checkpoints if c.step == step]
    if not match:
        have = ", ".join(str(c.step) for c in state.valid) or "none"
        raise SpecError("--resume", mode, f"no checkpoint at step {step}; valid: {have}")
    if match[0].problem:
        raise SpecError("--resume", mode, f"checkpoint {match[0].name} is invalid: "
                        f"{match[0].problem}")
    moved = _set_aside_after(state, step, checkpoint_dir)
    if moved:
        notes.append(f"set aside {len(moved)} newer checkpoint(s) into checkpoints/"
                     f"{layout.ABANDONED}/: {', '.join(moved)}")
    notes.append(f"resuming from step {step} ({_where(state, match[0])})")
    return ResumeDecision(fresh=False, resume_step=step, checkpoint=match[0].name, notes=notes,
                          set_aside=moved)


def _where(state: RunState, info: CheckpointInfo) -> str:
    return f"checkpoints/{info.name}"


def _notes(state: RunState) -> list[str]:
    notes = []
    for name in state.torn:
        notes.append(f"checkpoints/{name} has no manifest (a write cut short, or the manifest "
                     "was deleted): skipped")
    for info in state.checkpoints:
        if info.problem:
            notes.append(f"checkpoints/{info.name} is invalid ({info.problem}): skipped")
    names = {c.name for c in state.valid}
    if state.latest is not None and state.latest not in names:
        best = state.valid[0].name if state.valid else "none"
        notes.append(f"checkpoints/latest names {state.latest!r}, not a valid checkpoint: "
                     f"ignored (newest valid: {best})")
    return notes


def _all_invalid(state: RunState) -> str:
    first = state.checkpoints[0]
    return (f"all {len(state.checkpoints)} checkpoint(s) in {state.run_dir / 'checkpoints'} are "
            f"invalid (newest: {first.name}: {first.problem}); valid: fix or restore them, or "
            "--resume never to start over (the old run is moved to previous/)")


def _set_aside_after(state: RunState, step: int, checkpoint_dir: Path | None) -> list[str]:
    root = checkpoint_dir or state.run_dir / "checkpoints"
    return layout.set_aside_from(root, step + 1)


def _move_previous(run_dir: Path) -> Path:
    """Move everything in ``run_dir`` except earlier ``previous/`` runs into
    ``previous/<timestamp>/``; returns that folder."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    target = run_dir / PREVIOUS / stamp
    target.mkdir(parents=True)
    for entry in run_dir.iterdir():
        if entry.name == PREVIOUS or entry.name.startswith(".write-test-"):
            continue
        shutil.move(str(entry), target / entry.name)
    return target


def check_same_job(saved: dict[str, Any], new: dict[str, Any]) -> None:
    """SpecError naming the first field that makes ``new`` a different job from ``saved``
    (the model, or a plan/config value that changes what the checkpoints mean)."""
    diffs = _diff(saved.get("model", {}), new.get("model", {}), "model")
    diffs += _diff(saved.get("hf_config"), new.get("hf_config"), "hf_config")
    for key in FROZEN_PLAN:
        if saved.get("plan", {}).get(key) != new.get("plan", {}).get(key):
            diffs.append((f"plan.{key}", saved.get("plan", {}).get(key),
                          new.get("plan", {}).get(key)))
    for key in FROZEN_CONFIG:
        if saved.get("config", {}).get(key) != new.get("config", {}).get(key):
            diffs.append((f"config.{key}", saved.get("config", {}).get(key),
                          new.get("config", {}).get(key)))
    if diffs:
        name, old, value = diffs[0]
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        raise SpecError(name, value, f"the run in this --run-dir was started with {old!r}{more}; "
                        "valid: the same value to resume it, --resume never to start over, or "
                        "another --run-dir")


def _diff(old: Any, new: Any, prefix: str) -> list[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            out += _diff(old.get(key), new.get(key), f"{prefix}.{key}")
        return out
    return [] if old == new else [(prefix, old, new)]


def clear_preempted(run_dir: Path) -> dict[str, Any] | None:
    """Forget a previous preemption marker (the run resumes); returns what it said."""
    path = run_dir / PREEMPTED
    data = _read_json(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return data
