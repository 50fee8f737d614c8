"""Documents packed into fixed-length samples, with an end-of-sequence token between documents.

The token stream is every document in order, each followed by ``eos_id`` when one is given
(nanoGPT's and Megatron's packing: documents run into each other, the EOS tells the model where
one ends). Sample ``i`` is stream tokens ``[i * seq_len, (i + 1) * seq_len + 1)``: consecutive
windows that share only their boundary token (the last target of one is the first input of the
next), so one epoch reads every token of the stream once as an input. Sample ``i`` is a pure
function of ``i``: which rank reads it, and when, never changes its content, which is what
lets :class:`~trainpilot.runtime.sampler.ResumableSampler` resume exactly-once at any world size.

Documents are ``(part, start, length)`` references into one or more flat token arrays (memory
maps of shard files, or an in-memory array of a tokenized corpus); the stream is never
materialised, and the index is O(documents).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trainpilot.specs.errors import SpecError


class PackedDocuments:
    """A :class:`~trainpilot.runtime.data.TokenDataset` over documents in flat token arrays.

    ``parts``: 1-D integer arrays (``np.memmap`` or ``np.ndarray``). ``doc_part``,
    ``doc_start``, ``doc_length``: each document's array, first token and token count.
    ``eos_id``: appended after every document (None: documents are concatenated as they are,
    e.g. shards whose tokenizer already wrote an EOS). ``vocab_size``: every token id read is
    checked against it. ``source``: named in errors.
    """

    def __init__(self, parts: Sequence[np.ndarray], *, doc_part: np.ndarray, doc_start: np.ndarray,
                 doc_length: np.ndarray, seq_len: int, vocab_size: int, eos_id: int | None,
                 source: str):
        if seq_len < 1:
            raise SpecError("plan.seq_len", seq_len, "valid: >= 1")
        if eos_id is not None and not 0 <= eos_id < vocab_size:
            raise SpecError("data_eos_id", eos_id, f"valid: 0 <= eos_id < vocab_size={vocab_size}")
        self.parts = list(parts)
        self.doc_part = np.asarray(doc_part, dtype=np.int64)
        self.doc_start = np.asarray(doc_start, dtype=np.int64)
        self.doc_length = np.asarray(doc_length, dtype=np.int64)
        self.seq_len, self.vocab_size, self.eos_id, self.source = seq_len, vocab_size, eos_id, source
        extra = 1 if eos_id is not None else 0
        # Where each document starts in the (virtual) packed stream; the last entry is its end.
        spans = self.doc_length + extra
        self.stream_starts = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
        self.num_tokens = int(self.stream_starts[-1])
        self.num_documents = len(self.doc_length)
        self.num_samples = (self.num_tokens - 1) // seq_len
        if self.num_samples < 1:
            raise SpecError("data", source, f"holds {self.num_tokens} tokens after packing; need "
                            f"at least seq_len + 1 = {seq_len + 1}")

    def stream(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)`` of the packed stream (int64)."""
        out = np.empty(count, dtype=np.int64)
        doc = int(np.searchsorted(self.stream_starts, start, side="right")) - 1
        filled, pos = 0, start
        while filled < count:
            offset = pos - int(self.stream_starts[doc])
            length = int(self.doc_length[doc])
            if offset < length:  # inside the document's own tokens
                take = min(length - offset, count - filled)
                begin = int(self.doc_start[doc]) + offset
                out[filled:filled + take] = self.parts[int(self.doc_part[doc])][begin:begin + take]
            else:  # its trailing EOS
                assert self.eos_id is not None  # only an EOS adds a slot after a document
                take = 1
                out[filled] = self.eos_id
            filled += take
            pos += take
            if pos >= int(self.stream_starts[doc + 1]):
                doc += 1
        return out

    def sample(self, index: int) -> np.ndarray:
        """Sample ``index``: ``seq_len + 1`` stream tokens (inputs and the shifted targets)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} of {self.num_samples}")
        return self.stream(index * self.seq_len, self.seq_len + 1)

    def get_batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, int64 [len(indices), seq_len]."""
        rows = [self.sample(int(i)) for i in np.asarray(indices, dtype=np.int64)]
        data = (torch.from_numpy(np.stack(rows)) if rows
                else torch.zeros(0, self.seq_len + 1, dtype=torch.int64))
        if data.numel() and (int(data.max()) >= self.vocab_size or int(data.min()) < 0):
            raise SpecError("data", self.source,
                            f"token id {int(data.max())} >= the model's vocab_size "
                            f"{self.vocab_size}; wrong dtype, tokenizer or model?")
        return data[:, :-1], data[:, 1:]

    def describe(self) -> dict:
        """What was packed (for the run's log): documents, tokens, samples."""
        return dict(source=self.source, num_documents=self.num_documents,
                    num_tokens=self.num_tokens, num_samples=self.num_samples,
                    seq_len=self.seq_len, eos_id=self.eos_id)


def documents_from_lengths(lengths: Sequence[int] | np.ndarray, part: int = 0,
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_part, doc_start, doc_length) for consecutive documents of ``lengths`` in one part."""
    length = np.asarray(lengths, dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    return np.full(len(length), part, dtype=np.int64), start, length
