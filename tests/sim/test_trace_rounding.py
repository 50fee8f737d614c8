"""Chrome/Perfetto trace slices never overlap on a track after rounding to the integer
microseconds (and nanoseconds) a trace viewer works in."""

from __future__ import annotations

from collections import defaultdict

from trainpilot.sim.step import chrome_trace, simulate_plan
from trainpilot.specs import load_job


def _tracks(trace):
    by_track = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append(e)
    return by_track


def test_back_to_back_slices_do_not_overlap_after_rounding():
    job = load_job("llama3-405b-h100-16384")
    result, _ = simulate_plan(job.model, job.cluster, job.plan)
    trace = chrome_trace(result)
    tracks = _tracks(trace)
    touching = 0
    for events in tracks.values():
        events.sort(key=lambda e: (e["ts"], e["dur"]))
        for a, b in zip(events, events[1:]):
            assert isinstance(a["ts"], int) and isinstance(a["dur"], int) and a["dur"] >= 0
            # Perfetto converts microseconds to integer nanoseconds.
            assert (a["ts"] + a["dur"]) * 1000 <= b["ts"] * 1000, (a, b)
            touching += a["ts"] + a["dur"] == b["ts"]
    assert touching > 100  # the case that used to overlap (slices ending where the next begins)


def test_float_microseconds_would_overlap():
    """Negative control: the old fractional-microsecond slices, truncated to nanoseconds as a
    viewer does, run into their successor on some track of the same simulation."""
    job = load_job("llama3-405b-h100-16384")
    result, _ = simulate_plan(job.model, job.cluster, job.plan)
    by_track = defaultdict(list)
    for rank, track, _, start_s, dur_s in result.events:
        by_track[(rank, track)].append((start_s * 1e6, dur_s * 1e6))
    overlaps = 0
    for slices in by_track.values():
        slices.sort()
        for (ts_a, dur_a), (ts_b, _) in zip(slices, slices[1:]):
            end_ns = int(ts_a * 1000) + int(round(dur_a * 1000))
            overlaps += end_ns > int(ts_b * 1000)
    assert overlaps > 0
