"""The export matrix every consumer's validator runs on: dense, MoE, pipeline (even, uneven,
interleaved), context parallel, ZeRO 0-3, on the presets' real hyper-parameters."""

from __future__ import annotations

from trainpilot.specs import ModelSpec, Plan, load_model
from trainpilot.specs.job import check_job


def _case(name: str, model: str | ModelSpec, **plan) -> tuple[str, ModelSpec, Plan]:
    spec = load_model(model) if isinstance(model, str) else model
    plan.setdefault("seq_len", 4096)
    p = Plan(**plan)
    check_job(spec, None, p)
    return name, spec, p


def cases() -> list[tuple[str, ModelSpec, Plan]]:
    """(id, model, plan) for every row of the matrix."""
    tied = load_model("tiny-gpt").replace(tie_word_embeddings=True, name="tiny-tied")
    return [
        _case("dense-tp2-sp-zero1", "llama3-8b", tp=2, dp=2, zero=1, sequence_parallel=True,
              global_batch_size=16, micro_batch_size=2, recompute="selective"),
        _case("dense-tp2-zero1", "llama3-8b", tp=2, dp=2, zero=1, global_batch_size=16,
              micro_batch_size=2),
        _case("dense-zero0", "llama3-8b", dp=4, zero=0, global_batch_size=16),
        _case("dense-zero2", "llama3-8b", tp=2, dp=2, zero=2, global_batch_size=8),
        _case("dense-zero3", "llama3-8b", dp=4, zero=3, global_batch_size=8,
              recompute="full"),
        _case("dense-zero3-hsdp-tp2", "llama3-8b", tp=2, dp=4, zero=3, dp_shard=2,
              global_batch_size=8),
        _case("pp4-even", "llama3-8b", pp=4, dp=2, global_batch_size=32),
        _case("pp4-uneven", "llama3-8b", pp=4, dp=2, global_batch_size=32,
              pp_first_stage_layers=6, pp_last_stage_layers=10),
        _case("pp4-vp2", "llama3-8b", pp=4, vp=2, dp=2, global_batch_size=32),
        _case("pp2-vp2", "llama3-8b", pp=2, vp=2, dp=2, global_batch_size=32),
        _case("pp16-vp8-405b", "llama3-405b", tp=8, pp=16, vp=8, dp=1, global_batch_size=64,
              pp_first_stage_layers=7, pp_last_stage_layers=7, sequence_parallel=True,
              seq_len=8192),
        _case("pp4-vp2-uneven-layout", "llama3-8b", pp=4, vp=2, dp=1, global_batch_size=16,
              pp_first_stage_layers=5, pp_last_stage_layers=7),
        _case("cp2-tp2", "llama3-8b", tp=2, cp=2, dp=2, global_batch_size=8, seq_len=8192,
              sequence_parallel=True),
        _case("gpt3-learned-tp2-pp2", "gpt3-175b", tp=2, pp=2, dp=2, global_batch_size=16,
              seq_len=2048),
        _case("moe-mixtral-ep4", "mixtral-8x7b", dp=4, ep=4, global_batch_size=16),
        _case("moe-qwen3-tp2-ep2", "qwen3-30b-a3b", tp=2, dp=4, ep=2, global_batch_size=16,
              sequence_parallel=True),
        _case("moe-deepseek-v3-pp2", "deepseek-v3", tp=2, pp=2, dp=4, ep=4,
              global_batch_size=32, pp_first_stage_layers=30, pp_last_stage_layers=31,
              sequence_parallel=True),
        _case("moe-deepseek-v3-ep8-mtp", "deepseek-v3", dp=8, ep=8, global_batch_size=16),
        _case("tied-dense-zero1", tied, dp=2, global_batch_size=4, seq_len=256),
    ]


def megatron_runtime_cases() -> list[tuple[str, ModelSpec, Plan]]:
    """Megatron-Core runtime knobs the cost model prices: token dropping with padded expert
    inputs, CUDA-graph scopes (dropless: attention and router; drop-and-pad: the MoE block), FP8
    scaling recipes."""
    return [
        _case("moe-qwen3-dropless-graphs", "qwen3-30b-a3b", dp=8, ep=8, etp=1,
              global_batch_size=16, runtime=dict(stack="megatron", cuda_graph_scope=[
                  "attn", "moe_router", "moe_preprocess"])),
        _case("moe-qwen3-tokendrop-moe-graph", "qwen3-30b-a3b", dp=8, ep=8, etp=1,
              global_batch_size=16, runtime=dict(stack="megatron", moe_capacity_factor=1.0,
                                                 cuda_graph_scope=["attn", "moe"])),
        _case("dense-full-iteration-graph", "llama3-8b", tp=2, dp=2, global_batch_size=16,
              runtime=dict(stack="megatron", cuda_graph_scope=["full_iteration"])),
        _case("dense-fp8-current-scaling", "llama3-8b", tp=2, dp=2, global_batch_size=16,
              precision="fp8", fp8_recipe="current", runtime=dict(stack="megatron")),
        # (MoE with FP8 is validated by megatron-core only with Transformer Engine installed.)
        _case("dense-mxfp8", "llama3-8b", dp=4, global_batch_size=16, precision="fp8",
              fp8_recipe="mxfp8", runtime=dict(stack="megatron")),
    ]


def refusals() -> list[tuple[str, ModelSpec, Plan]]:
    """Combinations a consumer refuses; the exporters must refuse them too."""
    tied = load_model("tiny-gpt").replace(tie_word_embeddings=True, name="tiny-tied")
    return [
        _case("zero3-pp2", "llama3-8b", pp=2, dp=2, zero=3, global_batch_size=8),
        _case("zero3-ep2", "mixtral-8x7b", dp=2, ep=2, zero=3, global_batch_size=8),
        _case("zero3-tied", tied, dp=2, zero=3, global_batch_size=4, seq_len=256),
    ]
