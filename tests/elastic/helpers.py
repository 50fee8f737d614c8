"""Shared pieces of the elastic tests: detection settings sized for a loaded 2-core machine,
and the oracle (bit-exact state, loss sequence and samples; intact checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.elastic.drill import DrillSpec, Outcome, read_outcome, run_drill
from trainpilot.runtime.checkpoint import committed, read_manifest
from trainpilot.runtime.checkpoint.layout import step_dirs, verify_files

# Short timeouts so that a hang costs seconds; long enough for a loaded machine's slow step.
ELASTIC = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.5, collective_timeout_s=4.0,
               hang_grace_s=2.0, join_timeout_s=40.0)
PLAN = "dp=2,zero=0,micro_batch_size=4,global_batch_size=16,seq_len=32"
STEPS = 16


def drill(run_dir: Path, *, inject: str = "", world_size: int = 2, policy: str = "replace",
          timeout_s: float = 100.0, max_restarts: int = 6, **spec) -> tuple[object, Outcome]:
    """Run a drill and read what it left; fails if the supervisor did not finish it."""
    spec.setdefault("plan", PLAN)
    spec.setdefault("steps", STEPS)
    spec.setdefault("elastic", ELASTIC)
    report = run_drill(DrillSpec(run_dir=str(run_dir), inject=inject, **spec),
                       world_size=world_size, policy=policy, timeout_s=timeout_s,
                       max_restarts=max_restarts)
    assert report.ok, f"drill did not finish: {[(p.rank, p.incarnation, p.exitcode) for p in report.processes]}"
    return report, read_outcome(run_dir)


def state_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors are not bit-identical (or missing on one side)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


def assert_bit_exact(outcome: Outcome, reference: Outcome) -> None:
    """The oracle: every rank's parameters and optimizer state, the loss of every step and the
    samples of every step equal the uninterrupted run's."""
    assert outcome.losses == reference.losses  # floats compared exactly
    for rank, state in outcome.states.items():
        assert state_diff(state, reference.states[rank]) == [], f"rank {rank} differs"
    assert outcome.samples == reference.samples


def assert_exactly_once(outcome: Outcome, *, global_batch: int, steps: int) -> None:
    """Every committed step read a full global batch, and no sample was read twice."""
    assert sorted(outcome.samples) == list(range(1, steps + 1))
    seen = [i for step in sorted(outcome.samples) for i in outcome.samples[step]]
    assert all(len(outcome.samples[s]) == global_batch for s in outcome.samples)
    assert len(seen) == len(set(seen)) == steps * global_batch


def assert_no_torn_checkpoint(run_dir: Path, *, damaged: tuple[int, ...] = ()) -> None:
    """Every checkpoint folder on disk is committed (has a manifest) and its files verify,
    except the ``damaged`` steps a fault corrupted on purpose after their commit."""
    root = Path(run_dir) / "checkpoints"
    folders = [name for _, name in step_dirs(root)]
    good = [name for step, name in committed(root)]
    assert folders == good, f"uncommitted folders left: {sorted(set(folders) - set(good))}"
    for step, name in committed(root):
        body = read_manifest(root, name)
        problems = verify_files(root, body["files"], list(body["files"]))
        assert bool(problems) == (step in damaged), (name, problems)


def journal(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "faults.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def store_events(run_dir: Path, kinds: list[str]) -> list:
    from trainpilot.store import RunStore

    store = RunStore.open_readonly(run_dir)
    try:
        return store.events(kinds=kinds)
    finally:
        store.close()
