"""The process torchrun starts on every rank: ``python -m trainpilot.app.worker --job-file
RUN_DIR/job.json``.

It asks the kernel to end it with its launcher, registers with the launcher's watchdog (a
beacon), installs the preemption guard, runs its rank (:mod:`trainpilot.app.rank`) and, before
it exits, says why (the watchdog reads it): completed, preempted, bad input (one line, exit 2),
or failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

from trainpilot.app.rank import run_rank
from trainpilot.runtime.preempt import PreemptGuard
from trainpilot.runtime.watchdog import Beacon
from trainpilot.runtime.workerjob import read_job
from trainpilot.specs import SpecError


def main(argv: list[str] | None = None) -> int:
    from trainpilot.runtime.checkpoint.restore import TemplateMismatch
    from trainpilot.runtime.degrade import QuietStream
    from trainpilot.runtime.preempt import Preempted
    from trainpilot.runtime.watchdog import die_with_launcher

    parser = argparse.ArgumentParser(prog="trainpilot.app.worker")
    parser.add_argument("--job-file", required=True, help="the run's job.json")
    args = parser.parse_args(argv)
    sys.stdout, sys.stderr = QuietStream(sys.stdout), QuietStream(sys.stderr)
    die_with_launcher()
    beacon = Beacon(int(os.environ.get("RANK", "0"))).start()
    try:
        job = read_job(args.job_file)
        guard = PreemptGuard(job.preempt_signals, deadline_s=job.preempt_deadline_s,
                             on_exit=beacon.record_exit).install()
        if "USR1" not in job.preempt_signals:
            # `kill -USR1 <pid>` prints every thread's stack to the worker's stderr: what a
            # hang diagnosis needs first, without stopping the process.
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        outcome = run_rank(job, beacon=beacon, guard=guard)
    except (SpecError, TemplateMismatch) as err:
        line = str(err) if isinstance(err, SpecError) else (
            f"the checkpoint does not match this job's model or layout: {err}")
        print(f"error: {line}", file=sys.stderr)
        beacon.record_exit(2, "bad_input", line)
        return 2
    except Preempted as err:
        beacon.record_exit(guard.exit_code, "terminated", str(err))
        return guard.exit_code
    except BaseException as err:
        first = (str(err).strip().splitlines() or [""])[0][:300]
        beacon.record_exit(1, _failure_reason(err), f"{type(err).__name__}: {first}")
        raise
    if outcome == "drain_peer":  # the job moves off a drained host: torchrun re-forms it
        from trainpilot.runtime.drain import EXIT_DRAINED_PEER

        beacon.record_exit(EXIT_DRAINED_PEER, outcome, "a host was drained: the job re-forms")
        return EXIT_DRAINED_PEER
    beacon.record_exit(0, outcome)
    return 0


def _failure_reason(err: BaseException) -> str:
    from trainpilot.runtime.elastic.retry import is_recoverable

    return "peer_failed" if is_recoverable(err) else "failed"


if __name__ == "__main__":
    from trainpilot.runtime.procexit import run_and_end

    run_and_end(main)
