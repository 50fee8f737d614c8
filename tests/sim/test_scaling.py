"""Scaling, time, cost and energy: the arithmetic checked by hand on a stub planner, then one
real run through the cost model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainpilot.sim.availability import CheckpointSpec, RecoverySpec
from trainpilot.sim.failures import llama3_mix
from trainpilot.sim.scaling import CostInputs, grid_planner, scaling_table
from trainpilot.specs import Plan, SpecError, load_cluster, load_model


def _stub_planner(tokens_per_device_s: float, efficiency_per_doubling: float):
    """Throughput = N * rate * eff^(log2(N/64)): a known sub-linear curve."""

    def plan(model, cluster, gbs, seq_len):
        n = cluster.num_devices
        doublings = (n // 64).bit_length() - 1
        tps = n * tokens_per_device_s * efficiency_per_doubling ** doublings
        layout = Plan(dp=n, global_batch_size=gbs * n // 64, seq_len=seq_len)
        return layout, SimpleNamespace(tokens_per_s=tps, step_time_s=gbs * seq_len / tps,
                                       mfu=0.4)

    return plan


def test_time_cost_energy_and_linearity_by_hand():
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x64")
    costs = CostInputs(price_per_device_hour=2.0, pue=1.2, grid_kg_co2_per_kwh=0.5)
    rows = scaling_table(model, cluster, [64, 128, 256], global_batch_size=64, seq_len=8192,
                         total_tokens=1e12, planner=_stub_planner(10_000.0, 0.9), costs=costs)
    assert [r.linearity for r in rows] == pytest.approx([1.0, 0.9, 0.81])
    r = rows[1]
    seconds = 1e12 / (128 * 10_000 * 0.9)
    assert r.train_days == pytest.approx(seconds / 86400)
    assert r.device_hours == pytest.approx(128 * seconds / 3600)
    assert r.cost_usd == pytest.approx(2.0 * 128 * seconds / 3600)
    energy_mwh = 128 * 700 * 1.2 * seconds / 3.6e9  # H100 SXM: 700 W
    assert r.energy_mwh == pytest.approx(energy_mwh)
    assert r.co2_t == pytest.approx(energy_mwh * 0.5)
    assert r.ettr is None and r.wall_days is None


def test_failures_stretch_wall_days_by_one_over_ettr():
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x64")
    availability = (llama3_mix(), CheckpointSpec(stall_s=10, durable_s=120), RecoverySpec())
    rows = scaling_table(model, cluster, [64, 4096], global_batch_size=64, seq_len=8192,
                         total_tokens=1e12, planner=_stub_planner(10_000.0, 1.0),
                         availability=availability)
    for r in rows:
        assert r.wall_days == pytest.approx(r.train_days / r.ettr)
        assert r.cost_usd is None  # the preset has no price and none was given
    assert rows[1].ettr < rows[0].ettr < 1.0  # 64x the nodes, 64x the failure rate
    assert rows[1].interval_min < rows[0].interval_min


def test_real_planner_on_the_cost_model():
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x64")
    rows = scaling_table(model, cluster, [64, 128], global_batch_size=512, seq_len=8192,
                         total_tokens=1e12, planner=grid_planner)
    assert rows[0].linearity == 1.0 and 0.5 < rows[1].linearity <= 1.0 + 1e-9
    assert rows[1].tokens_per_s > rows[0].tokens_per_s
    assert all(0.05 < r.mfu < 0.8 for r in rows)


def test_bad_input():
    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x64")
    with pytest.raises(SpecError, match="devices"):
        scaling_table(model, cluster, [], global_batch_size=64, seq_len=8192,
                      total_tokens=1e12, planner=grid_planner)
    with pytest.raises(SpecError, match="num_devices"):
        scaling_table(model, cluster, [100], global_batch_size=64, seq_len=8192,
                      total_tokens=1e12, planner=grid_planner)
    with pytest.raises(SpecError, match="pue"):
        CostInputs(pue=0.9)
