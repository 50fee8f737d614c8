"""The dashboard server (the real CLI under uvicorn, over HTTP): it serves only its static files
and a read-only API, refuses path traversal, checks the Host header on loopback and requires a
token anywhere else."""

from __future__ import annotations

import hashlib
import http.client
import json
import urllib.parse

import pytest

from tests.conftest import run_cli
from tests.ui import helpers
from tests.ui.conftest import NUM_STEPS
from trainpilot.store import STORE_FILENAME


def request(url: str, path: str, *, method: str = "GET", headers: dict | None = None,
            ) -> tuple[int, dict, bytes]:
    """One raw request: ``path`` is sent exactly as given (no client-side normalisation)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=20)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        all_headers = {"Host": parts.netloc, **(headers or {})}
        for key, value in all_headers.items():
            conn.putheader(key, value)
        conn.endheaders()
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture
def dashboard(known_run):
    proc, url = helpers.start_dashboard(known_run)
    yield url
    helpers.kill_tree(proc)


TRAVERSALS = [
    "/static/../../../../../../etc/passwd",
    "/static/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "/static/..%2f..%2f..%2f..%2f..%2fetc%2fpasswd",
    "/static/%252e%252e/%252e%252e/etc/passwd",
    "/static/....//....//etc/passwd",
    "/static//etc/passwd",
    "/static/..\\..\\..\\etc\\passwd",
    "/vendor/../../../../etc/passwd",
    f"/static/../../{STORE_FILENAME}",
    "/static/../server.py",
    "/static/../../../../pyproject.toml",
    "/api/run?key=../../../../etc",
    "/api/run?key=/etc",
    "/api/run?key=%2e%2e",
    "/api/compare?key=.&key=../..",
    "/etc/passwd",
    f"/{STORE_FILENAME}",
]


def test_serves_only_static_files_and_the_read_only_api(known_run, dashboard):
    db = known_run / STORE_FILENAME
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    # Positive controls: what should be served is (so the 404s below are refusals).
    status, headers, body = request(dashboard, "/static/style.css")
    assert status == 200 and b"--panel" in body
    assert "script-src 'self'" in headers["content-security-policy"]
    status, _, body = request(dashboard, "/vendor/plotly.min.js")
    assert status == 200 and b"plotly.js v" in body[:200]
    status, headers, _ = request(dashboard, "/")
    assert status == 307 and headers["location"] == "/run?key=."
    status, headers, body = request(dashboard, "/api/run?key=.")
    assert status == 200 and headers["cache-control"] == "no-store"
    assert json.loads(body)["cursor"]["step"] == NUM_STEPS
    for path in TRAVERSALS:
        status, _, body = request(dashboard, path)
        assert status in (400, 404), (path, status)
        assert b"root:" not in body and b"SQLite format" not in body, path
        assert b"[project]" not in body and b"import " not in body, path
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        for path in ("/api/run?key=.", "/api/runs", "/static/style.css", "/"):
            status, _, _ = request(dashboard, path, method=method)
            assert status == 405, (method, path, status)
    assert request(dashboard, "/api/run?key=.&since_step=abc")[0] == 400
    status, _, body = request(dashboard, "/api/run?key=nope")
    assert status == 404 and "no run" in json.loads(body)["error"]
    # Reading changed nothing: the store file is byte-identical.
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_loopback_binding_rejects_foreign_host_headers(dashboard):
    port = urllib.parse.urlsplit(dashboard).port
    assert request(dashboard, "/api/runs", headers={"Host": f"localhost:{port}"})[0] == 200
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        status, _, _ = request(dashboard, "/api/runs", headers={"Host": host})
        assert status == 403, host


def test_non_loopback_binding_requires_the_token(known_run):
    proc, url = helpers.start_dashboard(known_run, "--host", "0.0.0.0")
    try:
        token = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["token"][0]
        assert len(token) >= 24  # generated and printed
        base = url.split("?")[0]
        for path in ("/api/runs", "/static/style.css", "/run", "/vendor/plotly.min.js"):
            assert request(base, path)[0] == 401, path
        assert request(base, "/api/runs", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert request(base, "/api/runs?token=" + token[:-1] + "x")[0] == 401
        status, _, body = request(base, "/api/runs",
                                  headers={"Authorization": f"Bearer {token}"})
        assert status == 200 and json.loads(body)["runs"][0]["key"] == "."
        # ?token= once sets an HttpOnly cookie that the page's own requests then carry.
        status, headers, _ = request(base, f"/run?token={token}")
        assert status == 200
        cookie = headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        value = cookie.split(";")[0]
        assert request(base, "/api/runs", headers={"Cookie": value})[0] == 200
        assert request(base, "/api/runs", headers={"Cookie": "trainpilot_token=nope"})[0] == 401
        # No Host check off loopback (the token guards instead): any Host with the token works.
        assert request(base, "/api/runs", headers={"Host": "example.org",
                                                   "Authorization": f"Bearer {token}"})[0] == 200
    finally:
        helpers.kill_tree(proc)


def test_an_explicit_token_is_enforced_on_loopback_too(known_run):
    token = "s3cret-token-for-tests-0123"
    proc, url = helpers.start_dashboard(known_run, "--token", token)
    try:
        base = url.split("?")[0]
        assert request(base, "/api/runs")[0] == 401
        assert request(base, "/api/runs", headers={"Authorization": f"Bearer {token}"})[0] == 200
    finally:
        helpers.kill_tree(proc)


def test_bad_input_is_one_line_and_exit_2(tmp_path, known_run):
    result = run_cli("dashboard", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: run_dir") and "Traceback" not in result.stderr
    result = run_cli("dashboard", str(known_run), "--port", "70000")
    assert result.returncode == 2 and "--port" in result.stderr
    result = run_cli("dashboard", str(known_run), "--token", "short")
    assert result.returncode == 2 and "--token" in result.stderr
    proc, url = helpers.start_dashboard(known_run)
    try:  # the port is taken now
        port = urllib.parse.urlsplit(url).port
        result = run_cli("dashboard", str(known_run), "--port", str(port))
        assert result.returncode == 2 and "cannot listen" in result.stderr
    finally:
        helpers.kill_tree(proc)
