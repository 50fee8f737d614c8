"""``trainpilot predict``: one plan's step time, throughput, MFU and per-stage memory."""

from __future__ import annotations

import argparse

from trainpilot.cli.common import add_doc_args, add_json_arg, add_verb, console, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "predict", help="predict a plan's step time and memory",
        description="Cost one plan with the analytical model: step time broken down into "
                    "compute, recompute, TP/PP/DP/EP/CP communication, pipeline bubble and "
                    "optimizer; tokens/s, model TFLOP/s per device, MFU/HFU; memory per "
                    "pipeline stage; where each parallel group lies on the cluster. An "
                    "impossible plan names the violated constraint and exits 2.",
        examples="  trainpilot predict --job gpt3-175b-a100-1024\n"
                 "  trainpilot predict --model gpt3-175b --cluster a100-80gb-x1024 "
                 "--plan tp=8,pp=16,dp=8,recompute=full,global_batch_size=1536,seq_len=2048\n"
                 "  trainpilot predict --model llama3-70b --cluster h100-sxm-x64 "
                 "--plan tp=8,pp=4,vp=5,dp=2,sequence_parallel=true,global_batch_size=64,"
                 "seq_len=8192 --json\n"
                 "  trainpilot predict --job llama3-405b-h100-16384 --ranks 16",
    )
    parser.add_argument("--job", help="job preset or file (instead of --model/--cluster/--plan)")
    add_doc_args(parser, required=False)
    parser.add_argument("--ranks", type=int, default=0, metavar="N",
                        help="also print the rank -> (rack, node, device) map of the first N "
                             "ranks")
    parser.add_argument("--no-flash-attention", action="store_true",
                        help="assume unfused attention (s^2 scores in memory), as 2021-22 "
                             "Megatron ran")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def load_documents(args: argparse.Namespace):
    """(model, cluster, plan) from --job or --model/--cluster/--plan."""
    from trainpilot.specs import SpecError, load_cluster, load_job, load_model, load_plan

    if args.job:
        job = load_job(args.job)
        return job.model, job.cluster, job.plan
    missing = [f"--{name}" for name in ("model", "cluster", "plan") if not getattr(args, name)]
    if missing:
        raise SpecError("/".join(missing), None, "give --job, or --model, --cluster and --plan")
    return load_model(args.model), load_cluster(args.cluster), load_plan(args.plan)


def run(args: argparse.Namespace) -> int:
    from trainpilot.perf import CostOptions, predict
    from trainpilot.plan.render import print_prediction
    from trainpilot.specs import SpecError

    if args.ranks < 0:
        raise SpecError("--ranks", args.ranks, "valid: 0 or more")
    model, cluster, plan = load_documents(args)
    options = CostOptions(flash_attention=not args.no_flash_attention)
    pred = predict(model, cluster, plan, options=options)
    if args.json:
        data = pred.to_dict()
        if args.ranks:
            data = dict(data, rank_map=pred.rank_map(args.ranks))
        print_json(data)
        return 0
    print_prediction(console, pred, ranks=args.ranks)
    if not pred.fits:
        console.print(f"[bold red]does not fit:[/] peak {pred.memory_gib['peak']:.1f} GiB > "
                      f"{pred.memory_gib['hbm']:.0f} GiB on stage "
                      f"{pred.memory_gib['peak_stage']}; try recompute, zero=3, "
                      "sequence_parallel or a smaller micro_batch_size "
                      "(`trainpilot plan` searches them)")
    return 0
