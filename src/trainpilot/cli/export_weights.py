"""``trainpilot export-weights``: a run's newest checkpoint as weights other tools load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainpilot.cli.common import add_json_arg, add_verb, console, print_json


def register(subparsers) -> None:
    parser = add_verb(
        subparsers, "export-weights",
        help="write a run's model weights as Hugging Face safetensors or a torch state dict",
        description="Read the newest intact checkpoint of RUN_DIR (or --step N) through "
                    "trainpilot's own reader (JSON manifest, checksums, any world size) and "
                    "write its model tensors. --to hf: model.safetensors + config.json that "
                    "transformers' from_pretrained loads: for a Hugging Face model trained by "
                    "trainpilot (hf_config.json in the run directory) the keys as they are; for "
                    "trainpilot's reference GPT, mapped exactly onto LlamaForCausalLM or "
                    "GPT2LMHeadModel (other shapes are refused). --to torch: model.pt, the "
                    "state dict torch.load(weights_only=True) reads.",
        examples="  trainpilot export-weights runs/tiny --to hf --output tiny-hf\n"
                 "  trainpilot export-weights runs/tiny --to torch --step 200 --json",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a trainpilot run directory")
    parser.add_argument("--to", required=True, choices=["hf", "torch"], help="output format")
    parser.add_argument("--output", type=Path,
                        help="output folder (default RUN_DIR/export-hf or RUN_DIR/export-torch)")
    parser.add_argument("--step", type=int, help="the checkpoint of this step (default newest)")
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="checkpoint root (default RUN_DIR/checkpoints)")
    add_json_arg(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from trainpilot.fsio import atomic_write_text
    from trainpilot.runtime.checkpoint.weights import read_tensors, reference_gpt_to_hf
    from trainpilot.specs import SpecError, load_model

    run_dir: Path = args.run_dir
    if not run_dir.is_dir():
        raise SpecError("RUN_DIR", str(run_dir), "not a directory")
    step, tensors = read_tensors(args.checkpoint_dir or run_dir / "checkpoints", step=args.step)
    out = args.output or run_dir / f"export-{args.to}"
    out.mkdir(parents=True, exist_ok=True)
    if args.to == "torch":
        path = out / "model.pt"
        torch.save(tensors, path)
        files = [path]
        source = "state dict"
    else:
        from safetensors.torch import save_file

        hf_config = run_dir / "hf_config.json"
        if hf_config.is_file():  # an HF model trained directly: its keys are HF's already
            config = json.loads(hf_config.read_text())
            source = f"Hugging Face {config.get('model_type', 'model')}"
        else:
            model_doc = run_dir / "model.yaml"
            if not model_doc.is_file():
                raise SpecError("RUN_DIR", str(run_dir),
                                "has neither hf_config.json nor model.yaml")
            config, tensors = reference_gpt_to_hf(tensors, load_model(str(model_doc)))
            source = f"reference GPT as {config['architectures'][0]}"
        dtypes = {t.dtype for t in tensors.values()}
        config["torch_dtype"] = str(max(dtypes, key=lambda d: torch.finfo(d).bits
                                        if d.is_floating_point else 0)).removeprefix("torch.")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
        files = [out / "model.safetensors", out / "config.json"]
    summary = {"step": step, "to": args.to, "source": source, "tensors": len(tensors),
               "parameters": sum(t.numel() for t in tensors.values()),
               "files": [str(f) for f in files]}
    if args.json:
        print_json(summary)
    else:
        console.print(f"step {step}: {len(tensors)} tensors ({summary['parameters']:,} "
                      f"values, {source}) -> {', '.join(summary['files'])}")
    return 0
