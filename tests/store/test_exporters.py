"""Exporters: TensorBoard event files (read back record by record) and a Prometheus endpoint."""

from __future__ import annotations

import math
import struct
import urllib.request

import pytest

from trainpilot.store import RunStore
from trainpilot.store.exporters import (PrometheusExporter, TensorBoardExporter,
                                        export_store_to_tensorboard)


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Parse TFRecord event files (length, crc, Event proto, crc) without TensorFlow."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_tensorboard_exporter_writes_what_the_store_logs(tmp_path):
    store = RunStore.create(tmp_path / "run")
    store.add_exporter(TensorBoardExporter(tmp_path / "tb"))
    for step in range(1, 6):
        store.log_metrics(step, {"loss": 1.0 / step, "grad_norm/blocks.0": float(step),
                                 "nan_metric": math.nan})
    store.close(status="completed")
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4, 5]
    assert scalars["loss"][-1][1] == pytest.approx(0.2)
    assert scalars["grad_norm/blocks.0"][2] == (3, 3.0)
    assert "nan_metric" not in scalars


def test_a_finished_store_converts_to_tensorboard(tmp_path):
    with RunStore.create(tmp_path / "run") as store:
        for step in range(1, 4):
            store.log_metrics(step, {"loss": float(step)})
    assert export_store_to_tensorboard(tmp_path / "run", tmp_path / "tb") == 3
    assert read_scalars(tmp_path / "tb")["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0)]


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
