"""The sampler: a true permutation per epoch, and exactly-once coverage across restarts with a
different world size (2 -> 1 -> 2 ranks), with a negative control."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from trainpilot.runtime.sampler import FeistelPermutation, ResumableSampler


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_feistel_is_a_permutation(n):
    out = FeistelPermutation(n, key=11)(np.arange(n))
    assert sorted(out.tolist()) == list(range(n))


def test_feistel_shuffles_and_depends_on_key():
    a = FeistelPermutation(1000, key=1)(np.arange(1000))
    b = FeistelPermutation(1000, key=2)(np.arange(1000))
    assert not np.array_equal(a, np.arange(1000)) and not np.array_equal(a, b)
    huge = FeistelPermutation(10**12, key=5)(np.arange(10))  # O(1) memory at any size
    assert len(set(huge.tolist())) == 10 and huge.max() < 10**12


def run_ranks(state: dict | None, world: int, steps: int, global_batch: int) -> tuple[list, dict]:
    """Each rank builds its own sampler, restores ``state``, takes its share per step."""
    seen, states = [], []
    for rank in range(world):
        sampler = ResumableSampler(96, seed=3)
        if state is not None:
            sampler.load_state_dict(state)
        for _ in range(steps):
            seen += ResumableSampler.shard(sampler.next_indices(global_batch), rank, world).tolist()
        states.append(sampler.state_dict())
    assert all(s == states[0] for s in states)  # every rank agrees on the position
    return seen, states[0]


def test_every_sample_once_across_2_1_2_world_sizes():
    seen, state = run_ranks(None, world=2, steps=3, global_batch=8)  # 24 samples
    more, state = run_ranks(state, world=1, steps=5, global_batch=8)  # 40
    rest, state = run_ranks(state, world=2, steps=4, global_batch=8)  # 32 -> epoch done
    counts = Counter(seen + more + rest)
    assert sorted(counts) == list(range(96)) and set(counts.values()) == {1}
    assert state["epoch"] == 1 and state["position"] == 0


def test_negative_control_restart_without_position_repeats_samples():
    seen, _ = run_ranks(None, world=2, steps=3, global_batch=8)
    again, _ = run_ranks(None, world=1, steps=3, global_batch=8)  # position not restored
    assert Counter(seen + again).most_common(1)[0][1] == 2


def test_epochs_cross_and_reshuffle():
    sampler = ResumableSampler(10, seed=0)
    first = sampler.next_indices(10)
    second = sampler.next_indices(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert not np.array_equal(first, second)
    straddle = ResumableSampler(10, seed=0)
    straddle.next_indices(7)
    both = straddle.next_indices(6)  # 3 from epoch 0, 3 from epoch 1
    assert both[:3].tolist() == first[7:].tolist() and both[3:].tolist() == second[:3].tolist()


def test_windowed_order_equals_the_direct_permutation():
    """Steps are served from a cached window of the order (sampler.WINDOW positions): the
    indices must be the permutation's own, across window edges, an epoch edge and a restore
    to a position whose epoch is not the one the window holds."""
    from trainpilot.runtime import sampler as sampler_mod

    n = 2 * sampler_mod.WINDOW + 123
    sampler = ResumableSampler(n, seed=7)
    drawn = np.concatenate([sampler.next_indices(37) for _ in range(2 * n // 37 + 1)])
    expect = np.concatenate([FeistelPermutation(n, key=7 * 1_000_003 + e)(np.arange(n))
                             for e in range(3)])
    assert np.array_equal(drawn, expect[:len(drawn)])
    state = dict(sampler.state_dict(), epoch=1, position=sampler_mod.WINDOW - 5)
    sampler.load_state_dict(state)  # its window holds epoch 2: must not be reused
    got = sampler.next_indices(10)
    assert np.array_equal(got, expect[n + sampler_mod.WINDOW - 5:n + sampler_mod.WINDOW + 5])


def test_restore_refuses_another_dataset():
    from trainpilot.specs import SpecError

    state = ResumableSampler(10, seed=0).state_dict()
    with pytest.raises(SpecError, match="num_samples"):
        ResumableSampler(11, seed=0).load_state_dict(state)
