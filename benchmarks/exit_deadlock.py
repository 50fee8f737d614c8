"""How often the plain DDP example hangs after its last step: as shipped (``keep_alive(model)``
before ``main`` returns) vs the same file without that line, alternated in one run.

    python benchmarks/exit_deadlock.py              # 5 runs of each, ~3 min
    python benchmarks/exit_deadlock.py --runs 10

The mechanism (trainpilot/runtime/procexit.py): the DDP model's reducer holds the last reference
to the gloo group once ``destroy_process_group`` has run, so freeing the model as ``main``
returns destroys the group with the GIL held while gloo's worker thread, dropping its last work,
waits for the GIL. Each run is ``torchrun --nproc-per-node 2 examples/plain_ddp.py --steps 4``
on four standard-library files; a run still going after ``TIMEOUT_S`` (its four steps take
about 10 s) is counted hung and killed. How often it hangs depends on the machine's load (3 of 3
runs beside one training process on this 2-core machine; a smaller DDP loop of our own, even
beside two busy loops, never hung): run it beside other work.

Writes benchmarks/results/exit_deadlock.txt and prints it.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from exit_abort import write_report  # this folder is sys.path[0] when run as a script

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "plain_ddp.py"
KEEP_LINE = "    keep_alive(model)"
MODES = ("as shipped", "without keep_alive")
TIMEOUT_S = 45.0


def variant(mode: str, folder: Path) -> Path:
    """The example as shipped, or a copy without its ``keep_alive`` line."""
    if mode == "as shipped":
        return EXAMPLE
    lines = EXAMPLE.read_text().splitlines(keepends=True)
    kept = [line for line in lines if not line.startswith(KEEP_LINE)]
    if len(kept) != len(lines) - 1:
        raise SystemExit(f"{EXAMPLE} has no line starting {KEEP_LINE.strip()!r}")
    path = folder / "plain_ddp_without_keep_alive.py"
    path.write_text("".join(kept))
    return path


def run_once(script: Path, data: str) -> str:
    """'clean', 'hung' or 'failed' for one torchrun of ``script``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", str(script), "--steps", "4", "--data", data]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        return "clean" if proc.wait(TIMEOUT_S) == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks
        proc.wait()
        return "hung"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each variant")
    args = parser.parse_args(argv)
    counts = {mode: dict(hung=0, clean=0, failed=0) for mode in MODES}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:4]:
            shutil.copy(path, folder)
        data = str(folder / "*.py")
        scripts = {mode: variant(mode, folder) for mode in MODES}
        for i in range(args.runs):
            for mode in MODES:  # alternated: the same load for both
                counts[mode][run_once(scripts[mode], data)] += 1
            print(f"\r{i + 1}/{args.runs} runs of each", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    write_report("exit_deadlock", f"--runs {args.runs}", load,
                 f"example               hung (> {TIMEOUT_S:.0f} s)  clean  failed",
                 [f"{mode:<21} {counts[mode]['hung']:>4} of {args.runs:<10} "
                  f"{counts[mode]['clean']:>5}  {counts[mode]['failed']:>6}" for mode in MODES])
    return 0

if __name__ == "__main__":
    sys.exit(main())
