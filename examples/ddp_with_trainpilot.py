"""examples/plain_ddp.py with trainpilot's parts added (lines marked ``# +``): the checkpoint
manager (async, sharded, verified, with an in-memory peer copy), the elastic session (process
group through generations, heartbeats that catch a hung rank), the step guard (clipping and
one non-finite decision for all ranks), the fault injector, the health monitor, and a
resumable exactly-once sampler. Crash it and torchrun restarts it where it was:

    TRAINPILOT_INJECT="crash:rank=1,step=12" torchrun --standalone --nproc-per-node 2 \
        --max-restarts 1 examples/ddp_with_trainpilot.py --steps 30 --run-dir /tmp/run
"""
import argparse
import os
import sysconfig

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

from trainpilot.health.monitor import HealthMonitor  # +
from trainpilot.runtime.checkpoint.manager import CheckpointManager  # +
from trainpilot.runtime.datasets import TextDataset
from trainpilot.runtime.elastic import ElasticConfig, ElasticSession  # +
from trainpilot.runtime.faults import FaultInjector  # +
from trainpilot.runtime.procexit import keep_alive, run_and_end  # +
from trainpilot.runtime.sampler import ResumableSampler  # +
from trainpilot.runtime.stepguard import StepGuard  # +
from trainpilot.specs.plan import CheckpointPolicy  # +

STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "[a-c]*.py")
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--data", default=STDLIB, help="a .jsonl, a text file or a glob of them")
parser.add_argument("--run-dir", default="runs/ddp_with_trainpilot")  # +
parser.add_argument("--save-every", type=int, default=5)  # +
args = parser.parse_args()


def main() -> None:
    session = ElasticSession(ElasticConfig(recovery="restart"))  # + joins the process group
    session.start()  # + a failure ends the process; torchrun --max-restarts restarts all
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = TextDataset(args.data, seq_len=64, vocab_size=512)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model = DDP(LlamaForCausalLM(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    faults = FaultInjector(os.environ.get("TRAINPILOT_INJECT", ""),  # +
                           journal_path=os.path.join(args.run_dir, "faults.jsonl"))
    monitor = HealthMonitor(model=model.module, optimizer=optimizer,  # +
                            total_steps=args.steps)
    sampler = ResumableSampler(data.num_samples, seed=0)  # + replaces the randperm order
    manager = CheckpointManager(  # + async, sharded, verified, with a peer copy in memory
        dict(model=model.module, optimizer=optimizer, sampler=sampler, monitor=monitor),
        root_dir=os.path.join(args.run_dir, "ckpt"), faults=faults,
        policy=CheckpointPolicy(interval_steps=args.save_every))
    guard = StepGuard(model.parameters(), max_norm=1.0, faults=faults,  # +
                      poison=[model.module.lm_head], on_grad_norms=monitor.observe_grad_norms)
    batch = 16  # sequences per step, all ranks
    for step in range(manager.load() + 1, args.steps + 1):  # + load: 0 on a fresh start
        faults.on_step(step, rank=rank)  # + crash / hang / slow when scheduled
        session.heartbeat.update(step=step)  # +
        mine = ResumableSampler.shard(sampler.next_indices(batch), rank, world)
        inputs, targets = data.get_batch(mine)
        for attempt in guard.attempts(step):  # + a non-finite gradient: the step once more
            logits = model(input_ids=inputs).logits
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            attempt.check(loss)  # + clip; the non-finite vote rides in the loss all-reduce
        monitor.observe_loss(step, guard.loss)  # + may skip a spike's update (its hook)
        if guard.finite:  # +
            optimizer.step()
        optimizer.zero_grad()
        loss = guard.loss.item()  # the mean over ranks
        monitor.end_step(step=step, loss=loss, tokens=batch * 64)  # + rules, alerts
        if rank == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
        manager.maybe_save(step, last=step == args.steps)  # +
    manager.close()  # + waits for the save in flight
    if rank == 0:  # + the final weights, for comparing runs bit for bit
        torch.save(model.module.state_dict(), os.path.join(args.run_dir, "final.pt"))
    session.close()  # +
    dist.destroy_process_group()
    keep_alive(model)  # its reducer holds the gloo group: freeing it here can deadlock (torch 2.13)


run_and_end(main)  # + ends cleanly with gloo threads still running (docs/runtime.md)
