"""The dashboard's cluster view of a multi-node run: its hosts, the links between them and what
happened to both, read from the run directory's own records.

Sources (every one written by the job itself): ``launcher.jsonl`` (each host's launches and how
they ended, link flags, drain requests), ``links/`` (the hosts' link probes,
``runtime.elastic.linkprobe``), ``faults.jsonl`` (faults made on hosts and links, with the
cluster harness's or the operator's records), ``drained.json`` (the last drain) and the
store's restart events (which source each recovery restored from). A run on one host has no
cluster view (``{}``).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path
from typing import Any

from trainpilot.fsio import read_jsonl

_HOST_EVENTS = ("drain_requested", "drain_refused")


def cluster_section(run_dir: Path, *, restarts: list[dict[str, Any]] | None = None,
                    ) -> dict[str, Any]:
    """Hosts, links and cluster events of the run in ``run_dir``; ``{}`` for a one-host run.

    ``restarts``: the store's restart events (payloads with a step), shown among the events.
    """
    from trainpilot.runtime.elastic.linkprobe import LINKS, judge, link_speeds, read_probes

    run_dir = Path(run_dir)
    launcher = read_jsonl(run_dir / "launcher.jsonl")
    hosts: dict[str, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    for r in launcher:
        host = r.get("host")
        if not isinstance(host, str):
            continue
        entry = hosts.setdefault(host, dict(host=host, launches=0, state="running",
                                            flagged_rounds=0, probe_live=False))
        kind = r.get("kind")
        if kind == "launch_start":
            entry["launches"] += 1
            entry["state"] = "running"
        elif kind == "launch_end":
            entry["state"] = r.get("outcome") or "ended"
        elif kind == "launcher_lost":
            entry["state"] = "lost"
        elif kind == "link_degraded":
            entry["flagged_rounds"] = int(r.get("rounds") or 0)
            if r.get("rounds") == 1:  # the start of a flagged spell; later rounds repeat it
                events.append(_event(r, "link_degraded", host,
                                     f"link under half the others' speed "
                                     f"({r.get('mbit_s', 0):.0f} vs "
                                     f"{r.get('others_mbit_s', 0):.0f} Mbit/s)"))
        if kind in _HOST_EVENTS:
            events.append(_event(r, kind, host, str(r.get("reason") or r.get("why") or "")))
    if len(hosts) < 2:
        return {}
    for path in (run_dir / LINKS / "hosts").glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            live = json.loads(path.read_text())
            if live.get("host") in hosts:
                hosts[live["host"]]["probe_live"] = True
                hosts[live["host"]]["address"] = live.get("address")
    probes = [r for r in read_probes(run_dir) if r.get("kind") == "probe"]
    speeds = link_speeds(probes)
    by_link: dict[frozenset, list[dict[str, Any]]] = {}
    for r in probes:
        by_link.setdefault(frozenset((r["src"], r["dst"])), []).append(r)
    links = []
    for pair, mine in sorted(by_link.items(), key=lambda item: sorted(item[0])):
        a, b = sorted(pair)
        links.append(dict(a=a, b=b, mbit_s=speeds.get(pair), probes=len(mine),
                          failed=sum(not r.get("ok") for r in mine),
                          probe_bytes=sum(r.get("bytes", 0) for r in mine if r.get("ok")),
                          last_unix_s=max(r["t"] for r in mine)))
    for host, entry in hosts.items():
        verdict = judge(host, speeds)
        entry["link_mbit_s"], entry["link_slow"] = verdict.mbit_s, verdict.slow
    drained = {}
    with contextlib.suppress(OSError, ValueError):
        drained = json.loads((run_dir / "drained.json").read_text())
    if drained.get("host") in hosts:
        hosts[drained["host"]]["state"] = "drained"
        events.append(dict(unix_s=drained.get("done_unix_s"), kind="drained",
                           host=drained["host"], step=drained.get("step"),
                           message=f"ranks {drained.get('drained_ranks')} saved step "
                                   f"{drained.get('step')} and left"))
    for fault in read_jsonl(run_dir / "faults.jsonl"):
        if fault.get("host") or fault.get("origin") == "cluster":
            detail = {k: v for k, v in fault.items() if k in ("peer", "duration_s", "rate_mbit")}
            events.append(dict(unix_s=fault.get("time_unix_s"), kind=f"fault: {fault['kind']}",
                               host=fault.get("host"), step=fault.get("step"),
                               message=", ".join(f"{k}={v}" for k, v in detail.items())))
    for restart in restarts or []:
        events.append(dict(unix_s=restart.get("unix_s"), kind="restart", host=None,
                           step=restart.get("step"),
                           message=f"restored step {restart.get('restored_step')} from "
                                   f"{restart.get('source', '?')}"))
    events.sort(key=lambda e: (e["unix_s"] is None, e["unix_s"] or 0))
    return dict(hosts=[hosts[h] for h in sorted(hosts)], links=links, events=events,
                probing=bool(probes),
                median_link_mbit_s=statistics.median(speeds.values()) if speeds else None)


def _event(record: dict[str, Any], kind: str, host: str, message: str) -> dict[str, Any]:
    return dict(unix_s=record.get("time_unix_s"), kind=kind, host=host, step=None,
                message=message)
