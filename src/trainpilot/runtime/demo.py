"""The runtime's step of ``trainpilot demo``: train the tiny GPT on 2 local processes, crash one
of them on purpose, recover, and say what the crash cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

DEMO_JOB = "tiny-gpt-cpu-2"  # tiny-gpt, dp=2 (DDP), 16 x 64-token sequences per step
DEMO_STEPS = 80
CHECKPOINT_EVERY = 10


def demo_train(console: Console, run_dir: str | Path, *, steps: int = DEMO_STEPS,
               crash: bool = True) -> dict[str, Any]:
    """Train ``tiny-gpt`` with DDP on 2 processes under torchrun (gloo) for ``steps`` steps,
    with a progress bar, a checkpoint every 10 steps and, with ``crash``, rank 1 SIGKILLed a
    few steps after the middle checkpoint: torchrun restarts both ranks (``--max-restarts 1``),
    they restore from storage and finish. Prints loss, tokens/s, predicted vs measured step
    time and the time the crash cost; writes the run store the health report and the dashboard
    read. Returns the run's summary. About 25 s on 2 idle cores (2-3x that when other jobs
    share them)."""
    from trainpilot.runtime.config import TrainConfig
    from trainpilot.runtime.launch import launch
    from trainpilot.runtime.report import summary_rows
    from trainpilot.specs import load_job

    job = load_job(DEMO_JOB)
    checkpoint_every = min(CHECKPOINT_EVERY, max(1, steps // 4))
    config = TrainConfig(steps=steps, warmup_steps=max(1, steps // 10), lr=3e-3,
                         checkpoint_every=checkpoint_every)
    crash_step = _crash_step(steps, checkpoint_every) if crash else None
    console.print(f"Training {job.model.name} ({job.plan.dp} processes, DDP over gloo, "
                  f"{job.plan.global_batch_size} x {job.plan.seq_len} tokens per step) on the "
                  "seeded Markov corpus; the cost model is calibrated on this CPU first. "
                  f"A checkpoint every {config.checkpoint_every} steps (host memory, a peer's "
                  "memory, storage)" + (f"; rank 1 is killed (SIGKILL) at step {crash_step}."
                                        if crash_step else "."))
    progress = Progress(TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
    task = progress.add_task("train", total=steps, info="starting 2 processes...")

    def on_record(record: dict) -> None:
        if record.get("kind") == "step":
            progress.update(task, completed=record["step"],
                            info=f"loss {record['loss']:.3f}  {record['tokens_per_s']:,.0f} tok/s")
        elif record.get("kind") == "restart" and "restored_step" in record:
            progress.update(task, completed=record["restored_step"],
                            info=f"restarted: step {record['restored_step']} restored from "
                                 f"{record.get('source')}")

    # The workers' stderr goes to files: the crash makes the survivor print the gloo error it
    # recovers from, which belongs in a log, not in the demo's output.
    log_dir = Path(run_dir) / "worker-logs"
    with progress:
        summary = launch(model=job.model, plan=job.plan, config=config, run_dir=run_dir,
                         options=dict(nproc_per_node=str(job.plan.dp),
                                      max_restarts=1 if crash_step else 0,
                                      redirects="2", log_dir=str(log_dir)),
                         on_record=on_record, elastic=dict(recovery="restart"),
                         inject=f"crash:rank=1,step={crash_step}" if crash_step else None)
    table = Table(show_header=False, title=f"run {run_dir}", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in summary_rows(summary) + recovery_rows(summary):
        table.add_row(label, value)
    console.print(table)
    console.print(f"Workers' stderr (the survivor's error from the crash included): {log_dir}/",
                  style="dim")
    summary["run_dir"] = str(run_dir)
    return summary


def _crash_step(steps: int, every: int) -> int:
    """A few steps after the checkpoint nearest the middle: some work is lost and redone."""
    middle = max(every, (steps // 2) // every * every)
    return min(steps, middle + max(1, every // 2))


def recovery_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """What each fault cost: from the fault to the first step after the restart, and the
    steps that had to be done again."""
    rows = []
    median = summary.get("median_step_time_s") or 0.0
    for rec in summary.get("recoveries", []):
        lost = rec.get("lost_steps") or 0
        total = (rec.get("recovery_s") or 0.0) + lost * median
        rows.append((f"crash → recovered ({rec.get('reason')})",
                     f"{rec.get('fault') or 'a failure'}: restored step {rec.get('restored_step')}"
                     f" from {rec.get('source')}; {rec.get('recovery_s', 0):.1f} s from the "
                     f"fault to the next completed step, {lost} step(s) redone "
                     f"({lost * median:.1f} s): {total:.1f} s lost"))
    return rows
