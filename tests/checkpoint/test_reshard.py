"""FSDP2 (DTensor) state on 4 gloo ranks -> restored on 2 -> saved at 2 -> restored on 4, all
bit-exact against the full tensors of the original; a training step after the round trip
matches the uninterrupted run bit for bit. Also: the in-memory ring holds each peer's exact
bytes, and a full disk on one rank fails the save on every rank with nothing committed."""

from __future__ import annotations

import errno
import hashlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.checkpoint import dist_util
from trainpilot.runtime.checkpoint import (
    CheckpointConfig,
    Checkpointer,
    CheckpointWriteError,
    committed,
    diff_states,
)
from trainpilot.runtime.faults import FaultInjector


def build(mesh, seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train_step(model, opt, step: int) -> None:
    data = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank
    x = torch.randn(8, 6, generator=data)
    loss = ((model(x) - 1.0) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def state_of(model, opt, step: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": step}


def load_into(model, opt, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full(value):
    """The state with every DTensor gathered (collective on its mesh)."""
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [full(v) for v in value]
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    return value.clone() if isinstance(value, torch.Tensor) else value


def worker(rank: int, rendezvous: str, root: str, journal: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    dist_util.init_gloo(rank, 4, rendezvous)
    out: dict = {}
    mesh4 = init_device_mesh("cpu", (4,))
    model, opt = build(mesh4, seed=0)
    for step in (1, 2):
        train_step(model, opt, step)
    reference = full(state_of(model, opt, 2))

    # Phase 1: 4 ranks save; the in-memory ring holds each peer's exact bytes.
    faults = FaultInjector("enospc:rank=1,step=3", journal_path=journal)
    ckpt = Checkpointer(CheckpointConfig(root_dir=root), faults=faults)
    ckpt.save(2, state_of(model, opt, 2), rank_state={"cursor": 10 * rank}).result()
    own = hashlib.sha256(ckpt.memory.own[-1].buffer.numpy()).hexdigest()
    held = ckpt.memory.held[-1]
    all_own = [None] * 4
    dist.all_gather_object(all_own, own)
    out["ring"] = [held.rank, held.step,
                   hashlib.sha256(held.buffer.numpy()).hexdigest() == all_own[(rank - 1) % 4]]
    # A full disk on rank 1 fails step 3 everywhere; nothing is committed.
    try:
        ckpt.save(3, state_of(model, opt, 3)).result()
        out["enospc"] = "no error"
    except CheckpointWriteError as err:
        out["enospc"] = [sorted(err.failures), err.errno == errno.ENOSPC]
    out["committed_after_enospc"] = [s for s, _ in committed(ckpt.root)]
    ckpt.close()

    # Phase 2: ranks 0 and 1 alone, a 2-way FSDP2 mesh; restore (resharded), save at 2.
    if rank < 2:
        sub = dist.new_group([0, 1], use_local_synchronization=True)
        mesh2 = DeviceMesh.from_group(sub, "cpu")
        model2, opt2 = build(mesh2, seed=99)
        ckpt2 = Checkpointer(CheckpointConfig(root_dir=root), process_group=sub)
        restored = ckpt2.restore_latest(state_of(model2, opt2, 0), source="storage")
        load_into(model2, opt2, restored.state)
        out["phase2"] = [restored.step, restored.saved_world_size, restored.rank_state]
        out["phase2_diff"] = diff_states(full(state_of(model2, opt2, 2)), reference)
        ckpt2.save(5, state_of(model2, opt2, 2), rank_state=restored.rank_state).result()
        ckpt2.close()
    dist.barrier()

    # Phase 3: back to 4 ranks from the 2-rank checkpoint; then one more step must match.
    model4, opt4 = build(mesh4, seed=7)
    ckpt3 = Checkpointer(CheckpointConfig(root_dir=root))
    restored = ckpt3.restore_latest(state_of(model4, opt4, 0), source="storage")
    load_into(model4, opt4, restored.state)
    out["phase3"] = [restored.step, restored.saved_world_size, restored.rank_state]
    out["phase3_diff"] = diff_states(full(state_of(model4, opt4, 2)), reference)
    train_step(model, opt, 3)
    train_step(model4, opt4, 3)
    out["step3_diff"] = diff_states(full(state_of(model4, opt4, 3)),
                                    full(state_of(model, opt, 3)))
    ckpt3.close()
    dist.destroy_process_group()
    return out


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_reshard_4_2_4_bit_exact(tmp_path):
    import torch.distributed.checkpoint  # noqa: F401 (import once, before forking)
    import torch.distributed.fsdp  # noqa: F401

    args = (dist_util.rendezvous(tmp_path), str(tmp_path / "ckpt"), str(tmp_path / "faults.jsonl"))
    procs = [dist_util.start(worker, r, tmp_path, *args, hang_dump_s=100) for r in range(4)]
    codes = dist_util.join_all(procs, deadline_s=110)
    res = dist_util.results(tmp_path, [f"rank{r}" for r in range(4)])
    res = {r: res[f"rank{r}"] for r in range(4)}
    assert codes == [0, 0, 0, 0]
    for rank, out in res.items():
        assert out["ring"] == [(rank - 1) % 4, 2, True]
        assert out["enospc"] == [[1], True]
        assert out["committed_after_enospc"] == [2]
        assert out["phase3_diff"] == [] and out["step3_diff"] == []
        # The checkpoint was written by 2 ranks: ranks 2 and 3 get no per-rank state.
        assert out["phase3"] == [5, 2, {"cursor": 10 * rank} if rank < 2 else None]
    for rank in (0, 1):
        assert res[rank]["phase2"] == [2, 4, {"cursor": 10 * rank}]
        assert res[rank]["phase2_diff"] == []
    (record,) = FaultInjector(journal_path=tmp_path / "faults.jsonl").fired()
    assert (record["kind"], record["rank"], record["step"]) == ("enospc", 1, 3)
