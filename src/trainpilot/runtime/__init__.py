"""Execute a Plan on torch.distributed: launcher (torchrun), layout (DeviceMesh + PyTorch's
parallel APIs), reference models and data, and the Trainer. See docs/runtime.md.

Names are imported lazily so ``import trainpilot.runtime.<sub>`` (and the CLI's ``--help``) do
not pay for torch until something here is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Callback": "callbacks", "StepRecord": "callbacks", "JsonlMetrics": "callbacks",
    "TrainConfig": "config",
    "MarkovCorpus": "data", "TokenFileDataset": "data", "write_token_file": "data",
    "ResumableSampler": "sampler",
    "Layout": "layout", "build_layout": "layout", "check_runtime": "layout",
    "ParallelModel": "parallelize", "parallelize": "parallelize",
    "full_parameters": "parallelize",
    "build_optimizer": "optim", "build_lr_scheduler": "optim", "clip_grad_norm_": "optim",
    "Trainer": "trainer",
    "launch": "launch",
    "dry_run": "dryrun",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"trainpilot.runtime.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'trainpilot.runtime' has no attribute {name!r}")
