"""Run the ranks of a small job as local processes around a TCPStore this process hosts.

For multi-process tests and benchmarks on one machine, where each rank is a command line (a
worker module or script) rather than a function: :class:`trainpilot.runtime.elastic.local.
LocalSupervisor` forks functions and replaces dead ranks; torchrun runs training jobs. This is
the plain case: start every rank, wait, collect exit codes and output, never leave one behind.

Why it is built this way:
- The rendezvous TCPStore is bound to port 0 by this process and held open until every rank has
  exited, so the port is free by construction (no pick-then-bind race) and ranks connect to it
  as clients (``is_master=False``).
- Each rank starts in its own session, so ``os.killpg(pid)`` kills that rank and whatever it
  started, and nothing else.
- A wall-clock deadline kills ranks still running: a process-group timeout does not end a hook
  deadlock or a hung restart, a kill does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainpilot.specs.errors import SpecError


@dataclass(frozen=True, kw_only=True)
class LocalRanksResult:
    """How each rank ended. ``returncodes[r]`` is rank r's exit status (negative: the signal
    that ended it, e.g. -9 for the deadline's SIGKILL); ``timed_out`` lists the ranks still
    running at the deadline (and killed); ``outputs[r]`` is rank r's stdout and stderr when logs
    were asked for, else None."""

    returncodes: list[int]
    timed_out: list[int]
    outputs: list[str] | None

    @property
    def ok(self) -> bool:
        """Every rank exited with status 0 before the deadline."""
        return not self.timed_out and not any(self.returncodes)

    def describe(self, *, tail_chars: int = 3000) -> str:
        """One paragraph per rank (exit status, last ``tail_chars`` of its output) for a failure
        message."""
        outputs = self.outputs or [""] * len(self.returncodes)
        return "\n".join(f"--- rank {r} (exit {c}) ---\n{o[-tail_chars:]}"
                         for r, (c, o) in enumerate(zip(self.returncodes, outputs)))


def run_local_ranks(command: Callable[[int, int], Sequence[str]], world_size: int, *,
                    timeout_s: float, env: Mapping[str, str] | None = None,
                    cwd: str | os.PathLike | None = None,
                    logs: Sequence[str | os.PathLike] | None = None) -> LocalRanksResult:
    """Start ``command(rank, store_port)`` for every rank in ``range(world_size)``, each in its
    own session, and wait until all exit or ``timeout_s`` seconds (wall clock, counted from
    when the last rank started) pass; ranks still running then are killed (SIGKILL to their
    process group).

    The ranks' environment is this process's, with ``OMP_NUM_THREADS=1`` (ranks share the cores),
    updated with ``env``. ``logs``: a file per rank that receives its stdout and stderr (and is
    read back into ``outputs``); without it the ranks write to this process's streams. On return
    (or any exception, Ctrl-C included) no rank is left running and the store is closed.
    """
    if world_size < 1:
        raise SpecError("world_size", world_size, "valid: an integer >= 1")
    if not timeout_s > 0:
        raise SpecError("timeout_s", timeout_s, "valid: seconds > 0")
    if logs is not None and len(logs) != world_size:
        raise SpecError("logs", len(logs), f"valid: one path per rank ({world_size})")
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs: list[subprocess.Popen] = []
    files = []
    try:
        for rank in range(world_size):
            out = None
            if logs is not None:
                out = open(Path(logs[rank]), "w+")
                files.append(out)
            procs.append(subprocess.Popen(
                list(command(rank, store.port)), cwd=cwd, env=full_env, stdout=out,
                stderr=subprocess.STDOUT if out is not None else None, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        try:
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    finally:
        timed_out = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: this rank only
                except ProcessLookupError:
                    pass  # it exited between the poll and the kill
                proc.wait()
        del store
        outputs = []
        for f in files:
            f.seek(0)
            outputs.append(f.read())
            f.close()
    return LocalRanksResult(returncodes=[p.returncode for p in procs], timed_out=timed_out,
                            outputs=outputs if logs is not None else None)
