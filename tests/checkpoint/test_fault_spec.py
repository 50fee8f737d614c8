"""The --inject spec and the injector's journal (pure logic, no process group)."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from trainpilot.runtime.faults import FaultInjector, InjectedCollectiveError, parse_faults
from trainpilot.specs.errors import SpecError


def test_parse_fills_defaults_and_keeps_order():
    faults = parse_faults("crash:rank=1,step=5; corrupt:step=10 ;slow:rank=0,step=3,factor=4")
    assert [f.kind for f in faults] == ["crash", "corrupt", "slow"]
    assert faults[0].get("at") == "step" and faults[0].get("mode") == "sigkill"
    assert faults[1].get("rank") == 0 and faults[1].get("file") == "data"
    assert faults[2].get("factor") == 4.0 and faults[2].times == 1
    assert faults[0].id == "crash:rank=1,step=5,at=step,file=1,mode=sigkill"


@pytest.mark.parametrize("spec, field, fragment", [
    ("boom:step=1", "inject[0]", "unknown fault"),
    ("crash:step=1", "inject[0].rank", "needs rank"),
    ("crash:rank=1,step=x", "inject[0].step", "integer"),
    ("crash:rank=1,step=2,when=3", "inject[0].when", "valid: rank, step"),
    ("crash:rank=1,step=2,at=somewhere", "inject[0].at", "valid: step, data"),
    ("crash:rank=1,step=2,at=manifest", "inject[0].rank", "coordinator"),
    ("nan:rank=0,step=1;hang:rank=-1,step=2", "inject[1].rank", ">= 0"),
    ("slow:rank=0,step=1,at=checkpoint", "inject[0].seconds", "needs seconds"),
    ("crash:rank", "inject[0].rank", "key=value"),
])
def test_bad_specs_name_the_field(spec, field, fragment):
    with pytest.raises(SpecError) as info:
        parse_faults(spec)
    assert info.value.field == field and fragment in str(info.value)


def test_journal_survives_restarts_so_a_fault_fires_once(tmp_path):
    journal = tmp_path / "j.jsonl"
    first = FaultInjector("collective:rank=1,step=4", journal_path=journal)
    first.before_collective(3, rank=1)  # wrong step: nothing
    first.before_collective(4, rank=0)  # wrong rank: nothing
    with pytest.raises(InjectedCollectiveError):
        first.before_collective(4, rank=1)
    first.before_collective(4, rank=1)  # fired already
    restarted = FaultInjector("collective:rank=1,step=4", journal_path=journal)
    restarted.before_collective(4, rank=1)  # the journal says it fired: no second failure
    (record,) = restarted.fired()
    assert (record["kind"], record["rank"], record["step"], record["point"]) == (
        "collective", 1, 4, "collective")


def test_nan_and_slow_hooks_fire_and_are_journaled():
    faults = FaultInjector("nan:rank=0,step=2,at=grad;slow:rank=0,step=1,factor=2,steps=2;"
                           "nan:rank=0,step=3")
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    assert not faults.poison_gradients(model.parameters(), 1, rank=0)
    assert not faults.poison_backward([model], 2, rank=0)  # the step-2 fault is at=grad
    assert faults.poison_gradients(model.parameters(), 2, rank=0)
    assert math.isnan(model.weight.grad.view(-1)[0].item())
    # at=backward (the default): armed before the forward, the NaN enters in backward and
    # reaches every gradient of the module; a second forward is left alone.
    handles = faults.poison_backward([model], 3, rank=0)
    model.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    assert all(torch.isnan(p.grad).any() for p in model.parameters())
    model.zero_grad()
    model(torch.ones(1, 3)).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    for handle in handles:
        handle.remove()
    for step in (1, 2, 3):
        faults.on_step(step, rank=0, step_time_s=0.01)
    assert [r["step"] for r in faults.fired("slow")] == [1, 2]
    assert [r["sleep_s"] for r in faults.fired("slow")] == [0.01, 0.01]
    assert [(r["step"], r["point"]) for r in faults.fired("nan")] == [(2, "grad"), (3, "backward")]


def _hang_child(journal: str) -> None:
    FaultInjector("hang:rank=0,step=3", journal_path=journal).on_step(3, rank=0)
    os._exit(0)  # only reached if the hang did not happen


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(60)
def test_hang_stops_the_process_until_someone_kills_it(tmp_path):
    journal = tmp_path / "j.jsonl"
    proc = multiprocessing.get_context("fork").Process(target=_hang_child, args=(str(journal),))
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while _state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(proc.pid) == "T"  # stopped (SIGSTOP), not exited
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert proc.exitcode == -signal.SIGKILL
    (record,) = FaultInjector(journal_path=journal).fired("hang")
    assert (record["mode"], record["step"], record["pid"]) == ("sigstop", 3, proc.pid)


def test_hang_inside_a_collective_sleeps():
    faults = FaultInjector("hang:rank=0,step=1,at=collective,mode=sleep,seconds=0.2")
    start = time.perf_counter()
    faults.before_collective(1, rank=0)
    assert time.perf_counter() - start >= 0.2
    assert faults.fired("hang")[0]["point"] == "collective"
