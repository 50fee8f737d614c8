"""Checkpoint stall per save vs synchronous saves of the same state, and bytes incremental vs full.

    .venv/bin/python benchmarks/checkpoint_stall.py                 # ~4 min, writes results
    .venv/bin/python benchmarks/checkpoint_stall.py --params-m 5 --saves 3   # quick look

One process, one thread (OMP_NUM_THREADS=1). The state: an MLP stack of ``--params-m`` million
fp32 parameters with AdamW moments (3 x the parameter bytes), plus a small config, trained with
real steps (forward, backward, AdamW on a random batch), so every parameter and both moments
change at every step.

Side by side, from one run, save by save, each save on a fresh folder after an untimed
``os.sync()`` (so no method pays for another's dirty pages):
- ``torch.save``: the state to one file, returning when the bytes are in the page cache;
- ``torch.save + fsync``: the same, durable (what a synchronous checkpoint must wait for);
- ``dcp.save``: torch.distributed.checkpoint's synchronous save (FileSystemWriter, fsyncs);
- ours, in blocks of ``--block-steps`` training steps that start with a save (the order of the
  three blocks rotates from round to round):
  - ``overlap`` (what the Trainer does): ``save(overlap=True)`` returns before copying; the
    writer thread copies to host memory while the next forward and backward run, and the loop
    calls ``fence()`` before its optimizer step;
  - ``copy first``: ``save()`` copies to host memory before it returns;
  - ``none``: the same steps without a save.
  The stall is what the loop waited (save call + fence); "extra wall" is the block's wall time
  minus the same round's block without a save (copy and background write competing for the
  machine included). The write is awaited, untimed, after each block.
Target (issue 6): stall <= 10% of the synchronous save.

Bytes: a full save, an incremental save after one step of full training (everything changed),
and an incremental save of a fine-tuning run with the first half of the layers frozen; zstd
ratio on the same state. Restore time from host memory vs from storage, same process.

Writes benchmarks/results/checkpoint_stall.txt.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from trainpilot.fsio import atomic_write_text
from trainpilot.runtime.checkpoint import CheckpointConfig, Checkpointer, diff_states

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_stall.txt"
TARGET = 0.10
WIDTH = 1024


def build_state(params_m: float, *, frozen_half: bool = False):
    """An MLP stack of about ``params_m`` million parameters and its AdamW state."""
    layers = max(2, round(params_m * 1e6 / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    if frozen_half:
        model[: layers // 2].requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    for p in trainable:  # one real step, so the moments hold gradient-like values
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return model, opt


def state_of(model, opt, step: int) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step,
            "config": {"lr": 1e-3, "betas": (0.9, 0.999)}}


def train_like(model, opt) -> None:
    """Change every trained parameter and both moments, cheaply (no forward/backward)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1e-3)
        for s in opt.state.values():
            s["exp_avg"].add_(1e-3)
            s["exp_avg_sq"].add_(1e-6)


def _tensors(state) -> list[torch.Tensor]:
    out = list(state["model"].values())
    for moments in state["optim"]["state"].values():
        out += [t for t in moments.values() if isinstance(t, torch.Tensor)]
    return out


def state_bytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(state))


def time_torch_save(state, folder: Path, *, fsync: bool) -> float:
    path = folder / "state.pt"
    start = time.perf_counter()
    with open(path, "wb") as handle:
        torch.save(state, handle)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())
    return time.perf_counter() - start


def time_dcp_save(state, folder: Path) -> float:
    import torch.distributed.checkpoint as dcp

    flat = {"model": state["model"], "optim": state["optim"]}
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    return time.perf_counter() - start


def train_step(model, opt, batch: torch.Tensor) -> None:
    """One real step: forward and backward of an MSE loss on ``batch``, then AdamW."""
    loss = model(batch).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed_block(model, opt, batch, steps: int, ckpt=None, save_step: int = 0,
                overlap: bool = False) -> dict:
    """``steps`` training steps, optionally preceded by a save; what the loop paid.

    ``blocked``: seconds the loop waited for the checkpoint (the save call, plus the fence
    before the first optimizer step after an overlapped save). ``wall``: the whole block."""
    start = time.perf_counter()
    call = fence = 0.0
    handle = None
    if ckpt is not None:
        handle = ckpt.save(save_step, state_of(model, opt, save_step), overlap=overlap)
        call = time.perf_counter() - start
    for i in range(steps):
        loss = model(batch).float().pow(2).mean()
        loss.backward()
        if i == 0 and ckpt is not None:
            fence = ckpt.fence()  # before the optimizer changes the saved tensors
        opt.step()
        opt.zero_grad(set_to_none=True)
    wall = time.perf_counter() - start
    done = handle is None or handle.done()
    if handle is not None:
        handle.result()  # untimed: the write finishes before the next block
    return {"wall": wall, "blocked": call + fence, "call": call, "fence": fence,
            "write_done": done}


def measure_stall(args, work: Path) -> dict:
    model, opt = build_state(args.params_m)
    batch = torch.randn(args.batch, WIDTH)
    nbytes = state_bytes(state_of(model, opt, 0))
    base = {"torch.save": [], "torch.save + fsync": [], "dcp.save (sync)": []}
    ckpt = Checkpointer(CheckpointConfig(root_dir=work / "ours", keep_last=1))
    # The floor: one memcpy of the same tensors into buffers allocated once.
    tensors = _tensors(state_of(model, opt, 0))
    copies, floor = [torch.empty_like(t) for t in tensors], []
    modes = {"none": {}, "overlap": dict(overlap=True), "copy first": dict(overlap=False)}
    blocks: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(2):  # warm-up: allocates both host slots, faults the pages in
        timed_block(model, opt, batch, 1, ckpt, save_step=0)
    for i in range(args.saves):
        train_step(model, opt, batch)
        state = state_of(model, opt, i)
        for name, fn in (("torch.save", lambda f, s=state: time_torch_save(s, f, fsync=False)),
                         ("torch.save + fsync",
                          lambda f, s=state: time_torch_save(s, f, fsync=True)),
                         ("dcp.save (sync)", lambda f, s=state: time_dcp_save(s, f))):
            folder = Path(tempfile.mkdtemp(dir=work))
            os.sync()  # untimed: no earlier method's dirty pages are flushed on this one's clock
            base[name].append(fn(folder))
            shutil.rmtree(folder)
        start = time.perf_counter()
        for dst, src in zip(copies, tensors):
            dst.copy_(src)
        floor.append(time.perf_counter() - start)
        names = list(modes)
        for name in names[i % 3:] + names[:i % 3]:  # rotate the order: drift hits all alike
            os.sync()
            use = ckpt if name != "none" else None
            blocks[name].append(timed_block(model, opt, batch, args.block_steps, use,
                                            save_step=i + 1, **modes[name]))
    step_s = statistics.median(b["wall"] for b in blocks["none"]) / args.block_steps
    ckpt.close()
    out = {"bytes": nbytes, "base": {k: statistics.median(v) for k, v in base.items()},
           "floor": statistics.median(floor), "step_s": step_s, "num": args.saves,
           "block_steps": args.block_steps}
    for name in ("overlap", "copy first"):
        extra = [b["wall"] - n["wall"] for b, n in zip(blocks[name], blocks["none"])]
        out[name] = {"blocked": statistics.median(b["blocked"] for b in blocks[name]),
                     "fence": statistics.median(b["fence"] for b in blocks[name]),
                     "extra": statistics.median(extra),
                     "write_done": sum(b["write_done"] for b in blocks[name])}
    return out


def measure_bytes(args, work: Path) -> dict:
    out = {}
    for label, frozen in (("full training", False), ("half the layers frozen", True)):
        model, opt = build_state(args.params_m, frozen_half=frozen)
        cfg = CheckpointConfig(root_dir=work / f"inc{frozen}", incremental=True, keep_last=2)
        with Checkpointer(cfg) as ckpt:
            full = ckpt.save(1, state_of(model, opt, 1)).result()
            train_like(model, opt)
            inc = ckpt.save(2, state_of(model, opt, 2)).result()
        out[label] = (full.bytes_written, inc.bytes_written, inc.bytes_referenced)
    model, opt = build_state(args.params_m)
    with Checkpointer(CheckpointConfig(root_dir=work / "zstd", compress=True)) as ckpt:
        z = ckpt.save(1, state_of(model, opt, 1)).result()
    out["zstd"] = (z.bytes_raw, z.bytes_written)
    return out


def measure_restore(args, work: Path) -> dict:
    model, opt = build_state(args.params_m)
    expected = state_of(model, opt, 1)
    with Checkpointer(CheckpointConfig(root_dir=work / "restore")) as ckpt:
        ckpt.save(1, expected).result()
        template = state_of(*build_state(args.params_m), 0)
        mem = ckpt.restore_latest(template, source="memory")
        assert diff_states(mem.state, expected) == []
        fresh = Checkpointer(CheckpointConfig(root_dir=work / "restore"))
        sto = fresh.restore_latest(template, source="storage")
        assert diff_states(sto.state, expected) == []
        fresh.close()
    return {"memory": mem.restore_s, "storage": sto.restore_s}


def render(args, stall: dict, nbytes: dict, restore: dict) -> str:
    mib = stall["bytes"] / 2**20
    ours = stall["overlap"]
    extra_head = f"extra wall over {stall['block_steps']} steps"
    lines = [f"checkpoint stall, {args.params_m:g} M parameters + AdamW = {mib:,.0f} MiB, "
             f"1 process, 1 thread, {platform.machine()}, torch {torch.__version__}",
             f"a training step (forward, backward, AdamW; batch {args.batch}): "
             f"{stall['step_s']:.3f} s; medians of {stall['num']} saves per method", "",
             f"{'synchronous baseline':<22}{'baseline s':>12}{'ours: stall s':>15}"
             f"{'stall/baseline':>16}  target <= {TARGET:.0%}"]
    for name, value in stall["base"].items():
        ratio = ours["blocked"] / value
        verdict = "ok" if ratio <= TARGET else "MISSED"
        lines.append(f"{name:<22}{value:>12.3f}{ours['blocked']:>15.3f}{ratio:>15.1%}  {verdict}")
    lines += ["",
              "ours, stall = what the loop waited: the save call, plus (overlapped) the wait "
              "before the next optimizer step for the copy to host memory",
              f"{'copy to host':<28}{'stall s':>9}{'of which fence':>16}{extra_head:>24}",
              *(f"{name:<28}{stall[name]['blocked']:>9.3f}{stall[name]['fence']:>16.3f}"
                f"{stall[name]['extra']:>24.3f}" for name in ("overlap", "copy first")),
              f"{'memcpy floor':<28}{stall['floor']:>9.3f}   (one copy_ of the same tensors "
              "into buffers allocated once)",
              "extra wall: the block of steps after a save minus the same block without one "
              "(same round): the copy and the",
              "background write (checksums, files, fsync) compete with training for memory "
              f"bandwidth; writes finished inside the block: "
              f"{ours['write_done']}/{stall['num']}", "",
              f"{'bytes per save':<28}{'full MiB':>10}{'incremental MiB':>17}"
              f"{'referenced MiB':>16}"]
    for label in ("full training", "half the layers frozen"):
        full, written, ref = (b / 2**20 for b in nbytes[label])
        lines.append(f"{label:<28}{full:>10.1f}{written:>17.1f}{ref:>16.1f}"
                     f"   ({written / full:.0%} of full)")
    raw, z = nbytes["zstd"]
    lines += [f"zstd (level 3) on fp32 weights + moments: {z / raw:.1%} of raw", "",
              f"restore, same process: from host memory {restore['memory']:.3f} s, "
              f"from storage (verify + DCP load) {restore['storage']:.3f} s"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-m", type=float, default=50.0, help="parameters, millions")
    parser.add_argument("--saves", type=int, default=6, help="saves per method (>= 3)")
    parser.add_argument("--batch", type=int, default=128,
                        help="rows per training step (sets the step time)")
    parser.add_argument("--block-steps", type=int, default=8,
                        help="training steps timed after each save")
    parser.add_argument("--no-write", action="store_true", help="do not write the results file")
    args = parser.parse_args()
    if args.saves < 3:
        parser.error("--saves must be at least 3")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="tp-ckpt-bench-") as tmp:
        work = Path(tmp)
        stall = measure_stall(args, work)
        nbytes = measure_bytes(args, work)
        restore = measure_restore(args, work)
    text = render(args, stall, nbytes, restore)
    print(text, end="")
    if not args.no_write:
        atomic_write_text(RESULTS, text)


if __name__ == "__main__":
    main()
