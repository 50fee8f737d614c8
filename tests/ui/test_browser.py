"""End to end in a real browser: the dashboard server on the store of a short real 2-rank
training run, driven by Debian's headless Chromium through chromedriver.

Oracle: the points plotly drew (each chart's ``gd.data``) equal the store's rows; a negative
control shows the comparison fails on data off by one step or by one part in a million."""

from __future__ import annotations

import math

import pytest

from tests.ui import helpers
from trainpilot.store import RunStore
from trainpilot.ui.data import natural_key, run_data

pytestmark = [pytest.mark.browser, pytest.mark.timeout(240)]
STRAGGLER_COLOR = "#d62728"


@pytest.fixture
def page(browser):
    """The shared browser on a blank page with its console log drained (a page left open by an
    earlier test would keep polling a server that is gone)."""
    browser.get("about:blank")
    browser.get_log("browser")
    yield browser
    browser.get("about:blank")


def by_name(traces, name):
    found = [t for t in traces if t["name"] == name]
    assert len(found) == 1, (name, [t["name"] for t in traces])
    return found[0]


def updates(browser) -> int:
    return browser.execute_script("return window.trainpilot ? window.trainpilot.status.updates "
                                  ": 0") or 0


def severe_console_entries(browser) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def check_charts_equal_store(browser, run_dir) -> None:
    """Every chart against the store (read here, independently of the page's API answers)."""
    from trainpilot.health.view import straggler_ratios

    with RunStore.open_readonly(run_dir) as store:
        loss_steps, loss = store.series("loss")
        assert helpers.same_points(*_xy(browser, "loss-chart", "loss"), loss_steps, loss)
        assert helpers.same_points(*_xy(browser, "lr-chart", "lr"), *store.series("lr"))
        assert helpers.same_points(*_xy(browser, "health-chart", "score"),
                                   *store.series("health/score"))
        assert helpers.same_points(*_xy(browser, "comm-chart", "exposed comm (rank 0)"),
                                   *store.series("comm_time_s"))
        assert helpers.same_points(*_xy(browser, "mem-chart", "peak memory (GiB)"),
                                   *store.series("peak_mem_gib"))
        # Negative controls: the oracle rejects a shift by one step and a 1e-6 change.
        assert not helpers.same_points(loss_steps[1:], loss[:-1], loss_steps[1:], loss[1:])
        nudged = list(loss)
        nudged[3] *= 1 + 1e-6
        assert not helpers.same_points(loss_steps, loss, loss_steps, nudged)

        layers = sorted((n for n in store.metric_names("grad_norm/")), key=natural_key)
        heat = helpers.chart_traces(browser, "grad-heatmap")[0]
        assert heat["y"] == [n[len("grad_norm/"):] for n in layers]
        for row, drawn, name in zip(heat["customdata"], heat["dz"], layers):
            steps, values = store.series(name)
            assert steps == heat["x"] and row == values, name
            assert drawn == pytest.approx([math.log10(v) for v in values], rel=1e-12), name

        ratios = straggler_ratios(store)
        timings = store.rank_timings()
        traces = helpers.chart_traces(browser, "rank-step-chart")
        slow = {r for r, x in ratios.items() if x >= 1.2}
        assert slow == {1}, ratios  # the run slowed rank 1: the fault fired and is flagged
        for rank in sorted({t.rank for t in timings}):
            mine = [t for t in timings if t.rank == rank]
            trace = next(t for t in traces if t["name"].startswith(f"rank {rank} compute"))
            assert helpers.same_points(trace["dx"], trace["dy"], [t.step for t in mine],
                                       [t.compute_s for t in mine])
            assert (trace["color"] == STRAGGLER_COLOR) == (rank in slow)
            assert ("straggler" in trace["name"]) == (rank in slow)
        expected = run_data(store)["ranks"]
        for trace in helpers.chart_traces(browser, "rank-tokens-chart"):
            if trace["name"].startswith("rank "):
                rank = trace["name"].split()[1]
                assert trace["dy"] == expected[rank]["tokens_per_s"]["values"]

        events = [e for e in run_data(store)["events"] if e["kind"] != "alert_cleared"]
        placed = [e for e in events if e["x_step"] is not None]
        marks = helpers.chart_traces(browser, "timeline-chart")
        assert sum(len(t["dx"]) for t in marks) == len(placed)
        assert sorted(x for t in marks for x in t["dx"]) == sorted(e["x_step"] for e in placed)
        assert 0 not in [x for t in marks for x in t["dx"]]  # no step-less event at step 0
        assert {t["name"] for t in marks} == {e["kind"] for e in placed}
        assert {"alert", "intervention", "checkpoint"} <= {t["name"] for t in marks}


def _xy(browser, chart: str, name: str):
    """The points drawn (calcdata), not just the arrays handed to plotly."""
    trace = by_name(helpers.chart_traces(browser, chart), name)
    return trace["dx"], trace["dy"]


def test_dashboard_draws_the_store_and_updates_without_reload(trained_run, page, tmp_path):
    browser = page
    proc, url = helpers.start_dashboard(trained_run)
    try:
        browser.get(url)
        assert browser.current_url.endswith("/run?key=.")  # a single run opens its page
        browser.get(url + "run?key=.&poll_ms=300")
        helpers.wait_for(lambda: updates(browser) >= 1, timeout_s=90, what="the first update")
        check_charts_equal_store(browser, trained_run)
        plan = browser.find_element("id", "plan-table").text
        assert "dp=2" in plan and "measured step time" in plan
        assert browser.find_element("id", "run-status").text == "completed"

        # A metric written after the page loaded shows up without a reload.
        browser.execute_script("window.__sameDocument = 42;")
        with RunStore.open_readonly(trained_run) as store:
            last = store.latest_step()
        writer = RunStore.append(trained_run)
        writer.log_metrics(last + 1, {"loss": 1.2345, "lr": 1e-4})
        writer.close()

        def late_point():  # every chart that draws the store's arrays as they grow
            x, y = _xy(browser, "loss-chart", "loss")
            lr_x, lr_y = _xy(browser, "lr-chart", "lr")
            return (x[-1], y[-1], lr_x[-1], lr_y[-1]) == (last + 1, 1.2345, last + 1, 1e-4)
        helpers.wait_for(late_point, timeout_s=30, what="the late loss point")
        assert browser.execute_script("return window.__sameDocument") == 42
        assert browser.find_element("id", "run-step").text == str(last + 1)
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        assert (tmp_path / "dashboard.png").stat().st_size > 20_000
        assert severe_console_entries(browser) == []  # no CSP violation, no failed request
    finally:
        helpers.kill_tree(proc)


def test_runs_index_lists_runs_and_compares_two_loss_curves(trained_run, page, tmp_path):
    browser = page
    from tests.health.toyrun import run_toy_training

    root = tmp_path / "runs"
    run_toy_training(root / "toy", num_steps=40)
    (root / "ddp").symlink_to(trained_run, target_is_directory=True)  # not followed: skipped
    import shutil

    shutil.copytree(trained_run, root / "ddp-copy", ignore=shutil.ignore_patterns("checkpoints"))
    proc, url = helpers.start_dashboard(root)
    try:
        browser.get(url)
        helpers.wait_for(lambda: len(browser.execute_script(
            "return window.trainpilot ? window.trainpilot.runs : []")) == 2,
            timeout_s=60, what="the runs table")
        rows = browser.find_elements("css selector", "#runs-table tbody tr")
        assert [r.find_elements("css selector", "td")[1].text for r in rows] == ["ddp-copy",
                                                                                  "toy"]
        assert all(r.find_elements("css selector", "td")[3].text == "completed" for r in rows)
        for box in browser.find_elements("css selector", "#runs-table input[type=checkbox]"):
            box.click()
        browser.find_element("id", "compare-button").click()
        traces = helpers.wait_for(
            lambda: len(helpers.chart_traces(browser, "compare-chart")) == 2
            and helpers.chart_traces(browser, "compare-chart"), timeout_s=30,
            what="the comparison chart")
        for key, trace in zip(["ddp-copy", "toy"], traces):
            assert trace["name"].startswith(key)
            with RunStore.open_readonly(root / key) as store:
                assert helpers.same_points(trace["dx"], trace["dy"], *store.series("loss"))
        browser.save_screenshot(str(tmp_path / "index.png"))
        assert severe_console_entries(browser) == []
    finally:
        helpers.kill_tree(proc)


def test_report_renders_offline_in_chromium(trained_run, page, tmp_path):
    browser = page
    from trainpilot.ui.report import write_report

    out = write_report(trained_run, tmp_path / "report.html")["html"]
    browser.get(out.as_uri())
    helpers.wait_for(lambda: browser.execute_script("return window.trainpilotReportRendered"),
                     timeout_s=60, what="the report's charts")
    check_charts_equal_store(browser, trained_run)
    assert severe_console_entries(browser) == []
    browser.save_screenshot(str(tmp_path / "report.png"))


def test_dashboard_rereads_rewritten_steps_after_a_resume(known_run, page):
    """A re-run process reopens the store (``run_resumed``) and rewrites steps behind the
    page's cursor: the page reads everything again."""
    browser = page
    proc, url = helpers.start_dashboard(known_run)
    try:
        browser.get(url + "run?key=.&poll_ms=300")
        helpers.wait_for(lambda: updates(browser) >= 1, timeout_s=90, what="the first update")
        x, y = _xy(browser, "loss-chart", "loss")
        old_step1 = y[x.index(1)]
        # A step rewritten behind the newest one, with no event: its batch's range brings it.
        assert old_step1 != 9.25
        writer = RunStore.append(known_run)
        writer.log_metrics(1, {"loss": 9.25})
        writer.close()
        helpers.wait_for(lambda: _xy(browser, "loss-chart", "loss")[1][0] == 9.25,
                         timeout_s=30, what="the rewritten step 1")
        x = by_name(helpers.chart_traces(browser, "loss-chart"), "loss")["x"]
        assert x == sorted(set(x))  # replaced in place, not appended
        # A re-run process reopens the store (run_resumed, no trainer restart) and logs step 2.
        writer = RunStore.create(known_run, world_size=2)
        writer.log_metrics(2, {"loss": 7.5})
        writer.flush()

        def reread():
            x, y = _xy(browser, "loss-chart", "loss")
            return y[x.index(1)] == 9.25 and y[x.index(2)] == 7.5
        helpers.wait_for(reread, timeout_s=30, what="the rewritten steps")
        writer.close(status="completed")
    finally:
        helpers.kill_tree(proc)
