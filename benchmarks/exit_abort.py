"""How often a finished gloo process dies at interpreter teardown: plain ``sys.exit`` vs
trainpilot's ``end_process``, pairs of ranks alternated in one run.

    python benchmarks/exit_abort.py              # 20 pairs of each, ~2 min
    python benchmarks/exit_abort.py --pairs 50

The scenario (see trainpilot/runtime/procexit.py for the mechanism): rank 0 leaves with 400
all-reduces still in flight on gloo's threads and a slow interpreter teardown (an object whose
finalizer sleeps, standing in for a big process's teardown); rank 1 joins those all-reduces only
once rank 0 is leaving, so they complete on rank 0's gloo threads while it exits. Counted per
pair: rank 0 killed by SIGABRT ("terminate called without an active exception"), or exiting 0.
tests/runtime/test_procexit.py runs the same worker (``--worker``).

Writes benchmarks/results/exit_abort.txt and prints it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

from trainpilot.runtime.procexit import end_process

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("sys_exit", "end_process")
ABORT = "terminate called without an active exception"
NUM_OPS = 400


class SlowTeardown:
    def __del__(self, sleep=time.sleep):
        sleep(1.0)


def worker(rank: int, port: int, how: str) -> None:
    """One rank of the scenario; rank 1 always exits 0."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        store.set("connected", "1")
        store.wait(["leaving"])
        try:
            for _ in range(NUM_OPS):
                dist.all_reduce(torch.ones(1 << 14))
        except RuntimeError:
            pass  # rank 0 left with end_process: its half of the collectives went with it
        os._exit(0)
    # Rank 1 may still be finishing gloo's full-mesh connect when rank 0's init returns; a
    # rank 0 gone by then fails rank 1's init ("Connection closed by peer": a CI run), which is
    # not the hazard measured here.
    store.wait(["connected"])
    tensors = [torch.ones(1 << 14) for _ in range(NUM_OPS)]
    for t in tensors:
        dist.all_reduce(t, async_op=True)
    # Module globals live until the interpreter's teardown clears them: the tensors of the
    # in-flight all-reduces, then the slow finalizer that keeps the teardown going.
    globals().update(tensors=tensors, slow=SlowTeardown())
    store.set("leaving", "1")
    print("rank 0 leaving", flush=True)
    if how == "end_process":
        end_process(0)
    sys.exit(0)


def worker_command(how: str):
    """``run_local_ranks`` command for one pair in mode ``how``."""
    return lambda rank, port: [sys.executable, str(Path(__file__).resolve()), "--worker",
                               str(rank), str(port), how]


def run_pair(how: str, logdir: Path):
    """One pair of ranks; returns its ``LocalRanksResult`` (outputs included)."""
    from trainpilot.runtime.local_ranks import run_local_ranks

    return run_local_ranks(worker_command(how), 2, timeout_s=60,
                           logs=[logdir / f"{how}.rank{rank}.log" for rank in range(2)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=20, help="pairs of ranks per mode")
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "HOW"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(int(args.worker[0]), int(args.worker[1]), args.worker[2])
        return 0
    counts = {how: dict(aborted=0, clean=0, other=0) for how in MODES}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for how in MODES:  # alternated: the same load for both
                result = run_pair(how, Path(tmp))
                code = result.returncodes[0]
                if code == -signal.SIGABRT and ABORT in result.outputs[0]:
                    counts[how]["aborted"] += 1
                elif code == 0 and result.returncodes[1] == 0:
                    counts[how]["clean"] += 1
                else:
                    counts[how]["other"] += 1
            print(f"\r{i + 1}/{args.pairs} pairs of each", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    write_report("exit_abort", f"--pairs {args.pairs}", load,
                 "exit          rank 0 aborted (SIGABRT)  clean  other",
                 [f"{how:<13} {counts[how]['aborted']:>7} of {args.pairs:<15} "
                  f"{counts[how]['clean']:>5}  {counts[how]['other']:>5}" for how in MODES])
    return 0


def write_report(name: str, args: str, load: float, header: str, rows: list[str]) -> None:
    """Write benchmarks/results/NAME.txt (a line saying how it was run, then the table) and
    print it; ``load``: the load average when the runs started."""
    from trainpilot.fsio import atomic_write_text

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = "\n".join([f"# benchmarks/{name}.py {args}, {stamp}, {os.cpu_count()} cores, python "
                      f"{platform.python_version()}, load average at start {load:.1f}",
                      header, *rows]) + "\n"
    RESULTS.mkdir(exist_ok=True)
    atomic_write_text(RESULTS / f"{name}.txt", text)
    print(text, end="")

if __name__ == "__main__":
    # Not run_and_end: the worker picks its own exit (that is what is measured), and the
    # launcher only hosts a TCPStore (no gloo threads).
    sys.exit(main())
