"""The runtime's step of ``trainpilot demo``: train the tiny GPT on 2 local processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

DEMO_JOB = "tiny-gpt-cpu-2"  # tiny-gpt, dp=2 (DDP), 16 x 64-token sequences per step
DEMO_STEPS = 80


def demo_train(console: Console, run_dir: str | Path, *, steps: int = DEMO_STEPS) -> dict[str, Any]:
    """Train ``tiny-gpt`` with DDP on 2 processes under torchrun (gloo) for ``steps`` steps,
    with a progress bar; print loss, tokens/s and predicted vs measured step time. Returns the
    run's summary (``summary.json``). About 15 s on 2 idle cores (3x that when other jobs
    share them)."""
    from trainpilot.runtime.config import TrainConfig
    from trainpilot.runtime.launch import launch
    from trainpilot.runtime.report import summary_rows
    from trainpilot.specs import load_job

    job = load_job(DEMO_JOB)
    config = TrainConfig(steps=steps, warmup_steps=max(1, steps // 10), lr=3e-3)
    console.print(f"Training {job.model.name} ({job.plan.dp} processes, DDP over gloo, "
                  f"{job.plan.global_batch_size} x {job.plan.seq_len} tokens per step) on the "
                  "seeded Markov corpus; the cost model is calibrated on this CPU first.")
    progress = Progress(TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
    task = progress.add_task("train", total=steps, info="starting 2 processes...")

    def on_record(record: dict) -> None:
        if record.get("kind") == "step":
            progress.update(task, completed=record["step"],
                            info=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s")

    with progress:
        summary = launch(model=job.model, plan=job.plan, config=config, run_dir=run_dir,
                         options=dict(nproc_per_node=str(job.plan.dp)), on_record=on_record)
    table = Table(show_header=False, title=f"run {run_dir}", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    console.print(table)
    summary["run_dir"] = str(run_dir)
    return summary
