"""Make docs/dashboard.png from a real run: ``python -m tests.ui.screenshot docs/dashboard.png``.

Starts the 2-rank toy run (``tests.ui.ddp_run``: rank 1 slowed, the loss of the step at 40% of
the run spiked) under torchrun, serves its dashboard in this process while it trains, and saves
a full-page screenshot from headless Chromium once ``--at`` of the steps are done (live, so the
convergence forecast band reaches ahead of the loss curve).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.ui import helpers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.ui.screenshot")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--at", type=float, default=0.6, help="fraction of the steps done")
    parser.add_argument("--width", type=int, default=1400)
    args = parser.parse_args(argv)

    import uvicorn

    from trainpilot.store import STORE_FILENAME, RunStore
    from trainpilot.ui.server import bind, create_app

    tmp = Path(tempfile.mkdtemp(prefix="trainpilot-shot-"))
    run_dir = tmp / "demo-run"
    training = threading.Thread(target=helpers.train, args=(run_dir,), daemon=True, kwargs=dict(
        steps=args.steps, spike_at=int(0.4 * args.steps), timeout_s=600))
    training.start()
    helpers.wait_for(lambda: (run_dir / STORE_FILENAME).is_file(), timeout_s=300,
                     what="the run's store")
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(run_dir), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    driver = helpers.make_driver(tmp / "profile", width=args.width, height=1000)
    try:
        driver.get(f"http://127.0.0.1:{sock.getsockname()[1]}/run?key=.")
        def progress() -> bool:
            with RunStore.open_readonly(run_dir) as store:
                return (store.latest_step() or 0) >= args.at * args.steps
        helpers.wait_for(progress, timeout_s=600, what="training progress")
        helpers.wait_for(lambda: driver.execute_script(
            "return window.trainpilot && window.trainpilot.status.updates"), timeout_s=120,
            what="the page")
        time.sleep(3.0)  # a couple more polls
        height = driver.execute_script("return document.body.scrollHeight")
        driver.set_window_size(args.width, height + 20)
        time.sleep(1.0)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(args.out))
    finally:
        driver.quit()
        server.should_exit = True
        thread.join(timeout=10)
        training.join(timeout=600)
    print(f"wrote {args.out} from the run in {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
