"""Fixtures of the UI tests: a store written row by row (known values, instant), a store from a
short real 2-rank training run (session-wide), and headless Chromium (session-wide)."""

from __future__ import annotations

import math
import time

import pytest

from tests.ui import helpers
from trainpilot.store import RankTiming, RunStore

NUM_STEPS = 30
STEP_S, STEP_1_S, STALL_S = 0.005, 0.025, 0.002


def write_known_store(run_dir, *, status: str = "completed", with_fault: bool = True):
    """A run with known rows: 30 steps (step_time 5 ms, step 1: 25 ms), 2 ranks with rank 1
    1.5x slower, per-layer norms, a NaN loss at step 7, checkpoints with stalls, a fault at
    step 20 and a restart resuming from step 15, an alert whose message holds markup."""
    store = RunStore.create(run_dir, name="known", world_size=2, flush_every_steps=1000)
    store.set_document("plan", {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 4,
                                "global_batch_size": 8, "seq_len": 64})
    for step in range(1, NUM_STEPS + 1):
        loss = math.nan if step == 7 else 4.0 / math.sqrt(step)
        step_s = STEP_1_S if step == 1 else STEP_S
        store.log_metrics(step, {"loss": loss, "lr": 1e-3 * min(1.0, step / 5),
                                 "step_time_s": step_s, "tokens_per_s": 512 / step_s,
                                 "grad_norm/blocks.10.mlp": 0.01 * step,
                                 "grad_norm/blocks.9.mlp": 0.02 * step,
                                 "grad_norm/embed": 1e-3, "health/score": 80.0 + step % 3,
                                 "skipped_update": 1.0 if step == 12 else 0.0})
        store.log_rank_timings([RankTiming(step=step, rank=0, step_s=step_s, compute_s=0.04,
                                           comm_s=0.05),
                                RankTiming(step=step, rank=1, step_s=step_s, compute_s=0.06,
                                           comm_s=0.03)])
        if step in (10, 15, 25):
            store.log_event("checkpoint", step, {"step": step, "stall_s": STALL_S})
    store.flush()
    if with_fault:
        store.log_event("fault", 20, {}, severity="critical", name="rank_crash",
                        message="rank 1 exited with SIGKILL")
        store.log_event("restart", 20, {"restored_step": 15}, message="restarted")
    store.log_event("alert", 7, {"loss": math.nan}, severity="critical", name="non_finite",
                    message="non-finite loss <script>alert(1)</script>")
    time.sleep(0.3)  # wall time covers the (short) step times written above, as in a real run
    store.close(status=status)
    return run_dir


@pytest.fixture
def known_run(tmp_path):
    return write_known_store(tmp_path / "known")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """A store from a real 2-rank gloo run (torchrun): rank 1 is slowed (a straggler), step 40's
    loss is spiked (an alert and a skipped batch), checkpoints every 25 steps."""
    return helpers.train(tmp_path_factory.mktemp("runs") / "ddp", steps=60)


@pytest.fixture(scope="session")
def browser(tmp_path_factory):
    from trainpilot.ui.browser import find_chromium

    if find_chromium() is None or helpers.chromedriver_path() is None:
        pytest.skip(helpers.NO_BROWSER)
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    driver = helpers.make_driver(tmp_path_factory.mktemp("chromium-profile"))
    yield driver
    driver.quit()
