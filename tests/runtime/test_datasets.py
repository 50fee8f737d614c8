"""Bring your own data: Megatron .bin/.idx and raw token shards, JSONL and text with a local
tokenizer, packed with EOS between documents; exactly-once resume across 2 -> 1 -> 2 ranks,
at the sampler/dataset level and through the Trainer on 2 gloo ranks."""

from __future__ import annotations

import struct
from collections import Counter

import numpy as np
import pytest

from tests.runtime.byo_data import SEQ_LEN, VOCAB, make_corpus, stdlib_texts
from trainpilot.runtime.datasets import (
    data_kind,
    load_tokenizer,
    open_dataset,
    read_megatron_index,
    train_bpe,
    write_megatron,
)
from trainpilot.runtime.sampler import ResumableSampler
from trainpilot.specs import SpecError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def megatron_bytes(docs: list[list[list[int]]], code: int = 8, dtype=np.uint16) -> tuple:
    """A Megatron index written field by field from its documented layout (independently of
    ``write_megatron``): documents made of several sequences each."""
    seqs = [s for d in docs for s in d]
    lengths = np.array([len(s) for s in seqs], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * np.dtype(
        dtype).itemsize
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
           + struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)) + lengths.tobytes()
           + pointers.tobytes() + doc_idx.tobytes())
    return np.concatenate([np.array(s, dtype) for s in seqs]).tobytes(), idx


def test_megatron_index_layout_and_packing(tmp_path):
    docs = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8, 9, 10]]]  # doc 0 has two sequences
    data, idx = megatron_bytes(docs)
    (tmp_path / "d.bin").write_bytes(data)
    (tmp_path / "d.idx").write_bytes(idx)
    index = read_megatron_index(tmp_path / "d.idx")
    assert index["sequence_lengths"].tolist() == [3, 2, 1, 4]
    assert index["document_indices"].tolist() == [0, 2, 3, 4]
    assert data_kind(str(tmp_path / "d.bin")) == "megatron"
    ds = open_dataset(str(tmp_path / "d.bin"), seq_len=4, vocab_size=20, eos_id=0)
    # Stream: 1 2 3 4 5 <eos> 6 <eos> 7 8 9 10 <eos> = 13 tokens -> 3 samples of 4 (+1).
    assert ds.num_tokens == 13 and ds.num_samples == 3
    x, y = ds.get_batch(np.array([0, 1, 2]))
    assert x.tolist() == [[1, 2, 3, 4], [5, 0, 6, 0], [7, 8, 9, 10]]
    assert y.tolist() == [[2, 3, 4, 5], [0, 6, 0, 7], [8, 9, 10, 0]]
    # Our writer produces the same bytes as the layout above (one sequence per document).
    flat = [[sum(d, [])] for d in docs]
    data2, idx2 = megatron_bytes(flat)
    write_megatron(tmp_path / "w", [sum(d, []) for d in docs])
    assert (tmp_path / "w.bin").read_bytes() == data2
    assert (tmp_path / "w.idx").read_bytes() == idx2
    no_eos = open_dataset(str(tmp_path / "w.idx"), seq_len=4, vocab_size=20)
    assert no_eos.num_tokens == 10


def test_megatron_bad_input(tmp_path):
    data, idx = megatron_bytes([[[1, 2, 3]]])
    (tmp_path / "d.bin").write_bytes(data)
    for broken, match in ((b"XXXXXXXXX" + idx[9:], "bad magic"),
                          (idx[:9] + struct.pack("<Q", 2) + idx[17:], "version"),
                          (idx[:17] + struct.pack("<B", 7) + idx[18:], "not an integer"),
                          (idx[:40], "promises")):
        (tmp_path / "d.idx").write_bytes(broken)
        with pytest.raises(SpecError, match=match):
            open_dataset(str(tmp_path / "d.bin"), seq_len=2, vocab_size=10)
    (tmp_path / "d.idx").write_bytes(idx)
    with pytest.raises(SpecError, match="vocab_size"):
        open_dataset(str(tmp_path / "d.bin"), seq_len=2, vocab_size=3).get_batch(np.array([0]))
    with pytest.raises(SpecError, match="seq_len"):
        open_dataset(str(tmp_path / "d.bin"), seq_len=5, vocab_size=10)


def test_raw_token_shards_glob(tmp_path):
    from trainpilot.runtime.data import write_token_file

    write_token_file(tmp_path / "train_000.bin", np.arange(0, 10), dtype="uint32")
    write_token_file(tmp_path / "train_001.bin", np.arange(10, 17), dtype="uint32")
    ds = open_dataset(str(tmp_path / "train_*.bin"), seq_len=4, vocab_size=100, dtype="uint32")
    assert ds.num_tokens == 17 and ds.num_samples == 4
    x, _ = ds.get_batch(np.array([2]))
    assert x.tolist() == [[8, 9, 10, 11]]  # a window crosses the shard boundary
    with_eos = open_dataset(str(tmp_path / "train_*.bin"), seq_len=4, vocab_size=100,
                            dtype="uint32", eos_id=99)
    assert with_eos.stream(8, 4).tolist() == [8, 9, 99, 10]
    with pytest.raises(SpecError, match="matches no file"):
        open_dataset(str(tmp_path / "valid_*.bin"), seq_len=4, vocab_size=100)
    with pytest.raises(SpecError, match="is a folder"):
        open_dataset(str(tmp_path), seq_len=4, vocab_size=100)


def test_text_and_jsonl_with_a_local_tokenizer(tmp_path, corpus):
    tokenizer = load_tokenizer(corpus["tokenizer"])
    texts = stdlib_texts()
    ds = open_dataset(corpus["jsonl"], seq_len=SEQ_LEN, vocab_size=VOCAB,
                      tokenizer=corpus["tokenizer"])
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert ds.eos_id == eos and ds.num_documents == len(texts)
    # The stream is the documents' tokens with an EOS after each; it decodes back to the text.
    ids = ds.stream(0, ds.num_tokens)
    ends = np.flatnonzero(ids == eos)
    assert len(ends) == len(texts) and ends[-1] == ds.num_tokens - 1
    assert tokenizer.decode(ids[:ends[0]].tolist()) == texts[0]
    # The same corpus as plain files (a glob) and as Megatron shards packs identically.
    import shutil

    from tests.runtime.byo_data import stdlib_files

    for path in stdlib_files():
        shutil.copy(path, tmp_path / path.name)
    files = open_dataset(str(tmp_path / "*.py"), seq_len=SEQ_LEN, vocab_size=VOCAB,
                         tokenizer=tokenizer)
    mega = open_dataset(corpus["megatron"], seq_len=SEQ_LEN, vocab_size=VOCAB)
    assert mega.num_samples == files.num_samples == ds.num_samples
    idx = np.array([0, 7, ds.num_samples - 1])
    for other in (files, mega):
        assert all((a == b).all() for a, b in zip(ds.get_batch(idx), other.get_batch(idx)))


def test_text_files_glob_and_bad_input(tmp_path):
    for i, text in enumerate(["alpha beta gamma " * 20, "delta epsilon " * 30]):
        (tmp_path / f"doc{i}.txt").write_text(text)
    ds = open_dataset(str(tmp_path / "*.txt"), seq_len=8, vocab_size=300)  # BPE trained here
    assert data_kind(str(tmp_path / "*.txt")) == "text_files" and ds.num_documents == 2
    assert ds.tokenizer.get_vocab_size() <= 300
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(SpecError, match="bad.jsonl:2"):
        open_dataset(str(bad), seq_len=8, vocab_size=300)
    bad.write_text('{"body": "no text field"}\n')
    with pytest.raises(SpecError, match="data_text_field"):
        open_dataset(str(bad), seq_len=8, vocab_size=300)
    with pytest.raises(SpecError, match="more ids than the model"):
        open_dataset(str(tmp_path / "*.txt"), seq_len=8, vocab_size=200,
                     tokenizer=train_bpe(["x y z " * 50], vocab_size=300))


def test_bpe_training_is_deterministic():
    texts = stdlib_texts()[:4]
    first = train_bpe(texts, vocab_size=400).to_str()
    assert train_bpe(texts, vocab_size=400).to_str() == first
    assert train_bpe(texts[:3], vocab_size=400).to_str() != first  # negative control


def run_ranks(dataset, state, world: int, steps: int, global_batch: int):
    """Each rank restores ``state``, takes its dp share for ``steps`` steps; returns the
    sample indices read, the tokens of those samples, and the (agreed) sampler state."""
    seen, tokens, states = [], {}, []
    for rank in range(world):
        sampler = ResumableSampler(dataset.num_samples, seed=11)
        if state is not None:
            sampler.load_state_dict(state)
        for _ in range(steps):
            mine = ResumableSampler.shard(sampler.next_indices(global_batch), rank, world)
            x, _ = dataset.get_batch(mine)
            seen += mine.tolist()
            tokens.update(zip(mine.tolist(), x.numpy()))
        states.append(sampler.state_dict())
    assert all(s == states[0] for s in states)
    return seen, tokens, states[0]


@pytest.mark.parametrize("kind", ["megatron", "jsonl"])
def test_exactly_once_across_2_1_2_ranks(corpus, kind):
    """One whole epoch split 2 -> 1 -> 2 ranks: every sample read once, and the samples' inputs
    cover the packed stream once (each token of the first num_samples * seq_len)."""
    ds = open_dataset(corpus[kind], seq_len=SEQ_LEN, vocab_size=VOCAB,
                      tokenizer=corpus["tokenizer"])
    batch = 8
    n_steps = ds.num_samples // batch
    a, ta, state = run_ranks(ds, None, 2, n_steps // 3, batch)
    b, tb, state = run_ranks(ds, state, 1, n_steps // 3, batch)
    rest = n_steps - 2 * (n_steps // 3)
    c, tc, state = run_ranks(ds, state, 2, rest, batch)
    counts = Counter(a + b + c)
    assert set(counts.values()) == {1} and len(counts) == n_steps * batch
    assert state == dict(state, epoch=0, position=n_steps * batch)
    # Sample i is stream tokens [i * seq_len, (i + 1) * seq_len): distinct samples read
    # distinct tokens, so the stream's tokens under them were each read once.
    tokens = {**ta, **tb, **tc}
    assert all((tokens[i] == ds.stream(i * SEQ_LEN, SEQ_LEN)).all() for i in tokens)
    print({kind: dict(samples=ds.num_samples, read=len(counts), once=sum(
        v == 1 for v in counts.values()), tokens_read=len(counts) * SEQ_LEN)})
    # Negative control: a restart that forgets the position reads samples twice.
    again, _, _ = run_ranks(ds, None, 1, n_steps // 3, batch)
    assert Counter(a + again).most_common(1)[0][1] == 2


@pytest.mark.dist
@pytest.mark.timeout(200)
def test_trainer_resumes_exactly_once_2_1_2_ranks(tmp_path, corpus):
    """The Trainer (tiny HF Llama) on 2 gloo ranks, then 1, then 2, each from the sampler
    state the previous one saved: the samples read (recorded by the dataset) are each read
    once, and are exactly the sampler's first (2 + 3 + 2) * 8 positions."""
    from tests.runtime.harness import spawn

    steps = (2, 3, 2)
    res = spawn("tests.runtime.byo_scenarios:data_resume", 2, tmp_path, timeout_s=180,
                args=dict(data=corpus["megatron"], tokenizer=corpus["tokenizer"], steps=steps))
    read = [i for r in res for part in ("first", "middle", "last") for i in r[part]]
    counts = Counter(read)
    assert set(counts.values()) == {1} and len(counts) == sum(steps) * 8
    expected = ResumableSampler(res[0]["states"][0]["num_samples"], seed=7).next_indices(
        sum(steps) * 8)
    assert sorted(counts) == sorted(expected.tolist())
    assert [s["position"] for s in res[0]["states"]] == [16, 40, 56]
    assert res[0]["states"] == res[1]["states"]
    # Rank 1 read nothing while rank 0 trained alone.
    assert res[1]["middle"] == [] and len(res[0]["middle"]) == 3 * 8
    print({"samples_read": len(read), "distinct": len(counts),
           "positions": [s["position"] for s in res[0]["states"]]})
