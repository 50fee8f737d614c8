"""Trainer: the thin reference loop.

It composes pieces a user can also call from their own loop: ``build_layout`` (mesh),
``parallelize`` (the model under the plan), ``build_optimizer`` / ``build_lr_scheduler``,
``clip_grad_norm_``, ``ResumableSampler`` and a dataset. One step = ``global_batch_size``
sequences: each data-parallel rank takes its share and accumulates gradients over
``num_micro_batches`` micro-batches (or hands them to the pipeline schedule), then one clip and
one AdamW step. Everything that must be saved to resume is in :meth:`Trainer.state_dict`.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from trainpilot.runtime.callbacks import Callback, StepRecord
from trainpilot.runtime.config import TrainConfig
from trainpilot.runtime.data import MarkovCorpus, TokenDataset, TokenFileDataset
from trainpilot.runtime.layout import Layout, build_layout
from trainpilot.runtime.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_
from trainpilot.runtime.parallelize import (
    ParallelModel, parallelize, sync_expert_grads, token_cross_entropy, wrap_custom)
from trainpilot.runtime.sampler import ResumableSampler
from trainpilot.specs import ModelSpec, Plan, SpecError


def make_dataset(config: TrainConfig, model: ModelSpec | None, plan: Plan) -> TokenDataset:
    """The dataset named by ``config.data``: the Markov corpus or a ``.bin`` token file."""
    vocab = model.vocab_size if model is not None else 256
    if config.data == "markov":
        return MarkovCorpus(vocab_size=vocab, seq_len=plan.seq_len, seed=config.seed,
                            num_samples=config.data_num_samples,
                            concentration=config.data_concentration)
    return TokenFileDataset(config.data, seq_len=plan.seq_len, vocab_size=vocab,
                            dtype=config.data_dtype)


def use_bf16_autocast(mode: str, plan: Plan, device: torch.device) -> tuple[bool, str]:
    """Whether to autocast to bf16, and why (said in the run's output)."""
    if mode == "off" or plan.precision != "bf16":
        return False, "off (asked)" if mode == "off" else f"off (plan.precision={plan.precision})"
    if mode == "bf16":
        return True, "bf16 (asked)"
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, "bf16" if ok else "off (this GPU has no bf16)"
    if device.type == "cpu":
        ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return ok, "bf16 (native bf16 CPU)" if ok else (
            "off, fp32: this CPU lacks native bf16 matmul (AVX512-BF16/AMX)")
    return True, "bf16"


def set_determinism(seed: int, deterministic: bool, device: torch.device) -> None:
    torch.manual_seed(seed)
    if deterministic:
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


class Trainer:
    """Train ``model`` (a ModelSpec, or ``model_factory()`` returning your own ``nn.Module`` that
    maps tokens [b, s] to logits [b, s, vocab]) under ``plan``.

    ``layout`` defaults to :func:`build_layout` (a mesh over the initialised process group, or a
    single process). ``dataset`` defaults to ``config.data``. ``cluster`` and
    ``predicted_step_time_s`` are recorded in every step's record.
    """

    def __init__(self, *, plan: Plan, config: TrainConfig = TrainConfig(),
                 model: ModelSpec | None = None,
                 model_factory: Callable[[], nn.Module] | None = None,
                 dataset: TokenDataset | None = None, layout: Layout | None = None,
                 callbacks: Sequence[Callback] = (), loss_fn: Callable | None = None,
                 predicted_step_time_s: float | None = None):
        if (model is None) == (model_factory is None):
            raise ValueError("give exactly one of model (a ModelSpec) and model_factory")
        self.plan, self.config, self.spec = plan, config, model
        self.layout = layout or build_layout(plan, model=model,
                                             custom_model=model_factory is not None)
        set_determinism(config.seed, config.deterministic, self.layout.device)
        self.loss_fn = loss_fn or token_cross_entropy
        if model is not None:
            self.model: ParallelModel = parallelize(model, self.layout, seed=config.seed,
                                                    max_seq_len=plan.seq_len, loss_fn=self.loss_fn)
        else:
            self.model = wrap_custom(model_factory(), self.layout)
        self.model.train()
        # One optimizer per model chunk (interleaved pipelines hold several): parameter names
        # are global, so their state dicts merge without clashes.
        self.optimizers = [build_optimizer(m.named_parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay,
                                           betas=(config.beta1, config.beta2))
                           for m in self.model.modules]
        self.schedulers = [build_lr_scheduler(o, warmup_steps=config.warmup_steps,
                                              total_steps=config.steps,
                                              min_ratio=config.min_lr_ratio)
                           for o in self.optimizers]
        self.dataset = dataset or make_dataset(config, model, plan)
        if self.dataset.seq_len != plan.seq_len:
            raise SpecError("plan.seq_len", plan.seq_len,
                            f"the dataset yields sequences of {self.dataset.seq_len} tokens")
        self.sampler = ResumableSampler(self.dataset.num_samples, seed=config.seed,
                                        shuffle=config.shuffle)
        self.callbacks = list(callbacks)
        self.autocast, self.autocast_note = use_bf16_autocast(config.autocast, plan,
                                                              self.layout.device)
        self.predicted_step_time_s = predicted_step_time_s
        self.step = 0
        self.stop_reason: str | None = None
        # The pipeline schedule divides gradients by the micro-batch count itself.
        aux_scale = 1.0 if self.model.schedule is not None else 1.0 / plan.num_micro_batches
        for moe in self.model.moe_layers():
            moe.aux_scale = aux_scale

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer when this rank has one model chunk (None under an interleaved
        pipeline, which keeps one per chunk in ``optimizers``)."""
        return self.optimizers[0] if len(self.optimizers) == 1 else None

    # ---- pieces of a step -------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch, on the device."""
        indices = self.sampler.next_indices(self.plan.global_batch_size)
        mine = ResumableSampler.shard(indices, self.layout.dp_rank, self.plan.dp)
        inputs, targets = self.dataset.get_batch(mine)
        return inputs.to(self.layout.device), targets.to(self.layout.device)

    def _autocast_ctx(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.layout.device.type, dtype=torch.bfloat16)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Gradients of the mean loss over this rank's batch; returns that loss (0 on pipeline
        ranks without the last stage)."""
        pm = self.model
        if pm.schedule is not None:
            losses: list[torch.Tensor] = []
            target = targets if pm.has_last_stage else None
            with self._autocast_ctx():
                if pm.has_first_stage:
                    pm.schedule.step(inputs, target=target, losses=losses)
                else:
                    pm.schedule.step(target=target, losses=losses)
            return torch.stack(losses).mean().detach() if losses else torch.zeros(())
        n, chunk = self.plan.num_micro_batches, pm.chunks[0]
        total = torch.zeros((), device=inputs.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            with _grad_sync(chunk, pm.data_parallel, last=i == n - 1):
                with self._autocast_ctx():
                    logits = chunk(x)
                loss = self.loss_fn(logits, y)
                (loss / n).backward()
            total += loss.detach()
        return total / n

    def optimizer_step(self) -> float:
        """Expert-gradient sync, clip, AdamW, LR schedule; returns the pre-clip grad norm."""
        pm = self.model
        sync_expert_grads(pm)
        norm = clip_grad_norm_(pm.parameters(), self.config.grad_clip,
                               expert_params=pm.expert_params, ep_group=self.layout.group("ep"),
                               pp_group=self.layout.group("pp"))
        for opt, sched in zip(self.optimizers, self.schedulers):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        return float(norm)

    def _start_stats(self, loss: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start summing [loss, MoE aux loss] over all ranks. Asynchronous: it overlaps with
        clipping and the optimizer step instead of adding a synchronisation point."""
        device = self.layout.device
        aux = sum((m.take_aux_loss().to(device) for m in self.model.moe_layers()),
                  torch.zeros((), device=device))
        stats = torch.stack([loss.float().to(device), aux.float()])
        work = dist.all_reduce(stats, async_op=True) if self.layout.is_distributed else None
        return stats, work

    def _finish_stats(self, stats: torch.Tensor, work: Any) -> tuple[float, float | None]:
        """Global-batch mean loss and mean MoE aux loss, the same on every rank."""
        replicas = 1
        if work is not None:
            work.wait()
            replicas = self.plan.dp * self.plan.tp  # every dp x tp rank of the last stage
        stats = stats.cpu() / replicas
        num_moe = self.spec.num_moe_layers if self.spec is not None else 0
        return float(stats[0]), (float(stats[1]) / num_moe if num_moe else None)

    def train_step(self) -> StepRecord:
        """One optimizer step; returns its record (after calling the callbacks)."""
        start = time.perf_counter()
        inputs, targets = self.next_batch()
        data_wait = time.perf_counter() - start
        lr = self.optimizers[0].param_groups[0]["lr"]
        loss = self.forward_backward(inputs, targets)
        pending = self._start_stats(loss)
        grad_norm = self.optimizer_step()
        loss_value, aux = self._finish_stats(*pending)
        _synchronize(self.layout.device)
        elapsed = time.perf_counter() - start
        self.step += 1
        tokens = self.plan.tokens_per_step
        record = StepRecord(step=self.step, loss=loss_value, lr=lr, grad_norm=grad_norm,
                            step_time_s=elapsed, data_wait_s=data_wait, tokens=tokens,
                            tokens_per_s=tokens / elapsed,
                            predicted_step_time_s=self.predicted_step_time_s, aux_loss=aux,
                            epoch=self.sampler.epoch,
                            samples_seen=self.step * self.plan.global_batch_size)
        if not np.isfinite(loss_value):
            self.emit("nonfinite_loss", dict(step=self.step, loss=loss_value))
        for cb in self.callbacks:
            cb.on_step_end(self, record)
        return record

    # ---- the loop ---------------------------------------------------------------------------
    def emit(self, kind: str, payload: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_event(kind, payload)

    def request_stop(self, reason: str) -> None:
        """Stop after the current step (callbacks call this: a health rule, a time budget)."""
        self.stop_reason = reason

    def fit(self, steps: int | None = None) -> dict[str, Any]:
        """Run until ``steps`` (default ``config.steps``) optimizer steps are done or a stop is
        requested; returns a summary (first/last loss, median step time and tokens/s)."""
        target = steps if steps is not None else self.config.steps
        for cb in self.callbacks:
            cb.on_train_start(self)
        self.emit("autocast", dict(setting=self.autocast_note))
        records = []
        while self.step < target and self.stop_reason is None:
            records.append(self.train_step())
        summary = summarize(records, self.predicted_step_time_s)
        if self.stop_reason:
            summary["stopped"] = self.stop_reason
        for cb in self.callbacks:
            cb.on_train_end(self, summary)
        return summary

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly: model and optimizer (this rank's shards, with
        global names, via torch.distributed.checkpoint.state_dict), LR schedule, sampler
        position, RNG state and step."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        model_state: dict[str, Any] = {}
        optim_state: dict[str, Any] = {}
        for chunk, opt in zip(self.model.chunks, self.optimizers):
            model_state.update(get_model_state_dict(chunk, options=options))
            optim_state.update(get_optimizer_state_dict(chunk, opt, options=options))
        rng = dict(cpu=torch.get_rng_state())
        if self.layout.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.layout.device)
        return dict(model=model_state, optimizer=optim_state,
                    scheduler=self.schedulers[0].state_dict(), sampler=self.sampler.state_dict(),
                    rng=rng, step=self.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        for chunk, opt in zip(self.model.chunks, self.optimizers):
            set_model_state_dict(chunk, state["model"], options=options)
            set_optimizer_state_dict(chunk, opt, state["optimizer"], options=options)
        for sched in self.schedulers:
            sched.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.layout.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.layout.device)
        self.step = int(state["step"])


def _grad_sync(chunk: nn.Module, kind: str, *, last: bool):
    """Accumulate locally on all but the last micro-batch (DDP no_sync / FSDP2 sync flag)."""
    if kind == "ddp" and not last:
        return chunk.no_sync()
    if kind == "fsdp":
        chunk.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(records: list[StepRecord], predicted: float | None) -> dict[str, Any]:
    """First/last/min loss and median step time and throughput of a run (first step, which
    includes warm-up, excluded from the medians when there are more)."""
    if not records:
        return dict(steps=0)
    timed = records[1:] if len(records) > 1 else records
    step_time = float(np.median([r.step_time_s for r in timed]))
    out = dict(steps=records[-1].step, first_loss=records[0].loss, last_loss=records[-1].loss,
               min_loss=min(r.loss for r in records), median_step_time_s=step_time,
               median_tokens_per_s=float(np.median([r.tokens_per_s for r in timed])),
               median_data_wait_s=float(np.median([r.data_wait_s for r in timed])),
               predicted_step_time_s=predicted)
    if predicted:
        out["predicted_over_measured"] = predicted / step_time
    return out
