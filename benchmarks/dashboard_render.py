"""How fast the dashboard draws a long run: a 1M-step store beside a 10K-step one, in headless
Chromium (Debian's, through chromedriver: scripts/install_browser.sh installs both).

    .venv/bin/python benchmarks/dashboard_render.py                  # 10K and 1M steps
    .venv/bin/python benchmarks/dashboard_render.py --steps 10000    # one size only
    .venv/bin/python benchmarks/dashboard_render.py --keep /tmp/tp-bench   # reuse the stores

Each store holds what a monitored run writes every step (loss, its trend, lr, grad norm, step/
data/compute/comm times, tokens/s, MFU, skipped updates, the health score and its four parts:
16 series), per-layer gradient norms for 8 layers every 25 steps, memory every 25 steps, 2 ranks'
timings every step (rank 1 1.3x slower), a checkpoint event every 1,000 steps and a loss spike
with its alert every 100,000 steps; written through ``RunStore`` (so with its rollups), in
batches of 2,000 steps.

Measured, per store, 3 page loads each in a fresh tab: from navigation start to the first full
render (every chart drawn: ``window.trainpilot.status.firstRenderMs``), the size of the first
``/api/run`` answer, and a zoom: the time of ``/api/window`` for 5,000 steps (full resolution).
Also checked: the 1M-step page draws the spikes (the loss chart's maximum is the spike's value).
Target (issue 17): the 1M-step page renders in under 3 s.

Writes benchmarks/results/dashboard_render.txt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainpilot.fsio import atomic_write_text  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
TARGET_S = 3.0
SPIKE = 50.0
LAYERS = [f"blocks.{i}.mlp" for i in range(7)] + ["embed"]


def write_store(run_dir: Path, num_steps: int) -> float:
    """A store as a monitored 2-rank run writes it; returns seconds taken."""
    from trainpilot.store import RankTiming, RunStore

    start = time.perf_counter()
    store = RunStore.create(run_dir, name=f"bench-{num_steps}", world_size=2,
                            flush_every_steps=2000, flush_interval_s=3600)
    store.set_document("plan", {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 8,
                                "global_batch_size": 16, "seq_len": 64})
    for step in range(1, num_steps + 1):
        noise = 0.02 * math.sin(step * 12.9898) ** 2
        loss = 2.0 + 3.0 * step ** -0.3 + noise
        if step % 100_000 == 0:
            loss = SPIKE
        m = {"loss": loss, "loss_trend": loss - noise, "lr": 3e-4 * min(1.0, step / 2000),
             "grad_norm": 0.5 + noise, "step_time_s": 0.1 + noise, "data_time_s": 0.002,
             "compute_time_s": 0.07, "comm_time_s": 0.02, "tokens_per_s": 1024 / (0.1 + noise),
             "mfu": 0.4, "skipped_update": 0.0, "health/score": 95.0,
             "health/gradient_flow": 1.0, "health/communication": 0.95,
             "health/hardware": 0.85, "health/convergence": 1.0}
        if step % 25 == 0:
            m.update({f"grad_norm/{n}": 0.1 + 0.01 * i for i, n in enumerate(LAYERS)})
            m.update(peak_mem_gib=1.5, mem_frac=0.4)
        store.log_metrics(step, m, time_s=1.7e9 + 0.1 * step)
        store.log_rank_timings([RankTiming(step=step, rank=r, step_s=0.1 + noise,
                                           compute_s=0.07 * (1.3 if r else 1.0), comm_s=0.02,
                                           data_s=0.002) for r in (0, 1)])
        if step % 1000 == 0:
            store.log_event("checkpoint", step, {"step": step, "stall_s": 0.01})
        if step % 100_000 == 0:
            store.log_event("alert", step, {"loss": SPIKE}, severity="critical",
                            name="divergence_risk", message="loss spike")
    store.close(status="completed")
    return time.perf_counter() - start


def measure(run_dir: Path, num_steps: int, *, loads: int = 3) -> dict:
    from tests.ui import helpers

    proc, url = helpers.start_dashboard(run_dir)
    base = url.split("?")[0].rstrip("/")
    out: dict = {"render_s": [], "api_bytes": None}
    try:
        with urllib.request.urlopen(f"{base}/api/run?key=.", timeout=120) as resp:
            body = resp.read()
        out["api_bytes"] = len(body)
        out["max_points_per_series"] = max(len(s["steps"]) for s in
                                           json.loads(body)["series"].values())
        with tempfile.TemporaryDirectory() as profile:
            driver = helpers.make_driver(Path(profile))
            try:
                for _ in range(loads):
                    driver.get("about:blank")
                    driver.get(f"{base}/run?key=.&poll_ms=60000")
                    ms = helpers.wait_for(lambda: driver.execute_script(
                        "return window.trainpilot && window.trainpilot.status.firstRenderMs"),
                        timeout_s=120, what="the first render")
                    errors = driver.execute_script("return window.trainpilot.status.errors")
                    assert errors == 0, driver.execute_script(
                        "return window.trainpilot.status.lastError")
                    out["render_s"].append(ms / 1000.0)
                ys = driver.execute_script(
                    "const gd = document.getElementById('loss-chart');"
                    "return gd.data[0].y.filter(v => v !== null);")
                out["loss_max_drawn"] = max(ys)
                out["loss_points_drawn"] = len(ys)
            finally:
                driver.quit()
        start = time.perf_counter()
        lo = num_steps // 2
        with urllib.request.urlopen(f"{base}/api/window?key=.&lo={lo}&hi={lo + 4999}",
                                    timeout=60) as resp:
            window = json.loads(resp.read())
        out["zoom_s"] = time.perf_counter() - start
        out["zoom_points"] = len(window["series"]["loss"]["steps"])
        out["zoom_downsampled"] = window["series"]["loss"]["downsampled"]
    finally:
        helpers.kill_tree(proc)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--keep", type=Path, default=None,
                        help="folder for the stores (reused when present)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="tp-dash-bench-"))
    lines = ["dashboard render time in headless Chromium (first full render after navigation)",
             f"python {platform.python_version()}, {os.cpu_count()} cores, "
             f"load {os.getloadavg()[0]:.1f}", "",
             f"{'steps':>9} {'store MB':>8} {'write s':>7} {'render s (3 loads)':>22} "
             f"{'median':>6} {'/api/run KB':>11} {'pts/series':>10} {'zoom 5K s':>9} "
             f"{'zoom pts':>8} {'spike drawn':>11}"]
    ok = True
    for steps in args.steps:
        run_dir = root / f"steps-{steps}"
        write_s = math.nan
        if not (run_dir / "trainpilot.db").exists():
            write_s = write_store(run_dir, steps)
            print(f"wrote {steps} steps in {write_s:.0f} s", file=sys.stderr)
        m = measure(run_dir, steps)
        med = statistics.median(m["render_s"])
        size = (run_dir / "trainpilot.db").stat().st_size / 1e6
        spike = "yes" if steps < 100_000 or m["loss_max_drawn"] == SPIKE else "NO"
        lines.append(f"{steps:>9,} {size:>8.0f} {write_s:>7.0f} "
                     f"{' '.join(f'{x:.2f}' for x in m['render_s']):>22} {med:>6.2f} "
                     f"{m['api_bytes'] / 1e3:>11.0f} {m['max_points_per_series']:>10} "
                     f"{m['zoom_s']:>9.3f} {m['zoom_points']:>8} {spike:>11}")
        if steps >= 1_000_000:
            ok &= med < TARGET_S and spike == "yes"
    lines.append("")
    lines.append(f"target: the 1M-step store renders in < {TARGET_S:.0f} s: "
                 f"{'met' if ok else 'MISSED'}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if set(args.steps) == {10_000, 1_000_000}:
        atomic_write_text(RESULTS / "dashboard_render.txt", text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
