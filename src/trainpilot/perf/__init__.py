"""The analytical cost model: FLOPs, memory per rank, collectives on a topology, efficiency.

``predict(model, cluster, plan)`` is the entry point; ``Estimator`` is its engine with caches,
for callers that cost many plans of one model on one cluster (the layout search).
"""

from trainpilot.perf.estimator import Estimator, Layout, layout_of
from trainpilot.perf.options import CostOptions
from trainpilot.perf.predict import Prediction, StageCost, predict

__all__ = ["CostOptions", "Estimator", "Layout", "Prediction", "StageCost", "layout_of", "predict"]
