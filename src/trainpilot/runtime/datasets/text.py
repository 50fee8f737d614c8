"""Text corpora (JSONL or plain text files) tokenized with a local ``tokenizers`` tokenizer and
packed into samples with an EOS between documents.

The tokenizer is a ``tokenizer.json`` on disk (what every Hugging Face model folder ships), or a
byte-level BPE trained on the corpus itself (:func:`train_bpe`). Nothing is downloaded. The
corpus is tokenized once when the dataset opens (the ``tokenizers`` library's batch encoder, in
Rust) and held in memory as uint32 ids, 4 bytes a token; a corpus too large for that is
tokenized once to a Megatron ``.bin`` + ``.idx`` (:func:`tokenize_to_megatron`) and read from
there, memory-mapped.
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainpilot.runtime.datasets.packing import PackedDocuments, documents_from_lengths
from trainpilot.specs.errors import SpecError

# Special tokens that end a document, by tokenizer family (GPT-2/Qwen, Llama 2/Mistral, Llama 3,
# Gemma); the first one the tokenizer knows is its EOS unless ``eos_id`` is given.
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
DEFAULT_EOS = "<|endoftext|>"


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` (or a folder holding one)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise SpecError("data_tokenizer", str(path), "no such file; valid: a tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the library raises a bare Exception on bad JSON
        raise SpecError("data_tokenizer", str(path),
                        f"not a tokenizers JSON file ({str(err)[:120]})") from None


def train_bpe(texts: Iterable[str], *, vocab_size: int, eos: str = DEFAULT_EOS) -> Any:
    """A byte-level BPE (GPT-2's scheme: no unknown tokens) trained on ``texts`` with at most
    ``vocab_size`` ids, ``eos`` among them as a special token. Deterministic for the same texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257 + 1:
        raise SpecError("vocab_size", vocab_size, "a byte-level BPE needs >= 258 ids (256 bytes, "
                        "the EOS and at least one merge)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def eos_token_id(tokenizer: Any, eos_id: int | None = None) -> int:
    """``eos_id`` if given, else the id of the tokenizer's end-of-document special token."""
    if eos_id is not None:
        return eos_id
    for name in EOS_NAMES:
        token = tokenizer.token_to_id(name)
        if token is not None:
            return int(token)
    raise SpecError("data_eos_id", None, f"the tokenizer has none of {', '.join(EOS_NAMES)}; "
                    "valid: set data_eos_id to the id that separates documents")


def read_documents(source: str | os.PathLike, *, text_field: str = "text") -> list[str]:
    """The documents of ``source``: a ``.jsonl`` file (one JSON object a line, its
    ``text_field`` a document), a text file (one document), or a glob of text files (one
    document each, sorted by path)."""
    source = str(source)
    if glob.has_magic(source):
        paths = sorted(p for p in glob.glob(source, recursive=True) if Path(p).is_file())
        if not paths:
            raise SpecError("data", source, "matches no file")
        return [Path(p).read_text(encoding="utf-8", errors="replace") for p in paths]
    path = Path(source)
    if not path.is_file():
        raise SpecError("data", source, "no such file; valid: a .jsonl, a text file or a glob "
                        "of text files (e.g. 'corpus/*.txt')")
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8", errors="replace")]
    docs = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise SpecError("data", f"{path}:{number}", f"not JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise SpecError("data", f"{path}:{number}",
                                f"no string field {text_field!r}; valid: set data_text_field")
            docs.append(row[text_field])
    if not docs:
        raise SpecError("data", str(path), "holds no documents")
    return docs


def tokenize(tokenizer: Any, documents: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(all ids as one uint32 array, tokens per document), without special tokens added."""
    encoded = tokenizer.encode_batch(list(documents), add_special_tokens=False)
    lengths = np.array([len(e.ids) for e in encoded], dtype=np.int64)
    ids = (np.concatenate([np.asarray(e.ids, dtype=np.uint32) for e in encoded])
           if len(encoded) else np.zeros(0, np.uint32))
    return ids, lengths


class TextDataset(PackedDocuments):
    """A JSONL / text corpus, tokenized on open and packed (EOS between documents).

    ``tokenizer``: a ``tokenizers.Tokenizer`` or the path of a ``tokenizer.json``; None trains
    a byte-level BPE of ``vocab_size`` ids on the corpus (every rank trains the same one: the
    trainer is deterministic; pass a file to be independent of that). ``fingerprint``: a CRC of
    every token id, equal on every rank that tokenized the same corpus the same way.
    """

    def __init__(self, source: str | os.PathLike, *, seq_len: int, vocab_size: int,
                 tokenizer: Any = None, text_field: str = "text", eos_id: int | None = None):
        documents = read_documents(source, text_field=text_field)
        if tokenizer is None:
            tokenizer = train_bpe(documents, vocab_size=vocab_size)
        elif isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        if tokenizer.get_vocab_size() > vocab_size:
            raise SpecError("data_tokenizer", tokenizer.get_vocab_size(),
                            f"the tokenizer has more ids than the model's vocab_size "
                            f"{vocab_size}; valid: a tokenizer of at most {vocab_size} ids")
        self.tokenizer = tokenizer
        ids, lengths = tokenize(tokenizer, documents)
        self.fingerprint = zlib.crc32(ids.tobytes())
        part, start, length = documents_from_lengths(lengths)
        super().__init__([ids], doc_part=part, doc_start=start, doc_length=length,
                         seq_len=seq_len, vocab_size=vocab_size,
                         eos_id=eos_token_id(tokenizer, eos_id), source=str(source))


def tokenize_to_megatron(source: str | os.PathLike, prefix: str | os.PathLike, *, tokenizer: Any,
                         text_field: str = "text", append_eos: bool = True) -> Path:
    """Tokenize ``source`` once into a Megatron ``prefix.bin`` + ``.idx`` (uint16 when the
    vocabulary fits, else int32), an EOS appended to each document as Megatron's
    ``--append-eod`` does; open it with ``data=prefix.bin`` and no ``data_eos_id``."""
    from trainpilot.runtime.datasets.shards import write_megatron

    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    documents = read_documents(source, text_field=text_field)
    eos = eos_token_id(tokenizer) if append_eos else None
    encoded = tokenizer.encode_batch(documents, add_special_tokens=False)
    docs = [e.ids + ([eos] if eos is not None else []) for e in encoded]
    dtype = "uint16" if tokenizer.get_vocab_size() < 65_500 else "int32"  # Megatron's rule
    return write_megatron(prefix, docs, dtype=dtype)
