"""Presets: models, devices, clusters and jobs, each with its source cited where it is defined."""

from __future__ import annotations

from trainpilot.specs.presets.hardware import (
    DEVICES,
    EXAMPLE_CLUSTERS,
    NAMED_CLUSTERS,
    build_cluster,
    cluster_preset,
    device_preset,
)
from trainpilot.specs.presets.jobs import JOBS
from trainpilot.specs.presets.models import MODELS

__all__ = [
    "DEVICES", "EXAMPLE_CLUSTERS", "JOBS", "MODELS", "NAMED_CLUSTERS",
    "build_cluster", "cluster_preset", "device_preset",
]
