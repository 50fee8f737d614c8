"""``trainpilot train``: run a plan for real under torchrun (CPU/gloo here, NCCL on GPUs)."""

from __future__ import annotations

import argparse
import datetime
import sqlite3
import sys
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trainpilot.cli.common import (
    EXIT_FAILURE,
    add_doc_args,
    add_json_arg,
    add_verb,
    console,
    err_console,
    human,
    print_json,
)

# Training options that map one-to-one onto TrainConfig fields.
_CONFIG_FLAGS = dict(steps=int, lr=float, warmup_steps=int, grad_clip=float, seed=int, data=str,
                     data_dtype=str, autocast=str, checkpoint_every=int, storage_every=int,
                     data_tokenizer=str, data_text_field=str, data_eos_id=int)
# Recovery options that map onto ElasticConfig fields.
_ELASTIC_FLAGS = dict(recovery="recovery", heartbeat_timeout="heartbeat_timeout_s",
                      collective_timeout="collective_timeout_s", probe_links="link_probe_s",
                      drain_slow_links="drain_slow_links", slow_link_ratio="slow_link_ratio")


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "train", help="train a model under a plan with torchrun",
        description="Start the job under torchrun (its own options are accepted as they are) "
                    "and train the reference model: layout from the plan (DDP/FSDP2, TP+SP, PP, "
                    "EP), AdamW with warmup+cosine, per-step loss, tokens/s and the cost "
                    "model's predicted step time. Checkpoints follow the plan (async, in-memory peer "
                    "copy, incremental), the health monitor watches every step, failures are "
                    "detected (heartbeats, collective timeouts) and recovered in process or "
                    "by torchrun --max-restarts; --inject breaks the run on purpose. Writes "
                    "the resolved documents, the run store (trainpilot.db: read it with "
                    "monitor, dashboard, report), checkpoints/, metrics.jsonl and summary.json "
                    "into the run directory. --dry-run builds the layout on the meta device "
                    "and reports per-rank parameters and memory.",
        examples="  trainpilot train --model tiny-gpt --steps 50 "
                 "--plan dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64\n"
                 "  trainpilot train --nproc-per-node 2 --model tiny-moe "
                 "--plan dp=2,ep=2,micro_batch_size=4,global_batch_size=16,seq_len=64\n"
                 "  trainpilot train --model tiny-gpt --plan tp=2,sequence_parallel=true,"
                 "global_batch_size=8,seq_len=64 --run-dir runs/tp2 --json\n"
                 "  trainpilot train --dry-run --model llama3-70b --cluster h100-sxm-x64 "
                 "--plan tp=8,pp=4,dp=2,zero=3,global_batch_size=64,seq_len=8192\n"
                 "  trainpilot train --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d "
                 "--rdzv-endpoint head:29400 --model llama3-8b --plan plan.yaml\n"
                 "  trainpilot train --model tiny-gpt --steps 30 --checkpoint-every 5 "
                 "--max-restarts 1 --inject 'crash:rank=1,step=12' "
                 "--plan dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64\n"
                 "  trainpilot train --model tiny-gpt --steps 30 --checkpoint-every 2 "
                 "--inject 'collective:rank=0,step=5;nan:rank=1,step=9' "
                 "--plan dp=2,zero=0,micro_batch_size=8,global_batch_size=16,seq_len=64",
    )
    add_doc_args(parser, cluster=False)
    parser.add_argument("--cluster", help="cluster preset or file for the predicted step time "
                        "(default on CPU: this machine, calibrated at start)")
    group = parser.add_argument_group("training options (TrainConfig)")
    group.add_argument("--config", help="TrainConfig YAML/JSON file; the flags below override it")
    group.add_argument("--steps", type=int, help="optimizer steps (default 100)")
    group.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    group.add_argument("--warmup-steps", type=int, help="linear warmup steps (default min(10, steps/10))")
    group.add_argument("--grad-clip", type=float, help="max global grad norm (default 1.0)")
    group.add_argument("--seed", type=int, help="seed for init, data order and the corpus")
    group.add_argument("--data", help="'markov' (synthetic, known entropy floor; default) or a "
                       "nanoGPT-style .bin token file")
    group.add_argument("--data-dtype", choices=["uint16", "uint32"], help="token file dtype")
    group.add_argument("--data-tokenizer", metavar="TOKENIZER_JSON",
                       help="text/JSONL data: a local tokenizers tokenizer.json (default: a "
                            "byte-level BPE trained on the corpus itself)")
    group.add_argument("--data-text-field", metavar="KEY", help="JSONL: the text field "
                       "(default text)")
    group.add_argument("--data-eos-id", type=int, metavar="ID",
                       help="token id placed between documents (default: the tokenizer's EOS)")
    group.add_argument("--weights", metavar="SAFETENSORS",
                       help="with a Hugging Face --model config.json: start from these weights "
                            "(a local .safetensors file or folder; default: seeded random "
                            "init)")
    group.add_argument("--export-metrics", metavar="SPEC",
                       help="also send the metrics live: 'tensorboard=DIR', "
                            "'prometheus=PORT|FILE', comma-separated")
    group.add_argument("--autocast", choices=["auto", "bf16", "off"],
                       help="bf16 autocast (auto: when the plan says bf16 and the device has "
                            "native bf16)")
    group.add_argument("--no-predict", action="store_true",
                       help="skip calibration and the predicted step time")
    group.add_argument("--callback", action="append", default=[], metavar="MODULE:FACTORY",
                       help="attach a callback: factory(run_dir=, layout=) -> Callback "
                            "(repeatable)")
    group = parser.add_argument_group("checkpoints, health and recovery")
    group.add_argument("--checkpoint-every", type=int, metavar="N",
                       help="snapshot every N steps (default: the plan's "
                            "checkpoint.interval_steps), kept in host memory and a peer's")
    group.add_argument("--storage-every", type=int, metavar="K",
                       help="write every K-th snapshot to storage as well (default 1)")
    group.add_argument("--no-checkpoint", action="store_true", help="no checkpoints")
    group.add_argument("--no-health", action="store_true",
                       help="no health monitor (metrics are still stored)")
    group.add_argument("--health-config", metavar="YAML",
                       help="health rules and interventions (default: trainpilot's rules.yaml)")
    group.add_argument("--inject", metavar="SPEC",
                       help="faults to inject, e.g. 'crash:rank=1,step=5;nan:rank=0,step=9' "
                            "(kinds: crash, hang, slow, corrupt, truncate, missing, enospc, "
                            "collective, nan; see docs/elastic.md)")
    group.add_argument("--recovery", choices=["in_process", "restart"],
                       help="on a failure that leaves every process alive: rebuild the group "
                            "and restore from memory in process (default), or exit and let "
                            "torchrun restart every rank (a dead rank always means a restart)")
    group.add_argument("--no-recovery", action="store_true",
                       help="fail on the first fault: no torchrun restarts, no in-process "
                            "recovery (default: both, up to --max-restarts 3)")
    group.add_argument("--resume", default="auto", metavar="auto|never|STEP",
                       help="on a run directory that holds a run: continue from its newest "
                            "valid checkpoint (auto, the default), from checkpoint STEP, or "
                            "start over (never: the old run is moved to RUN_DIR/previous/)")
    group.add_argument("--preempt-signals", default="TERM", metavar="SIG[,SIG]",
                       help="signals that trigger a last-moment checkpoint and a clean exit "
                            "(code 128+signal); e.g. TERM,USR1 (default TERM)")
    group.add_argument("--preempt-deadline", type=float, default=20.0, metavar="S",
                       help="seconds the last-moment checkpoint may take (default 20; torchrun "
                            "kills workers 30 s after forwarding the signal)")
    group.add_argument("--skip-memory-check", action="store_true",
                       help="launch even if the cost model predicts the plan does not fit in "
                            "memory")
    group.add_argument("--heartbeat-timeout", type=float, metavar="S",
                       help="declare a rank failed after S seconds without a heartbeat "
                            "(default 3)")
    group.add_argument("--collective-timeout", type=float, metavar="S",
                       help="the training group's collective timeout (default 10)")
    group.add_argument("--probe-links", type=float, metavar="S",
                       help="multi-node: each host's launcher probes the other hosts' links "
                            "every S seconds and flags a host whose links are under half the "
                            "others' speed (needs 3 hosts, a standby counts; RUN_DIR/links/)")
    group.add_argument("--drain-slow-links", action="store_true", default=None,
                       help="with --probe-links: a host flagged 3 rounds in a row asks for its "
                            "own drain (see `trainpilot drain`): the job moves to the standby "
                            "at the next step, losing none")
    group.add_argument("--slow-link-ratio", type=float, metavar="R",
                       help="with --probe-links: a host is flagged when its links' median "
                            "speed is under R x the other hosts' (default 0.5; lower it where "
                            "probes are noisy)")
    parser.add_argument("--run-dir", help="where the run writes (default runs/<timestamp>)")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the layout on the meta device; report per-rank parameters "
                             "and memory; no training")
    add_json_arg(parser)
    parser.set_defaults(func=run)
    _attach_torchrun_options_lazily(parser)


def _attach_torchrun_options_lazily(parser: argparse.ArgumentParser) -> None:
    """torchrun's parser lives in torch (seconds to import), so its options join this verb's
    parser only when ``train`` itself is parsed: ``trainpilot --help`` stays fast while
    ``trainpilot train --help`` lists them."""
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        if not getattr(parser, "_torchrun_attached", False):
            from trainpilot.runtime.launch import add_torchrun_arguments

            add_torchrun_arguments(parser)
            parser._torchrun_attached = True
        return original(args, namespace)

    # a deliberate per-instance override of the bound method (see the docstring)
    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def _config(args: argparse.Namespace):
    from trainpilot.runtime.config import load_config
    from trainpilot.specs import read_document

    data: dict[str, Any] = read_document(args.config, doc="train") if args.config else {}
    for flag in _CONFIG_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            data[flag] = value
    if args.no_predict:
        data["predict"] = False
    return load_config(data)


def run(args: argparse.Namespace) -> int:
    from trainpilot.specs import SpecError, load_cluster, load_model, load_plan

    model, plan = load_model(args.model), load_plan(args.plan)
    hf_config = _hf_config(args.model)
    if args.weights and hf_config is None:
        raise SpecError("--weights", args.weights, "needs a Hugging Face --model config.json")
    if args.export_metrics:
        from trainpilot.store.exporters import ExportSpec

        ExportSpec.parse(args.export_metrics)  # bad input before anything starts
    cluster = load_cluster(args.cluster) if args.cluster else None
    if args.dry_run:
        return _dry_run(args, model, plan, cluster)
    config = _config(args)
    if args.health_config:  # bad rules are bad input: before anything starts
        from trainpilot.health.config import load_health_config

        load_health_config(args.health_config)
    from trainpilot.runtime.degrade import QuietStream
    from trainpilot.runtime.launch import RunPreempted, launch

    # A log file on a full disk must not end the launcher (and with it the job).
    sys.stdout, sys.stderr = QuietStream(sys.stdout), QuietStream(sys.stderr)

    run_dir = Path(args.run_dir or Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if not args.json:
        console.print(f"[bold]train[/] {model.name} · plan world size {plan.world_size} · "
                      f"{config.steps} steps → {run_dir}")
    progress = None if args.json else _progress(config.steps)
    note = progress.note if progress else (lambda line: err_console.print(line, soft_wrap=True))
    try:
        elastic = {field: getattr(args, flag) for flag, field in _ELASTIC_FLAGS.items()
                   if getattr(args, flag) is not None}
        signals = tuple(s.strip().upper().removeprefix("SIG")
                        for s in args.preempt_signals.split(",") if s.strip())
        summary = launch(model=model, plan=plan, config=config, run_dir=run_dir, options=args,
                         cluster=cluster, callbacks=args.callback,
                         on_record=progress.on_record if progress else None, on_note=note,
                         inject=args.inject, elastic=elastic, health=not args.no_health,
                         health_config=args.health_config, checkpoint=not args.no_checkpoint,
                         resume=args.resume, recovery=not args.no_recovery,
                         memory_check=not args.skip_memory_check, preempt_signals=signals,
                         preempt_deadline_s=args.preempt_deadline,
                         on_launch=progress.start if progress else None,
                         hf_config=hf_config, hf_weights=args.weights,
                         export_metrics=args.export_metrics)
    except RunPreempted as err:
        if progress:
            progress.stop()
        err_console.print(f"[bold yellow]{err}[/]", soft_wrap=True)
        return err.exit_code
    except RuntimeError as err:  # TrainingFailed included
        if progress:
            progress.stop()
        err_console.print(f"[bold red]error:[/] {err}", soft_wrap=True)
        _close_crashed(run_dir, str(err))
        return EXIT_FAILURE
    finally:
        if progress:
            progress.stop()
    summary["run_dir"] = str(run_dir)
    if args.json:
        print_json(summary)
    else:
        if not (summary.get("already_complete") or summary.get("left_job")):
            print_train_summary(summary)
        console.print(final_line(summary), soft_wrap=True)
    return 0


def _hf_config(ref: str) -> dict[str, Any] | None:
    """The config.json of a Hugging Face model ``--model`` points at (a file, or a folder
    holding one); None for a preset or a trainpilot model document."""
    import json

    from trainpilot.specs.hf import looks_like_hf_config

    path = Path(ref)
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # load_model has said what is wrong with it
    return data if isinstance(data, dict) and looks_like_hf_config(data) else None


def _close_crashed(run_dir: Path, reason: str) -> None:
    """The workers are gone: a store they left saying "running" says how the run ended."""
    from trainpilot.specs import SpecError
    from trainpilot.store import RunStore

    try:
        RunStore.close_run(run_dir, status="crashed", reason=reason[:500], exit_code=1)
    except (SpecError, OSError, sqlite3.Error):
        pass  # no store (the run failed before rank 0 opened it), or the disk refuses


def final_line(summary: dict[str, Any]) -> str:
    """One honest line: complete, and from which faults it recovered."""
    if summary.get("already_complete"):
        return f"nothing to do: {summary['run_dir']} already completed {summary.get('steps')} steps"
    if summary.get("left_job"):
        return str(summary["left_job"])
    faults = summary.get("faults") or []
    recoveries = summary.get("recoveries") or []
    resumed = [r for r in recoveries if r.get("reason") == "resume"]
    recovered = [r for r in recoveries if r.get("reason") != "resume"]
    line = f"completed {summary.get('steps')} steps"
    if resumed:
        line += "; resumed from step " + ", ".join(str(r.get("restored_step")) for r in resumed)
    if faults or recovered:
        named = [f"{f.get('kind')}" + (f" of rank {f['rank']}" if f.get("rank") is not None
                                       else "")
                 + (f" at step {f['step']}" if f.get("step") is not None else "")
                 + f" ({'external' if f.get('source') == 'external' else 'injected'})"
                 for f in faults]
        line += (f"; recovered {len(recovered)} time(s) from {len(faults)} fault(s)"
                 + (f": {'; '.join(named)}" if named else ""))
    if summary.get("checkpoint_errors"):
        line += (f"; {summary['checkpoint_errors']} checkpoint save(s) failed (the warnings "
                 "above say why)")
    return line


class _progress(Progress):
    """A progress bar fed by the run's metrics.jsonl lines."""

    def __init__(self, steps: int):
        super().__init__(TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(),
                         TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
        self.task = self.add_task("train", total=steps, info="starting processes...")

    def note(self, line: str) -> None:
        """A line above the bar (where the run resumes from, a full disk)."""
        self.console.print(line, soft_wrap=True, style="yellow" if "warning" in line else None)

    def on_record(self, record: dict) -> None:
        if record.get("kind") == "step":
            self.update(self.task, completed=record["step"],
                        info=f"loss {record['loss']:.4f}  {record['tokens_per_s']:,.0f} tok/s")
        elif record.get("kind") == "calibration":
            self.update(self.task, info="calibrated; training...")
        elif record.get("kind") == "restart":
            self.update(self.task, completed=record.get("restored_step", 0),
                        info=f"recovered ({record.get('reason')}): restored step "
                             f"{record.get('restored_step')} from {record.get('source')}")


def print_train_summary(summary: dict[str, Any]) -> None:
    """The run's outcome as a table: losses, speed, predicted vs measured step time."""
    from trainpilot.runtime.report import summary_rows

    table = Table(show_header=False, title=f"run {summary['run_dir']}", title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    console.print(table)


def _dry_run(args: argparse.Namespace, model, plan, cluster) -> int:
    from trainpilot.runtime.dryrun import dry_run

    report = dry_run(model, plan)
    hbm = cluster.device.hbm_gib if cluster is not None else None
    if hbm is not None:
        report["device_hbm_gib"] = hbm
    if args.json:
        print_json(report)
        return 0
    mesh = " ".join(f"{k}={v}" for k, v in report["mesh"].items())
    table = Table(title=f"dry run: {report['model']} ({human(report['total_params'])} params) on "
                        f"{report['world_size']} ranks, mesh {mesh}", title_justify="left")
    for col in ("rank", "pp", "dp", "tp", "ep", "layers", "params", "model states GiB"):
        table.add_column(col, justify="right")
    if hbm is not None:
        table.add_column(f"of {hbm:g} GiB HBM", justify="right")
    for row in report["ranks"]:
        cells = [str(row[k]) for k in ("rank", "pp", "dp", "tp", "ep", "layers")]
        cells += [human(row["params"]), f"{row['model_states_gib']:.3f}"]
        if hbm is not None:
            cells.append(f"{row['model_states_gib'] / hbm:.0%}")
        table.add_row(*cells)
    console.print(table)
    console.print(f"[dim]{report['note']}; {report['bytes_per_param']} bytes per parameter. "
                  "Ranks not shown hold the same counts as the rank of their pipeline stage.[/]")
    return 0
