"""A Hugging Face model from its config.json and your data, through trainpilot's Trainer under
a Plan (DDP, FSDP2, TP, EP), on CPU with gloo:

    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --plan tp=2 --steps 20
    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --model mixtral --plan dp=2,ep=2

``--config`` takes any supported config.json (llama, mistral, qwen2, qwen3, mixtral,
qwen2_moe, qwen3_moe); ``--data`` a .jsonl, text files, token shards or a Megatron .bin/.idx.
"""
import argparse
import os
import sysconfig

import torch
import torch.distributed as dist

from trainpilot.runtime.config import TrainConfig
from trainpilot.runtime.datasets import open_dataset
from trainpilot.runtime.hf_parallel import HFModel
from trainpilot.runtime.procexit import run_and_end
from trainpilot.runtime.trainer import Trainer
from trainpilot.specs import load_plan

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)
MODELS = dict(llama=dict(model_type="llama", **TINY),
              qwen3=dict(model_type="qwen3", head_dim=16, **TINY),
              mixtral=dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                           **TINY))
parser = argparse.ArgumentParser()
parser.add_argument("--config", help="a config.json (default: a tiny --model)")
parser.add_argument("--model", default="llama", choices=sorted(MODELS))
parser.add_argument("--plan", default="dp=2,zero=3")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--data", default=os.path.join(sysconfig.get_paths()["stdlib"], "[a-c]*.py"))
parser.add_argument("--tokenizer", help="a tokenizer.json (default: a BPE trained on --data)")
args = parser.parse_args()


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = HFModel(args.config or MODELS[args.model], seed=0)
    plan = load_plan(f"{args.plan},micro_batch_size=4,global_batch_size=16,seq_len=64")
    data = open_dataset(args.data, seq_len=plan.seq_len, vocab_size=model.vocab_size,
                        tokenizer=args.tokenizer)
    trainer = Trainer(plan=plan, config=TrainConfig(steps=args.steps, predict=False),
                      model_factory=model, dataset=data)
    for _ in range(args.steps):
        record = trainer.train_step()
        if dist.get_rank() == 0 and (record.step % 5 == 0 or record.step == 1):
            print(f"step {record.step} loss {record.loss:.4f} tokens/s {record.tokens_per_s:.0f}",
                  flush=True)
    dist.destroy_process_group()


run_and_end(main)
