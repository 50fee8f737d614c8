"""RuntimeProfile: which software executes a Plan, and the choices of that software that change
its speed (kernel fusion, compilation, communication overlap, when gradients are reduced).

It is part of the Plan ("how"): the same layout runs at different speeds on Megatron-Core with
Transformer Engine's fused kernels and overlapped communication and on eager PyTorch FSDP2.
Every field left ``None`` takes the stack's default (``stack_defaults``); the cost model reads
the resolved values only, so a plan file can name a stack and override one knob.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import NonNegativeFloat, PositiveFloat

from trainpilot.specs.base import Spec
from trainpilot.specs.errors import SpecError

Stack = Literal["trainpilot", "pytorch", "megatron", "megatron-legacy", "deepspeed"]
STACKS: tuple[str, ...] = ("trainpilot", "pytorch", "megatron", "megatron-legacy", "deepspeed")

# What each stack does when the profile does not say (sources in docs/cost_model.md, "Runtime
# profiles"):
# * trainpilot: this project's runtime (runtime/parallelize.py): PyTorch FSDP2 / DDP / DTensor
#   TP in eager mode, SDPA flash attention, unfused norms and activations, gradients reduced
#   once per step (no_sync / set_requires_gradient_sync(last)), no TP or EP overlap.
# * pytorch: PyTorch FSDP/FSDP2 training loops (torchtitan, llm-foundry/Composer, NeMo
#   AutoModel): as trainpilot; ``compile`` and fused kernels are per-run choices; experts run
#   as one grouped GEMM (torch._grouped_mm, torchtitan's default since 2025).
# * megatron: Megatron-Core with Transformer Engine: fused norm/activation/RoPE/softmax kernels,
#   flash attention, distributed-optimizer gradient reduce-scatter per step overlapped with the
#   backward (with ZeRO-2/3, Megatron-Core's FSDP, after every micro-batch: perf.runtime
#   Runtime.sync_for), parameter all-gather overlapped with the forward; TP and EP overlap per run;
#   experts through TE's GroupedLinear (a GEMM and its fp8 quantization per local expert).
# * megatron-legacy: 2021-22 Megatron-LM / Megatron-DeepSpeed: unfused (softmax) attention,
#   apex fused LayerNorm and bias-GeLU, no communication overlap.
# * deepspeed: DeepSpeed ZeRO: gradients reduced (ZeRO-2: reduce-scattered) after every
#   micro-batch's backward.
_DEFAULTS: dict[str, dict[str, object]] = {
    "trainpilot": dict(flash_attention=True, fused_kernels=False, tp_comm_overlap=False,
                       ep_comm_overlap=False, grad_sync="step", attention_kernel="flash2",
                       expert_gemm="per_expert"),
    "pytorch": dict(flash_attention=True, fused_kernels=False, tp_comm_overlap=False,
                    ep_comm_overlap=False, grad_sync="step", attention_kernel="flash2",
                    expert_gemm="grouped"),
    "megatron": dict(flash_attention=True, fused_kernels=True, tp_comm_overlap=False,
                     ep_comm_overlap=False, grad_sync="step", attention_kernel="fused",
                     expert_gemm="per_expert"),
    "megatron-legacy": dict(flash_attention=False, fused_kernels=True, tp_comm_overlap=False,
                            ep_comm_overlap=False, grad_sync="step", attention_kernel="flash2",
                            expert_gemm="per_expert"),
    "deepspeed": dict(flash_attention=False, fused_kernels=True, tp_comm_overlap=False,
                      ep_comm_overlap=False, grad_sync="micro_batch", attention_kernel="flash2",
                      expert_gemm="per_expert"),
}


class RuntimeProfile(Spec):
    """The executing stack and its speed-relevant choices (``None``: the stack's default).

    ``fused_kernels``: norms, activation functions, RoPE, softmax and the loss run as one fused
    kernel each (Transformer Engine, apex, or ``torch.compile``); off, each is the chain of
    elementwise kernels eager PyTorch issues. ``compile``: torch.compile (implies fused
    elementwise kernels and fewer kernel launches). ``host_us_per_kernel``: host time to issue
    one kernel, replacing the device data's. ``tp_comm_overlap`` / ``ep_comm_overlap``: TP
    collectives / expert all-to-alls overlapped with independent compute (Megatron's
    ``--tp-comm-overlap``, ``--overlap-moe-expert-parallel-comm``, DualPipe). ``grad_sync``:
    gradients reduced once per step at the last micro-batch (``step``: Megatron, DDP no_sync,
    FSDP2's sync flag) or after every micro-batch (``micro_batch``: DeepSpeed ZeRO-2, FSDP
    without no_sync). ``moe_imbalance``: tokens on the busiest expert rank over the mean (1.0
    for force-balanced benchmarks). ``ep_dispatcher``, ``attention_kernel``, ``expert_gemm``,
    ``moe_capacity_factor``, ``cuda_graph_scope``, ``zero3_collectives``: see the fields.
    """

    stack: Stack = "trainpilot"
    flash_attention: bool | None = None
    fused_kernels: bool | None = None
    compile: bool = False
    host_us_per_kernel: NonNegativeFloat | None = None
    tp_comm_overlap: bool | None = None
    ep_comm_overlap: bool | None = None
    grad_sync: Literal["step", "micro_batch"] | None = None
    moe_imbalance: float = pydantic.Field(default=1.1, ge=1.0)
    # Token dispatch for expert parallelism: "alltoall" (NCCL all-to-all: each token copy
    # crosses the network once per destination GPU) or "deepep" (DeepSeek's DeepEP /
    # Megatron's flex dispatcher: one copy per destination node over the network, forwarded
    # inside the node over NVLink).
    ep_dispatcher: Literal["alltoall", "deepep"] = "alltoall"
    # Which fused attention kernel runs (with flash_attention): FlashAttention-2 (PyTorch's
    # SDPA, flash_attn 2.x), FlashAttention v1 (flash_attn 1.x, half FA-2's throughput), or
    # "fused": Transformer Engine / cuDNN fused attention (Megatron-Core's default).
    attention_kernel: Literal["flash1", "flash2", "fused"] | None = None
    # How a rank's local experts run their GEMMs: "per_expert" (one GEMM launch per local
    # expert, each input quantized separately under fp8: Transformer Engine's GroupedLinear,
    # which Megatron-Core's TEGroupedMLP uses; DeepSpeed-MoE and this project's runtime loop
    # over experts) or "grouped" (one grouped-GEMM kernel for all of them: torch._grouped_mm in
    # torchtitan, the grouped_gemm library behind Megatron's legacy GroupedMLP, DeepGEMM).
    expert_gemm: Literal["per_expert", "grouped"] | None = None
    # Token dropping (``--moe-expert-capacity-factor`` with the expert inputs padded to the
    # capacity): each expert takes at most ``capacity x`` the mean tokens and computes exactly
    # that many rows, so every shape is static. None: dropless, where the host must read the
    # per-expert token counts back from the GPU (a device-to-host sync in every MoE layer's
    # forward: Megatron-Core's dispatchers, whose GroupedLinear takes its splits as a Python
    # list; PyTorch stacks when the expert all-to-all needs its split sizes, ep > 1).
    moe_capacity_factor: PositiveFloat | None = None
    # Parts of each layer captured as CUDA graphs (Megatron-Core's --cuda-graph-scope with
    # --cuda-graph-impl transformer_engine or local): "attn" (input norm, attention,
    # residual), "mlp" (a dense MLP), "moe_router" (pre-MLP norm and router), "moe_preprocess"
    # (the dispatcher's preprocessing; its device-to-host sync stays), "moe" (the whole MoE
    # block: token dropping only, dropless shapes are dynamic), "full_iteration" (every
    # scope). A graph's kernels replay from one launch: no per-kernel host issue time.
    cuda_graph_scope: tuple[Literal["attn", "mlp", "moe_router", "moe_preprocess", "moe",
                                    "full_iteration"], ...] = ()
    # How ZeRO-3 issues its data-parallel collectives: "bucketed" (one collective per wrapped
    # unit or bucket into one flat buffer: FSDP/FSDP2, Megatron-FSDP, DeepSpeed from 0.6.0,
    # 2022, whose fetch coalesces a module's gathers) or "per_param" (DeepSpeed 0.3.12-0.5.4,
    # Mar-Oct 2021, partition_parameters.py: one all-gather per partitioned weight tensor in
    # every module forward, in the recomputed forward and in the backward, and one
    # reduce-scatter per tensor; each takes a Python list of the group's n chunks, which
    # ProcessGroupNCCL copies one chunk at a time (n copy kernels issued per collective); and
    # a torch.cuda.synchronize() precedes every parameter gather, so none overlaps compute).
    # DeepSpeed 0.5.5-0.5.10 sits between: per-tensor gathers after a synchronize, but into a
    # flat tensor (_all_gather_base) without the chunk copies; neither value is exact for it.
    zero3_collectives: Literal["bucketed", "per_param"] = "bucketed"

    @pydantic.model_validator(mode="after")
    def _check(self) -> RuntimeProfile:
        if self.compile and self.stack not in ("trainpilot", "pytorch"):
            raise SpecError("compile", True,
                            f"torch.compile is a PyTorch-stack choice; stack={self.stack!r} "
                            "fuses its own kernels (valid: stack pytorch or trainpilot)")
        if self.zero3_collectives == "per_param" and self.stack != "deepspeed":
            raise SpecError("zero3_collectives", "per_param",
                            f"per-parameter collectives are DeepSpeed's 2021 ZeRO-3; "
                            f"stack={self.stack!r} (valid: stack deepspeed, or bucketed)")
        scope = self.cuda_graph_scope
        if len(set(scope)) != len(scope):
            raise SpecError("cuda_graph_scope", list(scope), "a scope is listed twice")
        if "moe" in scope and self.moe_capacity_factor is None:
            raise SpecError("cuda_graph_scope", list(scope),
                            "the moe scope needs static shapes: set runtime.moe_capacity_factor "
                            "(token dropping), or graph moe_router instead")
        if "moe" in scope and "moe_router" in scope:
            raise SpecError("cuda_graph_scope", list(scope),
                            "moe already covers the router; valid: moe or moe_router")
        if "moe_preprocess" in scope and "moe_router" not in scope:
            raise SpecError("cuda_graph_scope", list(scope),
                            "moe_preprocess is captured with the router; add moe_router")
        if ("moe_preprocess" in scope and self.moe_capacity_factor is not None
                and self.ep_dispatcher == "alltoall"):
            raise SpecError("cuda_graph_scope", list(scope),
                            "the all-to-all dispatcher's preprocessing syncs the host under "
                            "token dropping, so Megatron cannot capture it; drop moe_preprocess")
        return self

    def resolved(self, name: str) -> object:
        """The value of ``name`` after the stack's defaults are applied."""
        value = getattr(self, name)
        if value is not None:
            return value
        if name == "fused_kernels" and self.compile:
            return True
        return _DEFAULTS[self.stack][name]


def stack_defaults(stack: str) -> dict[str, object]:
    """The defaults of ``stack`` (SpecError for an unknown one)."""
    if stack not in _DEFAULTS:
        raise SpecError("runtime.stack", stack, f"valid: {', '.join(STACKS)}")
    return dict(_DEFAULTS[stack])
