"""``trainpilot demo``: the whole pipeline on an embedded default job, no arguments needed.

1. the job (GPT-3 175B on 1,024 A100): parameters, FLOPs;
2. plan: every layout searched, the best ones with time and memory breakdowns;
3. simulate: availability of the run under the Llama 3 failure mix, per recovery policy;
4. run: the tiny GPT trained for real on 2 local processes (gloo), with an injected crash and
   its recovery;
5. watch: the health report from the run store, the HTML report and the dashboard command.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from trainpilot.cli.common import add_verb, console

DEMO_JOB = "gpt3-175b-a100-1024"
PARTS = ("job", "plan", "simulate", "train", "watch")


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "demo", help="run the end-to-end demo on a preset job",
        description="Plan, simulate, train (with an injected fault and its recovery) and watch: "
                    "GPT-3 175B on 1,024 A100 80GB for the planning and simulation, the tiny "
                    "GPT on 2 local CPU processes for the real run.",
        examples="  trainpilot demo\n"
                 "  trainpilot demo --only job,plan          # no training\n"
                 "  trainpilot demo --run-dir runs/demo --steps 40",
    )
    parser.add_argument("--job", default=DEMO_JOB, help=f"job preset (default {DEMO_JOB})")
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"comma-separated parts to run (default all: {','.join(PARTS)})")
    parser.add_argument("--run-dir", default=None,
                        help="where the training run is written (default runs/demo-<time>)")
    parser.add_argument("--steps", type=int, default=None, help="training steps for the real run")
    parser.set_defaults(func=run)


def _parts(text: str) -> list[str]:
    from trainpilot.specs import SpecError

    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise SpecError("--only", text, f"valid: a comma-separated subset of {','.join(PARTS)}")
    return parts


def run(args: argparse.Namespace) -> int:
    from trainpilot.cli.show import print_summary, summarize
    from trainpilot.specs import load_job

    parts = _parts(args.only)
    job = load_job(args.job)
    started = time.perf_counter()
    if "job" in parts:
        console.rule(f"[bold]1. The job: {job.name}")
        print_summary(summarize(job.model, job.cluster, job.plan, name=job.name,
                                total_tokens=job.total_tokens))
    if "plan" in parts:
        from trainpilot.plan.demo import demo_plan

        console.rule("[bold]2. Plan: search every layout")
        demo_plan(console, job)
    if "simulate" in parts:
        from trainpilot.sim.demo import demo_availability

        console.rule("[bold]3. Simulate: availability under failures")
        demo_availability(console, job)
    run_dir = Path(args.run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    if "train" in parts:
        from trainpilot.runtime.demo import demo_train

        console.rule("[bold]4. Run: train for real on 2 local processes, with an injected crash")
        kwargs = {"steps": args.steps} if args.steps else {}
        demo_train(console, run_dir, **kwargs)
    if "watch" in parts:
        from trainpilot.health.demo import demo_health
        from trainpilot.ui.demo import demo_report

        console.rule("[bold]5. Watch: health report, HTML report, dashboard")
        if (run_dir / "trainpilot.db").is_file():
            demo_health(console, run_dir)
        demo_report(console, run_dir)
    console.print(f"[dim]demo finished in {time.perf_counter() - started:.0f} s[/]")
    return 0
