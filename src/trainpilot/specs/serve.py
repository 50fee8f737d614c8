"""ServePlan, the "how" document of an inference deployment: instance layouts, batch and
lengths, precisions, speculative decoding.

An *instance* is the group of devices that holds one copy of the model and serves requests
together: ``tp`` x ``dp_attention`` devices. Attention (and the dense layers) run as
``dp_attention`` independent groups of ``tp`` tensor-parallel devices, each with its own
requests and KV cache (SGLang's and vLLM's "DP attention"); MoE layers spread the experts over
``ep`` groups of the instance's devices (each expert split ``devices / ep`` ways), so with
``dp_attention`` > 1 the tokens of all groups meet in an all-to-all. With a ``prefill`` layout
the deployment is disaggregated (DistServe, DeepSeek): prefill instances compute the KV cache and
ship it to the decode instances over the network; otherwise one instance does both.

Units: lengths and batches in tokens and sequences; ``batch_size`` counts the sequences decoding
at once in one instance (None: the largest that fits its KV cache).
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import NonNegativeFloat, NonNegativeInt, PositiveInt

from trainpilot.specs.base import Spec
from trainpilot.specs.errors import SpecError

DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5625}  # fp4: + 1/16 block scales


class InstanceLayout(Spec):
    """One serving instance: ``tp`` x ``dp_attention`` devices, experts over ``ep`` groups."""

    tp: PositiveInt = 1
    dp_attention: PositiveInt = 1
    ep: PositiveInt = 1
    # Extra copies of the busiest experts (DeepSeek's EPLB: 32 on its EP32 and EP144 units).
    num_redundant_experts: NonNegativeInt = 0

    @pydantic.model_validator(mode="after")
    def _check(self) -> InstanceLayout:
        if self.num_devices % self.ep:
            raise SpecError("ep", self.ep, f"does not divide the instance's {self.num_devices} "
                            f"devices (tp={self.tp} x dp_attention={self.dp_attention}); valid: "
                            "a divisor")
        return self

    @property
    def num_devices(self) -> int:
        return self.tp * self.dp_attention

    @property
    def expert_tp(self) -> int:
        """Ways each expert's width is split."""
        return self.num_devices // self.ep

    def label(self) -> str:
        parts = [f"tp{self.tp}"]
        if self.dp_attention > 1:
            parts.append(f"dpa{self.dp_attention}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return " ".join(parts)


class SpeculativeSpec(Spec):
    """Speculative decoding: each step verifies ``num_draft_tokens`` proposed tokens per
    sequence; the i-th is accepted with probability ``acceptance`` ** i (a chain), so a step
    yields 1 + sum_i acceptance^i tokens. ``draft`` "mtp": DeepSeek's multi-token-prediction
    module (one extra decoder layer per draft token); "ngram": free proposals."""

    num_draft_tokens: NonNegativeInt = 0
    acceptance: float = pydantic.Field(default=0.8, ge=0, le=1)
    draft: Literal["mtp", "ngram"] = "mtp"

    @property
    def tokens_per_step(self) -> float:
        return 1.0 + sum(self.acceptance ** i for i in range(1, self.num_draft_tokens + 1))


class ServeRuntime(Spec):
    """The serving software stack, where its kernels change the physics (a "runtime
    profile"). Everything else about a stack (achieved bandwidths, launch gaps) is in
    ``trainpilot.perf.serve.ServeEfficiency``, calibrated on the calibration sources.

    ``gemm_kernels`` names the measured GEMM kernel class whose small-batch behaviour the cost
    model uses (``trainpilot.perf.serve.GEMM_KERNELS``): "deepgemm" (DeepSeek's DeepGEMM, 2025,
    and the FP8 GEMMs of its generation), "cutlass-3.6" (DeepSeek's tuned CUTLASS 3.6
    implementation of the same GEMMs as DeepGEMM's README measured it: 1.4-2.7x slower at
    64-128 rows, 1.0-1.3x at 4,096; the best Hopper FP8 GEMMs before 2025 published shape by
    shape, so no slower than what 2023 releases shipped).

    ``gqa_kv_reuse``: the decode attention kernel reads each KV head once for all the query
    heads that share it (TensorRT-LLM's XQA from v0.7, FlashInfer, FlashAttention, FlashMLA);
    False: once per query head, as TensorRT-LLM's masked multi-head attention kernel does, the
    only generation kernel up to v0.6 (one thread block per query head and sequence, loading
    its KV head's cache; the v0.7 XQA blog: 2.4x on Llama-70B at 128/2048).

    ``moe_gemm_kernels`` names the class of the routed experts' grouped GEMMs when it differs
    from ``gemm_kernels`` (None: the same): "triton-moe-2025" is the Triton fused-MoE kernel
    with block-scaled FP8 weights that vLLM 0.7 and SGLang 0.4 ran for tensor-parallel
    experts in early 2025, as vLLM's kernel benchmark measured it for DeepSeek-V3's experts on
    H100 (``trainpilot.sim.serve_gemm``: about 0.39 of HBM bandwidth, 0.08 of the FP8 peak).

    ``host_step_ms`` is the engine's host (CPU) time per forward pass that the GPU waits for:
    scheduling the step, building its input tensors, the sampler's device-to-host copy and
    turning the sampled ids into Python outputs. A C++ runtime with CUDA graphs (TensorRT-LLM)
    or an engine that overlaps this work with the previous step's GPU time has ~0 (the
    default; what the calibration sources ran); vLLM's V0 engine, which does it between steps,
    has ``VLLM_V0_HOST_STEP_MS``. Every prefill and decode pass pays it."""

    name: str = "current"
    gemm_kernels: Literal["deepgemm", "cutlass-3.6"] = "deepgemm"
    gqa_kv_reuse: bool = True
    moe_gemm_kernels: Literal["deepgemm", "cutlass-3.6", "triton-moe-2025"] | None = None
    host_step_ms: NonNegativeFloat = 0.0


# vLLM's V0 engine (0.6.x-0.7.x, and 0.8.x with VLLM_USE_V1=0: async output processing on,
# one scheduler step per forward): its host time per pass, fitted by
# ``trainpilot.sim.serve_validation.fit_host_step`` on the calibration source vllm-pr10933
# (benchmark_latency, Llama-3-8B, batch 1, on vLLM's main branch of 2024-12-05) and rounded to
# 0.05 ms; tests/sim check that the fit still gives it. vLLM 0.5.x, before async output
# processing, left more (4-13 ms of GPU idle per decode step in its RFC #6854's traces).
VLLM_V0_HOST_STEP_MS = 1.35


# Runtime profiles of the stacks the validation rows were measured on (each documented above).
RUNTIME_PRESETS: dict[str, dict] = {
    "current": dict(name="current"),
    # TensorRT-LLM v0.5/v0.6 (Oct-Nov 2023): masked MHA decode attention, 2023 GEMMs.
    "trtllm-0.5": dict(name="trtllm-0.5", gemm_kernels="cutlass-3.6", gqa_kv_reuse=False),
    # TensorRT-LLM v0.7 (Dec 2023): XQA for GQA decode attention, 2023 GEMMs.
    "trtllm-0.7": dict(name="trtllm-0.7", gemm_kernels="cutlass-3.6", gqa_kv_reuse=True),
    # vLLM 0.7 and SGLang 0.4 (Jan-Mar 2025) with block-FP8 experts run tensor-parallel: the
    # Triton fused-MoE kernel (DeepGEMM reached their MoE paths later, and only with EP).
    "triton-moe-2025": dict(name="triton-moe-2025", moe_gemm_kernels="triton-moe-2025"),
    # vLLM's V0 engine (0.6-0.7): current kernels, host time between passes (above).
    "vllm-v0": dict(name="vllm-v0", host_step_ms=VLLM_V0_HOST_STEP_MS),
}
# vLLM 0.7's V0 engine serving block-FP8 experts tensor-parallel: both of the above.
RUNTIME_PRESETS["vllm-v0-triton-moe"] = {**RUNTIME_PRESETS["triton-moe-2025"],
                                         **RUNTIME_PRESETS["vllm-v0"],
                                         "name": "vllm-v0-triton-moe"}


class ServePlan(Spec):
    """How a model is served. See the module docstring for the layout's meaning."""

    name: str = "custom"
    decode: InstanceLayout = InstanceLayout()  # the decode (or colocated) instance
    prefill: InstanceLayout | None = None  # set: prefill/decode disaggregation
    num_decode_instances: PositiveInt = 1
    num_prefill_instances: PositiveInt = 1
    input_len: PositiveInt
    output_len: PositiveInt
    # Sequences decoding at once per decode instance; None: the largest that fits.
    batch_size: PositiveInt | None = None
    max_batch_size: PositiveInt | None = None  # a scheduler's cap on the fitted batch
    # Prompt tokens per device in one prefill pass (the prefill batch); default: one prompt.
    prefill_tokens: PositiveInt | None = None
    # "static": a batch is prefilled, then decoded to the end together (TensorRT-LLM's
    # session benchmark); "continuous": prompts join running batches (chunked prefill in the
    # same passes as decoding), the steady state of vLLM, SGLang, TensorRT-LLM in-flight
    # batching; "unmixed": prompts join running batches, but each prompt is prefilled in a
    # pass of its own that the decoding sequences wait for (vLLM's V0 engine without chunked
    # prefill, forced off there for MLA models; SGLang without --enable-mixed-chunk): per
    # request one prefill pass plus its share of the decode steps. Disaggregated plans decode
    # continuously by construction.
    batching: Literal["static", "continuous", "unmixed"] = "continuous"
    prefix_cache_hit: float = pydantic.Field(default=0.0, ge=0, lt=1)  # input tokens not computed
    weight_dtype: Literal["bf16", "fp16", "fp8", "fp4"] = "bf16"
    # Which decoder-layer linear maps ``weight_dtype`` covers (the rest, the embedding and
    # the output head stay 16-bit): "all" (TensorRT Model Optimizer, llm-compressor,
    # DeepSeek's block FP8) or "mlp", the MLPs and experts only (Meta's Llama 3.1 FP8
    # checkpoints, llama-models' fp8_mixed mode; gpt-oss's MXFP4 experts).
    quantized_modules: Literal["all", "mlp"] = "all"
    # Decoder layers at each end of the stack left wholly 16-bit (Meta's fp8_mixed: 1, the
    # first and the last).
    unquantized_end_layers: NonNegativeInt = 0
    kv_dtype: Literal["bf16", "fp16", "fp8"] = "bf16"
    speculative: SpeculativeSpec = SpeculativeSpec()
    two_batch_overlap: bool = False  # split each pass in two to hide all-to-alls (DeepSeek)
    kv_mem_fraction: float = pydantic.Field(default=0.9, gt=0, le=1)  # of HBM left for KV
    # What ``kv_mem_fraction`` is a fraction of: "free", the HBM left after the weights, the
    # reserve and the activations (TensorRT-LLM's kv_cache_free_gpu_mem_fraction); "total",
    # all of the HBM, which the weights, the reserve and the activations share with the KV
    # cache (vLLM's gpu_memory_utilization: KV = total x fraction - the profiled peak).
    kv_mem_basis: Literal["free", "total"] = "free"
    # Tokens of the forward pass whose activation peak the engine reserves before it sizes the
    # KV cache (vLLM's profile run: max_num_batched_tokens, which without chunked prefill is
    # max(max_model_len, 2048)); None: the runtime's fixed workspace.
    profile_tokens: PositiveInt | None = None
    # When a sequence may join the running batch: "full", once its whole input + output fits
    # the free cache (TensorRT-LLM's GUARANTEED_NO_EVICT); "current", on the tokens it holds,
    # growing block by block and preempted when the cache fills (vLLM, SGLang): with continuous
    # batching the running sequences are spread over their output, input + output / 2 each on
    # average (the recomputation of preempted sequences is not priced).
    kv_admission: Literal["full", "current"] = "full"
    # Busiest device's expert rows over the mean; None: the calibrated stack's (EPLB-like
    # placement). 1.0 for a perfectly balanced router (DeepSeek's profiles simulate one).
    moe_imbalance: float | None = pydantic.Field(default=None, ge=1)
    # The software stack's kernels: a RUNTIME_PRESETS name or a ServeRuntime mapping.
    runtime: ServeRuntime = ServeRuntime()

    @pydantic.field_validator("runtime", mode="before")
    @classmethod
    def _runtime(cls, value):
        if isinstance(value, str):
            if value not in RUNTIME_PRESETS:  # loading.validate names the field and value
                raise ValueError(f"valid: {', '.join(RUNTIME_PRESETS)} or a mapping of "
                                 "ServeRuntime fields")
            return RUNTIME_PRESETS[value]
        return value

    @pydantic.model_validator(mode="after")
    def _check(self) -> ServePlan:
        if self.batch_size is not None and self.batch_size % self.decode.dp_attention:
            raise SpecError("batch_size", self.batch_size,
                            f"not a multiple of decode.dp_attention={self.decode.dp_attention} "
                            "(each attention group decodes its own share)")
        return self

    def weight_bytes(self, module: Literal["attention", "mlp"], layer: int,
                     num_layers: int) -> float:
        """Bytes per weight of ``module``'s linear maps in decoder layer ``layer`` (0-based)
        of ``num_layers``, by ``weight_dtype``, ``quantized_modules`` and
        ``unquantized_end_layers``."""
        end = self.unquantized_end_layers
        if layer < end or layer >= num_layers - end:
            return DTYPE_BYTES["bf16"]
        if module == "attention" and self.quantized_modules == "mlp":
            return DTYPE_BYTES["bf16"]
        return DTYPE_BYTES[self.weight_dtype]

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    @property
    def num_devices(self) -> int:
        n = self.decode.num_devices * self.num_decode_instances
        if self.prefill is not None:
            n += self.prefill.num_devices * self.num_prefill_instances
        return n


# Serving-plan presets. Each says where its layout comes from; lengths are typical, not the
# source's (the validation rows carry the measured ones).
SERVE_PRESETS: dict[str, dict] = {
    # DeepSeek open-source week day 6: prefill units of 4 nodes (EP32, DP-attention 32), decode
    # units of 18 nodes (EP144, DP-attention 144), 32 redundant experts, FP8 GEMMs, two-batch
    # overlap, MTP (acceptance 85-90%, DeepSeek-V3 report sec. 5.4.3).
    "deepseek-v3-pd-ep144": dict(
        name="deepseek-v3-pd-ep144",
        prefill=dict(dp_attention=32, ep=32, num_redundant_experts=32),
        decode=dict(dp_attention=144, ep=144, num_redundant_experts=32),
        input_len=4096, output_len=1024, prefill_tokens=16384, weight_dtype="fp8",
        two_batch_overlap=True, speculative=dict(num_draft_tokens=1, acceptance=0.85)),
    # LMSYS/SGLang on 12 H100 nodes: prefill EP32 on 4 nodes, decode EP72 on 9 nodes.
    "deepseek-v3-pd-ep72": dict(
        name="deepseek-v3-pd-ep72", prefill=dict(dp_attention=32, ep=32),
        decode=dict(dp_attention=72, ep=72, num_redundant_experts=32), input_len=2000,
        output_len=100, prefill_tokens=16384, weight_dtype="fp8", two_batch_overlap=True),
    # One 8-GPU node serving DeepSeek-V3 with TP8 (the pre-EP baseline of SGLang's blogs).
    "deepseek-v3-tp8": dict(name="deepseek-v3-tp8", decode=dict(tp=8, ep=8), input_len=2000,
                            output_len=1000, weight_dtype="fp8"),
    # TensorRT-LLM's perf overview layouts (FP8 weights and KV cache, in-flight batching).
    "llama3-70b-tp2-fp8": dict(name="llama3-70b-tp2-fp8", decode=dict(tp=2), input_len=1000,
                               output_len=1000, weight_dtype="fp8", kv_dtype="fp8",
                               max_batch_size=4096),
    "llama3-8b-tp1-fp8": dict(name="llama3-8b-tp1-fp8", input_len=1000, output_len=1000,
                              weight_dtype="fp8", kv_dtype="fp8", max_batch_size=4096),
}


def load_serve_plan(ref: str | dict | ServePlan, **overrides) -> ServePlan:
    """A serving plan from a preset name, a YAML/JSON file, an inline
    ``"decode.tp=8,input_len=1000,..."`` string, or a mapping; ``overrides`` (dotted keys as
    nested dicts) replace fields. Unknown keys are SpecErrors."""
    from pathlib import Path

    from trainpilot.specs.loading import parse_inline, read_document, validate

    if isinstance(ref, ServePlan):
        data = ref.to_dict()
    elif isinstance(ref, dict):
        data = dict(ref)
    elif ref in SERVE_PRESETS:
        data = dict(SERVE_PRESETS[ref])
    elif Path(ref).suffix in (".yaml", ".yml", ".json") or Path(ref).is_file():
        data = read_document(ref, doc="serve plan")
    elif "=" in ref:
        data = parse_inline(ref, doc="serve plan")
    else:
        raise SpecError("serve plan", ref, f"not a preset, file or inline plan; presets: "
                        f"{', '.join(SERVE_PRESETS)}")
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = dict(data[key], **value)
        else:
            data[key] = value
    return validate(ServePlan, data, doc="serve plan")
