"""The Monte-Carlo engine: agreement with the closed form within Monte-Carlo error, its
optimum against Daly's, and the effects only it models (spares, Weibull, lemons, correlated
failures, retries), each asserted to have fired."""

from __future__ import annotations

import pytest

from trainpilot.sim.availability import (
    AvailabilityJob,
    CheckpointSpec,
    RecoverySpec,
    closed_form,
    daly_interval,
)
from trainpilot.sim.failures import llama3_mix, single_mtbf
from trainpilot.sim.montecarlo import monte_carlo

SIGMAS = 3.0  # "within Monte-Carlo error": |MC - closed form| <= 3 standard errors


def _sigma(result) -> float:
    return (result.ettr_ci95[1] - result.ettr_ci95[0]) / (2 * 1.96)


def _agree(mc, cf) -> None:
    assert abs(mc.ettr - cf.ettr) <= SIGMAS * _sigma(mc), (mc.ettr, cf.ettr, _sigma(mc))


KOKOLIS = dict(num_nodes=2000, duration_h=24 * 90)
KOKOLIS_REC = RecoverySpec(detect_s=0, restart_s=300, restore_storage_s=0, restore_peer_s=0)


@pytest.mark.parametrize("interval_min", [60.0, 5.0])
def test_engines_agree_on_the_kokolis_case(interval_min):
    job = AvailabilityJob(**KOKOLIS)
    failures = single_mtbf(mtbf_h=24 / (2000 * 6.5e-3), num_nodes=2000)
    ck = CheckpointSpec(interval_min=interval_min)
    mc = monte_carlo(job, failures, ck, KOKOLIS_REC, num_trials=400, seed=3, optimize=False)
    cf = closed_form(job, failures, ck, KOKOLIS_REC)
    _agree(mc, cf)
    assert _sigma(mc) < 0.001  # the check is tight enough to mean something


def test_agreement_check_can_fail():
    """Negative control: a closed form with the restart time off by 2 minutes (0.4% of ETTR)
    is rejected by the same 3-sigma check."""
    job = AvailabilityJob(**KOKOLIS)
    failures = single_mtbf(mtbf_h=24 / (2000 * 6.5e-3), num_nodes=2000)
    ck = CheckpointSpec(interval_min=60.0)
    mc = monte_carlo(job, failures, ck, KOKOLIS_REC, num_trials=400, seed=3, optimize=False)
    wrong = closed_form(job, failures, ck, KOKOLIS_REC.replace(restart_s=420))
    assert abs(mc.ettr - wrong.ettr) > SIGMAS * _sigma(mc)


@pytest.mark.parametrize("peer", [False, True])
def test_engines_agree_on_the_llama3_mix(peer):
    """Eighteen classes, cold replacement for hardware, async saves (durable after 2 min)."""
    job = AvailabilityJob(num_nodes=2048, duration_h=24 * 54)
    ck = CheckpointSpec(interval_min=20, stall_s=10, durable_s=120, in_memory_peer=peer,
                        peer_durable_s=5, storage_every=6)
    rec = RecoverySpec()
    mc = monte_carlo(job, llama3_mix(), ck, rec, num_trials=300, seed=5, optimize=False)
    cf = closed_form(job, llama3_mix(), ck, rec)
    _agree(mc, cf)
    assert mc.interruptions == pytest.approx(419, rel=0.01)
    for key, hours in cf.badput_h.items():
        assert mc.badput_h[key] == pytest.approx(hours, rel=0.03, abs=0.5), key
    total = mc.ettr * job.duration_h + sum(mc.badput_h.values())
    assert total == pytest.approx(job.duration_h, rel=1e-9)


@pytest.mark.parametrize("mtbf_min,horizon_h", [(6 * 60, 24 * 365), (15, 24 * 15)])
def test_monte_carlo_optimum_lands_near_daly(mtbf_min, horizon_h):
    """delta = 5 min, R = 10 min: the Monte-Carlo optimum within 10% of Daly's (57, 9.1 min);
    at M = 15 min Young's 12.2 min would be 34% off."""
    job = AvailabilityJob(num_nodes=1, duration_h=horizon_h)
    failures = single_mtbf(mtbf_h=mtbf_min / 60, num_nodes=1)
    rec = RecoverySpec(detect_s=0, restart_s=600, restore_storage_s=0, restore_peer_s=0)
    mc = monte_carlo(job, failures, CheckpointSpec(interval_min=30, stall_s=300), rec,
                     num_trials=60, optimize_trials=60, seed=1)
    daly = daly_interval(5.0, mtbf_min)
    assert abs(mc.optimal_interval_min - daly) / daly < 0.10, (mc.optimal_interval_min, daly)


def _base(nodes=256, days=120):
    return AvailabilityJob(num_nodes=nodes, duration_h=24 * days)


def test_hot_spares_remove_the_replacement_wait_until_the_pool_runs_dry():
    job, mix = _base(), llama3_mix()
    ck = CheckpointSpec(interval_min=20, stall_s=10, durable_s=120)
    cold = monte_carlo(job, mix, ck, RecoverySpec(), num_trials=200, optimize=False)
    ample = monte_carlo(job, mix, ck, RecoverySpec(num_spares=16), num_trials=200,
                        optimize=False)
    dry = monte_carlo(job, mix, ck, RecoverySpec(num_spares=1, repair_h=24 * 30),
                      num_trials=200, optimize=False)
    assert ample.badput_h["spare_wait"] == 0.0
    assert cold.badput_h["spare_wait"] > 10.0
    # One spare with month-long repairs: the pool is empty for most failures, which then take
    # the cold path (the fault fired: spare wait is back, but below the no-spare case).
    assert 0.5 * cold.badput_h["spare_wait"] < dry.badput_h["spare_wait"] < cold.badput_h[
        "spare_wait"]
    assert ample.ettr > dry.ettr > cold.ettr
    # With spares that never run out, the closed form (which assumes so) is exact again.
    _agree(ample, closed_form(job, mix, ck, RecoverySpec(num_spares=16)))


def test_weibull_shape_one_is_exponential_and_infant_mortality_adds_failures():
    job = _base(nodes=64, days=60)
    ck = CheckpointSpec(interval_min=30, stall_s=10, durable_s=60)
    exp = monte_carlo(job, llama3_mix(), ck, RecoverySpec(), num_trials=300, optimize=False)
    w1 = monte_carlo(job, llama3_mix(distribution="weibull", weibull_shape=1.0), ck,
                     RecoverySpec(), num_trials=300, seed=1, optimize=False)
    stationary = monte_carlo(job, llama3_mix(distribution="weibull", weibull_shape=0.5), ck,
                             RecoverySpec(), num_trials=300, seed=2, optimize=False)
    new = monte_carlo(job, llama3_mix(distribution="weibull", weibull_shape=0.5,
                                      weibull_start="new"), ck, RecoverySpec(), num_trials=300,
                      seed=3, optimize=False)
    assert abs(w1.ettr - exp.ettr) <= SIGMAS * (_sigma(w1) ** 2 + _sigma(exp) ** 2) ** 0.5
    # Nodes in service (stationary renewal): the same mean rate as memoryless nodes.
    assert stationary.interruptions == pytest.approx(exp.interruptions, rel=0.05)
    # All nodes new at t = 0 with shape 0.5: burn-in failures come early, well above the
    # long-run rate over a horizon shorter than the per-node MTBF (the fault fired).
    assert new.interruptions > 1.2 * exp.interruptions


def test_lemons_add_failures_and_quarantine_removes_them():
    job = _base(nodes=128, days=60)
    ck = CheckpointSpec(interval_min=30, stall_s=10, durable_s=60)
    mix = llama3_mix()
    base = monte_carlo(job, mix, ck, RecoverySpec(), num_trials=300, optimize=False)
    lemons = monte_carlo(job, llama3_mix(num_lemon_nodes=4, lemon_multiplier=20), ck,
                         RecoverySpec(), num_trials=300, seed=1, optimize=False)
    quarantined = monte_carlo(job, llama3_mix(num_lemon_nodes=4, lemon_multiplier=20,
                                              quarantine_lemons=True), ck, RecoverySpec(),
                              num_trials=300, seed=2, optimize=False)
    extra = 4 * 19 * mix.per_node_per_hour * job.duration_h
    assert lemons.interruptions - base.interruptions == pytest.approx(extra, rel=0.1)
    assert quarantined.interruptions - base.interruptions < 4.5  # each lemon fails once
    assert quarantined.ettr > lemons.ettr


def test_correlated_failures_cost_the_peer_copies():
    """A correlated event loses peers' copies: with peer checkpoints the restore comes from the
    older storage save (more lost work, storage restore time); with storage-only checkpoints
    the lost work does not change."""
    job = _base(nodes=512, days=30)
    peer = CheckpointSpec(interval_min=10, stall_s=5, durable_s=120, in_memory_peer=True,
                          peer_durable_s=5, storage_every=12)
    rec = RecoverySpec(num_spares=64)
    calm = monte_carlo(job, llama3_mix(), peer, rec, num_trials=200, optimize=False)
    storm = monte_carlo(job, llama3_mix(correlated_fraction=0.5), peer, rec, num_trials=200,
                        optimize=False)
    assert storm.badput_h["lost_progress"] > 2 * calm.badput_h["lost_progress"]
    assert storm.badput_h["restore"] > 2 * calm.badput_h["restore"]
    storage = CheckpointSpec(interval_min=10, stall_s=5, durable_s=120)
    s_calm = monte_carlo(job, llama3_mix(), storage, rec, num_trials=200, optimize=False)
    s_storm = monte_carlo(job, llama3_mix(correlated_fraction=0.5), storage, rec,
                          num_trials=200, optimize=False)
    assert s_storm.badput_h["lost_progress"] == pytest.approx(
        s_calm.badput_h["lost_progress"], rel=0.1)


def test_operator_retry_absorbs_transient_faults():
    job = _base(nodes=2048, days=30)
    ck = CheckpointSpec(interval_min=10, stall_s=5, durable_s=60)
    mix = llama3_mix()
    plain = monte_carlo(job, mix, ck, RecoverySpec(), num_trials=200, optimize=False)
    retry = monte_carlo(job, mix, ck, RecoverySpec(retry_fraction=0.8), num_trials=200,
                        optimize=False)
    transient = sum(s for s, c in zip(mix.shares(), mix.classes) if c.transient)
    expected = 0.8 * transient * plain.interruptions
    assert retry.retries == pytest.approx(expected, rel=0.1)
    assert plain.interruptions - retry.interruptions == pytest.approx(expected, rel=0.1)
    assert retry.badput_h["retry"] > 0 and retry.ettr > plain.ettr
    _agree(retry, closed_form(job, mix, ck, RecoverySpec(retry_fraction=0.8)))


@pytest.mark.parametrize("peer,spares,correlated,retry,every", [
    (False, 0, 0.0, 0.0, 1), (True, 0, 0.0, 0.0, 1), (True, 2, 0.5, 0.7, 5),
    (False, 2, 0.5, 0.7, 1), (True, 0, 0.5, 0.0, 5)])
def test_vectorised_walk_equals_the_scalar_oracle(peer, spares, correlated, retry, every):
    """Same events, two implementations of the model (lock-step numpy vs one trial and one
    save cycle at a time): every per-trial total agrees to 1e-9 h."""
    import numpy as np

    from trainpilot.sim.montecarlo import draw_events, walk
    from trainpilot.sim.reference import reference_walk

    job = AvailabilityJob(num_nodes=256, duration_h=24 * 60)
    failures = llama3_mix(correlated_fraction=correlated, distribution="weibull",
                          weibull_shape=0.8, num_lemon_nodes=2)
    rec = RecoverySpec(num_spares=spares, repair_h=100, retry_fraction=retry)
    ck = CheckpointSpec(interval_min=7, stall_s=30, durable_s=400, in_memory_peer=peer,
                        peer_durable_s=20, storage_every=every)
    events = draw_events(np.random.default_rng(1), job, failures, rec, 12)
    fast = walk(events, job, ck, rec, 7.0)
    slow = reference_walk(events, job, ck, rec, 7.0)
    for i, ref in enumerate(slow):
        assert fast.interruptions[i] == ref["interruptions"] > 0
        assert fast.retries[i] == ref["retries"]
        for key, hours in fast.acc.items():
            assert hours[i] == pytest.approx(ref[key], abs=1e-9), (key, i)
    # Negative control: the oracle notices a different interval.
    other = reference_walk(events, job, ck, rec, 8.0)
    assert any(abs(fast.acc["productive"][i] - o["productive"]) > 1e-3
               for i, o in enumerate(other))
