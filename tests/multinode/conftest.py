"""The multi-node tier: a cluster of network namespaces per test (tests/multinode/netns.py),
torn down on the way out; skipped, with the reason, where the machine cannot make one (not
root, no iproute2 or iptables). CI runs as root."""

from __future__ import annotations

import pytest

from tests.multinode.netns import NetCluster, missing_requirements


@pytest.fixture
def cluster():
    """Two hosts and a spare (``node0`` holds the rendezvous), links of 1 Gbit/s."""
    reason = missing_requirements()
    if reason:
        pytest.skip(f"multinode tier: {reason}")
    with NetCluster(["node0", "node1", "spare"], rate_mbit=1000.0, lifetime_s=600.0) as net:
        yield net
