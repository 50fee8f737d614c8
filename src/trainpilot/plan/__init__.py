"""Layout search over DP/TP/PP/EP/CP/ZeRO/recompute, placement on the topology, and exports.

``search(model, cluster, global_batch_size=..., seq_len=...)`` returns a ``SearchResult``: the
ranked plans with their predictions, the search statistics and why the best beats the
runner-up. ``trainpilot.plan.export`` turns a plan into our YAML, Megatron-LM arguments, a
torchtitan config module, a DeepSpeed config or a SLURM script (docs/interop.md).
"""

from trainpilot.plan.search import (
    Candidate,
    SearchResult,
    SearchStats,
    Shortfall,
    describe,
    layout_plan,
    search,
)
from trainpilot.plan.space import SearchSpace

__all__ = ["Candidate", "SearchResult", "SearchSpace", "SearchStats", "Shortfall", "describe",
           "layout_plan", "search"]
