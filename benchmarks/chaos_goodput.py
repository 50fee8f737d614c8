"""Goodput of a chaos run, measured, next to what the availability simulator predicts.

A chaos drill: tiny-gpt with DDP on 2 gloo ranks, a snapshot every ``--every`` steps (memory,
a peer's memory and storage), faults on rank 1 at exponential inter-arrival times (mean
``--gap`` steps): crashes (SIGKILL) and hangs (SIGSTOP), which interrupt the run, and failed
collectives and NaN gradients, which the loop absorbs (retry, recompute). The policy is
in-process recovery with a warm replacement process (the LocalSupervisor forks it) restoring
from the peer's memory.

Measured, from the run store and the fault journal (seconds of wall time):
  productive       step time of the steps that survived (the last run of each step)
  checkpoint_stall the stall of every save (``checkpoint`` events)
  lost_progress    steps done, then rolled back and done again (step time of the redone runs)
  detection        fault -> the survivor's failure (collective error, or a hang's heartbeat)
  restart          new group formed (waiting for the replacement) + model rebuilt
  restore          the checkpointer's restore
  retry            absorbed faults: the recomputed half of NaN steps (a retried collective
                   costs microseconds)
  other            the rest: start-up, the first step after each restore, logging

Simulated: ``trainpilot.sim.availability.closed_form_ettr`` for the same job (2 "nodes"), the
same fault rate (the chaos process's, and the realized count), the same policy (in-memory peer,
a warm spare, transient faults absorbed) and recovery costs measured in this run (medians).
ETTR = productive / (wall - other): the time the simulator models.

    .venv/bin/python benchmarks/chaos_goodput.py            # ~2 min on 2 idle cores
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the drills are the oracle's fixtures, in tests/
RESULTS = Path(__file__).parent / "results"
PLAN = "dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64"
KINDS = ("crash", "hang", "collective", "nan")
INTERRUPTING = ("crash", "hang")
ELASTIC = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.5, collective_timeout_s=5.0,
               hang_grace_s=2.0, join_timeout_s=60.0)


def run_chaos(work: Path, *, steps: int, gap: float, every: int, seed: int):
    from tests.elastic.drill import DrillSpec, run_drill
    from trainpilot.runtime.elastic.chaos import chaos_inject, chaos_schedule

    schedule = [(s, k, 1) for s, k, _ in chaos_schedule(
        seed=seed, num_steps=steps - 2, mean_gap_steps=gap, world_size=2, kinds=KINDS,
        first_step=every + 1)]
    spec = DrillSpec(run_dir=str(work), plan=PLAN, model="tiny-gpt", steps=steps, lr=3e-3,
                     checkpoint_every=every, inject=chaos_inject(schedule), elastic=ELASTIC)
    report = run_drill(spec, world_size=2, max_restarts=len(schedule) + 2, timeout_s=900)
    if not report.ok:
        raise RuntimeError(f"chaos drill failed: {report.processes}")
    return schedule


def measure(run_dir: Path) -> dict:
    """Seconds per category, counts and the recovery costs (see the module doc)."""
    from trainpilot.store import RunStore

    store = RunStore.open_readonly(run_dir)
    try:
        run = store.run()
        wall = run.ended_time - run.started_time
        step_s = dict(zip(*store.series("step_time_s")))
        attempts = dict(zip(*store.series("attempts")))
        events = store.events()
    finally:
        store.close()
    faults = [json.loads(x) for x in (run_dir / "faults.jsonl").read_text().splitlines()]
    median_step = statistics.median(step_s.values())
    stalls = [e.payload["stall_s"] for e in events if e.kind == "checkpoint"]
    written = [e.payload["previous"] for e in events
               if e.kind == "checkpoint" and e.payload.get("previous")]
    restarts = [e.payload for e in events if e.kind == "restart"
                and e.payload.get("reason") == "in_process"]
    by_fault_step = {f["step"]: f for f in faults if f["kind"] in INTERRUPTING}
    detect, restart, restore, lost_steps, interruptions = [], [], [], 0, []
    for r in restarts:
        fault = by_fault_step.get(r["failed_step"]) or min(
            by_fault_step.values(), key=lambda f: abs(f["time_unix_s"] - r["failed_at_unix_s"]))
        detect.append(max(0.0, r["failed_at_unix_s"] - fault["time_unix_s"]))
        restart.append(r["rendezvous_s"] + r["rebuild_s"])
        restore.append(r["restore_s"])
        lost_steps += max(0, r["failed_step"] - 1 - r["restored_step"])
        interruptions.append(dict(fault=fault["fault"], failed_step=r["failed_step"],
                                  restored_step=r["restored_step"], source=r["source"],
                                  detect_s=detect[-1], restart_s=restart[-1]))
    retried = [s for s, a in attempts.items() if a > 1]
    seconds = dict(
        productive=sum(step_s.values()) - sum(step_s[s] / 2 for s in retried),
        checkpoint_stall=sum(stalls), lost_progress=lost_steps * median_step,
        detection=sum(detect), restart=sum(restart), restore=sum(restore),
        retry=sum(step_s[s] / 2 for s in retried))
    seconds["other"] = max(0.0, wall - sum(seconds.values()))
    return dict(seconds=seconds, wall_s=wall, median_step_s=median_step,
                num_steps=len(step_s), num_saves=len(stalls),
                median_stall_s=statistics.median(stalls) if stalls else 0.0,
                num_interruptions=len(restarts), num_faults=len(faults),
                num_absorbed=sum(f["kind"] in ("collective", "nan") for f in faults),
                # Means: the closed form takes one cost per interruption, and the mean keeps
                # the totals (a hang's detection is seconds, a crash's a few ms).
                detect_s=statistics.fmean(detect) if detect else 0.0,
                restart_s=statistics.fmean(restart) if restart else 0.0,
                restore_s=statistics.fmean(restore) if restore else 0.0,
                peer_durable_s=statistics.median(w["exchange_s"] for w in written)
                if written else 0.0,
                durable_s=statistics.median(w["exchange_s"] + w["write_s"] for w in written)
                if written else 0.0,
                lost_steps=lost_steps, interruptions=interruptions)


def simulate(m: dict, *, faults_per_s: float, every: int, absorbed_share: float) -> dict:
    """The closed form for this job, fault rate and policy; seconds per category over the
    modelled time (wall less "other")."""
    from trainpilot.sim.availability import (
        AvailabilityJob,
        CheckpointSpec,
        RecoverySpec,
        closed_form_ettr,
    )
    from trainpilot.sim.failures import FailureClass, FailureModel

    modelled = m["wall_s"] - m["seconds"]["other"]
    job = AvailabilityJob(num_nodes=2, devices_per_node=1, duration_h=modelled / 3600)
    per_node_per_day = faults_per_s * 86400 / 2
    classes = (FailureClass(name="crash_or_hang", per_node_per_day=per_node_per_day
                            * (1 - absorbed_share), needs_replacement=True),
               FailureClass(name="transient", per_node_per_day=per_node_per_day * absorbed_share,
                            needs_replacement=False, transient=True))
    failures = FailureModel(classes=tuple(c for c in classes if c.per_node_per_day > 0))
    interval_s = every * m["median_step_s"]
    ckpt = CheckpointSpec(interval_min=interval_s / 60, stall_s=m["median_stall_s"],
                          in_memory_peer=True, peer_durable_s=m["peer_durable_s"],
                          durable_s=max(m["durable_s"], m["peer_durable_s"]))
    retry_s = m["seconds"]["retry"] / max(1, m["num_absorbed"])
    rec = RecoverySpec(detect_s=m["detect_s"], restart_s=m["restart_s"],
                       restore_peer_s=m["restore_s"], restore_storage_s=m["restore_s"],
                       num_spares=1, replace_s=0.0, retry_fraction=1.0, retry_s=retry_s)
    ettr, fractions = closed_form_ettr(job, failures, ckpt, rec)
    seconds = dict(productive=ettr * modelled, **{k: v * modelled for k, v in fractions.items()})
    seconds["restart"] = seconds.pop("restart") + seconds.pop("spare_wait", 0.0)
    return dict(ettr=ettr, seconds=seconds, modelled_s=modelled)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--gap", type=float, default=20.0, help="mean steps between faults")
    parser.add_argument("--every", type=int, default=5, help="steps between snapshots")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="tp-chaos-"))
    try:
        schedule = run_chaos(work, steps=args.steps, gap=args.gap, every=args.every,
                             seed=args.seed)
        m = measure(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    modelled = m["wall_s"] - m["seconds"]["other"]
    absorbed = m["num_absorbed"] / max(1, m["num_faults"])
    # The chaos process draws faults per step of progress; the simulator's arrive per second
    # of wall time. Same rate = the process's expected count (steps / gap) over the time the
    # simulator models; and the count this run realized over that time.
    process_rate = (args.steps - args.every) / args.gap / modelled
    sims = {"sim (chaos rate)": simulate(m, faults_per_s=process_rate, every=args.every,
                                         absorbed_share=absorbed),
            "sim (realized count)": simulate(m, faults_per_s=m["num_faults"] / modelled,
                                             every=args.every, absorbed_share=absorbed)}
    text = report(m, sims, schedule, args, load)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chaos_goodput.txt").write_text(text)
    (RESULTS / "chaos_goodput.json").write_text(json.dumps(
        dict(measured=m, simulated=sims, schedule=schedule, args=vars(args)), indent=1) + "\n")
    return 0


def report(m: dict, sims: dict, schedule, args, load: float) -> str:
    cats = ("productive", "checkpoint_stall", "lost_progress", "detection", "restart",
            "restore", "retry")
    modelled = m["wall_s"] - m["seconds"]["other"]
    lines = [f"# benchmarks/chaos_goodput.py, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{os.cpu_count()} cores, load average at start {load:.1f}",
             f"# tiny-gpt DDP on 2 gloo ranks, {args.steps} steps, snapshot every {args.every} "
             f"steps, faults on rank 1 every {args.gap:g} steps on average (seed {args.seed}): "
             f"{len(schedule)} faults ({', '.join(f'{k}@{s}' for s, k, _ in schedule)})",
             f"# measured: wall {m['wall_s']:.1f} s, of which 'other' {m['seconds']['other']:.1f}"
             f" s (start-up, first steps after restores, logging: not modelled); "
             f"{m['num_interruptions']} interruptions, {m['num_absorbed']} absorbed faults; "
             f"median step {m['median_step_s'] * 1e3:.0f} ms, stall {m['median_stall_s'] * 1e3:.1f}"
             f" ms, peer copy durable after {m['peer_durable_s'] * 1e3:.0f} ms, storage after "
             f"{m['durable_s'] * 1e3:.0f} ms (medians); detect {m['detect_s']:.2f} s, restart "
             f"{m['restart_s']:.2f} s, restore {m['restore_s'] * 1e3:.0f} ms (means per "
             f"interruption); all fed to the simulator",
             f"{'category':18} {'measured s':>11} {'share':>7}" + "".join(
                 f" {name:>22}" for name in sims)]
    for cat in cats:
        row = f"{cat:18} {m['seconds'][cat]:11.2f} {m['seconds'][cat] / modelled:7.1%}"
        for sim in sims.values():
            value = sim["seconds"].get(cat, 0.0)
            row += f" {value:11.2f} {value / sim['modelled_s']:10.1%}"
        lines.append(row)
    measured_ettr = m["seconds"]["productive"] / modelled
    lines.append(f"{'ETTR':18} {measured_ettr:19.1%}" + "".join(
        f" {s['ettr']:22.1%}" for s in sims.values()))
    lines.append(f"# overall productive / wall (start-up included): "
                 f"{m['seconds']['productive'] / m['wall_s']:.1%}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
