"""The step simulator's front door: costs from the cost model, Chrome-trace output."""

from __future__ import annotations

import json
import os
from typing import Any

from trainpilot.fsio import atomic_write_text
from trainpilot.sim.timeline import (
    TRACK_COMPUTE,
    TRACK_DP,
    TRACK_PP,
    StageCosts,
    StepResult,
    StepSpec,
    simulate_step,
)
from trainpilot.specs import ClusterSpec, ModelSpec, Plan

TRACK_NAMES = {TRACK_COMPUTE: "compute stream", TRACK_PP: "pipeline sends",
               TRACK_DP: "gradient buckets (DP stream)"}


def step_spec_from_prediction(pred: Any, plan: Plan, *, shared_nic: bool = False) -> StepSpec:
    """A ``StepSpec`` from ``perf.predict(...)``: one ``StageCosts`` per pipeline rank.

    The cost model's ``fwd_s``/``bwd_s`` already include the expert all-to-alls and the exposed
    tensor-parallel collectives; they are split out here (half in the forward, half in the
    backward) so the timeline shows them as blocking communication. ``tp_comm_s`` is read when
    the cost model's ``StageCost`` carries it (else the TP time stays inside compute). Its
    ``dp_comm_s`` is the full gradient traffic; the timeline overlaps it.
    """
    stages = []
    for s in pred.stages:
        ep_half = min(s.ep_comm_s / 2.0, s.fwd_s, s.bwd_s)
        tp_half = min(getattr(s, "tp_comm_s", 0.0) / 2.0, s.fwd_s - ep_half, s.bwd_s - ep_half)
        stages.append(StageCosts(
            fwd_s=s.fwd_s - ep_half - tp_half, bwd_s=s.bwd_s - ep_half - tp_half,
            p2p_s=s.p2p_s, dp_comm_s=s.dp_comm_s,
            dp_bucket_bytes=tuple(float(b) for b in s.dp_bucket_bytes if b),
            optimizer_s=s.optimizer_s, ep_comm_s=2.0 * ep_half, tp_comm_s=2.0 * tp_half,
        ))
    return StepSpec(stages=tuple(stages), num_micro_batches=pred.num_micro_batches,
                    schedule=str(plan.pp_schedule), vp=plan.vp, dp_overlap=plan.comm.overlap,
                    shared_nic=shared_nic)


def simulate_plan(model: ModelSpec, cluster: ClusterSpec, plan: Plan, *,
                  shared_nic: bool = False) -> tuple[StepResult, Any]:
    """Cost the plan with ``perf.predict`` and simulate its step: (result, prediction)."""
    from trainpilot.perf import predict

    pred = predict(model, cluster, plan)
    return simulate_step(step_spec_from_prediction(pred, plan, shared_nic=shared_nic)), pred


def chrome_trace(result: StepResult) -> dict[str, Any]:
    """Trace Event Format (opens in Perfetto or chrome://tracing): one process per pipeline
    rank, one thread per stream; timestamps and durations in whole microseconds."""
    events: list[dict[str, Any]] = []
    for rank in range(len(result.ranks)):
        events.append(dict(name="process_name", ph="M", pid=rank, tid=0,
                           args=dict(name=f"pipeline rank {rank}")))
        for tid, name in TRACK_NAMES.items():
            events.append(dict(name="thread_name", ph="M", pid=rank, tid=tid,
                               args=dict(name=name)))
    for rank, track, name, start_s, dur_s in result.events:
        cat = "compute" if track == TRACK_COMPUTE and "a2a" not in name else "comm"
        # Whole microseconds, start and end rounded separately: rounding is monotonic, so a
        # slice that ends where the next begins never overlaps it (fractional microseconds
        # came back from Perfetto's float-to-nanosecond conversion 1 ns too long).
        start_us, end_us = round(start_s * 1e6), round((start_s + dur_s) * 1e6)
        events.append(dict(name=name, cat=cat, ph="X", pid=rank, tid=track,
                           ts=start_us, dur=end_us - start_us))
    return dict(traceEvents=events, displayTimeUnit="ms",
                otherData=dict(step_time_s=result.step_time_s,
                               bubble_fraction=result.bubble_fraction))


def write_chrome_trace(result: StepResult, path: str | os.PathLike) -> None:
    """Write ``chrome_trace(result)`` to ``path`` atomically."""
    atomic_write_text(path, json.dumps(chrome_trace(result)) + "\n")


def explain(result: StepResult, spec: StepSpec) -> list[str]:
    """Why the simulated bubble differs from (p - 1) / (v m), in sentences."""
    notes = []
    work = [spec.num_micro_batches * (c.fwd_s + c.bwd_s) for c in spec.stages]
    if max(work) > 0 and (max(work) - min(work)) / max(work) > 0.01:
        heavy = max(range(len(work)), key=work.__getitem__)
        notes.append(f"stages are uneven: rank {heavy} does {max(work) / min(work):.2f}x the "
                     "work of the lightest, and the others wait for it")
    p2p = max(c.p2p_s for c in spec.stages)
    if p2p > 0 and spec.pp > 1:
        notes.append(f"each stage boundary adds a {p2p * 1e3:.3g} ms transfer on the fill and "
                     "drain path, which the closed form ignores")
    if spec.schedule == "zero_bubble":
        notes.append("zero-bubble defers weight gradients into the waits, so the bubble is "
                     "smaller than 1F1B's (p - 1) / m")
    blocking = max(c.ep_comm_s + c.tp_comm_s for c in spec.stages)
    if blocking > 0:
        notes.append("expert / tensor-parallel collectives stall compute and are not in the "
                     "ideal time")
    tail = max(r.to_dict(result.step_time_s)["exposed_dp_s"] for r in result.ranks)
    if tail > 0:
        notes.append(f"the data-parallel gradient tail is exposed for {tail * 1e3:.3g} ms after "
                     "the last backward (it is after the pipeline flush, so not in the bubble)")
    return notes
