"""A tiny, fully seeded training loop whose every step draws from every RNG (python, numpy,
torch: data and dropout), with an optimizer, LR scheduler, grad scaler and a sampler cursor, so
leaving any piece out of a checkpoint makes a resumed run diverge."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn


class Tiny:
    def __init__(self, seed: int = 0, *, frozen_first: bool = False, width: int = 16):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Dropout(0.25),
                                   nn.Linear(width, 4))
        if frozen_first:
            self.model[0].requires_grad_(False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LinearLR(self.opt, start_factor=0.5, total_iters=5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
        self.sampler = {"epoch": 0, "cursor": 0}
        self.step = 0
        self.losses: list[float] = []

    def train_step(self) -> float:
        x = torch.randn(4, 8)
        x[random.randrange(4)] += float(np.random.rand())
        loss = ((self.model(x) - 1.0) ** 2).mean()
        self.opt.zero_grad()
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.sampler["cursor"] += 4
        self.step += 1
        self.losses.append(loss.item())
        return loss.item()

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(),
                "sched": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                "sampler": dict(self.sampler), "step": self.step,
                "config": {"lr": 1e-2, "betas": (0.9, 0.999), "width": 16}}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.scaler.load_state_dict(state["scaler"])
        self.sampler = dict(state["sampler"])
        self.step = state["step"]


def trained(steps: int, seed: int = 0, **kw) -> Tiny:
    tiny = Tiny(seed, **kw)
    for _ in range(steps):
        tiny.train_step()
    return tiny
