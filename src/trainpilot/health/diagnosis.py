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
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Iterable, Literal

import pydantic
import yaml

from trainpilot.health.timestamps import guess_year, parse_timestamp
from trainpilot.specs.errors import SpecError, from_pydantic

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
    def _unique_ids(self) -> "PatternLibrary":
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
    """The verdict for a set of logs. ``to_dict`` gives the CLI's JSON (exactly these keys)."""

    category: str
    root_cause: str
    evidence: str
    action: str
    confidence: float
    matches: tuple[Match, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return dict(category=self.category, root_cause=self.root_cause, evidence=self.evidence,
                    action=self.action, confidence=round(self.confidence, 2))


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


class Diagnoser:
    """Matches log lines against a pattern library and picks the root cause."""

    def __init__(self, library: PatternLibrary | None = None, *, skew_s: float = 60.0):
        self.library = library or _default_library()
        self.skew_s = skew_s
        self._compiled = [(p, re.compile(p.regex, 0 if p.case else re.IGNORECASE))
                          for p in self.library.patterns]
        # One alternation as a prefilter: most lines match nothing and cost one search.
        self._any = re.compile("|".join(f"(?:{p.regex})" for p in self.library.patterns),
                               re.IGNORECASE)

    def classify_line(self, text: str) -> tuple[str, Finding] | None:
        """(pattern id, finding) for one line, or ``None``."""
        if not self._any.search(text):
            return None
        for pattern, regex in self._compiled:
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

    def scan(self, name: str, lines: list[str], *, default_year: int) -> list[Match]:
        """Every matched line of one log."""
        out = []
        for index, text in enumerate(lines):
            hit = self.classify_line(text)
            if hit is None:
                continue
            pattern_id, finding = hit
            tier, symptom = self._defaults(finding)
            out.append(Match(file=name, line_no=index + 1, text=text.rstrip("\n"),
                             time=_time_of(lines, index, default_year), pattern_id=pattern_id,
                             finding=finding, tier=tier, symptom=symptom))
        return out

    def diagnose_texts(self, logs: dict[str, str]) -> Diagnosis:
        """Diagnose named log texts (``{name: text}``) as one failed job."""
        split = {name: text.splitlines() for name, text in logs.items()}
        year = guess_year([line for lines in split.values() for line in lines])
        matches = [m for name, lines in split.items()
                   for m in self.scan(name, lines, default_year=year)]
        return self.decide(matches, split)

    def diagnose_files(self, paths: Iterable[str | os.PathLike]) -> Diagnosis:
        """Diagnose log files (one job, possibly one file per rank or host)."""
        logs = {}
        for path in paths:
            path = Path(path)
            if not path.is_file():
                raise SpecError("LOGFILE", str(path), "valid: a readable log file")
            logs[str(path)] = path.read_text(errors="replace")
        return self.diagnose_texts(logs)

    def decide(self, matches: list[Match], lines: dict[str, list[str]] | None = None) -> Diagnosis:
        """Pick the root cause among ``matches`` (rules in the module docstring)."""
        if not matches:
            return _unknown(lines or {})
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
        return Diagnosis(category=best.finding.category,
                         root_cause=best.finding.root_cause + _also_seen(matches, best),
                         evidence=_evidence(best), action=best.finding.action,
                         confidence=confidence, matches=tuple(matches))


def _time_of(lines: list[str], index: int, year: int) -> datetime | None:
    for back in range(index, max(-1, index - _BACKTRACK_LINES), -1):
        stamp = parse_timestamp(lines[back], default_year=year)
        if stamp is not None:
            return stamp
    return None


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


_ERRORISH = re.compile(r"error|exception|fatal|failed|traceback|abort|killed", re.IGNORECASE)


def _unknown(lines: dict[str, list[str]]) -> Diagnosis:
    evidence = ""
    for name, file_lines in lines.items():
        for index in range(len(file_lines) - 1, -1, -1):
            if _ERRORISH.search(file_lines[index]):
                evidence = f"{name}:{index + 1}: {file_lines[index].strip()[:MAX_EVIDENCE_CHARS]}"
                break
        if evidence:
            break
    return Diagnosis(category="unknown", root_cause="no known failure pattern matched",
                     evidence=evidence, action="read the last error lines of each rank's log; "
                     "add a pattern to trainpilot/health/patterns.yaml once the cause is known",
                     confidence=0.1)


@lru_cache(maxsize=1)
def _default_library() -> PatternLibrary:
    return load_library()


def diagnose(paths: Iterable[str | os.PathLike], *, skew_s: float = 60.0) -> Diagnosis:
    """Diagnose log files with the shipped pattern library (see :class:`Diagnoser`)."""
    return Diagnoser(skew_s=skew_s).diagnose_files(paths)
