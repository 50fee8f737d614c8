"""The held-out validation before issue 14's physics changes, recorded for before/after tables.

Run at the commit that added it (the new sources and runner, the cost model still as of 9b89b7d; see
benchmarks/results/validation_before.txt for its output):

    .venv/bin/python benchmarks/validation_before.py > benchmarks/results/validation_before.txt

The old documents had no MoE parallel folding: a row whose EP does not divide dp x cp was
refused by the old Plan (``ep must divide dp * cp``) and is reported as refused here; every
other row is costed by the old model (which ignored ``etp`` and the runtime profile except
flash attention, dropout and the gradient-reduction dtype). At later commits this script runs
the current model with the same refusal rule, which is not what it is for.
"""

from __future__ import annotations

import subprocess

from trainpilot.perf.validation import HELD_OUT, POOLED, SOURCE_MEAN, run, source_cases
from trainpilot.perf.validation.runner import Result, summarize


def main() -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    cases = source_cases()
    old_refuses = [(c.plan.dp * c.plan.cp) % c.plan.ep != 0 for c in cases]
    results = []
    for case, refused in zip(cases, old_refuses):
        if refused:
            results.append(Result(case, None, refused="old Plan: ep must divide dp * cp"))
        else:
            results.extend(run([case]))
    print(f"# held-out validation at commit {commit} (cost model of 9b89b7d)")
    print(f"# {'source':26s} {'kind':6s} {'rows':>5s} {'refused':>8s} {'mean':>7s} "
          f"{'max':>7s} {'bias':>7s}")
    for s in summarize(results):
        if s.split != HELD_OUT:
            continue
        name = s.dataset if s.dataset not in (POOLED, SOURCE_MEAN) else s.dataset.upper()
        print(f"  {name:26s} {s.model_kind:6s} {s.count:5d} {s.refused:8d} {s.mape:7.1%} "
              f"{s.max_ape:7.1%} {s.bias:+7.1%}")
    print("# rows")
    for r in results:
        pred = "refused" if r.predicted is None else f"{r.predicted:10.4g}"
        err = "" if r.predicted is None else f"{r.error:+7.1%}"
        print(f"  {r.case.dataset:22s} {r.case.label:48s} {r.case.measured:10.4g} {pred:>10s} "
              f"{err}")


if __name__ == "__main__":
    main()
