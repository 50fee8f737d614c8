"""``trainpilot dashboard``: serve a run's (or a folder of runs') live dashboard on a local page."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from trainpilot.cli.common import add_verb, console, err_console

TOKEN_ENV = "TRAINPILOT_DASHBOARD_TOKEN"
MIN_TOKEN_CHARS = 16


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "dashboard", help="serve the live dashboard of a run (or a folder of runs)",
        description="Serve a web page that shows a run while it trains: loss with its "
                    "convergence forecast, learning rate, per-layer gradient norms, per-rank step "
                    "time and tokens/s (stragglers highlighted), communication, memory, the "
                    "health score, the timeline of alerts, interventions, checkpoints, faults and "
                    "restarts, and the plan. Given a folder of runs, the first page lists them "
                    "and compares their loss curves. Read-only; binds 127.0.0.1 unless told. "
                    "Any other address needs a token, read from --token-file or "
                    f"${TOKEN_ENV} (never from the command line, where `ps` shows it); the "
                    "traffic is plain HTTP unless --tls-cert/--tls-key are given.",
        examples="  trainpilot dashboard runs/demo\n"
                 "  trainpilot dashboard runs/ --port 8080        # the runs index\n"
                 "  head -c 24 /dev/urandom | base64 > ~/.dash-token; chmod 600 ~/.dash-token\n"
                 "  trainpilot dashboard runs/demo --host 0.0.0.0 --token-file ~/.dash-token "
                 "--tls-cert cert.pem --tls-key key.pem",
    )
    parser.add_argument("run_dir", help="a run directory (holding trainpilot.db) or a folder of "
                                        "them")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; others require a token)")
    parser.add_argument("--port", type=int, default=10400,
                        help="port to listen on (default 10400; 0 picks a free one)")
    parser.add_argument("--token-file", metavar="FILE", default=None,
                        help=f"file holding the access token (default ${TOKEN_ENV}); required "
                             f"for a non-loopback --host; at least {MIN_TOKEN_CHARS} characters")
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tls-cert", metavar="PEM", default=None,
                        help="serve HTTPS with this certificate (and --tls-key)")
    parser.add_argument("--tls-key", metavar="PEM", default=None, help="the certificate's key")
    parser.set_defaults(func=run)


def read_token(args: argparse.Namespace) -> str | None:
    """The token from --token-file, else the environment; None when neither gives one."""
    from trainpilot.specs.errors import SpecError

    if args.token is not None:
        raise SpecError("--token", "<hidden>", "not accepted on the command line (`ps` shows "
                        f"it to every user); valid: --token-file FILE or ${TOKEN_ENV}")
    token: str | None
    if args.token_file is not None:
        path = Path(args.token_file)
        try:
            token = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as err:
            raise SpecError("--token-file", str(path), "valid: a readable UTF-8 text file "
                            f"holding the token ({type(err).__name__})") from None
        if not token:
            raise SpecError("--token-file", str(path), "valid: a file holding the token (it "
                            "is empty)")
    else:
        token = (os.environ.get(TOKEN_ENV) or "").strip() or None
    if token is not None and (len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token)):
        raise SpecError("token", "<hidden>", f"valid: at least {MIN_TOKEN_CHARS} characters, "
                        "no spaces")
    return token


def run(args: argparse.Namespace) -> int:
    from trainpilot.specs.errors import SpecError
    from trainpilot.ui.server import bind, create_app, is_loopback, serve

    if not 0 <= args.port <= 65535:
        raise SpecError("--port", args.port, "valid: 0-65535 (0 picks a free port)")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SpecError("--tls-cert" if args.tls_cert is None else "--tls-key", None,
                        "valid: both --tls-cert and --tls-key, or neither")
    for flag, value in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if value is not None and not Path(value).is_file():
            raise SpecError(flag, value, "valid: a PEM file")
    token = read_token(args)
    loopback = is_loopback(args.host)
    if not loopback and token is None:
        raise SpecError("--host", args.host, "not a loopback address: anyone who can reach "
                        f"it would see the runs; valid: 127.0.0.1 (and an SSH tunnel), or a "
                        f"token from --token-file FILE or ${TOKEN_ENV}")
    sock = bind(args.host, args.port)
    port = sock.getsockname()[1]
    tls = args.tls_cert is not None
    app = create_app(args.run_dir, token=token, loopback_only=loopback, port=port, secure=tls)
    scheme = "https" if tls else "http"
    host = args.host.strip("[]")
    if host in ("0.0.0.0", "::"):
        host = socket.gethostname()
    shown = f"[{host}]" if ":" in host else host
    url = f"{scheme}://{shown}:{port}/"
    if token is not None:
        url += f"?token={token}"
    console.print(f"dashboard of {args.run_dir} at {url}", soft_wrap=True, markup=False)
    if not loopback:
        console.print(f"listening on {args.host} port {port}; every request needs the token",
                      soft_wrap=True, markup=False)
        if not tls:
            err_console.print("warning: plain HTTP: the token and the runs cross the network "
                              "unencrypted; give --tls-cert/--tls-key, or keep the default "
                              "127.0.0.1 and use `ssh -L`", soft_wrap=True, markup=False)
    console.print("Ctrl-C stops it.", style="dim")
    console.file.flush()
    serve(app, sock, tls_cert=args.tls_cert, tls_key=args.tls_key)
    return 0
