"""The held-out errors before and after the two calibrations were refitted by their own procedures
(2026-12-07), and with and without vLLM V0's host time per pass, in one run.

    .venv/bin/python benchmarks/calibration_refit_before_after.py

Training: "before" is the H100 and B200 data as shipped until the refit (the OpenXLA-table
curve at factor 0.763 instead of 0.7212, fused attention 0.685; the B200 curve derived from
0.763), copied below from commit fe56a22; "after" is the shipped data. Serving: "before" is serve_calibration.yaml until the refit
(prefill attention 0.4435, imbalance 1.6157, kernel gap 2.6393 us); "after" the shipped file;
each with the runtimes' host time per pass removed and as shipped. Batch 7 was scored once after
both changes; its "before" cells are shown for comparison only. Writes
benchmarks/results/calibration_refit_before_after.txt.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainpilot.fsio import atomic_write_text  # noqa: E402
from trainpilot.perf.hardware import curve_for, load_curves  # noqa: E402
from trainpilot.perf.validation.cases import HELD_OUT, source_cases  # noqa: E402
from trainpilot.perf.validation.runner import TIME_METRICS, run  # noqa: E402
from trainpilot.sim import serve_validation as sv  # noqa: E402

# perf/data/efficiency.yaml's h100 and b200 GEMM points until the refit (commit fe56a22).
OLD_H100_POINTS = ((7.0, 0.0013), (8.0, 0.01298), (8.5, 0.03435), (9.0, 0.09925),
                   (9.5, 0.22139), (10.0, 0.38171), (10.5, 0.51913), (11.0, 0.58784),
                   (11.5, 0.61838))
OLD_B200_POINTS = ((7.5, 0.0022), (8.0, 0.00658), (8.5, 0.0249), (9.0, 0.05241), (9.5, 0.1271),
                   (10.0, 0.2473), (10.5, 0.37786), (11.0, 0.43667), (11.5, 0.47776),
                   (12.5, 0.55499))
OLD_FUSED_ATTENTION = 0.685
OLD_SERVE = dict(prefill_attention_efficiency=0.4435, moe_imbalance=1.6157,
                 kernel_gap_us=2.6393)


def old_curves():
    """The h100 and b200 data as they were before the refit."""
    curves = load_curves()
    return (dataclasses.replace(curves["h100"], gemm_points=OLD_H100_POINTS,
                                fused_attention_efficiency=OLD_FUSED_ATTENTION),
            dataclasses.replace(curves["b200"], gemm_points=OLD_B200_POINTS))


def training_lines() -> list[str]:
    cases = [c for c in source_cases() if c.split == HELD_OUT and c.metric in TIME_METRICS]
    old_h100, old_b200 = old_curves()
    by_h100, by_b200 = run(cases, old_h100), run(cases, old_b200)
    before = [b2 if curve_for(r.case.cluster).name == "b200" else r
              for r, b2 in zip(by_h100, by_b200)]
    after = run(cases)
    lines = ["training, held-out time rows: mean |error|",
             f"{'rows':<10} {'n':>4} {'before':>8} {'after':>8}"]
    for kind in ("dense", "moe"):
        cells = []
        for results in (before, after):
            errs = [abs(r.error) for r in results
                    if r.case.kind == kind and r.predicted is not None]
            cells.append(statistics.mean(errs))
        lines.append(f"{kind:<10} {len(errs):>4} {cells[0]:>8.1%} {cells[1]:>8.1%}")
    return lines


def serving_lines() -> list[str]:
    shipped = sv.calibrated_efficiency()
    stale = shipped.replace(**OLD_SERVE)
    cases = sv.load_cases()
    no_host = [dataclasses.replace(c, plan=c.plan.replace(
        runtime=c.plan.runtime.replace(host_step_ms=0.0))) if c.split == "held_out" else c
        for c in cases]
    columns = {"stale, no host": (stale, no_host), "refit, no host": (shipped, no_host),
               "refit, host": (shipped, cases)}
    summaries = {k: sv.summarize(sv.run(eff, rows)) for k, (eff, rows) in columns.items()}
    batches = list(summaries["refit, host"]["held_out_batches"])
    lines = ["serving, held out: mean |error|",
             f"{'rows':<12} {'n':>4} " + " ".join(f"{k:>15}" for k in columns)]
    for b in batches:
        n = summaries["refit, host"]["held_out_batches"][b]["rows"]
        cells = " ".join(f"{summaries[k]['held_out_batches'][b]['mean_abs_error']:>15.1%}"
                         for k in columns)
        lines.append(f"{'batch ' + str(b):<12} {n:>4} {cells}")
    n = summaries["refit, host"]["held_out"]["rows"]
    cells = " ".join(f"{summaries[k]['held_out']['mean_abs_error']:>15.1%}" for k in columns)
    lines.append(f"{'all':<12} {n:>4} {cells}")
    return lines


def main() -> int:
    text = "\n".join(training_lines() + [""] + serving_lines()) + "\n"
    print(text, end="")
    atomic_write_text(REPO / "benchmarks" / "results" / "calibration_refit_before_after.txt",
                      text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
