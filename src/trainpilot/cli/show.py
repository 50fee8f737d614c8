"""``trainpilot show``: load, validate and summarise documents (a job or model/cluster/plan)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from trainpilot.cli.common import add_doc_args, add_json_arg, add_verb, console, human, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "show", help="validate documents and print their summary",
        description="Load a job (or a model, optionally with a cluster and plan), check every "
                    "rule, and print parameters, active parameters and model FLOPs per token.",
        examples="  trainpilot show --job gpt3-175b-a100-1024\n"
                 "  trainpilot show --model path/to/config.json --json\n"
                 "  trainpilot show --model llama3-70b --cluster h100-sxm-x64 "
                 "--plan tp=8,pp=4,dp=2,global_batch_size=64,seq_len=8192\n"
                 "  trainpilot show --model mixtral-8x7b --dump   # the resolved YAML",
    )
    parser.add_argument("--job", help="job preset or YAML/JSON file")
    add_doc_args(parser, required=False)
    parser.add_argument("--seq-len", type=int, default=None,
                        help="sequence length for FLOPs when no plan is given (default 2048)")
    parser.add_argument("--dump", action="store_true", help="print the resolved documents as YAML")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def summarize(model, cluster=None, plan=None, *, seq_len: int = 2048, name: str | None = None,
              total_tokens: int | None = None) -> dict[str, Any]:
    """Parameters, active parameters and model FLOPs per token of a model (and its job)."""
    from trainpilot.perf.flops import count_params, model_flops_per_token

    counts = count_params(model)
    seq = plan.seq_len if plan else seq_len
    flops_per_token = model_flops_per_token(model, seq)
    out: dict[str, Any] = dict(
        job=name, model=model.name, params=counts.total, active_params=counts.active,
        seq_len=seq, model_flops_per_token=flops_per_token,
        six_n_flops_per_token=6.0 * counts.active,
    )
    if cluster is not None:
        out.update(cluster=cluster.name, devices=cluster.num_devices, device=cluster.device.name)
    if plan is not None:
        out.update(layout=dict(tp=plan.tp, pp=plan.pp, dp=plan.dp, ep=plan.ep, cp=plan.cp,
                               vp=plan.vp, zero=plan.zero),
                   tokens_per_step=plan.tokens_per_step,
                   model_flops_per_step=flops_per_token * plan.tokens_per_step)
    if total_tokens:
        out.update(total_tokens=total_tokens, total_model_flops=flops_per_token * total_tokens)
    return out


def print_summary(info: dict[str, Any]) -> None:
    table = Table(show_header=False, title=info.get("job") or info["model"], title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows = [("model", info["model"]), ("parameters", human(info["params"])),
            ("active parameters", human(info["active_params"])),
            (f"model FLOPs / token (s={info['seq_len']})", f"{info['model_flops_per_token']:.4g}"),
            ("  6 x active params", f"{info['six_n_flops_per_token']:.4g}")]
    if "cluster" in info:
        rows.append(("cluster", f"{info['cluster']} ({info['devices']} x {info['device']})"))
    if "layout" in info:
        rows.append(("layout", " ".join(f"{k}={v}" for k, v in info["layout"].items())))
        rows.append(("tokens / step", human(info["tokens_per_step"])))
        rows.append(("model FLOPs / step", f"{info['model_flops_per_step']:.4g}"))
    if "total_tokens" in info:
        rows.append(("training tokens", human(info["total_tokens"])))
        rows.append(("total model FLOPs", f"{info['total_model_flops']:.4g}"))
    for key, value in rows:
        table.add_row(key, str(value))
    console.print(table)


def run(args: argparse.Namespace) -> int:
    from trainpilot.specs import (
        ClusterSpec,
        Plan,
        SpecError,
        check_job,
        dump,
        load_cluster,
        load_job,
        load_model,
        load_plan,
    )

    cluster: ClusterSpec | None
    plan: Plan | None
    if args.job:
        job = load_job(args.job)
        model, cluster, plan = job.model, job.cluster, job.plan
        name, tokens = job.name, job.total_tokens
    elif args.model:
        model = load_model(args.model)
        cluster = load_cluster(args.cluster) if args.cluster else None
        plan = load_plan(args.plan) if args.plan else None
        if plan is not None:
            check_job(model, cluster, plan)
        name, tokens = None, None
    else:
        raise SpecError("--job/--model", None, "give a job, or at least a model")
    if args.dump:
        for doc in (model, cluster, plan):
            if doc is not None:
                console.print(dump(doc), end="", markup=False)
                console.print("---", markup=False)
        return 0
    info = summarize(model, cluster, plan, seq_len=args.seq_len or 2048, name=name,
                     total_tokens=tokens)
    if args.json:
        print_json(info)
    else:
        print_summary(info)
    return 0
