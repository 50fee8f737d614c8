"""The health score: 0-100, four equal parts of 25 (gradient flow, communication, hardware,
convergence). Each part is a product of factors in [0, 1]; a missing input counts as healthy.

gradient_flow = 0 if any gradient or the loss is non-finite, else
    min(1, 10 * median_recent_norm / norm)          (1 until the norm is 10x its recent median;
                                                     0 past the grad_explosion threshold)
    * (1 - share of layers whose norm < the vanishing threshold)
communication = 0 if one collective took longer than the comm_stall threshold, else
    1 - clip((comm_s / step_s - 0.25) / 0.75, 0, 1) (exposed communication above 25 % of the step
                                                     costs linearly, down to 0 at 100 %)
hardware      = memory * evenness * faults, with
    memory   = 1 if used/capacity <= threshold else (1 - used/capacity) / (1 - threshold)
    evenness = median(compute_s over ranks) / max(compute_s)  (1 with one rank; 0.8 for a
                                                               1.25x straggler)
    faults   = 0.5 if a fault event was recorded in the last 100 steps, else 1
convergence   = 0 if the loss is non-finite, else trend * progress * learning * recovery, with
    trend    = 1 - clip((z - 4.5) / (z_threshold - 4.5), 0, 1) for a loss above its trend (z is
               the robust z-score of the divergence detector; batch noise up to z = 4.5 is free),
               1 otherwise
    progress = clip(0.5 + 0.5 * improvement / min_rel_improvement, 0.5, 1) once the plateau window
               is full (a flat loss halves this part), 1 before
    learning = 0 once LEARN_AFTER_STEPS (100) losses are known if the median of the last 20 is
               not LEARN_MIN_REL (2 %) below the median of the first 20 (a run that learns
               nothing), else 1
    recovery = 0.2 for SPIKE_MEMORY_STEPS (50) steps after a loss flagged by the divergence
               detector whose update was applied (a damaging spike), else 1

What a score means (the bands documented in docs/health.md, from the measured clean, non-
learning and spiked toy runs of tests/health/test_score_calibration.py):
    90-100  healthy: keep going
    80-90   watch: one part is degraded (a spike in the last 50 steps, a straggler, comm share
            above 25 %, memory above the pressure threshold); read the parts and the alerts
    60-80   act: a part has failed (the run stopped learning, a stall, a fault in the last 100
            steps, a gradient explosion); the alert says what
    0-60    failing: several parts have failed; stop and diagnose
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PART_WEIGHT = 25.0
EXPLOSION_FACTOR = 10.0  # a norm this many times its recent median starts to cost
COMM_SHARE_OK = 0.25
Z_OK = 4.5
LEARN_AFTER_STEPS, LEARN_MIN_REL = 100, 0.02
SPIKE_MEMORY_STEPS, SPIKE_RECOVERY = 50, 0.2
BANDS = ((90.0, "healthy"), (80.0, "watch"), (60.0, "act"), (0.0, "failing"))


def band(score: float | None) -> str:
    """The band a score falls in ("healthy", "watch", "act", "failing"; "unknown" for None)."""
    if score is None or score != score:
        return "unknown"
    return next(name for low, name in BANDS if score >= low)


@dataclass(frozen=True, kw_only=True)
class ScoreInputs:
    finite: bool = True
    grad_norm: float | None = None
    median_grad_norm: float | None = None
    explosion_threshold: float = 1e5
    num_layers: int = 0
    num_vanishing_layers: int = 0
    step_s: float | None = None
    comm_s: float | None = None
    comm_max_s: float | None = None
    stall_threshold_s: float = 5.0
    mem_frac: float | None = None
    mem_threshold: float = 0.9
    compute_s_by_rank: tuple[float, ...] = ()
    recent_fault: bool = False
    loss_z: float | None = None
    loss_above_trend: bool = False
    z_threshold: float = 6.0
    improvement: float | None = None
    min_rel_improvement: float = 0.01
    learned_rel: float | None = None  # (first-20 median - last-20 median) / first; None early
    recent_spike: bool = False  # a damaging spike in the last SPIKE_MEMORY_STEPS steps


@dataclass(frozen=True, kw_only=True)
class HealthScore:
    score: float
    gradient_flow: float
    communication: float
    hardware: float
    convergence: float

    def as_metrics(self) -> dict[str, float]:
        return {"health/score": self.score, "health/gradient_flow": self.gradient_flow,
                "health/communication": self.communication, "health/hardware": self.hardware,
                "health/convergence": self.convergence}


def _clip01(x: float) -> float:
    return min(1.0, max(0.0, x))


def gradient_flow(i: ScoreInputs) -> float:
    if not i.finite or (i.grad_norm is not None and not math.isfinite(i.grad_norm)):
        return 0.0
    explode = 1.0
    if i.grad_norm is not None:
        if i.grad_norm > i.explosion_threshold:
            return 0.0
        if i.median_grad_norm and i.grad_norm > 0:
            explode = min(1.0, EXPLOSION_FACTOR * i.median_grad_norm / i.grad_norm)
    vanishing = i.num_vanishing_layers / i.num_layers if i.num_layers else 0.0
    return explode * (1.0 - vanishing)


def communication(i: ScoreInputs) -> float:
    if i.comm_max_s is not None and i.comm_max_s > i.stall_threshold_s:
        return 0.0
    if not i.step_s or i.comm_s is None:
        return 1.0
    share = i.comm_s / i.step_s
    return 1.0 - _clip01((share - COMM_SHARE_OK) / (1.0 - COMM_SHARE_OK))


def hardware(i: ScoreInputs) -> float:
    memory = 1.0
    if i.mem_frac is not None and i.mem_frac > i.mem_threshold:
        memory = _clip01((1.0 - i.mem_frac) / (1.0 - i.mem_threshold))
    evenness = 1.0
    times = [t for t in i.compute_s_by_rank if t is not None and t > 0]
    if len(times) > 1:
        ordered = sorted(times)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
        evenness = median / ordered[-1]
    return memory * evenness * (0.5 if i.recent_fault else 1.0)


def convergence(i: ScoreInputs) -> float:
    if not i.finite:
        return 0.0
    trend = 1.0
    if i.loss_z is not None and i.loss_above_trend:
        if not math.isfinite(i.loss_z):
            return 0.0
        trend = 1.0 - _clip01((i.loss_z - Z_OK) / max(i.z_threshold - Z_OK, 1e-9))
    progress = 1.0
    if i.improvement is not None and i.min_rel_improvement > 0:
        progress = min(1.0, max(0.5, 0.5 + 0.5 * i.improvement / i.min_rel_improvement))
    learning = 0.0 if i.learned_rel is not None and i.learned_rel < LEARN_MIN_REL else 1.0
    recovery = SPIKE_RECOVERY if i.recent_spike else 1.0
    return trend * progress * learning * recovery


def health_score(inputs: ScoreInputs) -> HealthScore:
    """Score one step (module docstring has the formulas). Invariant: 0 <= score <= 100 and
    score = 25 * (sum of the four parts), each part in [0, 1]."""
    parts = [gradient_flow(inputs), communication(inputs), hardware(inputs),
             convergence(inputs)]
    return HealthScore(score=PART_WEIGHT * sum(parts), gradient_flow=parts[0],
                       communication=parts[1], hardware=parts[2], convergence=parts[3])
