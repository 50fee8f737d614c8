"""Exporters so users keep the tools they have: TensorBoard event files and a Prometheus
text endpoint. Both receive every metric batch the writer logs (``RunStore.add_exporter``)."""

from __future__ import annotations

import math
import os
from typing import Mapping

from trainpilot.specs.errors import SpecError


class TensorBoardExporter:
    """Writes scalars to TensorBoard event files under ``log_dir`` (tensorboardX: no TensorFlow).

    Tags are the metric names (``grad_norm/blocks.0.attn``); NaN is skipped as TensorBoard would
    draw it as a gap anyway and some readers reject it.
    """

    def __init__(self, log_dir: str | os.PathLike, *, flush_secs: int = 10):
        from tensorboardX import SummaryWriter

        self.log_dir = str(log_dir)
        self._writer = SummaryWriter(logdir=self.log_dir, flush_secs=flush_secs)

    def export(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            value = float(value)
            if not math.isnan(value):
                self._writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class PrometheusExporter:
    """Serves the latest value of every metric as Prometheus text on ``http://addr:port/metrics``.

    One gauge family, ``trainpilot_metric{run,name}``, plus ``trainpilot_step{run}``: metric names
    stay exactly as logged (label values accept any text). ``port=0`` picks a free port (see
    ``self.port``). Binds 127.0.0.1 unless told otherwise.
    """

    def __init__(self, *, port: int = 0, addr: str = "127.0.0.1", run: str = "run"):
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        if not 0 <= port <= 65535:
            raise SpecError("port", port, "valid: 0 (any free port) to 65535")
        self.registry = CollectorRegistry()
        self._metric = Gauge("trainpilot_metric", "latest value of a trainpilot metric",
                             ["run", "name"], registry=self.registry)
        self._step = Gauge("trainpilot_step", "latest step logged", ["run"],
                           registry=self.registry)
        self.run = run
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._server.server_port
        self.url = f"http://{addr}:{self.port}/metrics"

    def export(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._metric.labels(self.run, name).set(float(value))
        self._step.labels(self.run).set(step)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def export_store_to_tensorboard(run_dir: str | os.PathLike, log_dir: str | os.PathLike) -> int:
    """Write a finished (or running) store's metrics as TensorBoard event files; returns the
    number of scalars written."""
    from trainpilot.store.runstore import RunStore

    store = RunStore.open_readonly(run_dir)
    exporter = TensorBoardExporter(log_dir)
    count = 0
    try:
        for name, rows in store.metrics().items():
            for step, value in rows:
                exporter.export(step, {name: value})
                count += not math.isnan(value)
    finally:
        exporter.close()
        store.close()
    return count
