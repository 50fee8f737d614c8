"""Chaos: faults of every in-process kind at exponential inter-arrival times (seeded), on 2
ranks; the run still ends bit-identical to the uninterrupted one, every fault fired, no
checkpoint is torn and every sample was read exactly once."""

from __future__ import annotations

import pytest

from tests.elastic.helpers import (
    STEPS,
    assert_bit_exact,
    assert_exactly_once,
    assert_no_torn_checkpoint,
    drill,
    journal,
)
from trainpilot.runtime.elastic.chaos import chaos_inject, chaos_schedule

pytestmark = [pytest.mark.dist]


def test_schedule_is_seeded_and_exponential():
    a = chaos_schedule(seed=3, num_steps=10_000, mean_gap_steps=20, world_size=2)
    assert a == chaos_schedule(seed=3, num_steps=10_000, mean_gap_steps=20, world_size=2)
    gaps = [y[0] - x[0] for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    assert 17 < mean < 23  # ~500 gaps: the sample mean is within 3 standard errors of 20
    share_short = sum(g <= 20 * 0.693 for g in gaps) / len(gaps)  # the median of Exp(20)
    assert 0.42 < share_short < 0.58
    assert {k for _, k, _ in a} >= {"crash", "hang", "collective", "nan", "slow"}


@pytest.mark.timeout(180)
def test_chaos_run_ends_bit_identical(tmp_path, tmp_path_factory):
    schedule = chaos_schedule(seed=7, num_steps=STEPS - 1, mean_gap_steps=2.5, world_size=2)
    assert len(schedule) >= 4, schedule
    _, reference = drill(tmp_path_factory.mktemp("chaos_reference"))
    _, outcome = drill(tmp_path, inject=chaos_inject(schedule), timeout_s=160,
                       max_restarts=len(schedule) + 2)
    fired = journal(tmp_path)
    expected = sorted((step, rank) for step, _, rank in schedule)
    assert sorted({(r["step"], r["rank"]) for r in fired}) == expected, (schedule, fired)
    assert_bit_exact(outcome, reference)
    assert_exactly_once(outcome, global_batch=16, steps=STEPS)
    assert_no_torn_checkpoint(tmp_path)
