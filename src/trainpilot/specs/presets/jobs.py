"""Job presets: a model, a cluster and a plan that were run (or are typical) at that scale."""

from __future__ import annotations

from typing import Any

from trainpilot.specs.presets.hardware import build_cluster

JOBS: dict[str, dict[str, Any]] = {
    # GPT-3 175B on 1,024 A100 80GB with Megatron-LM's 3-D layout (Narayanan et al. 2021 used
    # TP=8 and PP=8-16 for this size); 300B training tokens as in Brown et al. 2020.
    "gpt3-175b-a100-1024": dict(
        name="gpt3-175b-a100-1024", model="gpt3-175b", cluster="a100-80gb-x1024",
        plan=dict(tp=8, pp=16, dp=8, zero=1, micro_batch_size=1, global_batch_size=1536,
                  seq_len=2048, recompute="full", precision="bf16",
                  runtime=dict(stack="megatron")),
        total_tokens=300_000_000_000,
    ),
    # Llama 3 405B pre-training (Llama 3 report, sec. 3.3 and Table 4): TP=8, PP=16, DP=128 on
    # 16,384 H100, 8,192-token sequences, 16M tokens per batch; 15.6T tokens. Interleaved 1F1B
    # with one layer fewer on the first and the last stage, whose first (last) model chunk
    # holds only the embedding (the output layer and loss): chunks of one layer, vp=8, the split
    # Megatron-core builds with --account-for-embedding/loss-in-pipeline-split. FSDP sharding
    # optimizer states and gradients while keeping the weights gathered: zero=2, each FSDP unit
    # (one layer, 806 MB of 16-bit gradients per rank) reduced at once. No activation
    # checkpointing at 8K (sec. 3.3.2); sequence parallel and micro-batch 1 are assumptions
    # (not published). Predicted peak 72.3 GiB of the H100's 79.65.
    # The documents say everything the validation row (llama3_2024) uses: 3,072-GPU pods as
    # racks (384 nodes), gradients reduced in bf16 (comm.compression) per micro-batch and per
    # FSDP unit, Meta's PyTorch stack with fused kernels.
    "llama3-405b-h100-16384": dict(
        name="llama3-405b-h100-16384", model="llama3-405b",
        cluster=dict(build_cluster("h100-sxm", 16384), nodes_per_rack=384),
        plan=dict(tp=8, pp=16, vp=8, dp=128, zero=2, micro_batch_size=1, global_batch_size=2048,
                  seq_len=8192, recompute="none", sequence_parallel=True, precision="bf16",
                  pp_first_stage_layers=7, pp_last_stage_layers=7,
                  comm=dict(bucket_mb=806, compression="bf16"),
                  runtime=dict(stack="pytorch", fused_kernels=True, grad_sync="micro_batch")),
        total_tokens=15_600_000_000_000,
    ),
    # DeepSeek-V3 (report sec. 3.2-3.3): PP=16, EP=64 across 8 nodes, ZeRO-1 DP, no TP, on 2,048
    # H800; FP8 GEMMs with their inputs cached in FP8; 4K sequences; 14.8T tokens; the final
    # batch size was 15,360 sequences. DualPipe (bidirectional, its all-to-all hidden behind
    # the other direction's compute) is not a schedule the Plan can express: 1F1B stands in,
    # whose memory (PP micro-batches in flight) is DualPipe's less one, and whose bubble is
    # larger. Selective recompute here is Megatron's (the attention core); DeepSeek recomputes
    # every RMSNorm and the MLA up-projections instead, which the Plan cannot express either,
    # so the cost model keeps those activations (Q, K, V up-projected, norm outputs: about
    # 0.55 GB per layer per micro-batch) and predicts 94 GiB on stage 1 of 79.65: it does not
    # fit here, though it did in DeepSeek's run (docs/cost_model.md).
    "deepseek-v3-h800-2048": dict(
        name="deepseek-v3-h800-2048", model="deepseek-v3", cluster="h800-x2048",
        plan=dict(tp=1, pp=16, dp=128, ep=64, zero=1, micro_batch_size=1,
                  global_batch_size=15360, seq_len=4096, recompute="selective",
                  precision="fp8",
                  pp_first_stage_layers=3, pp_last_stage_layers=2,
                  runtime=dict(stack="megatron", ep_comm_overlap=True, ep_dispatcher="deepep",
                               moe_imbalance=1.0)),
        total_tokens=14_800_000_000_000,
    ),
    # Llama 3 8B on one DGX H100 node with FSDP (zero 3), an everyday fine-tuning layout, run
    # as torchtitan runs it: FSDP2 reduce-scatters gradients after every micro-batch (its
    # train_step never disables gradient sync), so only the gradient shard is held.
    "llama3-8b-h100-8": dict(
        name="llama3-8b-h100-8", model="llama3-8b", cluster="h100-sxm-x8",
        plan=dict(tp=1, pp=1, dp=8, zero=3, micro_batch_size=1, global_batch_size=64,
                  seq_len=8192, recompute="selective", precision="bf16",
                  runtime=dict(stack="pytorch", grad_sync="micro_batch")),
        total_tokens=1_000_000_000,
    ),
    # The tiny model on two CPU processes: what `trainpilot demo` trains.
    "tiny-gpt-cpu-2": dict(
        name="tiny-gpt-cpu-2", model="tiny-gpt", cluster="cpu-x2",
        plan=dict(dp=2, zero=0, micro_batch_size=8, global_batch_size=16, seq_len=64,
                  recompute="none", precision="bf16"),
        total_tokens=1_000_000,
    ),
}
