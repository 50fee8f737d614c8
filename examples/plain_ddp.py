"""A plain PyTorch DDP loop: a tiny Hugging Face Llama on text (Python's own standard-library
sources, tokenized with a BPE trained on them), on CPU with gloo.

    torchrun --standalone --nproc-per-node 2 examples/plain_ddp.py --steps 30
"""
import argparse
import os
import sysconfig

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

from trainpilot.runtime.datasets import TextDataset  # JSONL / text, packed, EOS between docs
from trainpilot.runtime.procexit import keep_alive, run_and_end

STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "[a-c]*.py")
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--data", default=STDLIB, help="a .jsonl, a text file or a glob of them")
args = parser.parse_args()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TextDataset(args.data, seq_len=64, vocab_size=512)  # trains the BPE: same on every rank
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model = DDP(LlamaForCausalLM(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order = torch.randperm(data.num_samples, generator=torch.Generator().manual_seed(0))
    batch = 16  # sequences per step, all ranks
    for step in range(1, args.steps + 1):
        mine = order[(step - 1) * batch:step * batch].view(world, -1)[rank]
        inputs, targets = data.get_batch(mine.numpy())
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss := loss.detach(), op=dist.ReduceOp.AVG)
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()
    keep_alive(model)  # its reducer holds the gloo group: freeing it here can deadlock (torch 2.13)


# torch 2.13's gloo threads outlive destroy_process_group; one of them can abort the process
# ("terminate called without an active exception", SIGABRT) while Python tears down, and
# torchrun then reports the finished job as failed (CI saw it here). run_and_end exits as
# Python would, minus that teardown (docs/runtime.md, benchmarks/exit_abort.py).
run_and_end(main)
