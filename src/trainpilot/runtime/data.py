"""Token datasets: a seeded Markov-chain corpus with a known entropy floor, and memory-mapped
token files (nanoGPT's ``.bin``).

A dataset is anything with ``num_samples``, ``seq_len`` and ``get_batch(indices) -> (inputs,
targets)`` (int64 tensors [n, seq_len], targets shifted by one token). Sample ``i`` is a pure
function of ``i``, so which rank reads it, and when, never changes its content.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from trainpilot.specs.errors import SpecError


class TokenDataset(Protocol):
    """What the sampler and trainer need from a dataset."""

    num_samples: int
    seq_len: int

    def get_batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, int64 [len(indices), seq_len]."""
        ...


class MarkovCorpus:
    """Sequences from a seeded first-order Markov chain over ``vocab_size`` tokens.

    Each row of the transition matrix is Dirichlet(``concentration``); the first token of every
    sequence is drawn from the stationary distribution, so every position is stationary and the
    best possible expected next-token loss is exactly :attr:`entropy_rate_nats`. A model that
    reaches it has learned the chain; nothing can do better.
    """

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int = 0,
                 num_samples: int = 1 << 20, concentration: float = 0.1):
        if vocab_size < 2 or seq_len < 1 or num_samples < 1 or concentration <= 0:
            raise SpecError("data", dict(vocab_size=vocab_size, seq_len=seq_len,
                                         num_samples=num_samples, concentration=concentration),
                            "valid: vocab_size >= 2, seq_len >= 1, num_samples >= 1, "
                            "concentration > 0")
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.num_samples = num_samples
        rng = np.random.default_rng([seed, 0x6D61726B])
        self.transition = rng.dirichlet(np.full(vocab_size, concentration), size=vocab_size)
        self._cdf = np.cumsum(self.transition, axis=1)
        self._cdf[:, -1] = 1.0  # guard against rounding leaving a gap at the top
        self.stationary = _stationary(self.transition)
        self._stationary_cdf = np.cumsum(self.stationary)
        self._stationary_cdf[-1] = 1.0

    @property
    def entropy_rate_nats(self) -> float:
        """H = -sum_i pi_i sum_j P_ij ln P_ij: the minimum expected cross-entropy per token."""
        p = self.transition
        row_entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
        return float(self.stationary @ row_entropy)

    @property
    def uniform_loss_nats(self) -> float:
        """The loss of a model that knows nothing (uniform over the vocabulary)."""
        return math.log(self.vocab_size)

    def get_batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        indices = np.asarray(indices, dtype=np.int64)
        # One generator per sample: the content of sample i does not depend on its batch.
        uniforms = np.stack([np.random.default_rng([self.seed, 1, int(i)]).random(self.seq_len + 1)
                             for i in indices]) if len(indices) else np.zeros((0, self.seq_len + 1))
        tokens = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        tokens[:, 0] = np.searchsorted(self._stationary_cdf, uniforms[:, 0], side="right")
        for t in range(1, self.seq_len + 1):
            rows = self._cdf[tokens[:, t - 1]]
            tokens[:, t] = (rows < uniforms[:, t, None]).sum(axis=1)
        tokens = np.minimum(tokens, self.vocab_size - 1)
        data = torch.from_numpy(tokens)
        return data[:, :-1], data[:, 1:]


def _stationary(transition: np.ndarray) -> np.ndarray:
    """Left eigenvector of the transition matrix for eigenvalue 1, normalised."""
    values, vectors = np.linalg.eig(transition.T)
    vec = np.real(vectors[:, np.argmin(np.abs(values - 1.0))])
    vec = np.abs(vec)
    return vec / vec.sum()


class TokenFileDataset:
    """A flat file of token ids (nanoGPT's ``train.bin``: raw uint16 or uint32, no header),
    memory-mapped. Sample ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len + 1)``: consecutive,
    non-overlapping windows, so one epoch reads every token once."""

    def __init__(self, path: str | os.PathLike, *, seq_len: int, vocab_size: int,
                 dtype: str = "uint16"):
        if dtype not in ("uint16", "uint32"):
            raise SpecError("data_dtype", dtype, "valid: uint16, uint32")
        path = Path(path)
        if not path.is_file():
            raise SpecError("data", str(path), "no such file; valid: a .bin file of token ids")
        itemsize = np.dtype(dtype).itemsize
        size = path.stat().st_size
        if size % itemsize:
            raise SpecError("data", str(path),
                            f"{size} bytes is not a whole number of {dtype} tokens")
        self.tokens = np.memmap(path, dtype=dtype, mode="r")
        self.seq_len, self.vocab_size, self.path = seq_len, vocab_size, path
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise SpecError("data", str(path), f"holds {len(self.tokens)} tokens; need at least "
                            f"seq_len + 1 = {seq_len + 1}")

    def get_batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1], dtype=np.int64)
                for i in np.asarray(indices, dtype=np.int64)]
        data = torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, self.seq_len + 1,
                                                                          dtype=torch.int64)
        if data.numel() and int(data.max()) >= self.vocab_size:
            raise SpecError("data", str(self.path),
                            f"token id {int(data.max())} >= the model's vocab_size "
                            f"{self.vocab_size}; wrong dtype or model?")
        return data[:, :-1], data[:, 1:]


def write_token_file(path: str | os.PathLike, tokens: np.ndarray, dtype: str = "uint16") -> None:
    """Write ``tokens`` as a raw ``.bin`` (atomically): what :class:`TokenFileDataset` reads."""
    from trainpilot.fsio import atomic_write_bytes

    info = np.iinfo(dtype)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > info.max):
        raise SpecError("tokens", int(tokens.max()), f"out of range for {dtype}")
    atomic_write_bytes(path, tokens.astype(dtype).tobytes())
