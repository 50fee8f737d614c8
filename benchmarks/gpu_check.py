"""One GPU: the measured step time of a ~1B-parameter transformer beside the cost model's.

    python benchmarks/gpu_check.py              # on a CUDA GPU: bf16, NCCL at world size 1
    python benchmarks/gpu_check.py --dry-run    # on a CPU: a tiny model over gloo (the test)

What it does: initialises a process group of one rank (NCCL on a GPU, gloo on a CPU: the init
path the runtime takes, checked with an all-reduce), builds the project's reference model
(``runtime.models.build_gpt``) from a ModelSpec, trains it with AdamW in bf16 autocast on random
tokens for ``--warmup`` + ``--steps`` steps, and times the steps after the warm-up (CUDA events
around each step, synchronised). The prediction is ``perf.predict`` for the same documents: the
same ModelSpec, a one-device cluster of the detected device (``h100-sxm``, ``h200``,
``a100-80gb``, ``b200``; another device gets the roofline default from its own peak, which the
script cannot read off the hardware, so give ``--device`` for a named one) and a plan of one
rank, ZeRO-0, run by trainpilot's own eager stack (``runtime.stack = trainpilot``). It prints
both and the error, and writes them as JSON with ``--out``.

The GPU run is sized to take about a minute on an H200 (model build and warm-up included; not
yet run on a GPU: the session that wrote it had none); the dry run takes a few seconds. Nothing in the test suite needs a GPU: tests/perf/test_gpu_check.py runs the dry
mode.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

# ~1B parameters: Llama-style, 16 layers of width 2048, SwiGLU MLP of 5632, vocabulary 32,000
# (16 x (4 x 2048^2 + 3 x 2048 x 5632) + 2 x 32000 x 2048 = 0.95B).
GPU_MODEL = dict(name="gpu-check-1b", num_hidden_layers=16, hidden_size=2048,
                 num_attention_heads=16, num_key_value_heads=16, intermediate_size=5632,
                 vocab_size=32000, activation="swiglu", norm="rmsnorm",
                 position_embedding="rope", max_position_embeddings=4096)
TINY_MODEL = dict(name="gpu-check-tiny", num_hidden_layers=2, hidden_size=64,
                  num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                  vocab_size=256, activation="swiglu", norm="rmsnorm",
                  position_embedding="rope", max_position_embeddings=256)
DEVICES = (("H200", "h200"), ("H100", "h100-sxm"), ("H800", "h800"), ("A100", "a100-80gb"),
           ("B200", "b200"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _device_preset(torch, name: str | None) -> str:
    if name:
        return name
    if not torch.cuda.is_available():
        return "cpu"
    found = torch.cuda.get_device_name(0)
    for key, preset in DEVICES:
        if key in found:
            return preset
    raise SystemExit(f"unknown GPU {found!r}: give --device (a device preset)")


def measure(spec_data: dict, *, micro_batch: int, seq_len: int, warmup: int, steps: int,
            dry_run: bool) -> dict:
    """Train the model for ``warmup + steps`` steps; the mean step time of the timed ones."""
    import torch
    import torch.distributed as dist

    from trainpilot.runtime.models import build_gpt, init_parameters
    from trainpilot.specs import ModelSpec

    use_cuda = torch.cuda.is_available() and not dry_run
    backend = "nccl" if use_cuda else "gloo"
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if not dry_run and not use_cuda:
        raise SystemExit("no CUDA GPU: run with --dry-run on a CPU")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        probe = torch.ones(4, device=device)
        dist.all_reduce(probe)  # the collective path at world size 1
        assert float(probe.sum()) == 4.0
        spec = ModelSpec.model_validate(spec_data)
        model = build_gpt(spec, max_seq_len=seq_len, device="meta")
        model.to_empty(device=device)
        init_parameters(model, spec, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=use_cuda)
        tokens = torch.randint(0, spec.vocab_size, (micro_batch, seq_len + 1), device=device)
        dtype = torch.bfloat16
        times = []
        for step in range(warmup + steps):
            start = time.perf_counter()
            if use_cuda:
                begin, end = torch.cuda.Event(enable_timing=True), \
                    torch.cuda.Event(enable_timing=True)
                begin.record()
            with torch.autocast(device.type, dtype=dtype):
                logits = model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                     tokens[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if use_cuda:
                end.record()
                torch.cuda.synchronize()
                elapsed = begin.elapsed_time(end) / 1e3
            else:
                elapsed = time.perf_counter() - start
            if step >= warmup:
                times.append(elapsed)
        params = sum(p.numel() for p in model.parameters())
        return dict(step_time_s=sum(times) / len(times), steps=len(times), backend=backend,
                    device=torch.cuda.get_device_name(0) if use_cuda else "cpu",
                    params=params, loss=loss.item(), min_s=min(times), max_s=max(times))
    finally:
        dist.destroy_process_group()


def prediction(spec_data: dict, device: str, *, micro_batch: int, seq_len: int) -> dict:
    from trainpilot.perf import predict
    from trainpilot.specs import ModelSpec, Plan, load_cluster

    spec = ModelSpec.model_validate(spec_data)
    plan = Plan(dp=1, zero=0, micro_batch_size=micro_batch, global_batch_size=micro_batch,
                seq_len=seq_len, precision="bf16", runtime=dict(stack="trainpilot"))
    pred = predict(spec, load_cluster(f"{device}-x1"), plan)
    return dict(step_time_s=pred.step_time_s, mfu=pred.mfu, plan=plan.to_dict(),
                breakdown_s=pred.breakdown_s, caveats=list(pred.caveats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="a tiny model on the CPU over gloo (what the test suite runs)")
    parser.add_argument("--device", default=None, help="device preset (default: detected)")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    spec = TINY_MODEL if args.dry_run else GPU_MODEL
    mb = args.micro_batch or (2 if args.dry_run else 8)
    seq = args.seq_len or (64 if args.dry_run else 2048)
    device = "cpu" if args.dry_run else _device_preset(torch, args.device)
    started = time.perf_counter()
    measured = measure(spec, micro_batch=mb, seq_len=seq, warmup=args.warmup,
                       steps=args.steps, dry_run=args.dry_run)
    predicted = prediction(spec, device, micro_batch=mb, seq_len=seq)
    error = (predicted["step_time_s"] - measured["step_time_s"]) / measured["step_time_s"]
    result = dict(mode="dry-run" if args.dry_run else "gpu", device_preset=device,
                  model=spec["name"], micro_batch=mb, seq_len=seq, measured=measured,
                  predicted=predicted, error=error, wall_s=time.perf_counter() - started)
    print(f"{spec['name']} ({measured['params'] / 1e9:.2f}B parameters) on {measured['device']} "
          f"via {measured['backend']}: measured {measured['step_time_s']:.4f} s/step "
          f"(mean of {measured['steps']}), predicted {predicted['step_time_s']:.4f} s/step "
          f"({device}), error {error:+.1%}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
