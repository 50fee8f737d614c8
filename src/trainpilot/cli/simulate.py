"""``trainpilot simulate``: the step timeline, availability under failures (training and
serving), scaling, and serving (Sim2Infer)."""

from __future__ import annotations

import argparse

from trainpilot.cli.common import (
    Formatter,
    add_doc_args,
    add_json_arg,
    add_verb,
    console,
    print_json,
)


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "simulate", help="simulate a step, availability under failures, or scaling",
        description="What-if machines built on the cost model: one training step as a "
                    "discrete-event timeline, the job's availability under failures "
                    "(closed forms and Monte-Carlo), time, cost and energy across sizes, and "
                    "inference serving (Sim2Infer).",
        examples="  trainpilot simulate step --job gpt3-175b-a100-1024 --trace step.json\n"
                 "  trainpilot simulate availability --job llama3-405b-h100-16384 --compare\n"
                 "  trainpilot simulate scaling --model llama3-8b --cluster h100-sxm-x64 "
                 "--devices 64,128,256 --global-batch-size 512 --seq-len 8192 --tokens 1e12",
    )
    sub = parser.add_subparsers(dest="what", metavar="<what>", required=True)
    _register_step(sub)
    _register_availability(sub)
    _register_scaling(sub)
    _register_serve(sub)


def _sub(sub, name: str, *, help: str, description: str, examples: str):
    return sub.add_parser(name, help=help, description=description,
                          epilog="examples:\n" + examples.rstrip(), formatter_class=Formatter)


def _register_step(sub) -> None:
    p = _sub(sub, "step", help="discrete-event timeline of one training step",
             description="Simulate one step of a plan: every pipeline rank's forwards and "
                         "backwards in the plan's schedule, sends on links, gradient buckets "
                         "overlapped with backward, the optimizer. Prints step time, bubble "
                         "(vs (p-1)/(v m)) and per-rank busy/idle/comm.",
             examples="  trainpilot simulate step --job gpt3-175b-a100-1024\n"
                      "  trainpilot simulate step --model llama3-70b --cluster h100-sxm-x64 "
                      "--plan tp=8,pp=4,vp=5,dp=2,global_batch_size=64,seq_len=8192 "
                      "--trace out.json")
    p.add_argument("--job", help="job preset or file (instead of --model/--cluster/--plan)")
    add_doc_args(p, required=False)
    p.add_argument("--schedule", choices=["gpipe", "1f1b", "interleaved", "zero_bubble"],
                   help="override the plan's pipeline schedule")
    p.add_argument("--shared-nic", action="store_true",
                   help="pipeline sends and gradient buckets share each rank's NIC")
    p.add_argument("--trace", help="write a Chrome-trace JSON timeline (Perfetto, "
                                   "chrome://tracing)")
    add_json_arg(p)
    p.set_defaults(func=run_step)


def _register_availability(sub) -> None:
    from trainpilot.cli import simulate_availability

    p = _sub(sub, "availability", help="ETTR, badput and the best checkpoint interval",
             description="Availability of a job under failures: ETTR (productive / wall time) "
                         "with a 95%% interval, interruptions, badput by category and the optimal "
                         "checkpoint interval, from the closed form and a Monte-Carlo "
                         "simulation. Default failures: the Llama 3 405B report's mix. Every "
                         "cost added (detection, replacement, restart, restore, stall, write) "
                         "is printed with its source; --explain tabulates them.",
             examples="  trainpilot simulate availability --nodes 2048 --days 54 --explain\n"
                      "  trainpilot simulate availability --scenario llama3-405b\n"
                      "  trainpilot simulate availability --scenario kokolis-rsc1 --json\n"
                      "  trainpilot simulate availability --job gpt3-175b-a100-1024 --compare\n"
                      "  trainpilot simulate availability --nodes 256 --mtbf-h 12 "
                      "--weibull-shape 0.7 --spares 4 --json")
    simulate_availability.register_arguments(p)
    p.set_defaults(func=simulate_availability.run)


def _register_serve(sub) -> None:
    from trainpilot.cli import simulate_serve

    p = _sub(sub, "serve", help="Sim2Infer: TTFT, TPOT, throughput, KV cache of a deployment",
             description="Serving of dense and MoE models under TP, EP, DP-attention and "
                         "prefill/decode disaggregation, from the model, the cluster and a "
                         "serving plan: TTFT, TPOT, throughput per device and per instance, KV "
                         "capacity and the largest batch that fits, and per pass the bound "
                         "(compute, HBM weights / KV, all-to-all, TP collectives) that sets it. "
                         "--validate predicts the bundled published measurements.",
             examples="  trainpilot simulate serve --model deepseek-v3 --cluster h800-x176 "
                      "--plan deepseek-v3-pd-ep144\n"
                      "  trainpilot simulate serve --model llama3-70b --cluster h100-sxm-x8 "
                      "--plan llama3-70b-tp2-fp8 --input-len 2048 --output-len 256\n"
                      "  trainpilot simulate serve --model llama3-8b --cluster h200-x8 "
                      "--plan 'input_len=128,output_len=2048,batching=static,batch_size=256'\n"
                      "  trainpilot simulate serve --validate")
    simulate_serve.register_arguments(p)
    p.set_defaults(func=simulate_serve.run)


def _register_scaling(sub) -> None:
    p = _sub(sub, "scaling", help="throughput, MFU, linearity, time, cost, energy vs size",
             description="Plan each device count, then report throughput, MFU, linearity, "
                         "the days to train the token budget (with failures: / ETTR), "
                         "device-hours, cost, energy and CO2.",
             examples="  trainpilot simulate scaling --model llama3-70b --cluster h100-sxm-x256 "
                      "--devices 256,512,1024 --global-batch-size 1024 --seq-len 8192 "
                      "--tokens 15e12 --price 2.5")
    add_doc_args(p, plan=False)
    p.add_argument("--devices", required=True, help="comma-separated device counts")
    p.add_argument("--global-batch-size", type=int, required=True, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="default 4096")
    p.add_argument("--tokens", type=float, required=True, help="training tokens")
    p.add_argument("--price", type=float, help="USD per device-hour (default: cluster's)")
    p.add_argument("--power-w", type=float, help="W per device (default: the device's TDP)")
    p.add_argument("--pue", type=float, default=1.1)
    p.add_argument("--grid-kg-per-kwh", type=float, default=0.4, help="kg CO2 per kWh")
    p.add_argument("--oversubscription", type=float, default=1.0,
                   help="bandwidth taper between non-blocking domains (Llama 3 clusters: 7)")
    p.add_argument("--domain-nodes", type=int,
                   help="nodes per non-blocking domain (default: the cluster's racks; Llama 3: "
                        "384)")
    p.add_argument("--no-failures", action="store_true",
                   help="skip the availability model (Llama 3 mix, storage checkpoints)")
    add_json_arg(p)
    p.set_defaults(func=run_scaling)


# ------------------------------------------------------------------ step


def run_step(args: argparse.Namespace) -> int:
    from trainpilot.perf import predict
    from trainpilot.sim.step import explain, step_spec_from_prediction
    from trainpilot.sim.timeline import simulate_step
    from trainpilot.specs import SpecError, load_cluster, load_job, load_model, load_plan

    if args.job:
        job = load_job(args.job)
        model, cluster, plan = job.model, job.cluster, job.plan
    elif args.model and args.cluster and args.plan:
        model, cluster, plan = (load_model(args.model), load_cluster(args.cluster),
                                load_plan(args.plan))
    else:
        raise SpecError("--job/--model/--cluster/--plan", None,
                        "give a job, or a model, a cluster and a plan")
    if args.schedule:
        from trainpilot.specs import Plan
        from trainpilot.specs.loading import validate

        plan = validate(Plan, dict(plan.to_dict(), pp_schedule=args.schedule), doc="plan")
    pred = predict(model, cluster, plan)
    spec = step_spec_from_prediction(pred, plan, shared_nic=args.shared_nic)
    result = simulate_step(spec)
    if args.trace:
        from trainpilot.sim.step import write_chrome_trace

        write_chrome_trace(result, args.trace)
    notes = explain(result, spec)
    if args.json:
        print_json(dict(result.to_dict(), cost_model_step_time_s=pred.step_time_s,
                        schedule=spec.schedule, num_micro_batches=spec.num_micro_batches,
                        explanation=notes, trace=args.trace))
        return 0
    _print_step(result, spec, pred, notes, args.trace)
    return 0


def _print_step(result, spec, pred, notes: list[str], trace: str | None) -> None:
    from rich.table import Table

    summary = Table(show_header=False, title=f"one step: {spec.schedule}, pp={spec.pp}, "
                    f"vp={spec.vp}, {spec.num_micro_batches} micro-batches", title_justify="left")
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    rows = [("step time (simulated)", f"{result.step_time_s:.4f} s"),
            ("step time (cost model)", f"{pred.step_time_s:.4f} s"),
            ("pipeline flush ends", f"{result.pipeline_end_s:.4f} s"),
            ("bubble (simulated)", f"{result.bubble_fraction:.4f}"),
            ("bubble (p-1)/(v m)", f"{result.closed_form_bubble:.4f}"),
            ("exposed communication", f"{result.exposed_comm_s:.4f} s")]
    for key, value in rows:
        summary.add_row(key, value)
    console.print(summary)
    ranks = Table(title="per pipeline rank (seconds)", title_justify="left")
    for col in ("rank", "busy", "idle", "comm", "exposed DP tail"):
        ranks.add_column(col, justify="right")
    for i, r in enumerate(result.ranks):
        d = r.to_dict(result.step_time_s)
        ranks.add_row(str(i), f"{d['busy_s']:.4f}", f"{d['idle_s']:.4f}", f"{d['comm_s']:.4f}",
                      f"{d['exposed_dp_s']:.4f}")
    console.print(ranks)
    for note in notes:
        console.print(f"- {note}")
    if trace:
        console.print(f"trace written to {trace} (open in https://ui.perfetto.dev)")


# ------------------------------------------------------------------ scaling


def run_scaling(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from trainpilot.sim.availability import CheckpointSpec, RecoverySpec
    from trainpilot.sim.failures import llama3_mix
    from trainpilot.sim.scaling import (
        CostInputs,
        Oversubscription,
        planner_or_fallback,
        scaling_table,
    )
    from trainpilot.specs import SpecError, load_cluster, load_model

    try:
        counts = [int(float(x)) for x in args.devices.split(",") if x.strip()]
    except ValueError:
        raise SpecError("--devices", args.devices, "valid: comma-separated integers") from None
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    costs = CostInputs(price_per_device_hour=args.price, power_w=args.power_w, pue=args.pue,
                       grid_kg_co2_per_kwh=args.grid_kg_per_kwh)
    availability = None if args.no_failures else (
        llama3_mix(), CheckpointSpec(stall_s=10.0, durable_s=120.0), RecoverySpec())
    planner, which = planner_or_fallback()
    seq_len = args.seq_len or 4096
    with Progress(console=console, transient=True, disable=args.json) as progress:
        task = progress.add_task("planning", total=len(counts))
        rows = scaling_table(model, cluster, counts, global_batch_size=args.global_batch_size,
                             seq_len=seq_len, total_tokens=args.tokens, planner=planner,
                             costs=costs, availability=availability,
                             oversubscription=Oversubscription(ratio=args.oversubscription,
                                                               domain_nodes=args.domain_nodes),
                             on_row=lambda _: progress.advance(task))
    if args.json:
        print_json(dict(planner=which, rows=[r.to_dict() for r in rows]))
        return 0
    _print_scaling(rows, which, args.tokens)
    return 0


def _print_scaling(rows, which: str, tokens: float) -> None:
    from rich.table import Table

    table = Table(title=f"scaling to train {tokens:.3g} tokens (planner: {which})",
                  title_justify="left")
    cols = ("devices", "layout", "tokens/s", "MFU", "linearity", "days", "ETTR", "wall days",
            "device-h", "cost $", "MWh", "t CO2")
    for col in cols:
        table.add_column(col, justify="left" if col == "layout" else "right")

    def opt(value, fmt):
        return "-" if value is None else format(value, fmt)

    for r in rows:
        table.add_row(str(r.num_devices), r.layout, f"{r.tokens_per_s:,.0f}", f"{r.mfu:.3f}",
                      f"{r.linearity:.3f}", f"{r.train_days:.2f}", opt(r.ettr, ".4f"),
                      opt(r.wall_days, ".2f"), f"{r.device_hours:,.0f}", opt(r.cost_usd, ",.0f"),
                      opt(r.energy_mwh, ".1f"), opt(r.co2_t, ".1f"))
    console.print(table)
    console.print("Days: failure-free; wall days / ETTR include failures (Llama 3 mix, storage "
                  "checkpoints at the optimal interval); device-hours, cost and energy use wall "
                  "days when failures are on. Energy at board power x PUE: an upper bound.")
