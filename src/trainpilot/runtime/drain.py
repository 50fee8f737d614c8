"""Draining a host: the job moves off it at a step boundary, losing no step.

``trainpilot drain RUN_DIR --host H`` writes ``RUN_DIR/drain.json``. Rank 0 looks for it at
most once a second; the request rides in the step's statistics all-reduce, so every rank learns
of it after the same step. Every rank then saves that step (memory, the node's memory folder,
storage) and waits until it is durable; the ranks on ``H`` exit 0 and their launcher leaves the
job without closing the rendezvous; the others exit 1, so that their torchrun agents re-form the
job with a standby (``--nnodes`` with one launcher more, waiting) or with fewer nodes
(``--nnodes MIN:MAX``). The re-formed job restores the drained step from memory: the drained
ranks' copies are held by their ring peers on the other hosts. The request is then renamed
``drained.json`` (with the step), so the next attempt does not drain again.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trainpilot.fsio import atomic_write_text

REQUEST = "drain.json"
DONE = "drained.json"
EXIT_DRAINED_PEER = 1  # a rank that stays: its agent must re-form the job


def request_drain(run_dir: Path, host: str, *, reason: str = "operator") -> dict[str, Any]:
    body = dict(host=host, reason=reason, requested_unix_s=time.time())
    atomic_write_text(Path(run_dir) / REQUEST, json.dumps(body) + "\n")
    return body


def read_request(run_dir: Path) -> dict[str, Any] | None:
    try:
        body = json.loads((Path(run_dir) / REQUEST).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and body.get("host") else None


def mark_done(run_dir: Path, request: dict[str, Any], *, step: int, ranks: list[int]) -> None:
    """Rank 0, once the drained step is durable: the request becomes a record."""
    body = dict(request, step=step, drained_ranks=ranks, done_unix_s=time.time())
    atomic_write_text(Path(run_dir) / DONE, json.dumps(body) + "\n")
    try:
        os.unlink(Path(run_dir) / REQUEST)
    except FileNotFoundError:
        pass


class DrainWatch:
    """Rank 0's look for a request: a ``stat`` at most every ``interval_s``."""

    def __init__(self, run_dir: Path, *, interval_s: float = 1.0):
        self.path = Path(run_dir) / REQUEST
        self.interval_s = interval_s
        self._next = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.interval_s
        return self.path.exists()
