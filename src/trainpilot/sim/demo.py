"""The availability step of ``trainpilot demo``: recovery policies for the planned job."""

from __future__ import annotations

from rich.table import Table

from trainpilot.sim.availability import AvailabilityJob
from trainpilot.sim.failures import llama3_mix
from trainpilot.sim.policies import CheckpointCosts, compare, standard_policies
from trainpilot.specs import TrainJob

DEFAULT_DAYS = 30.0


def training_days(job: TrainJob) -> float:
    """Failure-free days to train the job's token budget (cost model), or DEFAULT_DAYS."""
    if not job.total_tokens:
        return DEFAULT_DAYS
    from trainpilot.perf import predict

    return job.total_tokens / predict(job.model, job.cluster, job.plan).tokens_per_s / 86400.0


def availability_rows(job: TrainJob, *, num_trials: int = 500, seed: int = 0):
    """Compare the three standard policies on ``job`` under the Llama 3 failure mix."""
    from trainpilot.perf.flops import count_params

    cluster = job.cluster
    costs = CheckpointCosts(params=count_params(job.model).total, num_nodes=cluster.num_nodes,
                            devices_per_node=cluster.devices_per_node)
    days = training_days(job)
    avail_job = AvailabilityJob(num_nodes=cluster.num_nodes,
                                devices_per_node=cluster.devices_per_node,
                                duration_h=days * 24.0)
    failures = llama3_mix()
    return avail_job, failures, compare(avail_job, failures, standard_policies(costs),
                                        num_trials=num_trials, seed=seed)


def demo_availability(console, job: TrainJob) -> None:
    """Print the availability comparison for ``job`` as a rich table."""
    avail_job, failures, rows = availability_rows(job)
    title = (f"Availability of {job.name}: {avail_job.num_nodes} nodes, "
             f"{avail_job.duration_h / 24:.1f} days, Llama 3 failure mix "
             f"(MTBF {failures.mtbf_h(avail_job.num_nodes):.1f} h), Monte-Carlo 500 runs")
    table = Table(title=title, title_justify="left")
    for col in ("policy", "ckpt every", "ETTR ± 95%", "closed form", "failures", "lost h",
                "recover h", "spares h", "wall days"):
        table.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for policy, mc, cf in rows:
        b = mc.badput_h
        table.add_row(
            policy.name, f"{policy.checkpoint.interval_min:.1f} min",
            f"{mc.ettr:.4f} ± {(mc.ettr_ci95[1] - mc.ettr_ci95[0]) / 2:.4f}",
            f"{cf.ettr:.4f}" if cf else "-", f"{mc.interruptions:.1f}",
            f"{b['lost_progress']:.1f}", f"{b['detection'] + b['restart'] + b['restore']:.1f}",
            f"{b['spare_wait']:.1f}", f"{avail_job.duration_h / 24 / mc.ettr:.1f}",
        )
    console.print(table)
    console.print("ETTR = productive time / wall time (Monte-Carlo mean and 95% interval). "
                  "lost h: work redone after failures; recover h: detection + restart + restore; "
                  "spares h: waiting for a replacement node. Wall days = failure-free training "
                  "days / ETTR. Closed form: exact for exponential failures when spares never "
                  "run out; see docs/simulators.md.")
