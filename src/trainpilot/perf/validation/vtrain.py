"""vTrain's measured Megatron-DeepSpeed iteration times (Bang et al., MICRO'24; MIT license).

The CSVs are read where they are published to us, never copied into the project: the folder
named by ``TRAINPILOT_VTRAIN_DIR``, else ``shared/validation/vtrain`` beside the repository
(``<repo>/../shared/...``, the layout of this workspace and of CI), else beside the current
directory.

What the rows are (vTrain's validation configs, ``config/validation/{single,multi}/*.json`` in
github.com/VIA-Research/vTrain): GPT with vocab 50,257 (Megatron pads it to a multiple of
128 x tp), learned positions, ffn 4h; fp16; activation checkpointing on every layer
(``use_checkpoint: true``); PyTorch DDP gradient bucketing off (``use_gradient_bucket: false``),
so the data-parallel all-reduce runs after the backward; 1F1B; 8 GPUs per node; inter-node
bandwidth 800 Gb/s per node (12.5 GB/s per GPU). Neither sequence parallelism nor a distributed
optimizer is used. We assume A100 SXM 80GB (the 175B rows with tp*pp = 64 need more than 40 GB)
with NVLink inside a node.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

ENV = "TRAINPILOT_VTRAIN_DIR"
FILES = {"vtrain_single": "ground_truth_single.csv", "vtrain_multi": "ground_truth_multi.csv"}
VOCAB = 50257
INTER_NODE_GBYTES_PER_GPU = 800 / 8 / 8  # 800 Gb/s per 8-GPU node


@dataclass(frozen=True)
class VTrainRow:
    dataset: str
    index: int  # 0-based row in its CSV
    gpus: int
    global_batch: int
    micro_batch: int
    hidden: int
    heads: int
    layers: int
    seq_len: int
    tp: int
    dp: int
    pp: int
    iteration_s: float


def locate(start: Path | None = None) -> Path | None:
    """The vTrain folder, or None when it is not present."""
    env = os.environ.get(ENV)
    if env:
        path = Path(env)
        return path if (path / FILES["vtrain_single"]).exists() else None
    repo = Path(__file__).resolve().parents[4]
    bases = [repo, *(start or Path.cwd()).resolve().parents, (start or Path.cwd()).resolve()]
    for base in bases:
        for cand in (base.parent / "shared/validation/vtrain", base / "shared/validation/vtrain"):
            if (cand / FILES["vtrain_single"]).exists():
                return cand
    return None


def read_rows(folder: Path) -> list[VTrainRow]:
    """Every row of both CSVs (column names as published; a leading BOM is tolerated)."""
    out = []
    for dataset, name in FILES.items():
        path = folder / name
        if not path.exists():
            continue
        with open(path, encoding="utf-8-sig", newline="") as handle:
            for index, rec in enumerate(csv.DictReader(handle)):
                out.append(VTrainRow(
                    dataset=dataset, index=index, gpus=int(rec["# GPUs"]),
                    global_batch=int(rec["global batch"]), micro_batch=int(rec["micro batch"]),
                    hidden=int(rec["hidden size"]), heads=int(rec["attention heads"]),
                    layers=int(rec["# layers"]), seq_len=int(rec["sequence length"]),
                    tp=int(rec["tensor parallelism"]), dp=int(rec["data parallelism"]),
                    pp=int(rec["pipeline parallelism"]),
                    iteration_s=float(rec["iteration time (ms)"]) / 1e3,
                ))
    return out
