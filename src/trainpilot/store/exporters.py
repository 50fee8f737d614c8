"""Exporters so users keep the tools they have: TensorBoard event files, a Prometheus endpoint
and a Prometheus text file (node_exporter's textfile collector). Live, they receive every
metric batch the writer logs (``RunStore.add_exporter``), with the step's wall time; after the
fact, :func:`export_metrics` writes what a run store holds, each step at the wall time the
store recorded for it (``steps.time``), not at the time of the export.

``export_metrics(store_or_run_dir, spec)`` is the one entry point for both: ``spec`` is
``"tensorboard=DIR,prometheus=PORT|FILE"`` (either part optional), as ``trainpilot
export-metrics`` and ``trainpilot train --export-metrics`` take it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from trainpilot.specs.errors import SpecError


class TensorBoardExporter:
    """Writes scalars to TensorBoard event files under ``log_dir`` (tensorboardX: no TensorFlow).

    Tags are the metric names (``grad_norm/blocks.0.attn``); each event's wall time is the
    step's (``time_s``, unix seconds; now when not given). NaN is skipped: TensorBoard would
    draw it as a gap anyway and some readers reject it.
    """

    def __init__(self, log_dir: str | os.PathLike, *, flush_secs: int = 10):
        from tensorboardX import SummaryWriter

        self.log_dir = str(log_dir)
        self._writer = SummaryWriter(logdir=self.log_dir, flush_secs=flush_secs)

    def export(self, step: int, metrics: Mapping[str, float], *,
               time_s: float | None = None) -> None:
        wall = time.time() if time_s is None else float(time_s)
        for name, value in metrics.items():
            value = float(value)
            if not math.isnan(value):
                self._writer.add_scalar(name, value, global_step=step, walltime=wall)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Gauges:
    """``trainpilot_metric{run,name}`` (latest value of each metric, names exactly as logged)
    and ``trainpilot_step{run}`` / ``trainpilot_step_time_seconds{run}`` in a registry."""

    def __init__(self, run: str):
        from prometheus_client import CollectorRegistry, Gauge

        self.run = run
        self.registry = CollectorRegistry()
        self._metric = Gauge("trainpilot_metric", "latest value of a trainpilot metric",
                             ["run", "name"], registry=self.registry)
        self._step = Gauge("trainpilot_step", "latest step logged", ["run"],
                           registry=self.registry)
        self._time = Gauge("trainpilot_step_time_seconds",
                           "unix time at which the latest step was logged", ["run"],
                           registry=self.registry)

    def export(self, step: int, metrics: Mapping[str, float], *,
               time_s: float | None = None) -> None:
        for name, value in metrics.items():
            self._metric.labels(self.run, name).set(float(value))
        self._step.labels(self.run).set(step)
        self._time.labels(self.run).set(time.time() if time_s is None else time_s)


class PrometheusExporter(_Gauges):
    """Serves the latest value of every metric as Prometheus text on ``http://addr:port/metrics``.
    ``port=0`` picks a free port (see ``self.port``). Binds 127.0.0.1 unless told otherwise."""

    def __init__(self, *, port: int = 0, addr: str = "127.0.0.1", run: str = "run"):
        from prometheus_client import start_http_server

        if not 0 <= port <= 65535:
            raise SpecError("port", port, "valid: 0 (any free port) to 65535")
        super().__init__(run)
        self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._server.server_port
        self.url = f"http://{addr}:{self.port}/metrics"

    def join(self, timeout: float | None = None) -> None:
        """Wait until the server thread ends (it serves until ``close``), or ``timeout`` s."""
        self._thread.join(timeout)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class PrometheusFileExporter(_Gauges):
    """Writes the latest values to a Prometheus text file (atomically, as node_exporter's
    textfile collector expects) at every flush and at close."""

    def __init__(self, path: str | os.PathLike, *, run: str = "run", every_s: float = 10.0):
        super().__init__(run)
        self.path, self.every_s, self._last = Path(path), every_s, 0.0

    def export(self, step: int, metrics: Mapping[str, float], *,
               time_s: float | None = None) -> None:
        super().export(step, metrics, time_s=time_s)
        if time.monotonic() - self._last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        from prometheus_client import write_to_textfile

        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.path), self.registry)  # tmp file + rename
        self._last = time.monotonic()

    def close(self) -> None:
        self.flush()


@dataclass(kw_only=True)
class ExportSpec:
    """Where metrics go: a TensorBoard log dir and/or Prometheus (a port to serve on, or a
    text file to write)."""

    tensorboard: Path | None = None
    prometheus_port: int | None = None
    prometheus_file: Path | None = None

    @classmethod
    def parse(cls, text: str) -> ExportSpec:
        """``"tensorboard=DIR,prometheus=PORT|FILE"``; SpecError naming a bad part."""
        out = cls()
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            key, sep, value = part.partition("=")
            if not sep or not value:
                raise SpecError("--export-metrics", part, "valid: tensorboard=DIR, "
                                "prometheus=PORT or prometheus=FILE, comma-separated")
            if key == "tensorboard":
                out.tensorboard = Path(value)
                if out.tensorboard.exists() and not out.tensorboard.is_dir():
                    raise SpecError("--export-metrics", part, "tensorboard= names a file; "
                                    "valid: a log directory (new or existing)")
            elif key == "prometheus":
                if value.isdigit():
                    port = int(value)
                    if not 0 <= port <= 65535:
                        raise SpecError("--export-metrics", part, "valid port: 0 to 65535")
                    out.prometheus_port = port
                else:
                    out.prometheus_file = Path(value)
                    if out.prometheus_file.is_dir():
                        raise SpecError("--export-metrics", part, "prometheus= names a "
                                        "folder; valid: a file to write, or a port")
            else:
                raise SpecError("--export-metrics", key, "valid: tensorboard, prometheus")
        if out.tensorboard is None and out.prometheus_port is None and out.prometheus_file is None:
            raise SpecError("--export-metrics", text, "names no destination; valid: "
                            "tensorboard=DIR,prometheus=PORT|FILE")
        return out


def export_metrics(store_or_run_dir, spec: str | ExportSpec, *, run: str | None = None):
    """Send a run's metrics where ``spec`` says, each step at the store's own wall time.

    Given a writable RunStore (a live run: ``train --export-metrics``), the exporters are
    attached to it after receiving what it already holds (a resumed run), get every later
    batch as it is logged, and are closed with the store; returns them. Given a run directory
    (or a read-only store), writes what the store holds and closes them; returns ``[]``.
    """
    from trainpilot.store.runstore import RunStore

    spec = spec if isinstance(spec, ExportSpec) else ExportSpec.parse(spec)
    owned = not isinstance(store_or_run_dir, RunStore)
    store = RunStore.open_readonly(store_or_run_dir) if owned else store_or_run_dir
    try:
        info = None if run else store.run()
        name = run or (info.name if info else None) or "run"
        exporters: list = []
        if spec.tensorboard is not None:
            exporters.append(TensorBoardExporter(spec.tensorboard))
        if spec.prometheus_file is not None:
            exporters.append(PrometheusFileExporter(spec.prometheus_file, run=name))
        if spec.prometheus_port is not None:
            exporters.append(PrometheusExporter(port=spec.prometheus_port, run=name))
        if store.writable:
            store.flush()
        _replay(store, exporters)
        if owned or not store.writable:
            for exporter in exporters:
                if not isinstance(exporter, PrometheusExporter):
                    exporter.close()
            return [e for e in exporters if isinstance(e, PrometheusExporter)]
        for exporter in exporters:
            store.add_exporter(exporter)
        return exporters
    finally:
        if owned:
            store.close()


def _replay(store, exporters: list) -> int:
    """Every stored (step, metrics) to ``exporters`` in step order, at the step's stored wall
    time; returns the number of finite values sent."""
    times = dict(store.step_times())
    by_step: dict[int, dict[str, float]] = {}
    for name, rows in store.metrics().items():
        for step, value in rows:
            by_step.setdefault(step, {})[name] = value
    count = 0
    for step in sorted(by_step):
        for exporter in exporters:
            exporter.export(step, by_step[step], time_s=times.get(step))
        count += sum(not math.isnan(v) for v in by_step[step].values())
    return count


def export_store_to_tensorboard(run_dir: str | os.PathLike, log_dir: str | os.PathLike) -> int:
    """Write a finished (or running) store's metrics as TensorBoard event files at the steps'
    own wall times; returns the number of scalars written."""
    from trainpilot.store.runstore import RunStore

    store = RunStore.open_readonly(run_dir)
    exporter = TensorBoardExporter(log_dir)
    try:
        return _replay(store, [exporter])
    finally:
        exporter.close()
        store.close()
