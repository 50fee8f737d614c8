"""Time to resume of the reference EP serving loop after a killed rank, beside the prediction.

    .venv/bin/python benchmarks/serve_recovery.py            # 3 ranks, 3 faulted runs
    .venv/bin/python benchmarks/serve_recovery.py --runs 1   # quick look

What runs: ``trainpilot.runtime.serve.loop.run_serving`` on tiny-moe (4 layers, 4 experts
top-2, dealt round-robin), 3 gloo ranks decoding 12 seeded requests greedily, DP attention and
expert parallelism; first fault-free (its tokens must equal the one-process reference), then
``--runs`` times with rank 1 killed (SIGKILL) at step 4. Measured per faulted run, from the
kill: detection (the survivors' collective raises), membership (the launcher publishes the
survivors), regroup (new ProcessGroupGloo), expert reload (the dead rank's experts adopted from
the peer copy) and the first completed pass after recovery (the re-prefill of the retried
requests plus everyone's decode row): time to resume. Requests lost and token equality with the
fault-free run are checked.

Prediction: the serving simulator's remedy ("token-level retry with expert migration", the
model of ``sim/serve_availability.py``) fed the component costs: its outage is detection +
membership + regroup + reload (measured in this run: the simulator does not know gloo's
failure latency), then the resume pass predicted from the fault-free run's own passes (a
least-squares fit of pass seconds against rows, applied to the resume pass's rows). Requests
lost predicted: 0 (the remedy retries in-flight requests); retried: the dead rank's unfinished
requests. Writes benchmarks/results/serve_recovery.txt.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

from trainpilot.fsio import atomic_write_text
from trainpilot.runtime.serve.loop import ServeConfig, reference_tokens, run_serving
from trainpilot.sim.serve_availability import Remedy

RESULTS = Path(__file__).resolve().parent / "results" / "serve_recovery.txt"


def pass_model(passes: list[tuple[int, float]]) -> tuple[float, float]:
    """(seconds per pass, seconds per row) fitted to fault-free passes."""
    rows = np.array([r for r, _ in passes], dtype=float)
    secs = np.array([s for _, s in passes])
    slope, intercept = np.polyfit(rows, secs, 1)
    return float(intercept), float(slope)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--kill-step", type=int, default=4)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    base = ServeConfig(world_size=args.world_size, num_requests=12)
    ref = reference_tokens(base)
    clean = run_serving(base)
    assert clean.results == ref, "the fault-free run differs from the one-process reference"
    intercept, per_row = pass_model([p for r in clean.passes.values() for p in r])
    lines = [
        f"EP serving recovery: tiny-moe, {args.world_size} gloo ranks, 12 requests, rank 1 "
        f"killed at step {args.kill_step}",
        f"machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        f"fault-free: {len(clean.results)} requests, tokens equal to the one-process reference: "
        f"yes; pass time {intercept * 1e3:.1f} ms + {per_row * 1e3:.2f} ms per row "
        f"(fit on {sum(len(p) for p in clean.passes.values())} passes)",
        "",
        f"{'run':>3} {'fired':>5} {'lost':>4} {'retried':>7} {'equal':>5} {'detect s':>8} "
        f"{'members s':>9} {'regroup s':>9} {'reload s':>8} {'resume s':>8} "
        f"{'predicted s':>11} {'error':>6}",
    ]
    print("\n".join(lines), flush=True)
    errors, measured = [], []
    for i in range(args.runs):
        cfg = ServeConfig(world_size=args.world_size, num_requests=12,
                          kill=(1, args.kill_step), seed=0)
        run = run_serving(cfg)
        survivors = [r for r in run.phases if "resumed_at" in run.phases[r]]
        t0 = run.fault_time
        ph = {k: max(run.phases[r][k] for r in survivors) for k in
              ("detected_at", "members_at", "regrouped_at", "resumed_at", "reload_s",
               "resume_pass_rows")}
        resume = ph["resumed_at"] - t0
        outage = Remedy(name="token-level retry + expert migration (measured costs)",
                        down_s=ph["regrouped_at"] - t0 + ph["reload_s"], requests="retried")
        predicted = outage.down_s + intercept + per_row * ph["resume_pass_rows"]
        err = (predicted - resume) / resume
        errors.append(err)
        measured.append(resume)
        retried = sum(run.phases[r].get("retried_requests", 0) for r in survivors)
        line = (f"{i:3d} {'yes' if run.exit_codes[1] == -9 else 'NO':>5} {len(run.lost):4d} "
                f"{retried:7d} {'yes' if run.results == ref else 'NO':>5} "
                f"{ph['detected_at'] - t0:8.3f} {ph['members_at'] - ph['detected_at']:9.3f} "
                f"{ph['regrouped_at'] - ph['members_at']:9.3f} {ph['reload_s']:8.4f} "
                f"{resume:8.3f} {predicted:11.3f} {err:+6.1%}")
        print(line, flush=True)
        lines.append(line)
    summary = (f"time to resume: median {statistics.median(measured):.3f} s measured; "
               f"prediction error mean {statistics.mean(abs(e) for e in errors):.1%}; requests "
               "lost predicted 0 (token-level retry)")
    print(summary)
    lines += ["", summary]
    if not args.no_write:
        atomic_write_text(RESULTS, "\n".join(lines) + "\n")
        print(f"written to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
