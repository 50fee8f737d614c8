"""Reference models built from a ModelSpec: the GPT decoder, its MoE variant, and context
parallelism for it."""

from trainpilot.runtime.models.context import ContextParallel, shard_sequence
from trainpilot.runtime.models.gpt import GPT, build_gpt, keep_stage
from trainpilot.runtime.models.init import init_parameters
from trainpilot.runtime.models.moe import MoE

__all__ = ["GPT", "ContextParallel", "MoE", "build_gpt", "init_parameters", "keep_stage",
           "shard_sequence"]
