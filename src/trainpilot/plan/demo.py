"""The planning step of ``trainpilot demo``: search the job's model on its cluster at its batch."""

from __future__ import annotations

from rich.console import Console

from trainpilot.perf import predict
from trainpilot.plan.render import compact, print_search
from trainpilot.plan.search import SearchResult, search
from trainpilot.specs import TrainJob


def demo_plan(console: Console, job: TrainJob, *, top: int = 5) -> SearchResult:
    """Print the top plans for ``job.model`` on ``job.cluster`` at the job's batch and
    sequence length (time and memory breakdowns), then how the job's own layout compares.
    Returns the search result."""
    plan = job.plan
    console.rule(f"[bold]Plan: every layout of {job.model.name} on {job.cluster.name}")
    result = search(job.model, job.cluster, global_batch_size=plan.global_batch_size,
                    seq_len=plan.seq_len, top=top, precision=plan.precision)
    print_search(console, result)
    own = predict(job.model, job.cluster, plan)
    verdict = "fits" if own.fits else "does not fit"
    line = (f"the job's own layout ({compact(plan)}): {own.step_time_s:.2f} s/step, "
            f"MFU {own.mfu:.1%}, peak {own.memory_gib['peak']:.1f} GiB ({verdict})")
    if result:
        best = result[0].prediction
        line += f"; the best plan found is {own.step_time_s / best.step_time_s:.2f}x faster"
    console.print(line)
    return result
