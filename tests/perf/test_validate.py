"""`trainpilot validate`: the committed gate CI runs, the calibration/held-out split, and
negative controls showing the gate can fail."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from trainpilot.perf.hardware import load_curves
from trainpilot.perf.validation import (
    CALIBRATION,
    HELD_OUT,
    THRESHOLDS,
    all_cases,
    failures,
    run,
    summarize,
)
from trainpilot.perf.validation import vtrain

HAVE_VTRAIN = vtrain.locate() is not None


def test_validate_passes_its_committed_threshold():
    """This is how CI runs the validation (the vTrain rows when ../shared is present)."""
    result = run_cli("validate", "--json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    data = json.loads(result.stdout)
    assert data["failures"] == []
    assert data["thresholds"] == THRESHOLDS
    by_key = {(s["dataset"], s["split"]): s for s in data["summaries"]}
    for (dataset, split), s in by_key.items():
        if dataset != "all held-out":
            assert s["mape"] <= THRESHOLDS[s["kind"]], (dataset, split, s)
    assert ("narayanan2021", HELD_OUT) in by_key and ("korthikanti2022", HELD_OUT) in by_key
    if HAVE_VTRAIN:
        assert ("vtrain_single", CALIBRATION) in by_key and ("vtrain_multi", HELD_OUT) in by_key
        assert len(data["rows"]) > 1500


def test_without_vtrain_it_says_so_and_validates_the_papers(tmp_path):
    result = run_cli("validate", env={"TRAINPILOT_VTRAIN_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    assert "vTrain measurements not found" in result.stdout
    assert "narayanan2021" in result.stdout and "PASS" in result.stdout


def test_split_rule():
    cases = all_cases()
    calibration = [c for c in cases if c.split == CALIBRATION]
    assert all(c.dataset.startswith("vtrain") for c in calibration)
    assert all(int(c.label.split()[0][1:]) % 2 == 0 for c in calibration)
    papers = [c for c in cases if not c.dataset.startswith("vtrain")]
    assert len(papers) == 10 + 8 + 12 + 3 and all(c.split == HELD_OUT for c in papers)


def test_a_worse_curve_fails_the_gate():
    """Negative control: halve the A100's GEMM efficiency and the gate must trip."""
    curve = load_curves()["a100"]
    slow = curve.replace(gemm_points=tuple((x, y / 2) for x, y in curve.gemm_points))
    cases = [c for c in all_cases(find_vtrain=False)]
    assert failures(summarize(run(cases))) == []
    failed = failures(summarize(run(cases, slow)))
    assert any("narayanan2021" in line for line in failed)
    assert any("korthikanti2022" in line for line in failed)


@pytest.mark.skipif(not HAVE_VTRAIN, reason="vTrain measurements not present")
def test_held_out_vtrain_rows_within_target():
    results = run([c for c in all_cases() if c.dataset.startswith("vtrain")])
    for s in summarize(results):
        assert s.mape <= THRESHOLDS["time"], s


def test_llama3_rows_are_held_out_on_an_unfitted_h100_curve():
    """The H100 rows (Llama 3 405B, 8,192-16,384 GPUs) check efficiency data nothing was
    fitted to; a curve with half the GEMM throughput must fail their gate."""
    from trainpilot.perf.predict import CALIBRATED_CURVES
    from trainpilot.perf.validation.calibrate import GEMM_CEILING

    cases = [c for c in all_cases(find_vtrain=False) if c.dataset == "llama3_2024"]
    assert len(cases) == 3 and all(c.split == HELD_OUT for c in cases)
    assert {c.cluster.device.efficiency_curve for c in cases} == {"h100"}
    assert "h100" not in CALIBRATED_CURVES and "h100" not in GEMM_CEILING
    results = run(cases)
    assert failures(summarize(results)) == []
    assert all(abs(r.error) < 0.15 for r in results), [r.error for r in results]
    curve = load_curves()["h100"]
    slow = curve.replace(gemm_points=tuple((x, y / 2) for x, y in curve.gemm_points))
    assert any("llama3_2024" in line for line in failures(summarize(run(cases, slow))))
