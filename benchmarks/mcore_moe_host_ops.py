"""Host work of Megatron-Core's MoE layer, counted from its own code: ATen ops (and CPU time) of
one forward + backward of ``MoELayer`` at tiny sizes, against the dense MLP it replaces.

    .venv/bin/python benchmarks/mcore_moe_host_ops.py

Why: fine-grained MoE rows (Qwen3-30B-A3B on 8 B200 at micro-batch 1) run ~3x slower than the
cost model predicts, and one candidate is host-bound kernel issue: more kernels per MoE layer
than the model counts. This counts them in the real stack rather than guessing. megatron-core
(a test extra of this project) runs on this CPU-only torch once its hard-coded CUDA stream and
device calls are stubbed (``_stub_cuda``); the alltoall token dispatcher runs at EP 1 (its
all-to-alls are skipped, so the count is a lower bound for EP > 1), the experts as
``SequentialMLP`` (Megatron's own per-expert loop; the recipes' Transformer Engine
``GroupedLinear`` issues its per-expert GEMMs from C++ and is not installable here), no permute
or router fusion, fp32. At these sizes every op is host-bound, so CPU seconds per op are this
machine's per-op framework cost, not a GPU's.

"non-view" leaves out ops that launch no kernel on a GPU (views, transposes, splits, empty
allocations). Writes benchmarks/results/mcore_moe_host_ops.txt.
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainpilot.fsio import atomic_write_text  # noqa: E402

VIEW_OPS = {"aten.view", "aten._unsafe_view", "aten.t", "aten.transpose", "aten.expand",
            "aten.as_strided", "aten.permute", "aten.unsqueeze", "aten.squeeze", "aten.slice",
            "aten.select", "aten.split", "aten.split_with_sizes", "aten.detach", "aten.alias",
            "aten.reshape", "aten.unbind", "aten.empty", "aten.empty_like", "aten.new_empty",
            "aten.new_empty_strided", "aten.empty_strided", "aten.chunk", "aten.narrow"}
EXPERTS = (4, 8, 16, 32)
ITERS = 30


class _Stream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, *args, **kwargs):
        return _Stream()

    def wait_event(self, event) -> None:
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True


def _stub_cuda() -> None:
    """megatron-core calls torch.cuda for streams, events and the current device even on the
    paths that compute on CPU tensors: answer them on the CPU."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.Stream = _Stream  # type: ignore[assignment,misc]
    torch.cuda.Event = _Stream  # type: ignore[assignment,misc]
    torch.cuda.current_stream = lambda *a, **k: _Stream()  # type: ignore[assignment]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _mlp(num_experts: int | None, hidden: int = 64, ffn: int = 32):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    topk = min(8, max(2, (num_experts or 4) // 2))
    cfg = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=4 * hidden, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        normalization="RMSNorm", bias_dropout_fusion=False, apply_rope_fusion=False,
        num_moe_experts=num_experts, moe_router_topk=topk,
        moe_ffn_hidden_size=ffn if num_experts else None, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3,
        moe_grouped_gemm=False, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    return build_module(spec, config=cfg, layer_number=1).mlp, cfg, topk


def measure(num_experts: int | None, seq: int = 32) -> dict:
    """ATen ops of one forward + backward, and CPU seconds per forward + backward."""
    mlp, cfg, topk = _mlp(num_experts)
    x = torch.randn(seq, 1, cfg.hidden_size, requires_grad=True)

    def step() -> None:
        out = mlp(x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        mlp.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    with _Count() as count:
        step()
    start = time.process_time()
    for _ in range(ITERS):
        step()
    cpu_s = (time.process_time() - start) / ITERS
    non_view = sum(n for op, n in count.ops.items() if op not in VIEW_OPS)
    return dict(experts=num_experts, topk=topk, ops=sum(count.ops.values()), non_view=non_view,
                mm=count.ops.get("aten.mm", 0), cpu_s=cpu_s)


def main() -> int:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    _stub_cuda()
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    import megatron.core
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # 0.16.1 reads it unguarded when TE is absent
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    rows = [measure(None)] + [measure(e) for e in EXPERTS]
    dist.destroy_process_group()
    per_expert = (rows[-1]["non_view"] - rows[-2]["non_view"]) / (EXPERTS[-1] - EXPERTS[-2])
    base = rows[-1]["non_view"] - per_expert * EXPERTS[-1]
    lines = [f"Megatron-Core {megatron.core.__version__} MLP / MoELayer (alltoall dispatcher, "
             f"SequentialMLP experts, EP 1, no fusions), one forward + backward, hidden 64, "
             f"32 tokens; torch {torch.__version__}, python {platform.python_version()}, "
             f"{platform.processor() or platform.machine()}, 1 thread",
             "", f"{'local experts':>13} {'top-k':>5} {'ATen ops':>8} {'non-view':>8} "
             f"{'GEMMs':>5} {'CPU ms':>7} {'us/op':>6}"]
    for r in rows:
        name = "dense MLP" if r["experts"] is None else str(r["experts"])
        lines.append(f"{name:>13} {r['topk']:>5} {r['ops']:>8} {r['non_view']:>8} {r['mm']:>5} "
                     f"{r['cpu_s'] * 1e3:>7.2f} {r['cpu_s'] / r['ops'] * 1e6:>6.1f}")
    lines += ["", f"non-view ops per local expert: {per_expert:.0f}; router, dispatcher, "
              f"permutation and aux loss (the rest): {base:.0f}"]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    atomic_write_text(REPO / "benchmarks" / "results" / "mcore_moe_host_ops.txt", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
