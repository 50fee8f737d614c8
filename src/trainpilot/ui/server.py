"""The dashboard server: a Starlette app serving the page's static files and a read-only JSON API.

Security model (a local tool that may be exposed on purpose):
- Only GET/HEAD routes exist; stores are opened ``mode=ro``. Static files come from the package's
  ``static/`` folder through Starlette's ``StaticFiles`` (which refuses paths that resolve
  outside it); runs are named by keys looked up in the discovered set, never joined to a path.
- Bound to a loopback address (the default), requests must carry a loopback ``Host`` header: a
  web page elsewhere cannot reach the API through DNS rebinding.
- Bound anywhere else, a token is required (generated when not given): ``Authorization: Bearer
  TOKEN``, or ``?token=TOKEN`` once (the answer sets an HttpOnly, SameSite=Strict cookie).
- Every answer carries a Content-Security-Policy that allows only this origin's scripts: plotly.js
  is served from the installed ``plotly`` package, never a CDN.
"""

from __future__ import annotations

import contextlib
import ipaddress
import secrets
import socket
import urllib.parse
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, RedirectResponse
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


def plotly_js_path() -> Path:
    """plotly.js as shipped inside the ``plotly`` Python package (served and inlined by us)."""
    path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    if not path.is_file():
        raise FileNotFoundError(f"plotly.min.js not found at {path}; reinstall 'plotly'")
    return path


class Guard:
    """ASGI middleware: Host check (loopback binding), token check (otherwise), headers."""

    def __init__(self, app, *, token: str | None, loopback_only: bool):
        self.app, self.token, self.loopback_only = app, token, loopback_only

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        if scope["type"] != "http":  # no websocket routes: refuse before any app code runs
            return await send({"type": "websocket.close", "code": 1008})
        request = Request(scope)
        if self.loopback_only and not _host_is_loopback(request.headers.get("host", "")):
            return await PlainTextResponse("forbidden: bad Host header", 403)(scope, receive, send)
        set_cookie = False
        if self.token is not None:
            given, from_query = _given_token(request)
            if given is None or not secrets.compare_digest(given.encode(), self.token.encode()):
                response = PlainTextResponse(
                    "unauthorized: this dashboard needs its token (?token=... or "
                    "'Authorization: Bearer ...')", 401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
            set_cookie = from_query
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
                if set_cookie:
                    headers.append((b"set-cookie", f"{TOKEN_COOKIE}={self.token}; Path=/; "
                                    "HttpOnly; SameSite=Strict".encode()))
                message = dict(message, headers=headers)
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _host_is_loopback(host_header: str) -> bool:
    hostname = urllib.parse.urlsplit("//" + host_header).hostname
    return hostname is not None and is_loopback(hostname)


def _given_token(request: Request) -> tuple[str | None, bool]:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip(), False
    if "token" in request.query_params:
        return request.query_params["token"], True
    return request.cookies.get(TOKEN_COOKIE), False


class UnknownRun(LookupError):
    """A run key that is not one of the discovered runs (answered with 404)."""


def _int_param(request: Request, name: str) -> int | None:
    value = request.query_params.get(name)
    if value in (None, "", "null"):
        return None
    try:
        return int(value)
    except ValueError:
        raise SpecError(name, value, "valid: an integer") from None


def create_app(root: str | Path, *, token: str | None = None, loopback_only: bool = True):
    """The ASGI app for the runs under ``root`` (a run directory or a folder of them)."""
    from trainpilot.ui.data import clean, compare_data, run_data
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
        return endpoint

    def api_runs(request: Request) -> dict[str, Any]:
        return {"root": index.root.name, "single_run": index.is_single_run, "runs": index.rows()}

    def api_run(request: Request) -> dict[str, Any]:
        key, store = _store(request)
        data = run_data(store, since_step=_int_param(request, "since_step"),
                        since_rank_step=_int_param(request, "since_rank_step"),
                        since_event=_int_param(request, "since_event") or 0)
        return dict(key=key, **data)

    def api_plan(request: Request) -> dict[str, Any]:
        key, store = _store(request)
        return dict(key=key, **clean(plan_section(store, store.path.parent)))

    def api_compare(request: Request) -> dict[str, Any]:
        stores = dict(_store(request, key) for key in request.query_params.getlist("key")[:8])
        return compare_data(stores, request.query_params.get("metric", "loss"))

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
        Route("/api/plan", _json(api_plan), methods=["GET"]),
        Route("/api/compare", _json(api_compare), methods=["GET"]),
        Route("/vendor/plotly.min.js", lambda r: FileResponse(plotly_js_path()),
              methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        index.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    return Guard(app, token=token, loopback_only=loopback_only)


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


def serve(app, sock: socket.socket) -> None:
    """Run ``app`` with uvicorn on an already bound socket until interrupted."""
    import uvicorn

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
