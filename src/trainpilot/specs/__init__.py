"""The three job documents (ModelSpec, ClusterSpec, Plan), TrainJob, loading and presets."""

from trainpilot.specs.cluster import ClusterSpec, DeviceSpec, LinkSpec, NetworkSpec
from trainpilot.specs.errors import SpecError
from trainpilot.specs.job import TrainJob, check_job, stage_layers
from trainpilot.specs.loading import (
    dump,
    load_cluster,
    load_job,
    load_model,
    load_plan,
    parse_inline,
    read_document,
)
from trainpilot.specs.model import MLASpec, ModelSpec, MoESpec
from trainpilot.specs.plan import RANK_ORDERS, CheckpointPolicy, CommOptions, Plan
from trainpilot.specs.runtime import STACKS, RuntimeProfile

__all__ = [
    "CheckpointPolicy", "ClusterSpec", "CommOptions", "DeviceSpec", "LinkSpec", "MLASpec",
    "ModelSpec", "MoESpec", "NetworkSpec", "Plan", "RANK_ORDERS", "RuntimeProfile", "STACKS",
    "SpecError", "TrainJob", "check_job", "dump",
    "load_cluster", "load_job", "load_model", "load_plan", "parse_inline", "read_document",
    "stage_layers",
]
