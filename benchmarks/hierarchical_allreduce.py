"""Hierarchical vs flat all-reduce on 4 gloo ranks as 2 nodes x 2, over a real slow link.

    sudo python benchmarks/hierarchical_allreduce.py            # ~2 min; needs root + iproute2
    python benchmarks/hierarchical_allreduce.py --inter-mbit 400 --sizes-mb 1 4 16

The "nodes" are two Linux network namespaces. Inside a node, ranks talk over loopback (fast).
Between nodes each local rank has its own link ("rail", a veth pair, as one NIC per GPU in
rail-optimised clusters), shaped with ``tc tbf`` to ``--inter-mbit`` in each direction. Gloo
binds every rank to its rail (``GLOO_SOCKET_IFNAME``). Nothing is simulated inside the
collective: the kernel delays the packets.

Measured per message size: median time of a flat ``all_reduce`` and of the hierarchical one
(intra-node reduce-scatter, inter-node all-reduce among ranks of the same local rank,
intra-node all-gather); bytes that left each node, from the rails' ``tx_bytes`` counters. Then
DDP steps of the reference model (tiny-gpt) flat vs hierarchical, per bucket size and overlap.

Predicted, beside each measurement:

* "gloo ring": alpha-beta for the algorithms gloo runs (ours, in this file): a flat ring over
  0-1-2-3 crosses the node boundary on two of its four edges, so every ring step waits for the
  slow link: 2 (p-1) (alpha_inter + S / (p B_inter)); hierarchical: all-to-all and all-gather
  of S/2 over loopback plus a 2-rank all-reduce of S/2 on each rail in parallel.
* "perf": ``trainpilot.perf.topology.Network.all_reduce_s`` (the cost model) on a ClusterSpec
  with the same measured link figures. The cluster's device family (``cpu``) makes it model
  gloo's algorithms: one ring over all ranks paced by its slowest edge, and the runtime's
  staged all-reduce for the hierarchical form. (Until the collective library became part of
  the model it assumed NCCL's rail-aligned rings, which use every rail for a flat all-reduce,
  predicted flat 62-70% too fast and no gain from the hierarchy.)
* DDP steps: ``trainpilot.perf.predict`` on that ClusterSpec with the calibrated CPU matmul rate.

Link figures (alpha, B) come from a calibration at the start of the run: a 2-rank all-reduce
inside a node (loopback) and across one rail; they are inputs to both models, never fitted to
the results. Writes benchmarks/results/hierarchical_allreduce.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainpilot.runtime.procexit import run_and_end

RESULTS = Path(__file__).resolve().parent / "results"
NODES, PER_NODE = 2, 2


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inter-mbit", type=float, default=200.0,
                        help="inter-node rail rate per direction, Mbit/s (tc tbf)")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ddp-steps", type=int, default=12)
    parser.add_argument("--bucket-mb", type=float, nargs="+", default=[1.0, 25.0])
    parser.add_argument("--out", type=Path, default=RESULTS / "hierarchical_allreduce.json")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--master", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- network namespaces --------------------------------------------------------------------

class Testbed:
    """Two namespaces ("nodes") joined by one shaped veth pair per local rank."""

    def __init__(self, inter_mbit: float):
        self.tag = f"tp{os.getpid() % 100000}"
        self.subnet = 10 + os.getpid() % 200
        self.inter_mbit = inter_mbit

    def ns(self, node: int) -> str:
        return f"{self.tag}n{node}"

    def iface(self, node: int, local: int) -> str:
        return f"{self.tag}r{local}{'ab'[node]}"

    def address(self, node: int, local: int) -> str:
        return f"10.{self.subnet}.{local}.{node + 1}"

    def __enter__(self) -> Testbed:
        for node in range(NODES):
            _ip("netns", "add", self.ns(node))
            _ip("-n", self.ns(node), "link", "set", "lo", "up")
        for local in range(PER_NODE):
            a, b = self.iface(0, local), self.iface(1, local)
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            for node, name in ((0, a), (1, b)):
                _ip("link", "set", name, "netns", self.ns(node))
                _ip("-n", self.ns(node), "addr", "add", f"{self.address(node, local)}/24",
                    "dev", name)
                _ip("-n", self.ns(node), "link", "set", name, "up")
                # Cross-rail replies come back on another interface: no reverse-path filter.
                for conf in ("all", "default", name):
                    _run("ip", "netns", "exec", self.ns(node), "sysctl", "-qw",
                         f"net.ipv4.conf.{conf}.rp_filter=0")
                _run("ip", "netns", "exec", self.ns(node), "tc", "qdisc", "add", "dev", name,
                     "root", "tbf", "rate", f"{self.inter_mbit}mbit", "burst", "256kb",
                     "latency", "100ms")
        return self

    def __exit__(self, *exc) -> None:
        for node in range(NODES):  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", self.ns(node)], capture_output=True)


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip()}")


def can_shape() -> str | None:
    """None when namespaces and tc are usable, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2)"
    return None


def launch(args: argparse.Namespace, bed: Testbed) -> list[subprocess.Popen]:
    procs = []
    master = f"{bed.address(0, 0)}:{29500 + os.getpid() % 1000}"
    for rank in range(NODES * PER_NODE):
        node, local = divmod(rank, PER_NODE)
        env = dict(os.environ, OMP_NUM_THREADS="1", RANK=str(rank),
                   WORLD_SIZE=str(NODES * PER_NODE), GLOO_SOCKET_IFNAME=bed.iface(node, local))
        cmd = ["ip", "netns", "exec", bed.ns(node), sys.executable, __file__,
               f"--worker={rank}", f"--master={master}", f"--inter-mbit={args.inter_mbit}",
               f"--repeats={args.repeats}", f"--ddp-steps={args.ddp_steps}",
               f"--out={args.out}", "--sizes-mb", *map(str, args.sizes_mb),
               "--bucket-mb", *map(str, args.bucket_mb)]
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    return procs


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    reason = can_shape()
    if reason:
        print(f"error: this benchmark shapes a real link between network namespaces and {reason}."
              " Without it there is no slow inter-node link to measure.", file=sys.stderr)
        return 2
    start = time.time()
    with Testbed(args.inter_mbit) as bed:
        procs = launch(args, bed)
        try:
            codes = [p.wait(timeout=900) for p in procs]
        except subprocess.TimeoutExpired:
            codes = [1]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
    if any(codes):
        print(f"error: ranks exited with {codes}", file=sys.stderr)
        return 1
    from trainpilot.fsio import atomic_write_text

    atomic_write_text(args.out.with_suffix(".txt"), print_tables(json.loads(args.out.read_text())))
    print(f"wall {time.time() - start:.0f} s; results in {args.out} (.txt: the tables)")
    return 0


def report(path: Path) -> str:
    """Print the tables of a results file again (``python -c`` or an import)."""
    return print_tables(json.loads(Path(path).read_text()))


# -- one rank ----------------------------------------------------------------------------------

def worker(args: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from trainpilot.fsio import atomic_write_text
    from trainpilot.runtime.comm import build_groups

    torch.set_num_threads(1)
    rank, world = args.worker, NODES * PER_NODE
    host, port = args.master.split(":")
    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore(host, int(port), world_size=world, is_master=rank == 0,
                          timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    groups = build_groups(shaped_cluster(dict(intra_bw=1e9, intra_lat=0, inter_bw=1e8,
                                              inter_lat=0), 0.1))
    links = calibrate_links(groups)
    tflops = _matmul_tflops()
    cluster = shaped_cluster(links, tflops)
    collectives = [collective_row(size_mb, groups, links, args.repeats)
                   for size_mb in args.sizes_mb]
    ddp = [ddp_row(bucket_mb, overlap, hierarchical, cluster, args.ddp_steps)
           for hierarchical in (False, True) for overlap in (True, False)
           for bucket_mb in args.bucket_mb]
    if rank == 0:
        result = dict(inter_mbit=args.inter_mbit, links=links, matmul_tflops=tflops,
                      load_average=os.getloadavg(), collectives=collectives, ddp=ddp)
        atomic_write_text(args.out, json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _max_over_ranks(value: float, group=None) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _median_time(fn, repeats: int, group=None) -> float:
    """Median over ``repeats`` of the slowest rank's time of ``fn`` (all ranks start together)."""
    import torch.distributed as dist

    fn()  # warm-up: connections, allocations
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(_max_over_ranks(time.perf_counter() - start))
    return statistics.median(times)


def calibrate_links(groups) -> dict:
    """alpha (s) and B (bytes/s) of a 2-rank ring all-reduce, T = 2 alpha + S / B, inside a
    node (loopback) and across one rail; both pairs of each kind run at once."""
    import torch
    import torch.distributed as dist

    out = {}
    for kind, sub in (("intra", groups.local), ("inter", groups.cross_node)):
        small, large = torch.ones(2), torch.ones(1 << 20)  # 8 B and 4 MiB
        t_small = _median_time(lambda t=small, g=sub.group: dist.all_reduce(t, group=g), 9)
        t_large = _median_time(lambda t=large, g=sub.group: dist.all_reduce(t, group=g), 5)
        out[f"{kind}_lat"] = t_small / 2
        out[f"{kind}_bw"] = large.numel() * 4 / max(t_large - t_small, 1e-9)
    return out


def _matmul_tflops() -> float:
    from trainpilot.runtime.calibrate import measure_matmul_tflops

    return statistics.mean([measure_matmul_tflops(size=512) for _ in range(2)])


def shaped_cluster(links: dict, matmul_tflops: float):
    """2 nodes x 2 CPU ranks with the measured link figures (what both models are given)."""
    from trainpilot.specs import ClusterSpec
    from trainpilot.specs.presets import device_preset

    device = dict(device_preset("cpu"), peak_tflops=dict(fp32=matmul_tflops, bf16=matmul_tflops))
    return ClusterSpec(
        name="netns-2x2", device=device, devices_per_node=PER_NODE, num_nodes=NODES,
        network=dict(intra_node=dict(gbytes_per_s=links["intra_bw"] / 1e9,
                                     latency_us=links["intra_lat"] * 1e6),
                     inter_node=dict(gbytes_per_s=links["inter_bw"] / 1e9,
                                     latency_us=links["inter_lat"] * 1e6)))


def gloo_ring_prediction(size: float, links: dict) -> tuple[float, float]:
    """(flat, hierarchical) seconds for a ``size``-byte all-reduce; see the module docstring."""
    p = NODES * PER_NODE
    a_i, b_i, a_e, b_e = (links[k] for k in ("intra_lat", "intra_bw", "inter_lat", "inter_bw"))
    flat = 2 * (p - 1) * (a_e + size / p / b_e)  # every ring step waits for the slow edge
    half = size / PER_NODE
    hier = (a_i + half / b_i) + 2 * (a_e + half / NODES / b_e) + (a_i + half / b_i)
    return flat, hier


def perf_prediction(size: float, links: dict) -> tuple[float, float]:
    """The cost model's all-reduce on the shaped ClusterSpec: its collective library comes
    from the cluster (the ``cpu`` device family runs gloo), as in every ``perf.predict``."""
    from trainpilot.perf.hardware import curve_for
    from trainpilot.perf.topology import GroupSpan, Network

    cluster = shaped_cluster(links, 0.1)
    net = Network.of(cluster, curve_for(cluster).collective_library)
    span = GroupSpan(NODES * PER_NODE, PER_NODE, NODES, 1)
    return (net.all_reduce_s(span, size, hierarchical=False),
            net.all_reduce_s(span, size, hierarchical=True))


def _tx_bytes(iface: str) -> int:
    return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())


def collective_row(size_mb: float, groups, links: dict, repeats: int) -> dict:
    """Flat vs hierarchical all-reduce of ``size_mb`` MB of fp32: time, and bytes that left each
    node (the rails' transmit counters, TCP/IP headers included)."""
    import torch
    import torch.distributed as dist

    from trainpilot.runtime.comm import StagedAllReduce
    from trainpilot.runtime.comm.counters import CommCounters

    iface = os.environ["GLOO_SOCKET_IFNAME"]
    x = torch.ones(int(size_mb * 1e6) // 4)
    size = x.numel() * 4
    staged = StagedAllReduce.from_groups(groups)
    row = dict(size_mb=size / 1e6)
    for name, fn in (("flat", lambda: dist.all_reduce(x.clone())), ("hier", lambda: staged(x))):
        row[f"{name}_s"] = _median_time(fn, repeats)
        before = _tx_bytes(iface)
        dist.barrier()
        fn()
        dist.barrier()
        left = torch.tensor([_tx_bytes(iface) - before], dtype=torch.float64)
        dist.all_reduce(left)  # every rank's rail: all bytes that left either node
        row[f"{name}_off_node_mb"] = float(left) / NODES / 1e6  # per node
        if name == "hier":  # the counters' model of the same call
            counters = CommCounters()
            staged.counters = counters
            staged(x)
            staged.counters = None
            model = torch.tensor([counters.end_step().off_node_bytes], dtype=torch.float64)
            dist.all_reduce(model)
            row["hier_off_node_model_mb"] = float(model) / NODES / 1e6
    # Flat ring 0-1-2-3: one rank per node (1, 3) sends its whole 2(p-1)/p S to the other node.
    row["flat_off_node_model_mb"] = 2 * (NODES * PER_NODE - 1) / (NODES * PER_NODE) * size / 1e6
    row["gloo_flat_s"], row["gloo_hier_s"] = gloo_ring_prediction(size, links)
    row["perf_flat_s"], row["perf_hier_s"] = perf_prediction(size, links)
    return row


def ddp_row(bucket_mb: float, overlap: bool, hierarchical: bool, cluster, steps: int) -> dict:
    """Median step time of tiny-gpt under DDP with these comm options, and perf's prediction."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainpilot.perf import predict
    from trainpilot.runtime.comm import ddp_kwargs, make_comm_hook
    from trainpilot.runtime.data import MarkovCorpus
    from trainpilot.runtime.models import build_gpt, init_parameters
    from trainpilot.specs import CommOptions, Plan, load_model

    # 2 sequences per rank: little compute, so the step is communication-bound, the regime
    # where fusion, overlap and the hierarchy matter (4 ranks share 2 cores here).
    spec, seq, batch = load_model("tiny-gpt"), 64, 2
    comm = CommOptions(bucket_mb=bucket_mb, overlap=overlap, hierarchical=hierarchical)
    model = build_gpt(spec, max_seq_len=seq, device="cpu")
    init_parameters(model, spec, seed=0)
    ddp = DDP(model, **ddp_kwargs(comm, model))
    hook = make_comm_hook(comm, cluster).register(ddp)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    corpus = MarkovCorpus(vocab_size=spec.vocab_size, seq_len=seq, seed=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    times, comm_s = [], []
    for step in range(steps):
        first = (step * world + rank) * batch
        x, y = corpus.get_batch(np.arange(first, first + batch))
        dist.barrier()
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(_max_over_ranks(time.perf_counter() - start))
        comm_s.append(hook.end_step().comm_s)
    hook.close()
    plan = Plan(dp=world, micro_batch_size=batch, global_batch_size=world * batch, seq_len=seq,
                comm=comm, zero=0)
    prediction = predict(spec, cluster, plan)
    return dict(bucket_mb=bucket_mb, overlap=overlap, hierarchical=hierarchical,
                step_s=statistics.median(times[2:]), comm_s=statistics.median(comm_s[2:]),
                perf_step_s=prediction.step_time_s,
                perf_dp_exposed_s=prediction.breakdown_s["dp_comm_exposed"])


# -- report ------------------------------------------------------------------------------------

def _err(predicted: float, measured: float) -> str:
    return f"{(predicted / measured - 1) * 100:+.0f}%"


def print_tables(result: dict) -> str:
    """Print the tables; returns them as text."""
    from rich.console import Console
    from rich.table import Table

    links = result["links"]
    console = Console(width=180, record=True)
    if "load_average" in result:  # other processes share these 2 cores: say how many
        console.print("load average at the end of the run: "
                      + ", ".join(f"{x:.1f}" for x in result["load_average"]))
    console.print(
        f"links (calibrated): intra-node {links['intra_bw'] / 1e6:.0f} MB/s, "
        f"alpha {links['intra_lat'] * 1e6:.0f} us; inter-node rail {links['inter_bw'] / 1e6:.1f}"
        f" MB/s (tbf {result['inter_mbit']:.0f} Mbit/s = {result['inter_mbit'] / 8:.1f} MB/s), "
        f"alpha {links['inter_lat'] * 1e6:.0f} us")
    table = Table(title="all-reduce, 4 gloo ranks as 2 nodes x 2 (network namespaces, tc tbf); "
                        "predictions with their error against the measurement")
    for col in ("MB", "flat s", "gloo-ring", "perf", "hier s", "gloo-ring ", "perf ",
                "speed-up", "gloo-ring  ", "perf  ", "off-node MB/node: flat", "model",
                "hier", "model "):
        table.add_column(col, justify="right")
    for r in result["collectives"]:
        table.add_row(
            f"{r['size_mb']:.1f}", f"{r['flat_s']:.3f}",
            f"{r['gloo_flat_s']:.3f} ({_err(r['gloo_flat_s'], r['flat_s'])})",
            f"{r['perf_flat_s']:.3f} ({_err(r['perf_flat_s'], r['flat_s'])})",
            f"{r['hier_s']:.3f}",
            f"{r['gloo_hier_s']:.3f} ({_err(r['gloo_hier_s'], r['hier_s'])})",
            f"{r['perf_hier_s']:.3f} ({_err(r['perf_hier_s'], r['hier_s'])})",
            f"{r['flat_s'] / r['hier_s']:.2f}x", f"{r['gloo_flat_s'] / r['gloo_hier_s']:.2f}x",
            f"{r['perf_flat_s'] / r['perf_hier_s']:.2f}x",
            f"{r['flat_off_node_mb']:.2f}", f"{r['flat_off_node_model_mb']:.2f}",
            f"{r['hier_off_node_mb']:.2f}", f"{r['hier_off_node_model_mb']:.2f}")
    console.print(table)
    table = Table(title="DDP step, tiny-gpt (3.4 MB of fp32 gradients), 2 x 64 tokens per rank, "
                        "4 ranks on 2 cores; perf = trainpilot.perf.predict")
    for col in ("reduction", "overlap", "bucket MB", "step s", "comm s (busy)",
                "perf step s", "error", "perf exposed comm s"):
        table.add_column(col, justify="right")
    for r in result["ddp"]:
        table.add_row("hierarchical" if r["hierarchical"] else "flat", str(r["overlap"]),
                      f"{r['bucket_mb']:g}", f"{r['step_s']:.3f}", f"{r['comm_s']:.3f}",
                      f"{r['perf_step_s']:.3f}", _err(r["perf_step_s"], r["step_s"]),
                      f"{r['perf_dp_exposed_s']:.3f}")
    console.print(table)
    return console.export_text()


if __name__ == "__main__":
    run_and_end(main)
