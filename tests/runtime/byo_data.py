"""Real text for the bring-your-own tests: Python's own standard-library sources (on every
machine, no download), a byte-level BPE trained on them, and tiny HF model configs."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Any

# Modules present in every CPython 3.11+ (sorted, fixed list: the corpus is the same everywhere).
STDLIB_MODULES = ("argparse", "base64", "bisect", "calendar", "colorsys", "csv", "difflib",
                  "fractions", "heapq", "shlex", "string", "textwrap")
VOCAB = 512
SEQ_LEN = 64


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / f"{name}.py" for name in STDLIB_MODULES]


def stdlib_texts() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in stdlib_files()]


def make_corpus(folder: Path) -> dict[str, str]:
    """tokenizer.json (BPE of VOCAB ids trained on the corpus), corpus.jsonl (one document a
    file), a Megatron .bin/.idx of it (EOS appended) and a stdlib glob; returns their paths."""
    from trainpilot.runtime.datasets import tokenize_to_megatron, train_bpe

    folder.mkdir(parents=True, exist_ok=True)
    texts = stdlib_texts()
    tokenizer_path = folder / "tokenizer.json"
    train_bpe(texts, vocab_size=VOCAB).save(str(tokenizer_path))
    jsonl = folder / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prefix = tokenize_to_megatron(jsonl, folder / "corpus", tokenizer=tokenizer_path)
    return dict(tokenizer=str(tokenizer_path), jsonl=str(jsonl),
                megatron=str(prefix.with_suffix(".bin")))


def tiny_configs() -> dict[str, dict[str, Any]]:
    """hidden 64, 2 layers, 4 heads (2 KV heads), vocab VOCAB: llama, qwen3 (tied embeddings,
    q/k norms), mixtral (4 experts, top-2)."""
    from transformers import LlamaConfig, MixtralConfig, Qwen3Config

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2 * SEQ_LEN)
    return dict(
        llama=LlamaConfig(intermediate_size=128, **common).to_dict(),
        qwen3=Qwen3Config(intermediate_size=128, head_dim=16, tie_word_embeddings=True,
                          **common).to_dict(),
        mixtral=MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                              **common).to_dict(),
    )


def more_configs() -> dict[str, dict[str, Any]]:
    """The other supported families, same sizes: qwen2 (q/k/v biases), mistral, qwen2_moe
    (shared expert with its gate), qwen3_moe; and a 4-layer llama (interleaved pipelines)."""
    from transformers import MistralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2 * SEQ_LEN)
    moe = dict(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
               num_experts_per_tok=2)
    return dict(
        llama4=dict(tiny_configs()["llama"], num_hidden_layers=4),  # room for interleaving
        qwen2=Qwen2Config(intermediate_size=128, **common).to_dict(),
        mistral=MistralConfig(intermediate_size=128, **common).to_dict(),
        qwen2_moe=Qwen2MoeConfig(shared_expert_intermediate_size=64, **moe, **common).to_dict(),
        qwen3_moe=Qwen3MoeConfig(head_dim=16, **moe, **common).to_dict(),
    )
