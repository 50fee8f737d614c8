"""Failures visible only in a log's metric lines: a NaN or infinite loss or gradient norm, a
loss spike, a throughput that drifts down.

The lines training loops print carry fields such as ``loss 3.99``, ``loss: nan``, ``lm loss:
2.38E+00``, ``grad norm: nan``, ``grad_norm=nan``, ``tokens/s 5,614``, ``tps: 4123``, ``samples
per second: 1.88``, ``elapsed time per iteration (ms): 4247.9``, ``time 1019.95ms`` (nanoGPT,
Megatron-LM, torchtitan, Hugging Face, ...). :class:`MetricScanner` reads them from the
lower-cased chunks of one file, in order:

- **non-finite**: a ``loss`` or ``grad norm`` field whose value is ``nan`` or ``inf`` (the first
  such line is the evidence; a ``number of nan iterations`` counter is not such a field);
- **loss spike**: a loss more than ``SPIKE_RATIO`` (2x) the median of the ``SPIKE_WINDOW`` (20)
  losses before it and more than ``SPIKE_Z`` (8) robust deviations above it, once 20 losses are
  known (evaluation losses, ``val``/``eval``/``test``, are not part of the series);
- **throughput drift**: over a series of at least ``DRIFT_MIN_POINTS`` (80) throughput (or time
  per step) values, the median of the last quarter at least ``DRIFT_FRACTION`` (4 %) worse than
  the median of the first quarter (after the first ``DRIFT_SKIP`` warm-up points), with at least
  75 % of the last quarter's values worse than that first median (a drift, not noise).

Each finding is a line (number, text) with what it concludes; the diagnoser ranks it with the
pattern matches (non-finite and spikes: ``numerical``; drift: ``straggler``, a symptom).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import numpy as np

SPIKE_RATIO, SPIKE_Z, SPIKE_WINDOW = 2.0, 8.0, 20
DRIFT_FRACTION, DRIFT_MIN_POINTS, DRIFT_SKIP, DRIFT_CONSISTENCY = 0.04, 80, 5, 0.75
_NUM = rb"([-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?|nan|[-+]?inf(?:inity)?)"
# On the lower-cased bytes of a chunk. Each starts with a literal so that `re` scans for it at
# C speed; what precedes is checked after a match.
LOSS = re.compile(rb"loss(?:es)?[\"']?\s*(?:[:=]\s*|\s+)[\"']?" + _NUM + rb"(?![a-z0-9])")
GRAD_NONFINITE = re.compile(rb"norm[\"']?\s*(?:[:=]\s*|\s+)[\"']?(nan|[-+]?inf(?:inity)?)(?![a-z0-9])")
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
_EVAL_BYTES = tuple(w.encode() for w in ("val", "eval", "valid", "test", "validation"))


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
        line_no = chunk.first_line + chunk.num_lines - data.count(b"\n", start)
    else:
        line_no = chunk.first_line + data.count(b"\n", 0, start)
    return line_no, chunk.line(start, end)


@dataclass(frozen=True, kw_only=True)
class MetricFinding:
    kind: str  # "non_finite", "loss_spike", "throughput_drift"
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

    def feed(self, chunk) -> None:
        """One chunk (``logscan.Chunk``), in file order."""
        low = chunk.low
        values = _floats(LOSS.findall(low))
        if len(values):
            if self.first_nonfinite is None:
                self._nonfinite("loss", LOSS, values, chunk)
            if not self._spikes:
                self._spike_candidates(values, chunk)
            self.losses.extend(values.tolist())
        if self.first_nonfinite is None:
            m = GRAD_NONFINITE.search(low)
            if m is not None:
                line_no, text = _locate(chunk, m.start())
                self.first_nonfinite = MetricFinding(kind="non_finite", line_no=line_no,
                                                     text=text, detail="grad norm is "
                                                     + m.group(1).decode())
        sample = low[:THROUGHPUT_SAMPLE_BYTES]
        for index, (regex, _) in enumerate(THROUGHPUT):
            found = regex.findall(sample)
            if not found:
                continue
            v = _floats([t.replace(b",", b"") for t in found] if any(b"," in t for t in found[:64])
                        else found)
            self.throughput.setdefault(index, []).extend(v[np.isfinite(v) & (v > 0)].tolist())
            last = _nth(regex, sample, len(found) - 1, start=max(0, len(sample) - 8192))
            if last is not None:
                self._last_line[index] = _locate(chunk, last.start())

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
                                   & (current > SPIKE_RATIO * np.nanmin(windows, axis=1)))
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
    def findings(self) -> list[MetricFinding]:
        out = [self.first_nonfinite] if self.first_nonfinite else []
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
