"""Convergence forecast on curves whose truth is known (the benchmark uses real runs)."""

from __future__ import annotations

import numpy as np
import pytest

from trainpilot.health.forecast import NOISE_K, ConvergenceForecaster, lr_areas
from trainpilot.specs.errors import SpecError

T = 2000


def noisy_power_law(seed=0, noise=0.02):
    rng = np.random.default_rng(seed)
    t = np.arange(1, T + 1)
    truth = 2.0 * t ** -0.4 + 1.5
    return t, truth, truth * np.exp(rng.normal(0, noise, T))


def test_final_loss_and_target_step_from_half_the_curve():
    t, truth, y = noisy_power_law()
    fc = ConvergenceForecaster(total_steps=T).forecast(t[:1000], y[:1000], target_loss=1.6)
    assert fc.model == "power_law" and fc.made_at_step == 1000
    # Measured 1.4 %: only the recent half seen (steps 500-1000) is fitted (SKIP_FRAC), which
    # costs a curve that is the law from step 1 and pays on real curves (their early transient).
    assert abs(fc.final_loss - truth[-1]) / truth[-1] < 0.02
    true_target = int(np.argmax(truth <= 1.6)) + 1  # step 1789, where the curve is flat
    # Measured 1340 (-25 %; 1616 when the whole curve was fitted): 1.4 % on the loss moves the
    # step where a flat curve crosses the target by a quarter.
    assert abs(fc.target_step - true_target) / true_target < 0.3
    assert fc.target_lo <= fc.target_step <= fc.target_hi
    assert fc.band[0][1] <= fc.band[0][2] <= fc.band[0][3] and fc.band[-1][0] == T


def test_intervals_have_roughly_their_nominal_coverage():
    covered = 0
    for seed in range(10):
        t, truth, y = noisy_power_law(seed)
        fc = ConvergenceForecaster(total_steps=T, num_bootstrap=24, seed=seed,
                                   calibration=False).forecast(
            t[:600], y[:600])
        covered += fc.final_lo <= truth[-1] <= fc.final_hi
    assert covered >= 6  # nominal 8 of 10


def test_an_lr_drop_starts_a_new_fit_segment():
    t, truth, y = noisy_power_law(noise=0.005)
    lrs = np.where(t < 800, 1e-3, 5e-4)
    dropped = np.where(t < 800, y, y - 0.1)  # the halving lowers the curve
    fc = ConvergenceForecaster(total_steps=T).forecast(t[:1200], dropped[:1200], lrs=lrs[:1200])
    assert fc.segment_start == 800
    assert abs(fc.final_loss - (truth[-1] - 0.1)) < 0.02
    whole = ConvergenceForecaster(total_steps=T).forecast(t[:1200], dropped[:1200])
    assert whole.segment_start == 1  # negative control: without the LRs it fits across the drop
    assert abs(whole.final_loss - (truth[-1] - 0.1)) > abs(fc.final_loss - (truth[-1] - 0.1))


def test_schedule_aware_model_reduces_to_the_plain_law_at_constant_lr():
    s1, s2 = lr_areas(np.full(10, 2e-3))
    assert s1.tolist() == list(range(1, 11)) and not s2.any()
    s1, s2 = lr_areas(np.array([1.0, 1.0, 0.5, 0.5]))
    assert s1.tolist() == [1.0, 2.0, 2.5, 3.0] and s2[2] == pytest.approx(0.5)
    t, truth, y = noisy_power_law()
    fc = ConvergenceForecaster(total_steps=T, lr_at=lambda s: 1e-3).forecast(t[:1000], y[:1000])
    # S2 = 0: no annealing to identify, so the plain law (in steps, which S1 equals here).
    assert fc.model == "power_law" and abs(fc.final_loss - truth[-1]) / truth[-1] < 0.02


def cosine_lr(s: int) -> float:
    return 1e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * (s - 1) / (T - 1))))


def test_the_data_choose_the_law_when_the_schedule_is_known():
    t = np.arange(1, T + 1)
    s1, s2 = lr_areas(np.array([cosine_lr(s) for s in t]))
    rng = np.random.default_rng(3)
    annealed = 1.5 + 2.0 * s1 ** -0.4 - 2e-4 * s2  # the annealing law's own curve
    seen = int(0.75 * T)
    y = annealed * np.exp(rng.normal(0, 0.005, T))
    fc = ConvergenceForecaster(total_steps=T, lr_at=cosine_lr).forecast(t[:seen], y[:seen])
    assert fc.model == "lr_annealing" and fc.bic["lr_annealing"] < fc.bic["power_law"]
    assert abs(fc.final_loss - annealed[-1]) / annealed[-1] < 0.01
    plain = ConvergenceForecaster(total_steps=T).forecast(t[:seen], y[:seen])
    assert plain.model == "power_law" and not plain.bic.get("lr_annealing")
    # Negative control: the plain law on the annealed curve is further off.
    assert abs(plain.final_loss - annealed[-1]) > 2 * abs(fc.final_loss - annealed[-1])
    # A curve that ignores the decay (the plain law in steps) keeps the plain law, schedule or no:
    # the LR term, the default with a schedule, is refused on the data (BIC 119 worse here).
    steady = (2.0 * t ** -0.4 + 1.5) * np.exp(rng.normal(0, 0.005, T))
    kept = ConvergenceForecaster(total_steps=T, lr_at=cosine_lr).forecast(t[:seen], steady[:seen])
    assert kept.model == "power_law" and kept.bic["power_law"] < kept.bic["lr_annealing"]
    assert kept.bic["power_law"] < kept.bic["lr_noise"] - 6


def wsd_lr(s: int) -> float:
    """Warm-up-stable-decay: constant, then linear to 0 over the last 20 % of the steps."""
    decay_from = 0.8 * T
    return 1e-3 if s <= decay_from else 1e-3 * (T - s) / (T - decay_from)


def test_a_known_cooldown_ahead_is_priced_before_it_starts():
    # A curve whose loss carries a part proportional to the LR (the iterate noise a decay takes
    # off): at half a warm-up-stable-decay run the LR has been constant, so the curve seen
    # cannot show the drop to come; only the schedule can.
    t = np.arange(1, T + 1)
    eta = np.array([wsd_lr(s) for s in t]) / 1e-3
    truth = 1.5 + 2.0 * t ** -0.4 + 0.1 * eta
    y = truth * np.exp(np.random.default_rng(5).normal(0, 0.005, T))
    fc = ConvergenceForecaster(total_steps=T, lr_at=wsd_lr).forecast(t[:1000], y[:1000])
    assert fc.model == "lr_noise" and fc.params["N"] == pytest.approx(
        NOISE_K * np.mean(y[900:1000]))
    # Measured 0.6 % low (the drop priced at NOISE_K x the recent loss, 0.104, against 0.1).
    assert abs(fc.final_loss - truth[-1]) / truth[-1] < 0.02
    band_end = fc.band[-1]
    assert band_end[0] == T and band_end[2] == pytest.approx(fc.final_loss)
    # Negative control: without the schedule the plain law extrapolates the stable phase and
    # misses the cooldown's drop (measured 5.9 % high).
    plain = ConvergenceForecaster(total_steps=T).forecast(t[:1000], y[:1000])
    assert plain.model == "power_law" and (plain.final_loss - truth[-1]) / truth[-1] > 0.04
    # A constant LR has no drop ahead: the LR term is not used.
    flat = ConvergenceForecaster(total_steps=T, lr_at=lambda s: 1e-3).forecast(t[:1000], y[:1000])
    assert flat.model == "power_law"


def test_never_negative_and_an_unforecastable_curve_says_so():
    t = np.arange(1, T + 1)
    rising = 2.0 + 0.001 * t  # a loss going up: nothing to extrapolate
    fc = ConvergenceForecaster(total_steps=T).forecast(t[:500], rising[:500])
    assert fc is not None and not fc.reliable and "not decreasing" in fc.note
    assert fc.final_lo >= 0 and all(lo >= 0 for _, lo, _, _ in fc.band)
    early = ConvergenceForecaster(total_steps=100_000).forecast(t[:300], (2.0 * t ** -0.4 + 1.5)[:300])
    assert not early.reliable and "seen" in early.note
    t2, truth, y = noisy_power_law()
    good = ConvergenceForecaster(total_steps=T).forecast(t2[:1000], y[:1000])
    assert good.reliable and good.note == "" and good.final_loss > 0


def test_shipped_calibration_sets_the_interval_and_can_be_switched_off():
    t, truth, y = noisy_power_law()
    calibrated = ConvergenceForecaster(total_steps=T).forecast(t[:1000], y[:1000])
    bootstrap = ConvergenceForecaster(total_steps=T, calibration=False).forecast(t[:1000], y[:1000])
    assert calibrated.interval_source == "calibrated" and bootstrap.interval_source == "bootstrap"
    assert calibrated.final_loss == bootstrap.final_loss  # the point forecast is the same
    assert calibrated.final_lo <= calibrated.final_loss <= calibrated.final_hi


def test_too_few_points_and_bad_arguments():
    f = ConvergenceForecaster(total_steps=100)
    assert f.forecast(range(1, 11), [1.0] * 10) is None
    with pytest.raises(SpecError):
        ConvergenceForecaster(total_steps=1)
    with pytest.raises(SpecError):
        ConvergenceForecaster(total_steps=10, interval=1.5)


def test_the_recent_half_is_fitted_so_an_early_transient_does_not_bend_the_law():
    # A fast early drop (warm-up, the unigram phase) over a slower power law with no floor in
    # sight, as real short runs show: fitted whole, the saturating law reads the transient's end
    # as the approach to a floor and forecasts too high.
    t = np.arange(1, T + 1)
    rng = np.random.default_rng(5)
    truth = 3.0 * t ** -0.15 + 2.5 * np.exp(-t / 60.0)
    y = truth * np.exp(rng.normal(0, 0.01, T))
    recent = ConvergenceForecaster(total_steps=T).forecast(t[:1000], y[:1000])
    whole = ConvergenceForecaster(total_steps=T, skip_frac=0.05).forecast(t[:1000], y[:1000])
    err_recent = abs(recent.final_loss - truth[-1]) / truth[-1]
    err_whole = abs(whole.final_loss - truth[-1]) / truth[-1]
    print(f"recent half {err_recent:.4f}, whole curve {err_whole:.4f}")
    # Measured 1.4 % (the median of the windows dropping 30, 40 and 50 %; under 1 % from the
    # recent half alone) against 7.3 % fitted whole.
    assert err_recent < 0.02
    assert err_whole > 2 * err_recent  # negative control: fitting the transient costs accuracy


def test_a_floor_the_window_cannot_place_is_not_set_to_zero():
    """On real curves (the benchmark's set 11, development since it was scored) the law fitted
    to the recent half at half the run often runs its floor to 0 and forecasts too low; such a
    fit is refitted with the exponent of fits that did place a floor. Negative control: the
    same forecasts without the refit. One window (the recent half), as when the refit was
    chosen: the default's median of three windows often picks one that placed its floor."""
    import json
    from pathlib import Path

    from trainpilot.health import forecast as fc_mod

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    curves = json.loads((results / "forecast_text_curves_test10.json").read_text())
    truth = json.loads((results / "forecast_text_curves_test10_evals.json").read_text())

    class Floorless(ConvergenceForecaster):
        def _fit(self, x, s2, noise, y, scale, start):
            keep, fc_mod.B_FLOOR_UNSEEN = fc_mod.B_FLOOR_UNSEEN, None
            try:
                return super()._fit(x, s2, noise, y, scale, start)
            finally:
                fc_mod.B_FLOOR_UNSEEN = keep

    errs: dict[str, list[float]] = {"refit": [], "floorless": []}
    refitted = 0
    for name, losses in curves.items():
        n = len(losses) // 2
        for kind, cls in (("refit", ConvergenceForecaster), ("floorless", Floorless)):
            out = cls(total_steps=len(losses), num_bootstrap=0, skip_frac=0.5).forecast(
                np.arange(1, n + 1), losses[:n])
            errs[kind].append(abs(out.final_loss - truth[name]) / truth[name])
            if kind == "refit":
                refitted += out.params["b"] == fc_mod.B_FLOOR_UNSEEN
    refit, floorless = (float(np.median(errs[k])) for k in ("refit", "floorless"))
    print(f"median error at half the run: refit {refit:.3f}, floorless {floorless:.3f}, "
          f"{refitted} of {len(curves)} refitted")
    assert refitted >= len(curves) // 2
    assert refit < 0.06 and floorless > 0.10  # measured 4.2 % and 11.4 %
