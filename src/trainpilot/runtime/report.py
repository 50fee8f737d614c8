"""Human-readable rows of a run's summary, shared by ``trainpilot train`` and the demo."""

from __future__ import annotations

from typing import Any


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, value) rows: layout, losses against the corpus floor, speed, calibration and the
    predicted vs measured step time."""
    layout = summary.get("layout", {})
    mesh = " ".join(f"{k}={v}" for k, v in layout.get("mesh", {}).items())
    rows = [("layout", f"{layout.get('world_size')} ranks on {layout.get('backend')} ({mesh})"),
            ("autocast", str(summary.get("autocast", "")))]
    if "last_loss" not in summary:
        # Resumed from a checkpoint at the last step (a stop signal that came after it): no
        # step ran, so there are no losses or timings to report (the run's first loss, which
        # the rank reads back from the run store, may still be there).
        return [*rows, ("steps", "none trained by this command: the run had already reached "
                                 "its last step")]
    rows += [("steps", str(summary.get("steps"))),
             ("loss first → last", f"{summary['first_loss']:.4f} → {summary['last_loss']:.4f}")]
    data = summary.get("data") or {}
    if "entropy_rate_nats" in data:
        rows.append(("loss floor (corpus entropy rate)",
                     f"{data['entropy_rate_nats']:.4f} (uniform guess: "
                     f"{data['uniform_loss_nats']:.4f})"))
    rows += [("median step time", f"{summary['median_step_time_s'] * 1e3:.1f} ms"),
             ("median tokens/s", f"{summary['median_tokens_per_s']:,.0f}"),
             ("median data wait", f"{summary['median_data_wait_s'] * 1e3:.2f} ms")]
    cal = summary.get("calibration")
    if cal:
        link = (f"; all-reduce {cal['allreduce_latency_us']:.0f} µs, "
                f"{cal['allreduce_busbw_gbps']:.2f} GB/s bus" if cal.get("allreduce_busbw_gbps")
                else "")
        rows.append(("cpu calibrated at start",
                     f"matmul {cal['matmul_tflops'] * 1e3:.1f} GFLOP/s per rank{link}"))
    predicted = summary.get("predicted_step_time_s")
    if predicted:
        ratio = summary["median_step_time_s"] / predicted
        rows.append(("predicted step time (trainpilot.perf)",
                     f"{predicted * 1e3:.1f} ms; measured / predicted = {ratio:.2f}"))
    else:
        rows.append(("predicted step time", f"n/a ({summary.get('prediction_note')})"))
    return rows
