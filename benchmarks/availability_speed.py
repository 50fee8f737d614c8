"""Speed of the availability Monte-Carlo engine: one simulated year of a 16,384-device job.

    python benchmarks/availability_speed.py               # 1,000 trials per policy (~15 s)
    python benchmarks/availability_speed.py --trials 200  # quick look

Target (issue 4): one simulated year of a 16,384-device job (2,048 nodes of 8) under the Llama 3
failure mix (about 2,830 interruptions per trial), 1,000 Monte-Carlo trials, in at most 2 s.
Timed (issue 19: the benchmark times what the CLI does): ``trainpilot.sim.engines.run_engines``,
the function ``trainpilot simulate availability`` calls: drawing the events, walking them, the
Monte-Carlo interval search (on 200 trials) and the closed form with its own search; best of
``--repeats`` runs. Beside it, the walk alone (events + one interval, what this benchmark timed
before), so the share of the search shows. Four policies: storage checkpoints with cold
replacements (the plain vectorised path), peer checkpoints (adds the lock-step rollback walk),
hot spares (adds the lock-step spare queue) and Weibull nodes (per-node renewal draws).
``--big`` adds the 131,072-device case (16,384 nodes) on the storage policy, with the process's
peak resident memory.

Baseline, from the same run: ``trainpilot.sim.reference.reference_walk``, the scalar
event-by-event implementation of the same model, on the first ``--baseline-trials`` trials of
the same events, timed and scaled linearly to the full trial count (marked "extrapolated"). Its
per-trial results must equal ours (max difference printed), so both sides compute the same thing.

Writes benchmarks/results/availability_speed.txt.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from trainpilot.fsio import atomic_write_text
from trainpilot.sim.availability import AvailabilityJob, CheckpointSpec, RecoverySpec
from trainpilot.sim.engines import run_engines
from trainpilot.sim.failures import llama3_mix
from trainpilot.sim.montecarlo import Events, chunk_trials, draw_chunks, walk_chunks
from trainpilot.sim.reference import reference_walk

RESULTS = Path(__file__).resolve().parent / "results" / "availability_speed.txt"
TARGET_S = 2.0

STORAGE = CheckpointSpec(interval_min=10, stall_s=10, durable_s=120)
PEER = CheckpointSpec(interval_min=10, stall_s=10, durable_s=120, in_memory_peer=True,
                      peer_durable_s=5, storage_every=10)
POLICIES = {
    "storage, cold replacement": (llama3_mix(), STORAGE, RecoverySpec()),
    "peer copies, cold replacement": (llama3_mix(), PEER, RecoverySpec()),
    "peer copies, 41 hot spares": (llama3_mix(), PEER, RecoverySpec(num_spares=41)),
    "storage, Weibull k=0.7 nodes": (llama3_mix(distribution="weibull", weibull_shape=0.7),
                                     STORAGE, RecoverySpec()),
}


def time_cli(job, failures, ckpt, rec, trials: int, repeats: int):
    """Best wall and CPU seconds of ``run_engines`` (the CLI's computation) over ``repeats``
    runs, and its Monte-Carlo result."""
    best, best_cpu, result = float("inf"), float("inf"), None
    for seed in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        result, _ = run_engines(job, failures, ckpt, rec, num_trials=trials, seed=seed)
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best, best_cpu, result


def time_ours(job, failures, ckpt, rec, trials: int, repeats: int):
    """Best wall and CPU seconds over ``repeats`` runs of the walk alone (events and one
    interval, no search), with the last run's result and events for the baseline check."""
    best, best_cpu, result, events = float("inf"), float("inf"), None, None
    for seed in range(repeats):
        start, cpu = time.perf_counter(), time.process_time()
        events = draw_chunks(np.random.default_rng(seed), job, failures, rec, trials,
                             chunk_trials(ckpt, rec))
        result = walk_chunks(events, job, ckpt, rec, ckpt.interval_min)
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best, best_cpu, result, events


def time_baseline(events: list[Events], job, ckpt, rec, ours, num: int):
    """CPU seconds of the reference walk of the first ``num`` trials of the last run's events,
    and the largest per-trial difference from ours (hours)."""
    first = events[0]
    sub = Events(*(getattr(first, f)[:num] for f in ("time_h", "cls", "kind", "nodes",
                                                      "storage")))
    start = time.process_time()
    ref = reference_walk(sub, job, ckpt, rec, ckpt.interval_min)
    seconds = time.process_time() - start
    diff = max(abs(ours.acc[k][i] - row[k]) for i, row in enumerate(ref) for k in ours.acc)
    return seconds, diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-trials", type=int, default=10)
    parser.add_argument("--no-write", action="store_true", help="do not update the results file")
    parser.add_argument("--big", action="store_true",
                        help="also time the 131,072-device job (storage policy, CLI path)")
    args = parser.parse_args(argv)
    job = AvailabilityJob(num_nodes=2048, devices_per_node=8, duration_h=24 * 365)
    lines = [
        f"availability Monte-Carlo speed: {job.num_devices} devices ({job.num_nodes} nodes), "
        f"one simulated year, {args.trials} trials, Llama 3 failure mix",
        f"machine: {os.cpu_count()} CPUs, {platform.python_implementation()} "
        f"{platform.python_version()}, numpy {np.__version__}, OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"target: <= {TARGET_S:.1f} s wall for the CLI path (run_engines: events, walk, both "
        f"interval searches; best of {args.repeats}); walk: events + one interval only; "
        f"baseline: the scalar reference on {args.baseline_trials} trials, CPU time extrapolated "
        "linearly; speed-up in CPU time against the walk",
        "",
        f"{'policy':30} {'interrupts':>10} {'ETTR':>7} {'CLI wall s':>10} {'CLI cpu s':>9} "
        f"{'walk cpu s':>10} {'baseline cpu s':>14} {'speed-up':>8} {'max |diff| h':>12} "
        f"{'target':>7}",
    ]
    print("\n".join(lines), flush=True)
    ok = True
    for name, (failures, ckpt, rec) in POLICIES.items():
        cli_s, cli_cpu, mc = time_cli(job, failures, ckpt, rec, args.trials, args.repeats)
        _, ours_cpu, result, events = time_ours(job, failures, ckpt, rec, args.trials,
                                                args.repeats)
        base_s, diff = time_baseline(events, job, ckpt, rec, result, args.baseline_trials)
        base_full = base_s * args.trials / args.baseline_trials
        passed = cli_s <= TARGET_S
        ok &= passed
        line = (f"{name:30} {mc.interruptions:10.0f} {mc.ettr:7.4f} {cli_s:10.2f} "
                f"{cli_cpu:9.2f} {ours_cpu:10.2f} {base_full:14.1f} {base_full / ours_cpu:7.0f}x "
                f"{diff:12.1e} {'ok' if passed else 'MISSED':>7}")
        print(line, flush=True)
        lines.append(line)
    if args.big:
        import resource

        big = job.replace(num_nodes=16384)
        failures, ckpt, rec = POLICIES["storage, cold replacement"]
        cli_s, cli_cpu, mc = time_cli(big, failures, ckpt, rec, args.trials, 1)
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        line = (f"{'131,072 devices, storage':30} {mc.interruptions:10.0f} {mc.ettr:7.4f} "
                f"{cli_s:10.2f} {cli_cpu:9.2f}   (one run; process peak RSS {peak_gib:.2f} GiB)")
        print(line, flush=True)
        lines.append(line)
    if not args.no_write:
        atomic_write_text(RESULTS, "\n".join(lines) + "\n")
        print(f"written to {RESULTS}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
