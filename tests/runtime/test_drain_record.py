"""The drain request and its record, without processes (tests/multinode drains real hosts)."""

from __future__ import annotations

from trainpilot.runtime import drain
from trainpilot.runtime.elastic.rendezvous import host_name
from trainpilot.runtime.launch import _drained_here


def test_a_done_drain_names_its_host_and_only_that_host_reads_it_as_its_own(tmp_path):
    assert drain.read_request(tmp_path) is None and _drained_here(tmp_path) is None
    request = drain.request_drain(tmp_path, host_name())
    assert drain.read_request(tmp_path)["host"] == host_name()
    assert _drained_here(tmp_path) is None  # requested, not yet done
    drain.mark_done(tmp_path, request, step=6, ranks=[1])
    assert drain.read_request(tmp_path) is None  # the request became the record
    assert _drained_here(tmp_path)["step"] == 6
    other = tmp_path / "other"
    other.mkdir()
    drain.mark_done(other, drain.request_drain(other, "not-" + host_name()), step=6, ranks=[1])
    assert _drained_here(other) is None  # negative control: another host's drain
