"""The worker torchrun starts on every rank: ``python -m trainpilot.runtime.worker --job JSON``.

It joins the process group torchrun set up (env://), builds the layout, lets rank 0 write the
resolved documents into the run directory (atomically), calibrates the cost model on CPU, trains
and writes ``summary.json``. Per-step records stream to ``metrics.jsonl`` for the launcher.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from trainpilot.fsio import atomic_write_text
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError, dump


def write_documents(run_dir: Path, *, model: ModelSpec, plan: Plan, config, extra: dict) -> None:
    """The resolved model, plan and training config, plus the environment (rank 0 only)."""
    dump(model, run_dir / "model.yaml")
    dump(plan, run_dir / "plan.yaml")
    dump(config, run_dir / "train.yaml")
    atomic_write_text(run_dir / "env.json", json.dumps(extra, indent=2) + "\n")


def predict(model: ModelSpec, plan: Plan, layout, cluster: ClusterSpec | None) -> dict[str, Any]:
    """Calibrate (CPU) or take the given cluster, and ask the cost model for the step time."""
    from trainpilot.runtime.calibrate import calibrate, calibrated_cpu_cluster, predict_step_time_s

    info: dict[str, Any] = {}
    if cluster is None and layout.device.type == "cpu":
        cal = calibrate(device=layout.device)
        cluster = calibrated_cpu_cluster(layout.world_size, cal)
        info["calibration"] = cal.to_dict()
        info["calibration_note"] = ("cpu device calibrated on this machine: 1024^3 fp32 matmul "
                                    "(all ranks at once) and gloo all-reduce (8 B, 4 MiB)")
    if cluster is None:
        info.update(predicted_step_time_s=None, prediction_note="no cluster given")
        return info
    value, note = predict_step_time_s(model, cluster, plan)
    info.update(cluster=cluster, predicted_step_time_s=value, prediction_note=note)
    return info


def run_worker(job: dict[str, Any]) -> int:
    import torch
    import torch.distributed as dist

    from trainpilot.runtime.callbacks import JsonlMetrics
    from trainpilot.runtime.config import load_config
    from trainpilot.runtime.layout import build_layout, default_backend
    from trainpilot.runtime.trainer import Trainer
    from trainpilot.specs import load_cluster, load_model, load_plan

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, plan = load_model(job["model"]), load_plan(job["plan"])
    config = load_config(job["config"])
    cluster = load_cluster(job["cluster"]) if job.get("cluster") else None
    run_dir = Path(job["run_dir"])
    dist.init_process_group(default_backend(),
                            timeout=datetime.timedelta(seconds=job.get("timeout_s", 600)))
    try:
        layout = build_layout(plan, model=model)
        rank0 = layout.rank == 0
        if rank0:
            write_documents(run_dir, model=model, plan=plan, config=config, extra=dict(
                torch=torch.__version__, python=platform.python_version(),
                host=platform.node(), **layout.describe()))
        pred = predict(model, plan, layout, cluster) if config.predict else {}
        if rank0 and pred.get("cluster") is not None:
            dump(pred["cluster"], run_dir / "cluster.yaml")
        metrics = JsonlMetrics(run_dir / "metrics.jsonl", rank=layout.rank)
        trainer = Trainer(model=model, plan=plan, config=config, layout=layout,
                          callbacks=[metrics, *load_callbacks(job.get("callbacks", []),
                                                              run_dir=run_dir, layout=layout)],
                          predicted_step_time_s=pred.get("predicted_step_time_s"))
        if "calibration" in pred:
            trainer.emit("calibration", dict(**pred["calibration"], note=pred["calibration_note"]))
        summary = trainer.fit()
        if rank0:
            summary.update(
                layout=layout.describe(), autocast=trainer.autocast_note,
                prediction_note=pred.get("prediction_note"),
                calibration=pred.get("calibration"), data=_data_info(trainer.dataset))
            atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        return 0
    finally:
        dist.destroy_process_group()


def load_callbacks(refs: list[str], *, run_dir: Path, layout) -> list:
    """Instantiate ``"package.module:factory"`` references; each factory is called as
    ``factory(run_dir=..., layout=...)`` and returns a Callback (how the run store and the
    health monitor attach to a ``trainpilot train`` run)."""
    import importlib

    out = []
    for ref in refs:
        module_name, sep, attr = ref.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr) if sep else None
        except (ImportError, AttributeError):
            factory = None
        if factory is None:
            raise SpecError("--callback", ref, "not an importable 'package.module:factory'")
        out.append(factory(run_dir=run_dir, layout=layout))
    return out


def _data_info(dataset) -> dict[str, Any]:
    info: dict[str, Any] = dict(kind=type(dataset).__name__, num_samples=dataset.num_samples)
    if hasattr(dataset, "entropy_rate_nats"):
        info.update(entropy_rate_nats=dataset.entropy_rate_nats,
                    uniform_loss_nats=dataset.uniform_loss_nats)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trainpilot.runtime.worker")
    parser.add_argument("--job", required=True, help="JSON: model, plan, config, run_dir, cluster")
    args = parser.parse_args(argv)
    try:
        return run_worker(json.loads(args.job))
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
