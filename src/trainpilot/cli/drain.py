"""``trainpilot drain``: move a running multi-node job off one host, losing no step."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainpilot.cli.common import add_json_arg, add_verb, console, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "drain",
        help="move a running multi-node job off one host at its next step (no step lost)",
        description="Ask the job training in RUN_DIR to leave HOST: after its next step every "
                    "rank saves that step, the ranks on HOST exit and their launcher leaves, "
                    "and torchrun re-forms the job with a standby host waiting in the "
                    "rendezvous (or with fewer hosts, within --nnodes MIN:MAX). The new "
                    "members restore the drained step from the other hosts' memory. Use it "
                    "on a host that degrades (a slow link, rising errors) before it fails.",
        examples="  trainpilot drain /shared/runs/job42 --host node7\n"
                 "  trainpilot drain runs/mn --host node1 --json",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="the run directory of a running job")
    parser.add_argument("--host", required=True, help="the host to drain (its hostname)")
    parser.add_argument("--reason", default="operator", help="recorded with the request")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trainpilot.runtime.drain import request_drain
    from trainpilot.specs import SpecError

    job = args.run_dir / "job.json"
    if not job.is_file():
        raise SpecError("RUN_DIR", str(args.run_dir), "holds no job (job.json): not a run "
                        "directory of trainpilot train")
    if not args.host.strip():
        raise SpecError("--host", args.host, "a hostname of one of the job's hosts")
    body = request_drain(args.run_dir, args.host.strip(), reason=args.reason)
    body["run_dir"] = str(args.run_dir)
    if args.json:
        print_json(body)
    else:
        console.print(f"drain of {body['host']} requested: the job saves its next step and "
                      "goes on without that host (a standby waiting in the rendezvous takes "
                      "its place)", soft_wrap=True)
    return 0
