"""Bring your own data: token shards on disk and text corpora, as packed token datasets.

:func:`open_dataset` picks the reader from the path (``TrainConfig.data``):

=============================  ===================================================================
``x.bin`` with ``x.idx``       Megatron-LM indexed dataset (:func:`.shards.open_megatron`)
``x.bin`` alone                raw token ids, nanoGPT (:class:`~trainpilot.runtime.data.TokenFileDataset`)
``dir/train_*.bin`` (a glob)   several raw token files as one stream (:func:`.shards.open_token_shards`)
``x.jsonl``                    one JSON object a line, ``text_field`` a document (:class:`.text.TextDataset`)
``x.txt`` / any other file     one text document
``dir/**/*.py`` (a glob)       text files, one document each, sorted by path
=============================  ===================================================================

Every dataset here maps sample ``i`` to the same tokens whatever rank reads it, so the
:class:`~trainpilot.runtime.sampler.ResumableSampler` resumes exactly-once across restarts and
world-size changes unchanged.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from trainpilot.runtime.datasets.packing import PackedDocuments
from trainpilot.runtime.datasets.shards import (
    megatron_prefix,
    open_megatron,
    open_token_shards,
    read_megatron_index,
    write_megatron,
)
from trainpilot.runtime.datasets.text import (
    TextDataset,
    load_tokenizer,
    tokenize_to_megatron,
    train_bpe,
)
from trainpilot.specs.errors import SpecError

__all__ = ["PackedDocuments", "TextDataset", "load_tokenizer", "megatron_prefix", "open_dataset",
           "open_megatron", "open_token_shards", "read_megatron_index", "tokenize_to_megatron",
           "train_bpe", "write_megatron", "data_kind"]


def data_kind(data: str) -> str:
    """Which reader :func:`open_dataset` uses for ``data``: megatron, tokens, token_shards,
    jsonl, text or text_files."""
    if glob.has_magic(data):
        return "token_shards" if data.endswith(".bin") else "text_files"
    path = Path(data)
    if path.suffix in (".bin", ".idx") and megatron_prefix(path) is not None:
        return "megatron"
    if path.suffix == ".bin":
        return "tokens"
    if path.is_dir():
        raise SpecError("data", data, "is a folder; valid: a glob of its files, e.g. "
                        f"'{os.path.join(data, '*.bin')}' or '{os.path.join(data, '*.txt')}'")
    return "jsonl" if path.suffix == ".jsonl" else "text"


def open_dataset(data: str, *, seq_len: int, vocab_size: int, dtype: str = "uint16",
                 tokenizer: Any = None, text_field: str = "text",
                 eos_id: int | None = None) -> Any:
    """The dataset at ``data`` (see the module table), yielding ``seq_len`` tokens a sample.
    ``dtype``: raw token files' id type. ``tokenizer``: text only, a ``tokenizer.json`` path (or
    a Tokenizer); None trains a BPE on the corpus. ``eos_id``: the separator between documents
    (text: default the tokenizer's EOS; shards: None adds none)."""
    kind = data_kind(data)
    if kind == "megatron":
        prefix = megatron_prefix(data)
        if prefix is None:  # data_kind saw both files; they went away since
            raise SpecError("data", data, "valid: an existing Megatron .bin/.idx pair")
        return open_megatron(prefix, seq_len=seq_len, vocab_size=vocab_size,
                             eos_id=eos_id)
    if kind == "tokens":
        if eos_id is not None:  # one file is one document: an EOS after it changes nothing
            raise SpecError("data_eos_id", eos_id, "a single raw .bin has no document "
                            "boundaries; valid: unset, or a glob of shards or a Megatron .idx")
        from trainpilot.runtime.data import TokenFileDataset

        return TokenFileDataset(data, seq_len=seq_len, vocab_size=vocab_size, dtype=dtype)
    if kind == "token_shards":
        return open_token_shards(data, seq_len=seq_len, vocab_size=vocab_size, dtype=dtype,
                                 eos_id=eos_id)
    return TextDataset(data, seq_len=seq_len, vocab_size=vocab_size, tokenizer=tokenizer,
                       text_field=text_field, eos_id=eos_id)
