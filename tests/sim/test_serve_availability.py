"""Serving availability: the remedy ladder, closed form against Monte-Carlo within its interval
(with a negative control), and the blast radius of bigger EP instances."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from trainpilot.sim.failures import llama3_mix, single_mtbf
from trainpilot.sim.serve_availability import (
    Remedy,
    ServeDeployment,
    closed_form,
    monte_carlo,
    standard_remedies,
)

# A stressed deployment (instance MTBF 12 h) so each engine sees thousands of failures.
DEP = ServeDeployment(num_instances=4, nodes_per_instance=4, tokens_per_s_per_instance=1e5,
                      concurrency_per_instance=1000, output_len=500, load=0.8,
                      duration_h=24 * 30)
FAST = single_mtbf(mtbf_h=12.0 * 4, num_nodes=1)  # per node 48 h -> 12 h per 4-node instance


def _within(mc, cf, key, ci_key, sigmas=3.0):
    lo, hi = getattr(mc, ci_key)
    se = (hi - lo) / 2 / 1.96
    return abs(getattr(mc, key) - getattr(cf, key)) <= sigmas * se + 1e-12


@pytest.mark.parametrize("remedy", standard_remedies(nodes_per_instance=4),
                         ids=lambda r: r.name)
def test_closed_form_and_monte_carlo_agree(remedy):
    cf = closed_form(DEP, FAST, remedy)
    mc = monte_carlo(DEP, FAST, remedy, num_trials=150, seed=1)
    assert _within(mc, cf, "availability", "availability_ci95")
    assert _within(mc, cf, "served_fraction", "served_ci95")
    assert _within(mc, cf, "failures_per_day", "failures_ci95")


def test_a_wrong_closed_form_is_rejected():
    """Negative control: the closed form with the outage 30% too long falls outside the
    Monte-Carlo interval of the true one."""
    remedy = standard_remedies(nodes_per_instance=4)[1]
    mc = monte_carlo(DEP, FAST, remedy, num_trials=150, seed=1)
    wrong = closed_form(DEP, FAST, remedy.replace(down_s=remedy.down_s * 1.3))
    assert not _within(mc, wrong, "availability", "availability_ci95")


def test_remedies_lose_or_retry_and_rank_as_expected():
    results = {r.name: closed_form(DEP, FAST, r) for r in standard_remedies(nodes_per_instance=4)}
    in_flight = DEP.concurrency_per_instance * DEP.load
    switch = results["instance switch"]
    assert switch.requests_lost_per_day == pytest.approx(switch.failures_per_day * in_flight)
    assert results["token-level retry"].requests_lost_per_day == 0
    assert results["token-level retry"].requests_retried_per_day > 0
    # Shorter outages, higher availability: switch (20 min) < restart (5 min) < retry (55 s).
    order = [results[k].availability for k in ("instance switch", "in-instance restart",
                                               "token-level retry")]
    assert order == sorted(order)
    mig = results["expert migration"]
    assert mig.extra["state_shares"]["degraded"] > 0  # serves at 3/4 until repaired
    assert mig.slo_attainment > switch.slo_attainment


def test_bigger_instances_have_a_bigger_blast_radius():
    """Same devices and throughput, 16 instances of 2 nodes vs 2 of 16 at 90% load: one
    failure takes 1/16 vs 1/2 of the capacity, so the big instances leave demand unserved."""
    failures = llama3_mix()
    remedy = standard_remedies(nodes_per_instance=2)[0]
    small = ServeDeployment(num_instances=16, nodes_per_instance=2, tokens_per_s_per_instance=1e4,
                            concurrency_per_instance=100, output_len=500, load=0.9)
    big = small.replace(num_instances=2, nodes_per_instance=16, tokens_per_s_per_instance=8e4,
                        concurrency_per_instance=800)
    s, b = closed_form(small, failures, remedy), closed_form(big, failures, remedy)
    assert s.availability == pytest.approx(b.availability, rel=1e-3)  # same node-hours down
    assert 1 - b.served_fraction > 10 * (1 - s.served_fraction)
    # The same failures per day, each with 8x the requests in flight.
    assert b.failures_per_day == pytest.approx(s.failures_per_day, rel=1e-3)
    assert b.requests_lost_per_day == pytest.approx(8 * s.requests_lost_per_day, rel=0.01)


def test_bad_remedy_input():
    with pytest.raises(ValueError, match="degraded_capacity"):
        Remedy(name="x", down_s=1, degraded_capacity=2)


def test_cli_compares_ep_sizes_and_remedies_on_deepseek_v3():
    result = run_cli("simulate", "availability", "--serve", "--model", "deepseek-v3",
                     "--cluster", "h800-x288", "--plan", "deepseek-v3-pd-ep144",
                     "--ep-sizes", "32,144", "--trials", "40", "--days", "20", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["ep"] for r in rows] == [32, 144]
    assert [r["deployment"]["num_instances"] for r in rows] == [9, 2]
    names = {m["remedy"]["name"] for m in rows[0]["remedies"]}
    assert len(names) >= 4 and "expert migration" in names
    for row in rows:
        for m in row["remedies"]:
            lo, hi = m["monte_carlo"]["availability_ci95"]
            half = (hi - lo) / 2
            assert abs(m["monte_carlo"]["availability"] - m["closed_form"]["availability"]) \
                <= 2 * half + 2e-5
    bad = run_cli("simulate", "availability", "--serve", "--model", "deepseek-v3")
    assert bad.returncode == 2 and "needs --model, --cluster and --plan" in bad.stderr
