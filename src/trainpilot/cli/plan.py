"""``trainpilot plan``: search every layout, rank by predicted tokens/s, export the best."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainpilot.cli.common import (
    EXIT_FAILURE,
    add_doc_args,
    add_json_arg,
    add_verb,
    console,
    print_json,
)


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "plan", help="find the fastest layouts that fit, and export one",
        description="Enumerate every valid (tp, pp, vp, dp, ep, cp, ZeRO, micro-batch, "
                    "recompute, sequence parallel) layout of the model on the whole cluster, "
                    "including uneven first/last pipeline stages; prune by memory and by a "
                    "lower bound on step time; rank the plans that fit (with headroom) by "
                    "predicted tokens/s; say why the best beats the runner-up. When nothing "
                    "fits, print the smallest memory shortfall and what would help, exit 1.",
        examples="  trainpilot plan --model gpt3-175b --cluster a100-80gb-x1024 "
                 "--global-batch-size 1536 --seq-len 2048\n"
                 "  trainpilot plan --model deepseek-v3 --cluster h800-x2048 "
                 "--global-batch-size 15360 --seq-len 4096 --top 3 --json\n"
                 "  trainpilot plan --model llama3-70b --cluster h100-sxm-x64 "
                 "--global-batch-size 64 --seq-len 8192 --export megatron\n"
                 "  trainpilot plan --model llama3-8b --cluster h100-sxm-x16 "
                 "--global-batch-size 128 --seq-len 8192 --export slurm --output train.sbatch\n"
                 "  trainpilot plan --model llama3-8b --cluster h100-sxm-x16 "
                 "--global-batch-size 128 --seq-len 8192 --export deepspeed --pick 2",
    )
    add_doc_args(parser, plan=False)
    parser.add_argument("--global-batch-size", type=int, required=True,
                        help="sequences per optimizer step")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--top", type=int, default=5, help="plans to return (default 5)")
    parser.add_argument("--headroom", type=float, default=0.1,
                        help="share of device memory kept free (default 0.1)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp8"],
                        help="training precision (default bf16)")
    parser.add_argument("--fp8-recipe", default=None,
                        choices=["delayed", "current", "mxfp8", "blockwise", "rowwise"],
                        help="with --precision fp8: how FP8 inputs are scaled (default delayed)")
    parser.add_argument("--fp8-param-gather", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="with --precision fp8: all-gather parameters in 8 bits on plans "
                             "that shard them (default: on where the stack caches its FP8 "
                             "weights, as Megatron's --fp8-param-gather)")
    parser.add_argument("--no-flash-attention", action="store_true",
                        help="assume unfused attention (s^2 scores in memory)")
    parser.add_argument("--runtime", default=None, metavar="PROFILE",
                        help="the stack that runs the plans: trainpilot (default), pytorch, "
                             "megatron, megatron-legacy, deepspeed, or inline "
                             "'stack=megatron,tp_comm_overlap=true'")
    for axis in ("tp", "pp", "cp", "ep"):
        parser.add_argument(f"--{axis}", default=None, metavar="N[,N...]",
                            help=f"only these {axis} sizes (comma-separated)")
    parser.add_argument("--no-cp", action="store_true", help="no context parallelism")
    parser.add_argument("--max-tp", type=int, default=None, metavar="N",
                        help="tensor-parallel sizes up to N")
    parser.add_argument("--tp-across-nodes", action="store_true",
                        help="allow TP groups that span nodes (off: TP stays inside a node)")
    parser.add_argument("--max-idle-devices", type=int, default=None, metavar="N",
                        help="devices a plan may leave idle (default: one node when the device "
                             "count has a prime factor above 7, else 0)")
    parser.add_argument("--export",
                        choices=["yaml", "megatron", "torchtitan", "deepspeed", "slurm"],
                        help="print a ranked plan (the best, or --pick N) in this format "
                             "instead of the ranking")
    parser.add_argument("--pick", type=int, default=1, metavar="N",
                        help="with --export: the N-th plan of the ranking (default 1)")
    parser.add_argument("--output", type=Path,
                        help="with --export: write it to this file (atomically)")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainpilot.fsio import atomic_write_text
    from trainpilot.perf import CostOptions
    from trainpilot.plan import search
    from trainpilot.plan.export import export
    from trainpilot.plan.render import print_search
    from trainpilot.specs import SpecError, load_cluster, load_model

    if args.output and not args.export:
        raise SpecError("--output", str(args.output), "needs --export")
    if args.pick != 1 and not args.export:
        raise SpecError("--pick", args.pick, "needs --export")
    if args.pick < 1:
        raise SpecError("--pick", args.pick, "valid: 1 (the best) or more")
    for flag, value in (("--fp8-recipe", args.fp8_recipe),
                        ("--fp8-param-gather", args.fp8_param_gather)):
        if value is not None and args.precision != "fp8":
            raise SpecError(flag, value, f"applies to --precision fp8 only (got "
                                         f"{args.precision})")
    model, cluster = load_model(args.model), load_cluster(args.cluster)
    options = CostOptions(flash_attention=False if args.no_flash_attention else None)
    space, runtime = _space(args), _runtime(args.runtime)
    with console.status(f"searching layouts of {model.name} on {cluster.name}...",
                        spinner="dots") if not args.json else _null():
        result = search(model, cluster, global_batch_size=args.global_batch_size,
                        seq_len=args.seq_len, top=max(args.top, args.pick),
                        headroom=args.headroom, precision=args.precision,
                        fp8_recipe=args.fp8_recipe or "delayed",
                        fp8_param_gather=args.fp8_param_gather, options=options,
                        space=space, runtime=runtime)
    if not result:
        return _no_plan(result, args.json)
    if args.export:
        ranked = list(result)
        if args.pick > len(ranked):
            raise SpecError("--pick", args.pick, f"only {len(ranked)} plans fit; valid: 1 to "
                                                 f"{len(ranked)}")
        chosen = ranked[args.pick - 1]
        text = export(args.export, chosen.plan, model, cluster, chosen.prediction)
        if args.output:
            atomic_write_text(args.output, text)
            console.print(f"wrote plan #{args.pick} ({args.export}) to {args.output}")
        else:
            console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
        return 0
    if args.json:
        print_json(result.to_dict())
        return 0
    print_search(console, result)
    return 0


def _sizes(flag: str, text: str | None) -> tuple[int, ...] | None:
    from trainpilot.specs import SpecError

    if text is None:
        return None
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SpecError(flag, text, "valid: positive integers separated by commas") from None
    if not sizes or any(n < 1 for n in sizes):
        raise SpecError(flag, text, "valid: positive integers separated by commas")
    return sizes


def _space(args: argparse.Namespace):
    from trainpilot.plan import SearchSpace
    from trainpilot.specs import SpecError

    if args.no_cp and args.cp:
        raise SpecError("--no-cp", True, "contradicts --cp; give one of them")
    for flag in ("max_tp", "max_idle_devices"):
        value = getattr(args, flag)
        if value is not None and value < (1 if flag == "max_tp" else 0):
            raise SpecError(f"--{flag.replace('_', '-')}", value, "valid: a positive count")
    return SearchSpace(tp=_sizes("--tp", args.tp), pp=_sizes("--pp", args.pp),
                       cp=_sizes("--cp", args.cp), ep=_sizes("--ep", args.ep),
                       context_parallel=not args.no_cp, max_tp=args.max_tp,
                       tp_across_nodes=args.tp_across_nodes or args.tp is not None,
                       max_idle_devices=args.max_idle_devices)


def _runtime(text: str | None):
    """A RuntimeProfile from a stack name or inline key=value pairs."""
    from trainpilot.specs import RuntimeProfile, parse_inline
    from trainpilot.specs.loading import validate

    if text is None:
        return None
    data = parse_inline(text, doc="runtime") if "=" in text else dict(stack=text)
    return validate(RuntimeProfile, data, doc="runtime")


def _no_plan(result, as_json: bool) -> int:
    if as_json:
        print_json(result.to_dict())
        return EXIT_FAILURE
    from trainpilot.plan.render import stats_line

    short = result.shortfall
    if short is None:
        console.print("[bold red]no layout[/]: no layout of the device count splits this "
                      "model and batch")
    else:
        console.print(f"[bold red]no plan fits[/]: the closest layout needs "
                      f"{short.peak_gib:.1f} GiB per device, {short.short_gib:.1f} GiB over the "
                      f"{short.limit_gib:.1f} GiB allowed ({short.plan})")
        console.print("what would make it fit: " + "; ".join(short.suggestions))
    console.print(stats_line(result), style="dim")
    return EXIT_FAILURE


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
