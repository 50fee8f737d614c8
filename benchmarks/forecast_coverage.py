"""Convergence forecast on loss curves of real text: accuracy and interval coverage on curves the
model and its intervals never saw.

    .venv/bin/python benchmarks/forecast_coverage.py               # train missing curves, score
    .venv/bin/python benchmarks/forecast_coverage.py --from-curves # re-score the saved curves
    .venv/bin/python benchmarks/forecast_coverage.py --from-curves --calibrate
        # refit the interval table (src/trainpilot/health/data/forecast_calibration.json) from
        # the development curves only, then score the test curves

Curves: byte-level GPTs (``trainpilot.runtime.models``, vocabulary 256) trained in one process,
one thread, on the Python standard library's own ``.py`` sources (real text present on every
machine: files sorted by path, concatenated, the first 8 MB; each batch is 8 windows of 65 bytes
at random offsets: the stream is stationary, and 500 steps read 0.26 MB of the 8 MB, so the
training loss is close to a held-out loss. A first version read the text in file order: the loss
then followed which file was being read, not learning, and no forecast can be judged on that).
AdamW (0.9, 0.95), 500 steps, 25 warm-up steps.

Eighteen sets (``SETS``), apart by configuration, not only by seed:
- development, part 1 (12 runs, ``forecast_text_curves.json``): 2 sizes (2L-d64, 3L-d96) x
  peak LR (1e-3, 3e-3) x schedule (cosine to 10 %, constant, linear to 0), data order 1234,
  init seed 0. (Until 2026-12-01 its odd half was the test set; its misses were read.)
- development, part 2 (12 runs, ``forecast_text_curves_test.json``): 2L-d48, 4L-d128 x 6e-4,
  2e-3 x (cosine to 0, constant, warm-up-stable-decay: linear to 0 over the last 20 %), data
  order 4321, init seed 1. It was the test set of 2026-12-01 (scored once: 16 of 36 covered,
  7.3 % at half the run); seen since, so development now.
- development, part 3 (12 runs, ``forecast_text_curves_test2.json``): 3L-d80, 5L-d160 x
  1.5e-3, 4e-3 x (cosine to 10 %, linear to 0, warm-up-stable-decay), data order 777, init
  seed 2. The test set of 2026-12-01's second revision (scored once: 26 of 36 covered, 8.71 %
  at half the run); seen since, so development now.
  Every choice of the model (the law, when the annealing term may be fitted, BIC selection, the
  half of the curve that is fitted, the interval's form) and the interval table come from the
  development runs.
- development, part 4 (12 runs, ``forecast_text_curves_test3.json``): 3L-d64, 4L-d144 x
  8e-4, 2.5e-3 x (cosine to 10 %, cosine to 0, warm-up-stable-decay), data order 2468, init
  seed 3. The test set of 2026-12-02's first revision (the recent half fitted; scored once:
  3.59 % at half the run, met; 20 of 36 covered, missed: its runs sat +3 % where the
  development runs sat -2 %, and an interval from the pooled runs cannot see a shift between
  sets); seen since, so development now.
- development, part 5 (12 runs, ``forecast_text_curves_test4.json``): 2L-d96, 5L-d128 x
  1.2e-3, 3.5e-3 x (cosine to 10 %, linear to 0, warm-up-stable-decay), data order 1357, init
  seed 4. The test set of 2026-12-02's second revision (the random-effects interval, from 4
  sets; scored once: 5.43 % at half the run, 34 of 36 covered: both missed, narrowly); seen
  since, so development now.
- development, part 6 (12 runs, ``forecast_text_curves_test5.json``): 3L-d112, 4L-d80 x 9e-4,
  2.8e-3 x (cosine to 10 %, cosine to 0, warm-up-stable-decay), data order 8642, init seed 5.
  The test set of 2026-12-02's third revision (the table refitted from 5 sets; scored once
  against the last-steps truth: 2.11 % at half the run, 35 of 36 covered); seen since.
- development, part 7 (12 runs, ``forecast_text_curves_test6.json``): 4L-d112, 3L-d128 x
  1.1e-3, 3.2e-3 x (cosine to 10 %, linear to 0, warm-up-stable-decay), data order 9753, init
  seed 6. The test set of 2026-12-03's first revision (the held-out truth below; scored once:
  6.84 % at half the run, 28 of 36 covered); seen since.
- development, part 8 (12 runs, ``forecast_text_curves_test7.json``): 2L-d128, 5L-d96 x 7e-4,
  2.2e-3 x (cosine to 10 %, cosine to 0, warm-up-stable-decay), data order 3141, init seed 7.
  The test set of 2026-12-03's second revision (the LR term; scored once: 4.86 % at half the
  run, 36 of 36 covered); seen since.
- development, part 9 (12 runs, ``forecast_text_curves_test8.json``): 3L-d144, 4L-d96 x
  1.3e-3, 3.7e-3 x (cosine to 10 %, linear to 0, warm-up-stable-decay), data order 2718, init
  seed 8. The test set of 2026-12-03's third revision (the table refitted from 8 sets; scored
  once: 3.27 % at half the run, 21 of 36 covered); seen since.
- development, part 10 (12 runs, ``forecast_text_curves_test9.json``): 2L-d112, 4L-d64 x
  1.6e-3, 3.4e-3 x (cosine to 10 %, cosine to 0, warm-up-stable-decay), data order 1618, init
  seed 9. The test set of 2026-12-03's fourth revision (the table refitted from 9 sets; scored
  once: 11.61 % at half the run, 16 of 36 covered, both missed; every forecast at half the run
  too low); seen since.
- development, part 11 (12 runs, ``forecast_text_curves_test10.json``): 2L-d80, 5L-d112 x
  1.4e-3, 3.1e-3 x (cosine to 10 %, linear to 0, warm-up-stable-decay), data order 4242, init
  seed 10. The test set of 2026-12-06's first revision (the LR term, unchanged since set 8, the
  table refitted from 10 sets; scored once: 13.96 % at half the run, 17 of 36 covered, both
  missed; as in set 10 nearly every forecast at half the run had run its floor to zero and was
  12-16 % low); seen since.
- development, part 12 (12 runs, ``forecast_text_curves_test11.json``): 3L-d56, 4L-d120 x 9.5e-4, 2.6e-3 x
  (cosine to 10 %, cosine to 0, warm-up-stable-decay), data order 7070, init seed 11: sizes,
  peak LRs and seeds no development run has, the schedules by the sets' rotation. It tests the
  refit of a floor that runs to zero (``forecast.B_FLOOR_UNSEEN``, chosen on sets 1-11) with the
  interval table refitted from 11 sets by the same code. Its configuration was fixed on
  2026-12-06 before any of its runs was trained; trained and committed unscored; scored once on
  2026-12-06: 80 % interval covered 31 of 36 (86 %: met, within 10 points), median error at
  half the run 6.18 % (missed; the plain law 3.05 %; a quarter and three quarters of the run:
  3.00 % and 0.64 %); seen since.
- development, part 13 (12 runs, ``forecast_text_curves_test12.json``): 3L-d72, 5L-d144 x 1.25e-3, 3.3e-3 x
  (cosine to 10 %, linear to 0, warm-up-stable-decay), data order 5050, init seed 12: sizes,
  peak LRs and seeds no development run has, the schedules by the sets' rotation. Its
  configuration was fixed on 2026-12-06 (second session) before any of its runs was trained
  and before any change chosen on set 12. It tests the median of three fit windows
  (``forecast.SKIP_FRACS``, chosen on sets 1-12) with the table refitted from 12 sets. Scored
  once on 2026-12-06: median error at half the run 2.67 % (met), 80 % interval covered 33 of 36
  (92 %: missed by 2 points); seen since.
- development, part 14 (12 runs, ``forecast_text_curves_test13.json``): 2L-d144, 4L-d56 x 1.05e-3, 2.9e-3 x
  (cosine to 10 %, cosine to 0, warm-up-stable-decay), data order 6060, init seed 13: sizes,
  peak LRs and seeds no development run has. Fixed on 2026-12-06 after set 13 was scored and
  before any change chosen on it was made or any of its runs trained; it tests the interval's
  normal quantile without the centre's error term (chosen on sets 1-13 left out one at a
  time). Scored once on 2026-12-06: median error at half the run 1.51 %, 80 % interval
  covered 27 of 36 (75 %): both met; seen since.
- development, part 15 (12 runs, ``forecast_text_curves_test14.json``): 3L-d160, 5L-d80 x
  1.15e-3, 3.6e-3 x (cosine to 10 %, linear to 0, warm-up-stable-decay), data order 8080, init
  seed 14: sizes, peak LRs and seeds no development run has. Fixed on 2026-12-06 after set 14
  was scored, with the method unchanged: a second blind set for the same method (how often one
  set meets both targets). Scored once on 2026-12-06: median error at half the run 2.02 % (met),
  80 % interval covered 19 of 36 (53 %: missed; 3 of 12 at three quarters of the run); seen
  since.
- test block (``TEST_SETS`` = 3, 36 runs, scored pooled): sets 16-18 (``..._test15.json`` to
  ``..._test17.json``): 2L-d160, 4L-d72 x 8.5e-4, 2.7e-3 x (cosine to 10 %, cosine to 0, WSD),
  data 9090, init 15; 3L-d120, 5L-d64 x 1.35e-3, 3.9e-3 x (cosine to 10 %, linear to 0, WSD),
  data 3030, init 16; 2L-d72, 4L-d160 x 7.5e-4, 2.4e-3 x (cosine to 10 %, cosine to 0, WSD), data
  6161, init 17: sizes, peak LRs and seeds no development run has. Fixed on 2026-12-06 (third
  session) before any of their runs was trained, with the method unchanged since set 14 and the
  table refitted from sets 1-15 by the same code; trained and committed unscored; scored once:
  80 % interval covered 90 of 108 (83 %; the sets 29, 30 and 31 of 36), median error at half the
  run 2.95 % (the sets 4.47, 2.52, 2.63 %): both targets met, pooled and set by set. A next test
  block is development once it has been scored.


Scoring, as issue 17 asks: at 25 / 50 / 75 % of each run the forecaster sees the curve so far and
predicts the final loss. Truth: the final model's mean loss on ``EVAL_WINDOWS`` windows of the
same text at offsets drawn once (``EVAL_SEED``) for every run: 65K predicted bytes, none of them
a training batch's. Until 2026-12-02 the truth was the mean training loss of the last 2 % of the
steps: 10 batches that every run of a set reads in the same order, so that truth carried an
offset shared by the whole set (-3.5 % to +1.6 %), which the random-effects interval then
counted as forecast error. Each ``*_evals.json`` beside a curve file holds its runs' held-out
losses; a saved curve without one was retrained (float rounding on another CPU moves a curve's
steps by up to 1.8e-1 relative, its last step by up to 4.9e-2) and replaced. Reported per set and
forecaster (plain: no schedule; schedule-aware: ``lr_at`` given, as ``trainpilot train`` gives
it): median and max relative error, and the share of runs whose 80 % interval covered the truth
(nominal 80 %). Targets: coverage within 10 points of nominal and median error <= 5 % at half the
run, on the test curves, schedule-aware.

Writes benchmarks/results/forecast_coverage.txt and the curve files.
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
STEPS, SEQ, BATCH, WARMUP = 500, 64, 8, 25
EVAL_WINDOWS, EVAL_SEED = 1024, 20261202  # the held-out windows the final models are scored on
FRACTIONS = (0.25, 0.5, 0.75)
NOMINAL = 0.8
WSD_DECAY = 0.2  # warm-up-stable-decay: the last 20 % of the steps decay linearly to 0


def _size(name: str, layers: int, hidden: int) -> dict:
    return dict(name=name, num_hidden_layers=layers, hidden_size=hidden,
                intermediate_size=3 * hidden)


def _grid(sizes, lrs, schedules, *, data_seed: int, init_seed: int) -> list[dict]:
    return [dict(size=size, lr=lr, schedule=schedule, data_seed=data_seed, init_seed=init_seed,
                 name=f"{size['name']}-lr{lr:g}-{schedule}")
            for size in sizes for lr in lrs for schedule in schedules]


# The sets, in the order they were made: (curve file, sizes, peak LRs, schedules, data order,
# init seed). The last one is the test set; every earlier one is development.
SETS = (
    ("forecast_text_curves.json", (("2L-d64", 2, 64), ("3L-d96", 3, 96)), (1e-3, 3e-3),
     ("cosine", "constant", "linear"), 1234, 0),
    ("forecast_text_curves_test.json", (("2L-d48", 2, 48), ("4L-d128", 4, 128)), (6e-4, 2e-3),
     ("cosine0", "constant", "wsd"), 4321, 1),
    ("forecast_text_curves_test2.json", (("3L-d80", 3, 80), ("5L-d160", 5, 160)), (1.5e-3, 4e-3),
     ("cosine", "linear", "wsd"), 777, 2),
    ("forecast_text_curves_test3.json", (("3L-d64", 3, 64), ("4L-d144", 4, 144)), (8e-4, 2.5e-3),
     ("cosine", "cosine0", "wsd"), 2468, 3),
    ("forecast_text_curves_test4.json", (("2L-d96", 2, 96), ("5L-d128", 5, 128)),
     (1.2e-3, 3.5e-3), ("cosine", "linear", "wsd"), 1357, 4),
    ("forecast_text_curves_test5.json", (("3L-d112", 3, 112), ("4L-d80", 4, 80)),
     (9e-4, 2.8e-3), ("cosine", "cosine0", "wsd"), 8642, 5),
    ("forecast_text_curves_test6.json", (("4L-d112", 4, 112), ("3L-d128", 3, 128)),
     (1.1e-3, 3.2e-3), ("cosine", "linear", "wsd"), 9753, 6),
    ("forecast_text_curves_test7.json", (("2L-d128", 2, 128), ("5L-d96", 5, 96)),
     (7e-4, 2.2e-3), ("cosine", "cosine0", "wsd"), 3141, 7),
    ("forecast_text_curves_test8.json", (("3L-d144", 3, 144), ("4L-d96", 4, 96)),
     (1.3e-3, 3.7e-3), ("cosine", "linear", "wsd"), 2718, 8),
    ("forecast_text_curves_test9.json", (("2L-d112", 2, 112), ("4L-d64", 4, 64)),
     (1.6e-3, 3.4e-3), ("cosine", "cosine0", "wsd"), 1618, 9),
    ("forecast_text_curves_test10.json", (("2L-d80", 2, 80), ("5L-d112", 5, 112)),
     (1.4e-3, 3.1e-3), ("cosine", "linear", "wsd"), 4242, 10),
    ("forecast_text_curves_test11.json", (("3L-d56", 3, 56), ("4L-d120", 4, 120)),
     (9.5e-4, 2.6e-3), ("cosine", "cosine0", "wsd"), 7070, 11),
    ("forecast_text_curves_test12.json", (("3L-d72", 3, 72), ("5L-d144", 5, 144)),
     (1.25e-3, 3.3e-3), ("cosine", "linear", "wsd"), 5050, 12),
    ("forecast_text_curves_test13.json", (("2L-d144", 2, 144), ("4L-d56", 4, 56)),
     (1.05e-3, 2.9e-3), ("cosine", "cosine0", "wsd"), 6060, 13),
    ("forecast_text_curves_test14.json", (("3L-d160", 3, 160), ("5L-d80", 5, 80)),
     (1.15e-3, 3.6e-3), ("cosine", "linear", "wsd"), 8080, 14),
    # The test block (``TEST_SETS``): three sets scored together, fixed on 2026-12-06 (third
    # session) before any of their runs was trained, with the method unchanged since set 14.
    ("forecast_text_curves_test15.json", (("2L-d160", 2, 160), ("4L-d72", 4, 72)),
     (8.5e-4, 2.7e-3), ("cosine", "cosine0", "wsd"), 9090, 15),
    ("forecast_text_curves_test16.json", (("3L-d120", 3, 120), ("5L-d64", 5, 64)),
     (1.35e-3, 3.9e-3), ("cosine", "linear", "wsd"), 3030, 16),
    ("forecast_text_curves_test17.json", (("2L-d72", 2, 72), ("4L-d160", 4, 160)),
     (7.5e-4, 2.4e-3), ("cosine", "cosine0", "wsd"), 6161, 17),
)
# How many of the last sets are scored, pooled, as the test block. One set of 12 runs (36
# forecasts, correlated within the set) is too small a sample for a coverage target: leaving
# each of sets 1-13 out in turn, a single left-out set landed inside 70-90 % about half the
# time at a pooled 81 %; sets 13-15, scored one by one, covered 92 %, 75 % and 53 %.
TEST_SETS = 3


def set_runs(index: int) -> list[dict]:
    """The 12 runs of set ``index`` (0-based, in ``SETS`` order)."""
    _, sizes, lrs, schedules, data_seed, init_seed = SETS[index]
    return _grid([_size(*size) for size in sizes], lrs, schedules, data_seed=data_seed,
                  init_seed=init_seed)


def _set_of(run: dict) -> str:
    """A run's set: its data order and init seed are its set's own."""
    return f"data{run['data_seed']}-init{run['init_seed']}"


def multiplier(schedule: str, total: int):
    """LR multiplier at 0-based step ``i`` (LambdaLR's convention)."""
    def mult(i: int) -> float:
        if i < WARMUP:
            return (i + 1) / WARMUP
        progress = min(1.0, (i - WARMUP) / max(1, total - WARMUP))
        if schedule == "cosine":
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "cosine0":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if schedule == "linear":
            return max(0.0, 1.0 - progress)
        if schedule == "wsd":
            decay_from = total * (1 - WSD_DECAY)
            return 1.0 if i < decay_from else max(0.0, (total - i) / (total - decay_from))
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


def eval_offsets(text: np.ndarray) -> np.ndarray:
    """The held-out windows every run's final model is scored on: ``EVAL_WINDOWS`` random
    offsets into the same 8 MB (a stream no run reads 4 % of), one draw shared by all runs."""
    return np.random.default_rng(EVAL_SEED).integers(0, len(text) - SEQ - 1, size=EVAL_WINDOWS)


def train_curve(run: dict, text: np.ndarray, steps: int = STEPS) -> tuple[list[float], float]:
    """(the training loss of every step, the final model's mean loss on the held-out windows)."""
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
    init_parameters(model, spec, seed=run["init_seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=run["lr"], betas=(0.9, 0.95),
                            weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, multiplier(run["schedule"], steps))
    window = SEQ + 1
    offsets = np.random.default_rng(run["data_seed"]).integers(0, len(text) - window,
                                                               size=(steps, BATCH))
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
    total, count = 0.0, 0
    with torch.no_grad():
        for chunk in np.array_split(eval_offsets(text), EVAL_WINDOWS // 128):
            block = torch.from_numpy(np.stack([text[o:o + window] for o in chunk])
                                     .astype(np.int64))
            x, y = block[:, :-1], block[:, 1:]
            total += float(F.cross_entropy(model(x).flatten(0, 1), y.flatten(),
                                           reduction="sum"))
            count += y.numel()
    return losses, total / count


def last_steps_mean(losses: list[float]) -> float:
    """The truth until 2026-12-02: the mean training loss of the last 2 % of the steps (10
    batches, read in the same order by every run of a set, so it carries the set's offset)."""
    return float(np.mean(losses[-max(2, len(losses) // 50):]))


def forecasts(run: dict, losses: list[float], truth: float, *, calibration=None) -> list[dict]:
    """At each fraction: plain and schedule-aware forecasts of the final loss ``truth``."""
    total = len(losses)
    steps = np.arange(1, total + 1)
    mult = multiplier(run["schedule"], total)
    rows = []
    for frac in FRACTIONS:
        n = int(frac * total)
        for kind, lr_at in (("plain", None), ("schedule", lambda s: run["lr"] * mult(s - 1))):
            f = ConvergenceForecaster(total_steps=total, lr_at=lr_at, calibration=calibration)
            out = f.forecast(steps[:n], losses[:n])
            rows.append(scored(dict(run=run["name"], set=_set_of(run), frac=frac, kind=kind,
                                    model=out.model, pred=out.final_loss, lo=out.final_lo,
                                    hi=out.final_hi, reliable=out.reliable), truth))
    return rows


def scored(row: dict, truth: float) -> dict:
    """A forecast row scored against ``truth``: its error, log ratio and coverage."""
    return dict(row, truth=truth, rel_err=abs(row["pred"] - truth) / truth,
                log_ratio=math.log(truth / row["pred"]),
                covered=row["lo"] <= truth <= row["hi"])


def prediction_interval(values: list[float], sets: list[str]) -> dict:
    """A random-effects prediction interval for log(truth / point forecast) of a new run in a new
    set (Higgins, Thompson & Spiegelhalter 2009): set means m_j, within-set variance s_w^2 (pooled),
    between-set variance tau^2 = max(0, var(m_j) - s_w^2 / n) by the method of moments, centre
    mu = mean(m_j), and mu -/+ z_{(1+nominal)/2} * sqrt(tau^2 + s_w^2) over k sets (until
    2026-12-06 t_{k-2} and + var(m_j) / k: see below). A Student-t interval of the pooled runs, used before, assumed every run independent:
    the sets differ (size, LR, seeds) by more than runs within a set, and a new set shifted by
    5 points fell outside it (20 of 36 covered)."""
    from scipy import stats

    groups: dict[str, list[float]] = {}
    for v, g in zip(values, sets):
        groups.setdefault(g, []).append(v)
    k = len(groups)
    if k < 3:
        raise SystemExit(f"a random-effects interval needs 3 or more sets, got {k}")
    means = np.array([np.mean(v) for v in groups.values()])
    n = float(np.mean([len(v) for v in groups.values()]))
    s_w2 = float(np.mean([np.var(v, ddof=1) for v in groups.values()]))
    var_m = float(np.var(means, ddof=1))
    tau2 = max(0.0, var_m - s_w2 / n)
    mu = float(means.mean())
    # The normal quantile and no term for the centre's own error (Higgins et al. take
    # t_{k-2} and add var(m_j) / k): with both, leaving each of sets 1-13 out in turn and
    # fitting the interval on the other twelve, it covered 85.6 % of the left-out forecasts
    # (nominal 80 %; set 13, scored with it, 92 %); without them 81.3 %.
    half = float(stats.norm.ppf((1 + NOMINAL) / 2)) * math.sqrt(tau2 + s_w2)
    return dict(q_lo=mu - half, q_hi=mu + half, mean=mu, sd_within=math.sqrt(s_w2),
                tau=math.sqrt(tau2), num_runs=len(values), num_sets=k)


def calibrate(rows: list[dict]) -> dict:
    """Per law and fraction seen, the interval of ``prediction_interval`` from the development
    runs (the interval then is point * exp([q_lo, q_hi]))."""
    table: dict = {"nominal": NOMINAL, "method": "random-effects prediction interval over sets",
                   "source": "benchmarks/forecast_coverage.py --calibrate: the development "
                   "runs (byte-level GPTs on the Python standard library)", "kinds": {}}
    for kind in ("plain", "schedule"):
        entries = []
        for frac in FRACTIONS:
            sel = [x for x in rows if x["kind"] == kind and x["frac"] == frac
                   and (kind == "plain") == (x["model"] == "power_law")]
            if len({x["set"] for x in sel}) < 3 or len(sel) < 6:
                continue  # too few forecasts of this law: the plain law's entry is used
            entries.append(dict(fraction=frac, **prediction_interval(
                [x["log_ratio"] for x in sel], [x["set"] for x in sel])))
        table["kinds"][kind] = entries
    return table


def evals_path(path: Path) -> Path:
    """Where the final models' held-out losses of a curve file's runs are kept."""
    return path.with_name(path.stem + "_evals.json")


def _load_or_train(path: Path, chosen: list[dict], train: bool,
                   ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """(curves, held-out losses of the final models) of ``chosen`` from ``path`` and its
    ``evals_path``, training the missing runs. A saved curve whose held-out loss is missing is
    retrained and replaced: on another CPU the same torch's float sums round differently, and
    500 steps amplify that (measured on the 72 development runs retrained on 2026-12-02: the
    most-moved step of a run 2e-7 to 1.8e-1 relative, the last step at most 4.9e-2), so only
    the retrained curve belongs to the model that was scored."""
    curves = json.loads(path.read_text()) if path.exists() else {}
    epath = evals_path(path)
    evals = json.loads(epath.read_text()) if epath.exists() else {}
    missing = [r for r in chosen if r["name"] not in curves or r["name"] not in evals]
    if missing and not train:
        raise SystemExit(f"{path.name} or {epath.name} lacks {len(missing)} runs: run without "
                         "--from-curves")
    if missing:
        text = stdlib_bytes(8 << 20)
        for run in missing:
            start, cpu = time.perf_counter(), time.process_time()
            losses, held_out = train_curve(run, text)
            saved = curves.get(run["name"])
            drift = "" if saved is None else (
                f"; {max(abs(a - b) / a for a, b in zip(saved, losses)):.1e} off its saved curve")
            curves[run["name"]] = losses
            evals[run["name"]] = held_out
            print(f"trained {run['name']} in {time.perf_counter() - start:.0f} s "
                  f"({time.process_time() - cpu:.0f} CPU s): held-out loss {held_out:.4f}, "
                  f"last 10 steps {last_steps_mean(losses):.4f}{drift}", file=sys.stderr)
            atomic_write_text(path, json.dumps(curves))
            atomic_write_text(epath, json.dumps(evals, indent=1, sort_keys=True) + "\n")
    return curves, evals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-curves", action="store_true")
    parser.add_argument("--calibrate", action="store_true",
                        help="refit the shipped interval table from the development runs")
    parser.add_argument("--calibrate-only", action="store_true",
                        help="with --calibrate: stop after the table (no test curves needed)")
    parser.add_argument("--train-set", type=int, metavar="N",
                        help="only train set N's missing runs (0-based, SETS order), then stop: "
                        "two of these at once use both cores")
    args = parser.parse_args()
    if args.train_set is not None:
        _load_or_train(RESULTS / SETS[args.train_set][0], set_runs(args.train_set), True)
        return 0
    curves: dict[str, list[float]] = {}
    truth: dict[str, float] = {}
    last = len(SETS) - TEST_SETS
    dev = [r for i in range(last) for r in set_runs(i)]
    test = [r for i in range(last, len(SETS)) for r in set_runs(i)]
    for i in range(last):
        got, evals = _load_or_train(RESULTS / SETS[i][0], set_runs(i), not args.from_curves)
        curves.update(got)
        truth.update(evals)
    if args.calibrate:
        raw = [row for r in dev for row in forecasts(r, curves[r["name"]], truth[r["name"]],
                                                     calibration=False)]
        atomic_write_text(fc_mod.CALIBRATION_PATH, json.dumps(calibrate(raw), indent=2) + "\n")
        fc_mod.load_calibration.cache_clear()
    if args.calibrate_only:
        return 0
    for i in range(last, len(SETS)):
        got, evals = _load_or_train(RESULTS / SETS[i][0], set_runs(i), not args.from_curves)
        curves.update(got)
        truth.update(evals)
    lines = ["convergence forecast on byte-level GPTs trained on the Python standard library",
             f"{STEPS} steps per run; development runs (model choices and the interval table): "
             f"{len(dev)}; test runs (other sizes, LRs, schedules, seeds): "
             f"{len(test)}",
             f"truth: each final model's mean loss on {EVAL_WINDOWS} held-out windows of "
             f"{SEQ} predicted bytes",
             f"python {platform.python_version()}, {os.cpu_count()} cores", "",
             f"{'split':<12} {'seen':>5} {'model':<9} {'median err':>10} {'max err':>8} "
             f"{'80% covered':>12}"]
    ok = True
    for split, chosen in (("development", dev), ("test", test)):
        rows = [row for r in chosen
                for row in forecasts(r, curves[r["name"]], truth[r["name"]])]
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
            models = {m: sum(x["model"] == m for x in pooled) for m in sorted(
                {x["model"] for x in pooled})}
            for name in dict.fromkeys(x["set"] for x in pooled):
                one = [x for x in pooled if x["set"] == name]
                at_half = statistics.median(x["rel_err"] for x in one if x["frac"] == 0.5)
                lines.append(f"test set {name}, schedule-aware: 80% interval covered "
                             f"{sum(x['covered'] for x in one)} of {len(one)}; median error at "
                             f"50%: {100 * at_half:.2f}%")
            lines += ["", f"test runs, schedule-aware: law chosen by BIC {models}",
                      f"test runs, schedule-aware (what trainpilot train uses), all "
                          f"fractions pooled: 80% interval covered {100 * coverage:.0f}% of "
                          f"{len(pooled)} forecasts; median error at 50%: "
                          f"{100 * statistics.median(half):.2f}%"]
            before = [scored(x, last_steps_mean(curves[x["run"]])) for x in pooled]
            old_half = statistics.median(x["rel_err"] for x in before if x["frac"] == 0.5)
            lines.append(f"the same forecasts against the old truth (the mean of the last 10 "
                         f"steps' training loss): covered "
                         f"{100 * sum(x['covered'] for x in before) / len(before):.0f}%, median "
                         f"error at 50%: {100 * old_half:.2f}%")
    lines.append(f"targets: coverage within 10 points of 80% and median error <= 5% at half the "
                 f"run, on the test runs: {'met' if ok else 'MISSED'}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    atomic_write_text(RESULTS / "forecast_coverage.txt", text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
