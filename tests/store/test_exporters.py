"""Exporters, read back by the consumers' own readers: TensorBoard's EventAccumulator (its
event-file reader) sees each step at the run store's wall time; prometheus_client's parser reads
the text file; the endpoint serves the latest values."""

from __future__ import annotations

import math
import urllib.request

import pytest

from tests.conftest import run_cli
from trainpilot.specs import SpecError
from trainpilot.store import RunStore
from trainpilot.store.exporters import (
    ExportSpec,
    PrometheusExporter,
    TensorBoardExporter,
    export_metrics,
    export_store_to_tensorboard,
)

T0 = 1_700_000_000.25  # step wall times far from now: an export-time stamp cannot pass


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float, float]]]:
    """(step, wall_time, value) per tag, as TensorBoard itself reads the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.wall_time, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def _fill(store, steps=range(1, 6)):
    for step in steps:
        store.log_metrics(step, {"loss": 1.0 / step, "grad_norm/blocks.0": float(step),
                                 "nan_metric": math.nan}, time_s=T0 + 1.5 * step)


def test_live_tensorboard_events_carry_the_stores_step_times(tmp_path):
    store = RunStore.create(tmp_path / "run")
    store.add_exporter(TensorBoardExporter(tmp_path / "tb"))
    _fill(store)
    store.close(status="completed")
    with RunStore.open_readonly(tmp_path / "run") as reader:
        times = dict(reader.step_times())
    assert len(times) == 5
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert [(s, w) for s, w, _ in scalars["loss"]] == sorted(times.items())
    assert scalars["loss"][-1][2] == pytest.approx(0.2)
    assert scalars["grad_norm/blocks.0"][2][::2] == (3, 3.0)
    assert "nan_metric" not in scalars


def test_a_finished_store_exports_at_its_own_wall_times(tmp_path):
    with RunStore.create(tmp_path / "run") as store:
        _fill(store, range(1, 4))
    with RunStore.open_readonly(tmp_path / "run") as store:
        times = store.step_times()
    assert export_store_to_tensorboard(tmp_path / "run", tmp_path / "tb") == 6
    loss = tensorboard_scalars(tmp_path / "tb")["loss"]
    assert [(s, w) for s, w, _ in loss] == times
    assert all(abs(w - T0) < 10 for _, w, _ in loss)  # not the time of the export


def test_export_metrics_writes_tensorboard_and_a_prometheus_file(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    with RunStore.create(tmp_path / "run", name="exp1") as store:
        _fill(store)
    assert export_metrics(tmp_path / "run",
                          f"tensorboard={tmp_path / 'tb'},prometheus={tmp_path / 'm.prom'}") == []
    assert len(tensorboard_scalars(tmp_path / "tb")["loss"]) == 5
    families = {f.name: f for f in text_string_to_metric_families(
        (tmp_path / "m.prom").read_text())}
    values = {s.labels["name"]: s.value for s in families["trainpilot_metric"].samples}
    assert values["loss"] == pytest.approx(0.2) and values["grad_norm/blocks.0"] == 5.0
    assert families["trainpilot_step"].samples[0].value == 5.0
    assert families["trainpilot_step_time_seconds"].samples[0].value == T0 + 7.5


def test_export_metrics_attaches_to_a_live_store(tmp_path):
    store = RunStore.create(tmp_path / "run")
    _fill(store, range(1, 3))  # before the exporter (a resumed run): replayed
    exporters = export_metrics(store, f"tensorboard={tmp_path / 'tb'}")
    _fill(store, range(3, 5))
    store.close(status="completed")
    assert len(exporters) == 1
    assert [s for s, _, _ in tensorboard_scalars(tmp_path / "tb")["loss"]] == [1, 2, 3, 4]


def test_export_metrics_verb(tmp_path):
    with RunStore.create(tmp_path / "run") as store:
        _fill(store)
    result = run_cli("export-metrics", str(tmp_path / "run"), "--tensorboard",
                     str(tmp_path / "tb"), "--prometheus", str(tmp_path / "m.prom"), "--json")
    assert result.returncode == 0, result.stderr
    assert [w for _, w, _ in tensorboard_scalars(tmp_path / "tb")["loss"]] == [
        T0 + 1.5 * s for s in range(1, 6)]
    assert "trainpilot_metric" in (tmp_path / "m.prom").read_text()
    bad = run_cli("export-metrics", str(tmp_path / "run"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_export_spec_refuses_in_one_line():
    assert ExportSpec.parse("tensorboard=tb,prometheus=9100").prometheus_port == 9100
    for text in ("tensorboard", "wandb=x", "", "prometheus=99999"):
        with pytest.raises(SpecError):
            ExportSpec.parse(text)


@pytest.mark.timeout(30)
def test_prometheus_endpoint_serves_latest_values(tmp_path):
    exporter = PrometheusExporter(port=0, run="exp1")
    store = RunStore.create(tmp_path)
    store.add_exporter(exporter)
    try:
        store.log_metrics(7, {"loss": 2.5, "health/score": 91.0})
        store.log_metrics(8, {"loss": 2.25})
        text = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    finally:
        store.close(status="completed")  # closes the exporter (server shut down)
    assert 'trainpilot_metric{name="loss",run="exp1"} 2.25' in text
    assert 'trainpilot_metric{name="health/score",run="exp1"} 91.0' in text
    assert 'trainpilot_step{run="exp1"} 8.0' in text
    with pytest.raises(OSError):
        urllib.request.urlopen(exporter.url, timeout=2)
