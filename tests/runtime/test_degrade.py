"""Writers that a full disk must not turn into a crash, on a real full device (/dev/full
answers every write with ENOSPC)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from trainpilot.runtime.degrade import LineFile, QuietStream, disk_of, is_disk_error

FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full")


def test_a_print_to_a_full_disk_is_dropped_not_raised():
    raw = open(FULL, "w", buffering=1)
    with pytest.raises(OSError) as err:  # the negative control: a plain stream raises
        raw.write("x\n")
    assert err.value.errno == errno.ENOSPC
    quiet = QuietStream(open(FULL, "w", buffering=1))
    assert quiet.write("a line\n") == 7
    quiet.flush()
    assert quiet.dropped == 7


def test_line_file_keeps_lines_until_the_disk_takes_them(tmp_path, monkeypatch):
    seen = []
    lines = LineFile(FULL, on_degraded=lambda kind, payload: seen.append((kind, payload)))
    lines.write({"step": 1})
    lines.write({"step": 2})
    assert [k for k, _ in seen] == ["disk_full"]  # told once
    assert seen[0][1]["path"] == str(FULL) and "cannot be written" in seen[0][1]["message"]
    lines.path = tmp_path / "metrics.jsonl"  # space again (another disk here)
    lines.write({"step": 3})
    assert lines.path.read_text().splitlines() == ['{"step": 1}', '{"step": 2}', '{"step": 3}']


def test_disk_errors_are_told_from_bugs(tmp_path):
    import sqlite3

    assert is_disk_error(OSError(errno.ENOSPC, "full"))
    assert is_disk_error(sqlite3.OperationalError("database or disk is full"))
    assert not is_disk_error(OSError(errno.ENOENT, "missing"))
    assert not is_disk_error(ValueError("bug"))
    info = disk_of(tmp_path / "not" / "yet")
    assert info["mount"] and info["total_bytes"] > 0
