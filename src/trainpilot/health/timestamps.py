"""Timestamps in the log formats training jobs produce, so many ranks' logs can be ordered.

Recognised (searched in a line's first 120 characters): ISO 8601 and Python logging
(``2024-06-03 12:00:05,123``, ``2024-06-03T12:00:05.123Z``, with offsets), ``2024/06/03 12:00:05``,
glog / c10 (``E0603 12:00:05.123456`` and ``[rank0]:[E603 12:00:05.483726517 ...]``; no year),
``dmesg -T`` (``[Mon Jun  3 12:00:05 2024]``) and syslog (``Jun  3 12:00:05 host kernel: ...``;
no year). Raw ``dmesg`` seconds-since-boot are not wall-clock time and are ignored.
All results are naive UTC datetimes; formats without a year take ``default_year``.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_MONTHS = {m: i for i, m in enumerate(
    ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), 1)}
_MON = r"(?P<mon>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"

_ISO = re.compile(
    r"(?P<y>\d{4})[-/](?P<m>\d{2})[-/](?P<d>\d{2})[T ](?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2})"
    r"(?:[.,](?P<f>\d{1,9}))?\s?(?P<tz>Z|[+-]\d{2}:?\d{2}(?!\d))?")
_GLOG = re.compile(
    r"(?:^|[\[\s:])[IWEF](?P<m>[01]?\d)(?P<d>\d{2}) (?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2})"
    r"\.(?P<f>\d{1,9})")
_DMESG_T = re.compile(
    r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) " + _MON +
    r" +(?P<d>\d{1,2}) (?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2}) (?P<y>\d{4})\]")
_SYSLOG = re.compile(
    r"^(?:<\d+>)?" + _MON + r" +(?P<d>\d{1,2}) (?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2})\b")

HEAD_CHARS = 120


def _micro(frac: str | None) -> int:
    return int((frac or "0")[:6].ljust(6, "0"))


def _build(y: int, m: int, d: int, hh: str, mm: str, ss: str, frac: str | None) -> datetime | None:
    try:
        return datetime(y, m, d, int(hh), int(mm), int(ss), _micro(frac))
    except ValueError:
        return None


def parse_timestamp(line: str, *, default_year: int) -> datetime | None:
    """The wall-clock time a log line carries, or ``None``."""
    head = line[:HEAD_CHARS]
    match = _ISO.search(head)
    if match:
        g = match.groupdict()
        stamp = _build(int(g["y"]), int(g["m"]), int(g["d"]), g["H"], g["M"], g["S"], g["f"])
        if stamp is not None and g["tz"] and g["tz"] != "Z":
            sign = 1 if g["tz"][0] == "+" else -1
            digits = g["tz"][1:].replace(":", "")
            offset = timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
            stamp = (stamp - sign * offset)
        return stamp
    match = _DMESG_T.search(head)
    if match:
        g = match.groupdict()
        return _build(int(g["y"]), _MONTHS[g["mon"].lower()], int(g["d"]), g["H"], g["M"],
                      g["S"], None)
    match = _GLOG.search(head)
    if match:
        g = match.groupdict()
        return _build(default_year, int(g["m"]), int(g["d"]), g["H"], g["M"], g["S"], g["f"])
    match = _SYSLOG.search(head)
    if match:
        g = match.groupdict()
        return _build(default_year, _MONTHS[g["mon"].lower()], int(g["d"]), g["H"], g["M"],
                      g["S"], None)
    return None


def guess_year(lines: list[str]) -> int:
    """The year to give year-less formats: the latest year an ISO stamp in ``lines`` names,
    else this year."""
    years = [int(m.group("y")) for line in lines[:20000]
             if (m := _ISO.search(line[:HEAD_CHARS]))]
    return max(years) if years else datetime.now(UTC).year
