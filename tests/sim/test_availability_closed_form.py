"""Closed forms against the published numbers (Daly 2006, Kokolis et al. 2024), with negative
controls showing each check can fail."""

from __future__ import annotations

import math

import pytest

from trainpilot.sim.availability import (
    AvailabilityJob,
    CheckpointSpec,
    RecoverySpec,
    closed_form,
    closed_form_ettr,
    daly_interval,
    daly_wall_time,
    kokolis_ettr,
    young_interval,
)
from trainpilot.sim.failures import LLAMA3_TABLE5, llama3_mix, single_mtbf
from trainpilot.specs.errors import SpecError
from trainpilot.specs.loading import validate

# Daly 2006, sec. 6 example: delta = 5 min, R = 10 min; published optima 117, 57, 9.1 minutes.
DALY_CASES = [(24 * 60, 117.0), (6 * 60, 57.0), (15, 9.1)]


def _daly_job(mtbf_min: float):
    job = AvailabilityJob(num_nodes=1, duration_h=24 * 365)
    failures = single_mtbf(mtbf_h=mtbf_min / 60, num_nodes=1)
    rec = RecoverySpec(detect_s=0, restart_s=600, restore_storage_s=0, restore_peer_s=0)
    return job, failures, rec


@pytest.mark.parametrize("mtbf_min,published", DALY_CASES)
def test_daly_higher_order_optimum_matches_the_paper(mtbf_min, published):
    got = daly_interval(5.0, mtbf_min)
    assert abs(got - published) / published < 0.05, (got, published)


@pytest.mark.parametrize("mtbf_min,published", DALY_CASES)
def test_exact_renewal_optimum_matches_daly(mtbf_min, published):
    """Our closed-form engine maximises the exact ETTR numerically; it lands on Daly's value."""
    job, failures, rec = _daly_job(mtbf_min)
    result = closed_form(job, failures, CheckpointSpec(interval_min=30, stall_s=300), rec)
    assert abs(result.optimal_interval_min - published) / published < 0.05
    assert result.extra["exact"]


def test_young_first_order_fails_the_daly_band_at_short_mtbf():
    """Negative control: Young's sqrt(2 delta M) is 12.2 min for M = 15 min, 34% above Daly's
    9.1 — the 5% (and 10%) bands used above do reject a wrong optimum."""
    young = young_interval(5.0, 15.0)
    assert abs(young - 9.1) / 9.1 > 0.10


def test_exact_form_reduces_to_daly_wall_time():
    """One class, no durability delay: ETTR = T_s / T_w with Daly's eq. 20."""
    job, failures, rec = _daly_job(6 * 60)
    for interval in (20.0, 57.0, 150.0):
        ettr, _ = closed_form_ettr(job, failures, CheckpointSpec(interval_min=interval,
                                                                  stall_s=300), rec)
        wall = daly_wall_time(1000.0, interval, 5.0, 10.0, 360.0)
        assert ettr == pytest.approx(1000.0 / wall, rel=1e-12)


@pytest.mark.parametrize("interval_min,published", [(60.0, 0.68), (5.0, 0.93)])
def test_kokolis_first_order_ettr(interval_min, published):
    """2,000 nodes at 6.5 failures per 1,000 node-days, 5-min restart, non-blocking saves."""
    got = kokolis_ettr(num_nodes=2000, failures_per_node_day=6.5e-3, restart_min=5.0,
                       interval_min=interval_min)
    assert got == pytest.approx(published, abs=0.006)


def test_kokolis_is_the_linearisation_of_the_exact_form():
    """At 5 min the first-order form is within 0.3% of the exact renewal result; at 60 min it is
    0.036 low (it drops the higher-order terms of exp(lambda tau)); the gap shrinks as the
    failure rate does."""
    job = AvailabilityJob(num_nodes=2000, duration_h=24 * 365)
    failures = single_mtbf(mtbf_h=24 / (2000 * 6.5e-3), num_nodes=2000)
    rec = RecoverySpec(detect_s=0, restart_s=300, restore_storage_s=0, restore_peer_s=0)
    exact5, _ = closed_form_ettr(job, failures, CheckpointSpec(interval_min=5), rec)
    exact60, _ = closed_form_ettr(job, failures, CheckpointSpec(interval_min=60), rec)
    k5 = kokolis_ettr(num_nodes=2000, failures_per_node_day=6.5e-3, restart_min=5,
                      interval_min=5)
    k60 = kokolis_ettr(num_nodes=2000, failures_per_node_day=6.5e-3, restart_min=5,
                       interval_min=60)
    assert abs(exact5 - k5) < 0.003
    assert 0.03 < exact60 - k60 < 0.04
    rare = single_mtbf(mtbf_h=10 * 24 / (2000 * 6.5e-3), num_nodes=2000)
    exact_rare, _ = closed_form_ettr(job, rare, CheckpointSpec(interval_min=60), rec)
    k_rare = kokolis_ettr(num_nodes=2000, failures_per_node_day=6.5e-4, restart_min=5,
                          interval_min=60)
    assert abs(exact_rare - k_rare) < 0.001


def test_llama3_mix_is_table5():
    counts = [count for _, count, _, _ in LLAMA3_TABLE5]
    assert sum(counts) == 419 and len(counts) == 18
    assert counts[:5] == [148, 72, 54, 35, 32]
    mix = llama3_mix()
    # 419 interruptions in 54 days on 2,048 nodes: one every 3.09 hours.
    assert mix.mtbf_h(2048) == pytest.approx(54 * 24 / 419)
    assert sum(mix.shares()) == pytest.approx(1.0)


def test_badput_shares_sum_to_one():
    job = AvailabilityJob(num_nodes=2048, duration_h=24 * 54)
    ck = CheckpointSpec(interval_min=20, stall_s=10, durable_s=120)
    result = closed_form(job, llama3_mix(), ck, RecoverySpec())
    total = result.ettr * job.duration_h + sum(result.badput_h.values())
    assert total == pytest.approx(job.duration_h, rel=1e-9)
    assert result.interruptions == pytest.approx(419, rel=1e-9)


def test_bad_inputs_name_the_field():
    with pytest.raises(SpecError, match=r"^checkpoint\.interval_min: got 0\.5"):
        validate(CheckpointSpec, dict(interval_min=0.5, durable_s=120), doc="checkpoint")
    with pytest.raises(SpecError, match="distribution"):
        closed_form(AvailabilityJob(num_nodes=4), llama3_mix(distribution="weibull"),
                    CheckpointSpec(), RecoverySpec())
    with pytest.raises(SpecError, match="mtbf_h"):
        single_mtbf(mtbf_h=0, num_nodes=4)
    assert math.isfinite(daly_interval(30.0, 10.0))  # delta >= 2M: tau = M
