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
    assert status == 200 and b"plotly.js (cartesian - minified) v" in body[:200]
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


TOKEN = "s3cret-token-for-tests-0123"


def _token_file(tmp_path, token=TOKEN):
    path = tmp_path / "token"
    path.write_text(token + "\n")
    return str(path)


def _loopback(url: str) -> str:
    """The printed URL names the host; the tests reach it on 127.0.0.1."""
    parts = urllib.parse.urlsplit(url.split("?")[0])
    return f"{parts.scheme}://127.0.0.1:{parts.port}"


def test_non_loopback_binding_requires_a_token_and_warns_about_plain_http(known_run, tmp_path):
    result = run_cli("dashboard", str(known_run), "--host", "0.0.0.0", "--port", "0",
                     timeout=60)
    assert result.returncode == 2 and "not a loopback address" in result.stderr
    assert "--token-file" in result.stderr and "Traceback" not in result.stderr
    proc, url = helpers.start_dashboard(known_run, "--host", "0.0.0.0", "--token-file",
                                        _token_file(tmp_path))
    try:
        assert urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["token"] == [TOKEN]
        assert "127.0.0.1" not in url  # the printed URL names this host, not loopback
        base = _loopback(url)
        port = urllib.parse.urlsplit(base).port
        for path in ("/api/runs", "/static/style.css", "/run", "/vendor/plotly.min.js"):
            assert request(base, path)[0] == 401, path
        assert request(base, "/api/runs", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert request(base, "/api/runs?token=" + TOKEN[:-1] + "x")[0] == 401
        status, _, body = request(base, "/api/runs",
                                  headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and json.loads(body)["runs"][0]["key"] == "."
        # ?token= once: a redirect that drops it from the address, with a cookie named for
        # this port holding a keyed hash of the token (never the token itself).
        status, headers, _ = request(base, f"/run?key=.&token={TOKEN}")
        assert status == 303 and headers["location"] == "/run?key=."
        cookie = headers["set-cookie"]
        assert cookie.startswith(f"trainpilot_token_{port}=")
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
        value = cookie.split(";")[0]
        assert request(base, "/api/runs", headers={"Cookie": value})[0] == 200
        other_port = value.replace(f"_{port}=", f"_{port + 1}=")
        assert request(base, "/api/runs", headers={"Cookie": other_port})[0] == 401
        assert request(base, "/api/runs", headers={"Cookie": f"trainpilot_token_{port}={TOKEN}"}
                       )[0] == 401  # the raw token is not a cookie value
        # No Host check off loopback (the token guards instead): any Host with the token works.
        assert request(base, "/api/runs", headers={"Host": "example.org",
                                                   "Authorization": f"Bearer {TOKEN}"})[0] == 200
    finally:
        helpers.kill_tree(proc)


def test_plain_http_warning_and_the_token_never_read_from_argv(known_run, tmp_path):
    result = run_cli("dashboard", str(known_run), "--token", TOKEN)
    assert result.returncode == 2 and "not accepted on the command line" in result.stderr
    assert TOKEN not in result.stderr
    for bad, why in (("short", "at least 16"), ("", "empty")):
        result = run_cli("dashboard", str(known_run), "--token-file",
                         _token_file(tmp_path, bad))
        assert result.returncode == 2 and why in result.stderr, result.stderr
    result = run_cli("dashboard", str(known_run), "--token-file", str(tmp_path / "nope"))
    assert result.returncode == 2 and "--token-file" in result.stderr
    result = run_cli("dashboard", str(known_run), "--tls-cert", str(tmp_path / "c.pem"))
    assert result.returncode == 2 and "--tls-key" in result.stderr


def test_a_token_from_the_environment_is_enforced_on_loopback_too(known_run):
    import os

    os.environ["TRAINPILOT_DASHBOARD_TOKEN"] = TOKEN
    try:
        proc, url = helpers.start_dashboard(known_run)
    finally:
        del os.environ["TRAINPILOT_DASHBOARD_TOKEN"]
    try:
        base = url.split("?")[0]
        assert request(base, "/api/runs")[0] == 401
        assert request(base, "/api/runs", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
    finally:
        helpers.kill_tree(proc)


def test_integer_parameters_are_bounded_and_never_a_500(dashboard):
    for query in ("since_step=" + "9" * 30, "since_batch=-1", "since_batch=" + "9" * 19,
                  "since_event=1e3", "max_points=5", "max_points=" + "9" * 10,
                  "since_step=%00", "since_batch=0x10"):
        status, _, body = request(dashboard, f"/api/run?key=.&{query}")
        assert status == 400, (query, status)
        assert "valid:" in json.loads(body)["error"], query
    for query in ("lo=5&hi=1", "lo=" + "9" * 40, "lo=1&hi=2&max_points=0"):
        assert request(dashboard, f"/api/window?key=.&{query}")[0] == 400, query
    status, _, body = request(dashboard, "/api/window?key=.&lo=3&hi=5")
    assert status == 200 and json.loads(body)["series"]["loss"]["steps"] == [3, 4, 5]
    status, headers, body = request(dashboard, "/api/csv?key=.&metric=loss&metric=lr")
    assert status == 200 and headers["content-type"].startswith("text/csv")
    lines = body.decode().splitlines()
    assert lines[0] == "step,loss,lr" and len(lines) == NUM_STEPS + 1
    assert lines[7].startswith("7,,")  # the NaN loss of step 7 is an empty cell
    assert request(dashboard, "/api/csv?key=.&metric=nope")[0] == 400


def test_a_broken_or_empty_store_is_listed_as_broken_not_a_500(tmp_path):
    from tests.ui.conftest import write_known_store

    write_known_store(tmp_path / "good", with_fault=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / STORE_FILENAME).write_bytes(b"")
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / STORE_FILENAME).write_bytes(b"\x01not a database" * 500)
    proc, url = helpers.start_dashboard(tmp_path)
    try:
        status, _, body = request(url, "/api/runs")
        assert status == 200
        rows = {r["key"]: r for r in json.loads(body)["runs"]}
        assert rows["good"]["status"] == "completed" and rows["good"]["error"] is None
        for key in ("empty", "garbage"):
            assert rows[key]["status"] == "broken" and rows[key]["error"], key
        status, _, body = request(url, "/api/run?key=garbage")
        assert status == 400 and "not a readable trainpilot store" in json.loads(body)["error"]
    finally:
        helpers.kill_tree(proc)


def test_bad_input_is_one_line_and_exit_2(tmp_path, known_run):
    result = run_cli("dashboard", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.strip().startswith("error: run_dir") and "Traceback" not in result.stderr
    result = run_cli("dashboard", str(known_run), "--port", "70000")
    assert result.returncode == 2 and "--port" in result.stderr
    proc, url = helpers.start_dashboard(known_run)
    try:  # the port is taken now
        port = urllib.parse.urlsplit(url).port
        result = run_cli("dashboard", str(known_run), "--port", str(port))
        assert result.returncode == 2 and "cannot listen" in result.stderr
    finally:
        helpers.kill_tree(proc)
