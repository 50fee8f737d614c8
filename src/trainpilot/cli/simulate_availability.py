"""``trainpilot simulate availability``: arguments, resolution of every cost, output.

Every recovery and checkpoint value has one of three sources: the user's flag ("set"), a named
scenario (``--scenario``), or the generic default; all of them are printed under the result
(``--explain`` adds a table with the badput each one produced), so nothing is added unseen.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from trainpilot.cli.common import add_json_arg, console, print_json

# Generic defaults of the checkpoint and recovery flags (field, flag default, help).
CHECKPOINT_DEFAULTS = (("interval_min", 30.0, "compute minutes between saves"),
                       ("stall_s", 10.0, "blocking time per save"),
                       ("durable_s", 120.0, "after the stall, until the storage copy lands"),
                       ("peer_durable_s", 5.0, "after the stall, until the peer copy lands"),
                       ("storage_every", 10, "with --peer: every n-th save goes to storage"))
RECOVERY_DEFAULTS = (("detect_s", 60.0, "detection"),
                     ("restart_s", 300.0, "restart / re-rendezvous"),
                     ("restore_storage_s", 300.0, "restore from storage"),
                     ("restore_peer_s", 30.0, "restore from a peer"),
                     ("replace_s", 1800.0, "cold node replacement (hardware classes, no spare)"),
                     ("repair_h", 72.0, "hours until a failed node is back"),
                     ("retry_fraction", 0.0, "share of transient faults absorbed"),
                     ("retry_s", 30.0, "pause per absorbed fault"),
                     ("num_spares", 0, "hot spare nodes"))
_FLAG = {"num_spares": "--spares"}


def flag_of(field: str) -> str:
    return _FLAG.get(field, "--" + field.replace("_", "-"))


def register_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", help="job preset or file: nodes from its cluster, and with --compare "
                                 "checkpoint costs from its model")
    p.add_argument("--scenario", help="a published job with its failures and recovery settings "
                                      "(llama3-405b, kokolis-rsc1); flags override its values")
    p.add_argument("--nodes", type=int, help="nodes in the job (default: the job's)")
    p.add_argument("--devices-per-node", type=int, default=None, help="default 8")
    p.add_argument("--days", type=float, default=None, help="wall-clock days (default 30)")
    p.add_argument("--work-days", type=float,
                   help="failure-free days of training to finish instead: simulates about the "
                        "wall time they need and reports the expected wall days (work / ETTR)")
    g = p.add_argument_group("failures")
    g.add_argument("--mtbf-h", type=float, help="one failure class with this job MTBF (hours) "
                                                "instead of the Llama 3 mix (hardware: every "
                                                "failure needs a node swap)")
    g.add_argument("--weibull-shape", type=float, help="Weibull inter-arrivals of this shape")
    g.add_argument("--weibull-start", choices=["stationary", "new"], default="stationary",
                   help="Weibull nodes in service at t=0, or all new (burn-in)")
    g.add_argument("--lemons", type=int, default=0, help="lemon nodes")
    g.add_argument("--lemon-multiplier", type=float, default=10.0)
    g.add_argument("--quarantine-lemons", action="store_true")
    g.add_argument("--correlated", type=float, default=0.0,
                   help="share of hardware failures that take down several nodes")
    g.add_argument("--correlated-nodes", type=int, default=4)
    g = p.add_argument_group("checkpoints (defaults: the generic values, printed with the result)")
    for field, default, text in CHECKPOINT_DEFAULTS:
        g.add_argument(flag_of(field), type=type(default), default=None,
                       help=f"{text} (default {default:g})")
    g.add_argument("--peer", action="store_true", help="also keep copies in peers' memory")
    g = p.add_argument_group("recovery (defaults: the generic values, printed with the result)")
    for field, default, text in RECOVERY_DEFAULTS:
        g.add_argument(flag_of(field), type=type(default), default=None,
                       help=f"{text} (default {default:g})")
    g = p.add_argument_group("engines and output")
    g.add_argument("--trials", type=int, default=1000,
                   help="Monte-Carlo runs (1000; with --serve the default is 200)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--compare", action="store_true",
                   help="compare restart from storage / peer checkpoints / hot spares, each at "
                        "its best interval (or at --interval-min, if the storage sustains it)")
    g.add_argument("--storage-write", choices=["blocking", "async"], default="blocking",
                   help="with --compare: the storage policy's saves block for the write, or "
                        "only for the snapshot")
    g.add_argument("--explain", action="store_true",
                   help="a table of every cost added: value, source, badput it caused")
    from trainpilot.cli.simulate_serve import register_availability_arguments

    register_availability_arguments(p.add_argument_group("serving (--serve)"))
    add_json_arg(p)


def _failure_model(args: argparse.Namespace, num_nodes: int, scenario):
    import pydantic

    from trainpilot.sim.failures import FailureModel, llama3_mix, single_mtbf
    from trainpilot.specs.errors import from_pydantic

    extra: dict[str, Any] = dict(
        num_lemon_nodes=args.lemons, lemon_multiplier=args.lemon_multiplier,
        quarantine_lemons=args.quarantine_lemons, correlated_fraction=args.correlated,
        correlated_nodes=args.correlated_nodes)
    if args.weibull_shape is not None:
        extra.update(distribution="weibull", weibull_shape=args.weibull_shape,
                     weibull_start=args.weibull_start)
    try:
        if args.mtbf_h is not None:
            return single_mtbf(mtbf_h=args.mtbf_h, num_nodes=num_nodes, needs_replacement=True,
                               **extra)
        if scenario is not None:
            return scenario.failures.replace(**extra)
        return llama3_mix(**extra)
    except pydantic.ValidationError as err:
        raise from_pydantic(err, doc="failures", model_cls=FailureModel) from None


def resolve(args: argparse.Namespace, scenario) -> tuple[dict, dict, dict[str, str]]:
    """(checkpoint fields, recovery fields, field -> source) from flags, scenario, defaults."""
    sources: dict[str, str] = {}

    def pick(field, default, base):
        value = getattr(args, field, None)
        if value is not None:
            sources[field] = "set"
            return value
        if base is not None:
            sources[field] = f"scenario {scenario.name}"
            return getattr(base, field)
        sources[field] = "default"
        return default

    ckpt = {f: pick(f, d, scenario and scenario.checkpoint) for f, d, _ in CHECKPOINT_DEFAULTS}
    ckpt["in_memory_peer"] = bool(args.peer or (scenario and scenario.checkpoint.in_memory_peer))
    rec = {f: pick(f, d, scenario and scenario.recovery) for f, d, _ in RECOVERY_DEFAULTS}
    return ckpt, rec, sources


def run(args: argparse.Namespace) -> int:
    from trainpilot.sim.availability import AvailabilityJob, CheckpointSpec, RecoverySpec
    from trainpilot.sim.engines import run_engines
    from trainpilot.sim.explain import cost_lines, explain_rows, summary
    from trainpilot.sim.scenarios import scenario as load_scenario
    from trainpilot.specs import SpecError, load_job
    from trainpilot.specs.loading import validate

    if args.serve:
        from trainpilot.cli.simulate_serve import run_availability

        return run_availability(args)
    job = load_job(args.job) if args.job else None
    sc = load_scenario(args.scenario) if args.scenario else None
    nodes = args.nodes or (job.cluster.num_nodes if job else None) or (
        sc.job.num_nodes if sc else None)
    if nodes is None:
        raise SpecError("--nodes", None, "give --nodes, --job or --scenario")
    per_node = args.devices_per_node or (job.cluster.devices_per_node if job else None) or (
        sc.job.devices_per_node if sc else 8)
    days = args.days if args.days is not None else (sc.job.duration_h / 24 if sc else 30.0)
    avail = validate(AvailabilityJob, dict(num_nodes=nodes, devices_per_node=per_node,
                                           duration_h=days * 24.0), doc="job")
    if args.trials < 2:
        raise SpecError("--trials", args.trials, "valid: at least 2")
    failures = _failure_model(args, nodes, sc)
    if args.compare:
        return _run_compare(args, job, avail, failures)
    ckpt_fields, rec_fields, sources = resolve(args, sc)
    ckpt = validate(CheckpointSpec, ckpt_fields, doc="checkpoint")
    rec = validate(RecoverySpec, rec_fields, doc="recovery")
    if args.work_days is not None:
        avail = _horizon_for_work(args.work_days, avail, failures, ckpt, rec)
    status = console.status("Monte-Carlo...") if not args.json else contextlib.nullcontext()
    with status:
        mc, cf = run_engines(avail, failures, ckpt, rec, num_trials=args.trials, seed=args.seed)
    lines = cost_lines(failures, ckpt, rec, sources=sources)
    if args.json:
        out = mc.to_dict()
        out["closed_form"] = cf.to_dict() if cf else None
        out["costs"] = explain_rows(lines, mc)
        if sc is not None:
            out["scenario"] = _scenario_dict(sc, mc)
        if args.work_days is not None:
            out.update(work_days=args.work_days, expected_wall_days=args.work_days / mc.ettr)
        print_json(out)
        return 0
    _print_result(avail, mc, cf)
    console.print(summary(lines), soft_wrap=True)
    if args.explain:
        _print_explain(explain_rows(lines, mc))
    if sc is not None:
        _print_scenario(sc, mc)
    if args.work_days is not None:
        console.print(f"{args.work_days:g} failure-free days of training take "
                      f"{args.work_days / mc.ettr:.1f} wall days (work / ETTR)")
    return 0


def _scenario_dict(sc, mc) -> dict:
    from trainpilot.sim.scenarios import breakeven_restart_s

    return dict(name=sc.name, source=sc.source, published_ettr=sc.published_ettr,
                published_at_least=sc.published_at_least, assumptions=list(sc.assumptions),
                breakeven_restart_s=breakeven_restart_s(sc), simulated_ettr=mc.ettr)


def _print_scenario(sc, mc) -> None:
    d = _scenario_dict(sc, mc)
    rel = ">" if sc.published_at_least else "="
    console.print(f"scenario {sc.name}: {sc.source}; published ETTR {rel} {sc.published_ettr:.2f}"
                  f", simulated {mc.ettr:.4f}")
    if sc.published_at_least:
        console.print(f"  ETTR stays above {sc.published_ettr:.2f} while the restart takes under "
                      f"{d['breakeven_restart_s'] / 60:.1f} min (the other costs as below)")
    for note in sc.assumptions:
        console.print(f"  assumed: {note}")


def _print_explain(rows: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="every cost the simulation added (--explain)", title_justify="left")
    for col in ("cost", "flag", "value", "per", "applies to", "source", "badput h", "of wall"):
        table.add_column(col, justify="right" if col in ("value", "badput h", "of wall")
                         else "left")
    for r in rows:
        value = "-" if r["value_s"] is None else f"{r['value_s']:g} s"
        share = "" if r["share"] >= 0.999 else f" ({r['share']:.0%})"
        hours = "-" if r["badput_h"] is None else f"{r['badput_h']:.1f}"
        wall = "-" if r["wall_share"] is None else f"{r['wall_share']:.2%}"
        table.add_row(r["cost"], r["flag"], value, r["per"] + share, r["applies_to"],
                      r["source"], hours, wall)
    console.print(table)


def _horizon_for_work(work_days: float, avail, failures, ckpt, rec):
    """The job resized to the wall time ``work_days`` of training needs, estimated with the
    closed form (for Weibull: its exponential counterpart of the same mean rate)."""
    from trainpilot.sim.availability import closed_form_ettr
    from trainpilot.specs import SpecError

    if work_days <= 0:
        raise SpecError("--work-days", work_days, "valid: a positive number of days")
    ettr, _ = closed_form_ettr(avail, failures.replace(distribution="exponential"), ckpt, rec)
    return avail.replace(duration_h=work_days * 24.0 / max(ettr, 1e-3))


def _print_result(avail, mc, cf) -> None:
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
                            devices_per_node=avail.devices_per_node,
                            storage_write=args.storage_write)
    rows = compare(avail, failures, standard_policies(costs), num_trials=args.trials,
                   seed=args.seed, costs=costs, interval_min=args.interval_min)
    if args.json:
        print_json([dict(policy=p.name, checkpoint=p.checkpoint.to_dict(),
                         recovery=p.recovery.to_dict(), monte_carlo=mc.to_dict(),
                         closed_form=cf.to_dict() if cf else None,
                         storage_gbytes_per_s_needed=costs.needed_gbytes_per_s(p.checkpoint))
                    for p, mc, cf in rows])
        return 0
    title = (f"recovery policies, each at {'its optimal' if args.interval_min is None else 'the'}"
             f" interval; checkpoint {costs.total_bytes / 1e12:.3g} TB, storage "
             f"{costs.storage_gbytes_per_s:g} GB/s")
    table = Table(title=title, title_justify="left")
    for col in ("policy", "interval", "stall/save", "storage GB/s", "ETTR (95% CI)",
                "closed form", "lost h", "down h", "spare wait h"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for p, mc, cf in rows:
        b = mc.badput_h
        table.add_row(p.name, f"{p.checkpoint.interval_min:.1f} min",
                      f"{p.checkpoint.stall_s:.3g} s",
                      f"{costs.needed_gbytes_per_s(p.checkpoint):.1f}",
                      f"{mc.ettr:.4f} ({mc.ettr_ci95[0]:.4f}-{mc.ettr_ci95[1]:.4f})",
                      f"{cf.ettr:.4f}" if cf else "-", f"{b['lost_progress']:.1f}",
                      f"{b['detection'] + b['restart'] + b['restore']:.1f}",
                      f"{b['spare_wait']:.1f}")
    console.print(table)
    rec = rows[0][0].recovery
    console.print(f"every policy: detection {rec.detect_s:g} s, restart {rec.restart_s:g} s, "
                  f"cold replacement {rec.replace_s:g} s per hardware failure without a spare; "
                  f"storage GB/s: the saves' average write bandwidth (a blocking save writes "
                  f"inside its stall, at the storage's {costs.storage_gbytes_per_s:g} GB/s)")
    return 0
