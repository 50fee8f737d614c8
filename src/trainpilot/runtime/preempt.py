"""Preemption: a signal (SIGTERM by default, the notice every scheduler sends) asks for a
last-moment checkpoint and a clean exit.

A rank that receives one of the configured signals marks it; the mark rides in the step's
statistics all-reduce, so every rank learns of it at the same step (whichever rank was
signalled), saves that step to storage, and exits 0; rank 0 writes ``RUN_DIR/preempted.json``
and the launcher exits ``128 + signal`` (143 for SIGTERM), the code of a process ended by that
signal. The next start resumes from that step: no step is lost.

The same signal also reaches healthy-looking workers when torchrun's agent restarts a group
after one rank died. They never get as far as a checkpoint (their next collective fails: the
peer is gone), and a worker whose run is failing or recovering leaves at once. A deadline
(``deadline_s``) bounds the whole: past it the worker exits with ``128 + signal`` whatever it
is doing, before torchrun's agent would kill it (30 s after forwarding the signal).

The signal is seen by a thread, not only by Python's handler (which runs on the main thread
only between bytecodes, so not while it waits inside a collective): ``signal.set_wakeup_fd``
makes the C-level handler write the signal number to a pipe that the thread reads at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class Preempted(Exception):
    """Raised instead of a recovery when the run is being stopped by a signal."""


class PreemptGuard:
    """Watches the configured signals for one worker (install on the main thread).

    ``on_exit(code, reason, message)`` is called just before a forced exit (the deadline, or
    a signal during a failure): the worker records why it left."""

    def __init__(self, signals: list[str], *, deadline_s: float = 20.0,
                 on_exit: Callable[[int, str, str], None] | None = None):
        self.signums = [getattr(signal, f"SIG{name}") for name in signals]
        self.deadline_s, self.on_exit = deadline_s, on_exit
        self.signum: int | None = None
        self.received_at: float | None = None
        self.failing = False  # a failure or recovery is in progress: leave at once
        self.finishing = False  # the last checkpoint is being written: let it finish
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._watch, name="tp-preempt", daemon=True)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGTERM)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def install(self) -> PreemptGuard:
        for signum in self.signums:
            self._previous[signum] = signal.signal(signum, self._handler)
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread.start()
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        self._mark(signum)

    def _mark(self, signum: int) -> None:
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read, 16)
            except OSError:
                return
            wanted = [b for b in data if b in self.signums]
            if not wanted:
                continue
            self._mark(wanted[0])
            self._wait_out()

    def _wait_out(self) -> None:
        """After the signal: leave at once if the run is failing, else give the loop until
        the deadline to save and exit."""
        deadline = (self.received_at or time.monotonic()) + self.deadline_s
        while time.monotonic() < deadline:
            if self.failing and not self.finishing:
                self._leave("terminated", f"{self.signal_name} during a failure or recovery: "
                            "left at once (torchrun restarts the group)")
            time.sleep(0.05)
        self._leave("preempt_deadline", f"{self.signal_name}: the last checkpoint did not finish "
                    f"within {self.deadline_s:g} s; the newest earlier checkpoint stands")

    def _leave(self, reason: str, message: str) -> None:
        if self.on_exit is not None:
            try:
                self.on_exit(self.exit_code, reason, message)
            except Exception:  # noqa: BLE001 - leaving is what matters now
                pass
        os._exit(self.exit_code)

    @contextlib.contextmanager
    def during_failure(self) -> Iterator[None]:
        """Around a recovery: with a signal pending, stop instead (raises :class:`Preempted`);
        a signal that arrives during it makes the worker leave at once."""
        self.failing = True
        try:
            if self.requested:
                raise Preempted(f"{self.signal_name} received during a failure")
            yield
        finally:
            self.failing = False

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
