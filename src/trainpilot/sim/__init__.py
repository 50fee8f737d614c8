"""What-if machines: the step timeline, availability under failures, and scaling with time,
cost and energy. See docs/simulators.md."""

from trainpilot.sim.availability import (
    AvailabilityJob,
    AvailabilityResult,
    CheckpointSpec,
    RecoverySpec,
    closed_form,
    daly_interval,
    daly_wall_time,
    kokolis_ettr,
    young_interval,
)
from trainpilot.sim.failures import FailureClass, FailureModel, llama3_mix, single_mtbf
from trainpilot.sim.montecarlo import monte_carlo
from trainpilot.sim.timeline import StageCosts, StepResult, StepSpec, simulate_step

__all__ = [
    "AvailabilityJob", "AvailabilityResult", "CheckpointSpec", "FailureClass", "FailureModel",
    "RecoverySpec", "StageCosts", "StepResult", "StepSpec", "closed_form", "daly_interval",
    "daly_wall_time", "kokolis_ettr", "llama3_mix", "monte_carlo", "simulate_step",
    "single_mtbf", "young_interval",
]
