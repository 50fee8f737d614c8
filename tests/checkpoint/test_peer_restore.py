"""The in-memory tier with real processes, 3 gloo ranks, FSDP2 state, ring offset 1 (rank r's
copy lives on rank r+1).

gen 0: steps 1-4; step 2 saved to memory and storage, step 4 to memory only. Rank 1 is
       SIGKILLed at step 5; ranks 0 and 2 see the collective fail and rebuild the group.
gen 1: a replacement rank 1 (a new process, empty memory) joins; every rank restores step 4
       from memory, rank 1 from rank 2's copy (storage has no step 4: it cannot come from
       there). Steps 5-7, step 6 saved to memory and storage; ranks 1 and 2 are SIGKILLed at 8.
gen 2: both copies of rank 1's state are gone (its own and rank 2's), so all ranks fall back to
       storage at step 6, consistently, with replacements for ranks 1 and 2.
Each restore is checked bit-exact on the full (gathered) tensors against the original run.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.checkpoint import dist_util
from tests.checkpoint.test_reshard import build, full, load_into, state_of, train_step
from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer, diff_states
from trainpilot.runtime.faults import FaultInjector

SPEC = "crash:rank=1,step=5;crash:rank=1,step=8;crash:rank=2,step=8"
WORLD = 3


def rank_main(rank: int, rendezvous: list[str], gen: int, root: str, journal: str, out: str) -> dict:
    """One process, from generation ``gen`` (0: original, 1-2: replacement) to the end."""
    from torch.distributed.device_mesh import init_device_mesh

    def log(**event) -> None:
        with open(Path(out) / f"events_r{rank}.jsonl", "a") as handle:
            handle.write(json.dumps({"rank": rank, **event}) + "\n")

    faults = FaultInjector(SPEC, journal_path=journal)
    ckpt, reference, step = None, {}, 0
    while True:
        dist_util.init_gloo(rank, WORLD, rendezvous[gen], timeout_s=30)
        mesh = init_device_mesh("cpu", (WORLD,))
        model, opt = build(mesh, seed=100 + gen)
        if ckpt is None:
            ckpt = Checkpointer(CheckpointConfig(root_dir=root, peer_offset=1))
        else:
            ckpt.rebind()
        if gen > 0:
            restored = ckpt.restore_latest(state_of(model, opt, 0))
            load_into(model, opt, restored.state)
            step = restored.step
            gathered = full(state_of(model, opt, step))  # collective: every rank takes part
            diff = diff_states(gathered, reference[step]) if step in reference else None
            log(event="restored", gen=gen, step=step, source=restored.source,
                restore_s=round(restored.restore_s, 3),
                rank_state=restored.rank_state, rng=restored.rng_restored, diff=diff)
            if gen == 2:
                break
        try:
            while step < 9:
                step += 1
                faults.on_step(step, rank=rank)
                train_step(model, opt, step)
                if step in (2, 4, 6):
                    ckpt.save(step, state_of(model, opt, step), to_storage=step != 4,
                              rank_state={"cursor": 10 * step + rank}).result()
                    reference[step] = full(state_of(model, opt, step))
        except RuntimeError as err:  # the dead peer's collective fails: rebuild the group
            log(event="failure", gen=gen, step=step, error=str(err)[:120])
            dist.destroy_process_group()
            gen += 1
            continue
        break
    ckpt.close()
    dist.destroy_process_group()
    return {"gen": gen, "step": step}


def _wait_dead(proc, timeout_s: float) -> int | None:
    proc.join(timeout_s)
    return proc.exitcode


@pytest.mark.dist
@pytest.mark.timeout(170)
def test_replacement_restores_from_peer_memory_then_storage(tmp_path):
    import torch.distributed.checkpoint  # noqa: F401 (import once, before forking)
    import torch.distributed.fsdp  # noqa: F401

    rendezvous = [dist_util.rendezvous(tmp_path, f"gen{gen}") for gen in range(3)]
    args = (str(tmp_path / "ckpt"), str(tmp_path / "faults.jsonl"), str(tmp_path))

    def launch(rank: int, gen: int):
        return dist_util.start(rank_main, rank, tmp_path, rendezvous, gen, *args,
                               label=f"r{rank}g{gen}", hang_dump_s=140)

    procs = {f"r{r}g0": launch(r, 0) for r in range(WORLD)}
    try:
        assert _wait_dead(procs["r1g0"], 60) == -signal.SIGKILL
        procs["r1g1"] = launch(1, 1)
        assert _wait_dead(procs["r1g1"], 60) == -signal.SIGKILL
        assert _wait_dead(procs["r2g0"], 30) == -signal.SIGKILL
        procs["r1g2"], procs["r2g2"] = launch(1, 2), launch(2, 2)
        finals = ["r0g0", "r1g2", "r2g2"]
        codes = dist_util.join_all([procs[k] for k in finals], deadline_s=60)
        dist_util.results(tmp_path, finals)
        assert codes == [0, 0, 0]
    finally:
        dist_util.join_all(list(procs.values()), deadline_s=0)

    events = [json.loads(line) for r in range(WORLD)
              for line in (tmp_path / f"events_r{r}.jsonl").read_text().splitlines()]
    restores = {(e["gen"], e["rank"]): e for e in events if e["event"] == "restored"}
    assert sorted(restores) == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    for rank in range(WORLD):
        first, second = restores[(1, rank)], restores[(2, rank)]
        assert (first["step"], first["source"]) == (4, "memory")
        assert (second["step"], second["source"]) == (6, "storage")
        assert first["rank_state"] == {"cursor": 40 + rank} and first["rng"]
        assert second["rank_state"] == {"cursor": 60 + rank} and second["rng"]
    # Rank 0 lived through it all: it holds the original run's full tensors at steps 4 and 6,
    # and its full_tensor() gathers every rank's restored shard, the replacements' included.
    assert restores[(1, 0)]["diff"] == [] and restores[(2, 0)]["diff"] == []
    crashes = FaultInjector(journal_path=tmp_path / "faults.jsonl").fired("crash")
    assert sorted((c["rank"], c["step"]) for c in crashes) == [(1, 5), (1, 8), (2, 8)]
