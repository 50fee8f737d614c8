"""A probe mesh between the hosts of a multi-node job: which host's link is slow, and a drain
before it fails.

A collective runs at its slowest member's pace, so every rank of a ring sees the same slow
step when one host's NIC or cable degrades: step times name no host. Probes between hosts can,
given a third host to compare with (Pingmesh, Guo et al., SIGCOMM 2015, does the same at data
centre scale). Each host's launcher (``trainpilot train --probe-links S``) runs

* a sink: a TCP server on the host's address (an ephemeral port, published in
  ``RUN_DIR/links/hosts/<host>.json``) that reads one probe and answers ``ok``;
* a prober: every ``S`` seconds it sends ``probe_bytes`` to every other live host's sink and
  appends what it measured (Mbit/s, connect time, or the error) to
  ``RUN_DIR/links/<host>.jsonl``;
* a judge of its own host: a link's speed is the median of its last probes that got through
  (both directions; a link that is down is the timeouts' business, see ``link_speeds``);
  the host is *slow* when the median over its links is under ``ratio`` x the median over the
  links between the other hosts. That needs at least three hosts (a standby counts: it probes
  and is probed while it waits); with two, a slow link cannot be told from a slow host at
  either end, and nothing is flagged. A flag is logged (``link_degraded``), and after
  ``rounds`` flagged rounds in a row, with ``--drain-slow-links``, the host asks for its own
  drain (``runtime.drain``, reason ``link: ...``): the job saves its next step and moves to the
  standby, losing no step.

The probes share the links with training: on a busy link a probe measures what is left, on
every link alike, so the comparison holds while the absolute numbers are not link capacity.
Not covered: a host that is slow for a reason other than its link (a slow GPU is the
straggler rule's), or links that are all slow (nothing to compare with).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainpilot.fsio import atomic_write_text, read_jsonl

LINKS = "links"
_HEADER = struct.Struct("!Q")
_ACK = b"ok"


@dataclass(frozen=True, kw_only=True)
class LinkVerdict:
    """The judge's view of one host: its links' median speed against the other hosts'."""

    host: str
    slow: bool
    mbit_s: float | None  # median over the host's links
    others_mbit_s: float | None  # median over the links between the other hosts
    links: int  # links with probes touching the host

    def reason(self) -> str:
        return (f"link: {self.host}'s links at {self.mbit_s:.0f} Mbit/s, the other hosts' at "
                f"{self.others_mbit_s:.0f} Mbit/s")


class LinkSpeeds:
    """The newest ``last`` probes of each link that got through (either direction), fed
    record by record; ``speeds()`` gives their median Mbit/s, keyed by the pair of hosts. A
    failed probe is left out: a link that is down is for the collective timeouts and
    heartbeats to handle (a blip shorter than them is absorbed, a longer one is a recovery);
    this judges the speed of links that work."""

    def __init__(self, *, last: int = 5):
        self.last = last
        self._newest: dict[frozenset, list[tuple[float, float]]] = {}

    def add(self, records: Iterable[dict[str, Any]]) -> LinkSpeeds:
        for r in records:
            if r.get("kind") != "probe" or not r.get("ok"):
                continue
            probes = self._newest.setdefault(frozenset((r["src"], r["dst"])), [])
            probes.append((r["t"], r["mbit_s"]))
            probes.sort()
            del probes[:-self.last]
        return self

    def speeds(self) -> dict[frozenset, float]:
        return {key: statistics.median(v for _, v in probes)
                for key, probes in self._newest.items()}


def link_speeds(records: Iterable[dict[str, Any]], *, last: int = 5) -> dict[frozenset, float]:
    """Median Mbit/s of the newest ``last`` probes of each link that got through (see
    :class:`LinkSpeeds`), keyed by the pair of hosts."""
    return LinkSpeeds(last=last).add(records).speeds()


def judge(host: str, speeds: dict[frozenset, float], *, ratio: float = 0.5) -> LinkVerdict:
    """Is ``host``'s link slow? See the module docstring."""
    mine = [v for k, v in speeds.items() if host in k]
    others = [v for k, v in speeds.items() if host not in k]
    if not mine or not others:
        return LinkVerdict(host=host, slow=False, mbit_s=statistics.median(mine) if mine else None,
                           others_mbit_s=None, links=len(mine))
    me, rest = statistics.median(mine), statistics.median(others)
    return LinkVerdict(host=host, slow=me < ratio * rest, mbit_s=me, others_mbit_s=rest,
                       links=len(mine))


def read_probes(run_dir: Path, *, since: float = 0.0) -> list[dict[str, Any]]:
    """Every host's probe records newer than ``since`` (unix seconds)."""
    return [record for path in sorted((Path(run_dir) / LINKS).glob("*.jsonl"))
            for record in read_jsonl(path) if record.get("t", 0) > since]


class LinkProbe:
    """The sink, prober and judge of one host (see the module docstring). ``start()`` /
    ``stop()``; ``on_flag(verdict, rounds)`` is called for each flagged round and
    ``on_drain(verdict)`` from the ``rounds``-th in a row on, until it returns True (it acted;
    False: not now, e.g. no rank of the job runs here yet; None: flag only)."""

    def __init__(self, run_dir: Path, host: str, address: str, *, interval_s: float = 2.0,
                 probe_bytes: int = 256 * 1024, ratio: float = 0.5, rounds: int = 3,
                 timeout_s: float = 2.0,
                 on_flag: Callable[[LinkVerdict, int], None] | None = None,
                 on_drain: Callable[[LinkVerdict], bool] | None = None):
        self.run_dir, self.host, self.address = Path(run_dir), host, address
        self.interval_s, self.probe_bytes = interval_s, probe_bytes
        self.ratio, self.rounds, self.timeout_s = ratio, rounds, timeout_s
        self.on_flag, self.on_drain = on_flag, on_drain
        self.folder = self.run_dir / LINKS
        self._stop = threading.Event()
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._payload = os.urandom(min(probe_bytes, 1 << 16))
        self._flagged = 0
        self._drained = False
        self._started = time.time()
        self._speeds = LinkSpeeds()
        self._read_to: dict[Path, int] = {}  # each host's probe file: bytes judged so far

    # -- life cycle ------------------------------------------------------------------------
    def start(self) -> LinkProbe:
        (self.folder / "hosts").mkdir(parents=True, exist_ok=True)
        server = socket.create_server((self.address, 0))
        server.settimeout(0.5)
        self._server = server
        self.port = server.getsockname()[1]
        self._publish()
        for target, name in ((self._serve, "sink"), (self._probe_loop, "prober")):
            thread = threading.Thread(target=target, name=f"trainpilot-link-{name}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, *, wait: bool = True) -> None:
        """Stop probing and leave the mesh (``wait``: for a probe in flight to end)."""
        self._stop.set()
        for thread in self._threads if wait else ():
            thread.join(timeout=self.timeout_s + 1)
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            (self.folder / "hosts" / f"{self.host}.json").unlink()

    def _publish(self) -> None:
        atomic_write_text(self.folder / "hosts" / f"{self.host}.json", json.dumps(dict(
            host=self.host, address=self.address, port=self.port, pid=os.getpid(),
            t=time.time())) + "\n")

    # -- the sink --------------------------------------------------------------------------
    def _serve(self) -> None:
        """Accept probes, each read on its own thread: a sink that read one probe at a time
        made every link into a slow host look slow (the spare's probe of node0 waited behind
        node1's, 40 Mbit/s one, and node0 was flagged beside node1 in CI)."""
        assert self._server is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True,
                             name="trainpilot-link-sink-conn").start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(self.timeout_s * 4)
            size = _HEADER.unpack(_recv_exactly(conn, _HEADER.size))[0]
            left = min(size, 1 << 30)
            while left > 0:
                chunk = conn.recv(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
            if left == 0:
                conn.sendall(_ACK)

    # -- the prober ------------------------------------------------------------------------
    def peers(self) -> list[dict[str, Any]]:
        """The other hosts whose sinks are live (published within 3 rounds)."""
        out = []
        for path in (self.folder / "hosts").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                peer = json.loads(path.read_text())
                if peer["host"] != self.host and \
                        time.time() - peer["t"] < 3 * self.interval_s + 5:
                    out.append(peer)
        return sorted(out, key=lambda p: p["host"])

    def probe(self, peer: dict[str, Any]) -> dict[str, Any]:
        """One probe of ``peer``'s sink: its record."""
        record: dict[str, Any] = dict(kind="probe", src=self.host, dst=peer["host"],
                                      bytes=self.probe_bytes)
        start = time.perf_counter()
        try:
            with socket.create_connection((peer["address"], peer["port"]),
                                          timeout=self.timeout_s) as conn:
                connected = time.perf_counter()
                conn.settimeout(self.timeout_s)
                conn.sendall(_HEADER.pack(self.probe_bytes))
                left = self.probe_bytes
                while left > 0:
                    n = min(left, len(self._payload))
                    conn.sendall(self._payload[:n])
                    left -= n
                if _recv_exactly(conn, len(_ACK)) != _ACK:
                    raise OSError("no acknowledgement")
            elapsed = time.perf_counter() - start
            record.update(ok=True, seconds=elapsed, connect_s=connected - start,
                          mbit_s=self.probe_bytes * 8 / elapsed / 1e6)
        except OSError as err:
            record.update(ok=False, seconds=time.perf_counter() - start, mbit_s=0.0,
                          error=f"{type(err).__name__}: {err}"[:200])
        record["t"] = time.time()
        return record

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._publish()
            peers = self.peers()
            records = [self.probe(peer) for peer in peers]
            if records:
                self._append(records)
                self.judge_round({peer["host"] for peer in peers})

    def _append(self, records: Sequence[dict[str, Any]]) -> None:
        with open(self.folder / f"{self.host}.jsonl", "a") as out:
            out.write("".join(json.dumps(r) + "\n" for r in records))

    def _read_new_probes(self) -> list[dict[str, Any]]:
        """The whole lines every host's probe file gained since the last round (a file is read
        once, not again each round: it grows for the whole run)."""
        out = []
        for path in sorted(self.folder.glob("*.jsonl")):
            start = self._read_to.get(path, 0)
            try:
                with open(path, "rb") as handle:
                    handle.seek(start)
                    data = handle.read()
            except OSError:
                continue
            whole = data[: data.rfind(b"\n") + 1]  # a line being appended is read next round
            self._read_to[path] = start + len(whole)
            for line in whole.decode(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("t", 0) > self._started:
                        out.append(record)
        return out

    def judge_round(self, peers: set[str] | None = None) -> LinkVerdict:
        """Judge this host from every host's probes since this probe started, over the links
        between live hosts (``peers``: the other live hosts; default: read now)."""
        if peers is None:
            peers = {peer["host"] for peer in self.peers()}
        live = {self.host} | peers  # a drained host left
        self._speeds.add(self._read_new_probes())
        speeds = {link: v for link, v in self._speeds.speeds().items() if link <= live}
        verdict = judge(self.host, speeds, ratio=self.ratio)
        self._flagged = self._flagged + 1 if verdict.slow else 0
        if verdict.slow:
            self._append([dict(kind="link_degraded", host=self.host, t=time.time(),
                               rounds=self._flagged, mbit_s=verdict.mbit_s,
                               others_mbit_s=verdict.others_mbit_s)])
            if self.on_flag is not None:
                self.on_flag(verdict, self._flagged)
            if self._flagged >= self.rounds and not self._drained and self.on_drain:
                self._drained = self.on_drain(verdict)
        return verdict


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("connection closed")
        data += chunk
    return data


# -- the probe as its own process (what the launcher runs) -----------------------------------
def _training(watch: Path | None) -> bool:
    """Whether a worker of this host's launcher runs now (a live pid among the registrations
    in its watch folder, ``runtime.watchdog``): a standby has none, and nothing to drain."""
    if watch is None:
        return True
    from trainpilot.runtime.watchdog import registrations

    for info in registrations(watch):
        with contextlib.suppress(OSError):
            os.kill(int(info["pid"]), 0)
            return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainpilot.runtime.elastic.linkprobe``: one host's probe, run by its launcher
    as a separate process. Not in the launcher itself: a launcher busy starting torchrun's agent
    (imports hold the GIL for seconds) would answer probes late and be judged slow."""
    import argparse
    import signal

    from trainpilot.runtime.drain import request_drain
    from trainpilot.runtime.watchdog import log_launch

    parser = argparse.ArgumentParser(description=main.__doc__.split("\n")[0] if main.__doc__
                                     else None)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--drain", choices=("off", "on", "refused"), default="off",
                        help="refused: this host holds the rendezvous store")
    parser.add_argument("--watch", type=Path, default=None, help="the launcher's watch folder")
    parser.add_argument("--parent", type=int, default=None, help="exit when this pid is gone")
    args = parser.parse_args(argv)
    run_dir, host = args.run_dir, args.host

    def flag(verdict: LinkVerdict, rounds: int) -> None:
        log_launch(run_dir, "link_degraded", host=host, rounds=rounds, mbit_s=verdict.mbit_s,
                   others_mbit_s=verdict.others_mbit_s)

    def drain(verdict: LinkVerdict) -> bool:
        if not _training(args.watch):
            return False
        if args.drain == "refused":
            log_launch(run_dir, "drain_refused", host=host, reason=verdict.reason(),
                       why="this host holds the rendezvous store: the job would end with it")
            return True
        body = request_drain(run_dir, host, reason=verdict.reason())
        log_launch(run_dir, "drain_requested", host=host, reason=body["reason"])
        return True

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    probe = LinkProbe(run_dir, host, args.address, interval_s=args.interval, ratio=args.ratio,
                      rounds=args.rounds, on_flag=flag,
                      on_drain=None if args.drain == "off" else drain).start()
    try:
        while not stop.wait(0.2):
            if args.parent is not None and os.getppid() != args.parent:
                break  # the launcher is gone
    finally:
        probe.stop(wait=False)  # daemon threads: a probe in flight ends with the process
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
