"""TrainConfig: the training options that are not part of the Plan (optimizer, schedule, data,
determinism). Strict like the job documents: unknown keys and bad values are SpecErrors."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from trainpilot.specs.base import Spec
from trainpilot.specs.errors import SpecError


class TrainConfig(Spec):
    """Options of one training run. Learning rates are per optimizer step; ``steps`` counts
    optimizer steps of ``plan.global_batch_size`` sequences."""

    steps: PositiveInt = 100
    lr: PositiveFloat = 3e-3
    min_lr_ratio: float = pydantic.Field(default=0.1, ge=0, le=1)
    warmup_steps: NonNegativeInt | None = None  # default: min(10, steps // 10)
    weight_decay: NonNegativeFloat = 0.1
    beta1: float = pydantic.Field(default=0.9, ge=0, lt=1)
    beta2: float = pydantic.Field(default=0.95, ge=0, lt=1)
    grad_clip: PositiveFloat | None = 1.0  # None: measure the norm, do not clip
    seed: int = 0
    # Deterministic kernels and fixed seeds: same seed + plan + thread count -> bit-identical.
    deterministic: bool = True
    # "auto": bf16 autocast when the plan says bf16 and the device has native bf16 matmuls.
    autocast: Literal["auto", "bf16", "off"] = "auto"
    # "markov" (synthetic, known entropy floor) or a path (trainpilot.runtime.datasets):
    # x.bin (raw token ids, nanoGPT), x.bin + x.idx (Megatron), a glob of .bin shards, a .jsonl,
    # a text file, or a glob of text files.
    data: str = "markov"
    data_dtype: Literal["uint16", "uint32"] = "uint16"  # raw .bin token files
    # Text data: a tokenizer.json (None: train a byte-level BPE of the model's vocab on the
    # corpus), the JSONL field holding each document, and the id put between documents (text:
    # default the tokenizer's EOS; token shards: None adds none).
    data_tokenizer: str | None = None
    data_text_field: str = "text"
    data_eos_id: NonNegativeInt | None = None
    data_num_samples: PositiveInt = 1 << 20  # markov: samples per epoch
    data_concentration: PositiveFloat = 0.05  # markov: Dirichlet concentration of each row
    shuffle: bool = True
    # Measure this machine (matmul, all-reduce) and predict the step time with trainpilot.perf.
    predict: bool = True
    # Checkpoints (with a checkpointer): a snapshot every N steps (None: the plan's
    # checkpoint.interval_steps) to host memory and a peer's; every storage_every-th one is also
    # written to storage.
    checkpoint_every: PositiveInt | None = None
    storage_every: PositiveInt = 1
    # Copy a checkpoint's weights and optimizer state to host memory while the next step's
    # forward and backward run (waiting, if unfinished, before its optimizer step); off: the
    # copy is made before training goes on. Models with persistent buffers (which forward may
    # change, e.g. BatchNorm statistics) are always copied before training goes on.
    checkpoint_overlap: bool = True

    @pydantic.model_validator(mode="after")
    def _check(self) -> TrainConfig:
        warmup_steps = self.warmup_steps
        if warmup_steps is None:  # filled in so train.yaml states what ran
            warmup_steps = min(10, self.steps // 10)
            object.__setattr__(self, "warmup_steps", warmup_steps)
        if warmup_steps > self.steps:
            raise SpecError("warmup_steps", warmup_steps,
                            f"exceeds steps={self.steps}; valid: 0 <= warmup_steps <= steps")
        return self


def load_config(data: dict) -> TrainConfig:
    """A TrainConfig from plain data, errors as one-line SpecErrors."""
    from trainpilot.specs.loading import validate

    return validate(TrainConfig, data, doc="train")
