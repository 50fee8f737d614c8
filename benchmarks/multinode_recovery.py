"""A host lost on a cluster of network namespaces, recovered by the spare host waiting in
torchrun's rendezvous: its state from the survivor's memory copy over the network, or (the
same fault, the survivor's node memory removed) from storage. Side by side in one run.

    sudo .venv/bin/python benchmarks/multinode_recovery.py            # 2 hosts + a spare
    sudo .venv/bin/python benchmarks/multinode_recovery.py --repeats 3 --rate-mbit 100 --json

Each trial: ``trainpilot train`` launched once per host (node0 holds the rendezvous), DDP over
gloo, one rank per host, a checkpoint every 3 steps in memory and every 6 in storage; every
process of node1 SIGKILLed after step 7; measured: fault -> first step after the restart (wall),
the step restored and the steps recomputed, bytes the spare received on its link from the fault
to that step, and the run's weights, AdamW state and losses against an uninterrupted run
(bit-exact). Needs root (network namespaces), iproute2 and iptables.

``--chaos``: then a chaos run on the same cluster. Host losses arrive as a Poisson process on
the wall clock (exponential gaps, mean ``--mean-gap-s``), each SIGKILLing every process of the
host other than node0 that trains (node0 holds the rendezvous store: a single point of failure, not
faulted), after which that host's launcher is started again and waits as the next standby (a
repaired machine rejoining). Measured: goodput = the surviving steps' step time / the wall time
from the first step to the last. Simulated: the Monte-Carlo engine (``sim/montecarlo.py``:
failures on the wall clock, during recoveries too, as in the run) and the closed form
(``closed_form_ettr``: a renewal process, failures during uptime only), for 2 hosts, host
losses at the same rate per second (the same clock as the run: not per step), one spare, the spare's return time, the checkpoint interval and stall, and the
detection + restart and restore costs the side-by-side trials measured; also at the realized
count of drawn events (made, or drawn mid-recovery). The run is checked bit-exact against an uninterrupted one of the same length.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.external.harness import (  # noqa: E402 (the harness lives with the tests)
    PLAN2,
    assert_same_run,
    events,
    job,
    train_args,
)
from tests.multinode.harness import (  # noqa: E402
    completed_steps,
    kill_host,
    launch,
    start_with_standby,
    wait_step_after_restart,
)
from tests.multinode.netns import NetCluster, missing_requirements  # noqa: E402

STEPS, EVERY = 12, 3
EXTRA = ("--storage-every", "2")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def trial(net: NetCluster, run_dir: Path, *, reference: Path, from_storage: bool) -> dict:
    with launch(net, run_dir, steps=STEPS, every=EVERY, extra=EXTRA) as run:
        rejoin = start_with_standby(run)
        run.wait_step(7)
        before = net.port_bytes("spare")["received"]
        t0 = time.monotonic()
        fault = kill_host(run, "node1")
        if from_storage:
            for folder in Path("/dev/shm").glob(f"trainpilot-{run.jobs['node0'].proc.pid}-*/"
                                                "memory"):
                shutil.rmtree(folder)
        first = wait_step_after_restart(run)
        took = time.monotonic() - t0
        received = net.port_bytes("spare")["received"] - before
        codes = run.wait(["node0", "spare"])
        if codes != {"node0": 0, "spare": 0}:
            raise RuntimeError(f"launchers ended with {codes}:\n{run.outputs()}")
    assert_same_run(run_dir, reference, step=9, num_steps=STEPS)
    [restart] = [e.payload for e in events(run_dir, ["restart"])]
    return dict(source=restart["source"], restored_step=restart["restored_step"],
                restore_s=restart["restore_s"], fault_step=fault["step"],
                steps_recomputed=fault["step"] - 1 - restart["restored_step"],
                first_step=first["step"], fault_to_next_step_s=took,
                spare_received_bytes=received, rejoin_s=rejoin, bit_exact=True)


def _steps_seen(path: Path, seen: dict, clock: list) -> None:
    """Timestamp every new step record of ``metrics.jsonl`` (rank 0's stream) as it appears."""
    with contextlib.suppress(OSError):
        lines = path.read_text().splitlines()
        for line in lines[len(clock):]:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("kind") == "step":
                    seen[record["step"]] = (time.monotonic(), record["step_time_s"])
                elif record.get("kind") == "checkpoint":
                    seen.setdefault("stalls", []).append(record.get("stall_s") or 0.0)
            clock.append(line)


def chaos(net: NetCluster, run_dir: Path, *, steps: int, mean_gap_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    seen: dict = {}
    lines: list = []
    faults, skipped = [], 0
    with launch(net, run_dir, steps=steps, every=EVERY, extra=EXTRA) as run:
        start_with_standby(run)
        metrics = run_dir / "metrics.jsonl"
        while 1 not in seen:
            _steps_seen(metrics, seen, lines)
            time.sleep(0.02)
        t_first = seen[1][0] - seen[1][1]
        due = t_first + rng.expovariate(1.0 / mean_gap_s)
        while run.jobs["node0"].proc.poll() is None:
            _steps_seen(metrics, seen, lines)
            if time.monotonic() >= due:
                target = [h for h in run.ranks() if h != "node0"]
                if target:
                    host = target[0]
                    faults.append(dict(host=host, t=time.monotonic() - t_first,
                                       step=completed_steps(run_dir)))
                    kill_host(run, host)
                    run.jobs[host].proc.wait(10)
                    run.start(host)  # repaired: it waits as the next standby
                else:
                    skipped += 1  # no host trains rank 1 right now (mid-recovery)
                due += rng.expovariate(1.0 / mean_gap_s)
            time.sleep(0.02)
        _steps_seen(metrics, seen, lines)
        t_last = max(v[0] for k, v in seen.items() if isinstance(k, int))
        if run.jobs["node0"].proc.returncode != 0:
            raise RuntimeError(run.outputs())
    restarts = [e.payload for e in events(run_dir, ["restart"])]
    per_step = [seen[s][1] for s in range(1, steps + 1)]
    return dict(wall_s=t_last - t_first, productive_s=sum(per_step),
                median_step_s=statistics.median(per_step),
                median_stall_s=statistics.median(seen.get("stalls") or [0.0]),
                faults=faults, skipped=skipped, restarts=len(restarts),
                restored_from=[r["source"] for r in restarts])


def simulate(*, wall_s: float, faults_per_s: float, median_step_s: float, stall_s: float,
             detect_restart_s: float, restore_s: float, rejoin_s: float,
             engine: str = "closed_form") -> float:
    from trainpilot.sim.availability import (
        AvailabilityJob,
        CheckpointSpec,
        RecoverySpec,
        closed_form_ettr,
    )
    from trainpilot.sim.failures import FailureClass, FailureModel
    from trainpilot.sim.montecarlo import monte_carlo

    job = AvailabilityJob(num_nodes=2, devices_per_node=1, duration_h=wall_s / 3600)
    failures = FailureModel(classes=(FailureClass(
        name="host_lost", per_node_per_day=faults_per_s * 86400 / 2, needs_replacement=True),))
    ckpt = CheckpointSpec(interval_min=EVERY * median_step_s / 60, stall_s=stall_s,
                          in_memory_peer=True, peer_durable_s=0.0, durable_s=0.0)
    rec = RecoverySpec(detect_s=0.0, restart_s=detect_restart_s, restore_peer_s=restore_s,
                       restore_storage_s=restore_s, num_spares=1, replace_s=0.0,
                       repair_h=rejoin_s / 3600)
    if engine == "monte_carlo":  # failures on the wall clock, during recoveries too
        return monte_carlo(job, failures, ckpt, rec, num_trials=4000, seed=0,
                           optimize=False).ettr
    return closed_form_ettr(job, failures, ckpt, rec)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: sudo .venv/bin/python "
                                            "benchmarks/multinode_recovery.py --repeats 3")
    parser.add_argument("--repeats", type=int, default=2, help="trials of each kind (default 2)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="every link's bandwidth, each direction (default 1000)")
    parser.add_argument("--chaos", action="store_true",
                        help="also a chaos run: host losses at random wall-clock times")
    parser.add_argument("--chaos-steps", type=int, default=200)
    parser.add_argument("--mean-gap-s", type=float, default=25.0,
                        help="mean seconds between host losses in the chaos run (default 25)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    reason = missing_requirements()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    load0 = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="tp-multinode-"))
    try:
        reference = work / "reference"
        t0, c0 = time.monotonic(), _cpu_s()
        with job(train_args(reference, steps=STEPS, plan=PLAN2)) as ref:
            if ref.wait() != 0:
                raise RuntimeError(ref.output()[-3000:])
        ref_wall, ref_cpu = time.monotonic() - t0, _cpu_s() - c0
        rows: dict[str, list[dict]] = {"memory": [], "storage": []}
        with NetCluster(["node0", "node1", "spare"], rate_mbit=args.rate_mbit) as net:
            for i in range(args.repeats):
                for kind in ("memory", "storage"):  # interleaved: the same load for both
                    t0, c0 = time.monotonic(), _cpu_s()
                    row = trial(net, work / f"{kind}{i}", reference=reference,
                                from_storage=kind == "storage")
                    row.update(wall_s=time.monotonic() - t0, cpu_s=_cpu_s() - c0)
                    if row["source"] != kind:
                        raise RuntimeError(f"a {kind} trial restored from {row['source']}")
                    rows[kind].append(row)
                    print(f"  {kind:7s} trial {i}: next step {row['fault_to_next_step_s']:.2f} s "
                          f"after the fault, step {row['restored_step']} restored, "
                          f"{row['spare_received_bytes'] / 1e6:.1f} MB to the spare",
                          file=sys.stderr, flush=True)
            chaos_out = None
            if args.chaos:
                chaos_ref = work / "chaos_reference"
                with job(train_args(chaos_ref, steps=args.chaos_steps, plan=PLAN2)) as ref:
                    if ref.wait() != 0:
                        raise RuntimeError(ref.output()[-3000:])
                chaos_out = chaos(net, work / "chaos", steps=args.chaos_steps,
                                  mean_gap_s=args.mean_gap_s, seed=args.seed)
                last = max(s for s in range(EVERY, args.chaos_steps + 1, EVERY)
                           if (s // EVERY - 1) % 2 == 0)  # the newest storage checkpoint
                assert_same_run(work / "chaos", chaos_ref, step=last,
                                num_steps=args.chaos_steps)
                mem = rows["memory"]
                costs = dict(
                    median_step_s=chaos_out["median_step_s"],
                    stall_s=chaos_out["median_stall_s"],
                    detect_restart_s=statistics.median(
                        r["fault_to_next_step_s"] - r["restore_s"] for r in mem),
                    restore_s=statistics.median(r["restore_s"] for r in mem),
                    rejoin_s=statistics.median(r["rejoin_s"] for r in mem))
                wall = chaos_out["wall_s"]
                drawn = len(chaos_out["faults"]) + chaos_out["skipped"]
                chaos_out.update(
                    costs=costs, measured_goodput=chaos_out["productive_s"] / wall,
                    simulated_goodput=simulate(wall_s=wall, faults_per_s=1 / args.mean_gap_s,
                                               **costs),
                    # Every drawn event counts: one that found no host training (mid-recovery)
                    # is a failure during a recovery to the simulator.
                    simulated_goodput_realized=simulate(wall_s=wall, faults_per_s=drawn / wall,
                                                        **costs),
                    monte_carlo_goodput=simulate(wall_s=wall, faults_per_s=1 / args.mean_gap_s,
                                                 engine="monte_carlo", **costs),
                    monte_carlo_goodput_realized=simulate(
                        wall_s=wall, faults_per_s=drawn / wall, engine="monte_carlo", **costs),
                    bit_exact=True)
        out = dict(rate_mbit=args.rate_mbit, repeats=args.repeats, load_start=load0,
                   load_end=os.getloadavg()[0], reference_wall_s=ref_wall,
                   reference_cpu_s=ref_cpu, trials=rows, chaos=chaos_out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    med = {k: {f: statistics.median(r[f] for r in v) for f in
               ("fault_to_next_step_s", "restore_s", "steps_recomputed",
                "spare_received_bytes", "wall_s", "cpu_s")} for k, v in rows.items()}
    print(f"# benchmarks/multinode_recovery.py, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} cores, load {out['load_start']:.1f} -> {out['load_end']:.1f}; "
          f"2 hosts + 1 spare (network namespaces), {args.rate_mbit:g} Mbit/s links; tiny-gpt "
          f"DDP, 1 rank per host, {STEPS} steps; node1 SIGKILLed after step 7; medians of "
          f"{args.repeats}; every run bit-exact against the uninterrupted one "
          f"({ref_wall:.1f} s wall, {ref_cpu:.1f} s CPU)")
    print(f"{'state of the lost host from':30s} {'fault->step s':>13s} {'restore s':>9s} "
          f"{'recomputed':>10s} {'MB to spare':>11s} {'trial wall s':>12s} {'CPU s':>6s}")
    names = dict(memory="survivor's memory (network)", storage="storage (shared disk)")
    for kind, m in med.items():
        print(f"{names[kind]:30s} {m['fault_to_next_step_s']:13.2f} {m['restore_s']:9.2f} "
              f"{m['steps_recomputed']:10.0f} {m['spare_received_bytes'] / 1e6:11.1f} "
              f"{m['wall_s']:12.1f} {m['cpu_s']:6.1f}")
    c = out["chaos"]
    if c:
        print(f"chaos run: {args.chaos_steps} steps, host losses every {args.mean_gap_s:g} s on "
              f"average (wall clock, seed {args.seed}): {len(c['faults'])} made at "
              + ", ".join(f"{f['t']:.1f} s ({f['host']})" for f in c["faults"])
              + f", {c['skipped']} skipped mid-recovery; {c['restarts']} restarts from "
              f"{'/'.join(sorted(set(c['restored_from'])))}; bit-exact")
        k = c["costs"]
        print(f"  fed to the simulator: step {k['median_step_s'] * 1e3:.0f} ms, stall "
              f"{k['stall_s'] * 1e3:.0f} ms, detection + restart {k['detect_restart_s']:.2f} s, "
              f"restore {k['restore_s']:.2f} s, spare back after {k['rejoin_s']:.1f} s")
        print(f"  goodput over {c['wall_s']:.1f} s: measured {c['measured_goodput']:.1%}; "
              f"Monte Carlo (failures on the wall clock, recoveries included) "
              f"{c['monte_carlo_goodput_realized']:.1%} at the realized rate of drawn events, "
              f"{c['monte_carlo_goodput']:.1%} at the chaos rate; closed form (failures during "
              f"uptime only) {c['simulated_goodput_realized']:.1%} / "
              f"{c['simulated_goodput']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
