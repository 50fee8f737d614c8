"""Both availability engines on one job, as ``trainpilot simulate availability`` runs them.

One function so that the CLI and ``benchmarks/availability_speed.py`` time and compute the same
thing: the Monte-Carlo engine with its interval search, then the closed form (exponential
failures only) with its own interval search.
"""

from __future__ import annotations

from trainpilot.sim.availability import (
    AvailabilityJob,
    AvailabilityResult,
    CheckpointSpec,
    RecoverySpec,
    closed_form,
)
from trainpilot.sim.failures import FailureModel
from trainpilot.sim.montecarlo import monte_carlo


def run_engines(job: AvailabilityJob, failures: FailureModel, ckpt: CheckpointSpec,
                rec: RecoverySpec, *, num_trials: int = 1000, seed: int = 0,
                ) -> tuple[AvailabilityResult, AvailabilityResult | None]:
    """(Monte-Carlo result with its optimal interval, closed-form result or None when the
    failures are not exponential)."""
    mc = monte_carlo(job, failures, ckpt, rec, num_trials=num_trials, seed=seed, optimize=True)
    cf = closed_form(job, failures, ckpt, rec) if failures.distribution == "exponential" \
        else None
    return mc, cf
