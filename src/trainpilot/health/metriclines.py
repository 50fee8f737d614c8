"""Failures visible only in a log's metric lines: a NaN or infinite loss or gradient norm, a
loss spike, a throughput that drifts down.

The lines training loops print carry fields such as ``loss 3.99``, ``loss: nan``, ``lm loss:
2.38E+00``, ``grad norm: nan``, ``grad_norm=nan``, ``tokens/s 5,614``, ``tps: 4123``, ``samples
per second: 1.88``, ``elapsed time per iteration (ms): 4247.9``, ``time 1019.95ms`` (nanoGPT,
Megatron-LM, torchtitan, Hugging Face, ...). :class:`MetricScanner` reads them from the
lower-cased chunks of one file, in order:

- **non-finite**: a ``loss`` or ``grad norm`` field whose value is ``nan`` or ``inf`` (the first
  such line is the evidence; a ``number of nan iterations`` counter is not such a field, it is
  read on its own, below);
- **loss spike**: a loss more than ``SPIKE_RATIO`` (2x) the median of the ``SPIKE_WINDOW`` (20)
  losses before it and more than ``SPIKE_Z`` (8) robust deviations above it, once 20 losses are
  known (evaluation losses, ``val``/``eval``/``test``, are not part of the series);
- **loss-scale collapse** (fp16 dynamic loss scaling): the overflow messages of DeepSpeed
  (``[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 8, reducing to 4``,
  ``fp16 dynamic loss scale overflow! ... reducing to``), apex amp (``Gradient overflow.  Skipping
  step, loss scaler 0 reducing loss scale to 0.5``) and fairseq (``overflow detected, setting loss
  scale to: 0.25``) report each back-off. One overflow, or a run of them while the scale calibrates
  down from 2**32 at start-up, is normal. Flagged: ``OVERFLOW_STREAK`` (3) back-offs in a row (no
  growth between them) that drive the scale below 1 (below the minimum DeepSpeed and Megatron-LM
  allow by default), or an overflow at a scale that can no longer be lowered (DeepSpeed's
  ``Attempted loss scale: 1, reducing to 1``: the scaler is at its floor). Also flagged: DeepSpeed's
  ``step=N, skipped=S`` progress lines once more than ``SKIP_CALIBRATION`` (64) steps were skipped
  and at least half of the steps since the previous such line (>= 10) were skipped; and
  Megatron-LM iteration lines at ``loss scale`` <= 1 (its default minimum) that still skipped
  iterations, in ``FLOOR_LINES`` (2) lines;
- **non-finite** also covers a suffixed loss field (Lightning's ``train_loss_step=nan``),
  Megatron-LM's ``number of nan iterations: N`` with N >= 1 (the loss of a skipped iteration was
  NaN or inf), and a Megatron-LM iteration line whose loss field is missing (``global batch size:
  64 | loss scale: 1.0 |``: its ``training_log`` prints a loss only if its average is >= 0, which
  NaN is not);
- **throughput drift**: over a series of at least ``DRIFT_MIN_POINTS`` (80) throughput (or time
  per step) values, the median of the last quarter at least ``DRIFT_FRACTION`` (4 %) worse than
  the median of the first quarter (after the first ``DRIFT_SKIP`` warm-up points), with at least
  75 % of the last quarter's values worse than that first median (a drift, not noise).

- **a GPU spinning while its peers idle** (an ``nvidia-smi`` snapshot in the log): a collective
  kernel that waits on a peer spins on its SMs without touching memory, so ``nvidia-smi`` shows
  that GPU at 100 % utilization while the GPUs that finished (or never reached) the collective
  sit at 0 %. Read from the query form (``--query-gpu=...,utilization.gpu,utilization.memory``,
  comma-separated or aligned by ``column -t``: a GPU at >= ``SPIN_BUSY`` % with memory
  utilization <= ``SPIN_IDLE`` %, another GPU at <= ``SPIN_IDLE`` %) and from the default table
  (the same utilization split, and every GPU of the snapshot holding at least ``SPIN_HELD_MIB``
  of memory, so that the idle GPUs belong to the job: a single-GPU job on a shared node is not a
  hang; or every GPU at 100 % while drawing at most ``SPIN_POWER_SHARE`` of its power cap, since
  a spin-wait keeps a GPU "busy" at near-idle power where compute draws most of the cap). A
  symptom (``hang``): the cause is whatever kept the peer away.

Each finding is a line (number, text) with what it concludes; the diagnoser ranks it with the
pattern matches (non-finite, spikes and loss-scale collapse: ``numerical``; drift: ``straggler``, a
symptom).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import numpy as np

from trainpilot.health.logscan import count_newlines

SPIKE_RATIO, SPIKE_Z, SPIKE_WINDOW = 2.0, 8.0, 20
OVERFLOW_STREAK, SKIP_CALIBRATION, SKIP_FRACTION, SKIP_MIN_STEPS, FLOOR_LINES = 3, 64, 0.5, 10, 2
DRIFT_FRACTION, DRIFT_MIN_POINTS, DRIFT_SKIP, DRIFT_CONSISTENCY = 0.04, 80, 5, 0.75
SPIN_BUSY, SPIN_IDLE, SPIN_HELD_MIB, SPIN_POWER_SHARE = 95.0, 5.0, 1024.0, 0.35
# nvidia-smi: the query form's header names the columns ("utilization.gpu [%]"); its rows carry
# the percentages in the header's order. The default table's GPU rows end "| 100%  Default |"
# (the compute mode follows GPU-Util) after "| 1234MiB / 81559MiB |".
SMI_QUERY_HEADER = re.compile(rb"^[^\n]*utilization\.gpu[^\n]*$", re.M)
SMI_PERCENT = re.compile(rb"(\d+(?:\.\d+)?)\s*%")
SMI_TABLE_ROW = re.compile(rb"(?:(\d+)w\s*/\s*(\d+)w\s*|)\|\s*(\d+)mib\s*/\s*\d+mib\s*\|\s*(\d+)%\s+"
                           rb"(?:default|e\. process|exclusive_process|prohibited)")
# An optional group is written ``(?:x|)``, not ``(?:x)?``: the same matches in the same order of
# trial, but `re` runs a branch without the repeat bookkeeping ``?`` on a group costs, and LOSS
# tries a match at every "loss" of a chunk (with the possessive runs below, half of LOSS's time;
# benchmarks/diagnose_speed.py).
_NUM = rb"([-+]?(?:\d+(?:\.\d*|)|\.\d+)(?:e[-+]?\d+|)|nan|[-+]?inf(?:inity|))"
# On the lower-cased bytes of a chunk. Each starts with a literal so that `re` scans for it at
# C speed; what precedes is checked after a match.
# "loss 3.99", "loss: nan", "loss=2.1", "'loss': 2.0", BigDL's / Java's "Loss is Infinity.", and a
# loss indexed by its step, "train_batch_loss[ 6590 ]:  nan" (a print of ``f"loss[{i}]:"``).
# The separator's whitespace runs are possessive (``*+``): what follows each is not whitespace,
# so giving some back never leads to a match, and `re` no longer tries.
LOSS = re.compile(rb"loss(?:es|)(?:\[\s*+\d++\s*+\]|)[\"']?(?:\s*+[:=]\s*+|\s++(?:is\s++|))[\"']?"
                  + _NUM + rb"(?![a-z0-9])")
GRAD_NONFINITE = re.compile(rb"norm[\"']?\s*(?:[:=]\s*|\s+)[\"']?(nan|[-+]?inf(?:inity)?)(?![a-z0-9])")
# A loss field with a suffix (Lightning's ``train_loss_step=nan`` / ``loss_epoch``, ``loss_avg``):
# read for non-finite values only (not part of the loss series); the loss scale is not a loss.
LOSS_SUFFIX_NONFINITE = re.compile(rb"loss_(?!scale)[a-z0-9_]{1,16}[\"']?\s*[:=]\s*[\"']?"
                                   rb"(nan|[-+]?inf(?:inity)?)(?![a-z0-9])")
# fp16 loss-scale back-offs (lower case). DeepSpeed deepspeed/runtime/fp16/loss_scaler.py
# (update_scale: "[deepspeed] OVERFLOW! Rank {r} Skipping step. Attempted loss scale: {cur},
# reducing to {next}") and fused_optimizer.py / unfused_optimizer.py ("[deepspeed] fp16 dynamic
# loss scale overflow! Skipping step. Attempted loss scale: {prev}, reducing to {cur}"); apex
# apex/amp/handle.py ("Gradient overflow.  Skipping step, loss scaler {id} reducing loss scale to
# {s}") and apex/fp16_utils/fp16_optimizer.py ("... Skipping step, reducing loss scale to {s}");
# fairseq fairseq/optim/dynamic_loss_scaler.py (OverflowError "setting loss scale to: {s}", logged
# by fairseq/trainer.py as "NOTE: gradient overflow detected, ignoring gradient, setting loss scale
# to: {s}"; older "| WARNING: overflow detected, setting loss scale to: {s}") and
# fairseq/optim/amp_optimizer.py ("AMP: overflow detected, setting scale to to {s}").
_SCALE = rb"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?)"
OVERFLOW = re.compile(rb"overflow[^\n]{0,160}?(?:attempted loss scale:\s*" + _SCALE
                      + rb",\s*)?(?:reducing (?:loss scale )?to|setting (?:loss )?scale to:?"
                        rb"(?: to)?)\s*" + _SCALE)
# DeepSpeed deepspeed/runtime/engine.py (_report_progress): "step={step}, skipped={skipped_steps},
# lr=..., mom=...".
DS_PROGRESS = re.compile(rb"step=(\d+), skipped=(\d+)")
# Megatron-LM megatron/training/training.py (training_log): "... loss scale: {:.1f} | ... number of
# skipped iterations: {:3d} | number of nan iterations: {:3d} |".
# Both match only lines with a count >= 1, so healthy iteration lines (a run prints one a step)
# are skipped at C speed instead of reaching the loops below.
# One scan for both counters (a literal first); the loss scale is then read on the line.
MEGATRON_COUNTS = re.compile(rb"number of (skipped|nan) iterations:\s*([1-9]\d*)")
MEGATRON_SCALE = re.compile(rb"loss scale:\s*" + _SCALE + rb"\s*\|")
# Megatron-LM's training_log prints each loss as " {key}: {avg:.6E} |" only "if avg >= 0.0" (before
# 2024: "> 0.0"): a NaN average fails the test, so the loss field vanishes and "global batch
# size: N |" runs straight into " loss scale:" (an MoE run's load-balancing losses sit between).
MEGATRON_NO_LOSS = re.compile(rb"global batch size:\s*\d+\s*\|\s*loss scale:")
THROUGHPUT = (  # (regex, literal first; higher is better)
    (re.compile(rb"tokens?(?:/s| per sec(?:ond)?|_per_s(?:ec)?)[\"']?\s*[:=]?\s*([\d,]+(?:\.\d+)?)"),
     True),
    (re.compile(rb"tok/s\s*[:=]?\s*([\d,]+(?:\.\d+)?)"), True),
    (re.compile(rb"tps\s*[:=]\s*([\d,]+(?:\.\d+)?)"), True),
    (re.compile(rb"samples per second\s*[:=]\s*([\d.]+)"), True),
    (re.compile(rb"elapsed time per iteration \(ms\)\s*[:=]\s*([\d.]+)"), False),
    (re.compile(rb" time\s*[:=]?\s*([\d.]+)\s*ms(?![a-z])"), False),
)
THROUGHPUT_SAMPLE_BYTES = 1 << 20  # throughput is read from the first MB of each 8 MB chunk
# A literal every match of each THROUGHPUT regex holds: where it is absent (a log prints one or
# two of these fields), an `in` test skips the regex's scan at a fraction of its cost.
_THROUGHPUT_LITERALS = (b"token", b"tok/s", b"tps", b"samples per second", b"(ms)", b" time")
# Literals whose absence lets a chunk skip a rule. A caller that already runs a literal prefilter
# over the chunk (the diagnoser's automaton) can say which of them it holds (``feed(present=)``)
# instead of two more scans of 8 MB (10 % of a healthy chunk's time).
PRESENCE_LITERALS = (b"overflow", b"skipped=", b"utilization.gpu", b"gpu-util")
_EVAL_BYTES = tuple(w.encode() for w in ("val", "eval", "valid", "test", "validation"))


# Gates: necessary conditions for a rule's regex to match anywhere in a chunk, cheaper to scan for
# than the rule's own match (`re` pays for every occurrence of a pattern's first character, and
# "norm" and "number of" start with the frequent "n"). A healthy chunk fails them and skips the
# rules' scans; otherwise the rules' regexes run as before, so no result depends on the gates.
# GRAD_NONFINITE's and LOSS_SUFFIX_NONFINITE's value is a "nan" followed by a non-alphanumeric
# after a separator (quote, whitespace, ':' or '='; never "of ", as in Megatron-LM's "number of
# nan iterations" on each of its iteration lines), or an "inf" or "infinity" followed by a
# non-alphanumeric (not "INFO"). MEGATRON_COUNTS needs an "iterations:" followed by
# ``\s*[1-9]``, which "   0" never is (Megatron-LM prints the counters as "{:3d}"). Each gate is
# written from the "n" it holds, so one scan, with the one-character prefix `re` finds fastest,
# tests all three (half the time of two scans).
_NAN_AFTER_N = rb"an(?![a-z0-9])(?<!of nan)"
_INF_AFTER_N = rb"f(?<=inf)(?:inity|)(?![a-z0-9])"
_COUNT_AFTER_N = rb"s:(?<=iterations:)(?!   0)"
NONFINITE_GATE = re.compile(rb"n(?:" + _NAN_AFTER_N + rb"|" + _INF_AFTER_N + rb")")
COUNTS_GATE = re.compile(rb"iterations:(?!   0)")
_GATES = re.compile(rb"n(?:" + _NAN_AFTER_N + rb"|" + _INF_AFTER_N + rb"|(" + _COUNT_AFTER_N
                    + rb"))")


def _gates(low: bytes) -> tuple[bool, bool]:
    """(whether GRAD_NONFINITE or LOSS_SUFFIX_NONFINITE may match in ``low``, whether
    MEGATRON_COUNTS may): one scan where neither may, a second where one gate opens."""
    m = _GATES.search(low)
    if m is None:
        return False, False
    if m.group(1) is not None:  # a counter opened it first
        return NONFINITE_GATE.search(low) is not None, True
    return True, COUNTS_GATE.search(low) is not None


def _floats(texts: list[bytes]) -> np.ndarray:
    """Numbers as written in logs ('2.38e+00', 'nan', '-inf') to float64, in C."""
    if not texts:
        return np.empty(0)
    try:
        return np.array(texts, dtype=np.float64)
    except ValueError:  # an odd token ("+inf", "infinity" spellings numpy rejects)
        out = np.empty(len(texts))
        for i, t in enumerate(texts):
            try:
                out[i] = float(t)
            except ValueError:
                out[i] = np.nan
        return out


def _window_nanmin(y: np.ndarray) -> np.ndarray:
    """``np.nanmin`` of each window of ``SPIKE_WINDOW`` consecutive values of ``y`` (NaN where
    all are NaN), as ``np.fmin`` over shifted views: a tenth of the time of ``np.nanmin`` over a
    sliding-window view, which reduces 20 values at a time."""
    n = len(y) - SPIKE_WINDOW + 1
    out = y[:n].copy()
    for k in range(1, SPIKE_WINDOW):
        np.fmin(out, y[k:k + n], out=out)
    return out


def _nth(regex, text: str, k: int, *, start: int = 0):
    """The k-th (0-based) match of ``regex`` in ``text`` from ``start`` (located only for
    evidence, so the O(k) walk is rare)."""
    if start:
        matches = list(regex.finditer(text, start))
        return matches[-1] if matches else None
    return next(itertools.islice(regex.finditer(text), k, k + 1), None)


def _locate(chunk, pos: int) -> tuple[int, str]:
    """(line number, text) of the line holding byte ``pos`` of a chunk."""
    data = chunk.data
    start = data.rfind(b"\n", 0, pos) + 1
    end = data.find(b"\n", pos)
    end = len(data) if end < 0 else end
    # Count from the nearer end of the chunk.
    if start > len(data) // 2:
        line_no = chunk.first_line + chunk.num_lines - count_newlines(data, start)
    else:
        line_no = chunk.first_line + count_newlines(data, 0, start)
    return line_no, chunk.line(start, end)


_SPLIT = (f"a GPU at >= {SPIN_BUSY:.0f}% utilization while another of the job's GPUs sits at "
          f"<= {SPIN_IDLE:.0f}%")
_LOW_POWER = (f"every GPU of the job at >= {SPIN_BUSY:.0f}% utilization on at most "
              f"{100 * SPIN_POWER_SHARE:.0f}% of its power cap")


def _spin_in_query(low: bytes) -> tuple[int, str] | None:
    """(offset of a spinning GPU's row, what shows it) in the query-form snapshots of ``low``,
    or None."""
    for header in SMI_QUERY_HEADER.finditer(low):
        fields = [f for f in re.split(rb",|\s{2,}|\t", header.group(0)) if b"[%]" in f]
        names = [f.strip().split()[0] for f in fields]
        if b"utilization.gpu" not in names:
            continue
        gpu_col = names.index(b"utilization.gpu")
        mem_col = names.index(b"utilization.memory") if b"utilization.memory" in names else None
        rows = []
        pos = header.end() + 1
        while pos < len(low):
            end = low.find(b"\n", pos)
            end = len(low) if end < 0 else end
            values = SMI_PERCENT.findall(low, pos, end)
            if len(values) != len(names):
                break
            rows.append((pos, float(values[gpu_col]),
                         float(values[mem_col]) if mem_col is not None else None))
            pos = end + 1
        busy = [r for r in rows if r[1] >= SPIN_BUSY and r[2] is not None and r[2] <= SPIN_IDLE]
        if busy and len(rows) >= 2 and any(r[1] <= SPIN_IDLE for r in rows):
            return busy[0][0], _SPLIT
    return None


def _spin_in_table(low: bytes) -> tuple[int, str] | None:
    """(offset of a spinning GPU's row, what shows it) in a default-table snapshot of ``low``,
    or None: rows in one snapshot are consecutive GPU rows (nothing but table rules and the
    per-GPU second lines between them)."""
    snapshot: list[tuple[int, float, float, float | None]] = []
    last_end = -1
    for m in SMI_TABLE_ROW.finditer(low):
        between = low[last_end:m.start()] if last_end >= 0 else b""
        if last_end >= 0 and between.count(b"\n") > 4:
            hit = _spin_rows(snapshot)
            if hit is not None:
                return hit
            snapshot = []
        share = float(m.group(1)) / float(m.group(2)) if m.group(1) and float(m.group(2)) else None
        snapshot.append((m.start(), float(m.group(4)), float(m.group(3)), share))
        last_end = m.end()
    return _spin_rows(snapshot)


def _spin_rows(rows: list[tuple[int, float, float, float | None]]) -> tuple[int, str] | None:
    """A spin in one table snapshot: every GPU holds the job's memory and either some are busy
    while others idle, or all are busy at a power draw no compute runs at."""
    if len(rows) < 2 or any(held < SPIN_HELD_MIB for _, _, held, _ in rows):
        return None
    busy = [pos for pos, util, _, _ in rows if util >= SPIN_BUSY]
    if busy and any(util <= SPIN_IDLE for _, util, _, _ in rows):
        return busy[0], _SPLIT
    if len(busy) == len(rows) and all(share is not None and share <= SPIN_POWER_SHARE
                                      for _, _, _, share in rows):
        return busy[0], _LOW_POWER
    return None


@dataclass(frozen=True, kw_only=True)
class MetricFinding:
    kind: str  # "non_finite", "loss_spike", "loss_scale_collapse", "throughput_drift", "gpu_spin"
    line_no: int
    text: str
    detail: str


@dataclass
class MetricScanner:
    """Metric-line rules over one file's chunks (call :meth:`feed` in order, then
    :meth:`findings`). Values are pulled out with ``findall`` (no per-match Python work); a
    line is located (its number and text) only when it becomes evidence."""

    losses: list[float] = field(default_factory=list)
    throughput: dict[int, list[float]] = field(default_factory=dict)
    first_nonfinite: MetricFinding | None = None
    _spikes: list[MetricFinding] = field(default_factory=list)
    _last_line: dict[int, tuple[int, str]] = field(default_factory=dict)
    scale_collapse: MetricFinding | None = None
    gpu_spin: MetricFinding | None = None
    _streak: int = 0
    _last_scale: float | None = None
    _last_progress: tuple[int, int] | None = None
    _floor_lines: int = 0

    def feed(self, chunk, *, present: set[bytes] | frozenset[bytes] | None = None) -> None:
        """One chunk (``logscan.Chunk``), in file order. ``present``: which of
        ``PRESENCE_LITERALS`` the chunk holds (None: look)."""
        low = chunk.low
        if present is None:
            present = {lit for lit in PRESENCE_LITERALS if lit in low}
        values = _floats(LOSS.findall(low))
        if len(values):
            if self.first_nonfinite is None:
                self._nonfinite("loss", LOSS, values, chunk)
            if not self._spikes:
                self._spike_candidates(values, chunk)
            self.losses.extend(values.tolist())
        want_nan = (self.first_nonfinite is None
                    or self.first_nonfinite.line_no >= chunk.first_line)
        want_counts = want_nan or self.scale_collapse is None
        maybe_nonfinite, maybe_counts = _gates(low) if want_counts else (False, False)
        counts = ([(m.group(1), m.start(), int(m.group(2))) for m in MEGATRON_COUNTS.finditer(low)]
                  if want_counts and maybe_counts else [])
        if want_nan:
            self._other_nonfinite(chunk, [c for c in counts if c[0] == b"nan"], maybe_nonfinite)
        if self.scale_collapse is None:
            self._loss_scale(chunk, [c for c in counts if c[0] == b"skipped"], present)
        if self.gpu_spin is None and (b"utilization.gpu" in present or b"gpu-util" in present):
            self._spin(chunk, present)
        sample = low[:THROUGHPUT_SAMPLE_BYTES]
        for index, (regex, _) in enumerate(THROUGHPUT):
            found = regex.findall(sample) if _THROUGHPUT_LITERALS[index] in sample else []
            if not found:
                continue
            v = _floats([t.replace(b",", b"") for t in found] if any(b"," in t for t in found[:64])
                        else found)
            self.throughput.setdefault(index, []).extend(v[np.isfinite(v) & (v > 0)].tolist())
            last = _nth(regex, sample, len(found) - 1, start=max(0, len(sample) - 8192))
            if last is not None:
                self._last_line[index] = _locate(chunk, last.start())

    def _other_nonfinite(self, chunk, nan_counts: list[tuple[bytes, int, int]],
                         maybe_fields: bool) -> None:
        """A NaN/inf grad norm or suffixed loss field (looked for where ``maybe_fields``: the
        gate), or Megatron-LM's NaN-iteration counter, in this chunk; the earliest line wins
        (also over a NaN loss this chunk already gave)."""
        low = chunk.low
        found: list[tuple[int, str]] = []
        fields = ((GRAD_NONFINITE, "grad norm"), (LOSS_SUFFIX_NONFINITE, "loss"))
        for regex, what in fields if maybe_fields else ():
            m = regex.search(low)
            if m is not None:
                found.append((m.start(), f"{what} is {m.group(1).decode()}"))
        if nan_counts:
            _, pos, count = nan_counts[0]
            found.append((pos, f"Megatron-LM counted {count} iteration(s) whose loss was NaN "
                               "or inf"))
        # An `in` test first: where the literal is absent it costs under half the regex's scan
        # (`bytes` search skips ahead over a long needle; `re` steps byte by byte), and in a
        # Megatron log it stops at the first iteration line.
        m = MEGATRON_NO_LOSS.search(low) if b"global batch size:" in low else None
        if m is not None:
            found.append((m.start(), "the Megatron-LM iteration line has no loss field: "
                                     "training_log leaves out a loss whose average is not "
                                     ">= 0, i.e. NaN"))
        if not found:
            return
        pos, detail = min(found)
        line_no, text = _locate(chunk, pos)
        if self.first_nonfinite is None or line_no < self.first_nonfinite.line_no:
            self.first_nonfinite = MetricFinding(kind="non_finite", line_no=line_no, text=text,
                                                 detail=detail)

    def _loss_scale(self, chunk, skipped_counts: list[tuple[bytes, int, int]],
                    present: set[bytes] | frozenset[bytes]) -> None:
        """The loss-scale rules (module docstring) over one chunk's overflow, DeepSpeed progress
        and Megatron-LM iteration lines, in file order (``present``: as :meth:`feed`)."""
        low = chunk.low
        if b"overflow" in present:
            for m in OVERFLOW.finditer(low):
                attempted = float(m.group(1)) if m.group(1) else None
                new = float(m.group(2))
                prev = self._last_scale
                if prev is not None and new <= prev and (attempted is None or attempted == prev):
                    self._streak += 1
                else:
                    self._streak = 1
                self._last_scale = new
                if attempted is not None and attempted == new:
                    why = (f"an overflow at loss scale {new:g}, which the scaler can no longer "
                           "lower (it is at its minimum)")
                elif new < 1 and self._streak >= OVERFLOW_STREAK:
                    why = (f"{self._streak} overflow back-offs in a row drove the loss scale "
                           f"down to {new:g}")
                else:
                    continue
                self._collapse(chunk, m.start(), why)
                return
        if b"skipped=" in present:
            for m in DS_PROGRESS.finditer(low):
                step, skipped = int(m.group(1)), int(m.group(2))
                prev_progress, self._last_progress = self._last_progress, (step, skipped)
                if prev_progress is None or skipped <= SKIP_CALIBRATION:
                    continue
                d_step, d_skip = step - prev_progress[0], skipped - prev_progress[1]
                if d_step >= SKIP_MIN_STEPS and d_skip >= SKIP_FRACTION * d_step:
                    self._collapse(chunk, m.start(), f"{d_skip} of the {d_step} steps up to step "
                                   f"{step} were skipped for overflow ({skipped} in all)")
                    return
        for _, pos, _ in skipped_counts:
            line_start = low.rfind(b"\n", 0, pos) + 1
            scale = MEGATRON_SCALE.search(low, line_start, pos)
            if scale is not None and float(scale.group(1)) <= 1:
                self._floor_lines += 1
                if self._floor_lines >= FLOOR_LINES:
                    self._collapse(chunk, scale.start(), "iterations are still skipped at loss "
                                   f"scale {float(scale.group(1)):g}, Megatron-LM's default "
                                   "minimum")
                    return

    def _collapse(self, chunk, pos: int, why: str) -> None:
        line_no, text = _locate(chunk, pos)
        self.scale_collapse = MetricFinding(kind="loss_scale_collapse", line_no=line_no,
                                            text=text, detail=why)

    def _nonfinite(self, what: str, regex, values, chunk) -> None:
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            m = _nth(regex, chunk.low, int(bad[0]))
            line_no, text = _locate(chunk, m.start())
            self.first_nonfinite = MetricFinding(kind="non_finite", line_no=line_no, text=text,
                                                 detail=f"{what} is {m.group(1).decode()}")

    def _spike_candidates(self, values, chunk) -> None:
        """Spikes among this chunk's losses (the 20 before it as context); each candidate is
        located and checked (an evaluation loss is not part of the training curve)."""
        context = np.asarray(self.losses[-SPIKE_WINDOW:], dtype=np.float64)
        y = np.concatenate([context, values])
        if len(y) <= SPIKE_WINDOW:
            return
        from numpy.lib.stride_tricks import sliding_window_view

        windows = sliding_window_view(y[:-1], SPIKE_WINDOW)
        current = y[SPIKE_WINDOW:]
        with np.errstate(invalid="ignore"):
            # A spike is > 2x the window's median, hence > 2x its minimum: test that first.
            rough = np.flatnonzero(np.isfinite(current)
                                   & (current > SPIKE_RATIO * _window_nanmin(y[:-1])))
            med = np.full(len(current), np.nan)
            if len(rough):
                med[rough] = np.nanmedian(windows[rough], axis=1)
            cand = np.flatnonzero((med > 0) & (current > SPIKE_RATIO * med))
        offset = SPIKE_WINDOW - len(context)  # index of current[0] within this chunk's values
        for j in cand[:20]:
            window = windows[j][np.isfinite(windows[j])]
            if len(window) < SPIKE_WINDOW // 2 or len(self.losses) + j + offset < SPIKE_WINDOW:
                continue
            mad = 1.4826 * float(np.median(np.abs(window - med[j])))
            value = float(current[j])
            if value <= med[j] + SPIKE_Z * max(mad, 1e-3 * med[j]):
                continue
            m = _nth(LOSS, chunk.low, int(j) + offset)
            before = chunk.low[max(0, m.start() - 12):m.start()]
            if any(w in before for w in _EVAL_BYTES):
                continue
            line_no, text = _locate(chunk, m.start())
            self._spikes.append(MetricFinding(
                kind="loss_spike", line_no=line_no, text=text,
                detail=f"loss {value:.4g} is {value / med[j]:.1f}x the median {med[j]:.4g} of "
                       f"the {SPIKE_WINDOW} before it"))
            return

    # ------------------------------------------------------------------ verdicts
    def _spin(self, chunk, present) -> None:
        hit = _spin_in_query(chunk.low) if b"utilization.gpu" in present else None
        if hit is None and b"gpu-util" in present:
            hit = _spin_in_table(chunk.low)
        if hit is not None:
            line, text = _locate(chunk, hit[0])
            self.gpu_spin = MetricFinding(kind="gpu_spin", line_no=line, text=text,
                                          detail=f"nvidia-smi (line {line}) shows {hit[1]}")

    def findings(self) -> list[MetricFinding]:
        out = [self.first_nonfinite] if self.first_nonfinite else []
        out += [self.scale_collapse] if self.scale_collapse else []
        out += [self.gpu_spin] if self.gpu_spin else []
        out += self._spikes[:1]
        drift = self._drift()
        if drift:
            out.append(drift)
        return out

    def _drift(self) -> MetricFinding | None:
        for index, (_, higher_better) in enumerate(THROUGHPUT):
            y = np.asarray(self.throughput.get(index, [])[DRIFT_SKIP:], dtype=np.float64)
            if len(y) < DRIFT_MIN_POINTS:
                continue
            q = len(y) // 4
            first, last = np.median(y[:q]), np.median(y[-q:])
            worse = (first - last) / first if higher_better else (last - first) / first
            tail = y[-q:]
            consistent = np.mean(tail < first) if higher_better else np.mean(tail > first)
            if worse >= DRIFT_FRACTION and consistent >= DRIFT_CONSISTENCY:
                line, text = self._last_line.get(index, (0, ""))
                what = "throughput" if higher_better else "time per step"
                return MetricFinding(
                    kind="throughput_drift", line_no=line, text=text,
                    detail=f"{what} drifted {100 * worse:.1f}% worse: median {first:.4g} over "
                           f"the first quarter of {len(y)} lines, {last:.4g} over the last")
        return None
