"""Fault diagnosis from failure logs: one category, the evidence line, a root cause and an action.

How a diagnosis is chosen (documented in docs/health.md):

1. Every line of every log is matched against the pattern library (``patterns.yaml``); the first
   matching pattern names the line. Lines without their own timestamp take the nearest earlier
   one in the same file.
2. Matches are causes or symptoms (collective timeouts, hangs, stragglers, Xid 45 are symptoms:
   they follow some other failure). Symptoms are used only when no cause matched.
3. The first failure in time wins: among causes, those within ``skew_s`` seconds of the earliest
   timed cause (clock skew between hosts, and a crash's echo on its peers) compete, together with
   causes whose time is unknown. Among them the lowest tier wins (hardware 0 < OOM 1 < storage,
   network 2 < code, data, numerics 3 < rendezvous, peer-loss 4 ...): a hardware cause outranks
   the NCCL errors and timeouts it produces.
4. Ties go to the earlier line, then the higher confidence. Other categories seen are listed in
   the root cause, so a reader sees what else happened.
5. Metric lines count too (``metriclines``): a NaN/inf loss or gradient-norm field, a loss spike,
   an fp16 loss scale that repeated overflows drove to its floor (numerical), a throughput drift
   (straggler, a symptom).
6. A log in which no pattern matched but a Python exception line (``SomeError: ...``, not a
   launcher's wrapper such as torchelastic's ChildFailedError) was printed is called user_code
   at low confidence, with the last such line as evidence: an uncaught exception that no known
   cause explains is most often the training code, its configuration or a library version
   mismatch. A log that ends on Lightning's "initializing distributed: GLOBAL_RANK: r, MEMBER:
   m/n" line stopped in the rendezvous (rendezvous, low confidence). Otherwise the verdict is
   unknown.
7. The verdict names the rank and node of its evidence line where the line (or its file name)
   says them: ``[rank3]:``, ``[Rank 3]``, ``rank: 3``, torchelastic's ``[default3]:`` (a local
   rank), NCCL's ``host:pid:tid [dev]`` prefix, syslog's host field, ``rank3.log``.

Logs are read as streams (``logscan``: gzip/zstd/bzip2/xz recognised, bounded memory), and only
lines holding one of the patterns' literal triggers are matched against the patterns.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from trainpilot.health.logscan import (
    Chunk,
    Prefilter,
    count_newlines,
    iter_chunks,
    open_log,
    text_chunks,
    triggers_of,
)
from trainpilot.health.metriclines import PRESENCE_LITERALS, MetricScanner
from trainpilot.health.timestamps import guess_year, parse_timestamp
from trainpilot.specs.errors import from_pydantic

CATEGORIES = (
    "device_oom", "host_oom", "gpu_hardware", "gpu_memory_ecc", "network", "collective_timeout",
    "hang", "rendezvous", "collective_mismatch", "numerical", "storage", "dataloader", "user_code",
    "straggler", "unknown",
)
Category = Literal[
    "device_oom", "host_oom", "gpu_hardware", "gpu_memory_ecc", "network", "collective_timeout",
    "hang", "rendezvous", "collective_mismatch", "numerical", "storage", "dataloader", "user_code",
    "straggler", "unknown",
]
MAX_EVIDENCE_CHARS = 400
_BACKTRACK_LINES = 500  # how far back an untimed line looks for a timestamp


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class CategoryDefaults(_Strict):
    tier: int = pydantic.Field(ge=0, le=9)
    symptom: bool = False


class Finding(_Strict):
    """What one pattern (or one Xid code) concludes."""

    category: Category
    confidence: float = pydantic.Field(gt=0, le=1)
    root_cause: str
    action: str
    tier: int | None = pydantic.Field(default=None, ge=0, le=9)
    symptom: bool | None = None


class Pattern(Finding):
    id: str
    regex: str
    example: str
    case: bool = False
    # Literals one of which every match contains (lower case); derived from the regex when not
    # given (logscan.triggers_of). Given where the derived ones are common words.
    triggers: list[str] | None = None

    @pydantic.model_validator(mode="after")
    def _has_triggers(self) -> Pattern:
        found = self.trigger_list()
        if not found:
            raise ValueError(f"pattern {self.id!r}: no literal of >= 3 characters every match "
                             "must contain; give `triggers`")
        if not any(t in self.example.lower() for t in found):
            raise ValueError(f"pattern {self.id!r}: its example holds none of its triggers "
                             f"{found}")
        return self

    def trigger_list(self) -> list[str]:
        if self.triggers is not None:
            return [t.lower() for t in self.triggers]
        return triggers_of(self.regex) or []

    @pydantic.field_validator("regex")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"not a valid regular expression ({err})") from None
        return value


class XidTable(_Strict):
    default: Finding
    codes: dict[int, Finding]


class PatternLibrary(_Strict):
    """The YAML pattern library, validated (unknown keys are errors)."""

    categories: dict[Category, CategoryDefaults]
    xid: XidTable
    patterns: list[Pattern]

    @pydantic.model_validator(mode="after")
    def _unique_ids(self) -> PatternLibrary:
        ids = [p.id for p in self.patterns]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"duplicate pattern ids: {', '.join(dupes)}")
        return self


@dataclass(frozen=True, kw_only=True)
class Match:
    """One log line that a pattern matched."""

    file: str
    line_no: int  # 1-based
    text: str
    time: datetime | None
    pattern_id: str
    finding: Finding
    tier: int
    symptom: bool


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """The verdict for a set of logs. ``to_dict`` gives the CLI's JSON (exactly these keys;
    ``rank`` and ``node`` None where the evidence does not say)."""

    category: str
    root_cause: str
    evidence: str
    action: str
    confidence: float
    rank: int | None = None
    node: str | None = None
    matches: tuple[Match, ...] = ()
    warnings: tuple[str, ...] = ()  # about the input (a compressed log cut short), not the run

    def to_dict(self) -> dict[str, object]:
        return dict(category=self.category, root_cause=self.root_cause, evidence=self.evidence,
                    action=self.action, confidence=round(self.confidence, 2), rank=self.rank,
                    node=self.node)


def load_library(path: str | os.PathLike | None = None) -> PatternLibrary:
    """Load and validate a pattern library (default: the one shipped with trainpilot)."""
    if path is None:
        text = resources.files("trainpilot.health").joinpath("patterns.yaml").read_text()
        source = "patterns.yaml"
    else:
        text, source = Path(path).read_text(), str(path)
    try:
        return PatternLibrary.model_validate(yaml.safe_load(text))
    except pydantic.ValidationError as err:
        raise from_pydantic(err, doc="patterns", model_cls=PatternLibrary, source=source) from None


METRIC_FINDINGS = {
    "non_finite": Finding(category="numerical", confidence=0.8,
                          root_cause="the training loss or gradient norm became non-finite "
                                     "(NaN/inf) in the metric lines",
                          action="restart from the last checkpoint before the first NaN with a "
                                 "lower learning rate, gradient clipping, or bf16 instead of fp16; "
                                 "check the batch that preceded it"),
    "loss_spike": Finding(category="numerical", confidence=0.6,
                          root_cause="a loss spike in the metric lines",
                          action="look at the data batch of that step; lower the learning rate, "
                                 "clip gradients, or roll back past the spike and skip batches"),
    "loss_scale_collapse": Finding(category="numerical", confidence=0.8,
                                   root_cause="fp16 dynamic loss scaling collapsed: gradient "
                                              "overflow kept repeating while the loss scale fell "
                                              "to its floor (numerical instability; each overflow "
                                              "skips a step)",
                                   action="switch to bf16, or lower the learning rate and add "
                                          "warm-up / gradient clipping; resume from a checkpoint "
                                          "before the overflows began and check the batches "
                                          "there"),
    "gpu_spin": Finding(category="hang", confidence=0.5,
                        root_cause="GPUs 'busy' without doing work: a kernel spinning, as a "
                                   "collective does while it waits for a peer that never joins",
                        action="dump every rank's stacks (py-spy dump, or "
                               "TORCH_NCCL_DUMP_ON_TIMEOUT=1 with a collective timeout) and find "
                               "the rank that did not reach the collective; rerun with "
                               "NCCL_DEBUG=INFO"),
    "throughput_drift": Finding(category="straggler", confidence=0.5,
                                root_cause="throughput drifted down over the run in the metric "
                                           "lines (a slowing node, thermal throttling, a leak, "
                                           "growing data or checkpoint cost)",
                                action="compare per-rank step times (trainpilot monitor), GPU "
                                       "clocks and temperatures; look for a growing host-side "
                                       "cost (memory, data loading, logging)"),
}


class Diagnoser:
    """Matches log lines against a pattern library and picks the root cause."""

    def __init__(self, library: PatternLibrary | None = None, *, skew_s: float = 60.0,
                 metric_rules: bool = True):
        self.library = library or _default_library()
        self.skew_s, self.metric_rules = skew_s, metric_rules
        self._compiled = [(p, re.compile(p.regex, 0 if p.case else re.IGNORECASE))
                          for p in self.library.patterns]
        # The metric rules' presence literals ride in the same automaton (no pattern owns them).
        self._prefilter = Prefilter([t for p in self.library.patterns for t in p.trigger_list()]
                                    + [lit.decode() for lit in PRESENCE_LITERALS])
        self._pattern_triggers = [p.trigger_list() for p in self.library.patterns]
        # Which patterns a candidate line is worth trying: every trigger it holds (overlapping
        # matches of one automaton over the line, so the same as ``t in line`` for each trigger),
        # mapped to its patterns. Testing every pattern's triggers one by one cost 0.3 ms a
        # line, and a trigger as common as a Megatron iteration line's makes most lines
        # candidates: 5 MB/s where the automaton keeps 50+.
        self._trigger_list = self._prefilter.triggers  # the same sorted, de-duplicated set
        owners: dict[str, list[int]] = {t: [] for t in self._trigger_list}
        for k, triggers in enumerate(self._pattern_triggers):
            for t in set(triggers):
                owners[t].append(k)
        self._owners = [owners[t] for t in self._trigger_list]
        try:
            import ahocorasick_rs

            self._line_ac: Any = ahocorasick_rs.AhoCorasick(
                self._trigger_list, matchkind=ahocorasick_rs.MATCHKIND_STANDARD)
        except ImportError:  # pragma: no cover - the dependency is declared
            self._line_ac = None

    def _worth_trying(self, low_line: str) -> list[int]:
        """Indices of the patterns one of whose triggers the (lower-cased) line holds, in
        library order."""
        if self._line_ac is None:  # pragma: no cover - the dependency is declared
            return [k for k, triggers in enumerate(self._pattern_triggers)
                    if any(t in low_line for t in triggers)]
        found = {i for i, _, _ in self._line_ac.find_matches_as_indexes(low_line,
                                                                       overlapping=True)}
        if not found:
            return []
        return sorted({k for i in found for k in self._owners[i]})

    def classify_line(self, text: str, *, only: Iterable[int] | None = None,
                      ) -> tuple[str, Finding] | None:
        """(pattern id, finding) for one line, or ``None``; ``only``: the indices of the patterns
        worth trying (those whose triggers the line holds), in library order."""
        chosen = self._compiled if only is None else [self._compiled[k] for k in only]
        for pattern, regex in chosen:
            found = regex.search(text)
            if found:
                if "xid" in regex.groupindex:
                    return pattern.id, self._xid_finding(int(found.group("xid")))
                return pattern.id, pattern
        return None

    def _xid_finding(self, code: int) -> Finding:
        finding = self.library.xid.codes.get(code, self.library.xid.default)
        return finding.model_copy(update=dict(root_cause=finding.root_cause.format(xid=code)))

    def _defaults(self, finding: Finding) -> tuple[int, bool]:
        base = self.library.categories.get(finding.category, CategoryDefaults(tier=9))
        tier = base.tier if finding.tier is None else finding.tier
        symptom = base.symptom if finding.symptom is None else finding.symptom
        return tier, symptom

    def _match(self, name: str, line_no: int, text: str, pattern_id: str, finding: Finding,
               time: datetime | None) -> Match:
        tier, symptom = self._defaults(finding)
        return Match(file=name, line_no=line_no, text=text.rstrip("\r\n"), time=time,
                     pattern_id=pattern_id, finding=finding, tier=tier, symptom=symptom)

    def scan_chunks(self, name: str, chunks: Iterable[Chunk], *, default_year: int | None = None,
                    ) -> tuple[list[Match], Tail]:
        """(every matched line of one log, its tail: the last error-ish, exception and
        non-blank lines, for a verdict without a match). Streams: only a chunk and a small
        look-back are in memory."""
        out: list[Match] = []
        metrics = MetricScanner() if self.metric_rules else None
        tail = Tail()
        lookback = b""
        year = default_year
        for chunk in chunks:
            data = chunk.data
            if year is None:
                year = guess_year(data[:1 << 18].decode("utf-8", "replace").splitlines()[:2000])
            counted, line_no = 0, chunk.first_line
            dropped: list[tuple[int, int]] = []
            spans = self._prefilter.line_spans(chunk.low, dropped=dropped)
            for start, end in spans:
                line_no += count_newlines(data, counted, start)
                counted = start
                line = chunk.line(start, end)
                only = self._worth_trying(line.lower())
                if not only:
                    continue
                hit = self.classify_line(line, only=only)
                if hit is None:
                    continue
                stamp = _time_before(lookback + data, len(lookback) + start, year)
                out.append(self._match(name, line_no, line, hit[0], hit[1], stamp))
            if metrics is not None:
                metrics.feed(chunk, present=Prefilter.held(chunk.low, PRESENCE_LITERALS,
                                                            spans + dropped))
            tail = tail.after(chunk)
            lookback = data[-_LOOKBACK_BYTES:]
        if metrics is not None:
            for f in metrics.findings():
                finding = METRIC_FINDINGS[f.kind]
                finding = finding.model_copy(update=dict(
                    root_cause=f"{finding.root_cause}: {f.detail}"))
                out.append(self._match(name, f.line_no, f.text, f"metric:{f.kind}", finding,
                                       parse_timestamp(f.text, default_year=year or 1970)))
        out.sort(key=lambda m: m.line_no)
        return out, tail

    def scan(self, name: str, lines: list[str], *, default_year: int) -> list[Match]:
        """Every matched line of one log given as lines."""
        return self.scan_chunks(name, text_chunks("\n".join(lines) + "\n"),
                                default_year=default_year)[0]

    def diagnose_texts(self, logs: dict[str, str]) -> Diagnosis:
        """Diagnose named log texts (``{name: text}``) as one failed job."""
        year = guess_year([line for text in logs.values()
                           for line in text[:1 << 20].splitlines()])
        matches: list[Match] = []
        tails: dict[str, Tail] = {}
        for name, text in logs.items():
            found, tail = self.scan_chunks(name, text_chunks(text), default_year=year)
            matches += found
            tails[name] = tail
        return self.decide(matches, tails)

    def diagnose_files(self, paths: Iterable[str | os.PathLike]) -> Diagnosis:
        """Diagnose log files (one job, possibly one file per rank or host; plain or gzip/zstd/
        bzip2/xz). SpecError for a missing, empty or binary file."""
        paths = [Path(p) for p in paths]
        streams = [(str(p), *open_log(p)) for p in paths]  # every file checked before reading
        matches: list[Match] = []
        tails: dict[str, Tail] = {}
        try:
            for name, stream, _ in streams:
                found, tail = self.scan_chunks(name, iter_chunks(stream))
                matches += found
                tails[name] = tail
        finally:
            for _, stream, _ in streams:
                stream.close()
        damage = [(name, getattr(stream, "damage", None)) for name, stream, _ in streams]
        warnings = tuple(f"{name}: {why}" for name, why in damage if why)
        return replace(self.decide(matches, tails), warnings=warnings)

    def decide(self, matches: list[Match], tails: dict[str, Tail] | None = None,
               ) -> Diagnosis:
        """Pick the root cause among ``matches`` (rules in the module docstring)."""
        if not matches:
            return _unmatched(tails or {})
        causes = [m for m in matches if not m.symptom]
        pool = causes or matches
        timed = [m.time for m in pool if m.time is not None]
        if timed:
            first = min(timed)
            pool = [m for m in pool if m.time is None
                    or (m.time - first).total_seconds() <= self.skew_s]
        order = {id(m): i for i, m in enumerate(matches)}
        best = min(pool, key=lambda m: (m.tier, m.time or datetime.max, -m.finding.confidence,
                                        order[id(m)]))
        same = [m for m in matches if m.finding.category == best.finding.category]
        agreeing_patterns = {m.pattern_id for m in same}
        confidence = min(0.99, best.finding.confidence + 0.05 * (len(agreeing_patterns) - 1))
        rank, node = locate(best.text, best.file)
        return Diagnosis(category=best.finding.category,
                         root_cause=best.finding.root_cause + _also_seen(matches, best),
                         evidence=_evidence(best), action=best.finding.action,
                         confidence=confidence, rank=rank, node=node, matches=tuple(matches))


_LOOKBACK_BYTES = 1 << 16
_RANK_PATTERNS = (re.compile(r"\[rank(\d+)\]"), re.compile(r"\[Rank (\d+)\]"),
                  re.compile(r"\bPG(?: ID)? \d+(?: PG GUID [^\]]*)? Rank (\d+)\]"),
                  re.compile(r"\brank\s*[:=]\s*(\d+)\b", re.I),
                  re.compile(r"\blocal_rank\s*[:=]\s*(\d+)\b"),
                  re.compile(r"\[default(\d+)\]:"), re.compile(r"\bRank (\d+)\b"),
                  re.compile(r"^\[(?:\d+,)?(\d+)\]<std(?:out|err)>:"))
_NODE_PATTERNS = (
    re.compile(r"^(?:[\d.]+:\s+)?(?:\[\d+\]\s+)?([A-Za-z][\w.-]*):\d+:\d+ \[\d+\]"),  # NCCL
    re.compile(r"^(?:<\d+>)?\w{3} +\d{1,2} \d\d:\d\d:\d\d ([\w.-]+) "),  # syslog
    re.compile(r"\bhost\s*:\s*([\w.-]+)"),
)
_FILE_RANK = re.compile(r"rank[_-]?(\d+)", re.I)
_FILE_NODE = re.compile(r"((?:node|host|gpu|worker)[\w]*?\d+)", re.I)


def locate(text: str, file: str) -> tuple[int | None, str | None]:
    """(rank, node) that a log line, or failing that its file name, names."""
    rank = next((int(m.group(1)) for rx in _RANK_PATTERNS if (m := rx.search(text))), None)
    node = next((m.group(1) for rx in _NODE_PATTERNS if (m := rx.search(text))), None)
    name = Path(file).name
    if rank is None and (m := _FILE_RANK.search(name)):
        rank = int(m.group(1))
    if node is None and (m := _FILE_NODE.search(name)):
        node = m.group(1)
    return rank, node


def _time_before(data: bytes, pos: int, year: int) -> datetime | None:
    """The timestamp of the line at byte ``pos``, else of the nearest earlier line that has
    one (at most ``_BACKTRACK_LINES`` back)."""
    end = data.find(b"\n", pos)
    end = len(data) if end < 0 else end
    for _ in range(_BACKTRACK_LINES):
        start = data.rfind(b"\n", 0, pos) + 1
        head = data[start:min(end, start + 160)].decode("utf-8", "replace")
        stamp = parse_timestamp(head, default_year=year)
        if stamp is not None:
            return stamp
        if start == 0:
            return None
        end, pos = start - 1, start - 1
    return None


def _last_line(chunk: Chunk, rx: re.Pattern[bytes]) -> str | None:
    """The last line of a chunk's last 64 KB where ``rx`` matches its lower-cased text, as
    'line_no: text'."""
    data = chunk.low
    base = max(0, len(data) - (1 << 16))
    starts = [m.start() for m in rx.finditer(data, base)]
    if not starts:
        return None
    pos = starts[-1]
    start = data.rfind(b"\n", 0, pos) + 1
    end = data.find(b"\n", pos)
    return _numbered(chunk, start, len(data) if end < 0 else end)


def _last_nonempty_line(chunk: Chunk) -> str | None:
    """The chunk's last line that is not blank, as 'line_no: text'."""
    data = chunk.low
    base = max(0, len(data) - (1 << 16))  # the chunk's last 64 KB, as for the other tail lines
    end = base + len(data[base:].rstrip())
    if end == base:
        return None
    return _numbered(chunk, data.rfind(b"\n", 0, end) + 1, end)


def _numbered(chunk: Chunk, start: int, end: int) -> str:
    """The chunk's line from byte ``start`` to ``end`` as 'line_no: text'. The tail lines sit
    near the chunk's end, so the breaks after ``start`` are counted, not the megabytes before."""
    line_no = chunk.first_line + chunk.num_lines - count_newlines(chunk.low, start)
    return f"{line_no}: {chunk.line(start, end).strip()}"


@dataclass(frozen=True)
class Tail:
    """The last error-ish line, the last Python exception line and the last line of a log so
    far (for a verdict without a pattern match), each as 'line_no: text'."""

    errorish: str | None = None
    exception: str | None = None
    last: str | None = None

    def after(self, chunk: Chunk) -> Tail:
        return Tail(_last_line(chunk, _ERRORISH) or self.errorish,
                    _last_line(chunk, _EXCEPTION) or self.exception,
                    _last_nonempty_line(chunk) or self.last)


def _evidence(match: Match) -> str:
    text = match.text.strip()
    if len(text) > MAX_EVIDENCE_CHARS:
        text = text[:MAX_EVIDENCE_CHARS - 3] + "..."
    return f"{match.file}:{match.line_no}: {text}"


def _also_seen(matches: list[Match], best: Match) -> str:
    counts: dict[str, int] = {}
    for m in matches:
        if m.finding.category != best.finding.category:
            counts[m.finding.category] = counts.get(m.finding.category, 0) + 1
    if not counts:
        return ""
    listed = ", ".join(f"{c} ({n} line{'s' * (n > 1)})" for c, n in
                       sorted(counts.items(), key=lambda kv: -kv[1]))
    return f". Also seen, later or as consequences: {listed}"


_ERRORISH = re.compile(rb"error|exception|fatal|failed|traceback|abort|killed")  # on lower case
# A Python exception line, "pkg.mod.SomeError: message" (or the bare name) at the start of a
# line after an optional log prefix such as "[rank1]: ", horovodrun's "[6]<stderr>:", Open MPI's
# --tag-output "[1,6]<stderr>:" or "E   "; on lower case. Launcher
# wrappers that only say a child failed (torchelastic's ChildFailedError, subprocess's
# CalledProcessError) are not the exception itself.
_EXCEPTION = re.compile(
    rb"^(?:\[[^\]\n]{0,40}\](?:<std(?:out|err)>)?:?\s*|e\s+)?\s*(?:[a-z_][\w]*\.)*"
    rb"(?!childfailederror|calledprocesserror)(?:[a-z_]\w*error|(?:[a-z_]\w*)?exception)(?::[ \t]|:?[ \t]*\r?$)",
    re.M)


# Lightning's line as each rank enters torch.distributed's rendezvous (lightning_fabric/utilities/
# distributed.py "Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world}";
# pytorch_lightning <= 1.5 "initializing ddp: GLOBAL_RANK: ..."). A log whose last line is this
# one stopped where the ranks meet.
_AT_RENDEZVOUS = re.compile(r"initializing (?:ddp|distributed): GLOBAL_RANK: \d+, MEMBER: \d+/\d+",
                            re.I)


def _evidence_of(name: str, line: str) -> str:
    return f"{name}:{line}"[:MAX_EVIDENCE_CHARS + len(name) + 12]


def _read_from(name: str, line: str, **verdict: Any) -> Diagnosis:
    """A verdict whose evidence is ``line`` ('line_no: text') of log ``name``, with the rank and
    node the line names."""
    rank, node = locate(line.split(": ", 1)[1], name)
    return Diagnosis(evidence=_evidence_of(name, line), rank=rank, node=node, **verdict)


def _unmatched(tails: dict[str, Tail]) -> Diagnosis:
    """The verdict when no pattern matched (module docstring, rule 6): user_code on an
    uncaught Python exception, rendezvous on a log that ends at Lightning's rendezvous line,
    else unknown."""
    for name, tail in tails.items():
        if tail.exception:
            kind = _EXCEPTION_NAME.search(tail.exception.split(": ", 1)[1])
            what = kind.group(1) if kind else "an exception"
            return _read_from(
                name, tail.exception, category="user_code", confidence=0.3,
                root_cause=f"an uncaught Python exception ({what}) that no known failure "
                "pattern explains: most often the training code, its configuration or a "
                "library version mismatch",
                action="read the traceback that ends at this line (the innermost frame in the "
                "project's own code first); check the configuration and the library versions "
                "it names")
    for name, tail in tails.items():
        if tail.last and _AT_RENDEZVOUS.search(tail.last):
            return _read_from(
                name, tail.last, category="rendezvous", confidence=0.4,
                root_cause="the log stops where the ranks meet (Lightning's \"initializing "
                "distributed\" line is its last): not every rank joined the rendezvous (the "
                "launcher started only some processes, e.g. sbatch without srun, or a wrong "
                "MASTER_ADDR / port)",
                action="check that every rank was launched (under Slurm, run the script with "
                "srun and --ntasks-per-node = GPUs per node) and that all reach MASTER_ADDR: "
                "MASTER_PORT")
    evidence = next((_evidence_of(name, tail.errorish) for name, tail in tails.items()
                     if tail.errorish), "")
    return Diagnosis(category="unknown", root_cause="no known failure pattern matched",
                     evidence=evidence, action="read the last error lines of each rank's log; "
                     "add a pattern to trainpilot/health/patterns.yaml once the cause is known",
                     confidence=0.1)


_EXCEPTION_NAME = re.compile(r"((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception))\b")


@lru_cache(maxsize=1)
def _default_library() -> PatternLibrary:
    return load_library()


def diagnose(paths: Iterable[str | os.PathLike], *, skew_s: float = 60.0) -> Diagnosis:
    """Diagnose log files with the shipped pattern library (see :class:`Diagnoser`)."""
    return Diagnoser(skew_s=skew_s).diagnose_files(paths)
