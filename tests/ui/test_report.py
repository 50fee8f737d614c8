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
    assert "plotly.js (cartesian - minified) v" in text  # the library is inlined
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
    # Inside the embedded JSON no '<' is left at all: it is written \\u003c.
    body = re.search(r'<script type="application/json" id="run-data">(.*?)</script>', text,
                     re.S).group(1)
    assert "<" not in body and "alert(1)\\u003c/script\\u003e" in body


def _store_with_hostile_text(run_dir):
    from tests.ui.conftest import write_known_store

    write_known_store(run_dir)
    store = RunStore.append(run_dir)
    store.log_event("note", 3, {"text": "<!--<script>"}, name="<!--<script",
                    message="<!--<script>x</script>-->")
    store.close()
    return run_dir


def test_hostile_store_text_cannot_re_mode_the_script_elements(tmp_path):
    text = build_report(_store_with_hostile_text(tmp_path / "r"))
    scripts = re.findall(r"<script[^>]*>(.*?)</script>", text, re.S)
    assert len(scripts) == 4  # plotly, charts, data, the call: none was cut short
    assert embedded_data(text)["events"][-1]["message"] == "<!--<script>x</script>-->"
    for script in scripts:
        assert "<!--" not in script and "</script" not in script.lower()


def test_output_suffix_picks_the_format_and_anything_else_is_refused(tmp_path, known_run):
    for bad in ("noext", "r.txt", "r.pdf.bak"):
        result = run_cli("report", str(known_run), "-o", str(tmp_path / bad))
        assert result.returncode == 2, bad
        assert "valid: a file name ending in .html, .htm or .pdf" in result.stderr
        assert not (tmp_path / bad).exists() and "Traceback" not in result.stderr
    (tmp_path / "adir.html").mkdir()
    result = run_cli("report", str(known_run), "-o", str(tmp_path / "adir.html"))
    assert result.returncode == 2 and "directory" in result.stderr
    (tmp_path / "afile").write_text("x")
    result = run_cli("report", str(known_run), "-o", str(tmp_path / "afile" / "r.html"))
    assert result.returncode == 2 and "is a file" in result.stderr
    result = run_cli("report", str(known_run), "-o", str(tmp_path / "r.pdf"), "--pdf")
    assert result.returncode == 2 and "--pdf" in result.stderr
    bad_store = tmp_path / "bad"
    bad_store.mkdir()
    (bad_store / "trainpilot.db").write_bytes(b"\x00\xffnot sqlite" * 100)
    result = run_cli("report", str(bad_store), "-o", str(tmp_path / "b.html"))
    assert result.returncode == 2 and "not a readable trainpilot store" in result.stderr


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


def ink(pdf_path, page: int = 0):
    """(share of non-white pixels, share of strongly coloured ones) of a rendered PDF page."""
    import numpy as np
    import pypdfium2

    doc = pypdfium2.PdfDocument(str(pdf_path))
    try:
        image = doc[page].render(scale=1.0).to_numpy().astype(np.int32)[..., :3]
    finally:
        doc.close()
    nonwhite = (image.min(axis=2) < 235).mean()
    coloured = ((image.max(axis=2) - image.min(axis=2)) > 60).mean()
    return float(nonwhite), float(coloured), len(image)


def test_page_ink_oracle_tells_a_blank_page_from_a_drawn_one(tmp_path):
    """Negative control of the check below: a blank page has no ink."""
    import pypdfium2

    doc = pypdfium2.PdfDocument.new()
    doc.new_page(595, 842)
    doc.save(str(tmp_path / "blank.pdf"))
    doc.close()
    nonwhite, coloured, _ = ink(tmp_path / "blank.pdf")
    assert nonwhite == 0 and coloured == 0


@pytest.mark.browser
def test_report_pdf_with_chromium_renders_charts(tmp_path, known_run):
    from trainpilot.ui.browser import find_chromium

    if find_chromium() is None:
        pytest.skip("Chromium is not installed: run scripts/install_browser.sh")
    result = run_cli("report", str(known_run), "-o", str(tmp_path / "r.html"), "--pdf",
                     timeout=180)
    assert result.returncode == 0, result.stderr
    pdf = (tmp_path / "r.pdf").read_bytes()
    assert pdf.startswith(b"%PDF") and len(pdf) > 20_000
    assert pdf.count(b"/Type /Page") >= 2 or pdf.count(b"/Type/Page") >= 2
    # Page 2 holds plots: rendered, it has text and coloured chart lines, not a blank page.
    nonwhite, coloured, _ = ink(tmp_path / "r.pdf", page=1)
    assert nonwhite > 0.01 and coloured > 0.001, (nonwhite, coloured)
    # -o x.pdf: the PDF alone, a real one (not the HTML saved under a .pdf name).
    result = run_cli("report", str(known_run), "-o", str(tmp_path / "only.pdf"), timeout=180)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "only.pdf").read_bytes().startswith(b"%PDF")
    assert ink(tmp_path / "only.pdf", page=1)[1] > 0.001
    assert not list(tmp_path.glob("only.html"))
