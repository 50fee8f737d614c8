"""trainpilot: plan, simulate, run and watch large-model training on PyTorch."""

__version__ = "0.1.0"
