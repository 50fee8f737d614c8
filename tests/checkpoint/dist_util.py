"""Run a function on N gloo ranks in forked processes (torch is imported once, by pytest),
with a wall-clock deadline and kills by process id. Results come back as JSON files."""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


def rendezvous(folder: Path, name: str = "group") -> str:
    """A file for one process group's rendezvous (one per group: a file store is not reusable).
    A file, not a TCP port: a port picked free and bound later can be taken in between (CI saw
    EADDRINUSE when a test rebuilt its group on a port reserved minutes before)."""
    path = Path(folder) / f"{name}.rendezvous"
    assert not path.exists(), f"rendezvous file {path} already used"
    return str(path)


def init_gloo(rank: int, world_size: int, rendezvous_file: str, *,
              timeout_s: float = 60) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous_file}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))


def _entry(fn: Callable, rank: int, out: Path, args: tuple, hang_dump_s: float,
           label: str) -> None:
    # If this rank hangs, leave its stacks behind for the failure message.
    dump = open(out / f"{label}.stacks", "w")
    faulthandler.dump_traceback_later(hang_dump_s, file=dump)
    try:
        result = fn(rank, *args)
        (out / f"{label}.json").write_text(json.dumps(result, default=str))
        code = 0
    except BaseException:  # noqa: BLE001 (report anything, then exit hard)
        (out / f"{label}.error").write_text(traceback.format_exc())
        code = 1
    os._exit(code)  # skip atexit/teardown that could hang on a half-dead group


def start(fn: Callable, rank: int, out: Path, *args: Any, hang_dump_s: float = 100,
          label: str | None = None) -> multiprocessing.Process:
    """Fork a process running ``fn(rank, *args)``; its result lands in ``out/<label>.json``."""
    proc = multiprocessing.get_context("fork").Process(
        target=_entry, args=(fn, rank, out, args, hang_dump_s, label or f"rank{rank}"))
    proc.start()
    return proc


def join_all(procs: list[multiprocessing.Process], deadline_s: float) -> list[int | None]:
    """Wait for every process until the deadline, then SIGKILL the stragglers by pid."""
    end = time.monotonic() + deadline_s
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)
    return [proc.exitcode for proc in procs]


def results(out: Path, labels: list[str]) -> dict[str, Any]:
    """Each process's JSON result by label; fails showing every error, and the stacks of
    every process that left no result (killed at the deadline or hung)."""
    errors = {p.name: p.read_text() for p in out.glob("*.error")}
    for label in labels:
        if not (out / f"{label}.json").exists():
            errors[f"{label} stacks"] = (out / f"{label}.stacks").read_text()[-3000:]
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
    return {label: json.loads((out / f"{label}.json").read_text()) for label in labels}
