"""A distributed sampler whose position is training state.

Every rank computes the same global order; a step takes the next ``global_batch`` indices of it
and each data-parallel rank keeps its contiguous share. The state is only (seed, epoch, position
in the epoch), independent of the world size, so a job restored with more or fewer ranks
continues exactly where it stopped: every sample is seen once per epoch, no duplicates, no holes.

The per-epoch shuffle is a keyed Feistel permutation with cycle walking: O(1) memory whatever the
dataset size (no index array of billions of entries), and any position is computable directly.
The order is evaluated a window of ``WINDOW`` positions at a time (numpy's per-call cost, not
the arithmetic, dominates at a step's few dozen indices: 1.4 ms for 16 indices, about the same
for 4096), so a step's indices are a slice of the cached window.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainpilot.specs.errors import SpecError

_U64 = np.uint64
_MASK64 = (1 << 64) - 1
WINDOW = 4096  # positions of the order evaluated at once (32 KiB of int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-distributed 64-bit hash (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


class FeistelPermutation:
    """A pseudo-random bijection of ``[0, n)`` keyed by ``key`` (4-round Feistel network on the
    smallest even-width power of two >= n, cycle-walking back into range)."""

    def __init__(self, n: int, key: int, *, rounds: int = 4):
        if n < 1:
            raise ValueError("n must be positive")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = _U64((1 << self.half) - 1)
        seeds = np.arange(rounds, dtype=np.uint64) + _U64(key & _MASK64)
        self.keys = _mix(_mix(seeds))

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> _U64(self.half), x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << _U64(self.half)) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The permuted index of each position (int64 array in, int64 array out)."""
        x = np.asarray(positions, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError("position out of range")
        y = self._encrypt(x)
        outside = y >= _U64(self.n)
        while outside.any():  # at most a 4x larger domain: a few rounds on average
            y[outside] = self._encrypt(y[outside])
            outside = y >= _U64(self.n)
        return y.astype(np.int64)


class ResumableSampler:
    """Global sample order over epochs; ``next_indices`` advances, ``state_dict`` saves it."""

    def __init__(self, num_samples: int, *, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise SpecError("num_samples", num_samples, "valid: >= 1")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch = 0
        self.position = 0  # samples of this epoch already handed out
        # (epoch, first position, indices of positions first .. first + len - 1)
        self._window: tuple[int, int, np.ndarray] = (-1, 0, np.zeros(0, dtype=np.int64))

    def _order(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        if not self.shuffle:
            return positions.astype(np.int64)
        return FeistelPermutation(self.num_samples, key=self.seed * 1_000_003 + epoch)(positions)

    def _take(self, epoch: int, start: int, count: int) -> np.ndarray:
        """Indices of positions ``start .. start + count - 1`` of ``epoch``'s order, from the
        cached window (evaluated afresh, ``max(count, WINDOW)`` positions, when it misses)."""
        w_epoch, w_start, w_values = self._window
        if not (w_epoch == epoch and w_start <= start
                and start + count <= w_start + len(w_values)):
            stop = min(self.num_samples, start + max(count, WINDOW))
            w_epoch, w_start = epoch, start
            w_values = self._order(epoch, np.arange(start, stop))
            self._window = (w_epoch, w_start, w_values)
        return w_values[start - w_start:start - w_start + count].copy()

    def next_indices(self, count: int) -> np.ndarray:
        """The next ``count`` global sample indices (crossing into the next epoch if needed)."""
        out = []
        while count > 0:
            take = min(count, self.num_samples - self.position)
            out.append(self._take(self.epoch, self.position, take))
            self.position += take
            count -= take
            if self.position == self.num_samples:
                self.epoch, self.position = self.epoch + 1, 0
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    @staticmethod
    def shard(indices: np.ndarray, dp_rank: int, dp_size: int) -> np.ndarray:
        """This data-parallel rank's contiguous share of a step's global indices."""
        if len(indices) % dp_size:
            raise SpecError("global_batch_size", len(indices), f"not a multiple of dp={dp_size}")
        per_rank = len(indices) // dp_size
        return indices[dp_rank * per_rank:(dp_rank + 1) * per_rank]

    def state_dict(self) -> dict[str, Any]:
        return dict(num_samples=self.num_samples, seed=self.seed, shuffle=self.shuffle,
                    epoch=self.epoch, position=self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position; the dataset and seed must be the ones it was saved with."""
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise SpecError(f"sampler.{key}", state[key],
                                f"checkpoint was taken with {key}={state[key]}, this run has "
                                f"{getattr(self, key)}; valid: the same dataset and seed")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
