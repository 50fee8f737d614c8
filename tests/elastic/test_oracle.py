"""The oracle: a run with a fault and automatic recovery ends bit-identical to an uninterrupted
run with the same seed — parameters, AdamW state, the loss of every step and the samples of
every step — the fault fired (journal), no checkpoint on disk is torn, and no sample was skipped
or read twice.

Each drill is 2 gloo ranks forked by the LocalSupervisor (a dead rank is replaced by a new
process, or, with ``restart_all``, every rank restarts as under torchrun), training the
DropoutLM (its dropout draws from the RNG) for 16 steps with 2 micro-batches per rank, a
snapshot every 2 steps to memory, a peer's memory and storage. Negative controls show that the
oracle fails when a restore drops the sampler position or the RNG state.
"""

from __future__ import annotations

import pytest

from tests.elastic.helpers import (
    ELASTIC,
    STEPS,
    assert_bit_exact,
    assert_exactly_once,
    assert_no_torn_checkpoint,
    drill,
    journal,
    state_diff,
    store_events,
)

pytestmark = [pytest.mark.dist]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every faulted run is compared with."""
    _, outcome = drill(tmp_path_factory.mktemp("reference"))
    assert_exactly_once(outcome, global_batch=16, steps=STEPS)
    assert len(outcome.states) == 2 and outcome.recoveries == []
    return outcome


# In-process recovery (the survivor rebuilds its group; a dead rank gets a replacement that
# restores from its peer's memory): fault spec, and what must be seen besides the oracle.
IN_PROCESS = {
    "crash_sigkill": ("crash:rank=1,step=7", dict(replaced=[1], source="memory")),
    "crash_exit": ("crash:rank=0,step=5,mode=exit", dict(replaced=[0], source="memory")),
    "crash_between_data_files": ("crash:rank=1,step=6,at=data", dict(replaced=[1])),
    "crash_before_manifest": ("crash:rank=0,step=8,at=manifest", dict(replaced=[0])),
    "crash_before_latest": ("crash:rank=0,step=8,at=latest", dict(replaced=[0])),
    "hang_sigstop": ("hang:rank=1,step=5", dict(replaced=[1], verdict="silent")),
    "hang_in_collective": ("hang:rank=0,step=6,at=collective,mode=sleep",
                           dict(replaced=[0], verdict="hung")),
    "slow_rank": ("slow:rank=1,step=4,factor=4,steps=3", dict(replaced=[])),
    # Rank 0: events of other ranks do not reach the store (their faults do, via the journal).
    "failed_collective": ("collective:rank=0,step=5", dict(replaced=[], event="collective_retry")),
    "nan_gradient": ("nan:rank=0,step=6", dict(replaced=[], event="nonfinite_recompute")),
    # After the reduction, on rank 1 only: the ranks disagree, both see it in the step's stats
    # all-reduce and recover from the newest checkpoint instead of drifting apart.
    "nan_after_reduction": ("nan:rank=1,step=6,at=grad", dict(replaced=[], event="restart")),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(IN_PROCESS))
def test_fault_recovered_in_process_is_bit_exact(name, reference, tmp_path):
    spec, expect = IN_PROCESS[name]
    report, outcome = drill(tmp_path, inject=spec)
    fired = journal(tmp_path)
    times = 3 if name == "slow_rank" else 1  # a slow rank's fault fires on each of its steps
    assert [r["fault"].split(":")[0] for r in fired] == [spec.split(":")[0]] * times
    assert_bit_exact(outcome, reference)
    assert_exactly_once(outcome, global_batch=16, steps=STEPS)
    assert_no_torn_checkpoint(tmp_path)
    assert sorted(r["rank"] for r in report.replacements) == expect["replaced"]
    if expect["replaced"]:
        restarts = [e.payload for e in store_events(tmp_path, ["restart"])
                    if "restored_step" in e.payload]
        assert restarts, "no restart event in the run store"
        if "source" in expect:
            assert {r["source"] for r in restarts} == {expect["source"]}
        assert store_events(tmp_path, ["recovered"]), "no recovered event"
    if "verdict" in expect:
        assert expect["verdict"] in {v["reason"] for v in outcome.verdicts}
    if "event" in expect:
        assert store_events(tmp_path, [expect["event"]]), f"no {expect['event']} event"
    assert [e.payload["kind"] for e in store_events(tmp_path, ["fault"])] == [
        r["kind"] for r in fired]


# Storage faults: damage the newest checkpoint, then crash; every rank restarts (torchrun's
# semantics: host memory is gone), so the restore must come from storage and skip the damaged
# checkpoint for the previous intact one. Saves are synchronous so that the damage lands
# before the crash (an async write could still be in flight when the crash hits).
STORAGE = {
    "corrupt": ("corrupt:step=10;crash:rank=1,step=11", (10,)),
    "truncate": ("truncate:step=10,rank=1;crash:rank=0,step=11", (10,)),
    "missing_data": ("missing:step=10,rank=1;crash:rank=0,step=11", (10,)),
    "missing_manifest": ("missing:step=10,file=manifest;crash:rank=1,step=11", ()),
    "disk_full": ("enospc:step=10,rank=1;crash:rank=1,step=11", ()),
    "disk_full_at_manifest": ("enospc:step=10,at=manifest;crash:rank=0,step=11", ()),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(STORAGE))
def test_storage_fault_then_restart_is_bit_exact(name, reference, tmp_path):
    spec, damaged = STORAGE[name]
    report, outcome = drill(tmp_path, inject=spec, policy="restart_all", async_save=False)
    kinds = sorted(r["kind"] for r in journal(tmp_path))
    assert kinds == sorted(part.split(":")[0] for part in spec.split(";"))
    assert_bit_exact(outcome, reference)
    assert_exactly_once(outcome, global_batch=16, steps=STEPS)
    assert_no_torn_checkpoint(tmp_path, damaged=damaged)
    restart = [e.payload for e in store_events(tmp_path, ["restart"])
               if "restored_step" in e.payload]
    assert [(r["restored_step"], r["source"]) for r in restart] == [(8, "storage")]
    if damaged:  # the damaged step-10 checkpoint was tried and skipped, with the reason
        assert any("step_0000000010" in s for s in restart[0]["skipped"])
    if "enospc" in spec:
        assert store_events(tmp_path, ["checkpoint_failed"])


@pytest.mark.timeout(120)
def test_collective_retries_exhausted_escalate_to_recovery(reference, tmp_path):
    """Three failures of the same collective with two retries allowed: the third escalates to
    an in-process recovery (new group, restore from memory); its peer, blocked in the same
    collective, fails at its timeout and recovers too; the run still ends exact."""
    spec = ";".join(["collective:rank=1,step=5"] * 3)
    _, outcome = drill(tmp_path, inject=spec, elastic=dict(ELASTIC, max_collective_retries=2))
    assert len(journal(tmp_path)) == 3
    assert [r["source"] for r in outcome.recoveries] == ["memory", "memory"]  # both ranks
    assert_bit_exact(outcome, reference)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dropped", ["sampler", "rng"])
def test_negative_control_restore_without_position_or_rng_diverges(dropped, reference,
                                                                    tmp_path):
    """The same crash and recovery, but the restore keeps the live sampler position or RNG
    state: the oracle must fail (else it could not tell a correct recovery from a wrong one)."""
    _, outcome = drill(tmp_path, inject="crash:rank=1,step=7", drop_on_restore=(dropped,))
    assert journal(tmp_path)
    assert outcome.losses != reference.losses
    assert state_diff(outcome.states[0], reference.states[0]) != []
    if dropped == "sampler":  # the replacement re-read samples from the start of the epoch
        seen = [i for s in sorted(outcome.samples) for i in outcome.samples[s]]
        assert len(seen) != len(set(seen))
    else:
        assert outcome.samples == reference.samples  # same data, other dropout masks
