"""The dashboard's cluster view (trainpilot.ui.cluster, /api/cluster, the run page's cluster
panel), drawn by headless Chromium from a run directory whose cluster records were written by
the real writers: three link probes on this machine's loopback (runtime.elastic.linkprobe),
the launcher journal (runtime.watchdog.log_launch) and a drain record (runtime.drain). The same
view of a real multi-host run (node1 slowed and drained) is checked in
tests/multinode/test_drain.py."""

from __future__ import annotations

import json
import time

import pytest

from tests.ui import helpers
from tests.ui.conftest import write_known_store
from trainpilot.runtime.drain import mark_done, request_drain
from trainpilot.runtime.elastic.linkprobe import LinkProbe, read_probes
from trainpilot.runtime.watchdog import log_launch
from trainpilot.ui.cluster import cluster_section

HOSTS = ("node0", "node1", "spare")


@pytest.fixture
def cluster_run(tmp_path):
    run_dir = write_known_store(tmp_path / "mn")
    for host in HOSTS:  # the three hosts' launchers
        log_launch(run_dir, "launch_start", host=host)
    mesh = [LinkProbe(run_dir, host, "127.0.0.1", interval_s=0.2, probe_bytes=32 * 1024)
            for host in HOSTS]
    for probe in mesh:
        probe.start()
    try:
        helpers.wait_for(lambda: len({frozenset((r["src"], r["dst"])) for r in
                                      read_probes(run_dir) if r.get("ok")}) == 3,
                         timeout_s=30, what="probes of all three links")
    finally:
        for probe in mesh[1:]:  # node0 keeps its sink: the one live host
            probe.stop()
    log_launch(run_dir, "link_degraded", host="node1", rounds=1, mbit_s=12.0,
               others_mbit_s=900.0)
    request = request_drain(run_dir, "node1", reason="link: node1's links at 12 Mbit/s")
    log_launch(run_dir, "drain_requested", host="node1", reason=request["reason"])
    mark_done(run_dir, request, step=7, ranks=[1])
    log_launch(run_dir, "launch_end", host="node1", outcome="drained")
    with open(run_dir / "faults.jsonl", "a") as out:
        out.write(json.dumps(dict(kind="degraded_link", origin="cluster", host="node1", step=5,
                                  rate_mbit=40, time_unix_s=time.time() - 5)) + "\n")
    yield run_dir
    mesh[0].stop()


def test_the_cluster_section_reads_the_run_directory(cluster_run, tmp_path):
    section = cluster_section(cluster_run)
    hosts = {h["host"]: h for h in section["hosts"]}
    assert sorted(hosts) == list(HOSTS)
    assert hosts["node1"]["state"] == "drained" and hosts["node0"]["state"] == "running"
    assert hosts["node0"]["probe_live"] and not hosts["spare"]["probe_live"]
    assert {(link["a"], link["b"]) for link in section["links"]} == {
        ("node0", "node1"), ("node0", "spare"), ("node1", "spare")}
    assert all(link["mbit_s"] > 1 for link in section["links"])
    kinds = [e["kind"] for e in section["events"]]
    assert {"link_degraded", "drain_requested", "drained", "fault: degraded_link"} <= set(kinds)
    # Negative control: a one-host run has no cluster view.
    assert cluster_section(write_known_store(tmp_path / "one")) == {}


@pytest.mark.browser
@pytest.mark.timeout(180)
def test_the_run_page_draws_the_cluster_panel(cluster_run, browser):
    proc, url = helpers.start_dashboard(cluster_run)
    try:
        browser.get(url + "run?key=.&poll_ms=300")
        panel = helpers.wait_for(
            lambda: (el := browser.find_element("id", "cluster-panel")).is_displayed() and el,
            timeout_s=60, what="the cluster panel")
        hosts = browser.find_elements("css selector", "#cluster-hosts tbody tr")
        assert [r.text.split()[0] for r in hosts] == list(HOSTS)
        assert "drained" in hosts[1].text and "sev-warning" in hosts[1].get_attribute("class")
        links = browser.find_elements("css selector", "#cluster-links tbody tr")
        assert [r.text.split(" ", 3)[:3] for r in links] == [
            ["node0", "-", "node1"], ["node0", "-", "spare"], ["node1", "-", "spare"]]
        assert "drain_requested" in panel.text and "degraded_link" in panel.text
    finally:
        helpers.kill_tree(proc)
    # Negative control: the panel stays hidden for a run on one host.
    single = write_known_store(cluster_run.parent / "one")
    proc, url = helpers.start_dashboard(single)
    try:
        browser.get(url + "run?key=.&poll_ms=300")
        helpers.wait_for(lambda: browser.execute_script(
            "return window.trainpilot && window.trainpilot.state().plan !== null"),
            timeout_s=60, what="the plan panel's first refresh")
        time.sleep(1.0)
        assert not browser.find_element("id", "cluster-panel").is_displayed()
    finally:
        helpers.kill_tree(proc)
