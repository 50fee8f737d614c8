"""A cluster of hosts on one machine: one Linux network namespace per node, joined by a switch.

    with NetCluster(["node0", "node1", "spare"], rate_mbit=1000) as net:
        proc = net.popen("node0", ["trainpilot", "train", ...])    # runs inside node0
        net.partition("node0", "node1")                            # iptables DROP both ways
        net.heal("node0", "node1")
        net.kill_node("node1")                                     # SIGKILL all of node1
        net.link_down("node1"); net.link_up("node1")               # its cable pulled
        net.port_bytes("node1")                                    # bytes in/out of its link

    sudo .venv/bin/python -m tests.multinode.netns up --nodes 3   # by hand; `down TAG`, `list`

Layout (nothing touches the root namespace: traffic stays inside the cluster):

* a switch namespace ``<tag>-sw`` with a Linux bridge ``br0`` and one port ``p<i>`` per node;
* node ``i``: namespace ``<tag>-n<i>``, its end of the veth pair named ``eth0`` (so
  ``GLOO_SOCKET_IFNAME=eth0`` is one setting for every node), address ``10.99.0.<i+1>/24``,
  ``lo`` up; commands run under ``ip netns exec`` (its own ``/etc/hosts`` naming every node,
  from ``/etc/netns/<ns>/hosts``) in their own UTS namespace whose hostname is the node's
  name, as on separate machines;
* links shaped with ``tc tbf`` (bandwidth, both directions: the node's egress on ``eth0``, its
  ingress on the switch port). This kernel has no ``netem``, so latency cannot be added;
  random loss comes from iptables' ``statistic`` match instead.

Faults: ``partition(a, b)`` drops every packet between two hosts (iptables rules in both,
counted: :meth:`dropped` proves the fault fired), ``link_down`` takes a node's switch port
down (no FIN, no RST: peers see silence), ``kill_node`` SIGKILLs every process of a namespace
(the kernel closes their sockets: peers see resets at once), ``set_loss`` drops a fraction of
a node's inbound packets.

Teardown is guaranteed: :meth:`down` (also on ``__exit__``) kills every process in the
namespaces and deletes them; a janitor process started with the cluster does the same when
its owner dies or after ``lifetime_s``, and :func:`sweep_stale` removes clusters whose owner is
gone. Needs root, iproute2 and (for partitions and loss) iptables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PREFIX = "tpmn"
SUBNET = "10.99.0"
CMD_TIMEOUT_S = 15.0
ETC_NETNS = Path("/etc/netns")


class ClusterError(RuntimeError):
    """A set-up or fault command failed (its command line and stderr)."""


def missing_requirements(*, iptables: bool = True) -> str | None:
    """None when this process can build a cluster, else why not (for a pytest skip)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    tools = ["ip", "tc", "unshare"] + (["iptables"] if iptables else [])
    for tool in tools:
        if shutil.which(tool) is None:
            return f"needs {tool} on PATH"
    probe = f"{PREFIX}probe{os.getpid()}"  # root in a container may still lack CAP_SYS_ADMIN
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    return None


def _run(*cmd: str, check: bool = True, timeout: float = CMD_TIMEOUT_S) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"{' '.join(cmd)}: timed out after {timeout:.0f} s") from None
    if check and out.returncode:
        raise ClusterError(f"{' '.join(cmd)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout


@dataclass(frozen=True, kw_only=True)
class Node:
    name: str
    index: int
    ns: str
    address: str
    port: str  # its port on the switch (in the switch namespace)


class NetCluster:
    """``names``: one host per name (``node0``, ``node1``, a ``spare`` ...). ``rate_mbit``:
    every link's bandwidth in each direction (None: unshaped veth). ``lifetime_s``: the
    janitor tears the cluster down after this long whatever happens."""

    def __init__(self, names: Sequence[str], *, rate_mbit: float | None = 1000.0,
                 lifetime_s: float = 1200.0, tag: str | None = None):
        if not 1 <= len(names) <= 8 or len(set(names)) != len(names):
            raise ValueError(f"names: got {list(names)}; valid: 1-8 distinct host names")
        self.tag = tag or f"{PREFIX}{os.getpid()}x{time.monotonic_ns() % 100000}"
        self.rate_mbit, self.lifetime_s = rate_mbit, lifetime_s
        self.switch = f"{self.tag}-sw"
        self.nodes = {name: Node(name=name, index=i, ns=f"{self.tag}-n{i}",
                                 address=f"{SUBNET}.{i + 1}", port=f"p{i}")
                      for i, name in enumerate(names)}
        self._janitor: subprocess.Popen | None = None
        self._partitions: set[tuple[str, str]] = set()
        self.is_up = False

    # -- life cycle ------------------------------------------------------------------------
    def __enter__(self) -> NetCluster:
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> NetCluster:
        sweep_stale()
        try:
            self._janitor = _start_janitor(self)
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "set", "lo", "up")
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for node in self.nodes.values():
                self._add_node(node)
        except BaseException:
            self.down()
            raise
        self.is_up = True
        return self

    def _add_node(self, node: Node) -> None:
        hosts = ETC_NETNS / node.ns
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{n.address} {n.name}\n" for n in self.nodes.values()))
        _run("ip", "netns", "add", node.ns)
        _run("ip", "-n", node.ns, "link", "set", "lo", "up")
        # Created inside the node's namespace (no name clash in the root namespace), the peer
        # end then moves into the switch.
        _run("ip", "-n", node.ns, "link", "add", "eth0", "type", "veth", "peer", "name",
             node.port)
        _run("ip", "-n", node.ns, "link", "set", node.port, "netns", self.switch)
        _run("ip", "-n", self.switch, "link", "set", node.port, "master", "br0")
        _run("ip", "-n", self.switch, "link", "set", node.port, "up")
        _run("ip", "-n", node.ns, "addr", "add", f"{node.address}/24", "dev", "eth0")
        _run("ip", "-n", node.ns, "link", "set", "eth0", "up")
        if self.rate_mbit is not None:
            self.shape(node.name, self.rate_mbit)

    def down(self) -> None:
        """Kill every process in the cluster's namespaces and delete them (idempotent)."""
        teardown(self.tag)
        if self._janitor is not None and self._janitor.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._janitor.pid, signal.SIGKILL)
            self._janitor.wait(5)
        self._janitor = None
        self.is_up = False

    # -- running things on a node ----------------------------------------------------------
    def node(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise ValueError(f"node: got {name!r}; valid: {', '.join(self.nodes)}") from None

    def address(self, name: str) -> str:
        return self.node(name).address

    def exec_args(self, name: str, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as it runs on host ``name``: its network namespace, its own hostname."""
        node = self.node(name)
        return ["ip", "netns", "exec", node.ns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', node.name, *cmd]

    def popen(self, name: str, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` on host ``name`` in its own session (killed by process id)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.exec_args(name, cmd), **kwargs)

    def run(self, name: str, cmd: Sequence[str], *, timeout: float = 60.0,
            ) -> subprocess.CompletedProcess:
        return subprocess.run(self.exec_args(name, cmd), capture_output=True, text=True,
                              timeout=timeout)

    def pids(self, name: str) -> list[int]:
        """Every process whose network namespace is host ``name``'s."""
        return [int(p) for p in _run("ip", "netns", "pids", self.node(name).ns).split()]

    # -- faults ----------------------------------------------------------------------------
    def kill_node(self, name: str) -> list[int]:
        """SIGKILL every process of host ``name`` (a machine lost); returns their pids."""
        pids = self.pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def link_down(self, name: str) -> None:
        """Take host ``name``'s switch port down: its packets vanish both ways."""
        _run("ip", "-n", self.switch, "link", "set", self.node(name).port, "down")

    def link_up(self, name: str) -> None:
        _run("ip", "-n", self.switch, "link", "set", self.node(name).port, "up")

    def link_is_up(self, name: str) -> bool:
        info = json.loads(_run("ip", "-n", self.switch, "-j", "link", "show",
                               self.node(name).port))[0]
        return "UP" in info.get("flags", [])

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b`` (both directions, both hosts)."""
        for me, other in ((a, b), (b, a)):
            peer = self.address(other)
            ns = self.node(me).ns
            for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
                _run("ip", "netns", "exec", ns, "iptables", "-I", chain, "1", flag, peer, "-j",
                     "DROP", "-m", "comment", "--comment", f"tp-partition-{other}")
        self._partitions.add((a, b))

    def heal(self, a: str, b: str) -> None:
        for me, other in ((a, b), (b, a)):
            peer = self.address(other)
            ns = self.node(me).ns
            for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
                _run("ip", "netns", "exec", ns, "iptables", "-D", chain, flag, peer, "-j",
                     "DROP", "-m", "comment", "--comment", f"tp-partition-{other}",
                     check=False)
        self._partitions.discard((a, b))

    def dropped(self, name: str) -> int:
        """Packets host ``name``'s partition and loss rules dropped so far (iptables
        counters): the proof that a partition actually cut traffic."""
        text = _run("ip", "netns", "exec", self.node(name).ns, "iptables", "-L", "-v", "-x",
                    "-n")
        total = 0
        for line in text.splitlines():
            if "tp-partition-" in line or "tp-loss" in line:
                total += int(line.split()[0])
        return total

    def set_loss(self, name: str, fraction: float) -> None:
        """Drop ``fraction`` (0..1) of the packets host ``name`` receives (0 removes it)."""
        ns = self.node(name).ns
        rule = ["INPUT", "-m", "statistic", "--mode", "random", "--probability"]
        listing = _run("ip", "netns", "exec", ns, "iptables", "-S", "INPUT")
        for line in listing.splitlines():
            if "tp-loss" in line:
                _run("ip", "netns", "exec", ns, "iptables", *line.replace("-A", "-D", 1)
                     .replace('"', "").split())
        if fraction > 0:
            _run("ip", "netns", "exec", ns, "iptables", "-I", *rule, f"{fraction:.6f}", "-j",
                 "DROP", "-m", "comment", "--comment", "tp-loss")

    def shape(self, name: str, rate_mbit: float) -> None:
        """Host ``name``'s link: ``rate_mbit`` in each direction (tc tbf)."""
        node = self.node(name)
        burst = max(32, int(rate_mbit * 1e6 / 8 / 250 / 1024))  # ~4 ms of traffic, KiB
        for ns, dev in ((node.ns, "eth0"), (self.switch, node.port)):
            # Deleted, then added: `tc qdisc replace` keeps the packets already queued, and a
            # GSO packet queued under the old, larger burst (up to 64 KiB on a veth) can never
            # dequeue under a smaller one (tbf sends a packet only when that many tokens are
            # saved, and saves at most one burst): the link went dead for good, not slow, in
            # 3 of 3 trials with bulk traffic when shaped from 1000 down to 40 Mbit/s. A fresh
            # tbf splits an oversized GSO packet at enqueue instead.
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root",
                 check=False)
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                 "rate", f"{rate_mbit}mbit", "burst", f"{burst}kb", "latency", "50ms")

    # -- measurements ----------------------------------------------------------------------
    def port_bytes(self, name: str) -> dict[str, int]:
        """Bytes on host ``name``'s link so far: ``sent`` by the node, ``received`` by it
        (the switch port's counters, frame headers included)."""
        info = json.loads(_run("ip", "-n", self.switch, "-s", "-j", "link", "show",
                               self.node(name).port))[0]["stats64"]
        # The switch port receives what the node sends, and transmits what it receives.
        return dict(sent=int(info["rx"]["bytes"]), received=int(info["tx"]["bytes"]))

    def all_port_bytes(self) -> dict[str, dict[str, int]]:
        return {name: self.port_bytes(name) for name in self.nodes}

    def describe(self) -> dict:
        return dict(tag=self.tag, switch=self.switch, rate_mbit=self.rate_mbit,
                    nodes={n.name: dict(ns=n.ns, address=n.address) for n in
                           self.nodes.values()})


# -- teardown --------------------------------------------------------------------------------
def _namespaces(tag: str | None = None) -> list[str]:
    out = _run("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{tag}-" if tag else PREFIX)]


def teardown(tag: str) -> None:
    """Kill every process in the namespaces of cluster ``tag`` and delete them."""
    spaces = _namespaces(tag)
    for _ in range(3):
        pids = [int(p) for ns in spaces
                for p in _run("ip", "netns", "pids", ns, check=False).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    for ns in spaces:
        _run("ip", "netns", "del", ns, check=False)
        shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)


def _owner_pid(tag: str) -> int | None:
    try:
        return int(tag[len(PREFIX):].split("x")[0])
    except ValueError:
        return None


def sweep_stale() -> list[str]:
    """Tear down clusters whose owning process is gone; returns their tags."""
    tags = sorted({ns.rsplit("-", 1)[0] for ns in _namespaces()})
    stale = [t for t in tags if (pid := _owner_pid(t)) is None or not _alive(pid)]
    for tag in stale:
        teardown(tag)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_JANITOR = """
import sys, time
sys.path.insert(0, sys.argv[4])
from tests.multinode.netns import _alive, teardown
owner, tag, deadline = int(sys.argv[1]), sys.argv[2], time.monotonic() + float(sys.argv[3])
while _alive(owner) and time.monotonic() < deadline:
    time.sleep(1.0)
teardown(tag)
"""


def _start_janitor(cluster: NetCluster) -> subprocess.Popen:
    repo = str(Path(__file__).resolve().parents[2])
    return subprocess.Popen([sys.executable, "-c", _JANITOR, str(os.getpid()), cluster.tag,
                             str(cluster.lifetime_s), repo], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# -- by hand ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.multinode.netns",
                                     description="Bring a namespace cluster up or down.")
    sub = parser.add_subparsers(dest="verb", required=True)
    up = sub.add_parser("up", help="create a cluster and keep it until Ctrl-C (or --hold S)")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--rate-mbit", type=float, default=1000.0)
    up.add_argument("--hold", type=float, default=3600.0, help="seconds to keep it up")
    down = sub.add_parser("down", help="tear down a cluster by tag (all: every tpmn* one)")
    down.add_argument("tag")
    sub.add_parser("list", help="the clusters' namespaces")
    args = parser.parse_args(argv)
    if args.verb == "list":
        print("\n".join(_namespaces()))
        return 0
    if args.verb == "down":
        tags = sorted({n.rsplit("-", 1)[0] for n in _namespaces()}) if args.tag == "all" \
            else [args.tag]
        for tag in tags:
            teardown(tag)
        return 0
    reason = missing_requirements()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    names = [f"node{i}" for i in range(args.nodes)]
    with NetCluster(names, rate_mbit=args.rate_mbit, lifetime_s=args.hold + 60) as net:
        print(json.dumps(net.describe(), indent=1))
        print("run a command on a node: " + " ".join(net.exec_args(names[0], ["CMD"])))
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(args.hold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
