"""The executing stack as the cost model sees it: a Plan's RuntimeProfile resolved against its
stack's defaults, the model (dropout) and the caller's CostOptions overrides.

Physical meaning of each term (docs/cost_model.md, "Runtime profiles"):

* ``fused``: a norm, an activation function, RoPE or the loss is one kernel reading its input
  and writing its output once. Unfused (eager PyTorch) it is the chain of elementwise kernels
  the framework issues, each reading and writing a full tensor, several of them in fp32
  (``UNFUSED_TRAFFIC``, ``UNFUSED_KERNELS`` below: counted from the eager decompositions).
* ``host_us``: the host time to issue one kernel; a kernel never takes less on the critical
  path. None: the device data's value.
* ``tp_overlap`` / ``ep_overlap``: TP collectives / expert all-to-alls run concurrently with
  independent compute (only what the compute cannot cover is exposed).
* ``expert_gemm``: "per_expert" issues a GEMM (and, under fp8, its input's quantization) per
  local expert, so a rank with many small experts is bound by the host's issue rate;
  "grouped" runs all local experts as one kernel.
* ``capacity_factor``: None (dropless) makes every MoE layer's forward wait on the host for
  its per-expert token counts (``moe_host_sync``), so the host's issue time of the kernels
  after that point is not hidden behind the GPU's; with token dropping the expert inputs are
  padded to ``capacity_factor`` x the mean and no sync is needed.
* ``graph_scope``: the parts of a layer captured as CUDA graphs (Megatron's
  ``--cuda-graph-scope``): their kernels replay from one launch, so the host pays one issue
  time per graph instead of one per kernel.
* ``zero3_per_param``: ZeRO-3 collectives one per weight tensor, each with per-rank chunk
  copies and (gathers) a device synchronize before it (DeepSpeed 0.3.12-0.5.4;
  ``perf/dataparallel.py``).
* ``grad_sync``: "step" reduces gradients once per step (after the last micro-batch), holding
  them unsharded in between; "micro_batch" reduces (ZeRO-2: reduce-scatters) after every
  micro-batch and keeps only the shard. ``sync_for(zero)`` is what a layout at that ZeRO stage
  does: on the megatron stack ZeRO-2/3 (Megatron-Core's FSDP) reduce-scatter every micro-batch
  unless the plan names ``grad_sync``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainpilot.specs import ModelSpec, Plan

# Megatron-Core without overlapped reduction: the whole gradient buffer is one bucket (a size
# no buffer reaches, in MB).
MEGATRON_ONE_BUCKET_MB = 1e9

# Eager PyTorch decompositions, counted as (full-tensor passes through HBM relative to the fused
# kernel, kernels issued) for one forward; backward kernels follow the same ratio.
# * RMSNorm written in PyTorch ops under autocast (Llama-style models, torchtitan): cast to
#   fp32, square, mean, rsqrt, two multiplies, cast back: 7 kernels moving ~3.5x the fused
#   kernel's bytes (the fp32 intermediates count double).
# * LayerNorm and GeLU: one native ATen kernel each in eager mode too (no difference).
# * SwiGLU, silu(a) * b: silu reads a and writes s, the multiply reads s and b and writes: 5
#   passes against the fused kernel's 3 (1.7x), 2 kernels.
# * RoPE in the rotate-half / complex-multiply form: slices, negation, concatenation, two
#   multiplies and an add: ~3x the bytes, 6 kernels.
# * The loss: log_softmax and nll over fp32 logits: 1.5x the fused vocab-parallel loss, 3.
UNFUSED_TRAFFIC = {"rmsnorm": 3.5, "layernorm": 1.0, "swiglu": 1.7, "gelu": 1.0, "rope": 3.0,
                   "loss": 1.5}
UNFUSED_KERNELS = {"rmsnorm": 7, "layernorm": 1, "swiglu": 2, "gelu": 1, "rope": 6, "loss": 3}


@dataclass(frozen=True, slots=True)
class Runtime:
    """Resolved runtime facts one layout is costed with (hashable: part of cache keys)."""

    stack: str = "trainpilot"
    flash_attention: bool = True
    fused: bool = False
    compile: bool = False
    host_us: float | None = None
    tp_overlap: bool = False
    ep_overlap: bool = False
    grad_sync: str = "step"
    moe_imbalance: float = 1.1
    dropout: bool = False
    grad_bytes: int = 4
    ep_dispatcher: str = "alltoall"
    attention_kernel: str = "flash2"
    expert_gemm: str = "per_expert"
    capacity_factor: float | None = None  # None: dropless
    fp8_recipe: str = "delayed"  # Plan.fp8_recipe: how FP8 GEMM inputs are scaled
    fp8_param_gather: bool = False  # Plan.fp8_param_gather: weights all-gathered in 8 bits
    graph_scope: frozenset[str] = frozenset()  # CUDA-graph scopes (Megatron's names)
    zero3_per_param: bool = False  # RuntimeProfile.zero3_collectives == "per_param"
    # Megatron-Core's own FSDP (ZeRO-2 "optim_grads", ZeRO-3 "optim_grads_params") reduce-
    # scatters gradients after every micro-batch's backward whatever no_sync says
    # (distributed/custom_fsdp, core_v0.12.0: "For grads shard mode there will actually always be
    # gradient sync happening"); True when the stack is megatron and the plan leaves grad_sync
    # unset.
    sharded_every_micro_batch: bool = False

    def sync_for(self, zero: int) -> str:
        """The gradient reduction (``grad_sync``) at ZeRO stage ``zero``."""
        return "micro_batch" if self.sharded_every_micro_batch and zero >= 2 else self.grad_sync

    def graphed(self, scope: str) -> bool:
        """Whether the kernels of ``scope`` (attn, mlp, moe_router, moe: the whole MoE block)
        replay as CUDA graphs. "full_iteration" graphs every scope; the MoE block (``moe``)
        can be captured only with static shapes, i.e. token dropping."""
        if scope == "moe" and self.capacity_factor is None:
            return False
        return scope in self.graph_scope or "full_iteration" in self.graph_scope

    def moe_host_sync(self, ep: int) -> bool:
        """Whether a dropless MoE layer's forward makes the host wait for the per-expert token
        counts: Megatron-Core always (its GroupedLinear and all-to-all take their splits as
        Python lists), PyTorch stacks when an expert all-to-all needs its split sizes (ep > 1;
        torch._grouped_mm reads its offsets on the device)."""
        if self.capacity_factor is not None:
            return False
        return self.stack in ("megatron", "megatron-legacy", "deepspeed") or ep > 1

    @property
    def norm_amax_fused(self) -> bool:
        """Whether a norm that feeds an FP8 GEMM (Transformer Engine's LayerNormLinear: the
        attention's QKV, a dense MLP's FC1) computes its output's amax for current scaling
        (Megatron-Core's Transformer Engine layers; ``perf.hardware.FP8_CAST_NORM_FED``)."""
        return self.stack == "megatron"

    @property
    def grouped_cast_fused(self) -> bool:
        """Whether a rank's per-expert FP8 inputs are quantized in one kernel for all local
        experts: Transformer Engine's GroupedLinear (``split_quantize``) has a multi-tensor
        cast-transpose for delayed scaling only; other recipes and stacks quantize per expert."""
        return self.stack == "megatron" and self.fp8_recipe == "delayed"

    @property
    def param_gather_bytes(self) -> float:
        """Bytes per parameter of the data-parallel parameter all-gather: the 16-bit weights, or
        their 8-bit copies under ``fp8_param_gather``, except MXFP8, whose Megatron path gathers
        16-bit values into the gradient buffer and quantizes after the gather (Megatron-LM
        ``reuse_grad_buf_for_mxfp8_param_ag``, !3415: "cast from bf16 to MXFP8 during copy")."""
        return 1.0 if self.fp8_param_gather and self.fp8_recipe != "mxfp8" else 2.0

    @property
    def weight_cast_per_pass(self) -> bool:
        """Whether FP8 weights are quantized in every forward and backward (torchao's
        Float8Linear, the PyTorch stacks' FP8) rather than once per step (Transformer Engine's
        FP8 weight cache); ``perf.hardware.FP8_WEIGHT_CAST``."""
        return self.stack == "pytorch"

    def traffic(self, kind: str) -> float:
        """HBM traffic of an elementwise op of ``kind`` relative to its fused kernel."""
        return 1.0 if self.fused else UNFUSED_TRAFFIC[kind]

    def kernels(self, kind: str) -> int:
        """Kernels issued for an elementwise op of ``kind``."""
        return 1 if self.fused else UNFUSED_KERNELS[kind]


def grad_bytes(plan: Plan) -> int:
    """Bytes per gradient element in the data-parallel reduction: 16-bit when the plan
    compresses gradients to fp16/bf16 (``comm.compression``: Megatron's --grad-reduce-in-bf16,
    FSDP2's reduce_dtype), else fp32 for bf16/fp8 runs (Megatron's fp32 main gradients, FSDP2's
    fp32 reduce) and fp16 for fp16 runs."""
    if plan.comm.compression in ("fp16", "bf16"):
        return 2
    return 2 if plan.precision == "fp16" else 4


def bucket_mb(plan: Plan, rt: Runtime) -> float:
    """The gradient bucket size (MB) the executing stack uses: ``plan.comm.bucket_mb`` when
    the plan names one. Unset, Megatron-Core's DistributedDataParallel sizes its buckets at
    ``max(40M, 1M x DP)`` parameters of its gradient buffer (``bucket_size``, core v0.7 on:
    "larger DP sizes need larger buckets to ensure collectives do not become latency-bound"),
    and keeps one bucket when the reduction does not overlap the backward; every other stack
    uses PyTorch DDP's 25 MB."""
    if plan.comm.bucket_mb is not None or rt.stack != "megatron":
        return plan.comm.ddp_bucket_mb
    if not plan.comm.overlap:
        return MEGATRON_ONE_BUCKET_MB
    return max(40e6, 1e6 * plan.dp) * rt.grad_bytes / 1e6


def resolve(model: ModelSpec, plan: Plan, options=None) -> Runtime:
    """The plan's runtime for ``model``; non-None ``CostOptions`` fields override it."""
    prof = plan.runtime
    rt: dict[str, Any] = dict(
        stack=prof.stack, flash_attention=bool(prof.resolved("flash_attention")),
        fused=bool(prof.resolved("fused_kernels")), compile=prof.compile,
        host_us=prof.host_us_per_kernel, tp_overlap=bool(prof.resolved("tp_comm_overlap")),
        ep_overlap=bool(prof.resolved("ep_comm_overlap")),
        grad_sync=str(prof.resolved("grad_sync")), moe_imbalance=prof.moe_imbalance,
        dropout=model.has_dropout, grad_bytes=grad_bytes(plan), ep_dispatcher=prof.ep_dispatcher,
        attention_kernel=str(prof.resolved("attention_kernel")),
        expert_gemm=str(prof.resolved("expert_gemm")),
        capacity_factor=prof.moe_capacity_factor, fp8_recipe=plan.fp8_recipe,
        fp8_param_gather=plan.fp8_param_gather,  # Plan refuses it without precision fp8
        graph_scope=frozenset(prof.cuda_graph_scope),
        zero3_per_param=prof.zero3_collectives == "per_param",
        sharded_every_micro_batch=prof.stack == "megatron" and prof.grad_sync is None,
    )
    if options is not None:
        for key, attr in (("flash_attention", "flash_attention"), ("dropout", "dropout"),
                          ("moe_imbalance", "ep_imbalance"), ("grad_bytes", "grad_reduce_bytes"),
                          ("host_us", "host_us_per_kernel")):
            value = getattr(options, attr, None)
            if value is not None:
                rt[key] = value
    return Runtime(**rt)
