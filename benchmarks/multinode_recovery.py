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
"""

from __future__ import annotations

import argparse
import json
import os
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
    kill_host,
    launch,
    wait_standby,
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
        run.start("node0")
        run.wait_rendezvous_host()
        run.start("node1")
        run.wait_ranks(2)
        run.start("spare")
        wait_standby(run, "spare")
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
                spare_received_bytes=received, bit_exact=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="example: sudo .venv/bin/python "
                                            "benchmarks/multinode_recovery.py --repeats 3")
    parser.add_argument("--repeats", type=int, default=2, help="trials of each kind (default 2)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="every link's bandwidth, each direction (default 1000)")
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
        out = dict(rate_mbit=args.rate_mbit, repeats=args.repeats, load_start=load0,
                   load_end=os.getloadavg()[0], reference_wall_s=ref_wall,
                   reference_cpu_s=ref_cpu, trials=rows)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
