"""The B200 efficiency data is derived from measured tables, not written by hand: the shipped
curve equals what perf/gemm_table.py derives from OpenXLA's sm_100 table, and the table itself
is intact."""

from __future__ import annotations

import math

import pytest

from trainpilot.perf import gemm_table
from trainpilot.perf.hardware import FP8_GEMM_SHARE, device_model, load_curves
from trainpilot.specs import ClusterSpec
from trainpilot.specs.presets import cluster_preset


def test_table_holds_every_shape_once_with_whole_nanosecond_timings():
    for arch in ("sm_90", "sm_100"):
        rows = gemm_table.table(arch)
        assert len(rows) == 375  # b in {1, 2, 4} x m, n, k in {256 .. 4096}
        for flops, rate in rows:
            ns = flops / rate * 1e9  # XLA stores 2bmnk / (whole ns): a mistyped digit breaks it
            assert abs(ns - round(ns)) < 1e-3 * max(1.0, ns / 1e4)
    with pytest.raises(ValueError, match="sm_90, sm_100"):
        gemm_table.table("sm_80")


def test_shipped_b200_curve_is_the_derived_one():
    b200 = load_curves()["b200"]
    assert b200.gemm_points == gemm_table.b200_points()
    assert gemm_table.saturation_share("hopper") == pytest.approx(gemm_table.H100_CURVE_END)
    assert load_curves()["h100"].gemm_points[-1][1] == gemm_table.H100_CURVE_END
    assert b200.fp8_gemm_share == pytest.approx(gemm_table.b200_fp8_share(), abs=1e-4)
    # Its large-GEMM efficiency is the sustained rate, below the best-shape burst (MAMF 0.776).
    assert b200.gemm_efficiency(1e12) < gemm_table.MAMF_SHARE["b200"]["bf16"] * 0.7


def test_same_method_on_the_sm90_table_gives_the_h100_curve():
    """The h100 curve was built from an older sm_90 table by the same binning and its share: on
    this table's large GEMMs (where training spends its time) the method lands within 10%."""
    h100 = load_curves()["h100"]
    derived = dict(gemm_table.derived_points("sm_90", 989e12, gemm_table.H100_SUSTAINED_SHARE))
    for x in (9.5, 10.0, 10.5, 11.0, 11.5):
        assert derived[x] == pytest.approx(h100.gemm_efficiency(10 ** x), rel=0.10)


def test_b200_runs_a_large_gemm_at_its_measured_sustained_ratio_to_an_h100():
    """Measured sustained best-shape matmul rates (MSMF, all 8 GPUs busy): B200 / H200 = 2.04.
    The curve's end keeps that ratio to the h100 curve's end; the vendor-level curve this
    replaced gave 2.7x (0.74 of 2,250 against 0.618 of 989)."""
    def rate(name: str, flops: float) -> float:
        cluster = ClusterSpec.model_validate(cluster_preset(f"{name}-x8"))
        dev = device_model(cluster, "bf16")
        return dev.peak_flops * dev.curve.gemm_efficiency(flops)

    assert rate("b200", 1e13) / rate("h100-sxm", 1e13) == pytest.approx(1426.4 / 698.6, rel=0.01)
    # Mid-size GEMMs gain less: the table's median shapes sit further below the B200's best.
    assert 1.6 < rate("b200", 1e11) / rate("h100-sxm", 1e11) < 1.9


def test_fp8_share_is_per_device_family():
    b200 = ClusterSpec.model_validate(cluster_preset("b200-x8"))
    h100 = ClusterSpec.model_validate(cluster_preset("h100-sxm-x8"))
    assert device_model(h100, "fp8").fp8_flops == pytest.approx(1979e12 * FP8_GEMM_SHARE)
    share = gemm_table.b200_fp8_share()
    assert device_model(b200, "fp8").fp8_flops == pytest.approx(4500e12 * 0.8983, rel=1e-4)
    assert FP8_GEMM_SHARE < share < 1.0
    assert math.isclose(share, FP8_GEMM_SHARE * (0.7628 / 0.7756) / (0.7344 / 0.8033), rel_tol=1e-3)
