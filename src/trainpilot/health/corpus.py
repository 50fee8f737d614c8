"""The diagnosis's validation set: real failure logs from public issue threads, shipped in
``data/failure_logs.yaml`` (each case cites its thread), split once into ``authoring`` (patterns
were written and revised against them) and ``held_out`` (never looked at while authoring).

``validate()`` diagnoses every case and reports accuracy per split and per category; ``trainpilot
diagnose --validate`` prints it, and the test suite gates the held-out accuracy.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from importlib import resources
from typing import Literal

import pydantic
import yaml

from trainpilot.health.diagnosis import Category, Diagnoser
from trainpilot.specs.errors import from_pydantic

Split = Literal["authoring", "held_out"]
HELD_OUT_TARGET = 0.90
# What CI gates on: a regression floor, not the target. Measured blind: batch 1 82 % (87 % once
# two messages its issues named were added), batch 2 67 %, batch 3 60 %, batch 4 4/7 (9/14 over
# the whole batch), batch 5 3/4 (6/7 over the whole batch), batch 6 2/3, batch 7 6/9 (12/17 over
# the whole batch), batch 8 6/7 (12/14), batch 9 8/9 (13/17), batch 10 4/8 (10/16), batch 11
# 5/7 (11/14), batch 12 6/7 (8/13), batch 13 6/6 (12/12), batch 14 2/4 (3/7), batch 15 2/4
# (4/7), batch 16 1/1 (2/2), batch 17 3/3 (6/6), batch 18 4/4 (7/7), batch 19 2/2 (3/4), batch 20 5/5 (7/9), batch 21 4/4 (7/8), batch 22 1/4 (3/8), batch 23 4/5 (7/9), batch 24 2/3 (3/5), batch 25 1/3 (3/5), batch 26 3/3 (6/6), batch 27 6/6 (9/11), batch 28 8/8 (14/15), batch 29 2/3 (4/5), batch 30 5/5 (9/9), batch 31 2/3 (5/6), batch 32 3/3 (4/5), batch 33 5/5 (9/9), batch 34 3/4 (7/8), batch 35 2/6 (4/11), batch 36 3/5 (8/10), batch 37 4/5 (6/10), batch 38 1/2 (2/4), batch 39 3/4 (6/8), batch 40 4/6 (7/11), batch 41 5/5 (9/9), batch 42 3/3 (6/6), batch 43 8/9 (15/17), batch 44 2/3 (5/6), batch 45 3/3 (6/6), batch 46 3/4 (6/8), batch 47 5/5 (9/10), batch 48 1/2 (2/3), batch 49 0/3 (0/6), batch 50 4/4 (7/8), batch 51 5/6 (10/11), batch 52 3/5 (7/10), batch 53 8/10 (14/19), batch 54 2/2 (3/4), batch 55 4/4 (7/7), batch 56 4/5 (5/9), batch 57 5/6 (10/12), batch 58 5/5 (7/9), batch 59 4/6 (7/12), batch 60 3/3 (6/6), batch 61 5/6 (10/11), batch 62 2/2 (4/4), batch 63 6/7 (11/13), batch 64 3/6 (7/11), batch 65 4/5 (7/9), batch 66 0/4 (1/8), batch 67 5/6 (7/11), batch 68 5/6 (11/12), batch 69 5/6 (10/12), batch 70 3/4 (5/7), batch 71 4/5 (7/9), batch 72 2/3 (4/5), batch 73 5/5 (10/10), batch 74 5/5 (9/10), batch 75 4/7 (9/13), batch 76 2/6 (6/12), batch 77 3/3 (5/5); under a brief with category definitions: batch 78 4/4 (7/7), batch 79 5/6 (10/11), batch 80 5/5 (9/9), batch 81 5/5 (7/10), batch 82 5/6 (11/12), batch 83 3/6 (7/11), batch 84 4/4 (7/7), batch 85 1/2 (3/4), batch 86 3/4 (5/7), batch 87 5/5 (8/10), batch 88 7/8 (14/15), batch 89 3/3 (5/5), batch 90 7/9 (11/18), batch 91 2/2 (3/3), batch 92 2/3 (4/5), batch 93 7/7 (13/13), batch 94 4/4 (7/7), batch 95 5/5 (7/9), batch 96 3/3 (5/6), batch 97 2/4 (6/8), batch 98 1/1 (1/1), batch 99 2/3 (5/6); pooled 451/535 = 84 % (no longer blind: patterns, and the uncaught-exception fallback,
# were added after earlier batches were read, and DDP's unused-parameter error was relabelled
# user_code by the definitions of 2026-12-08: 444/535 under the labels as collected).
HELD_OUT_GATE = 0.75


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)


class Case(_Strict):
    id: str
    url: str = pydantic.Field(pattern=r"^https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+$")
    project: str
    category: Category
    split: Split
    # Collection round: each batch is split by its own rule, so a later batch never moves a case
    # of an earlier one. Batch 2 was gathered blind (its collector never saw the patterns).
    batch: int = pydantic.Field(default=1, ge=1)
    why: str = ""  # what in the thread establishes the category (batch 2 onwards)
    logs: dict[str, str]


class Corpus(_Strict):
    cases: list[Case]

    @pydantic.model_validator(mode="after")
    def _unique(self) -> Corpus:
        ids = [c.id for c in self.cases]
        urls = [c.url for c in self.cases]
        if len(set(ids)) != len(ids) or len(set(urls)) != len(urls):
            raise ValueError("case ids and urls must be unique")
        return self


def load_corpus() -> Corpus:
    text = resources.files("trainpilot.health").joinpath("data/failure_logs.yaml").read_text(
        encoding="utf-8")
    try:
        return Corpus.model_validate(yaml.safe_load(text))
    except pydantic.ValidationError as err:
        raise from_pydantic(err, doc="failure_logs", model_cls=Corpus) from None


def expected_splits(cases: list[Case]) -> dict[str, str]:
    """The split rule, per batch: cases ordered by sha256(url); the first half, rounded up, held
    out."""
    held: set[str] = set()
    for batch in {c.batch for c in cases}:
        order = sorted((c for c in cases if c.batch == batch),
                       key=lambda c: hashlib.sha256(c.url.encode()).hexdigest())
        held |= {c.id for c in order[:(len(order) + 1) // 2]}
    return {c.id: "held_out" if c.id in held else "authoring" for c in cases}


@dataclass(frozen=True, kw_only=True)
class Outcome:
    case: Case
    got: str
    evidence: str

    @property
    def correct(self) -> bool:
        return self.got == self.case.category


@dataclass(frozen=True, kw_only=True)
class Report:
    outcomes: list[Outcome]

    def accuracy(self, split: str | None = None, category: str | None = None,
                 batch: int | None = None) -> tuple[int, int]:
        """(correct, total) over the cases of ``split``, ``category`` and ``batch`` (None:
        all)."""
        chosen = [o for o in self.outcomes if (split is None or o.case.split == split)
                  and (category is None or o.case.category == category)
                  and (batch is None or o.case.batch == batch)]
        return sum(o.correct for o in chosen), len(chosen)

    def batches(self) -> list[int]:
        return sorted({o.case.batch for o in self.outcomes})

    def by_category(self, split: str) -> dict[str, tuple[int, int]]:
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for o in self.outcomes:
            if o.case.split == split:
                out[o.case.category][0] += o.correct
                out[o.case.category][1] += 1
        return {k: (v[0], v[1]) for k, v in sorted(out.items())}

    def to_dict(self) -> dict:
        out: dict = {"splits": {}, "misses": []}
        for split in ("authoring", "held_out"):
            ok, total = self.accuracy(split)
            out["splits"][split] = dict(correct=ok, total=total,
                                        accuracy=ok / total if total else None,
                                        by_category={k: dict(correct=a, total=b) for k, (a, b)
                                                     in self.by_category(split).items()})
        out["held_out_by_batch"] = {
            str(b): dict(zip(("correct", "total"), self.accuracy("held_out", batch=b)))
            for b in self.batches()}
        out["held_out_target"] = HELD_OUT_TARGET
        out["misses"] = [dict(id=o.case.id, url=o.case.url, split=o.case.split, batch=o.case.batch,
                              expected=o.case.category, got=o.got, evidence=o.evidence)
                         for o in self.outcomes if not o.correct]
        return out


def validate(diagnoser: Diagnoser | None = None, corpus: Corpus | None = None) -> Report:
    """Diagnose every case of the corpus."""
    diagnoser = diagnoser or Diagnoser()
    corpus = corpus or load_corpus()
    outcomes = []
    for case in corpus.cases:
        result = diagnoser.diagnose_texts(case.logs)
        outcomes.append(Outcome(case=case, got=result.category, evidence=result.evidence))
    return Report(outcomes=outcomes)
