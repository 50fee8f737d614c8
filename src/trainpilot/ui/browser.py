"""Headless Chromium: where it is, the flags we run it with, and printing a page to PDF.

Debian's ``chromium`` is what ``scripts/install_browser.sh`` installs (and what the browser tests
drive). ``TRAINPILOT_CHROMIUM`` names another binary.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from trainpilot.fsio import atomic_write_bytes

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
              "chrome")
# Quiet, offline, throwaway: no first-run UI, no background fetches, no sync, no updates.
HEADLESS_FLAGS = ("--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars",
                  "--mute-audio")


def find_chromium() -> str | None:
    """The Chromium (or Chrome) executable, or None."""
    override = os.environ.get("TRAINPILOT_CHROMIUM")
    if override:
        return override if os.access(override, os.X_OK) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def chromium_flags(user_data_dir: str | os.PathLike) -> list[str]:
    """Flags for a headless run with its own fresh profile (``--no-sandbox`` only as root,
    where Chromium refuses to start otherwise)."""
    flags = list(HEADLESS_FLAGS) + [f"--user-data-dir={user_data_dir}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        flags.append("--no-sandbox")
    return flags


def print_to_pdf(html_path: str | os.PathLike, pdf_path: str | os.PathLike, *,
                 timeout_s: float = 120.0, budget_ms: int = 15000) -> Path:
    """Render ``html_path`` in headless Chromium and write it as PDF (atomically).

    ``budget_ms`` of virtual time lets the page's scripts draw the charts first. Raises
    FileNotFoundError when no Chromium is installed, RuntimeError when printing fails."""
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("no PDF engine: Chromium is not installed "
                                "(scripts/install_browser.sh installs Debian's chromium)")
    html_path, pdf_path = Path(html_path).resolve(), Path(pdf_path)
    with tempfile.TemporaryDirectory(prefix="trainpilot-chromium-") as tmp:
        out = Path(tmp) / "out.pdf"
        cmd = [chromium, *chromium_flags(Path(tmp) / "profile"), "--no-pdf-header-footer",
               "--run-all-compositor-stages-before-draw", f"--virtual-time-budget={budget_ms}",
               f"--print-to-pdf={out}", html_path.as_uri()]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"Chromium did not print {html_path} within {timeout_s:.0f} s") \
                from None
        data = out.read_bytes() if out.is_file() else b""
        if not data.startswith(b"%PDF"):
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            raise RuntimeError(f"Chromium exited {proc.returncode} without a PDF: "
                               + " | ".join(tail))
    atomic_write_bytes(pdf_path, data)
    return pdf_path
