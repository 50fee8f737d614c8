"""Tier 2: the hook on a one-rank gloo group inside the test process."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from trainpilot.runtime.comm import ddp_kwargs, make_comm_hook
from trainpilot.specs import CommOptions


@pytest.fixture
def one_rank():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_counters_close_steps_by_themselves_and_state_round_trips(one_rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    comm = CommOptions(compression="topk", topk_density=0.25, bucket_mb=0.001)
    ddp = DDP(model, **ddp_kwargs(comm, model))
    hook = make_comm_hook(comm).register(ddp)
    for _ in range(3):  # never calls end_step: each new backward closes the previous step
        ddp(torch.randn(4, 8)).square().mean().backward()
    assert [m.step for m in hook.counters.history] == [0, 1]
    last = hook.end_step()
    assert last.num_buckets >= 1 and last.dense_bytes == 4 * sum(p.numel()
                                                                 for p in model.parameters())
    assert last.wire_bytes == 0  # one rank sends nothing
    state = hook.state_dict()
    assert set(state["topk"]["residuals"]) == {n for n, _ in model.named_parameters()}
    other = make_comm_hook(comm)
    other.load_state_dict(state)
    for name, value in state["topk"]["residuals"].items():
        assert torch.equal(other.error_feedback.residual(name), value)
    hook.close()
    other.close()
