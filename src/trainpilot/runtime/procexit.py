"""Ending a distributed worker process: everything Python's exit does, except the teardown.

Why: with torch 2.13, a gloo process group usually outlives ``destroy_process_group`` (gloo
has no ``shutdown``; DTensor's caches keep the DeviceMesh and its groups, and importing
``torch._dynamo`` keeps the default group), so the group's worker threads are still alive when
the interpreter finalizes. If one of them releases the last reference to a collective's tensor
then, it must take the GIL to drop the tensor's Python object; a thread that asks for the GIL
during finalization is ended with ``pthread_exit``, whose unwinding through a ``noexcept``
destructor calls ``std::terminate``: "terminate called without an active exception" and
SIGABRT, in a process that had finished its work (a core dump of the crash shows exactly this
stack: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` -> ``decref_pyobject`` ->
``gil_scoped_acquire`` -> ``take_gil`` -> ``PyThread_exit_thread``). torchrun then reports the
finished job as failed.

``end_process`` does what a normal exit does while the interpreter is intact (join non-daemon
threads, run ``atexit`` handlers, which include ``logging.shutdown``, flush the standard
streams) and then leaves with ``os._exit``, skipping module teardown and the garbage collection
of finalization: the threads are stopped with the process instead.
``benchmarks/exit_abort.py`` reproduces the abort with a plain ``sys.exit`` and measures that
``end_process`` avoids it; ``tests/runtime/test_procexit.py`` runs the same scenario.

A second way the same threads end a finished process, a deadlock: when the last reference to a
gloo group is dropped while the interpreter runs (a DDP model, whose reducer holds the group,
freed as ``main`` returns), ``~ProcessGroupGloo`` joins the group's worker thread with the GIL
held, and that thread, destroying its last work (whose tensors have Python objects), waits for
the GIL: both wait forever (gdb: ``~Reducer`` -> ``~ProcessGroupGloo`` -> ``std::thread::join``
on the main thread, ``runLoop`` -> ``~AsyncAllreduceWork`` -> ``take_gil`` on the other).
``examples/plain_ddp.py`` hung so after its last step in 3 of 3 runs on a loaded machine
(``benchmarks/exit_deadlock.py``: 2 of 4 without ``keep_alive``, 0 of 4 with it).
:func:`keep_alive` holds such objects until ``os._exit``, so the group is never destroyed.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

_KEPT: list[object] = []


def keep_alive(*objects: object) -> None:
    """Hold ``objects`` (a DDP model, a DeviceMesh, a process group: whatever holds a gloo group)
    until the process ends through :func:`end_process`, so that the group is never destroyed
    while the interpreter runs (the deadlock in the module doc)."""
    _KEPT.extend(objects)


def end_process(code: int = 0, *, join_threads: bool = True) -> NoReturn:
    """Exit with ``code`` as Python would, minus the teardown: wait for non-daemon threads (the
    interpreter's own ``threading._shutdown``, which first lets an executor nobody shut down
    stop), run the ``atexit`` handlers, flush stdout and stderr, then ``os._exit``. No wait
    with ``join_threads=False`` (a failed process must not hang on a thread stuck in a dead
    collective) or off the main thread (the wait would include the caller)."""
    if join_threads and threading.current_thread() is threading.main_thread():
        # What Py_FinalizeEx runs first, and all of it that is safe here (a private CPython
        # function, absent from typeshed's stubs).
        threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass  # closed or replaced: nothing left to lose
    os._exit(code)


def _exit_code(err: SystemExit) -> int:
    """The status ``sys.exit(x)`` would give: 0 for None, the int, else 1 (``x`` printed)."""
    if err.code is None:
        return 0
    if isinstance(err.code, int):
        return err.code
    print(err.code, file=sys.stderr)
    return 1


def run_and_end(main: Callable[[], int | None]) -> NoReturn:
    """``sys.exit(main())`` for a process that used torch.distributed: an exception prints its
    traceback and exits 1, as Python would, but every path leaves through :func:`end_process`
    (without waiting for other threads after an exception)."""
    try:
        code = main() or 0
    except SystemExit as err:
        code = _exit_code(err)
    except BaseException:  # noqa: BLE001 - reported like the interpreter would, then exit 1
        traceback.print_exc()
        end_process(1, join_threads=False)
    end_process(code)
