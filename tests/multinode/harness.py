"""``trainpilot train`` on a namespace cluster, launched once per host as a user would on a
cluster (the same command everywhere; only ``--local-addr`` differs), and the faults a cluster
has, each journaled in ``RUN_DIR/faults.jsonl`` *before* it acts (fsync'd, as the in-process
injector does) so the run store times recovery from the real fault.

The run directory is shared by every host (a cluster's shared filesystem: checkpoints and
the run store live there); ``/dev/shm`` is shared too, but each launcher's watch folder is
named by its own process id. Every launcher is started in its own session and killed by
process id (or with its whole namespace)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tests.external.harness import Job, completed_steps
from tests.multinode.netns import NetCluster
from trainpilot.runtime.checkpoint.nodemem import NodeMemory
from trainpilot.runtime.faults import append_journal

PLAN_DDP = "dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64"
PLAN_FSDP = "dp=2,zero=3,micro_batch_size=8,global_batch_size=16,seq_len=64"
RDZV_PORT = 29400
# Dead-node detection in torchrun's rendezvous: keep-alives every 1 s, 3 missed = dead (its
# defaults, 5 s x 3, make a node loss cost 15 s more); a 1 s last call once min nodes are in.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"
ENV = dict(GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")


def train_args(run_dir: Path, *, steps: int, plan: str = PLAN_DDP, every: int = 3,
               nnodes: str = "2", head: str | None = None, local_addr: str | None = None,
               rdzv_id: str = "mn", rdzv_conf: str = RDZV_CONF,
               extra: Sequence[str] = ()) -> list[str]:
    """The command each host runs. ``head``: the rendezvous host's address (None: a
    single-host run, torchrun standalone)."""
    cmd = [sys.executable, "-m", "trainpilot", "train", "--model", "tiny-gpt", "--steps",
           str(steps), "--checkpoint-every", str(every), "--no-predict", "--plan", plan,
           "--heartbeat-timeout", "2.5", "--collective-timeout", "5", "--run-dir",
           str(run_dir)]
    if head is not None:
        cmd += ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{head}:{RDZV_PORT}", "--rdzv-id", rdzv_id,
                "--rdzv-conf", rdzv_conf, "--local-addr", local_addr or head]
    return [*cmd, *extra]


class NodeJob(Job):
    """The launcher of one host (``trainpilot train`` run inside its namespace)."""

    def __init__(self, net: NetCluster, host: str, args: list[str], *, out: Path):
        self.net, self.host, self.args = net, host, args
        self.out_path = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(out, "ab")
        self.proc = net.popen(host, args, stdout=self._out, stderr=subprocess.STDOUT,
                              env=dict(os.environ, **ENV))
        self.run_dir = Path(args[args.index("--run-dir") + 1])


class Launch:
    """The same job launched on several hosts of ``net``."""

    def __init__(self, net: NetCluster, run_dir: Path, *, steps: int, plan: str = PLAN_DDP,
                 every: int = 3, nnodes: str = "2", head: str = "node0",
                 rdzv_conf: str = RDZV_CONF, extra: Sequence[str] = ()):
        self.net, self.run_dir = net, run_dir
        self.head = net.address(head)
        self.kwargs = dict(steps=steps, plan=plan, every=every, nnodes=nnodes,
                           rdzv_conf=rdzv_conf, extra=extra)
        self.jobs: dict[str, NodeJob] = {}

    def start(self, host: str) -> NodeJob:
        args = train_args(self.run_dir, head=self.head, local_addr=self.net.address(host),
                          **self.kwargs)
        job = NodeJob(self.net, host, args, out=self.run_dir.parent / f"{host}.out")
        self.jobs[host] = job
        return job

    def wait_rendezvous_host(self, timeout: float = 60.0) -> None:
        """Until the head's agent listens on the rendezvous port (its store is up)."""
        deadline = time.monotonic() + timeout
        probe = ("import socket,sys; s=socket.socket(); s.settimeout(0.5); "
                 f"sys.exit(s.connect_ex(('{self.head}', {RDZV_PORT})))")
        while time.monotonic() < deadline:
            host = next(iter(self.jobs))
            if self.net.run(host, [sys.executable, "-c", probe], timeout=10).returncode == 0:
                return
            time.sleep(0.3)
        raise TimeoutError("the rendezvous host never listened")

    def wait_step(self, step: int, timeout: float = 120.0) -> int:
        """Until rank 0 streamed ``step`` to metrics.jsonl (whichever host runs it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = completed_steps(self.run_dir)
            if done >= step:
                return done
            if all(j.proc.poll() is not None for j in self.jobs.values()):
                raise RuntimeError(f"every launcher ended before step {step}:\n{self.outputs()}")
            time.sleep(0.05)
        raise TimeoutError(f"step {step} not reached:\n{self.outputs()}")

    def wait(self, hosts: Sequence[str] | None = None, timeout: float = 240.0,
             ) -> dict[str, int]:
        """Exit codes of the launchers of ``hosts`` (default: all), waiting for each."""
        deadline = time.monotonic() + timeout
        codes = {}
        for host in hosts or list(self.jobs):
            left = max(1.0, deadline - time.monotonic())
            try:
                codes[host] = self.jobs[host].proc.wait(left)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{host}'s launcher still runs after {timeout:.0f} s:\n"
                                   f"{self.outputs()}") from None
        return codes

    def ranks(self) -> dict[str, list[int]]:
        """host -> ranks of its live workers (registered with its launcher's watchdog)."""
        out: dict[str, list[int]] = {}
        for host, job in self.jobs.items():
            if job.proc.poll() is None:
                ranks = sorted(job.workers())
                if ranks:
                    out[host] = ranks
        return out

    def wait_ranks(self, num_hosts: int, timeout: float = 90.0) -> dict[str, list[int]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.ranks()
            if len(found) >= num_hosts:
                return found
            time.sleep(0.2)
        raise TimeoutError(f"{num_hosts} hosts never trained:\n{self.outputs()}")

    def outputs(self) -> str:
        return "\n".join(f"--- {h} ---\n{j.output()[-2500:]}" for h, j in self.jobs.items())

    def kill_all(self) -> None:
        for host, job in self.jobs.items():
            if job.proc.poll() is None:
                self.net.kill_node(host)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    job.proc.wait(10)
            with contextlib.suppress(Exception):
                job._out.close()


@contextlib.contextmanager
def launch(net: NetCluster, run_dir: Path, **kwargs) -> Iterator[Launch]:
    """A :class:`Launch` whose launchers are all killed on the way out."""
    run = Launch(net, run_dir, **kwargs)
    try:
        yield run
    finally:
        run.kill_all()


# -- cluster faults, journaled before they act -------------------------------------------------
def journal_fault(run_dir: Path, kind: str, *, host: str, step: int, **details) -> dict:
    """Append a fault record (``source: cluster``) to the run's journal, fsync'd."""
    record = dict(kind=kind, fault=f"cluster:{kind}:host={host}", index=-1, source="external",
                  origin="cluster", host=host, rank=None, step=step, pid=os.getpid(),
                  time_unix_s=time.time(), **details)
    append_journal(run_dir / "faults.jsonl", record)
    return record


def kill_host(run: Launch, host: str) -> dict:
    """A machine lost: every process of ``host`` SIGKILLed."""
    rec = journal_fault(run.run_dir, "node_lost", host=host,
                        step=completed_steps(run.run_dir) + 1,
                        evidence=f"every process of {host} killed (SIGKILL)")
    rec["pids"] = run.net.kill_node(host)
    return rec


def cluster_faults(run_dir: Path) -> list[dict]:
    path = run_dir / "faults.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines())
            if r.get("origin") == "cluster"]


def rank_warnings(run_dir: Path) -> list[str]:
    """What the ranks logged about failures and recoveries (every attempt, every host): shown
    when a recovery test finds more or fewer restarts than it expects."""
    words = ("recover", "declared", "stale", "withdrawn", "generation", "exiting", "Timed out")
    return [line for path in sorted(run_dir.glob("logs/*/attempt_*/*/stderr.log"))
            for line in path.read_text(errors="replace").splitlines()
            if any(w in line for w in words)]


def kill_tree(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def tcp_peers(net: NetCluster, host: str, port: int) -> set[str]:
    """IPv4 addresses with an established TCP connection to ``port`` on ``host`` (its
    /proc/net/tcp and tcp6, where the store's dual-stack socket lists v4-mapped peers; read
    inside its namespace)."""
    out = net.run(host, ["cat", "/proc/net/tcp", "/proc/net/tcp6"], timeout=10).stdout
    peers = set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "01" or ":" not in fields[1]:
            continue
        local, remote = fields[1], fields[2]
        if int(local.rsplit(":", 1)[1], 16) != port:
            continue
        raw = bytes.fromhex(remote.rsplit(":", 1)[0])
        v4 = raw[-4:][::-1]  # little-endian words; the v4 address is the last one
        peers.add(".".join(str(b) for b in v4))
    return peers


def wait_standby(run: Launch, host: str, timeout: float = 90.0) -> None:
    """Until ``host``'s agent is connected to the rendezvous store (it waits there as a
    standby: torchrun's redundancy list once the round is full)."""
    deadline = time.monotonic() + timeout
    address = run.net.address(host)
    head = next(h for h, n in run.net.nodes.items() if n.address == run.head)
    while time.monotonic() < deadline:
        if address in tcp_peers(run.net, head, RDZV_PORT):
            return
        if run.jobs[host].proc.poll() is not None:
            raise RuntimeError(f"{host}'s launcher ended:\n{run.jobs[host].output()[-2000:]}")
        time.sleep(0.3)
    raise TimeoutError(f"{host} never connected to the rendezvous")


def start_with_standby(run: Launch) -> float:
    """node0 (the rendezvous host), then node1 (each trains one rank), then the spare, which
    waits in the rendezvous as the standby; returns the seconds the spare took to get there."""
    run.start("node0")
    run.wait_rendezvous_host()
    run.start("node1")
    ranks = run.wait_ranks(2)
    if ranks != {"node0": [0], "node1": [1]}:
        raise AssertionError(f"ranks by host: {ranks}; expected node0: [0], node1: [1]")
    start = time.monotonic()
    run.start("spare")
    wait_standby(run, "spare")
    return time.monotonic() - start


def wait_step_after_restart(run: Launch, timeout: float = 120.0) -> dict:
    """Until rank 0 streams its first step after a restart record (the job trains again);
    returns that step's record."""
    deadline = time.monotonic() + timeout
    path = run.run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        seen_restart = False
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("kind") == "restart":
                        seen_restart = True
                    elif seen_restart and record.get("kind") == "step":
                        return record
        time.sleep(0.05)
    raise TimeoutError(f"no step after a restart in {timeout:.0f} s:\n{run.outputs()}")


def wait_for_spill(launcher_pid: int, *, step: int, timeout: float = 60.0) -> None:
    """Until the launcher's node memory folder holds its own snapshot of ``step`` and the
    copy it keeps for its ring peer (complete spills, as the runtime's own inventory lists
    them). The spills are a writer thread's, after the step: under a loaded suite they can
    land after the next step or two, and a fault injected before them restores an older copy
    than the test expects."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = {kind for folder in memory_dirs(launcher_pid)
                 for local in folder.glob("local*")
                 for kind, steps in NodeMemory(folder, local_rank=int(local.name[5:]))
                 .inventory().items() if step in steps}
        if {"own", "held"} <= found:
            return
        time.sleep(0.05)
    raise TimeoutError(f"step {step}'s snapshots never reached the memory folder of launcher "
                       f"{launcher_pid}")


def memory_dirs(launcher_pid: int) -> list[Path]:
    """The node memory folders of one launcher (under its watch folder in /dev/shm)."""
    return sorted(Path("/dev/shm").glob(f"trainpilot-{launcher_pid}-*/memory"))
