"""The link probe mesh (runtime/elastic/linkprobe.py): the judge on probe records, and real
probes between sinks on this machine's loopback. The shaped-link case, end to end through
``trainpilot train`` across network namespaces, is tests/multinode/test_drain.py."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest

from trainpilot.runtime.drain import read_request, request_drain
from trainpilot.runtime.elastic import ElasticConfig
from trainpilot.runtime.elastic.linkprobe import LinkProbe, judge, link_speeds, read_probes
from trainpilot.specs.errors import SpecError


def probes(speeds: dict[tuple[str, str], float], *, t: float = 1.0, ok: bool = True):
    return [dict(kind="probe", src=a, dst=b, mbit_s=v if ok else 0.0, ok=ok, t=t)
            for (a, b), v in speeds.items()]


MESH = {("node0", "node1"): 40.0, ("node1", "spare"): 38.0, ("node0", "spare"): 900.0,
        ("node1", "node0"): 41.0, ("spare", "node1"): 39.0, ("spare", "node0"): 880.0}


def test_the_host_on_every_slow_link_is_the_slow_one():
    speeds = link_speeds(probes(MESH))
    verdicts = {h: judge(h, speeds) for h in ("node0", "node1", "spare")}
    assert verdicts["node1"].slow
    assert verdicts["node1"].mbit_s == pytest.approx(39.5)
    assert verdicts["node1"].others_mbit_s == pytest.approx(890.0)
    # Negative controls: the hosts at the other ends of node1's slow links are not flagged.
    assert not verdicts["node0"].slow and not verdicts["spare"].slow


def test_nothing_is_flagged_without_a_third_host_or_when_every_link_is_slow():
    two = link_speeds(probes({("node0", "node1"): 1.0, ("node1", "node0"): 1.0}))
    assert not judge("node1", two).slow and judge("node1", two).others_mbit_s is None
    uniform = link_speeds(probes({k: 40.0 for k in MESH}))
    assert not any(judge(h, uniform).slow for h in ("node0", "node1", "spare"))


def test_a_link_speed_is_the_median_of_its_newest_probes_that_got_through():
    records = (probes({("a", "b"): 10.0}, t=1) + probes({("b", "a"): 900.0}, t=2)
               + probes({("a", "b"): 800.0}, t=3) + probes({("a", "b"): 0.0}, t=4, ok=False)
               + probes({("b", "a"): 700.0}, t=5))
    # Newest three that got through: 900, 800, 700 (the failed probe and the oldest left out).
    assert link_speeds(records, last=3) == {frozenset(("a", "b")): 800.0}
    assert link_speeds(records) == {frozenset(("a", "b")): 750.0}  # the default: newest 5


def test_probes_between_live_sinks_on_loopback_are_recorded_and_judged(tmp_path):
    flags, drains = [], []
    mesh = [LinkProbe(tmp_path, name, "127.0.0.1", interval_s=0.2, probe_bytes=64 * 1024,
                      rounds=1, on_flag=lambda v, n: flags.append(v),
                      on_drain=drains.append) for name in ("h0", "h1", "h2")]
    for probe in mesh:
        probe.start()
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            links = {frozenset((r["src"], r["dst"])) for r in read_probes(tmp_path)
                     if r.get("kind") == "probe" and r["ok"]}
            if len(links) == 3:
                break
            time.sleep(0.1)
        assert len(links) == 3, read_probes(tmp_path)
        assert all(r["mbit_s"] > 1 and r["bytes"] == 64 * 1024
                   for r in read_probes(tmp_path) if r.get("kind") == "probe" and r["ok"])
        assert sorted(p["host"] for p in mesh[0].peers()) == ["h1", "h2"]
    finally:
        for probe in mesh:
            probe.stop()
    assert not (tmp_path / "links" / "hosts" / "h0.json").exists()  # a stopped host leaves
    # Loopback links are alike: the judge must not flag any of them within a factor of 2.
    speeds = link_speeds(read_probes(tmp_path))
    assert len(speeds) == 3
    assert sum(judge(h, speeds).slow for h in ("h0", "h1", "h2")) <= 1


def test_a_stalled_probe_does_not_delay_another_hosts_probe(tmp_path):
    # One slow link must not make the sink's other links look slow: a probe that stalls after
    # its header (as one over a 40 Mbit/s link does) while another host's probe arrives. The
    # sink that read one probe at a time held the second until the first ended (CI flagged
    # node0 beside the degraded node1 in test_drain.py).
    sink = LinkProbe(tmp_path, "h0", "127.0.0.1", interval_s=60).start()
    prober = LinkProbe(tmp_path, "h1", "127.0.0.1", interval_s=60, probe_bytes=64 * 1024)
    try:
        [peer] = prober.peers()
        stalled = socket.create_connection(("127.0.0.1", sink.port), timeout=5)
        stalled.sendall(struct.pack("!Q", 64 * 1024) + b"x" * 100)  # then nothing for 2 s
        time.sleep(0.2)  # accepted first
        record = prober.probe(peer)
        still_open = stalled.fileno() != -1
        time.sleep(max(0.0, 2.0 - record["seconds"] - 0.2))
        stalled.close()
    finally:
        sink.stop()
    assert still_open and record["ok"], record
    assert record["seconds"] < 1.0, record  # not queued behind the stalled probe


def test_a_flagged_host_asks_for_its_own_drain_after_its_rounds(tmp_path):
    drains = []

    def drain(verdict) -> bool:
        drains.append(request_drain(tmp_path, "node1", reason=verdict.reason()))
        return True

    probe = LinkProbe(tmp_path, "node1", "127.0.0.1", rounds=2, on_drain=drain)
    (tmp_path / "links" / "hosts").mkdir(parents=True)
    for host in ("node0", "spare"):  # live peers, as their launchers publish them
        (tmp_path / "links" / "hosts" / f"{host}.json").write_text(json.dumps(
            dict(host=host, address="127.0.0.1", port=1, t=time.time())))
    (tmp_path / "links" / "node0.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in probes(MESH, t=time.time())))
    assert probe.judge_round().slow and drains == []  # one round: flagged, not drained
    assert probe.judge_round().slow and len(drains) == 1
    probe.judge_round()
    assert len(drains) == 1  # asked once
    request = read_request(tmp_path)
    assert request["host"] == "node1" and request["reason"].startswith("link: node1's links")
    flagged = [json.loads(line) for line in
               (tmp_path / "links" / "node1.jsonl").read_text().splitlines()]
    assert [r["rounds"] for r in flagged] == [1, 2, 3]


def test_drain_slow_links_needs_probes():
    with pytest.raises(SpecError, match="link_probe_s"):
        ElasticConfig(drain_slow_links=True)
    with pytest.raises(SpecError, match="slow_link_ratio"):
        ElasticConfig(link_probe_s=1.0, slow_link_ratio=1.5)
    assert ElasticConfig(link_probe_s=0.5, drain_slow_links=True).drain_slow_links


def test_the_drain_verb_writes_the_request_the_job_reads(tmp_path):
    """``trainpilot drain`` (the operator's trigger; the probes' is above): the same request."""
    from tests.conftest import run_cli

    refused = run_cli("drain", str(tmp_path), "--host", "node1")
    assert refused.returncode == 2 and "holds no job" in refused.stderr  # not a run directory
    assert read_request(tmp_path) is None
    (tmp_path / "job.json").write_text("{}")
    out = run_cli("drain", str(tmp_path), "--host", "node1", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["host"] == "node1"
    assert read_request(tmp_path)["host"] == "node1"
