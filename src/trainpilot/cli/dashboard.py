"""``trainpilot dashboard``: serve a run's (or a folder of runs') live dashboard on a local page."""

from __future__ import annotations

import argparse
import os
import secrets

from trainpilot.cli.common import add_verb, console

TOKEN_ENV = "TRAINPILOT_DASHBOARD_TOKEN"


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "dashboard", help="serve the live dashboard of a run (or a folder of runs)",
        description="Serve a web page that shows a run while it trains: loss with its "
                    "convergence forecast, learning rate, per-layer gradient norms, per-rank step "
                    "time and tokens/s (stragglers highlighted), communication, memory, the "
                    "health score, the timeline of alerts, interventions, checkpoints, faults and "
                    "restarts, and the plan. Given a folder of runs, the first page lists them "
                    "and compares their loss curves. Read-only; binds 127.0.0.1 unless told; "
                    f"any other address needs a token (--token, ${TOKEN_ENV}, or one is "
                    "generated and printed).",
        examples="  trainpilot dashboard runs/demo\n"
                 "  trainpilot dashboard runs/ --port 8080        # the runs index\n"
                 "  trainpilot dashboard runs/demo --host 0.0.0.0  # prints a URL with a token",
    )
    parser.add_argument("run_dir", help="a run directory (holding trainpilot.db) or a folder of "
                                        "them")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; others require a token)")
    parser.add_argument("--port", type=int, default=10400,
                        help="port to listen on (default 10400; 0 picks a free one)")
    parser.add_argument("--token", default=None,
                        help=f"access token (default ${TOKEN_ENV}; generated for a non-loopback "
                             "host)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainpilot.specs.errors import SpecError
    from trainpilot.ui.server import bind, create_app, is_loopback, serve

    if not 0 <= args.port <= 65535:
        raise SpecError("--port", args.port, "valid: 0-65535 (0 picks a free port)")
    token = args.token or os.environ.get(TOKEN_ENV) or None
    loopback = is_loopback(args.host)
    if not loopback and token is None:
        token = secrets.token_urlsafe(24)
    if token is not None and len(token) < 16:
        raise SpecError("--token", "<hidden>", "valid: at least 16 characters")
    app = create_app(args.run_dir, token=token, loopback_only=loopback)
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    shown_host = f"[{args.host}]" if ":" in args.host else args.host
    if shown_host in ("0.0.0.0", "[::]"):
        shown_host = "127.0.0.1" if shown_host == "0.0.0.0" else "[::1]"
    url = f"http://{shown_host}:{port}/"
    if token is not None:
        url += f"?token={token}"
    console.print(f"dashboard of {args.run_dir} at {url}", soft_wrap=True, markup=False)
    if not loopback:
        console.print(f"listening on {args.host} (all requests need the token)",
                      soft_wrap=True)
    console.print("Ctrl-C stops it.", style="dim")
    console.file.flush()
    serve(app, sock)
    return 0
