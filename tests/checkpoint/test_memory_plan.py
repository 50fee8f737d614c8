"""The in-memory recovery plan (pure logic): every rank computes it from the same gathered
inventories, so it must pick the newest step at which every rank's snapshot survives."""

from __future__ import annotations

from trainpilot.runtime.checkpoint.peer import RecoveryPlan, plan_recovery


def inv(own=(), held=(), world=3):
    """own: steps this rank holds of itself (rank filled in by position); held: (step, owner)."""
    return {"own": [[s, None, world] for s in own], "held": [[s, r, world] for s, r in held]}


def inventories(*ranks):
    out = []
    for rank, entry in enumerate(ranks):
        entry["own"] = [[s, rank, w] for s, _, w in entry["own"]]
        out.append(entry)
    return out


def test_everyone_has_their_own_newest():
    invs = inventories(inv([2, 4], [(2, 2), (4, 2)]), inv([2, 4], [(2, 0), (4, 0)]),
                       inv([2, 4], [(2, 1), (4, 1)]))
    assert plan_recovery(invs, 3) == RecoveryPlan(step=4, moves=())


def test_a_replacement_gets_its_snapshot_from_the_holder():
    invs = inventories(inv([2, 4], [(2, 2), (4, 2)]), inv(), inv([2, 4], [(2, 1), (4, 1)]))
    assert plan_recovery(invs, 3) == RecoveryPlan(step=4, moves=((2, 1),))


def test_a_copy_caught_mid_exchange_falls_back_to_the_previous_step():
    # Rank 2 died before receiving rank 1's step-4 copy: step 2 is the newest complete one.
    invs = inventories(inv([2, 4], [(2, 2), (4, 2)]), inv(), inv([2, 4], [(2, 1)]))
    assert plan_recovery(invs, 3) == RecoveryPlan(step=2, moves=((2, 1),))


def test_both_copies_gone_means_storage():
    invs = inventories(inv([2, 4], [(2, 2), (4, 2)]), inv(), inv())
    assert plan_recovery(invs, 3) is None


def test_snapshots_of_another_world_size_do_not_count():
    invs = inventories(inv([4], world=4), inv([4], world=4), inv([4], world=4))
    assert plan_recovery(invs, 3) is None
