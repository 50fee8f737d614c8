"""The B200 efficiency data before and after it was derived from measured tables (2026-12-06), on
every held-out B200 row: the rows read while it was chosen (batches 2-3) and the batch collected
blind to test it (batch 5).

    .venv/bin/python benchmarks/b200_data_before_after.py

"Before" is the b200 entry of perf/data/efficiency.yaml until commit 872855b (vendor-level GEMM
points, the Hopper FP8 share), passed to the validation runner as the B200 curve; "after" is the
shipped data (perf/gemm_table.py). Writes benchmarks/results/b200_data_before_after.txt.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainpilot.fsio import atomic_write_text  # noqa: E402
from trainpilot.perf.hardware import load_curves  # noqa: E402
from trainpilot.perf.validation.cases import source_cases  # noqa: E402
from trainpilot.perf.validation.runner import run  # noqa: E402

BEFORE_POINTS = ((7.0, 0.01), (8.0, 0.03), (9.0, 0.12), (10.0, 0.35), (11.0, 0.58),
                 (12.0, 0.70), (13.0, 0.74))


def main() -> int:
    after = load_curves()["b200"]
    before = after.replace(gemm_points=BEFORE_POINTS, fp8_gemm_share=None)
    cases = [c for c in source_cases() if c.cluster.device.name == "b200"]
    groups = {
        "batch 5 (blind test of the change), dense": lambda c: c.batch == 5,
        "read while choosing it, dense, outside torchao": lambda c: (
            c.batch < 5 and c.kind == "dense" and not c.dataset.startswith("torchao")),
        "read while choosing it, MoE, outside torchao": lambda c: (
            c.batch < 5 and c.kind == "moe" and not c.dataset.startswith("torchao")),
        "torchao's rows (dense and MoE)": lambda c: c.dataset.startswith("torchao"),
    }
    results = {"before": run(cases, curve=before), "after": run(cases)}
    lines = ["held-out B200 rows: mean |error| (speed bias) with the B200 data before and after "
             "it was derived from measured tables", "",
             f"{'rows':<48} {'n':>3} {'before':>17} {'after':>17}"]
    for name, keep in groups.items():
        cells = []
        for key in ("before", "after"):
            rows = [r for r in results[key] if keep(r.case) and r.predicted is not None]
            mean = sum(abs(r.error) for r in rows) / len(rows)
            bias = sum(r.speed_error for r in rows) / len(rows)
            cells.append(f"{mean:6.1%} ({bias:+6.1%})")
        lines.append(f"{name:<48} {len(rows):>3} {cells[0]:>17} {cells[1]:>17}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    atomic_write_text(REPO / "benchmarks" / "results" / "b200_data_before_after.txt", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
