"""Bounded retry of one collective, and the errors that escalate to a recovery.

A collective that fails *before it reaches the wire* (a transient local error: the injected
``collective`` fault, an interrupted system call) can simply be issued again: the peers are
still waiting in the same collective, so the retry completes it and the step is committed once.
A collective that failed *on the wire* (gloo: a timeout, a reset connection) leaves its group
unusable (TORCH_CPU_FACTS: "after any collective error or timeout, that process group is
unusable"); re-issuing it there would only wait for another timeout, so that error escalates at
once to a recovery on a new group.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from trainpilot.runtime.faults import InjectedCollectiveError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors raised before anything was sent: safe to issue the same collective again.
TRANSIENT = (InjectedCollectiveError, InterruptedError)


class NonfiniteDisagreement(RuntimeError):
    """Ranks disagree on whether a step's reduced gradient is finite, so their gradients (and
    after the update their weights) differ: recover from the newest checkpoint."""


class CollectiveFailure(RuntimeError):
    """A collective failed for good (retries exhausted, or the group broke): recover."""

    def __init__(self, message: str, *, step: int, attempts: int, cause: BaseException):
        super().__init__(message)
        self.step, self.attempts, self.cause = step, attempts, cause


def retry_collective(issue: Callable[[], T], *, step: int, max_retries: int,
                     before: Callable[[], None] | None = None,
                     on_retry: Callable[[int, BaseException], None] | None = None) -> T:
    """Run ``before()`` then ``issue()``; on a transient error try again, at most
    ``max_retries`` times. Raises :class:`CollectiveFailure` when retries are exhausted, or
    at once for an error from the wire (the group is broken)."""
    attempt = 0
    while True:
        try:
            if before is not None:
                before()
            return issue()
        except TRANSIENT as err:
            attempt += 1
            if attempt > max_retries:
                raise CollectiveFailure(f"collective at step {step} failed {attempt} times: "
                                        f"{err}", step=step, attempts=attempt, cause=err) from err
            log.warning("collective at step %d failed (%s); retry %d of %d", step, err, attempt,
                        max_retries)
            if on_retry is not None:
                on_retry(attempt, err)
        except RuntimeError as err:
            raise CollectiveFailure(f"collective at step {step} failed on the wire: {err}",
                                    step=step, attempts=attempt + 1, cause=err) from err


def is_recoverable(err: BaseException) -> bool:
    """Errors that mean "a peer or the group failed": recover instead of crashing the run."""
    import torch.distributed as dist

    if isinstance(err, (CollectiveFailure, NonfiniteDisagreement)):
        return True
    kinds: tuple[Any, ...] = (dist.DistError,) if hasattr(dist, "DistError") else ()
    if isinstance(err, kinds):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Timed out waiting",
        "connectFullMesh", "Broken pipe", "Socket Timeout", "aborted", "NCCL", "Gloo"))
