"""``trainpilot simulate serve``: Sim2Infer on the model, cluster and serving-plan documents."""

from __future__ import annotations

import argparse

from trainpilot.cli.common import add_json_arg, console, print_json


def register_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model preset, YAML/JSON file, or Hugging Face config.json")
    p.add_argument("--cluster", help="cluster preset or YAML/JSON file")
    p.add_argument("--plan", help="serving plan: preset (deepseek-v3-pd-ep144, ...), YAML/JSON "
                                  "file, or inline 'decode.tp=8,input_len=1000,output_len=500'")
    g = p.add_argument_group("plan overrides")
    for flag, kind, text in (("--tp", int, "decode instance: tensor parallel size"),
                             ("--dp-attention", int, "decode instance: attention DP groups"),
                             ("--ep", int, "decode instance: expert parallel groups"),
                             ("--input-len", int, "prompt tokens"),
                             ("--output-len", int, "generated tokens"),
                             ("--batch-size", int, "sequences per decode instance (default: "
                                                   "the largest that fits)"),
                             ("--mtp", int, "speculative draft tokens per step (0: off)"),
                             ("--acceptance", float, "acceptance of each draft token")):
        g.add_argument(flag, type=kind, help=text)
    g.add_argument("--weight-dtype", choices=["bf16", "fp16", "fp8", "fp4"])
    g.add_argument("--kv-dtype", choices=["bf16", "fp16", "fp8"])
    g.add_argument("--batching", choices=["static", "continuous", "unmixed"],
                   help="static: prefill a batch, decode it to the end; continuous: prompt "
                        "tokens mixed into decode passes (chunked prefill); unmixed: prompts "
                        "prefilled in passes of their own (vLLM V0 without chunked prefill, "
                        "SGLang 0.4)")
    g.add_argument("--quantized-modules", choices=["all", "mlp"],
                   help="linear maps the weight dtype covers (mlp: Meta's Llama 3.1 FP8 "
                        "checkpoints, attention in 16-bit)")
    g.add_argument("--unquantized-end-layers", type=int, metavar="N",
                   help="decoder layers at each end left 16-bit (Meta's FP8: 1)")
    g.add_argument("--kv-mem-basis", choices=["free", "total"],
                   help="kv_mem_fraction of the memory left after the weights (TensorRT-LLM) "
                        "or of the whole device (vLLM's gpu_memory_utilization)")
    g.add_argument("--profile-tokens", type=int, metavar="N",
                   help="tokens of the pass whose activations the engine reserves before "
                        "sizing its cache (vLLM: max_num_batched_tokens)")
    g.add_argument("--kv-admission", choices=["full", "current"],
                   help="admit a sequence when its whole length fits (full) or on the blocks "
                        "it holds (current: vLLM, SGLang)")
    g = p.add_argument_group("model efficiency and validation")
    g.add_argument("--uncalibrated", action="store_true",
                   help="use the physics defaults instead of the calibrated efficiency")
    g.add_argument("--validate", action="store_true",
                   help="predict every published serving measurement bundled with trainpilot "
                        "and print the error per source (held-out target 15%%, a gate per "
                        "held-out batch; exit 1 past one)")
    g.add_argument("--calibrate", action="store_true",
                   help="refit the efficiency on the calibration sources only and print it")
    add_json_arg(p)


def _plan(args: argparse.Namespace):
    from trainpilot.specs import SpecError
    from trainpilot.specs.serve import load_serve_plan

    if not args.plan:
        raise SpecError("--plan", None, "give a serving plan (preset, file or inline)")
    over: dict = {}
    decode = {k: v for k, v in (("tp", args.tp), ("dp_attention", args.dp_attention),
                                ("ep", args.ep)) if v is not None}
    if decode:
        over["decode"] = decode
    for key in ("input_len", "output_len", "batch_size", "weight_dtype", "kv_dtype",
                "batching", "quantized_modules", "unquantized_end_layers", "kv_mem_basis",
                "profile_tokens", "kv_admission"):
        if getattr(args, key) is not None:
            over[key] = getattr(args, key)
    spec = {k: v for k, v in (("num_draft_tokens", args.mtp), ("acceptance", args.acceptance))
            if v is not None}
    if spec:
        over["speculative"] = spec
    return load_serve_plan(args.plan, **over)


def run(args: argparse.Namespace) -> int:
    from trainpilot.perf.serve import ServeEfficiency
    from trainpilot.sim.serve import deployment_summary, simulate_serve
    from trainpilot.sim.serve_validation import calibrate, calibrated_efficiency
    from trainpilot.specs import SpecError, load_cluster, load_model

    if args.calibrate:
        from trainpilot.sim.serve_validation import host_step_fits
        from trainpilot.specs.serve import RUNTIME_PRESETS

        eff, mape = calibrate()
        host = host_step_fits(eff)
        out = dict(fitted={k: getattr(eff, k) for k in _fitted_names()},
                   calibration_mean_abs_error=mape, host_step_ms=host)
        print_json(out) if args.json else console.print(
            f"fitted on the calibration sources only: {out['fitted']}; calibration mean "
            f"|error| {mape:.1%}; host time per pass (ms), each runtime on its own calibration "
            "rows: " + ", ".join(f"{k} {v:.2f} (preset {RUNTIME_PRESETS[k]['host_step_ms']})"
                                 for k, v in host.items()))
        return 0
    eff = ServeEfficiency() if args.uncalibrated else calibrated_efficiency()
    if args.validate:
        return _run_validate(args, eff)
    if not (args.model and args.cluster):
        raise SpecError("--model/--cluster", None, "give a model and a cluster (or --validate)")
    model, cluster, plan = load_model(args.model), load_cluster(args.cluster), _plan(args)
    report = simulate_serve(model, cluster, plan, eff)
    totals = deployment_summary(report, plan)
    if args.json:
        print_json(dict(report.to_dict(), deployment=totals, plan=plan.to_dict()))
        return 0
    _print_report(model, cluster, plan, report, totals)
    return 0


def _fitted_names():
    from trainpilot.sim.serve_validation import FITTED

    return list(FITTED)


def _print_report(model, cluster, plan, report, totals) -> None:
    from rich.table import Table

    layout = plan.decode.label() + (f"; prefill {plan.prefill.label()}" if plan.prefill else "")
    table = Table(title=f"serving {model.name} on {cluster.device.name}: decode {layout}, "
                        f"{plan.input_len} in / {plan.output_len} out", title_justify="left",
                  show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("TTFT", f"{report.ttft_s * 1e3:,.1f} ms"),
        ("TPOT (inter-token latency)", f"{report.tpot_s * 1e3:,.2f} ms"),
        ("output tokens/s per device", f"{report.output_tokens_per_s_per_device:,.0f}"),
        ("output tokens/s per decode instance", f"{report.output_tokens_per_s_per_instance:,.0f}"),
        ("input tokens/s per prefill device", f"{report.input_tokens_per_s_per_device:,.0f}"),
        ("batch (sequences per instance)", f"{report.batch_size:,}"),
        ("largest batch that fits", f"{report.largest_batch:,}"),
        ("KV cache per attention group", f"{report.kv_capacity_tokens:,.0f} tokens"),
        ("weights per device", f"{report.weights_gib_per_device:,.1f} GiB"),
        ("deployment: devices / output tokens/s", f"{totals['devices']:,} / "
                                                  f"{totals['output_tokens_per_s']:,.0f}"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    phases = Table(title="per pass: time by bound (ms); the largest is the roofline reason",
                   title_justify="left")
    cats = list(next(iter(report.phases.values())).seconds)
    for col in ("phase", "total", "reason", *cats):
        phases.add_column(col.replace("_", " "), justify="left" if col == "phase" else "right")
    for name, cost in report.phases.items():
        phases.add_row(name, f"{cost.total_s * 1e3:.2f}", cost.reason.replace("_", " "),
                       *(f"{cost.seconds[c] * 1e3:.2f}" for c in cats))
    console.print(phases)
    for note in report.notes:
        console.print(f"- {note}")


def _run_validate(args, eff) -> int:
    from rich.table import Table

    from trainpilot.sim.serve_validation import batches_line, gates_line, validate_serving

    out = validate_serving(eff)
    s = out["summary"]
    if args.json:
        print_json(out)
        return 0 if s["passed"] else 1
    table = Table(title="Sim2Infer against published serving measurements", title_justify="left",
                  caption="speed bias: mean of predicted / measured speed - 1 (+: optimistic; "
                          "TTFT and TPOT count inverted)", caption_justify="left")
    for col in ("source", "split", "batch", "rows", "mean |error|", "max |error|",
                "speed bias"):
        table.add_column(col, justify="left" if col in ("source", "split") else "right")

    def add(label: str, split: str, batch: str, row: dict) -> None:
        table.add_row(label, split, batch, str(row["rows"]), f"{row['mean_abs_error']:.1%}",
                      f"{row['max_abs_error']:.1%}", f"{row['bias']:+.1%}")

    for name, row in s["sources"].items():
        add(name, row["split"], str(row["batch"]), row)
    for batch, row in s["held_out_batches"].items():
        add(f"held_out, batch {batch} ({row['num_sources']} sources)", "held_out", str(batch),
            row)
    for split in ("calibration", "held_out"):
        row = s[split]
        add(f"all {split} ({row['num_sources']} sources)", split, "", row)
    console.print(table)
    rows = Table(title="held-out rows", title_justify="left")
    for col in ("source", "batch", "case", "runtime", "metric", "measured", "predicted",
                "error", "bound"):
        rows.add_column(col, justify="right" if col in ("measured", "predicted", "error")
                        else "left")
    for r in out["rows"]:
        if r["split"] == "held_out":
            rows.add_row(r["source"], str(r["batch"]), r["id"], r["runtime"], r["metric"],
                         f"{r['measured']:,.1f}",
                         f"{r['predicted']:,.1f}", f"{r['error']:+.1%}",
                         ", ".join(f"{k}: {v}" for k, v in r["reasons"].items()))
    console.print(rows)
    console.print(f"held-out mean |error| {s['held_out']['mean_abs_error']:.1%} over "
                  f"{s['held_out']['rows']} rows from {s['held_out']['num_sources']} sources "
                  f"({batches_line(s)}); target <= {s['target']:.0%}: {'met' if s['target_met'] else 'MISSED'}; "
                  f"gates: {gates_line(s)}")
    return 0 if s["passed"] else 1


def register_availability_arguments(g) -> None:
    """The ``simulate availability --serve`` flags (added to the availability verb)."""
    g.add_argument("--serve", action="store_true",
                   help="serving instead of training: instances that fail whole, the remedy "
                        "ladder, EP sizes side by side (needs --model, --cluster, --plan)")
    g.add_argument("--model", help="with --serve: model preset or file")
    g.add_argument("--cluster", help="with --serve: the decode devices (preset or file)")
    g.add_argument("--plan", help="with --serve: serving plan (lengths, dtypes, MTP)")
    g.add_argument("--ep-sizes", default="16,32,72,144",
                   help="with --serve: comma-separated EP sizes to compare")
    g.add_argument("--load", type=float, default=0.8,
                   help="with --serve: demand as a share of the nominal throughput")
    g.add_argument("--slo-stall-s", type=float, default=10.0,
                   help="with --serve: a request stalled longer misses its SLO")


def run_availability(args: argparse.Namespace) -> int:
    from rich.table import Table

    from trainpilot.sim.failures import llama3_mix
    from trainpilot.sim.serve_availability import compare_ep_sizes
    from trainpilot.sim.serve_validation import calibrated_efficiency
    from trainpilot.specs import SpecError, load_cluster, load_model
    from trainpilot.specs.serve import load_serve_plan

    if not (args.model and args.cluster and args.plan):
        raise SpecError("--serve", True, "needs --model, --cluster and --plan")
    try:
        sizes = [int(x) for x in args.ep_sizes.split(",") if x.strip()]
    except ValueError:
        raise SpecError("--ep-sizes", args.ep_sizes, "valid: comma-separated integers") from None
    if not 0 < args.load <= 1:
        raise SpecError("--load", args.load, "valid: (0, 1]")
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    plan = load_serve_plan(args.plan)
    days = args.days if args.days is not None else 30.0
    rows = compare_ep_sizes(model, cluster, plan, sizes, llama3_mix(), load=args.load,
                            duration_h=days * 24, num_trials=args.trials if args.trials != 1000
                            else 200, seed=args.seed, eff=calibrated_efficiency())
    if args.json:
        print_json([dict(ep=r.ep, deployment=r.deployment.to_dict(),
                         remedies=[dict(remedy=m.to_dict(), closed_form=cf.to_dict(),
                                        monte_carlo=mc.to_dict()) for m, cf, mc in r.results])
                    for r in rows])
        return 0
    table = Table(title=f"serving {model.name} on {cluster.num_devices} x {cluster.device.name}"
                        f", load {args.load:.0%}, {days:g} days, Llama 3 failure mix per node",
                  title_justify="left")
    for col in ("EP", "inst", "tok/s", "remedy", "down min/d MC", "95%", "CF", "unserved ppm",
                "fail/d", "lost/d", "retried/d", "SLO miss ppm"):
        table.add_column(col, justify="left" if col == "remedy" else "right", no_wrap=True)
    for r in rows:
        d = r.deployment
        for i, (rem, cf, mc) in enumerate(r.results):
            # monte_carlo() always sets the interval; only closed_form() leaves it None
            assert mc.availability_ci95 is not None
            lo, hi = mc.availability_ci95
            table.add_row(str(r.ep) if i == 0 else "", str(d.num_instances) if i == 0 else "",
                          f"{d.num_instances * d.tokens_per_s_per_instance:,.0f}" if i == 0
                          else "", rem.name,
                          f"{(1 - mc.availability) * 1440:.2f}",
                          f"{(1 - hi) * 1440:.2f}-{(1 - lo) * 1440:.2f}",
                          f"{(1 - cf.availability) * 1440:.2f}",
                          f"{(1 - mc.served_fraction) * 1e6:,.0f}", f"{mc.failures_per_day:.2f}",
                          f"{cf.requests_lost_per_day:,.0f}",
                          f"{cf.requests_retried_per_day:,.0f}",
                          f"{(1 - cf.slo_attainment) * 1e6:,.0f}")
    console.print(table)
    console.print("down min/d: (1 - mean capacity / nominal) x 1,440, Monte-Carlo with its 95% "
                  "interval, CF: closed form; unserved: tokens demanded but not served, per "
                  "million; lost/retried: requests in flight at a failure (batch x load); SLO "
                  "miss: requests queued past capacity, stalled > "
                  f"{args.slo_stall_s:g} s or lost, per million. Remedy costs: docs/simulators.md"
                  " (the issue's figures).")
    return 0
