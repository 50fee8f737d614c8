"""Plan, the "how" document: the parallel layout, batch, recompute, precision and options."""

from __future__ import annotations

from typing import Literal, get_args

import pydantic
from pydantic import NonNegativeInt, PositiveFloat, PositiveInt

from trainpilot.specs.base import Spec
from trainpilot.specs.errors import SpecError
from trainpilot.specs.runtime import RuntimeProfile

# Rank orders (innermost first). "tp-cp-ep-pp-dp": trainpilot's default (pipeline stages of one
# replica close together, data-parallel replicas outermost); "tp-cp-ep-dp-pp": Megatron-Core's
# default RankGenerator order (data-parallel groups compact, pipeline stages outermost).
RANK_ORDERS = ("tp-cp-ep-pp-dp", "tp-cp-ep-dp-pp")
# The values of Plan's enumerated fields, named for the code that builds plans from plain values.
ZeroStage = Literal[0, 1, 2, 3]
Recompute = Literal["none", "selective", "full", "op"]
Precision = Literal["bf16", "fp16", "fp8"]
PpSchedule = Literal["1f1b", "gpipe", "interleaved", "zero_bubble"]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)


DDP_BUCKET_MB = 25.0  # torch DistributedDataParallel's bucket_cap_mb default


class CommOptions(Spec):
    """Gradient communication: fusion, overlap, topology and compression."""

    # Gradient bucket size in MB. Unset: the executing stack's own default, PyTorch DDP's 25 MB
    # except on the megatron stack, whose DistributedDataParallel sizes its buckets at
    # max(40M, 1M x DP) parameters of its gradient buffer (``perf/runtime.py bucket_mb``).
    bucket_mb: PositiveFloat | None = None
    overlap: bool = True  # launch gradient buckets during backward
    hierarchical: bool = False  # intra-node reduce-scatter / inter-node all-reduce / all-gather
    compression: Literal["none", "fp16", "bf16", "powersgd", "topk"] = "none"
    topk_density: float = pydantic.Field(default=0.15, gt=0, le=1)
    powersgd_rank: PositiveInt = 4
    error_feedback: bool = True
    # How top-k messages cross the compressed stage. "all_gather": every rank's selection to
    # every other ((g-1) messages of the whole row: grows with the group). "scatter": a sparse
    # reduce-scatter (each rank's selection of each chunk to the chunk's owner), the owner's
    # top-k of the summed chunk all-gathered: 2 (g-1)/g of one message, like a ring all-reduce,
    # at the cost of a second selection (its residual is error-fed too). "auto": scatter when
    # the stage has more than 2 ranks (at 2 both send the same bytes).
    topk_exchange: Literal["auto", "all_gather", "scatter"] = "auto"
    # Collective algorithm for NCCL-family libraries: "auto" picks, per call, the fastest of
    # ring and tree by size (NCCL's tuner); "ring"/"tree" force one (NCCL_ALGO).
    algorithm: Literal["auto", "ring", "tree"] = "auto"

    @property
    def ddp_bucket_mb(self) -> float:
        """The bucket size a PyTorch DDP (or DeepSpeed) run uses: ``bucket_mb``, else DDP's
        default 25 MB."""
        return self.bucket_mb if self.bucket_mb is not None else DDP_BUCKET_MB


class CheckpointPolicy(Spec):
    """When and how state is saved."""

    interval_steps: PositiveInt = 100
    async_save: bool = True
    in_memory_peer: bool = True  # keep a copy in a peer's host memory
    incremental: bool = False
    compress: bool = False  # zstd
    keep_last: PositiveInt = 3
    keep_every: PositiveInt | None = None


class Plan(Spec):
    """The layout. Devices used = dp * tp * pp * cp; ep splits dp * cp for expert layers."""

    tp: PositiveInt = 1
    pp: PositiveInt = 1
    dp: PositiveInt = 1
    ep: PositiveInt = 1
    # Expert tensor parallelism. None: expert layers use tp (and EP divides dp * cp). Set: MoE
    # parallel folding (Megatron-Core's --expert-tensor-parallel-size): the expert layers re-map
    # the tp x cp x dp ranks of each pipeline stage as etp x ep x edp, so EP may span TP.
    etp: PositiveInt | None = None
    cp: PositiveInt = 1
    vp: PositiveInt = 1  # interleaved virtual stages per pipeline rank
    zero: ZeroStage = 1  # 1: distributed optimizer; 3: FSDP full shard
    dp_shard: PositiveInt | None = None  # HSDP: shard within groups of this many dp ranks
    micro_batch_size: PositiveInt = 1
    global_batch_size: PositiveInt  # sequences per optimizer step
    seq_len: PositiveInt
    # Activation recomputation: "selective" re-runs the attention core (Megatron's default
    # selective module), "full" the whole layer, "op" torchtitan's per-op selective
    # checkpointing (saves matmul and attention outputs but every second matmul's).
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    precision: Precision = "bf16"
    # How FP8 GEMM inputs are scaled (precision fp8; Megatron's --fp8-recipe, Transformer
    # Engine's recipes): "delayed" (the scale from past steps' amax history: one fused cast),
    # "current" (per-tensor current scaling, Megatron's "tensorwise": an amax pass, a scale
    # kernel and the cast; torchao's "tensorwise"), "mxfp8" (Blackwell's MX block scaling),
    # "blockwise" (DeepSeek-V3's 1 x 128 / 128 x 128 blocks): one fused cast each, and "rowwise"
    # (torchao's axiswise recipe: a scale per row along the reduction dimension, so each
    # operand is cast once per orientation from 16 bits, and the backward GEMMs rescale their
    # outputs in a separate pass).
    fp8_recipe: Literal["delayed", "current", "mxfp8", "blockwise", "rowwise"] = "delayed"
    # FP8 parameter all-gather (precision fp8; Megatron's --fp8-param-gather, torchtitan's
    # enable_fsdp_float8_all_gather): the data-parallel parameter all-gather moves the 8-bit
    # weights (1 byte per parameter instead of 2), except under mxfp8, where Megatron gathers
    # 16-bit values into the gradient buffer and quantizes after the gather; on the PyTorch stack
    # (torchao tensorwise only) each rank casts its shard before the gather, so the layer no
    # longer casts the whole weight in every pass (perf/hardware.py, FP8_GATHERED_WEIGHT).
    fp8_param_gather: bool = False
    pp_schedule: PpSchedule | None = None
    # Uneven pipelines: layers on the first / last stage (Megatron's
    # --decoder-first/last-pipeline-num-layers); the rest split evenly.
    pp_first_stage_layers: NonNegativeInt | None = None
    pp_last_stage_layers: NonNegativeInt | None = None
    comm: CommOptions = CommOptions()
    checkpoint: CheckpointPolicy = CheckpointPolicy()
    runtime: RuntimeProfile = RuntimeProfile()
    rank_order: Literal["tp-cp-ep-pp-dp", "tp-cp-ep-dp-pp"] = "tp-cp-ep-pp-dp"
    # Devices of the cluster the plan leaves unused (a prime device count, a spare node):
    # dp * tp * pp * cp + idle_devices must equal the cluster's devices.
    idle_devices: NonNegativeInt = 0

    @pydantic.model_validator(mode="after")
    def _check(self) -> Plan:
        per_step = self.micro_batch_size * self.dp
        if self.global_batch_size % per_step:
            raise SpecError(
                "global_batch_size", self.global_batch_size,
                f"not a multiple of micro_batch_size * dp = {self.micro_batch_size} * {self.dp}"
                f" = {per_step}",
            )
        if self.vp > 1 and self.pp == 1:
            raise SpecError("vp", self.vp, "needs pp > 1; valid: vp=1 when pp=1")
        if self.fp8_recipe != "delayed" and self.precision != "fp8":
            raise SpecError("fp8_recipe", self.fp8_recipe,
                            f"scales FP8 GEMM inputs; precision is {self.precision} (valid: "
                            "precision fp8, or leave fp8_recipe unset)")
        if self.fp8_param_gather and self.precision != "fp8":
            raise SpecError("fp8_param_gather", True,
                            f"gathers FP8 weights; precision is {self.precision} (valid: "
                            "precision fp8, or false)")
        if self.fp8_param_gather and self.zero == 0:
            raise SpecError("fp8_param_gather", True,
                            "gathers sharded weights in 8 bits; zero is 0, so nothing is "
                            "gathered (valid: zero >= 1 - Megatron's distributed optimizer or "
                            "FSDP - or false)")
        if self.fp8_param_gather and self.fp8_recipe == "rowwise":
            raise SpecError("fp8_param_gather", True,
                            "torchao's float8 all-gather supports tensorwise scaling only; "
                            "valid with fp8_recipe delayed, current, mxfp8 or blockwise")
        if self.fp8_param_gather and self.runtime.stack == "pytorch" \
                and self.fp8_recipe != "current":
            raise SpecError("fp8_param_gather", True,
                            f"on the pytorch stack torchao gathers float8 weights with "
                            f"tensorwise scaling only, not {self.fp8_recipe}; valid with "
                            "fp8_recipe current")
        if self.sequence_parallel and self.tp == 1:
            raise SpecError("sequence_parallel", True, "needs tp > 1; valid: false when tp=1")
        if self.etp is None and (self.dp * self.cp) % self.ep:
            raise SpecError("ep", self.ep, f"does not divide dp * cp = {self.dp * self.cp}; "
                            "valid: a divisor of dp * cp, or set etp (MoE parallel folding: "
                            "EP over tp x cp x dp)")
        if self.etp is not None and (self.tp * self.cp * self.dp) % (self.etp * self.ep):
            folded = self.tp * self.cp * self.dp
            raise SpecError("ep", self.ep,
                            f"etp * ep = {self.etp} * {self.ep} does not divide tp * cp * dp = "
                            f"{folded}; valid: etp * ep dividing {folded}")
        if self.dp_shard is not None and (self.zero != 3 or self.dp % self.dp_shard):
            raise SpecError("dp_shard", self.dp_shard,
                            f"needs zero=3 and must divide dp={self.dp}")
        if self.pp_schedule is None:
            object.__setattr__(self, "pp_schedule", "interleaved" if self.vp > 1 else "1f1b")
        elif self.pp_schedule == "interleaved" and self.vp == 1 and self.pp > 1:
            raise SpecError("pp_schedule", "interleaved", "needs vp > 1")
        for key in ("pp_first_stage_layers", "pp_last_stage_layers"):
            if getattr(self, key) is not None and self.pp == 1:
                raise SpecError(key, getattr(self, key), "needs pp > 1")
        return self

    @property
    def world_size(self) -> int:
        """Devices the plan occupies."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per pipeline per step (gradient-accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len
