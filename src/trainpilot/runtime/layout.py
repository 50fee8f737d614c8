"""A Plan as a DeviceMesh with named axes, and the rules for what runs on which backend.

Mesh axes, outer to inner: ``pp``, then data parallel, then ``cp``, then ``tp`` (Megatron's
order: tp innermost, then cp, so both sit on the fastest links). Data parallel is one axis
``dp``, or two that flatten into ``dp``: ``edp`` x ``ep`` with expert parallelism (experts are
sharded over ``ep`` and replicated over ``edp``), or ``dp_replicate`` x ``dp_shard`` for hybrid
sharding (HSDP). With context parallelism ``dp`` x ``cp`` also flatten into ``dp_cp``: cp ranks
read the same samples (the data split follows ``dp``) but hold different tokens, so gradients
are averaged over ``dp_cp`` (:attr:`Layout.grad_axis`). The :class:`Layout` is passed explicitly
to everything that needs a group; there is no global process-group singleton.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from trainpilot.specs import ModelSpec, Plan, SpecError, check_job

# What the reference runtime refuses, and why; the docs' table is generated from the same rules.
GPU_ONLY_PRECISIONS = {"fp8": "fp8 training needs torchao float8 kernels on H100-class GPUs, "
                              "which the reference runtime does not wire in"}
# fp16 runs with dynamic loss scaling where fp16 matmuls are native (GPUs, NPUs, CPUs with
# AVX512-FP16 / AMX-FP16). Elsewhere torch emulates fp16 autocast on the CPU: tiny-gpt's
# forward + backward took 0.33-0.40 s against 0.03 s in fp32 on this project's AMD EPYC.
CPU_FP16_REFUSAL = ("fp16 autocast is emulated on this CPU (no AVX512-FP16/AMX-FP16; about 10x "
                    "slower than fp32); valid: bf16 (runs fp32 here when the CPU lacks bf16), "
                    "or fp16 on a GPU/NPU, where it runs with dynamic loss scaling")


def cpu_has_native_fp16() -> bool:
    """Whether this CPU has native fp16 matmuls (oneDNN's check: AVX512-FP16 or AMX-FP16)."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def default_backend() -> str:
    """nccl with CUDA, hccl with an Ascend NPU (torch_npu), else gloo."""
    if torch.cuda.is_available():
        return "nccl"
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device and the hccl backend)

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return "hccl"
    except ImportError:
        pass
    return "gloo"


def device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if backend == "hccl":
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]
        return torch.device("npu", local_rank)
    return torch.device("cpu")


def check_runtime(model: ModelSpec | None, plan: Plan, *, backend: str,
                  world_size: int | None = None, custom_model: bool = False) -> None:
    """Raise SpecError (before any process starts) for a plan this runtime cannot execute on
    ``backend`` with ``world_size`` processes. ``model`` None: a user's own module."""
    if custom_model and (plan.tp > 1 or plan.pp > 1 or plan.ep > 1 or plan.cp > 1):
        raise SpecError("plan", f"tp={plan.tp}, pp={plan.pp}, ep={plan.ep}, cp={plan.cp}",
                        "a custom nn.Module factory runs data parallel only (DDP/FSDP2); "
                        "valid: tp=pp=ep=cp=1")
    if world_size is not None and plan.world_size != world_size:
        raise SpecError("plan.dp*tp*pp*cp", plan.world_size,
                        f"dp*tp*pp*cp = {plan.dp}*{plan.tp}*{plan.pp}*{plan.cp} must equal the "
                        f"{world_size} processes launched (nnodes x nproc-per-node)")
    if model is not None:
        check_job(model, None, plan)
    if plan.recompute == "op":
        raise SpecError("plan.recompute", "op", "torchtitan's per-op checkpointing is priced for "
                        "torchtitan runs (trainpilot plan --export torchtitan); this runtime "
                        "recomputes the attention core or whole layers; valid: none, selective, "
                        "full")
    if plan.runtime.moe_capacity_factor is not None and (model is None or model.moe is not None):
        raise SpecError("runtime.moe_capacity_factor", plan.runtime.moe_capacity_factor,
                        "this runtime's MoE layers are dropless; valid: unset")
    if plan.runtime.cuda_graph_scope:
        raise SpecError("runtime.cuda_graph_scope", list(plan.runtime.cuda_graph_scope),
                        "this runtime does not capture CUDA graphs (a Megatron-Core knob, "
                        "trainpilot plan --export megatron); valid: []")
    if plan.precision in GPU_ONLY_PRECISIONS:
        raise SpecError("plan.precision", plan.precision,
                        GPU_ONLY_PRECISIONS[plan.precision] + "; valid: bf16, fp16")
    if plan.precision == "fp16" and backend == "gloo" and not cpu_has_native_fp16():
        raise SpecError("plan.precision", plan.precision, CPU_FP16_REFUSAL)
    if plan.cp > 1:
        _check_context_parallel(model, plan)
    if model is not None:
        _check_model_rules(model, plan)
        if backend != "fake":
            _check_numerics(model)
    _check_pipeline(plan)
    if plan.zero >= 1:
        from trainpilot.runtime.comm.fsdp import check_fsdp_comm

        check_fsdp_comm(plan.comm)  # top-k and PowerSGD do not compose with FSDP2
    if plan.ep > 1 and plan.dp_shard is not None:
        raise SpecError("plan.dp_shard", plan.dp_shard, "hybrid sharding with expert "
                        "parallelism is not supported; valid: unset dp_shard when ep > 1")
    _check_folding(plan)
    if backend not in ("gloo", "nccl", "hccl", "fake"):  # fake: --dry-run's process group
        raise SpecError("backend", backend, "valid: gloo, nccl, hccl")


def _check_folding(plan: Plan) -> None:
    """Plan fields the cost model prices that this runtime does not run (one line each)."""
    if plan.etp is not None and (plan.etp != 1 or plan.dp % plan.ep):
        raise SpecError("plan.etp", plan.etp, "MoE parallel folding (experts over tp x dp, "
                        "expert tensor parallelism) is priced by the cost model but not run by "
                        "this runtime, whose ep divides dp; valid: unset etp, ep dividing dp")


def _check_model_rules(model: ModelSpec, plan: Plan) -> None:
    if model.mla is not None:
        raise SpecError("model.mla", "set", "multi-head latent attention is not in the reference "
                        "model; valid: a GQA/MHA model")
    if model.tie_word_embeddings and (plan.tp > 1 or plan.pp > 1):
        raise SpecError("model.tie_word_embeddings", True, "tied embeddings need tp=1 and pp=1 "
                        "in the reference runtime (no first/last-stage embedding all-reduce)")
    if model.is_moe and plan.tp > 1:
        raise SpecError("plan.tp", plan.tp, "the reference MoE model has no expert tensor "
                        "parallelism; valid: tp=1 with MoE (shard experts with ep)")
    if plan.sequence_parallel and model.position_embedding == "learned":
        raise SpecError("plan.sequence_parallel", True, "needs RoPE; learned position embeddings "
                        "are added to the sequence-sharded activations")


def _check_numerics(model: ModelSpec) -> None:
    """Model features the reference GPT would silently train without (a dry run, which only
    counts parameters and memory, does not need them)."""
    unsupported = {"qk_norm": model.qk_norm, "rope_scaling": model.rope_scaling,
                   "num_mtp_layers": model.num_mtp_layers or None,
                   "sliding_window": model.sliding_window,
                   "dropout": model.dropout or None}
    for name, value in unsupported.items():
        if value:
            raise SpecError(f"model.{name}", value, "not in the reference GPT (it would be "
                            "trained without it); valid: a Hugging Face config.json for this "
                            "model (trainpilot train builds it with transformers), or unset")
    moe = model.moe
    if moe is not None and (moe.router_score != "softmax" or moe.router_expert_bias
                            or moe.num_expert_groups > 1 or moe.router_scaling_factor):
        raise SpecError("model.moe.router", moe.router_score, "the reference MoE routes with a "
                        "softmax top-k (no expert bias, groups or scaling); valid: those "
                        "defaults, or a Hugging Face config.json for this model")


def _check_context_parallel(model: ModelSpec | None, plan: Plan) -> None:
    """What context parallelism does not compose with in the reference runtime."""
    if model is not None and model.is_moe:
        raise SpecError("plan.cp", plan.cp, "context parallelism with the MoE model is not "
                        "implemented (its balance loss is per local token set); valid: cp=1")
    if plan.dp_shard is not None:
        raise SpecError("plan.dp_shard", plan.dp_shard, "hybrid sharding with context "
                        "parallelism is not supported; valid: unset dp_shard when cp > 1")


def _check_pipeline(plan: Plan) -> None:
    if plan.pp == 1:
        return
    n = plan.num_micro_batches
    if plan.pp_schedule in ("1f1b", "interleaved", "zero_bubble") and n < plan.pp:
        raise SpecError("plan.global_batch_size", plan.global_batch_size,
                        f"gives {n} micro-batches per pipeline; {plan.pp_schedule} needs at least "
                        f"pp={plan.pp} (global_batch_size >= micro_batch_size * dp * pp)")
    if plan.vp > 1:
        rounds = max(1, n // plan.pp)
        if n % rounds:
            raise SpecError("plan.global_batch_size", plan.global_batch_size,
                            f"interleaved schedules need micro-batches ({n}) divisible by "
                            f"max(1, micro-batches // pp) = {rounds}")


def mesh_axes(plan: Plan) -> tuple[list[str], list[int], dict[str, tuple[str, ...]]]:
    """(axis names, sizes, flattened axes) for the plan's mesh."""
    if plan.ep > 1:
        data = [("edp", plan.dp // plan.ep), ("ep", plan.ep)]
    elif plan.dp_shard is not None:
        data = [("dp_replicate", plan.dp // plan.dp_shard), ("dp_shard", plan.dp_shard)]
    else:
        data = [("dp", plan.dp)]
    # plan.rank_order, fastest-varying axis first: "tp-cp-ep-dp-pp" puts data parallel inside
    # each pipeline stage's block of ranks, "tp-cp-ep-pp-dp" puts the stages inside each data-
    # parallel replica (the mesh's first axis varies slowest).
    # (torch's DeviceMesh flattens axes that are not neighbours: dp from edp and ep, dp_cp.)
    if plan.rank_order == "tp-cp-ep-pp-dp" and plan.ep > 1:
        axes = [("edp", plan.dp // plan.ep), ("pp", plan.pp), ("ep", plan.ep), ("tp", plan.tp)]
    elif plan.rank_order == "tp-cp-ep-pp-dp":
        axes = [*data, ("pp", plan.pp), ("tp", plan.tp)]
    else:
        axes = [("pp", plan.pp), *data, ("tp", plan.tp)]
    flat = {"dp": tuple(name for name, _ in data)} if len(data) > 1 else {}
    if plan.cp > 1:  # checked: data is the single axis "dp" then
        axes.insert(-1, ("cp", plan.cp))
        flat["dp_cp"] = ("dp", "cp")
    return [a for a, _ in axes], [s for _, s in axes], flat


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Where this process sits in the plan: its rank, device, backend and the named mesh.

    ``mesh`` is None in a single process without a process group; every group is then None
    and every axis coordinate 0.
    """

    plan: Plan
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device = torch.device("cpu")
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh
    # Flattened axes ("dp" from edp x ep or dp_replicate x dp_shard), kept by reference: slicing
    # them from the root mesh is deprecated.
    flat_meshes: dict[str, Any] = dataclasses.field(default_factory=dict)

    def size(self, axis: str) -> int:
        """Size of a mesh axis: pp, dp, cp, dp_cp, tp, ep, edp, dp_replicate, dp_shard."""
        plan = self.plan
        sizes = dict(pp=plan.pp, dp=plan.dp, cp=plan.cp, dp_cp=plan.dp * plan.cp, tp=plan.tp,
                     ep=plan.ep, edp=plan.dp // plan.ep,
                     dp_shard=plan.dp_shard or plan.dp,
                     dp_replicate=plan.dp // (plan.dp_shard or plan.dp))
        return sizes[axis]

    def coord(self, axis: str) -> int:
        """This rank's index along ``axis`` (0 when the axis has size 1 or there is no mesh)."""
        if self.mesh is None or self.size(axis) == 1:
            return 0
        return self.submesh(axis).get_local_rank()

    def submesh(self, axis: str):
        """The 1-D mesh of ``axis`` (None without a mesh)."""
        if self.mesh is None:
            return None
        return self.flat_meshes[axis] if axis in self.flat_meshes else self.mesh[axis]

    def group(self, axis: str):
        """The process group of ``axis``; None when it has size 1 (nothing to communicate)."""
        if self.mesh is None or self.size(axis) == 1:
            return None
        return self.submesh(axis).get_group()

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def cp_rank(self) -> int:
        return self.coord("cp")

    @property
    def grad_axis(self) -> str:
        """The axis gradients are averaged over: ``dp``, or ``dp_cp`` with context
        parallelism (cp ranks hold different tokens of the same samples)."""
        return "dp_cp" if self.plan.cp > 1 else "dp"

    @property
    def pp_rank(self) -> int:
        return self.coord("pp")

    @property
    def is_distributed(self) -> bool:
        return self.mesh is not None

    def describe(self) -> dict[str, Any]:
        names, sizes, _ = mesh_axes(self.plan)
        return dict(rank=self.rank, world_size=self.world_size, backend=self.backend,
                    device=str(self.device), mesh=dict(zip(names, sizes)))


def build_layout(plan: Plan, *, model: ModelSpec | None = None, custom_model: bool = False
                 ) -> Layout:
    """The layout of this process. With torch.distributed initialised: a named DeviceMesh over
    the world (``plan.world_size`` must equal it); otherwise a single-process layout."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        check_runtime(model, plan, backend="gloo", world_size=1, custom_model=custom_model)
        return Layout(plan=plan)
    from torch.distributed.device_mesh import init_device_mesh

    backend = dist.get_backend()
    world, rank = dist.get_world_size(), dist.get_rank()
    check_runtime(model, plan, backend=str(backend), world_size=world, custom_model=custom_model)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = device_for(str(backend), local_rank)
    names, sizes, flat = mesh_axes(plan)
    mesh = init_device_mesh(device.type, tuple(sizes), mesh_dim_names=tuple(names))
    flat_meshes = {name: mesh[parts]._flatten(name) for name, parts in flat.items()}
    return Layout(plan=plan, rank=rank, world_size=world, local_rank=local_rank,
                  backend=str(backend), device=device, mesh=mesh, flat_meshes=flat_meshes)
