"""Goodput by category: as measured from a run's store, next to what the availability simulator
(the closed form of ``trainpilot.sim.availability``) predicts for a job like it.

Measured (seconds of wall time, from ``run_start`` to ``run_end`` or now):
- productive: step time of the steps that survived (the store keeps the last run of each step)
  whose update was applied;
- skipped_updates: step time of steps whose update an intervention skipped;
- checkpoint_stall: the ``stall_s`` checkpoint events carry (0 when they carry none: said so);
- lost_progress: steps redone after a rollback or restart, times the median step time (the store
  keeps only the redone steps' times, so this is an estimate, labelled as one);
- recovery: from each fault to the first completed step after it (the runtime's ``recovered``
  events; else each restart paired with the latest fault before it);
- other: the rest (start-up, logging, evaluation, idle), which the simulator does not model.

Simulated: the closed form for an ``AvailabilityJob`` of the run's size over the time it models
(wall time less "other", which is outside its model), with a checkpoint every (measured)
interval and (measured) stall; the failure model and recovery times are the run's
``availability`` document's if it stored one, else the measured fault rate and recovery time if
faults happened, else the simulator's defaults (Llama 3 per-node rates, ``RecoverySpec()``).
Every input is reported with its source. ETTR is productive time over that modelled time for
both columns; ``overall_ettr`` is the measured productive share of the whole wall time.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from trainpilot.store import RunStore
from trainpilot.ui.runs import finite

CATEGORIES = ("productive", "skipped_updates", "checkpoint_stall", "lost_progress", "recovery",
              "retry", "other")
RECOVERY_KEYS = ("detection", "spare_wait", "restart", "restore")


def _wall_s(store: RunStore) -> float:
    run = store.run()
    if run is None:
        return 0.0
    end = run.ended_time if run.ended_time and run.status != "running" else time.time()
    return max(0.0, end - run.started_time)


def _recovery(store: RunStore) -> tuple[int, float, int]:
    """(steps redone, seconds from fault to the first step after it, faults seen).

    The runtime's ``recovered`` events carry both measurements (fault time to the first
    completed step, and the steps redone) and are used when present. Stores without them (older
    runs, other writers) pair each ``restart`` with the most recent fault before it, so a fault
    that was absorbed without a restart (a retried collective, a recomputed NaN step, a slow
    rank) is not charged with a later crash's recovery."""
    faults = store.events(kinds=["fault"])
    recovered = store.events(kinds=["recovered"])
    if recovered:
        lost = sum(int(e.payload.get("lost_steps") or 0) for e in recovered)
        secs = sum(float(finite(e.payload.get("recovery_s")) or 0.0) for e in recovered)
        return lost, secs, len(faults)
    lost_steps, recovery_s = 0, 0.0
    last_fault = None
    last_ckpt = 0
    for e in store.events(kinds=["fault", "restart", "checkpoint"]):
        if e.kind == "checkpoint" and e.step is not None:
            last_ckpt = e.step
        elif e.kind == "fault":
            last_fault = e
        elif e.kind == "restart":
            restored = e.payload.get("restored_step", e.payload.get("resumed_step"))
            at = e.payload.get("step", e.step)
            if last_fault is not None:
                recovery_s += max(0.0, e.time - last_fault.time)
                at = last_fault.step if last_fault.step is not None else at
                restored = restored if restored is not None else last_ckpt
                last_fault = None
            if restored is not None and at is not None:
                lost_steps += max(0, int(at) - int(restored))
    return lost_steps, recovery_s, len(faults)


def measured_goodput(store: RunStore) -> dict[str, Any]:
    """Seconds per category (keys of ``CATEGORIES``), wall time, and counts behind them."""
    steps, step_times = store.series("step_time_s")
    skipped = dict(zip(*store.series("skipped_update")))
    times = {s: v for s, v in zip(steps, step_times) if finite(v) is not None}
    median = statistics.median(times.values()) if times else 0.0
    productive = sum(v for s, v in times.items() if not skipped.get(s))
    skipped_s = sum(v for s, v in times.items() if skipped.get(s))
    checkpoints = store.events(kinds=["checkpoint"])
    stalls = [finite(e.payload.get("stall_s")) for e in checkpoints]
    # Overlapped copies: the save call's stall, plus the next step's wait for the copy.
    stall_s = sum(s for s in stalls if s) + sum(
        v for v in store.series("checkpoint_wait_s")[1] if finite(v) is not None)
    lost_steps, recovery_s, num_faults = _recovery(store)
    wall = _wall_s(store)
    out = dict(productive=productive, skipped_updates=skipped_s, checkpoint_stall=stall_s,
               lost_progress=lost_steps * median, recovery=recovery_s, retry=0.0)
    out["other"] = max(0.0, wall - sum(out.values()))
    return dict(seconds=out, wall_s=wall, num_steps=len(times), median_step_s=median or None,
                num_checkpoints=len(checkpoints),
                stall_recorded=any(s is not None for s in stalls), num_faults=num_faults,
                lost_steps=lost_steps)


def _sim_inputs(store: RunStore, measured: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """The simulator's documents for a job like this run, and where each came from."""
    from trainpilot.sim import AvailabilityJob, CheckpointSpec, RecoverySpec, llama3_mix
    from trainpilot.sim.failures import FailureModel, single_mtbf

    docs = store.documents()
    avail = docs.get("availability") or {}
    run = store.run()
    world = run.world_size if run else 1
    cluster = docs.get("cluster") or {}
    per_node = int(cluster.get("devices_per_node") or world)
    num_nodes = max(1, -(-world // per_node))
    modelled_s = measured["wall_s"] - measured["seconds"]["other"]
    wall_h = max(modelled_s, 1e-6) / 3600.0
    job = AvailabilityJob(num_nodes=num_nodes, devices_per_node=min(per_node, world),
                          duration_h=wall_h)
    sources = {"job": f"this run: {num_nodes} node(s) x {min(per_node, world)} device(s), "
                      f"{modelled_s:.3g} s modelled of {measured['wall_s']:.3g} s wall time"}
    ckpt_n, median = measured["num_checkpoints"], measured["median_step_s"] or 0.0
    compute_s = measured["seconds"]["productive"] + measured["seconds"]["skipped_updates"]
    interval_s = compute_s / ckpt_n if ckpt_n else max(compute_s, median, 1e-3)
    stall_s = measured["seconds"]["checkpoint_stall"] / ckpt_n if ckpt_n else 0.0
    checkpoint = CheckpointSpec(interval_min=interval_s / 60.0, stall_s=stall_s)
    sources["checkpoint"] = (f"measured: a save every {interval_s:.3g} s of compute, "
                             f"{stall_s:.3g} s stall" if ckpt_n else
                             "no checkpoint during the run: progress since the start is at risk")
    if avail.get("failures"):
        failures = FailureModel.model_validate(avail["failures"])
        sources["failures"] = "the run's availability document"
    elif measured["num_faults"]:
        mtbf_h = wall_h / measured["num_faults"]
        failures = single_mtbf(mtbf_h=mtbf_h, num_nodes=num_nodes)
        sources["failures"] = (f"measured: {measured['num_faults']} fault(s) in the run, "
                               f"MTBF {mtbf_h * 3600:.3g} s")
    else:
        failures = llama3_mix()
        sources["failures"] = ("the simulator's default: Llama 3 405B per-node interruption "
                               "rates (no fault in this run)")
    if avail.get("recovery"):
        recovery = RecoverySpec.model_validate(avail["recovery"])
        sources["recovery"] = "the run's availability document"
    elif measured["num_faults"]:
        mean_s = measured["seconds"]["recovery"] / measured["num_faults"]
        recovery = RecoverySpec(detect_s=0.0, restart_s=mean_s, restore_storage_s=0.0,
                                replace_s=0.0)
        sources["recovery"] = f"measured: {mean_s:.3g} s from fault to restart, on average"
    else:
        recovery = RecoverySpec()
        sources["recovery"] = "the simulator's defaults (RecoverySpec())"
    return (job, failures, checkpoint, recovery), sources


def goodput_section(store: RunStore) -> dict[str, Any]:
    """Measured and simulated seconds per category, ETTR of each, and the simulator's inputs."""
    measured = measured_goodput(store)
    out: dict[str, Any] = dict(categories=list(CATEGORIES), measured=measured,
                               modelled_s=None, measured_ettr=None, overall_ettr=None,
                               simulated=None, simulated_ettr=None, sim_inputs=None,
                               sim_note=None)
    wall = measured["wall_s"]
    modelled = wall - measured["seconds"]["other"]
    if wall <= 0 or modelled <= 0:
        out["sim_note"] = "not available: the run has no step time recorded yet"
        return out
    out.update(modelled_s=modelled, measured_ettr=measured["seconds"]["productive"] / modelled,
               overall_ettr=measured["seconds"]["productive"] / wall)
    try:
        # The ETTR form alone: closed_form() also searches the best interval up to a week,
        # which overflows exp() at MTBFs of seconds (a short run with a fault).
        from trainpilot.sim.availability import closed_form_ettr

        (job, failures, checkpoint, recovery), sources = _sim_inputs(store, measured)
        ettr, fractions = closed_form_ettr(job, failures, checkpoint, recovery)
        interruptions = failures.job_rate_per_hour(job.num_nodes) * job.duration_h
    except ImportError:
        out["sim_note"] = "not available: trainpilot.sim is not installed"
        return out
    except ValueError as err:  # SpecError: inputs the closed form cannot represent
        out["sim_note"] = f"not available: {err}"
        return out
    except OverflowError:
        out["sim_note"] = ("not available: the closed form overflows for these inputs (faults "
                           "far more often than checkpoints)")
        return out
    badput_s = {k: v * modelled for k, v in fractions.items()}
    out["simulated"] = dict(
        productive=ettr * modelled, skipped_updates=None,
        checkpoint_stall=badput_s.get("checkpoint_stall", 0.0),
        lost_progress=badput_s.get("lost_progress", 0.0),
        recovery=sum(badput_s.get(k, 0.0) for k in RECOVERY_KEYS),
        retry=badput_s.get("retry", 0.0), other=None)
    out["simulated_ettr"] = ettr
    out["sim_inputs"] = sources
    out["sim_note"] = (f"closed form over the {modelled:.3g} s the simulator models (wall time "
                       f"less 'other': start-up, logging, monitoring, which it does not model); "
                       f"{interruptions:.3g} expected interruption(s)")
    return out
