"""Step time of the user's own loop with trainpilot's parts (examples/ddp_with_trainpilot.py)
against the same loop without them (examples/plain_ddp.py), 2 ranks over gloo under torchrun.

Each round runs both scripts (order alternating A B, B A, ... so load drifts hit both alike) on
the same data (twelve standard-library files, BPE trained on them) and times rank 0's step lines
as they arrive: step time = (time of the last step line - time of step ``--skip``) / steps
between, so start-up, tokenizer training and warm-up steps are not counted. The parts' loop
runs the heartbeat, the fault injector's hooks, the non-finite vote (riding in the loss
all-reduce), the resumable sampler and the health monitor; it checkpoints after the last step
only (as trainer_vs_ddp.py runs the Trainer) unless ``--save-every N`` (async: host snapshot,
background write). Target (issue 15): the loop with our parts at >= 0.97x the plain loop's
throughput. Beside the wall time, the CPU time of both rank processes (all threads) between the
same two step lines. On this shared 2-core machine both vary by 5-10% from one launch to the
next, more than the effect measured: read the median over many rounds.

    .venv/bin/python benchmarks/user_loop_parts.py            # about 6 min; appends to results/
    .venv/bin/python benchmarks/user_loop_parts.py --rounds 1 --steps 40   # quick look
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "user_loop_parts.txt"
PIN = False  # --pin
FILES = ("argparse", "base64", "bisect", "calendar", "configparser", "datetime", "difflib",
         "inspect", "pathlib", "pickle", "pydoc", "typing")  # enough for 150 steps of 16


def copy_texts(folder: str) -> str:
    """Copy the standard-library files of FILES into ``folder``; returns their glob."""
    for name in FILES:
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / f"{name}.py", folder)
    return os.path.join(folder, "*.py")


def ranks_cpu_s(launcher_pid: int) -> float:
    """CPU seconds (user + system, all threads) used so far by the launcher's child processes:
    the ranks."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            except FileNotFoundError:
                continue  # it has just ended
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def step_time_s(script: str, data: str, steps: int, skip: int,
                extra: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of both ranks) per step of ``script`` on 2 ranks, from rank
    0's ``step N loss`` lines."""
    args = [str(REPO / "examples" / script), "--steps", str(steps), "--data", data, *extra]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2"]
    if PIN:  # rank r on CPU r: the scheduler does not move ranks between cores mid-run
        cmd = [*launcher, "--no-python", "bash", "-c",
               'exec taskset -c "$LOCAL_RANK" "$0" -u "$@"', sys.executable, *args]
    else:
        cmd = [*launcher, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    seen: dict[int, float] = {}
    cpu: dict[int, float] = {}
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            if line.startswith("step "):
                step = int(line.split()[1])
                seen[step] = time.monotonic()
                if step in (skip, steps):
                    cpu[step] = ranks_cpu_s(proc.pid)
        proc.wait()
    if proc.returncode or steps not in seen or skip not in seen:
        raise RuntimeError(f"{script} failed (exit {proc.returncode}, steps seen {sorted(seen)})")
    return ((seen[steps] - seen[skip]) / (steps - skip),
            (cpu[steps] - cpu[skip]) / (steps - skip))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps not timed")
    parser.add_argument("--save-every", type=int, default=0,
                        help="checkpoint every N steps (0: only after the last step, as "
                             "trainer_vs_ddp.py runs the Trainer)")
    parser.add_argument("--pin", action="store_true",
                        help="pin rank r to CPU r (taskset), for both loops")
    args = parser.parse_args()
    global PIN
    PIN = args.pin
    with tempfile.TemporaryDirectory() as tmp:
        data = copy_texts(tmp)
        plain, parts, ratios, cpu_ratios = [], [], [], []
        for r in range(args.rounds):
            order = ["plain", "parts"] if r % 2 == 0 else ["parts", "plain"]
            times, cpus = {}, {}
            for which in order:
                if which == "plain":
                    times[which], cpus[which] = step_time_s("plain_ddp.py", data, args.steps,
                                                            args.skip, [])
                else:
                    run_dir = os.path.join(tmp, f"run{r}")
                    times[which], cpus[which] = step_time_s(
                        "ddp_with_trainpilot.py", data, args.steps, args.skip,
                        ["--run-dir", run_dir, "--save-every",
                         str(args.save_every or args.steps)])
            plain.append(times["plain"])
            parts.append(times["parts"])
            ratios.append(times["plain"] / times["parts"])
            cpu_ratios.append(cpus["plain"] / cpus["parts"])
            print(f"round {r + 1}: plain {times['plain'] * 1e3:.1f} ms/step "
                  f"({cpus['plain'] * 1e3:.1f} CPU-ms), with parts {times['parts'] * 1e3:.1f} "
                  f"ms/step ({cpus['parts'] * 1e3:.1f} CPU-ms), throughput ratio "
                  f"{ratios[-1]:.3f} (CPU {cpu_ratios[-1]:.3f})", flush=True)
    load = os.getloadavg()[0]
    summary = (f"{time.strftime('%Y-%m-%d %H:%M')} steps={args.steps} skip={args.skip} "
               f"save_every={args.save_every} rounds={args.rounds} load={load:.1f}: "
               f"plain {statistics.median(plain) * 1e3:.1f} ms/step, with parts "
               f"{statistics.median(parts) * 1e3:.1f} ms/step, median ratio "
               f"{statistics.median(ratios):.3f} (per round {', '.join(f'{x:.3f}' for x in ratios)}"
               f"), median CPU-time ratio {statistics.median(cpu_ratios):.3f} (CPU-ms per step "
               "summed over both ranks)")
    print(summary)
    RESULTS.parent.mkdir(exist_ok=True)
    with open(RESULTS, "a") as handle:
        handle.write(summary + "\n")


if __name__ == "__main__":
    main()
