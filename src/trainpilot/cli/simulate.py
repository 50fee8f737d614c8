"""``trainpilot simulate``: the step timeline, availability under failures, and scaling."""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

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
                    "(closed forms and Monte-Carlo), and time, cost and energy across sizes.",
        examples="  trainpilot simulate step --job gpt3-175b-a100-1024 --trace step.json\n"
                 "  trainpilot simulate availability --job llama3-405b-h100-16384 --compare\n"
                 "  trainpilot simulate scaling --model llama3-8b --cluster h100-sxm-x64 "
                 "--devices 64,128,256 --global-batch-size 512 --seq-len 8192 --tokens 1e12",
    )
    sub = parser.add_subparsers(dest="what", metavar="<what>", required=True)
    _register_step(sub)
    _register_availability(sub)
    _register_scaling(sub)


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
    p = _sub(sub, "availability", help="ETTR, badput and the best checkpoint interval",
             description="Availability of a job under failures: ETTR (productive / wall time) "
                         "with a 95%% interval, interruptions, badput by category and the optimal "
                         "checkpoint interval, from the closed form and a Monte-Carlo "
                         "simulation. Default failures: the Llama 3 405B report's mix.",
             examples="  trainpilot simulate availability --nodes 2048 --days 54\n"
                      "  trainpilot simulate availability --job gpt3-175b-a100-1024 --compare\n"
                      "  trainpilot simulate availability --nodes 256 --mtbf-h 12 "
                      "--weibull-shape 0.7 --spares 4 --json")
    p.add_argument("--job", help="job preset or file: nodes from its cluster, and with --compare "
                                 "checkpoint costs from its model")
    p.add_argument("--nodes", type=int, help="nodes in the job (default: the job's)")
    p.add_argument("--devices-per-node", type=int, default=None, help="default 8")
    p.add_argument("--days", type=float, default=30.0, help="wall-clock days to simulate")
    p.add_argument("--work-days", type=float,
                   help="failure-free days of training to finish instead: simulates about the "
                        "wall time they need and reports the expected wall days (work / ETTR)")
    g = p.add_argument_group("failures")
    g.add_argument("--mtbf-h", type=float, help="one failure class with this job MTBF (hours) "
                                                "instead of the Llama 3 mix")
    g.add_argument("--weibull-shape", type=float, help="Weibull inter-arrivals of this shape")
    g.add_argument("--weibull-start", choices=["stationary", "new"], default="stationary",
                   help="Weibull nodes in service at t=0, or all new (burn-in)")
    g.add_argument("--lemons", type=int, default=0, help="lemon nodes")
    g.add_argument("--lemon-multiplier", type=float, default=10.0)
    g.add_argument("--quarantine-lemons", action="store_true")
    g.add_argument("--correlated", type=float, default=0.0,
                   help="share of hardware failures that take down several nodes")
    g.add_argument("--correlated-nodes", type=int, default=4)
    g = p.add_argument_group("checkpoints")
    g.add_argument("--interval-min", type=float, default=30.0)
    g.add_argument("--stall-s", type=float, default=10.0, help="blocking time per save")
    g.add_argument("--durable-s", type=float, default=120.0, help="until the storage copy lands")
    g.add_argument("--peer", action="store_true", help="also keep copies in peers' memory")
    g.add_argument("--peer-durable-s", type=float, default=5.0)
    g.add_argument("--storage-every", type=int, default=10)
    g = p.add_argument_group("recovery")
    for flag, default, text in (("--detect-s", 60.0, "detection"),
                                ("--restart-s", 300.0, "restart / re-rendezvous"),
                                ("--restore-storage-s", 300.0, "restore from storage"),
                                ("--restore-peer-s", 30.0, "restore from a peer"),
                                ("--replace-s", 1800.0, "cold node replacement"),
                                ("--repair-h", 72.0, "hours until a failed node is back"),
                                ("--retry-fraction", 0.0, "share of transient faults absorbed"),
                                ("--retry-s", 30.0, "pause per absorbed fault")):
        g.add_argument(flag, type=float, default=default, help=text)
    g.add_argument("--spares", type=int, default=0, help="hot spare nodes")
    g = p.add_argument_group("engines")
    g.add_argument("--trials", type=int, default=1000, help="Monte-Carlo runs")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compare", action="store_true",
                   help="compare restart from storage / peer checkpoints / hot spares")
    add_json_arg(p)
    p.set_defaults(func=run_availability)


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


# ------------------------------------------------------------------ availability


def _failure_model(args: argparse.Namespace, num_nodes: int):
    import pydantic

    from trainpilot.sim.failures import FailureModel
    from trainpilot.specs.errors import from_pydantic

    try:
        return _failure_model_unchecked(args, num_nodes)
    except pydantic.ValidationError as err:
        raise from_pydantic(err, doc="failures", model_cls=FailureModel) from None


def _failure_model_unchecked(args: argparse.Namespace, num_nodes: int):
    from trainpilot.sim.failures import llama3_mix, single_mtbf

    extra: dict[str, Any] = dict(
        num_lemon_nodes=args.lemons, lemon_multiplier=args.lemon_multiplier,
        quarantine_lemons=args.quarantine_lemons, correlated_fraction=args.correlated,
        correlated_nodes=args.correlated_nodes)
    if args.weibull_shape is not None:
        extra.update(distribution="weibull", weibull_shape=args.weibull_shape,
                     weibull_start=args.weibull_start)
    if args.mtbf_h is not None:
        return single_mtbf(mtbf_h=args.mtbf_h, num_nodes=num_nodes, needs_replacement=True,
                           **extra)
    return llama3_mix(**extra)


def _build(cls, doc: str, **data):
    from trainpilot.specs.loading import validate

    return validate(cls, data, doc=doc)


def run_availability(args: argparse.Namespace) -> int:
    from trainpilot.sim.availability import (
        AvailabilityJob,
        CheckpointSpec,
        RecoverySpec,
        closed_form,
    )
    from trainpilot.sim.montecarlo import monte_carlo
    from trainpilot.specs import SpecError, load_job

    job = load_job(args.job) if args.job else None
    nodes = args.nodes or (job.cluster.num_nodes if job else None)
    if nodes is None:
        raise SpecError("--nodes", None, "give --nodes or --job")
    per_node = args.devices_per_node or (job.cluster.devices_per_node if job else 8)
    avail = _build(AvailabilityJob, "job", num_nodes=nodes, devices_per_node=per_node,
                   duration_h=args.days * 24.0)
    if args.trials < 2:
        raise SpecError("--trials", args.trials, "valid: at least 2")
    failures = _failure_model(args, nodes)
    if args.compare:
        return _run_compare(args, job, avail, failures)
    ckpt = _build(CheckpointSpec, "checkpoint", interval_min=args.interval_min,
                  stall_s=args.stall_s, durable_s=args.durable_s, in_memory_peer=args.peer,
                  peer_durable_s=args.peer_durable_s, storage_every=args.storage_every)
    rec = _build(RecoverySpec, "recovery", detect_s=args.detect_s, restart_s=args.restart_s,
                 restore_storage_s=args.restore_storage_s, restore_peer_s=args.restore_peer_s,
                 num_spares=args.spares, replace_s=args.replace_s, repair_h=args.repair_h,
                 retry_fraction=args.retry_fraction, retry_s=args.retry_s)
    if args.work_days is not None:
        avail = _horizon_for_work(args.work_days, avail, failures, ckpt, rec)
    status = console.status("Monte-Carlo...") if not args.json else contextlib.nullcontext()
    with status:
        mc = monte_carlo(avail, failures, ckpt, rec, num_trials=args.trials, seed=args.seed)
    cf = closed_form(avail, failures, ckpt, rec) if failures.distribution == "exponential" \
        else None
    if args.json:
        out = mc.to_dict()
        out["closed_form"] = cf.to_dict() if cf else None
        if args.work_days is not None:
            out.update(work_days=args.work_days, expected_wall_days=args.work_days / mc.ettr)
        print_json(out)
        return 0
    _print_availability(avail, mc, cf)
    if args.work_days is not None:
        console.print(f"{args.work_days:g} failure-free days of training take "
                      f"{args.work_days / mc.ettr:.1f} wall days (work / ETTR)")
    return 0


def _horizon_for_work(work_days: float, avail, failures, ckpt, rec):
    """The job resized to the wall time ``work_days`` of training needs, estimated with the
    closed form (for Weibull: its exponential counterpart of the same mean rate)."""
    from trainpilot.sim.availability import closed_form_ettr
    from trainpilot.specs import SpecError

    if work_days <= 0:
        raise SpecError("--work-days", work_days, "valid: a positive number of days")
    ettr, _ = closed_form_ettr(avail, failures.replace(distribution="exponential"), ckpt, rec)
    return avail.replace(duration_h=work_days * 24.0 / max(ettr, 1e-3))


def _print_availability(avail, mc, cf) -> None:
    from rich.table import Table

    table = Table(title=f"availability: {avail.num_nodes} nodes x {avail.devices_per_node}, "
                        f"{avail.duration_h / 24:.1f} days, MTBF {mc.mtbf_h:.2f} h",
                  title_justify="left")
    table.add_column("")
    table.add_column("Monte-Carlo", justify="right")
    table.add_column("closed form", justify="right")
    c = cf.to_dict() if cf else {}
    table.add_row("ETTR", f"{mc.ettr:.4f} ({mc.ettr_ci95[0]:.4f}-{mc.ettr_ci95[1]:.4f})",
                  f"{cf.ettr:.4f}" if cf else "-")
    table.add_row("single runs, middle 95%",
                  f"{mc.ettr_range95[0]:.4f}-{mc.ettr_range95[1]:.4f}", "-")
    table.add_row("interruptions", f"{mc.interruptions:.1f}",
                  f"{c['interruptions']:.1f}" if cf else "-")
    for key, hours in mc.badput_h.items():
        table.add_row(f"  {key.replace('_', ' ')} h", f"{hours:.1f}",
                      f"{c['badput_h'][key]:.1f}" if cf else "-")
    table.add_row("optimal interval", f"{mc.optimal_interval_min:.1f} min",
                  f"{cf.optimal_interval_min:.1f} min" if cf else "-")
    if cf:
        table.add_row("  Young / Daly 2006", "",
                      f"{c['young_interval_min']:.1f} / {c['daly_interval_min']:.1f} min")
    console.print(table)


def _run_compare(args, job, avail, failures) -> int:
    from rich.table import Table

    from trainpilot.perf.flops import count_params
    from trainpilot.sim.policies import CheckpointCosts, compare, standard_policies
    from trainpilot.specs import SpecError

    if job is None:
        raise SpecError("--compare", True, "needs --job (checkpoint costs come from its model)")
    costs = CheckpointCosts(params=count_params(job.model).total, num_nodes=avail.num_nodes,
                            devices_per_node=avail.devices_per_node)
    rows = compare(avail, failures, standard_policies(costs), num_trials=args.trials,
                   seed=args.seed)
    if args.json:
        print_json([dict(policy=p.name, checkpoint=p.checkpoint.to_dict(),
                         recovery=p.recovery.to_dict(), monte_carlo=mc.to_dict(),
                         closed_form=cf.to_dict() if cf else None) for p, mc, cf in rows])
        return 0
    table = Table(title="recovery policies, each at its optimal interval", title_justify="left")
    for col in ("policy", "interval", "ETTR (95% CI)", "closed form", "lost h", "down h",
                "spare wait h"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for p, mc, cf in rows:
        b = mc.badput_h
        table.add_row(p.name, f"{p.checkpoint.interval_min:.1f} min",
                      f"{mc.ettr:.4f} ({mc.ettr_ci95[0]:.4f}-{mc.ettr_ci95[1]:.4f})",
                      f"{cf.ettr:.4f}" if cf else "-", f"{b['lost_progress']:.1f}",
                      f"{b['detection'] + b['restart'] + b['restore']:.1f}",
                      f"{b['spare_wait']:.1f}")
    console.print(table)
    return 0


# ------------------------------------------------------------------ scaling


def run_scaling(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from trainpilot.sim.availability import CheckpointSpec, RecoverySpec
    from trainpilot.sim.failures import llama3_mix
    from trainpilot.sim.scaling import CostInputs, planner_or_fallback, scaling_table
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
