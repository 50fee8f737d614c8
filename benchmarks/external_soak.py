"""A soak under random external faults: ``trainpilot train`` on 4 gloo ranks for 400+ steps
while a driver, outside the job, kills and stops it the way a cluster does, at exponential
intervals (seeded), and reruns the same command whenever the launcher is gone.

Faults (chosen uniformly):

* ``kill9_rank``     SIGKILL one rank: torchrun restarts the group, every rank restores;
* ``sigstop_rank``   SIGSTOP one rank: the launcher's watchdog kills it after the heartbeat
  timeout, then the same;
* ``sigterm_launcher``  the scheduler's preemption notice: a last-moment checkpoint, exit 143,
  and the driver reruns the command;
* ``kill9_launcher`` the launcher dies (its workers die with it): the driver reruns the command,
  which resumes from the newest checkpoint.

At the end the run must equal an uninterrupted run of the same command bit for bit (weights,
AdamW state, every loss), and every fault must be on record (journal or store). Reported per
kind: fault -> next completed step (wall seconds, measured by the driver from the moment it
acted to the first step the job completed after it), with CPU time of the whole process tree
beside wall time and the load average.

    .venv/bin/python benchmarks/external_soak.py                      # 4 ranks, 400 steps
    .venv/bin/python benchmarks/external_soak.py --steps 120 --ranks 2  # a quicker look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.external.harness import Job, assert_same_run, events, journal, train_args  # noqa: E402 (the harness lives with the tests)

RESULTS = Path(__file__).parent / "results"
KINDS = ("kill9_rank", "sigstop_rank", "sigterm_launcher", "kill9_launcher")
PLANS = {2: "dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64",
         4: "dp=4,zero=0,micro_batch_size=4,global_batch_size=16,seq_len=64"}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _progress(j: Job) -> tuple[int, int] | None:
    """(attempt, step) of the job's rank 0 right now (None before it registered)."""
    newest = None
    for folder in Path("/dev/shm").glob(f"trainpilot-{j.pid}-*"):
        try:
            info = json.loads((folder / "rank0.json").read_text())
            step = int((folder / f"rank0.beat.{info['pid']}").read_text().split()[1])
        except (OSError, ValueError, KeyError, IndexError):
            continue
        if newest is None or info["attempt"] > newest[0]:
            newest = (info["attempt"], step)
    return newest


def _wait_next_step(j: Job, before: tuple[int, int] | None, timeout: float = 300) -> float:
    """Seconds until the job completed a step in a new attempt (or a new launcher)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        now = _progress(j)
        if now is not None and now[1] > 0 and (before is None or now[0] != before[0]):
            return time.monotonic() - start
        if j.proc.poll() is not None:
            raise RuntimeError(f"launcher ended (rc {j.proc.returncode}):\n{j.output()[-3000:]}")
        time.sleep(0.02)
    raise TimeoutError("no step after the fault")


def soak(args: argparse.Namespace, work: Path) -> dict:
    rng = random.Random(args.seed)
    plan = PLANS[args.ranks]
    ref, run = work / "reference", work / "run"
    extra = ("--max-restarts", str(args.max_restarts)) if args.max_restarts is not None else ()
    cmd = lambda d: train_args(d, steps=args.steps, plan=plan, every=args.every,  # noqa: E731
                               extra=extra)

    t0, c0 = time.monotonic(), _cpu_s()
    ref_job = Job(cmd(ref))
    assert ref_job.wait(3600) == 0, ref_job.output()[-3000:]
    ref_wall, ref_cpu = time.monotonic() - t0, _cpu_s() - c0

    faults: list[dict] = []
    t0, c0 = time.monotonic(), _cpu_s()
    j = Job(cmd(run))
    while True:
        gap = rng.expovariate(1.0 / args.mean_gap_s)
        deadline = time.monotonic() + gap
        while time.monotonic() < deadline and j.proc.poll() is None:
            time.sleep(0.05)
        if j.proc.poll() is not None:
            break  # finished
        state = _progress(j)
        if state is None or state[1] < 1:
            continue  # still starting: the next fault waits for a step
        kind = rng.choice(args.kinds)
        workers = j.workers()
        if kind in ("kill9_rank", "sigstop_rank") and len(workers) < args.ranks:
            continue
        rank = rng.randrange(args.ranks)
        acted = time.monotonic()
        record = dict(kind=kind, rank=rank if kind.endswith("rank") else None,
                      step=state[1], launcher=j.pid, time_unix_s=time.time())
        if kind == "kill9_rank":
            record["pid"] = workers[rank]
            os.kill(workers[rank], signal.SIGKILL)
        elif kind == "sigstop_rank":
            record["pid"] = workers[rank]
            os.kill(workers[rank], signal.SIGSTOP)
        elif kind == "sigterm_launcher":
            os.kill(j.pid, signal.SIGTERM)
            record["rc"] = j.wait(120)
        else:
            os.kill(j.pid, signal.SIGKILL)
            j.wait(30)
            record["rc"] = -9
        if j.proc.poll() is not None:
            j = Job(cmd(run))  # the same command, as a user (or a requeue) would
        record["fault_to_next_step_s"] = (time.monotonic() - acted
                                          + _wait_next_step(j, state if kind.endswith("rank")
                                                            else None))
        faults.append(record)
        print(f"  {kind:17s} rank {record['rank']} at step {record['step']:4d}: next step after "
              f"{record['fault_to_next_step_s']:.1f} s", flush=True)
    rc = j.wait(3600)
    wall, cpu = time.monotonic() - t0, _cpu_s() - c0
    assert rc == 0, j.output()[-3000:]
    assert_same_run(run, ref, step=args.steps)

    records = journal(run)
    on_record = dict(
        kill9_rank=sum(r["kind"] == "crash" and r.get("source") == "external" for r in records),
        sigstop_rank=sum(r["kind"] == "hang" and r.get("source") == "external" for r in records),
        kill9_launcher=sum(r["kind"] == "launcher_lost" for r in records),
        sigterm_launcher=len(events(run, ["preempted"])))
    made = {k: sum(f["kind"] == k for f in faults) for k in KINDS}
    return dict(faults=faults, made=made, on_record=on_record, reference_wall_s=ref_wall,
                reference_cpu_s=ref_cpu, wall_s=wall, cpu_s=cpu)


def report(args: argparse.Namespace, out: dict, load: tuple[float, float]) -> str:
    lines = [f"# benchmarks/external_soak.py, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{os.cpu_count()} cores, load average {load[0]:.1f} at start, {load[1]:.1f} at end",
             f"# tiny-gpt, DDP on {args.ranks} gloo ranks, {args.steps} steps, a checkpoint every "
             f"{args.every}; faults every {args.mean_gap_s:g} s on average (exponential, seed "
             f"{args.seed}); trainpilot train with its defaults"
             + (f" and --max-restarts {args.max_restarts}" if args.max_restarts is not None
                else ""),
             f"uninterrupted run: {out['reference_wall_s']:.1f} s wall, "
             f"{out['reference_cpu_s']:.1f} s CPU",
             f"faulted run: {out['wall_s']:.1f} s wall, {out['cpu_s']:.1f} s CPU (CPU of "
             "launchers killed by SIGKILL and their workers is not counted), "
             f"{len(out['faults'])} faults; final state and every loss bit-identical to the "
             "uninterrupted run",
             f"{'fault':18s} {'made':>4s} {'on record':>9s} {'fault -> next step, s: median':>30s}"
             f" {'min':>6s} {'max':>6s}"]
    for kind in KINDS:
        times = [f["fault_to_next_step_s"] for f in out["faults"] if f["kind"] == kind]
        if not times:
            continue
        lines.append(f"{kind:18s} {out['made'][kind]:4d} {out['on_record'][kind]:9d} "
                     f"{statistics.median(times):30.1f} {min(times):6.1f} {max(times):6.1f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, choices=sorted(PLANS), default=4)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--mean-gap-s", type=float, default=25.0)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="passed to trainpilot train (default: its own, 3 per launch; a "
                             "fault every few seconds needs more)")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    args = parser.parse_args()
    args.kinds = args.kinds.split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(tempfile.mkdtemp(prefix="tp-soak-"))
    load0 = os.getloadavg()[0]
    try:
        out = soak(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = report(args, out, (load0, os.getloadavg()[0]))
    print(text)
    assert out["made"] == {k: out["on_record"][k] for k in out["made"]}, \
        f"faults not on record: made {out['made']}, on record {out['on_record']}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "external_soak.txt").write_text(text)
    (RESULTS / "external_soak.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
