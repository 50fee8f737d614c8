"""Whole tensors out of a committed checkpoint, in one process, through our own reader.

Used by ``trainpilot export-weights``: every chunk of every tensor under a prefix (``model/``)
is read from the JSON manifest's locations (never unpickled), checked against its SHA-256,
and placed at its offsets in a full-size tensor, whatever world size wrote it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from trainpilot.runtime.checkpoint import layout
from trainpilot.runtime.checkpoint.storage import CheckpointReader
from trainpilot.specs.errors import SpecError


def read_tensors(root: str | Path, *, step: int | None = None,
                 prefix: str = "model/") -> tuple[int, dict[str, torch.Tensor]]:
    """``(step, {name without prefix: full tensor})`` of the newest committed checkpoint under
    ``root`` (or the one at ``step``) whose files verify. Raises SpecError when there is none."""
    root = Path(root)
    found = [(s, n) for s, n in layout.committed(root) if step is None or s == step]
    if not found:
        steps = [s for s, _ in layout.committed(root)]
        raise SpecError("--step" if step is not None else "RUN_DIR", step or str(root),
                        f"no committed checkpoint there; valid steps: {steps or 'none'}")
    problems: list[str] = []
    for found_step, name in found:
        try:
            body = layout.read_manifest(root, name)
        except layout.CorruptCheckpoint as err:
            problems.append(str(err))
            continue
        bad = layout.verify_files(root, body["files"], sorted(body["files"]))
        if bad:
            problems.append(f"{name}: {'; '.join(bad)}")
            continue
        return found_step, _assemble(root, body, prefix)
    raise SpecError("RUN_DIR", str(root), f"no intact checkpoint: {' | '.join(problems)}")


def _assemble(root: Path, body: dict, prefix: str) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(root=root, body=body, verify_chunks=True)
    handles: dict[str, Any] = {}

    def handle_for(rel: str) -> Any:
        handles.setdefault(rel, open(root / rel, "rb"))
        return handles[rel]

    out: dict[str, torch.Tensor] = {}
    try:
        for fqn, md in reader.tensors.items():
            if not fqn.startswith(prefix):
                continue
            full = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for chunk in md.chunks:
                data = reader.read_chunk(MetadataIndex(fqn, chunk.offsets), handle_for)
                view = full
                for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                    view = view.narrow(dim, start, length)
                view.copy_(data)
            out[fqn[len(prefix):]] = full
    finally:
        for handle in handles.values():
            handle.close()
    if not out:
        raise SpecError("checkpoint", body.get("step"), f"holds no tensor under {prefix!r}")
    return out


# The reference GPT's parameter names (runtime/models/gpt.py) -> transformers' Llama names.
_LLAMA = {"attention_norm.weight": "input_layernorm.weight",
          "attention.wq.weight": "self_attn.q_proj.weight",
          "attention.wk.weight": "self_attn.k_proj.weight",
          "attention.wv.weight": "self_attn.v_proj.weight",
          "attention.wo.weight": "self_attn.o_proj.weight",
          "ffn_norm.weight": "post_attention_layernorm.weight",
          "feed_forward.w1.weight": "mlp.gate_proj.weight",
          "feed_forward.w3.weight": "mlp.up_proj.weight",
          "feed_forward.w2.weight": "mlp.down_proj.weight"}


def reference_gpt_to_hf(tensors: dict[str, torch.Tensor], spec) -> tuple[dict, dict]:
    """``(config.json mapping, HF state dict)`` for a checkpoint of trainpilot's reference GPT
    (``spec``: its ModelSpec). Exact for the two shapes ``specs.hf.hf_config_from_model``
    accepts: Llama (names renamed; both use rotate-half RoPE, so no permutation) and GPT-2
    (q/k/v fused into ``c_attn``, linears transposed into Conv1D layout)."""
    from trainpilot.specs.hf import hf_config_from_model

    config = hf_config_from_model(spec)
    layers = range(spec.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    if config["model_type"] == "llama":
        out["model.embed_tokens.weight"] = tensors["tok_embeddings.weight"]
        for i in layers:
            for ours, theirs in _LLAMA.items():
                out[f"model.layers.{i}.{theirs}"] = tensors[f"layers.{i}.{ours}"]
        out["model.norm.weight"] = tensors["norm.weight"]
        if not spec.tie_word_embeddings:
            out["lm_head.weight"] = tensors["output.weight"]
        return config, out
    # GPT-2: Conv1D computes x @ W + b with W of shape [in, out]: our Linear weights transposed.
    out["transformer.wte.weight"] = tensors["tok_embeddings.weight"]
    out["transformer.wpe.weight"] = tensors["pos_embeddings.weight"]
    config["n_positions"] = tensors["pos_embeddings.weight"].shape[0]  # the trained length
    for i in layers:
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        attn = [tensors[f"{ours}attention.{w}.weight"] for w in ("wq", "wk", "wv")]
        out[f"{theirs}attn.c_attn.weight"] = torch.cat(attn, dim=0).t().contiguous()
        out[f"{theirs}attn.c_attn.bias"] = torch.cat(
            [tensors[f"{ours}attention.{w}.bias"] for w in ("wq", "wk", "wv")])
        for src, dst in (("attention.wo", "attn.c_proj"), ("feed_forward.w1", "mlp.c_fc"),
                         ("feed_forward.w2", "mlp.c_proj")):
            out[f"{theirs}{dst}.weight"] = tensors[f"{ours}{src}.weight"].t().contiguous()
            out[f"{theirs}{dst}.bias"] = tensors[f"{ours}{src}.bias"]
        for src, dst in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[f"{theirs}{dst}.weight"] = tensors[f"{ours}{src}.weight"]
            out[f"{theirs}{dst}.bias"] = tensors[f"{ours}{src}.bias"]
    out["transformer.ln_f.weight"] = tensors["norm.weight"]
    out["transformer.ln_f.bias"] = tensors["norm.bias"]
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = tensors["output.weight"]
    return config, out
