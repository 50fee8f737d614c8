"""Convergence forecast: fit the loss curve so far, predict the final loss and when a target is hit.

Model (saturating power law): ``L(t) = a * t^(-b) + c``. Where the learning-rate schedule is known
(``lr_at``) and the LR still changes between the points fitted and the end, the law carries the
loss's LR-proportional part, ``+ N * lr_t / lr_peak`` with ``N = NOISE_K * L_ref`` fixed (model
"lr_noise", after Luo et al. 2025's multi-power law in its fast-saturation limit; see
``NOISE_K``), so a decay still ahead (a warm-up-stable-decay cooldown) is priced before it
shows. Past half the schedule's annealing area the annealing law is fitted as well: time is the
schedule's area and the annealing bonus is modelled, after Tissue et
al. 2024 ("Scaling law with learning rate annealing"): ``L = c + a * S1^(-b) - C * S2`` with
``S1(t) = sum_{i<=t} lr_i / lr_peak`` and ``S2(t) = sum_{i<=t} m_i``, ``m_i = lambda * m_{i-1} +
(lr_{i-1} - lr_i) / lr_peak`` (lambda = 0.999; warm-up's rises are not annealing). ``C`` is fitted
only once the curve has seen half of the final S2 (``ANNEAL_MIN_FRAC``; model "lr_annealing"); before, C = 0 and only
the time axis is the schedule's area ("lr_area"). With a constant LR this is the plain law.

Fit: the first ``skip_frac`` (half) of the curve seen is dropped and the recent half is fitted;
by default the forecast is the median of the forecasts from three such windows (``SKIP_FRACS``).
The first half, with warm-up and the fast early transient, follows other dynamics: fitted with
it, the saturating law read the transient's end as the approach to a floor and forecast too high
(median error at half the run over the 36 development runs of ``benchmarks/forecast_coverage.py``:
6.8 %, against 2.5 % from the recent half). The points are averaged into at most ``max_points``
equal-width bins, and ``log L`` is fitted (relative error, so the early high-loss points do not
dominate) with ``scipy.optimize.least_squares``; a fit whose floor runs to zero (a window
that cannot place the floor) is refitted with the exponent fixed (``B_FLOOR_UNSEEN``) unless the
data prefer the floorless law strongly. Uncertainty: a moving-
block bootstrap of the fit's residuals (blocks keep their autocorrelation), ``num_bootstrap``
refits, percentile interval; where the shipped calibration table
(``data/forecast_calibration.json``, fitted by ``benchmarks/forecast_coverage.py --calibrate`` on
curves of real text) covers the model, the interval is instead the point forecast times
``exp([q_lo, q_hi])``, a random-effects prediction interval of log(truth / forecast) at the
same fraction of the run seen, for a new run of a new set of runs (sets of other sizes, LRs and
seeds differ by more than runs within a set; a bootstrap of the fit's residuals cannot see the error of the
functional form, so it was overconfident: 3 of 6 and 0 of 6 covered on real curves). With a
known schedule the plain law is fitted beside the default "lr_noise" law, and past half the
annealing area the annealing law too; another law replaces the default only when its BIC is
lower by more than ``BIC_STRONG``. Forecasts
are never negative; one the forecaster cannot stand behind (a loss that is not decreasing, a fit
at its bounds, less than 10 % of the run seen, an interval wider than the forecast) carries
``reliable=False`` and a ``note`` saying why. Refit after LR-schedule changes: without ``lr_at``, an observed step
change of the LR (> 10 % in one step, e.g. "halve on plateau") starts a new segment, and only the
points after the last change are fitted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from trainpilot.specs.errors import SpecError

CALIBRATION_PATH = Path(str(resources.files("trainpilot.health") / "data"
                            / "forecast_calibration.json"))
MIN_SEEN_FRAC = 0.10  # a forecast from less of the run is marked unreliable

ANNEAL_DECAY = 0.999
# Fit the schedule-aware law only once the curve has seen this share of the final annealing area
# S2; before that the plain law in steps is used. Chosen on the calibration runs of
# benchmarks/forecast_coverage.py (median error at 50 % of the run: plain 3.1 %, schedule area
# without the annealing term 5.9 %, with it 11.8 %; at 75 %, past half the decay: 0.9 % with it).
ANNEAL_MIN_FRAC = 0.5
LR_JUMP = 0.10  # relative one-step LR change that starts a new fit segment
# Share of the curve seen that is dropped before fitting: the law is fitted to the recent half.
# Chosen on the 36 development runs of benchmarks/forecast_coverage.py (median error at half the
# run, plain law: dropping 5 % 6.8 %, 30 % 2.5 %, 40 % 1.8 %, 50 % 2.5 %, 60 % 5.0 %, 70 % 4.5 %:
# past the half too few points remain against the step-to-step noise). Later segments (after an
# LR step change) are fitted whole.
SKIP_FRAC = 0.5
# Where the fitted window starts is a choice the curve cannot make, and the forecast at half the
# run moved with it by more than its error (on the 144 development runs of sets 1-12, dropping
# 30 / 35 / 40 / 45 / 50 % gave median errors at half the run of 3.1 / 3.4 / 2.3 / 3.5 / 3.2 %,
# one set's 0.5 % at 40 % and 8.8 % at 45 %: a floor placed or not by a few points at the
# window's edge). The forecast is therefore the median of the forecasts from three windows,
# dropping these shares (bagging over the arbitrary choice, not picking its best value): 2.45 %
# on those runs, no set's median above 4.1 % (one window, 50 %: 7.5 %).
SKIP_FRACS = (0.3, 0.4, SKIP_FRAC)
BIC_STRONG = 6.0  # "strong" evidence for the law with more parameters (Kass & Raftery 1995)
# The loss's LR-proportional part. At a learning rate the iterates keep a noise that holds the
# loss above the floor of the valley they travel, by an amount that grows with the LR; a decay
# takes it off (the drop at a cooldown). Luo et al. 2025 ("A Multi-Power Law for Loss Curve
# Prediction Across Learning Rate Schedules") model the loss reduction of a decay as
# proportional to each LR drop, saturating over the steps after it; taken here in its
# fast-saturation limit: the law in steps plus NOISE_K * L_ref * lr_t / lr_peak, with L_ref the
# mean loss of the last tenth of the curve seen and NOISE_K fixed, not fitted (with a constant
# LR in the window seen, as before a warm-up-stable-decay cooldown, the curve cannot tell it).
# Chosen on the 84 development runs of benchmarks/forecast_coverage.py as the value at which
# warm-up-stable-decay and cosine runs are forecast with the same mean error at half the run
# (their mean log(truth / forecast) apart by 4.8 % at NOISE_K = 0, the plain law, which forecast
# warm-up-stable-decay high by the cooldown it had not seen; 1.7 % at 0.04, 0.9 % at 0.05, 0.0 %
# at 0.06). The default wherever the schedule is known (``lr_at``); the plain law replaces it
# when the data prefer it strongly (a curve that does not follow its LR).
NOISE_K = 0.06
# When the window seen cannot place the floor, the three-parameter fit runs c to its bound, 0:
# a pure power law with a shallow exponent (b ~ 0.3), which keeps falling as no loss curve does
# (the loss has a floor above zero) and forecasts too low. On the 132 development runs of
# benchmarks/forecast_coverage.py (sets 1-11), 73 of the forecasts at half the run ended at
# c = 0, and they sat 5.1 % below the truth (median), where the others sat 2.1 % above; sets 10
# and 11, every one of whose forecasts at half the run was 9-16 % low, were nearly all of that
# kind. Such a fit is refitted with the exponent fixed at B_FLOOR_UNSEEN, the median exponent of
# the development fits that did place a floor (0.92 at half the run, 0.95 at three quarters:
# their interquartile range 0.62-1.14), so the floor and the scale come from the data and the
# curvature from curves whose floor was seen.
B_FLOOR_UNSEEN: float | None = 0.93  # None: keep the floorless fit (tests)


@dataclass(frozen=True, kw_only=True)
class Forecast:
    """A forecast made at ``made_at_step`` of the loss at ``total_steps`` (and of a target)."""

    made_at_step: int
    total_steps: int
    model: str  # "power_law", "lr_noise", "lr_area" or "lr_annealing"
    final_loss: float
    final_lo: float
    final_hi: float
    interval: float  # e.g. 0.8 for a 10-90 % interval
    params: dict[str, float]
    segment_start: int
    target_loss: float | None = None
    target_step: int | None = None  # None: not reached within 10x the budget
    target_lo: int | None = None
    target_hi: int | None = None
    band: list[tuple[int, float, float, float]] = field(default_factory=list)  # step, lo, mid, hi
    reliable: bool = True
    note: str = ""  # why it is not reliable (empty when it is)
    interval_source: str = "bootstrap"  # or "calibrated" (the shipped table)
    bic: dict[str, float] = field(default_factory=dict)  # BIC of each law fitted

    def to_dict(self) -> dict:
        return asdict(self)


def lr_areas(lrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2) per step for a learning-rate sequence (index 0 = step 1), normalised by the peak."""
    peak = float(np.max(lrs)) or 1.0
    eta = lrs / peak
    s1 = np.cumsum(eta)
    drops = np.maximum(-np.diff(eta, prepend=eta[0]), 0.0)  # warm-up is not annealing
    momentum = np.empty_like(eta)
    m = 0.0
    for i, drop in enumerate(drops):
        m = ANNEAL_DECAY * m + drop
        momentum[i] = m
    return s1, np.cumsum(momentum)


@lru_cache(maxsize=1)
def load_calibration() -> dict[str, Any] | None:
    """The shipped interval calibration table, or None when absent."""
    try:
        return json.loads(CALIBRATION_PATH.read_text())
    except (OSError, ValueError):
        return None


def calibrated_quantiles(table: dict[str, Any], kind: str, fraction: float,
                         ) -> tuple[float, float] | None:
    """(q_lo, q_hi) of log(truth / forecast) for a model kind at a fraction of the run seen,
    interpolated in the fraction (clamped to the table's range)."""
    entries = sorted(table.get("kinds", {}).get(kind, []), key=lambda e: e["fraction"])
    if not entries:
        return None
    fracs = [e["fraction"] for e in entries]
    f = min(max(fraction, fracs[0]), fracs[-1])
    return (float(np.interp(f, fracs, [e["q_lo"] for e in entries])),
            float(np.interp(f, fracs, [e["q_hi"] for e in entries])))


class ConvergenceForecaster:
    """Fits loss curves and forecasts the loss at ``total_steps``.

    ``lr_at(step) -> lr`` (optional) is the planned schedule for steps 1..total_steps.
    ``calibration``: the interval table (None: the shipped one; False: none, bootstrap only).
    """

    def __init__(self, *, total_steps: int, lr_at: Callable[[int], float] | None = None,
                 num_bootstrap: int = 32, max_points: int = 80,
                 skip_frac: float | Sequence[float] = SKIP_FRACS,
                 interval: float = 0.8, seed: int = 0, calibration: Any = None):
        if total_steps < 2:
            raise SpecError("total_steps", total_steps, "valid: an integer >= 2")
        if not 0 < interval < 1:
            raise SpecError("interval", interval, "valid: a fraction in (0, 1), e.g. 0.8")
        self.total_steps, self.num_bootstrap = total_steps, num_bootstrap
        fracs = (skip_frac,) if isinstance(skip_frac, (int, float)) else tuple(skip_frac)
        if not fracs or not all(0 <= f < 1 for f in fracs):
            raise SpecError("skip_frac", skip_frac, "valid: shares in [0, 1), e.g. 0.5")
        self.max_points, self.skip_fracs, self.interval = max_points, fracs, interval
        self._rng = np.random.default_rng(seed)
        self.calibration = load_calibration() if calibration is None else (
            calibration or None)
        self._areas = None
        self._eta: np.ndarray | None = None  # lr / peak lr per step, when the schedule is known
        self._noise = 0.0  # NOISE_K * L_ref of the forecast being made (0: no LR term)
        if lr_at is not None:
            lrs = np.array([float(lr_at(s)) for s in range(1, total_steps + 1)])
            self._areas = lr_areas(lrs)
            self._eta = np.diff(self._areas[0], prepend=0.0)  # S1's steps: lr / peak lr
        # scipy.optimize takes about 0.7 s to import: pay it here, before training starts, not
        # inside whichever step makes the first forecast (it stalled that step by 20x).
        import scipy.optimize  # noqa: F401

    # ------------------------------------------------------------------ the model
    def _features(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(time, annealing area S2, the LR term) at ``steps`` for the model being fitted."""
        index = np.clip(steps.astype(int) - 1, 0, self.total_steps - 1)
        if self._areas is None:
            noise = (self._noise * self._eta[index] if self._noise and self._eta is not None
                     else np.zeros(len(steps)))
            return steps.astype(np.float64), np.zeros(len(steps)), noise
        return self._areas[0][index], self._areas[1][index], np.zeros(len(steps))

    @staticmethod
    def _curve(p: np.ndarray, x: np.ndarray, s2: np.ndarray, noise: np.ndarray,
               scale: float) -> np.ndarray:
        a, b, c = p[0], p[1], p[2]
        anneal = p[3] * s2 if len(p) > 3 else 0.0
        return c + a * np.power(x / scale, -b) - anneal + noise

    def _fit(self, x, s2, noise, y, scale, start) -> np.ndarray:
        from scipy.optimize import least_squares  # imported by __init__ already

        anneal = len(start) > 3
        lo = [1e-9, 1e-3, 0.0] + ([0.0] if anneal else [])
        hi = [np.inf, 3.0, max(float(np.min(y - noise)) * 0.999, 2e-12)] + (
            [np.inf] if anneal else [])
        start = np.clip(start, np.array(lo) + 1e-12, np.array(hi) - 1e-12)

        u, log_y = x / scale, np.log(y)
        log_u = np.log(u)

        def residual(p):
            return np.log(np.maximum(self._curve(p, x, s2, noise, scale), 1e-9)) - log_y

        def jacobian(p):
            power = np.power(u, -p[1])
            inv = 1.0 / np.maximum(self._curve(p, x, s2, noise, scale), 1e-9)
            cols = [power * inv, -p[0] * power * log_u * inv, inv]
            if len(p) > 3:
                cols.append(-s2 * inv)
            return np.stack(cols, axis=1)

        p = least_squares(residual, start, jac=jacobian, bounds=(lo, hi), method="trf",
                          max_nfev=100).x
        if B_FLOOR_UNSEEN is None or p[2] > 1e-6 * hi[2]:
            return p
        # The floor ran to its bound: refit a, c (and C) with b = B_FLOOR_UNSEEN (see there).
        keep = [0, 2] + ([3] if anneal else [])

        def full(q):
            out = np.array(p, dtype=np.float64)
            out[keep] = q
            out[1] = B_FLOOR_UNSEEN
            return out

        def residual_b(q):
            return residual(full(q))

        def jacobian_b(q):
            return jacobian(full(q))[:, keep]

        q0 = np.clip(p[keep], np.array(lo)[keep] + 1e-12, np.array(hi)[keep] - 1e-12)
        q0[1] = 0.5 * hi[2]  # start the floor inside its range, not at the bound it ran to
        q = least_squares(residual_b, q0, jac=jacobian_b,
                          bounds=(np.array(lo)[keep], np.array(hi)[keep]), method="trf",
                          max_nfev=100).x
        # Both fits have the same free parameters (the floorless one's c is pinned at its bound):
        # the floorless law stays only where the data prefer it strongly (a BIC lower by more
        # than BIC_STRONG, i.e. n log(SSE ratio) < -6), as a curve that really has no floor in
        # sight does.
        floored = full(q)
        sse_free, sse_floor = (float(np.sum(residual(v) ** 2)) for v in (p, floored))
        if len(y) * math.log(max(sse_free, 1e-300) / max(sse_floor, 1e-300)) < -BIC_STRONG:
            return p
        return floored

    # ------------------------------------------------------------------ forecasting
    def segment_start(self, steps: np.ndarray, lrs: Sequence[float] | None) -> int:
        """Index of the first point after the last observed LR step change (0 when none)."""
        if self._areas is not None or lrs is None or len(lrs) < 2:
            return 0
        lr = np.asarray(lrs, dtype=np.float64)
        prev = np.maximum(np.abs(lr[:-1]), 1e-30)
        jumps = np.flatnonzero(np.abs(lr[1:] - lr[:-1]) / prev > LR_JUMP)
        return int(jumps[-1] + 1) if len(jumps) else 0

    def _bins(self, steps: np.ndarray, losses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        keep = np.isfinite(losses) & (losses > 0)
        steps, losses = steps[keep], losses[keep]
        num_bins = min(self.max_points, len(steps))
        edges = np.linspace(steps[0], steps[-1] + 1e-9, num_bins + 1)
        which = np.clip(np.searchsorted(edges, steps, side="right") - 1, 0, num_bins - 1)
        counts = np.bincount(which, minlength=num_bins)
        ok = counts > 0
        x = np.bincount(which, weights=steps, minlength=num_bins)[ok] / counts[ok]
        y = np.bincount(which, weights=losses, minlength=num_bins)[ok] / counts[ok]
        return x, y

    def forecast(self, steps: Sequence[int], losses: Sequence[float], *,
                 lrs: Sequence[float] | None = None,
                 target_loss: float | None = None) -> Forecast | None:
        """Forecast from the curve so far; ``None`` until there are 20 usable points."""
        all_steps = np.asarray(steps, dtype=np.float64)
        all_losses = np.asarray(losses, dtype=np.float64)
        start = self.segment_start(all_steps, lrs)
        # One window per share dropped (SKIP_FRACS); a later segment is fitted whole.
        windows = sorted({int(f * len(all_steps)) for f in self.skip_fracs}) if start == 0 \
            else [0]
        windows = [w for w in windows
                   if np.isfinite(all_losses[start + w:]).sum() >= 20] or windows[:1]
        if np.isfinite(all_losses[start + windows[0]:]).sum() < 20:
            return None
        if len(windows) == 1:
            return self._forecast_window(all_steps, all_losses, start, windows[0], steps,
                                         losses, target_loss, self.num_bootstrap)
        # The median window's forecast (its point forecast found without the bootstrap first).
        points = [self._forecast_window(all_steps, all_losses, start, w, steps, losses, None, 0)
                  for w in windows]
        order = np.argsort([p.final_loss for p in points])
        median = windows[int(order[len(order) // 2])]
        return self._forecast_window(all_steps, all_losses, start, median, steps, losses,
                                     target_loss, self.num_bootstrap)

    def _forecast_window(self, all_steps, all_losses, start, skip, steps, losses, target_loss,
                         num_bootstrap) -> Forecast:
        """The forecast from the points after the first ``skip`` of the segment from ``start``."""
        steps_a, losses_a = all_steps[start + skip:], all_losses[start + skip:]
        first = min(max(int(steps_a[0]) - 1, 0), self.total_steps - 1)
        if self._eta is not None and np.ptp(self._eta[first:]) > 1e-6:
            # The LR changes between the points fitted and the end: the LR term, its size from
            # the recent loss (NOISE_K above). With a constant LR it would only shift the floor.
            seen = np.asarray(losses, dtype=np.float64)[start:]
            seen = seen[np.isfinite(seen)]
            self._noise = NOISE_K * float(np.mean(seen[-max(5, len(seen) // 10):]))
        xs, ys = self._bins(steps_a, losses_a)
        areas = self._areas
        if areas is not None:
            seen = areas[1][min(int(xs[-1]) - 1, self.total_steps - 1)]
            if seen < ANNEAL_MIN_FRAC * max(float(areas[1][-1]), 1e-12):
                self._areas = None  # too early to identify the schedule's effect: plain law
        kept, self.num_bootstrap = self.num_bootstrap, num_bootstrap
        try:
            return self._forecast_binned(xs, ys, steps, steps_a, start, target_loss)
        finally:
            self._areas, self._noise, self.num_bootstrap = areas, 0.0, kept

    def _forecast_binned(self, xs, ys, steps, steps_a, start, target_loss) -> Forecast:
        # The default is the law in steps, with its LR term where the schedule is known
        # ("lr_noise"); the plain law (no LR term) and, past ANNEAL_MIN_FRAC, the annealing law
        # (one parameter more) replace it only on "strong" evidence, a BIC on the binned log
        # losses lower by more than 6 (Kass & Raftery 1995): on the development runs the
        # annealing law won by 1-5.5 three times and each time extrapolated 7-10 % low where the
        # plain law was within 2 %.
        areas, noise = self._areas, self._noise
        self._areas = None
        chosen = self._fit_candidate(xs, ys)
        candidates = [chosen]
        if noise:
            self._noise = 0.0
            candidates.append(self._fit_candidate(xs, ys))
            self._noise = noise
            if candidates[-1]["bic"] < chosen["bic"] - BIC_STRONG:
                chosen = candidates[-1]
        if areas is not None:
            self._areas = areas
            candidates.append(self._fit_candidate(xs, ys))
            if candidates[-1]["bic"] < chosen["bic"] - BIC_STRONG:
                chosen = candidates[-1]
        self._areas = chosen["areas"]
        self._noise = noise if chosen["model"] == "lr_noise" else 0.0
        x, s2, noise = chosen["x"], chosen["s2"], chosen["noise"]
        scale, best = chosen["scale"], chosen["p"]
        samples = [best] + [self._fit(x, s2, noise, chosen["fitted"] * np.exp(
            self._block_resample(chosen["residuals"])), scale, best)
            for _ in range(self.num_bootstrap)]
        out = self._summarise(samples, scale, int(steps_a[-1]), int(steps[start]),
                              target_loss, chosen["model"])
        out = replace(out, bic={c["model"]: round(c["bic"], 2) for c in candidates})
        return self._judge(out, ys)

    def _fit_candidate(self, xs, ys) -> dict[str, Any]:
        """Fit the current model (``self._areas``: schedule-aware or not) to the binned curve."""
        x, s2, noise = self._features(xs)
        scale = float(x[-1])
        # The annealing term is fitted only once the curve has seen enough of the LR decay to
        # identify it; before that, C = 0 (time is still the schedule's area S1): extrapolating a
        # C fitted on an almost constant S2 gave absurd, even negative, losses.
        anneal = (self._areas is not None
                  and s2[-1] >= ANNEAL_MIN_FRAC * max(float(self._areas[1][-1]), 1e-12))
        base = ys - noise
        p0 = np.array([max(base[0] - 0.9 * base.min(), 1e-3), 0.5, 0.9 * float(base.min())]
                      + ([0.0] if anneal else []))
        best = self._fit(x, s2, noise, ys, scale, p0)
        fitted = self._curve(best, x, s2, noise, scale)
        residuals = np.log(ys) - np.log(np.maximum(fitted, 1e-9))
        n = len(ys)
        bic = n * math.log(max(float(np.mean(residuals ** 2)), 1e-300)) + len(best) * math.log(n)
        model = (("lr_noise" if noise.any() else "power_law") if self._areas is None else
                 "lr_annealing" if anneal else "lr_area")
        return dict(areas=self._areas, x=x, s2=s2, noise=noise, scale=scale, p=best,
                    fitted=fitted, residuals=residuals, bic=bic, model=model)

    def _judge(self, fc: Forecast, binned_losses: np.ndarray) -> Forecast:
        """Calibrated interval where the table covers the model; reliability and its note."""
        kind = "plain" if fc.model == "power_law" else "schedule"
        fraction = fc.made_at_step / self.total_steps
        update: dict[str, Any] = {}
        if self.calibration is not None and fc.interval == self.calibration.get("nominal"):
            # A law the table has too few development forecasts of borrows the plain law's.
            q = (calibrated_quantiles(self.calibration, kind, fraction)
                 or calibrated_quantiles(self.calibration, "plain", fraction))
            if q is not None:
                lo = fc.final_loss * math.exp(q[0])
                hi = fc.final_loss * math.exp(q[1])
                update.update(final_lo=min(lo, fc.final_loss), final_hi=max(hi, fc.final_loss),
                              interval_source="calibrated")
        notes = []
        k = max(2, len(binned_losses) // 5)
        if np.median(binned_losses[-k:]) >= np.median(binned_losses[:k]):
            notes.append("the loss is not decreasing: no trend to extrapolate")
        if fraction < MIN_SEEN_FRAC:
            notes.append(f"only {100 * fraction:.0f}% of the run seen "
                         f"(< {100 * MIN_SEEN_FRAC:.0f}%)")
        if fc.params.get("b", 1.0) <= 1.01e-3 or fc.params.get("b", 0.0) >= 2.99:
            notes.append("the fit sits at a bound of its exponent")
        lo, hi = update.get("final_lo", fc.final_lo), update.get("final_hi", fc.final_hi)
        if fc.final_loss <= 0:
            notes.append("the fitted curve falls to zero")
        elif hi - lo > fc.final_loss:
            notes.append("the interval is wider than the forecast itself")
        if notes:
            update.update(reliable=False, note="; ".join(notes))
        return replace(fc, **update) if update else fc

    def _block_resample(self, residuals: np.ndarray) -> np.ndarray:
        n = len(residuals)
        block = max(1, n // 10)
        starts = self._rng.integers(0, max(1, n - block + 1), size=math.ceil(n / block))
        return np.concatenate([residuals[s:s + block] for s in starts])[:n]

    def _predict(self, p: np.ndarray, steps: np.ndarray, scale: float) -> np.ndarray:
        x, s2, noise = self._features(steps)
        return np.maximum(self._curve(p, x, s2, noise, scale), 0.0)  # a loss is never negative

    def _summarise(self, samples, scale, made_at, segment_start, target_loss,
                   model: str) -> Forecast:
        q_lo, q_hi = 50 * (1 - self.interval), 50 * (1 + self.interval)
        end = np.array([float(self.total_steps)])
        finals = np.array([self._predict(p, end, scale)[0] for p in samples])
        grid = np.unique(np.linspace(max(1, segment_start), self.total_steps, 60).astype(int))
        curves = np.array([self._predict(p, grid.astype(np.float64), scale) for p in samples])
        # The band holds its own mid line: before the window fitted (the band starts at the
        # segment's first step) the refits' percentiles need not bracket the best fit.
        band = [(int(s), min(float(lo), float(mid)), float(mid), max(float(hi), float(mid)))
                for s, lo, mid, hi in zip(grid, np.percentile(curves, q_lo, axis=0), curves[0],
                                          np.percentile(curves, q_hi, axis=0))]
        names = ["a", "b", "c", "C"]
        params = {k: float(v) for k, v in zip(names, samples[0])}
        if model == "lr_noise":
            params["N"] = self._noise  # the LR term's size at the peak LR (loss units)
        out = dict(made_at_step=made_at, total_steps=self.total_steps, model=model,
                   final_loss=float(finals[0]), final_lo=float(np.percentile(finals, q_lo)),
                   final_hi=float(np.percentile(finals, q_hi)), interval=self.interval,
                   params=params,
                   segment_start=segment_start, band=band)
        if target_loss is not None:
            out.update(target_loss=target_loss,
                       **self._target_steps(samples, scale, made_at, target_loss, q_lo, q_hi))
        return Forecast(**out)

    def _target_steps(self, samples, scale, made_at, target, q_lo, q_hi) -> dict:
        horizon = self.total_steps if self._areas is not None else 10 * self.total_steps
        grid = np.unique(np.geomspace(max(made_at, 1), horizon, 400).astype(int))
        hits = []
        for p in samples:
            below = np.flatnonzero(self._predict(p, grid.astype(np.float64), scale) <= target)
            hits.append(int(grid[below[0]]) if len(below) else None)
        reached = [h for h in hits if h is not None]
        if hits[0] is None or len(reached) < len(hits) / 2:
            return dict(target_step=None, target_lo=None, target_hi=None)
        return dict(target_step=hits[0], target_lo=int(np.percentile(reached, q_lo)),
                    target_hi=int(np.percentile(reached, q_hi)))
