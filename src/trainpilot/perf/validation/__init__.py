"""Validation of the cost model against published and measured iteration times and memory."""

from trainpilot.perf.validation.cases import CALIBRATION, HELD_OUT, Case, all_cases
from trainpilot.perf.validation.runner import (
    THRESHOLDS,
    Result,
    Summary,
    failures,
    run,
    summarize,
)

__all__ = ["CALIBRATION", "HELD_OUT", "THRESHOLDS", "Case", "Result", "Summary", "all_cases",
           "failures", "run", "summarize"]
