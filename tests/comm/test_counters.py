"""Tier 1: the byte model and the per-step counters."""

from __future__ import annotations

import pytest

from trainpilot.runtime.comm import CommCounters, make_comm_hook, wire_bytes
from trainpilot.runtime.comm.counters import union_s
from trainpilot.runtime.comm.topology import Subgroup
from trainpilot.specs import CommOptions, SpecError


def test_ring_byte_model():
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_gather", 1000, 4) == 3000
    assert wire_bytes("all_to_all", 1000, 4) == 750
    assert wire_bytes("all_reduce", 1000, 1) == 0


def test_union_counts_overlapping_buckets_once():
    assert union_s([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union_s([]) == 0.0


def test_counters_close_one_step_at_a_time():
    sub = Subgroup(name="flat", group=None, ranks=(0, 1), nodes=(0, 1), index=0)
    counters = CommCounters(keep=2)
    counters.add_collective("all_reduce", 400, sub)
    counters.add_bucket(400, 0.0, 0.25)
    first = counters.end_step()
    assert (first.step, first.wire_bytes, first.off_node_bytes, first.comm_s) == (0, 400, 400, 0.25)
    assert counters.end_step().num_buckets == 0
    counters.end_step()
    assert len(counters.history) == 2 and counters.last.step == 2


def test_bad_combinations_are_refused_before_any_collective():
    with pytest.raises(SpecError, match="needs a cluster"):
        make_comm_hook(CommOptions(hierarchical=True), None)
    with pytest.raises(SpecError, match="PowerSGD does not compose"):
        make_comm_hook(CommOptions(hierarchical=True, compression="powersgd"), object())
