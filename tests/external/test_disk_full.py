"""A disk that fills up under a running job (a tmpfs made for the test, filled by another
process): training goes on, the run store and metrics file buffer and catch up, checkpoints
stay in host memory and a peer's, every warning names the disk; once space is back the run
ends bit-identical to the uninterrupted one, with every step in its store."""

from __future__ import annotations

import pytest

from tests.external.conftest import STEPS2
from tests.external.harness import (
    assert_same_run,
    events,
    job,
    losses,
    tmpfs,
    train_args,
)

pytestmark = [pytest.mark.dist, pytest.mark.external]


@pytest.fixture
def small_disk(tmp_path):
    with tmpfs(tmp_path / "disk", "size=64m", "a tmpfs (needs root)") as mount:
        yield mount


def _fill(path) -> int:
    """Fill the disk to its last byte: 1 MiB writes, then 4 KiB, then single bytes, each until
    the disk refuses one. (Stopping at the first refused MiB left up to a MiB free, room for the
    run store's small writes, so whether the store ever met the full disk depended on what the
    job wrote meanwhile.)"""
    written = 0
    with open(path, "wb", buffering=0) as handle:
        for size in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    written += handle.write(b"\0" * size)
            except OSError:
                continue
    return written


@pytest.mark.timeout(300)
def test_a_disk_filling_up_degrades_and_recovers_bit_exact(ref2, small_disk, tmp_path):
    run = small_disk / "run"
    with job(train_args(run, steps=STEPS2), out=tmp_path / "out.txt") as j:
        j.wait_step(4)
        filler = small_disk / "filler"
        assert _fill(filler) > 0
        j.wait_step(9)  # several checkpoints and store flushes meet the full disk
        filler.unlink()
        assert j.wait() == 0, j.output()[-3000:]
        out = j.output()
    assert f"disk full: {small_disk}" in out  # the warning names the disk
    assert "kept in host memory and a peer's only" in out
    assert_same_run(run, ref2, step=STEPS2)
    assert sorted(losses(run)) == list(range(1, STEPS2 + 1))  # the store caught up
    failed = [e.payload for e in events(run, ["checkpoint_failed"])]
    assert failed and all(f["errno"] == 28 for f in failed)  # the fault did fire
    assert events(run, ["disk_full"])
