"""The step guard hands its per-parameter gradient norms to the health monitor before it
clips: the monitor judges unclipped gradients (as in the Trainer, where clipping runs after
the monitor's hook) without measuring them again; the guard's clipping is clip_grad_norm_'s
arithmetic, bit for bit."""

from __future__ import annotations

import copy

import torch
from torch import nn

from trainpilot.health.monitor import HealthMonitor
from trainpilot.runtime.stepguard import StepGuard


def setup(hand_over: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = HealthMonitor(model=model, optimizer=opt, total_steps=10)
    guard = StepGuard(model.parameters(), max_norm=0.1,
                      on_grad_norms=monitor.observe_grad_norms if hand_over else None)
    return model, opt, monitor, guard


def step(model, opt, monitor, guard, n):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(n))
    for attempt in guard.attempts(n):
        loss = ((model(x) - 3.0) ** 2).mean()
        loss.backward()
        attempt.check(loss)
    monitor.observe_loss(n, guard.loss)
    opt.step()
    opt.zero_grad()
    monitor.end_step(step=n, loss=guard.loss.item(), tokens=16)


def test_monitor_judges_the_unclipped_norm_the_guard_measured():
    model, opt, monitor, guard = setup(hand_over=True)
    measured = []
    original = monitor.collector.grad_stats

    def spy(**kw):
        measured.append(kw.get("given") is not None)
        return original(**kw)

    monitor.collector.grad_stats = spy
    for n in range(1, 4):
        step(model, opt, monitor, guard, n)
        seen = monitor._grad_norms[-1]
        assert seen > guard.max_norm  # the norm before clipping
        assert abs(seen - float(guard.grad_norm)) <= 1e-6 * seen
    assert measured == [True, True, True]


def test_negative_control_without_the_hand_over_the_monitor_sees_clipped_gradients():
    model, opt, monitor, guard = setup(hand_over=False)
    for n in range(1, 4):
        step(model, opt, monitor, guard, n)
        assert float(guard.grad_norm) > guard.max_norm
        assert monitor._grad_norms[-1] <= guard.max_norm * (1 + 1e-5)


def test_guard_clip_is_clip_grad_norm_bit_for_bit():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    twin = copy.deepcopy(model)
    x = torch.randn(5, 8)
    for m in (model, twin):
        (m(x) ** 2).sum().backward()
    guard = StepGuard(model.parameters(), max_norm=0.5)
    norm = guard.clip()
    expect = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.5)
    assert torch.equal(norm, expect) and norm > 0.5
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)
