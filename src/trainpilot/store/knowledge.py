"""The knowledge base across runs: what was tried for an anomaly before, and how it went.

Each run's store has a ``knowledge`` table (anomaly, action, outcome); a new run consults the
stores of the runs beside it (same parent folder) before acting.
"""

from __future__ import annotations

import os
import sqlite3
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from trainpilot.store.runstore import RunStore, store_path
from trainpilot.store.schema import STORE_FILENAME


@dataclass(frozen=True, kw_only=True)
class Experience:
    """How often ``action`` was taken for ``anomaly`` across runs, and how often it worked."""

    anomaly: str
    action: str
    num_tried: int
    num_recovered: int
    num_runs: int

    @property
    def success_rate(self) -> float:
        return self.num_recovered / self.num_tried if self.num_tried else 0.0


def run_dirs(root: str | os.PathLike) -> list[Path]:
    """Run directories at ``root`` and one level below it (those holding a store)."""
    root = Path(root)
    found = [root] if store_path(root).is_file() else []
    found += sorted(p.parent for p in root.glob(f"*/{STORE_FILENAME}"))
    return found


def consult(root: str | os.PathLike, anomaly: str | None = None) -> list[Experience]:
    """Past experience with ``anomaly`` (or every anomaly) across the runs under ``root``,
    best success rate first. Unreadable stores are skipped (a run may be mid-creation)."""
    tried: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    runs: dict[tuple[str, str], set[str]] = defaultdict(set)
    for run_dir in run_dirs(root):
        try:
            store = RunStore.open_readonly(run_dir)
        except (sqlite3.Error, ValueError):
            continue
        try:
            for row in store.knowledge(anomaly):
                key = (row["anomaly"], row["action"])
                tried[key][0] += 1
                tried[key][1] += row["outcome"] == "recovered"
                runs[key].add(row["run_id"])
        except sqlite3.Error:
            pass
        finally:
            store.close()
    out = [Experience(anomaly=a, action=act, num_tried=n, num_recovered=r,
                      num_runs=len(runs[(a, act)])) for (a, act), (n, r) in tried.items()]
    return sorted(out, key=lambda e: (-e.success_rate, -e.num_tried, e.action))
