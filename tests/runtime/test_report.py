"""The train summary's rows for a command that trained nothing: CI once sent the launcher its
SIGTERM after the last step (12 of 12 saved as a preemption), so the rerun resumed at step 12,
ran no step, and `trainpilot train` ended in a KeyError traceback printing the losses."""

from __future__ import annotations

from trainpilot.runtime.report import summary_rows
from trainpilot.runtime.trainer import summarize


def test_a_run_resumed_at_its_last_step_has_a_summary_without_losses():
    summary = dict(summarize([], None), layout=dict(world_size=2, backend="gloo",
                                                    mesh=dict(dp=2)), autocast="off")
    rows = dict(summary_rows(summary))
    assert rows["steps"].startswith("none trained by this command")
    assert "loss first → last" not in rows and rows["layout"] == "2 ranks on gloo (dp=2)"
    # The rank adds the run's first loss from the run store (app/rank.py, _whole_run) even when
    # this command trained nothing: CI hit that KeyError again on 2026-12-06.
    rows = dict(summary_rows(dict(summary, first_loss=5.93)))
    assert rows["steps"].startswith("none trained by this command")
    # Negative control: a command that trained has both losses and prints them.
    trained = dict(summary, first_loss=5.93, last_loss=5.27, steps=12, median_step_time_s=0.1,
                   median_tokens_per_s=6800.0, median_data_wait_s=0.001)
    assert dict(summary_rows(trained))["loss first → last"] == "5.9300 → 5.2700"
