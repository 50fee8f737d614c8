"""The dashboard server: a Starlette app serving the page's static files and a read-only JSON API.

Security model (a local tool that may be exposed on purpose):
- Only GET/HEAD routes exist; stores are opened ``mode=ro``. Static files come from the package's
  ``static/`` folder through Starlette's ``StaticFiles`` (which refuses paths that resolve
  outside it); runs are named by keys looked up in the discovered set, never joined to a path.
- Bound to a loopback address (the default), requests must carry a loopback ``Host`` header: a
  web page elsewhere cannot reach the API through DNS rebinding.
- Bound anywhere else, a token is required (the CLI refuses to start without one, read from a
  file or the environment, never argv): ``Authorization: Bearer TOKEN``, or ``?token=TOKEN``
  once, answered with a redirect that drops it from the address and sets an HttpOnly,
  SameSite=Strict cookie named per port holding a keyed hash of the token.
- Every answer carries a Content-Security-Policy that allows only this origin's scripts: plotly.js
  is served from the package's own vendored copy, never a CDN.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import re
import secrets
import socket
import sqlite3
import urllib.parse
from importlib import resources
from pathlib import Path
from typing import Any, overload

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    StreamingResponse,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from trainpilot.specs.errors import SpecError
from trainpilot.ui.runs import RunIndex

STATIC_DIR = Path(str(resources.files("trainpilot.ui") / "static"))
TOKEN_COOKIE = "trainpilot_token"
LOOPBACK_NAMES = {"localhost", "localhost.", "ip6-localhost"}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
       "img-src 'self' data: blob:; connect-src 'self'; font-src 'self' data:; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'; object-src 'none'")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 possibly in brackets) is this machine only."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


VENDOR_DIR = Path(str(resources.files("trainpilot.ui") / "vendor"))


def plotly_js_path() -> Path:
    """plotly.js (the cartesian bundle, vendored with its licence: ui/vendor/README.md), served
    by the dashboard and inlined in reports."""
    path = VENDOR_DIR / "plotly-cartesian.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"plotly.js not found at {path}; reinstall trainpilot")
    return path


def cookie_name(port: int) -> str:
    """The token cookie's name for a dashboard on ``port``: cookies are scoped by host, not by
    port, so one name per port keeps two dashboards on one host from logging each other out."""
    return f"{TOKEN_COOKIE}_{int(port)}"


def cookie_value(token: str, port: int) -> str:
    """What the cookie holds: a keyed hash of the token, not the token (another service on the
    same host receives the cookie; it can replay it to this dashboard only, never learn the
    token)."""
    return hmac.new(token.encode(), f"trainpilot-dashboard-cookie:{int(port)}".encode(),
                    hashlib.sha256).hexdigest()


class Guard:
    """ASGI middleware: Host check (loopback binding), token check (when a token is set),
    security headers. ``port`` names the cookie; ``secure`` (TLS) marks it Secure."""

    def __init__(self, app, *, token: str | None, loopback_only: bool, port: int = 0,
                 secure: bool = False):
        self.app, self.token, self.loopback_only = app, token, loopback_only
        self.port, self.secure = port, secure

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # no websocket routes: refuse before any app code runs
            return await send({"type": "websocket.close", "code": 1008})
        request = Request(scope)
        if self.loopback_only and not _host_is_loopback(request.headers.get("host", "")):
            return await PlainTextResponse("forbidden: bad Host header", 403)(scope, receive, send)
        token = self.token
        if token is not None:
            ok, from_query = self._authorised(request, token)
            if not ok:
                response = PlainTextResponse(
                    "unauthorized: this dashboard needs its token (?token=... once, or "
                    "'Authorization: Bearer ...')", 401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
            if from_query:  # log in, then drop the token from the address bar and history
                query = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                target = scope["path"] + ("?" + urllib.parse.urlencode(query) if query else "")
                response = RedirectResponse(target, 303)
                response.headers.append("set-cookie", self._cookie(token))
                return await response(scope, receive, send)
        api = scope["path"].startswith("/api/")

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(b"content-security-policy", CSP.encode()),
                            (b"x-content-type-options", b"nosniff"),
                            (b"referrer-policy", b"no-referrer"),
                            (b"x-frame-options", b"DENY")]
                if api:
                    headers.append((b"cache-control", b"no-store"))
                message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _cookie(self, token: str) -> str:
        return (f"{cookie_name(self.port)}={cookie_value(token, self.port)}; Path=/; "
                "HttpOnly; SameSite=Strict" + ("; Secure" if self.secure else ""))

    def _authorised(self, request: Request, token: str) -> tuple[bool, bool]:
        """(``token`` accepted, it came as ?token=)."""
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return _same(auth[7:].strip(), token), False
        if "token" in request.query_params:
            return _same(request.query_params["token"], token), True
        cookie = request.cookies.get(cookie_name(self.port))
        return cookie is not None and _same(cookie, cookie_value(token, self.port)), False


def _same(given: str, expected: str) -> bool:
    return secrets.compare_digest(given.encode(), expected.encode())


def _host_is_loopback(host_header: str) -> bool:
    try:
        hostname = urllib.parse.urlsplit("//" + host_header).hostname
    except ValueError:
        return False
    return hostname is not None and is_loopback(hostname)


class UnknownRun(LookupError):
    """A run key that is not one of the discovered runs (answered with 404)."""


MAX_INT_CHARS = 24


@overload
def _int_param(request: Request, name: str, default: int) -> int: ...


@overload
def _int_param(request: Request, name: str, default: None = None) -> int | None: ...


def _int_param(request: Request, name: str, default: int | None = None) -> int | None:
    """An integer query parameter, or ``default``; SpecError (HTTP 400) when it is not one."""
    value = request.query_params.get(name)
    if value in (None, "", "null"):
        return default
    text = value.strip()
    if len(text) > MAX_INT_CHARS or not text.lstrip("+-").isdigit():
        raise SpecError(name, value, "valid: an integer")
    return int(text)


def create_app(root: str | Path, *, token: str | None = None, loopback_only: bool = True,
               port: int = 0, secure: bool = False):
    """The ASGI app for the runs under ``root`` (a run directory or a folder of them)."""
    from trainpilot.ui.data import (
        DEFAULT_MAX_POINTS,
        check_int,
        clean,
        compare_data,
        csv_rows,
        run_data,
        window_data,
    )
    from trainpilot.ui.plan import plan_section

    index = RunIndex(root)

    def _store(request: Request, key: str | None = None):
        key = request.query_params.get("key", ".") if key is None else key
        store = index.store(key)
        if store is None:
            raise UnknownRun(key)
        return key, store

    def _json(fn):
        def endpoint(request: Request):
            try:
                return JSONResponse(fn(request))
            except UnknownRun as err:
                return JSONResponse({"error": f"no run {err.args[0]!r} under this dashboard's "
                                              "directory"}, 404)
            except SpecError as err:
                return JSONResponse({"error": str(err)}, 400)
            except sqlite3.Error as err:  # a store deleted, truncated or replaced under us
                index.forget(request.query_params.get("key", "."))
                return JSONResponse({"error": f"the run's store cannot be read ({err})"}, 503)
        return endpoint

    def _max_points(request: Request) -> int:
        return _int_param(request, "max_points", DEFAULT_MAX_POINTS)

    def api_runs(request: Request) -> dict[str, Any]:
        return {"root": index.root.name, "single_run": index.is_single_run, "runs": index.rows()}

    def api_run(request: Request) -> dict[str, Any]:
        key, store = _store(request)
        data = run_data(store, since_batch=_int_param(request, "since_batch"),
                        since_step=_int_param(request, "since_step"),
                        since_event=_int_param(request, "since_event", 0),
                        max_points=_max_points(request))
        return dict(key=key, **data)

    def api_window(request: Request) -> dict[str, Any]:
        key, store = _store(request)
        lo, hi = _int_param(request, "lo"), _int_param(request, "hi")
        max_points = _max_points(request)
        for name, value in (("lo", lo), ("hi", hi)):
            check_int(name, value, low=-(1 << 62))
        check_int("max_points", max_points, low=16, high=200_000)
        if lo is not None and hi is not None and lo > hi:
            raise SpecError("lo", lo, f"valid: <= hi ({hi})")
        with store.snapshot():
            return dict(key=key, lo=lo, hi=hi, **window_data(store, lo, hi,
                                                             max_points=max_points))

    def api_plan(request: Request) -> dict[str, Any]:
        key, store = _store(request)
        return dict(key=key, **clean(plan_section(store, store.path.parent)))

    def api_cluster(request: Request) -> dict[str, Any]:
        from trainpilot.ui.cluster import cluster_section

        key, store = _store(request)
        restarts = [dict(e.payload, step=e.step, unix_s=e.time)
                    for e in store.events(kinds=["restart"], limit=200)]
        return dict(key=key, **clean(cluster_section(store.path.parent, restarts=restarts)))

    def api_compare(request: Request) -> dict[str, Any]:
        stores = dict(_store(request, key) for key in request.query_params.getlist("key")[:8])
        return compare_data(stores, request.query_params.get("metric", "loss"),
                            max_points=_max_points(request))

    def api_csv(request: Request):
        try:
            key, store = _store(request)
        except UnknownRun as err:
            return JSONResponse({"error": f"no run {err.args[0]!r}"}, 404)
        names = request.query_params.getlist("metric") or ["loss"]
        known = set(store.metric_names())
        missing = [n for n in names[:64] if n not in known]
        if missing:
            return JSONResponse({"error": f"metric: got {missing[0]!r}; valid: one of the run's "
                                          f"{len(known)} metrics"}, 400)
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key.strip("./") or "run")
        return StreamingResponse(csv_rows(store, names[:64]), media_type="text/csv", headers={
            "content-disposition": f'attachment; filename="{safe}.csv"'})

    def home(request: Request):
        if index.is_single_run:
            return RedirectResponse("/run?key=.", 307)
        return FileResponse(STATIC_DIR / "index.html")

    routes = [
        Route("/", home, methods=["GET"]),
        Route("/runs", lambda r: FileResponse(STATIC_DIR / "index.html"), methods=["GET"]),
        Route("/run", lambda r: FileResponse(STATIC_DIR / "run.html"), methods=["GET"]),
        Route("/api/runs", _json(api_runs), methods=["GET"]),
        Route("/api/run", _json(api_run), methods=["GET"]),
        Route("/api/window", _json(api_window), methods=["GET"]),
        Route("/api/plan", _json(api_plan), methods=["GET"]),
        Route("/api/cluster", _json(api_cluster), methods=["GET"]),
        Route("/api/compare", _json(api_compare), methods=["GET"]),
        Route("/api/csv", api_csv, methods=["GET"]),
        Route("/vendor/plotly.min.js", lambda r: FileResponse(plotly_js_path()),
              methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        index.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.index = index
    return Guard(app, token=token, loopback_only=loopback_only, port=port, secure=secure)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one. SpecError when taken."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as err:
        sock.close()
        raise SpecError("--port", port, f"cannot listen on {host}:{port} ({err.strerror}); "
                        "valid: a free port, or 0 for any") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(app, sock: socket.socket, *, tls_cert: str | None = None,
          tls_key: str | None = None) -> None:
    """Run ``app`` with uvicorn on an already bound socket until interrupted (HTTPS when a
    certificate and key are given)."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            ssl_certfile=tls_cert, ssl_keyfile=tls_key)
    uvicorn.Server(config).run(sockets=[sock])
