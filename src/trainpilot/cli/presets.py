"""``trainpilot presets``: list the model, device, cluster and job presets."""

from __future__ import annotations

import argparse

from rich.table import Table

from trainpilot.cli.common import add_json_arg, add_verb, console, human, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "presets", help="list model, device, cluster and job presets",
        description="List the presets every --model/--cluster/--job argument accepts.",
        examples="  trainpilot presets\n  trainpilot presets --kind model --json",
    )
    parser.add_argument("--kind", choices=["model", "device", "cluster", "job"],
                        help="only this kind")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def collect() -> dict[str, list[dict]]:
    from trainpilot.perf.flops import count_params
    from trainpilot.specs import load_model, presets

    models = []
    for name in presets.MODELS:
        model = load_model(name)
        counts = count_params(model)
        models.append(dict(name=name, layers=model.num_hidden_layers, hidden=model.hidden_size,
                           params=counts.total, active_params=counts.active,
                           moe=model.is_moe))
    devices = [dict(name=n, bf16_tflops=d["peak_tflops"].get("bf16"), hbm_gib=d["hbm_gib"])
               for n, d in presets.DEVICES.items()]
    clusters = [dict(name=n, device=d, devices=c) for n, (d, c) in presets.NAMED_CLUSTERS.items()]
    clusters += [dict(name=n, pattern="<device>-x<N>") for n in presets.EXAMPLE_CLUSTERS]
    jobs = [dict(name=n, model=j["model"], cluster=j["cluster"]) for n, j in presets.JOBS.items()]
    return dict(model=models, device=devices, cluster=clusters, job=jobs)


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.kind:
        data = {args.kind: data[args.kind]}
    if args.json:
        print_json(data)
        return 0
    for kind, rows in data.items():
        table = Table(title=f"{kind} presets", title_justify="left")
        for key in rows[0]:
            table.add_column(key)
        for row in rows:
            cells = [human(v) if k.endswith("params") else str(v) for k, v in row.items()]
            table.add_row(*cells)
        console.print(table)
    if not args.kind:
        console.print("Clusters also take any '<device>-x<N>' (e.g. h100-sxm-x4096).")
    return 0
