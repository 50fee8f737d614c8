"""Datasets: the Markov corpus's entropy floor is real, samples are pure functions of their
index, token files round-trip and reject bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainpilot.runtime.data import MarkovCorpus, TokenFileDataset, write_token_file
from trainpilot.specs import SpecError


def test_entropy_rate_is_the_loss_of_the_true_chain():
    corpus = MarkovCorpus(vocab_size=64, seq_len=32, seed=3, concentration=0.1)
    x, y = corpus.get_batch(np.arange(4000))
    nll_true = -np.log(corpus.transition[x.numpy(), y.numpy()]).mean()
    # 128k transitions: the sample mean's standard error is ~0.003 nats.
    assert nll_true == pytest.approx(corpus.entropy_rate_nats, abs=0.015)
    # Negative control: a wrong model (another seed's chain) is measurably worse than the floor.
    other = MarkovCorpus(vocab_size=64, seq_len=32, seed=4, concentration=0.1)
    nll_wrong = -np.log(other.transition[x.numpy(), y.numpy()] + 1e-12).mean()
    assert nll_wrong > corpus.entropy_rate_nats + 1.0
    assert corpus.entropy_rate_nats < corpus.uniform_loss_nats


def test_sample_content_depends_only_on_its_index():
    corpus = MarkovCorpus(vocab_size=256, seq_len=16, seed=0)
    x_all, y_all = corpus.get_batch(np.array([5, 9, 11]))
    x_one, y_one = corpus.get_batch(np.array([9]))
    assert torch.equal(x_all[1], x_one[0]) and torch.equal(y_all[1], y_one[0])
    assert torch.equal(x_all[:, 1:], y_all[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(x_all[0], x_all[2])
    assert int(x_all.max()) < 256 and int(x_all.min()) >= 0


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_round_trip(tmp_path, dtype):
    tokens = np.arange(1001) % 300 if dtype == "uint16" else np.arange(1001) * 70_000 % 100_000
    path = tmp_path / "train.bin"
    write_token_file(path, tokens, dtype=dtype)
    data = TokenFileDataset(path, seq_len=100, vocab_size=100_000, dtype=dtype)
    assert data.num_samples == 10  # (1001 - 1) // 100 non-overlapping windows
    x, y = data.get_batch(np.array([0, 9]))
    assert x[0].tolist() == tokens[:100].tolist()
    assert y[1].tolist() == tokens[901:1001].tolist()


def test_token_file_bad_input(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x01\x02\x03")
    with pytest.raises(SpecError, match="whole number of uint16"):
        TokenFileDataset(path, seq_len=1, vocab_size=10)
    with pytest.raises(SpecError, match="no such file"):
        TokenFileDataset(tmp_path / "missing.bin", seq_len=4, vocab_size=10)
    big = tmp_path / "big.bin"
    write_token_file(big, np.full(20, 500), dtype="uint16")
    with pytest.raises(SpecError, match="vocab_size"):
        TokenFileDataset(big, seq_len=4, vocab_size=256).get_batch(np.array([0]))
