"""Validation of the cost model against published and measured iteration times and memory."""

from trainpilot.perf.validation.cases import (
    CALIBRATION,
    DEVELOPMENT,
    HELD_OUT,
    SPLITS,
    Case,
    all_cases,
    source_cases,
)
from trainpilot.perf.validation.runner import (
    DATASET_THRESHOLDS,
    HELD_OUT_GATES,
    POOLED,
    SOURCE_MEAN,
    TARGETS,
    THRESHOLDS,
    Result,
    Summary,
    failures,
    is_pooled,
    run,
    summarize,
)

__all__ = ["DATASET_THRESHOLDS", "TARGETS", "CALIBRATION", "DEVELOPMENT", "HELD_OUT", "HELD_OUT_GATES", "POOLED", "SOURCE_MEAN",
           "SPLITS", "THRESHOLDS", "Case", "Result", "Summary", "all_cases", "failures", "run",
           "source_cases", "summarize", "is_pooled"]
