"""Recovery time, from an injected fault to the first completed training step after it.

tiny-gpt (0.85 M parameters) with DDP on 2 gloo ranks, a snapshot every 2 steps (memory, a
peer's memory and storage), the fault at step 10 of 14 (one step after the step-8 snapshot, whose
peer copy and storage write run in the background). Side by side, from one run:

* torchrun restart: ``trainpilot train --max-restarts 1 --recovery restart``; rank 1 is
  SIGKILLed, torchrun restarts both ranks (new Python processes, torch imported again), they
  re-rendezvous and restore from storage (host memory died with the processes);
* in-process, peer memory: the survivor rebuilds its group in process; the dead rank's
  replacement is forked by the LocalSupervisor from a warm parent (torch imported and the model
  run once: a warm spare process) and restores from the copy its peer holds in host memory;
* in-process, storage: the same with the in-memory peer copy switched off, so the replacement
  must read storage;
* in-process, cold replacement: the replacement is spawned (a new interpreter that imports
  torch), as a per-replica launcher on a real cluster would start it;
* in-process, hang (SIGSTOP): detection by heartbeat timeout (2.5 s) before the same path.

Times come from the run store: the fault's time in the fault journal, and the ``recovered``
event rank 0 logs when the first step after the restart completes; ``restore`` is the
checkpointer's own restore time; lost steps = steps completed before the fault that were done
again. Medians over ``--repeats`` runs.

    .venv/bin/python benchmarks/recovery_time.py             # ~2-3 min on 2 idle cores
    .venv/bin/python benchmarks/recovery_time.py --repeats 1  # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the drills are the oracle's fixtures, in tests/
RESULTS = Path(__file__).parent / "results"
PLAN = "dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64"
STEPS, FAULT_STEP, EVERY = 14, 10, 2
ELASTIC = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.5, collective_timeout_s=5.0,
               hang_grace_s=2.0, join_timeout_s=60.0)


def _events(run_dir: Path) -> dict:
    from trainpilot.store import RunStore

    store = RunStore.open_readonly(run_dir)
    try:
        recovered = [e.payload for e in store.events(kinds=["recovered"])]
        restarts = [e.payload for e in store.events(kinds=["restart"])
                    if "restored_step" in e.payload]
    finally:
        store.close()
    faults = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    return dict(recovered=recovered, restarts=restarts, faults=faults)


def _measure(run_dir: Path) -> dict:
    """Fault to first step, and its parts where the survivor logged them (in process):
    detect (fault -> the survivor's collective failed), rendezvous (-> the new group formed:
    includes waiting for the replacement to start), rebuild (model, optimizer, hooks),
    restore (the checkpointer's), the rest is the first step itself."""
    ev = _events(run_dir)
    rec, restart = ev["recovered"][-1], ev["restarts"][-1]
    fault = ev["faults"][0]
    out = dict(recovery_s=rec["recovery_s"], restore_s=restart["restore_s"],
               source=restart["source"], restored_step=restart["restored_step"],
               lost_steps=max(0, fault["step"] - 1 - restart["restored_step"]))
    own = [r for r in ev["restarts"] if r.get("reason") == "in_process"]
    if own:
        out.update(detect_s=own[-1]["failed_at_unix_s"] - fault["time_unix_s"],
                   rendezvous_s=own[-1]["rendezvous_s"], rebuild_s=own[-1]["rebuild_s"])
    return out


def torchrun_restart(work: Path) -> dict:
    run = work / "torchrun"
    cmd = [sys.executable, "-m", "trainpilot", "train", "--model", "tiny-gpt", "--plan", PLAN,
           "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--no-predict",
           "--no-health", "--run-dir", str(run), "--json", "--max-restarts", "1",
           "--recovery", "restart", "--inject", f"crash:rank=1,step={FAULT_STEP}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return _measure(run)


def drill(work: Path, name: str, inject: str, *, start_method: str = "fork", **spec) -> dict:
    from tests.elastic.drill import DrillSpec, run_drill

    run = work / name
    ds = DrillSpec(run_dir=str(run), plan=PLAN, model="tiny-gpt", steps=STEPS, lr=3e-3,
                   checkpoint_every=EVERY, inject=inject, elastic=ELASTIC, **spec)
    report = run_drill(ds, world_size=2, timeout_s=240, start_method=start_method)
    if not report.ok:
        raise RuntimeError(f"{name}: drill failed {report.processes}")
    return _measure(run)


SCENARIOS = {
    "torchrun restart (all ranks)": lambda w: torchrun_restart(w),
    "in-process, peer memory": lambda w: drill(w, "peer", f"crash:rank=1,step={FAULT_STEP}"),
    "in-process, storage": lambda w: drill(w, "storage", f"crash:rank=1,step={FAULT_STEP}",
                                           in_memory_peer=False),
    "in-process, cold replacement": lambda w: drill(w, "cold", f"crash:rank=1,step={FAULT_STEP}",
                                                    start_method="spawn"),
    "in-process, hang (SIGSTOP)": lambda w: drill(w, "hang", f"hang:rank=1,step={FAULT_STEP}"),
}


def _children_cpu_s() -> float:
    """CPU seconds of finished child processes (and theirs), user + system."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows = {}
    for name, run in SCENARIOS.items():
        samples = []
        for _ in range(args.repeats):
            work = Path(tempfile.mkdtemp(prefix="tp-recovery-"))
            wall0, cpu0 = time.monotonic(), _children_cpu_s()
            try:
                sample = run(work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            sample.update(run_wall_s=time.monotonic() - wall0, run_cpu_s=_children_cpu_s() - cpu0)
            samples.append(sample)
        rows[name] = samples
        med = statistics.median(s["recovery_s"] for s in samples)
        print(f"{name}: {med:.2f} s", flush=True)
    text = _table(rows, load)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "recovery_time.txt").write_text(text)
    (RESULTS / "recovery_time.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def _table(rows: dict, load: float) -> str:
    med = statistics.median
    base_name = "torchrun restart (all ranks)"
    base = med([s["recovery_s"] for s in rows[base_name]])
    lines = [f"# benchmarks/recovery_time.py, {time.strftime('%Y-%m-%d %H:%M')}, "
             f"{os.cpu_count()} cores, load average at start {load:.1f}",
             f"# tiny-gpt, DDP on 2 gloo ranks, snapshot every {EVERY} steps, fault at step "
             f"{FAULT_STEP}; medians over {len(rows[base_name])} runs (min-max)",
             f"{'path':30} {'fault -> next step, s':>24} {'detect':>7} {'rdzv':>6} "
             f"{'rebuild':>7} {'restore':>7} {'from':>8} {'lost steps':>10} {'vs torchrun':>12} "
             f"{'whole run: wall s':>17} {'CPU s':>6}"]
    for name, samples in rows.items():
        rec = [s["recovery_s"] for s in samples]
        speedup = "" if name == base_name else f"{base / med(rec):.1f}x faster"
        parts = [med([s[k] for s in samples]) if k in samples[0] else None
                 for k in ("detect_s", "rendezvous_s", "rebuild_s", "restore_s")]
        cells = " ".join(f"{v:7.2f}" if v is not None else f"{'-':>7}" for v in parts)
        lines.append(f"{name:30} {med(rec):11.2f} ({min(rec):5.2f}-{max(rec):5.2f}) {cells} "
                     f"{samples[0]['source']:>8} {med([s['lost_steps'] for s in samples]):10.0f} "
                     f"{speedup:>12} {med([s['run_wall_s'] for s in samples]):17.1f} "
                     f"{med([s['run_cpu_s'] for s in samples]):6.1f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
