"""Streaming speed of `trainpilot diagnose` on one core: a large training log, plain and gzip.

    .venv/bin/python benchmarks/diagnose_speed.py            # 200 MB
    .venv/bin/python benchmarks/diagnose_speed.py --mb 50

The log imitates what long runs print (one line type per source, rotating): Megatron-LM
iteration lines, NCCL INFO channel lines, torchtitan step lines, Hugging Face Trainer dicts,
glog-prefixed c10d warnings, and a few hundred NCCL WARN / checkpoint lines; the failure (an
Xid 79 and the timeouts it causes) is at the end, so the whole file must be read. Measured: CPU
seconds of the process (``time.process_time``: one thread) for ``Diagnoser.diagnose_files``, and
MB of (decompressed) log per CPU second (best of 5 runs, and their median; the pattern library
already loaded, its load reported apart). The verdict is checked. Target (issue 17): >= 50 MB/s.

Writes benchmarks/results/diagnose_speed.txt.
"""

from __future__ import annotations

import argparse
import gzip
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from trainpilot.fsio import atomic_write_text  # noqa: E402
from trainpilot.health.diagnosis import Diagnoser  # noqa: E402

TARGET_MB_S = 50.0
LINES = (
    " iteration {i:8d}/  250000 | consumed samples: {s:12d} | elapsed time per iteration (ms): "
    "4247.9 | learning rate: 2.999E-04 | global batch size:  1024 | lm loss: 2.382640E+00 | "
    "loss scale: 1.0 | grad norm: 0.227 | number of skipped iterations:   0 | number of nan "
    "iterations:   0 |",
    "node4:771:2210 [4] NCCL INFO Channel {c:02d}/0 : 12[4] -> 20[4] [send] via NET/IB/3",
    "[rank0]:[titan] 2025-05-28 21:13:37,816 - root - INFO - step: {i}  loss: 3.1234  memory: "
    "36.90GiB(46.63%)  tps: 4123  tflops: 90.11  mfu: 29.12%",
    "{{'loss': 2.9043, 'grad_norm': 0.8123, 'learning_rate': 4.999641867738336e-05, 'epoch': "
    "0.02}}",
    "[W603 11:58:01.100000000 ProcessGroupNCCL.cpp:1250] Warning: TORCH_NCCL_AVOID_RECORD_STREAMS"
    " is the default now",
    "2024-06-03 12:00:01,002 - INFO - step {i} loss 3.112 lr 3e-4 grad_norm 0.81 tok/s 5614",
)
FAILURE = """\
Jun  3 12:00:07 node1 kernel: [1832210.554420] NVRM: Xid (PCI:0000:3b:00): 79, pid=14871, name=python, GPU has fallen off the bus.
[rank0]:[E603 12:10:05.483726517 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=18234, OpType=ALLREDUCE, NumelIn=52428800, NumelOut=52428800, Timeout(ms)=600000) ran for 600064 milliseconds before timing out.
"""


def write_log(path: Path, megabytes: float) -> int:
    target = int(megabytes * 1e6)
    written, i = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            block = []
            for _ in range(1000):
                block.append(LINES[i % len(LINES)].format(i=i, s=i * 1024, c=i % 32))
                i += 1
            if i % 200_000 == 0:
                block.append("node4:771:2263 [4] NCCL WARN NET/IB : peer 10.0.5.21 slow "
                             "completion, retrying")
            text = "\n".join(block) + "\n"
            f.write(text)
            written += len(text)
        f.write(FAILURE)
    return path.stat().st_size


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def measure(diagnoser: Diagnoser, path: Path, runs: int = 5) -> tuple[float, float, str]:
    """(best, median) CPU seconds of ``runs`` diagnoses of ``path``, and the verdict. On a shared
    machine other work only adds time, so the best run is the code's own speed; the median
    says how noisy the machine was."""
    times = []
    verdict = ""
    for _ in range(runs):
        start = time.process_time()
        result = diagnoser.diagnose_files([path])
        times.append(time.process_time() - start)
        verdict = result.category
    return min(times), statistics.median(times), verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=200.0)
    args = parser.parse_args()
    lines = ["diagnose streaming speed, one thread (CPU seconds: time.process_time)",
             f"python {platform.python_version()}, {cpu_model()}, {os.cpu_count()} cores, load "
             f"{os.getloadavg()[0]:.1f}; best and median of 5 runs", "",
             f"{'input':<8} {'MB (text)':>9} {'MB on disk':>10} {'CPU s':>7} {'MB/s':>7} "
             f"{'median':>7} verdict"]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "train.log"
        size = write_log(plain, args.mb)
        packed = Path(tmp) / "train.log.gz"
        with open(plain, "rb") as src, gzip.open(packed, "wb", compresslevel=6) as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        start = time.process_time()
        diagnoser = Diagnoser()  # loads and checks the pattern library (once per command)
        startup_s = time.process_time() - start
        for name, path in (("plain", plain), ("gzip", packed)):
            cpu_s, median_s, verdict = measure(diagnoser, path)
            rate = size / 1e6 / cpu_s
            ok &= rate >= TARGET_MB_S and verdict == "gpu_hardware"
            lines.append(f"{name:<8} {size / 1e6:>9.0f} {path.stat().st_size / 1e6:>10.1f} "
                         f"{cpu_s:>7.2f} {rate:>7.1f} {size / 1e6 / median_s:>7.1f} {verdict}")
    lines += ["", f"start-up (pattern library load and compile, once per command): "
                  f"{startup_s:.2f} CPU s, not included above",
              f"target: >= {TARGET_MB_S:.0f} MB/s of log text per CPU second, verdict "
                  f"gpu_hardware: {'met' if ok else 'MISSED'}"]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.mb >= 200:
        atomic_write_text(REPO / "benchmarks" / "results" / "diagnose_speed.txt", text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
