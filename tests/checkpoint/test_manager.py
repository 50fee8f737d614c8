"""CheckpointManager and StepGuard, the parts a user's own loop composes (examples/
ddp_with_trainpilot.py runs both under torchrun with faults; these are the one-process
contracts): cadence, restore into the states, bad input; clipping, the non-finite retry and
skip, each with a negative control."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainpilot.runtime.checkpoint import diff_states
from trainpilot.runtime.checkpoint.manager import CheckpointManager
from trainpilot.runtime.faults import FaultInjector
from trainpilot.runtime.sampler import ResumableSampler
from trainpilot.runtime.stepguard import StepGuard
from trainpilot.specs import SpecError
from trainpilot.specs.plan import CheckpointPolicy

DATA = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))


class Loop:
    """A seeded model, optimizer and sampler, trained through a StepGuard."""

    def __init__(self, seed: int = 0, *, faults: FaultInjector | None = None, retries: int = 1):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sampler = ResumableSampler(len(DATA), seed=seed)
        self.guard = StepGuard(self.model.parameters(), max_norm=0.5, faults=faults,
                               poison=[self.model[2]], retries=retries)

    def states(self) -> dict:
        return dict(model=self.model, optimizer=self.opt, sampler=self.sampler)

    def step(self, step: int) -> None:
        x = DATA[self.sampler.next_indices(8)]
        for attempt in self.guard.attempts(step):
            loss = ((self.model(x) - x.sum(1, keepdim=True)) ** 2).mean()
            loss.backward()
            attempt.check(loss)
        if self.guard.finite:
            self.opt.step()
        self.opt.zero_grad()


def test_saves_on_the_interval_and_restores_every_state(tmp_path):
    run = Loop()
    manager = CheckpointManager(run.states(), root_dir=tmp_path,
                                policy=CheckpointPolicy(interval_steps=2))
    saved = []
    for step in range(1, 8):
        run.step(step)
        if manager.maybe_save(step, last=step == 7) is not None:
            saved.append(step)
    manager.close()
    assert saved == [2, 4, 6, 7]
    fresh = Loop(seed=5)  # other weights, other sampler seed
    with pytest.raises(SpecError, match="sampler.seed"):  # the sampler refuses another seed
        CheckpointManager(fresh.states(), root_dir=tmp_path).load()
    fresh = Loop(seed=0)
    fresh.model[0].weight.data.add_(1.0)
    restorer = CheckpointManager(fresh.states(), root_dir=tmp_path)
    assert restorer.load() == 7 and restorer.step == 7
    assert diff_states(fresh.model.state_dict(), run.model.state_dict()) == []
    assert diff_states(fresh.opt.state_dict(), run.opt.state_dict()) == []
    assert fresh.sampler.state_dict() == run.sampler.state_dict()
    # Negative control: an older checkpoint is restored when asked, and it differs.
    older = Loop(seed=0)
    assert CheckpointManager(older.states(), root_dir=tmp_path).load(max_step=4) == 4
    assert diff_states(older.model.state_dict(), run.model.state_dict()) != []
    assert older.sampler.state_dict()["position"] == 4 * 8
    restorer.close()


def test_storage_cadence_counts_steps_and_the_last_save_goes_to_storage(tmp_path):
    run = Loop()
    manager = CheckpointManager(run.states(), root_dir=tmp_path, storage_every=2,
                                policy=CheckpointPolicy(interval_steps=1))
    handles = [manager.maybe_save(step, last=step == 5) for step in range(1, 6)]
    manager.close()
    assert [h.report.to_storage for h in handles] == [True, False, True, False, True]


def test_bad_states_get_one_clear_error(tmp_path):
    with pytest.raises(SpecError, match="manager's own entry"):
        CheckpointManager(dict(step=nn.Linear(1, 1)), root_dir=tmp_path)
    with pytest.raises(SpecError, match="states.rng.*state_dict"):
        CheckpointManager(dict(rng=object()), root_dir=tmp_path)
    with pytest.raises(SpecError, match="root_dir"):
        CheckpointManager(dict(model=nn.Linear(1, 1)))


def test_guard_clips_and_a_nan_gradient_is_recomputed_bit_exactly(tmp_path):
    clean, faulty = Loop(), Loop(faults=FaultInjector(
        "nan:rank=0,step=3,at=grad", journal_path=tmp_path / "faults.jsonl"))
    for step in range(1, 6):
        clean.step(step)
        faulty.step(step)
    assert clean.guard.grad_norm > 0 and clean.guard.num_retries == 0
    assert faulty.guard.num_retries == 1 and faulty.guard.num_skipped == 0
    assert "nan" in (tmp_path / "faults.jsonl").read_text()  # the fault fired
    assert diff_states(faulty.model.state_dict(), clean.model.state_dict()) == []


def test_guard_clips_to_max_norm_and_reports_the_norm_before():
    run = Loop()
    x = DATA[:8]
    for attempt in run.guard.attempts(1):
        loss = ((run.model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        loss.backward()
        assert attempt.check(loss)
    after = torch.nn.utils.get_total_norm([p.grad for p in run.model.parameters()])
    assert float(run.guard.grad_norm) > run.guard.max_norm  # reported: the norm before
    assert float(after) <= run.guard.max_norm * (1 + 1e-5)  # applied: clipped
    assert torch.equal(run.guard.loss, loss.detach())  # one rank: the mean is its loss


def test_negative_control_without_retries_the_step_is_skipped_and_weights_differ(tmp_path):
    clean = Loop()
    faulty = Loop(faults=FaultInjector("nan:rank=0,step=3,at=backward",
                                       journal_path=tmp_path / "faults.jsonl"), retries=0)
    for step in range(1, 6):
        clean.step(step)
        faulty.step(step)
    assert faulty.guard.num_skipped == 1 and faulty.guard.num_retries == 0
    assert diff_states(faulty.model.state_dict(), clean.model.state_dict()) != []


def test_guard_insists_on_check():
    run = Loop()
    with pytest.raises(RuntimeError, match="attempt.check"):
        for _ in run.guard.attempts(1):
            pass


@pytest.mark.timeout(60)
def test_guard_clips_dtensor_and_plain_gradients_together(tmp_path):
    """DTensor gradients (FSDP2, TP) go through runtime.optim.clip_grad_norm_: a model holding
    both kinds is clipped as one, equal to that function on a twin."""
    import copy
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from trainpilot.runtime.optim import clip_grad_norm_

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
        model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh,
                                                         [Replicate()]))
        twin = copy.deepcopy(model)
        x = torch.randn(3, 4)
        for m in (model, twin):
            w = m[0].weight.to_local()
            (m[1](x @ w.T + m[0].bias) ** 2).sum().backward()
        from torch.distributed.tensor import DTensor

        assert isinstance(model[0].weight.grad, DTensor)  # the branch under test is taken
        norm = StepGuard(model.parameters(), max_norm=0.1).clip()
        expect = clip_grad_norm_(list(twin.parameters()), 0.1)
        assert torch.equal(norm, expect) and float(norm) > 0.1
        for a, b in zip(model.parameters(), twin.parameters()):
            ga = a.grad.to_local() if hasattr(a.grad, "to_local") else a.grad
            gb = b.grad.to_local() if hasattr(b.grad, "to_local") else b.grad
            assert torch.equal(ga, gb)
    finally:
        dist.destroy_process_group()
