"""Helpers for the UI tests and the README screenshot: a real training run, the dashboard
server as a subprocess (the real CLI), and headless Chromium through selenium + chromedriver."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHROMEDRIVER_CANDIDATES = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
NO_BROWSER = ("Chromium and chromedriver are not installed: run scripts/install_browser.sh "
              "(Debian's chromium and chromium-driver)")


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def kill_tree(proc: subprocess.Popen) -> None:
    """Stop a process we started in its own session, and its children, by its id."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def train(run_dir: Path, *, steps: int = 60, slow_rank: int | None = 1, spike_at: int | None = 40,
          timeout_s: float = 150, nproc: int = 2) -> Path:
    """A real ``nproc``-rank gloo run under torchrun (``tests.ui.ddp_run``) writing ``run_dir``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "tests.ui.ddp_run", str(run_dir),
           "--steps", str(steps)]
    if slow_rank is not None:
        cmd += ["--slow-rank", str(slow_rank)]
    if spike_at is not None:
        cmd += ["--spike-at", str(spike_at)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise RuntimeError(f"training did not finish in {timeout_s} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"training failed ({proc.returncode}):\n{out[-3000:]}")
    return run_dir


def start_dashboard(root: Path, *args: str, timeout_s: float = 60) -> tuple[subprocess.Popen, str]:
    """``trainpilot dashboard ROOT --port 0 ARGS`` in its own session; returns (process, URL
    it printed). The caller stops it with :func:`kill_tree`."""
    proc = subprocess.Popen([sys.executable, "-m", "trainpilot", "dashboard", str(root),
                             "--port", "0", *args], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + timeout_s
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if " at http://" in line:
            url = line.split(" at ", 1)[1].strip()
            _wait_listening(url, deadline)
            return proc, url
    kill_tree(proc)
    raise RuntimeError("dashboard did not start:\n" + "".join(lines))


def _wait_listening(url: str, deadline: float) -> None:
    import urllib.error
    import urllib.request

    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url.split("?")[0] + "static/style.css", timeout=2)
            return
        except urllib.error.HTTPError:
            return  # it answers (a 401 without the token is an answer)
        except OSError:
            time.sleep(0.1)


def chromedriver_path() -> str | None:
    import shutil

    found = shutil.which("chromedriver")
    if found:
        return found
    return next((p for p in CHROMEDRIVER_CANDIDATES if os.access(p, os.X_OK)), None)


def make_driver(profile_dir: Path, *, width: int = 1400, height: int = 1000):
    """Headless Chromium under chromedriver (both Debian's), with a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    from trainpilot.ui.browser import chromium_flags, find_chromium

    options = webdriver.ChromeOptions()
    options.binary_location = find_chromium()
    for flag in chromium_flags(profile_dir):
        options.add_argument(flag)
    options.add_argument(f"--window-size={width},{height}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(chromedriver_path()))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    return driver


def wait_for(predicate: Callable[[], Any], *, timeout_s: float = 45, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; its value, or AssertionError."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


def chart_traces(driver, chart_id: str) -> list[dict[str, Any]]:
    """What plotly drew in ``chart_id``: per trace its name, colour and width, the data it was
    given (``x``, ``y``, ``customdata``) and, from ``gd.calcdata`` (recomputed only when plotly
    really redraws), the drawn points ``dx``, ``dy`` (scatter) or matrix ``dz`` (heatmap)."""
    return driver.execute_script(
        "const gd = document.getElementById(arguments[0]);"
        "if (!gd || !gd.data) return [];"
        "return gd.data.map((t, i) => {"
        "  const cd = gd.calcdata && gd.calcdata[i] || [];"
        "  const heat = t.type === 'heatmap';"
        "  return {name: t.name, type: t.type, x: t.x, y: t.y, customdata: t.customdata || null,"
        "    color: t.line && t.line.color || null, width: t.line && t.line.width || null,"
        "    dx: heat ? null : cd.map(p => p.x), dy: heat ? null : cd.map(p => p.y),"
        "    dz: heat && cd[0] ? cd[0].z : null};"
        "});", chart_id)


def same_points(xs: list, ys: list, steps: list[int], values: list[float], *,
                rel: float = 1e-12) -> bool:
    """Plotted (x, y) equal the store's (step, value) pairs, NaN drawn as a gap (null)."""
    import math

    if list(xs) != list(steps) or len(ys) != len(values):
        return False
    for y, v in zip(ys, values):
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            if y is not None:
                return False
        elif y is None or abs(y - v) > rel * max(1.0, abs(v)):
            return False
    return True
