"""Step time of the user's own loop with trainpilot's parts (examples/ddp_with_trainpilot.py)
against the same loop without them (examples/plain_ddp.py), 2 ranks over gloo under torchrun.

Each round runs both scripts (order alternating A B, B A, ... so load drifts hit both alike) on
the same data (four standard-library files, BPE trained on them) and times rank 0's step lines
as they arrive: step time = (time of the last step line - time of step ``--skip``) / steps
between, so start-up, tokenizer training and warm-up steps are not counted. The parts' loop
saves a checkpoint every ``--save-every`` steps (async: host snapshot, background write), runs
the heartbeat, the fault injector's hooks, the non-finite vote (one 1-float all-reduce) and the
health monitor. Target (issue 15): the loop with our parts at >= 0.97x the plain loop's
throughput.

    .venv/bin/python benchmarks/user_loop_parts.py            # about 5 min; appends to results/
    .venv/bin/python benchmarks/user_loop_parts.py --rounds 1 --steps 20   # quick look
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
FILES = ("argparse", "base64", "bisect", "calendar")


def step_time_s(script: str, data: str, steps: int, skip: int, extra: list[str]) -> float:
    """Seconds per step of ``script`` on 2 ranks, from rank 0's ``step N loss`` lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(REPO / "examples" / script), "--steps", str(steps), "--data", data, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    seen: dict[int, float] = {}
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, bufsize=1) as proc:
        for line in proc.stdout:
            if line.startswith("step "):
                seen[int(line.split()[1])] = time.monotonic()
        proc.wait()
    if proc.returncode or steps not in seen or skip not in seen:
        raise RuntimeError(f"{script} failed (exit {proc.returncode}, steps seen {sorted(seen)})")
    return (seen[steps] - seen[skip]) / (steps - skip)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps not timed")
    parser.add_argument("--save-every", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in FILES:
            shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / f"{name}.py", tmp)
        data = os.path.join(tmp, "*.py")
        plain, parts, ratios = [], [], []
        for r in range(args.rounds):
            order = ["plain", "parts"] if r % 2 == 0 else ["parts", "plain"]
            times = {}
            for which in order:
                if which == "plain":
                    times[which] = step_time_s("plain_ddp.py", data, args.steps, args.skip, [])
                else:
                    run_dir = os.path.join(tmp, f"run{r}")
                    times[which] = step_time_s(
                        "ddp_with_trainpilot.py", data, args.steps, args.skip,
                        ["--run-dir", run_dir, "--save-every", str(args.save_every)])
            plain.append(times["plain"])
            parts.append(times["parts"])
            ratios.append(times["plain"] / times["parts"])
            print(f"round {r + 1}: plain {times['plain'] * 1e3:.1f} ms/step, with parts "
                  f"{times['parts'] * 1e3:.1f} ms/step, throughput ratio {ratios[-1]:.3f}",
                  flush=True)
    load = os.getloadavg()[0]
    summary = (f"{time.strftime('%Y-%m-%d %H:%M')} steps={args.steps} skip={args.skip} "
               f"save_every={args.save_every} rounds={args.rounds} load={load:.1f}: "
               f"plain {statistics.median(plain) * 1e3:.1f} ms/step, with parts "
               f"{statistics.median(parts) * 1e3:.1f} ms/step, median ratio "
               f"{statistics.median(ratios):.3f} (per round {', '.join(f'{x:.3f}' for x in ratios)})")
    print(summary)
    RESULTS.parent.mkdir(exist_ok=True)
    with open(RESULTS, "a") as handle:
        handle.write(summary + "\n")


if __name__ == "__main__":
    main()
