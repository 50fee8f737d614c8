"""Reference models built from a ModelSpec: the GPT decoder and its MoE variant."""

from trainpilot.runtime.models.gpt import GPT, build_gpt, keep_stage
from trainpilot.runtime.models.init import init_parameters
from trainpilot.runtime.models.moe import MoE

__all__ = ["GPT", "MoE", "build_gpt", "init_parameters", "keep_stage"]
