"""Convergence forecast on loss curves of real text: accuracy and interval coverage on curves the
intervals were not calibrated on.

    .venv/bin/python benchmarks/forecast_coverage.py               # train the curves, score
    .venv/bin/python benchmarks/forecast_coverage.py --from-curves # re-score the saved curves
    .venv/bin/python benchmarks/forecast_coverage.py --from-curves --calibrate
        # refit the interval table (src/trainpilot/health/data/forecast_calibration.json) from
        # the calibration curves only, then score the test curves

Curves: byte-level GPTs (``trainpilot.runtime.models``, vocabulary 256) trained in one process,
one thread, on the Python standard library's own ``.py`` sources (real text present on every
machine: files sorted by path, concatenated, the first 8 MB; each batch is 8 windows of 65 bytes
at random offsets, the same sequence for every run: the stream is stationary, and 500 steps read
0.26 MB of the 8 MB, so the training loss is close to a held-out loss. A first version read the
text in file order: the loss then followed which file was being read, not learning, and no
forecast can be judged on that). 12 runs: 2 sizes x 2 peak
learning rates x 3 schedules (warm-up + cosine to 10 %, warm-up + constant, warm-up + linear
decay to 0), AdamW (0.9, 0.95), 500 steps. Split by run index: even runs calibrate the
intervals, odd runs are the test set (they never touch the table).

Scoring, as issue 17 asks: at 25 / 50 / 75 % of each run the forecaster sees the curve so far and
predicts the loss at the last step; truth = the mean loss of the last 2 % of steps. Reported per
split and model (plain: no schedule; schedule-aware: ``lr_at`` given, as ``trainpilot train``
gives it): median and max relative error, and the share of runs whose 80 % interval covered the
truth (nominal 80 %). Targets: coverage within 10 points of nominal and median error <= 5 % at
half the run, on the test curves.

Writes benchmarks/results/forecast_coverage.txt and forecast_text_curves.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainpilot.fsio import atomic_write_text  # noqa: E402
from trainpilot.health import forecast as fc_mod  # noqa: E402
from trainpilot.health.forecast import ConvergenceForecaster  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SIZES = [dict(name="2L-d64", num_hidden_layers=2, hidden_size=64, intermediate_size=192),
         dict(name="3L-d96", num_hidden_layers=3, hidden_size=96, intermediate_size=288)]
LRS = (1e-3, 3e-3)
SCHEDULES = ("cosine", "constant", "linear")
STEPS, SEQ, BATCH, WARMUP = 500, 64, 8, 25
FRACTIONS = (0.25, 0.5, 0.75)
NOMINAL = 0.8


def runs() -> list[dict]:
    out = []
    for size in SIZES:
        for lr in LRS:
            for schedule in SCHEDULES:
                out.append(dict(size=size, lr=lr, schedule=schedule,
                                name=f"{size['name']}-lr{lr:g}-{schedule}"))
    return out


def multiplier(schedule: str, total: int):
    """LR multiplier at 0-based step ``i`` (LambdaLR's convention)."""
    def mult(i: int) -> float:
        if i < WARMUP:
            return (i + 1) / WARMUP
        progress = min(1.0, (i - WARMUP) / max(1, total - WARMUP))
        if schedule == "cosine":
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        return 1.0
    return mult


def stdlib_bytes(limit: int) -> np.ndarray:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


def train_curve(run: dict, text: np.ndarray, steps: int = STEPS) -> list[float]:
    import torch
    import torch.nn.functional as F

    from trainpilot.runtime.models import build_gpt, init_parameters
    from trainpilot.specs import load_model

    torch.set_num_threads(1)
    size = run["size"]
    spec = load_model("tiny-gpt").replace(
        **{k: v for k, v in size.items() if k != "name"}, vocab_size=256, name=size["name"])
    model = build_gpt(spec, max_seq_len=SEQ)
    model.to_empty(device="cpu")
    model.init_buffers()
    init_parameters(model, spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=run["lr"], betas=(0.9, 0.95),
                            weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, multiplier(run["schedule"], steps))
    window = SEQ + 1
    offsets = np.random.default_rng(1234).integers(0, len(text) - window, size=(steps, BATCH))
    losses = []
    for step in range(steps):
        block = torch.from_numpy(np.stack([text[o:o + window] for o in offsets[step]])
                                 .astype(np.int64))
        x, y = block[:, :-1], block[:, 1:]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def forecasts(run: dict, losses: list[float], *, calibration=None) -> list[dict]:
    """At each fraction: plain and schedule-aware forecasts of the last step's loss."""
    total = len(losses)
    steps = np.arange(1, total + 1)
    truth = float(np.mean(losses[-max(2, total // 50):]))
    mult = multiplier(run["schedule"], total)
    rows = []
    for frac in FRACTIONS:
        n = int(frac * total)
        for kind, lr_at in (("plain", None), ("schedule", lambda s: run["lr"] * mult(s - 1))):
            f = ConvergenceForecaster(total_steps=total, lr_at=lr_at, calibration=calibration)
            out = f.forecast(steps[:n], losses[:n])
            rows.append(dict(run=run["name"], frac=frac, kind=kind, model=out.model,
                             pred=out.final_loss, lo=out.final_lo, hi=out.final_hi, truth=truth,
                             rel_err=abs(out.final_loss - truth) / truth,
                             log_ratio=math.log(truth / out.final_loss),
                             covered=out.final_lo <= truth <= out.final_hi,
                             reliable=out.reliable))
    return rows


def calibrate(rows: list[dict]) -> dict:
    """Per model kind and fraction seen: the 10th and 90th percentiles of log(truth / point
    forecast) on the calibration runs (the interval then is point * exp([q10, q90]))."""
    table: dict = {"nominal": NOMINAL, "source": "benchmarks/forecast_coverage.py --calibrate: "
                   "even-numbered runs (byte-level GPTs on the Python standard library)",
                   "kinds": {}}
    lo_q, hi_q = 50 * (1 - NOMINAL), 50 * (1 + NOMINAL)
    for kind in ("plain", "schedule"):
        entries = []
        for frac in FRACTIONS:
            r = [x["log_ratio"] for x in rows if x["kind"] == kind and x["frac"] == frac]
            entries.append(dict(fraction=frac, q_lo=float(np.percentile(r, lo_q)),
                                q_hi=float(np.percentile(r, hi_q)), num_runs=len(r)))
        table["kinds"][kind] = entries
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-curves", action="store_true")
    parser.add_argument("--calibrate", action="store_true",
                        help="refit the shipped interval table from the calibration runs")
    args = parser.parse_args()
    curves_path = RESULTS / "forecast_text_curves.json"
    all_runs = runs()
    if args.from_curves:
        curves = json.loads(curves_path.read_text())
    else:
        text = stdlib_bytes(8 << 20)
        curves = {}
        for run in all_runs:
            start = time.perf_counter()
            curves[run["name"]] = train_curve(run, text)
            print(f"trained {run['name']} in {time.perf_counter() - start:.0f} s",
                  file=sys.stderr)
        atomic_write_text(curves_path, json.dumps(curves))
    calib_runs = [r for i, r in enumerate(all_runs) if i % 2 == 0]
    test_runs = [r for i, r in enumerate(all_runs) if i % 2 == 1]
    if args.calibrate:
        raw = [row for r in calib_runs for row in forecasts(r, curves[r["name"]],
                                                            calibration=False)]
        atomic_write_text(fc_mod.CALIBRATION_PATH, json.dumps(calibrate(raw), indent=2) + "\n")
        fc_mod.load_calibration.cache_clear()
    lines = ["convergence forecast on byte-level GPTs trained on the Python standard library",
             f"{len(all_runs)} runs x {STEPS} steps ({', '.join(SCHEDULES)} schedules); "
             f"calibration runs: {len(calib_runs)} (even), test runs: {len(test_runs)} (odd)",
             f"python {platform.python_version()}, {os.cpu_count()} cores", "",
             f"{'split':<12} {'seen':>5} {'model':<9} {'median err':>10} {'max err':>8} "
             f"{'80% covered':>12}"]
    ok = True
    for split, chosen in (("calibration", calib_runs), ("test", test_runs)):
        rows = [row for r in chosen for row in forecasts(r, curves[r["name"]])]
        for frac in FRACTIONS:
            for kind in ("plain", "schedule"):
                sel = [x for x in rows if x["frac"] == frac and x["kind"] == kind]
                errs = [x["rel_err"] for x in sel]
                cov = sum(x["covered"] for x in sel) / len(sel)
                lines.append(f"{split:<12} {100 * frac:>4.0f}% {kind:<9} "
                             f"{100 * statistics.median(errs):>9.2f}% {100 * max(errs):>7.2f}% "
                             f"{100 * cov:>5.0f}% of {len(sel)}")
        if split == "test":
            pooled = [x for x in rows if x["kind"] == "schedule"]
            coverage = sum(x["covered"] for x in pooled) / len(pooled)
            half = [x["rel_err"] for x in pooled if x["frac"] == 0.5]
            ok = abs(coverage - NOMINAL) <= 0.10 and statistics.median(half) <= 0.05
            lines += ["", f"test runs, schedule-aware (what trainpilot train uses), all "
                          f"fractions pooled: 80% interval covered {100 * coverage:.0f}% of "
                          f"{len(pooled)} forecasts; median error at 50%: "
                          f"{100 * statistics.median(half):.2f}%"]
    lines.append(f"targets: coverage within 10 points of 80% and median error <= 5% at half the "
                 f"run, on the test runs: {'met' if ok else 'MISSED'}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    atomic_write_text(RESULTS / "forecast_coverage.txt", text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
