"""One rank of the FSDP2 communication scenarios: ``python -m tests.comm._fsdp_worker SCENARIO
RANK WORLD PORT OUTDIR ARGS_JSON`` (started by ``tests.comm._launch.run_ranks``). Ranks are
placed on a 2 nodes x 2 CPU cluster; each scenario returns plain numbers, the test asserts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.comm._worker import cpu_cluster, main, rank_tensor
from trainpilot.runtime.comm import FSDPComm
from trainpilot.runtime.comm.counters import process_bytes_written
from trainpilot.runtime.comm.fsdp import fsdp_modules
from trainpilot.runtime.config import TrainConfig
from trainpilot.runtime.parallelize import full_parameters
from trainpilot.runtime.procexit import run_and_end
from trainpilot.runtime.trainer import Trainer
from trainpilot.specs import CommOptions, SpecError, load_model, load_plan

STEPS = 3
BASE = "dp=4,micro_batch_size=4,global_batch_size=16,seq_len=64"
# As tests/runtime/scenarios.py: full AdamW steps, no clipping, so a wrong gradient shows.
CONFIG = dict(steps=STEPS, warmup_steps=0, lr=3e-3, grad_clip=None, seed=7, predict=False,
              autocast="off")  # fp32 compute even where the CPU has native bf16


# -- the reduce-scatter on its own ----------------------------------------------------------------

def _reduce_scatter(comm: FSDPComm, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    out = torch.empty(x.numel() // dist.get_world_size(), dtype=x.dtype)
    comm.reduce_scatter(out, x, dist.group.WORLD, op)
    return out


def collective_checks(rank: int, world: int) -> dict:
    """Hierarchical reduce-scatter == gloo's on integer-valued float64 (bit-equal) and fp32
    (summation order), AVG, a wrong chunk order (negative control), and bytes against the
    kernel's count of bytes written to gloo's sockets."""
    out: dict = {}
    cluster = cpu_cluster(2, 2)
    hier = FSDPComm(CommOptions(hierarchical=True), cluster=cluster)
    flat = FSDPComm(CommOptions(), cluster=cluster)
    for name, dtype, integer in (("f64int", torch.float64, True), ("f32", torch.float32, False)):
        x = rank_tensor(rank, 4 * 1001, dtype, integer=integer)
        ref = torch.empty(1001, dtype=dtype)
        dist.reduce_scatter_tensor(ref, x.clone())
        got = _reduce_scatter(hier, x)
        out[f"{name}.equal"] = torch.equal(got, ref)
        out[f"{name}.max_rel"] = float((got - ref).abs().max() / ref.abs().max())
        avg = _reduce_scatter(hier, x, dist.ReduceOp.AVG)
        out[f"{name}.avg_max_rel"] = float((avg - ref / world).abs().max() / ref.abs().max())
    x = rank_tensor(rank, 4 * 1001, torch.float64, integer=True)
    ref = torch.empty(1001, dtype=torch.float64)
    dist.reduce_scatter_tensor(ref, x.clone())
    hier.reduce_scatter.order = hier.reduce_scatter.order.flip(0)  # deliberately wrong
    out["wrong_order.equal"] = torch.equal(_reduce_scatter(hier, x), ref)
    hier.reduce_scatter.order = hier.reduce_scatter.order.flip(0)
    for label, comm in (("hier", hier), ("flat", flat)):
        comm.end_step()
        payload = torch.randn(1 << 20)  # 4 MiB
        dist.barrier()
        before = process_bytes_written()
        _reduce_scatter(comm, payload)
        after = process_bytes_written()
        dist.barrier()
        metrics = comm.end_step()
        out[f"wire.{label}.measured"] = after - before
        out[f"wire.{label}.model"] = metrics.wire_bytes
        out[f"wire.{label}.off_node"] = metrics.off_node_bytes
        out[f"wire.{label}.collectives"] = metrics.num_collectives
    out["calls.hier"] = hier.reduce_scatter.num_calls
    # One node: a single all-to-all reduce-scatter inside it (no inter-node stage).
    one_node = FSDPComm(CommOptions(hierarchical=True), cluster=cpu_cluster(4, 1))
    out["one_node.levels"] = [s.size for s in one_node.reduce_scatter.staged.scatter]
    out["one_node.equal"] = torch.equal(_reduce_scatter(one_node, x), ref)
    try:
        FSDPComm(CommOptions(hierarchical=True), cluster=None)
        out["no_cluster.error"] = None
    except SpecError as err:
        out["no_cluster.error"] = str(err)
    return out


# -- training with the trainer ---------------------------------------------------------------------

def train(plan: str, *, wrong_order: bool = False, comm_hook: bool = True) -> dict:
    """``STEPS`` AdamW steps of tiny-gpt under ``plan`` on 2 nodes x 2; losses, parameters,
    reduce-scatter calls and per-step counters."""
    plan_doc = load_plan(f"{BASE},{plan}")
    trainer = Trainer(model=load_model("tiny-gpt"), plan=plan_doc, config=TrainConfig(**CONFIG),
                      cluster=cpu_cluster(2, 2), comm_hook=comm_hook)
    hook = trainer.comm_hook
    initial = full_parameters(trainer.model)
    if wrong_order:  # negative control: every rank receives another rank's chunk
        hook.reduce_scatter.order = hook.reduce_scatter.order.roll(1)
    records = [trainer.train_step() for _ in range(STEPS)]
    return dict(losses=[r.loss for r in records], params=full_parameters(trainer.model),
                initial=initial,
                kind=type(hook.reduce_scatter).__name__ if hook else None,
                calls=hook.reduce_scatter.num_calls if hook else 0,
                num_fsdp_modules=len(fsdp_modules(trainer.model.chunks[0])),
                comm=[m.to_dict() for m in hook.counters.history] if hook else [],
                comm_bytes=[r.comm_bytes for r in records])


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def norm_diff(a: dict, b: dict) -> float:
    """L2 norm of ``a - b`` over every parameter."""
    return float(torch.cat([(a[k] - b[k]).flatten() for k in a]).norm())


def scenario_fsdp(rank: int, world: int, args: dict) -> dict:
    out = collective_checks(rank, world)
    runs = {"zero3.flat": "zero=3", "zero3.hier": "zero=3,comm.hierarchical=true",
            "zero1.flat": "zero=1", "zero1.hier": "zero=1,comm.hierarchical=true",
            "zero3.fp16": "zero=3,comm.compression=fp16",
            "zero3.bf16.hier": "zero=3,comm.compression=bf16,comm.hierarchical=true"}
    results = {name: train(plan) for name, plan in runs.items()}
    results["zero3.native"] = train("zero=3", comm_hook=False)
    results["zero3.hier.wrong"] = train("zero=3,comm.hierarchical=true", wrong_order=True)
    for name, res in results.items():
        ref = results["zero1.flat" if name.startswith("zero1") else "zero3.flat"]
        out[f"{name}.max_diff"] = max_diff(res["params"], ref["params"])
        # Distance from the reference over the distance training moved the reference.
        out[f"{name}.rel_update_diff"] = (norm_diff(res["params"], ref["params"])
                                          / norm_diff(ref["params"], ref["initial"]))
        out[f"{name}.loss_diff"] = max(abs(a - b) for a, b in zip(res["losses"], ref["losses"]))
        out[f"{name}.finite"] = all(torch.isfinite(v).all().item() for v in res["params"].values())
        for key in ("kind", "calls", "num_fsdp_modules", "comm", "comm_bytes", "losses"):
            out[f"{name}.{key}"] = res[key]
    return out


SCENARIOS = {"fsdp": scenario_fsdp}


if __name__ == "__main__":
    run_and_end(lambda: main(SCENARIOS))
