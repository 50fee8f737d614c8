"""One rank of a multi-process comm scenario: ``python -m tests.comm._worker SCENARIO RANK WORLD
PORT OUTDIR ARGS_JSON``. Each scenario returns a dict of plain results; the test asserts on them.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainpilot.runtime.comm import (
    CommHook,
    StagedAllReduce,
    build_groups,
    ddp_kwargs,
    hierarchical_all_reduce,
    make_comm_hook,
)
from trainpilot.runtime.comm.counters import CommCounters, process_bytes_written
from trainpilot.runtime.procexit import run_and_end
from trainpilot.specs import ClusterSpec, CommOptions


def cpu_cluster(devices_per_node: int, num_nodes: int, nodes_per_rack: int | None = None,
                ) -> ClusterSpec:
    link = dict(gbytes_per_s=1.0, latency_us=50.0)
    return ClusterSpec(device="cpu", devices_per_node=devices_per_node, num_nodes=num_nodes,
                       nodes_per_rack=nodes_per_rack, network=dict(intra_node=link,
                                                                   inter_node=link))


def rank_tensor(rank: int, n: int, dtype: torch.dtype, *, integer: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    if integer:
        return torch.randint(-1000, 1000, (n,), generator=gen).to(dtype)
    return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)


# -- scenario: hierarchical all-reduce equals flat ----------------------------------------------

def scenario_hierarchy(rank: int, world: int, args: dict) -> dict:
    out: dict = {}
    layouts = {"2x2": cpu_cluster(2, 2), "racks": cpu_cluster(1, 4, nodes_per_rack=2)}
    for label, cluster in layouts.items():
        groups = build_groups(cluster)
        for compress_top in (False, True):
            staged = StagedAllReduce.from_groups(groups, compress_top=compress_top)
            key = f"{label}{'.top' if compress_top else ''}"
            out[f"{key}.stages"] = [s.size for s in staged.scatter] + [staged.top.size]
            for name, dtype, integer in (("int64", torch.int64, True),
                                         ("f64int", torch.float64, True),
                                         ("f64", torch.float64, False),
                                         ("f32", torch.float32, False)):
                x = rank_tensor(rank, 1001, dtype, integer=integer)  # odd: exercises padding
                flat = x.clone()
                dist.all_reduce(flat)
                hier = staged(x, segments=(500, 1, 500))
                out[f"{key}.{name}.equal"] = torch.equal(flat, hier)
                out[f"{key}.{name}.max_rel"] = float(
                    ((flat - hier).abs().max() / flat.abs().max().clamp_min(1)).item())
        # Negative control: one rank's input differs by one in one element -> must not equal.
        x = rank_tensor(rank, 1001, torch.int64, integer=True)
        flat = x.clone()
        dist.all_reduce(flat)
        if rank == 1:
            x[7] += 1
        out[f"{label}.control_equal"] = torch.equal(flat, StagedAllReduce.from_groups(groups)(x))
        # The in-place, any-shape entry point.
        y = rank_tensor(rank, 64, torch.int64, integer=True).view(8, 8)
        ref = y.clone()
        dist.all_reduce(ref)
        out[f"{label}.inplace_equal"] = torch.equal(hierarchical_all_reduce(y, groups), ref)
    out.update(wire_bytes_check(rank))
    return out


def wire_bytes_check(rank: int) -> dict:
    """The counters' byte model against the kernel's count of bytes written (gloo's sockets)."""
    out = {}
    groups = build_groups(cpu_cluster(2, 2))
    x = torch.randn(1 << 20)
    for label, staged in (("flat", StagedAllReduce(scatter=(), top=_flat_subgroup())),
                          ("hier", StagedAllReduce.from_groups(groups))):
        staged(x)  # warm up connections
        dist.barrier()
        counters = CommCounters()
        staged.counters = counters
        before = process_bytes_written()
        staged(x)
        measured = process_bytes_written() - before
        counters.add_bucket(x.numel() * 4, 0.0, 0.0)
        metrics = counters.end_step()
        out[f"wire.{label}.model"] = metrics.wire_bytes
        out[f"wire.{label}.off_node"] = metrics.off_node_bytes
        out[f"wire.{label}.measured"] = measured
    return out


def _flat_subgroup():
    from trainpilot.runtime.comm.topology import make_subgroup

    return make_subgroup("flat", tuple(range(dist.get_world_size())), cpu_cluster(2, 2))


# -- scenario: DDP hooks ------------------------------------------------------------------------

def tiny_model(seed: int, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4)).to(dtype)


def batch(step: int, rank: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(8, 16, generator=gen, dtype=torch.float64).to(dtype)
    return x, torch.sin(x[:, :4] * 3).to(dtype)


def flat_grads(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


def train_ddp(comm: CommOptions | None, cluster: ClusterSpec | None, *, steps: int,
              seed: int = 0, track_invariant: bool = False, lr: float = 0.05) -> dict:
    """A few SGD steps under ``comm``; returns per-step averaged gradients and, optionally, the
    error-feedback invariant's two sides."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_model(seed)
    kwargs = ddp_kwargs(comm, model) if comm else {}
    ddp = DDP(model, **kwargs)
    hook = make_comm_hook(comm, cluster).register(ddp) if comm else None
    local = tiny_model(seed)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    grads, buckets, sent, true = [], [], 0.0, 0.0
    for step in range(steps):
        x, y = batch(step, rank)
        if track_invariant:  # this rank's true local gradient, from an unwrapped replica
            local.load_state_dict(ddp.module.state_dict())
            local.zero_grad()
            nn.functional.mse_loss(local(x), y).backward()
            true = true + flat_grads(local)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        grads.append(flat_grads(ddp.module).clone())
        sent = sent + world * grads[-1]
        opt.step()
        if hook:
            buckets.append(hook.end_step().num_buckets)
    out = {"grads": grads, "buckets": buckets, "hook": hook,
           "params": torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])}
    if track_invariant:
        residual = torch.cat([
            (hook.error_feedback.residual(name) if hook.error_feedback and
             hook.error_feedback.residual(name) is not None else torch.zeros(p.numel(),
                                                                             dtype=p.dtype))
            for name, p in ddp.module.named_parameters()])
        dist.all_reduce(residual)
        dist.all_reduce(true)
        # sent is already the all-rank sum of what was transmitted (world x the average).
        out["invariant_rel"] = float(((sent + residual - true).abs().max()
                                      / true.abs().max()).item())
    return out


def scenario_ddp(rank: int, world: int, args: dict) -> dict:
    cluster, steps, out = cpu_cluster(2, 2), 4, {}
    small = dict(bucket_mb=0.004)  # ~4 KiB: several buckets once DDP rebuilds them
    ref = train_ddp(None, None, steps=steps)
    cases = {
        "none.flat": CommOptions(**small),
        "none.hier": CommOptions(hierarchical=True, **small),
        "none.hier.nooverlap": CommOptions(hierarchical=True, overlap=False, **small),
        "none.flat.nooverlap": CommOptions(overlap=False, **small),
        "fp16.flat": CommOptions(compression="fp16", **small),
        "bf16.flat": CommOptions(compression="bf16", **small),
        "fp16.hier": CommOptions(compression="fp16", hierarchical=True, **small),
        "bf16.hier.nooverlap": CommOptions(compression="bf16", hierarchical=True, overlap=False,
                                           **small),
    }
    for label, comm in cases.items():
        run = train_ddp(comm, cluster, steps=steps)
        diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in
                   zip(run["grads"], ref["grads"]))
        out[f"{label}.max_rel_vs_ref"] = diff
        out[f"{label}.buckets"] = run["buckets"]
        last = run["hook"].counters.last
        out[f"{label}.wire_over_dense"] = last.wire_bytes / last.dense_bytes
        if label.endswith("nooverlap"):
            base = train_ddp(comm.replace(overlap=True), cluster, steps=steps)
            out[f"{label}.bit_equal_overlap"] = all(
                torch.equal(a, b) for a, b in zip(run["grads"], base["grads"]))
    for label, comm in {
        "topk.flat.ef": CommOptions(compression="topk", topk_density=0.15, **small),
        "topk.hier.ef": CommOptions(compression="topk", topk_density=0.15, hierarchical=True,
                                    **small),
        "topk.hier.ef.nooverlap": CommOptions(compression="topk", topk_density=0.15,
                                              hierarchical=True, overlap=False, **small),
        "topk.flat.ef.allgather": CommOptions(compression="topk", topk_density=0.15,
                                              topk_exchange="all_gather", **small),
        "topk.4nodes.ef": CommOptions(compression="topk", topk_density=0.15, hierarchical=True,
                                      **small),
        "topk.flat.noef": CommOptions(compression="topk", topk_density=0.15,
                                      error_feedback=False, **small),
        "topk.hier.noef": CommOptions(compression="topk", topk_density=0.15,
                                      hierarchical=True, error_feedback=False, **small),
    }.items():
        where = cpu_cluster(1, 4) if ".4nodes." in label else cluster
        run = train_ddp(comm, where, steps=steps, track_invariant=True)
        out[f"{label}.invariant_rel"] = run["invariant_rel"]
        out[f"{label}.buckets"] = run["buckets"]
        big = train_ddp(comm.replace(bucket_mb=25.0), where, steps=steps)
        out[f"{label}.bucket_independent"] = torch.equal(big["params"], run["params"])
        last = run["hook"].counters.last
        out[f"{label}.payload_over_dense"] = last.payload_bytes / last.dense_bytes
        out[f"{label}.off_node_over_dense"] = last.off_node_bytes / last.dense_bytes
        out[f"{label}.wire_over_dense"] = last.wire_bytes / last.dense_bytes
    out.update(powersgd_checks(cluster, steps, ref))
    return out


def powersgd_checks(cluster: ClusterSpec, steps: int, ref: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    comm = CommOptions(compression="powersgd", powersgd_rank=2, bucket_mb=0.004)
    run = train_ddp(comm, None, steps=steps)
    out["powersgd.buckets"] = run["buckets"]
    out["powersgd.max_rel_vs_ref"] = max(float((a - b).abs().max() / b.abs().max())
                                         for a, b in zip(run["grads"], ref["grads"]))
    last = run["hook"].counters.last
    out["powersgd.payload_over_dense"] = last.payload_bytes / last.dense_bytes
    try:  # several buckets on gloo: refused at registration, before any collective
        make_comm_hook(comm, None).register(DDP(tiny_model(0), bucket_cap_mb=0.004))
        out["powersgd.multibucket_refused"] = ""
    except ValueError as err:
        out["powersgd.multibucket_refused"] = str(err)
    return out


# -- scenario: bit-exact resume with top-k + error feedback --------------------------------------

def _params_digest(module: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()


def _resume_parts(seed: int, comm: CommOptions):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = tiny_model(seed, torch.float32)
    ddp = DDP(model, **ddp_kwargs(comm, model))
    hook = make_comm_hook(comm, None).register(ddp)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    return ddp, hook, opt


def _resume_steps(ddp, hook: CommHook, opt, steps: range) -> None:
    rank = dist.get_rank()
    for step in steps:
        x, y = batch(step, rank, torch.float32)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        hook.end_step()


def scenario_resume(rank: int, world: int, args: dict) -> dict:
    comm = CommOptions(compression="topk", topk_density=0.05, bucket_mb=0.004,
                       topk_exchange=args.get("exchange", "auto"))
    ckpt = Path(args["dir"]) / f"ckpt.rank{rank}.pt"
    total, cut = 10, 5
    if args["phase"] == "full":
        ddp, hook, opt = _resume_parts(0, comm)
        _resume_steps(ddp, hook, opt, range(cut))
        torch.save({"model": ddp.module.state_dict(), "optim": opt.state_dict(),
                    "comm": hook.state_dict()}, ckpt)
        _resume_steps(ddp, hook, opt, range(cut, total))
        return {"digest": _params_digest(ddp.module)}
    out = {}
    for with_comm_state in (True, False):
        ddp, hook, opt = _resume_parts(123, comm)  # another init: loading must restore it all
        state = torch.load(ckpt, weights_only=False)
        ddp.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        if with_comm_state:
            hook.load_state_dict(state["comm"])
        _resume_steps(ddp, hook, opt, range(cut, total))
        out[f"digest.comm_state={with_comm_state}"] = _params_digest(ddp.module)
    return out


# -- scenario: convergence on the synthetic Markov corpus --------------------------------------

def scenario_converge(rank: int, world: int, args: dict) -> dict:
    """Held-out loss after a fixed budget per compression setting, same init and data, on the
    reference GPT (a small one) and the Markov corpus with its known entropy floor."""
    from trainpilot.runtime.data import MarkovCorpus
    from trainpilot.specs import ModelSpec

    spec = ModelSpec(name="conv-gpt", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                     intermediate_size=128, vocab_size=64, activation="swiglu", norm="rmsnorm",
                     position_embedding="rope", max_position_embeddings=64)
    corpus = MarkovCorpus(vocab_size=64, seq_len=32, seed=0, concentration=0.1)
    out = {"floor": corpus.entropy_rate_nats}
    for label, comm in {
        "none": CommOptions(),
        "topk15.ef": CommOptions(compression="topk", topk_density=0.15),
        "topk1.ef": CommOptions(compression="topk", topk_density=0.01),
        "topk1.noef": CommOptions(compression="topk", topk_density=0.01, error_feedback=False),
    }.items():
        out["initial"], out[label] = converge(spec, corpus, comm, steps=args.get("steps", 120))
    return out


def converge(spec, corpus, comm: CommOptions, *, steps: int) -> tuple[float, float]:
    import numpy as np
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainpilot.runtime.models import build_gpt, init_parameters

    rank, world, per_rank = dist.get_rank(), dist.get_world_size(), 8
    model = build_gpt(spec, max_seq_len=corpus.seq_len, device="cpu")
    init_parameters(model, spec, seed=0)
    ddp = DDP(model, **ddp_kwargs(comm, model))
    hook = make_comm_hook(comm, None).register(ddp)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.0)
    eval_x, eval_y = corpus.get_batch(np.arange(10**6, 10**6 + 64))

    def held_out() -> float:
        with torch.no_grad():
            return float(nn.functional.cross_entropy(model(eval_x).flatten(0, 1),
                                                     eval_y.flatten()))

    initial = held_out()
    for step in range(steps):
        first = (step * world + rank) * per_rank
        x, y = corpus.get_batch(np.arange(first, first + per_rank))
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        hook.end_step()
    hook.close()
    return initial, held_out()


SCENARIOS = {"hierarchy": scenario_hierarchy, "ddp": scenario_ddp, "resume": scenario_resume,
             "converge": scenario_converge}


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, CommHook):
        return None
    raise TypeError(type(value).__name__)


def main(scenarios: dict | None = None) -> None:
    """Run ``scenarios[argv[1]]`` (default: this module's) on one rank; write its result."""
    scenario, rank, world, port, outdir, args = sys.argv[1:7]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", int(port), is_master=False,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    result = (scenarios or SCENARIOS)[scenario](rank, world, json.loads(args))
    path = Path(outdir) / f"{scenario}.rank{rank}.json"
    path.write_text(json.dumps(result, default=_jsonable))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run_and_end(main)
