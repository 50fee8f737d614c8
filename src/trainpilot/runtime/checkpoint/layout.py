"""The checkpoint folder: names, the manifest (commit marker), ``latest``, verification,
retention and garbage collection.

```
root/
  step_0000000010/          one folder per checkpoint
    data_r0_0.bin ...       raw (or zstd) tensor bytes written by rank 0, rolled over by size
    manifest.json           written last (tmp, fsync, rename): the checkpoint exists iff it does
  latest                    name of the newest committed folder, moved only after the commit
  abandoned/                checkpoints of a timeline a restore rolled back from (kept, inert)
```

A manifest lists every file the checkpoint needs, with its size and SHA-256, including files
in older folders that an incremental checkpoint references. Its body carries its own SHA-256,
so a flipped bit in the manifest is detected too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainpilot.fsio import atomic_write_text

FORMAT = "trainpilot-checkpoint/1"
MANIFEST = "manifest.json"
LATEST = "latest"
ABANDONED = "abandoned"
_STEP_DIR = re.compile(r"^step_(\d{10})$")
_HASH_CHUNK_BYTES = 8 << 20


class CorruptCheckpoint(Exception):
    """A checkpoint folder failed verification; ``reason`` says how."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason
        super().__init__(f"{name}: {reason}")


def step_dir_name(step: int) -> str:
    return f"step_{step:010d}"


def parse_step(name: str) -> int | None:
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def step_dirs(root: Path) -> list[tuple[int, str]]:
    """Every ``step_*`` folder, committed or not, newest first."""
    if not root.is_dir():
        return []
    found = [(parse_step(p.name), p.name) for p in root.iterdir() if p.is_dir()]
    return sorted(((s, n) for s, n in found if s is not None), reverse=True)


def committed(root: Path) -> list[tuple[int, str]]:
    """Folders whose manifest exists (not yet verified), newest first."""
    return [(s, n) for s, n in step_dirs(root) if (root / n / MANIFEST).is_file()]


def write_manifest(step_dir: Path, body: dict[str, Any]) -> None:
    """Commit a checkpoint: the manifest, with the SHA-256 of its body, atomically."""
    body_text = json.dumps(body, sort_keys=True, allow_nan=False)
    text = json.dumps({"format": FORMAT, "body_sha256": _sha(body_text.encode()),
                       "body": body_text})
    atomic_write_text(step_dir / MANIFEST, text)


def read_manifest(root: Path, name: str) -> dict[str, Any]:
    """The manifest body of ``root/name``; raises :class:`CorruptCheckpoint` if unreadable."""
    path = root / name / MANIFEST
    try:
        outer = json.loads(path.read_text())
        body_text = outer["body"]
        if outer.get("format") != FORMAT:
            raise CorruptCheckpoint(name, f"unknown format {outer.get('format')!r}")
        if _sha(body_text.encode()) != outer["body_sha256"]:
            raise CorruptCheckpoint(name, "manifest checksum mismatch")
        return json.loads(body_text)
    except FileNotFoundError:
        raise CorruptCheckpoint(name, "no manifest (never committed)") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CorruptCheckpoint(name, f"unreadable manifest: {err}") from None


def verify_files(root: Path, files: dict[str, dict[str, Any]], names: Iterable[str]) -> list[str]:
    """Check size and SHA-256 of ``names`` (paths relative to root); returns the problems."""
    problems = []
    for rel in names:
        expected = files[rel]
        path = root / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{rel}: missing")
            continue
        if size != expected["bytes"]:
            problems.append(f"{rel}: {size} bytes, manifest says {expected['bytes']}")
            continue
        if file_sha256(path) != expected["sha256"]:
            problems.append(f"{rel}: checksum mismatch")
    return problems


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_latest(root: Path, name: str) -> None:
    atomic_write_text(root / LATEST, name + "\n")


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


def referenced_dirs(root: Path, name: str) -> set[str]:
    """Folders whose files the checkpoint ``name`` needs (itself included)."""
    try:
        body = read_manifest(root, name)
    except CorruptCheckpoint:
        return {name}
    return {rel.split("/", 1)[0] for rel in body["files"]} | {name}


def apply_retention(root: Path, *, keep_last: int, keep_every: int | None) -> list[str]:
    """Delete committed checkpoints outside the policy; returns the folders removed.

    Kept: the newest ``keep_last``, and every one whose step is a multiple of ``keep_every``
    (Orbax's ``keep_period``). A folder that a kept checkpoint references is never deleted.
    """
    done = committed(root)
    keep = {n for _, n in done[:keep_last]}
    if keep_every:
        keep |= {n for s, n in done if s % keep_every == 0}
    needed = set().union(*(referenced_dirs(root, n) for n in keep)) if keep else set()
    removed = []
    for _, name in done:
        if name not in needed:
            _remove_checkpoint(root / name)
            removed.append(name)
    return removed


def remove_uncommitted(root: Path) -> list[str]:
    """Delete folders without a manifest (torn by a crash or a failed write), except those
    whose files a committed checkpoint still needs (a base that lost its own manifest)."""
    torn = [name for _, name in step_dirs(root) if not (root / name / MANIFEST).exists()]
    if not torn:
        return []
    needed = _committed_needs(root)
    for name in torn:
        if name not in needed:
            shutil.rmtree(root / name, ignore_errors=True)
    return [n for n in torn if n not in needed]


def remove_torn(root: Path, name: str) -> bool:
    """Delete the folder ``name`` if it is torn (no manifest) and no committed checkpoint
    references its files; True if it was deleted."""
    path = root / name
    if not path.is_dir() or (path / MANIFEST).exists() or name in _committed_needs(root):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _committed_needs(root: Path) -> set[str]:
    """Folders whose files some committed checkpoint needs."""
    return set().union(*(referenced_dirs(root, n) for _, n in committed(root)))


def _remove_checkpoint(path: Path) -> None:
    # Manifest first: a crash half-way through leaves an uncommitted folder, never a torn
    # checkpoint that still claims to be complete.
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def set_aside_from(root: Path, step: int) -> list[str]:
    """Before a save at ``step``: folders at or after it belong to an abandoned timeline (the
    run was restored to an earlier step) and must never be restored later. Committed ones are
    moved to ``root/abandoned/`` (kept for forensics, never deleted by us); torn ones deleted."""
    moved = []
    for s, name in step_dirs(root):
        if s < step:
            continue
        if (root / name / MANIFEST).exists():
            target = root / ABANDONED / f"{name}-{time.time_ns()}"
            target.parent.mkdir(exist_ok=True)
            os.replace(root / name, target)
            moved.append(name)
    remove_uncommitted(root)  # the torn ones, the newer ones now included
    return moved
