"""``trainpilot demo``: the whole pipeline on an embedded default job, no arguments needed."""

from __future__ import annotations

import argparse

from trainpilot.cli.common import add_verb, console

DEMO_JOB = "gpt3-175b-a100-1024"


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "demo", help="run the end-to-end demo on a preset job",
        description="Load the preset job (GPT-3 175B on 1,024 A100 80GB) and walk through "
                    "what trainpilot does with it.",
        examples="  trainpilot demo",
    )
    parser.add_argument("--job", default=DEMO_JOB, help=f"job preset (default {DEMO_JOB})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainpilot.cli.show import print_summary, summarize
    from trainpilot.specs import load_job

    job = load_job(args.job)
    console.rule(f"[bold]1. The job: {job.name}")
    print_summary(summarize(job.model, job.cluster, job.plan, name=job.name,
                            total_tokens=job.total_tokens))
    return 0
