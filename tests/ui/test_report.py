"""The HTML report: self-contained (nothing fetched when opened), every section present, the
store's data embedded exactly, text from the store escaped; the CLI's outputs and exit codes."""

from __future__ import annotations

import html.parser
import json
import re

import pytest

from tests.conftest import run_cli
from tests.ui.conftest import NUM_STEPS
from trainpilot.store import RunStore
from trainpilot.ui.data import run_data
from trainpilot.ui.report import build_report, faults_and_recoveries, interventions


class _Refs(html.parser.HTMLParser):
    """Every URL-bearing attribute and every <script> with a src."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []
        self.external_scripts = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for key in ("src", "href", "data", "action", "poster"):
            if attrs.get(key):
                self.urls.append(attrs[key])
        if tag == "script" and attrs.get("src"):
            self.external_scripts += 1


def embedded_data(text: str) -> dict:
    match = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', text,
                      re.S)
    return json.loads(match.group(1))


def test_report_is_self_contained_and_embeds_the_store(known_run):
    text = build_report(known_run)
    refs = _Refs()
    refs.feed(text)
    assert refs.external_scripts == 0
    assert all(u.startswith(("#", "data:")) for u in refs.urls), refs.urls
    assert not re.search(r"https?://(?!www\.w3\.org)[^\s\"'<>]+\.(js|css)\b", text)
    assert "plotly.js v" in text  # the library is inlined
    with RunStore.open_readonly(known_run) as store:
        expected = run_data(store)
    assert embedded_data(text) == json.loads(json.dumps(expected))
    for section in ('id="summary"', 'id="plots"', 'id="loss-chart"', 'id="grad-heatmap"',
                    'id="rank-step-chart"', 'id="timeline-chart"', 'id="alerts-table"',
                    'id="faults-table"', 'id="goodput-table"', 'id="sim-inputs"',
                    'id="plan-table"'):
        assert section in text, section
    # Store text is data, not markup: escaped in tables, '</' escaped inside the JSON.
    assert "<script>alert(1)</script>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "alert(1)<\\/script>" in text  # inside the embedded JSON


def test_report_of_a_run_that_just_started(tmp_path):
    store = RunStore.create(tmp_path / "new", name="new")  # running, no step yet
    text = build_report(tmp_path / "new")
    store.close(status="completed")
    assert "not available: the run has no step time recorded yet" in text
    assert "not available: the run recorded no model, cluster or plan document" in text
    assert embedded_data(text)["series"] == {}


def test_report_sections_from_events(known_run):
    with RunStore.open_readonly(known_run) as store:
        data = run_data(store)
    faults = faults_and_recoveries(data["events"])
    assert len(faults) == 1
    assert faults[0]["fault"] == "rank_crash" and faults[0]["restored_step"] == 15
    assert faults[0]["recovery_s"] >= 0
    events = [dict(kind="intervention", step=5, name="clip", message="",
                   payload={"trigger": "grad_norm_trigger", "before": {"grad_norm": 40.0},
                            "after": {"grad_norm": 10.0}}),
              dict(kind="intervention", step=6, name="clip", message="",
                   payload={"phase": "outcome", "intervention_step": 5,
                            "outcome": "recovered"})]
    rows = interventions(events)
    assert rows == [dict(step=5, action="clip", trigger="grad_norm_trigger",
                         before="grad_norm=40", after="grad_norm=10", outcome="recovered",
                         outcome_step=6)]


def test_report_cli(tmp_path, known_run):
    out = tmp_path / "out" / "r.html"
    result = run_cli("report", str(known_run), "-o", str(out), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"html": str(out)}
    assert embedded_data(out.read_text())["cursor"]["step"] == NUM_STEPS
    result = run_cli("report", str(tmp_path / "missing"), "-o", str(tmp_path / "x.html"))
    assert result.returncode == 2 and result.stderr.startswith("error: run_dir")
    assert not (tmp_path / "x.html").exists()


def test_report_pdf_without_a_pdf_engine_fails_cleanly(tmp_path, known_run):
    out = tmp_path / "r.html"
    result = run_cli("report", str(known_run), "-o", str(out), "--pdf",
                     env={"TRAINPILOT_CHROMIUM": str(tmp_path / "no-such-chromium")})
    assert result.returncode == 1
    assert "no PDF engine" in result.stderr and "Traceback" not in result.stderr
    assert out.is_file()  # the HTML was still written


@pytest.mark.browser
def test_report_pdf_with_chromium(tmp_path, known_run):
    from trainpilot.ui.browser import find_chromium

    if find_chromium() is None:
        pytest.skip("Chromium is not installed: run scripts/install_browser.sh")
    result = run_cli("report", str(known_run), "-o", str(tmp_path / "r.html"), "--pdf",
                     timeout=180)
    assert result.returncode == 0, result.stderr
    pdf = (tmp_path / "r.pdf").read_bytes()
    assert pdf.startswith(b"%PDF") and len(pdf) > 20_000
    assert pdf.count(b"/Type /Page") >= 2 or pdf.count(b"/Type/Page") >= 2
