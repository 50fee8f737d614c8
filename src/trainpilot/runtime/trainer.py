"""Trainer: the thin reference loop.

It composes pieces a user can also call from their own loop: ``build_layout`` (mesh),
``parallelize`` (the model under the plan), ``build_optimizer`` / ``build_lr_scheduler``,
``clip_grad_norm_``, ``ResumableSampler`` and a dataset; optionally the communication of
``plan.comm`` (DDP hook, or FSDP2 reduce-scatter and counters), a
:class:`~trainpilot.runtime.checkpoint.Checkpointer` (saves every
``checkpoint_every`` steps, restores on start), a
:class:`~trainpilot.runtime.faults.FaultInjector`, a
:class:`~trainpilot.health.HealthMonitor` (its directives are honoured) and an
:class:`~trainpilot.runtime.elastic.ElasticSession` (failures are recovered in process).

One step = ``global_batch_size`` sequences: each data-parallel rank takes its share and
accumulates gradients over ``num_micro_batches`` micro-batches (or hands them to the pipeline
schedule), then one clip and one AdamW step. A step is *committed* by its optimizer update,
exactly once: a collective that fails before reaching the wire is re-issued, a non-finite
gradient makes the step be computed again from the same batch and RNG state, and any other
failure rolls back to the newest checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from trainpilot.runtime.callbacks import Callback, StepRecord
from trainpilot.runtime.config import TrainConfig
from trainpilot.runtime.data import MarkovCorpus, TokenDataset
from trainpilot.runtime.elastic.retry import retry_collective
from trainpilot.runtime.layout import Layout, build_layout
from trainpilot.runtime.optim import (
    build_grad_scaler,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    global_grad_norm,
)
from trainpilot.runtime.parallelize import (
    ParallelModel,
    parallelize,
    sync_expert_grads,
    token_cross_entropy,
    wrap_custom,
)
from trainpilot.runtime.sampler import ResumableSampler
from trainpilot.runtime.stepstats import StepStats
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from trainpilot.runtime.models.moe import MoE


def make_dataset(config: TrainConfig, model: ModelSpec | None, plan: Plan,
                 vocab_size: int | None = None) -> TokenDataset:
    """The dataset named by ``config.data``: the Markov corpus, token files or text
    (:func:`trainpilot.runtime.datasets.open_dataset`). ``vocab_size`` overrides the spec's."""
    vocab = vocab_size or (model.vocab_size if model is not None else 256)
    if config.data == "markov":
        return MarkovCorpus(vocab_size=vocab, seq_len=plan.seq_len, seed=config.seed,
                            num_samples=config.data_num_samples,
                            concentration=config.data_concentration)
    from trainpilot.runtime.datasets import open_dataset

    return open_dataset(config.data, seq_len=plan.seq_len, vocab_size=vocab,
                        dtype=config.data_dtype, tokenizer=config.data_tokenizer,
                        text_field=config.data_text_field, eos_id=config.data_eos_id)


def autocast_dtype(mode: str, plan: Plan, device: torch.device) -> tuple[torch.dtype | None, str]:
    """The autocast dtype (None: fp32), and why (said in the run's output)."""
    if mode == "off":
        return None, "off (asked)"
    if mode == "bf16":
        return torch.bfloat16, "bf16 (asked)"
    if plan.precision == "fp16":  # check_runtime refused it where fp16 would be emulated
        note = "fp16, dynamic loss scaling"
        if device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
            note += " (emulated on this CPU: slow)"
        return torch.float16, note
    if plan.precision != "bf16":
        return None, f"off (plan.precision={plan.precision})"
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return (torch.bfloat16 if ok else None), "bf16" if ok else "off (this GPU has no bf16)"
    if device.type == "cpu":
        ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return (torch.bfloat16 if ok else None), "bf16 (native bf16 CPU)" if ok else (
            "off, fp32: this CPU lacks native bf16 matmul (AVX512-BF16/AMX)")
    return torch.bfloat16, "bf16"


def set_determinism(seed: int, deterministic: bool, device: torch.device) -> None:
    torch.manual_seed(seed)
    if deterministic:
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if "torch._inductor.config" in sys.modules:
            torch.use_deterministic_algorithms(True)
        else:
            # What torch.use_deterministic_algorithms(True) does, without importing inductor
            # for its config flag (0.8 s of every rank's start): the flag comes from the
            # environment whenever inductor is imported (torch.compile in a user's model).
            os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
            torch._C._set_deterministic_algorithms(True)


class Trainer:
    """Train ``model`` (a ModelSpec, or ``model_factory()`` returning your own ``nn.Module`` that
    maps tokens [b, s] to logits [b, s, vocab]) under ``plan``.

    ``layout`` defaults to :func:`build_layout` (a mesh over the initialised process group, or a
    single process). ``dataset`` defaults to ``config.data``. ``cluster`` places ranks for a
    hierarchical comm hook; ``predicted_step_time_s`` is recorded in every step's record.
    ``checkpointer``, ``faults``, ``monitor`` and ``elastic`` are optional (module doc);
    ``comm_hook=False`` leaves DDP's built-in all-reduce (FSDP2's reduce-scatter) in place.
    """

    def __init__(self, *, plan: Plan, config: TrainConfig = TrainConfig(),
                 model: ModelSpec | None = None,
                 model_factory: Callable[[], nn.Module] | None = None,
                 dataset: TokenDataset | None = None, layout: Layout | None = None,
                 callbacks: Sequence[Callback] = (), loss_fn: Callable | None = None,
                 predicted_step_time_s: float | None = None, cluster: ClusterSpec | None = None,
                 checkpointer: Any = None, faults: Any = None, monitor: Any = None,
                 elastic: Any = None, comm_hook: bool = True, preempt: Any = None):
        if (model is None) == (model_factory is None):
            raise ValueError("give exactly one of model (a ModelSpec) and model_factory")
        self.plan, self.config, self.spec = plan, config, model
        self.model_factory, self.cluster = model_factory, cluster
        self.checkpointer, self.faults, self.monitor, self.elastic = (
            checkpointer, faults, monitor, elastic)
        self.preempt = preempt  # a PreemptGuard: its signal stops the run after a checkpoint
        self.preempt_checkpoint: str | None = None  # the last-moment checkpoint's folder
        self.preempt_signal = ""  # which signal stopped the run (any rank's)
        # Rank 0's look for a drain request (runtime.drain): True stops every rank after the
        # step, which is saved; the caller then leaves the job (app.rank.finish).
        self.drain_requested: Callable[[], bool] | None = None
        self.use_comm_hook = comm_hook
        self.loss_fn = loss_fn or token_cross_entropy
        # The callbacks, and the monitor (a HealthMonitor: its on_step_end returns a Directive).
        self.callbacks: list[Callback | Any] = list(callbacks)
        if monitor is not None and monitor not in self.callbacks:
            self.callbacks.append(monitor)
        if monitor is not None and checkpointer is not None and monitor.restore is None:
            # The rollback intervention restores the checkpoint it picked, through ours.
            monitor.restore = lambda step: self.restore(max_step=step, monitor=False)
        if elastic is not None:
            elastic.emit = self.emit
        layout = layout or self.new_layout()
        set_determinism(config.seed, config.deterministic, layout.device)
        self.comm_hook = None
        self._build(layout)
        self.dataset = dataset or make_dataset(config, model, plan,
                                               getattr(model_factory, "vocab_size", None))
        if self.dataset.seq_len != plan.seq_len:
            raise SpecError("plan.seq_len", plan.seq_len,
                            f"the dataset yields sequences of {self.dataset.seq_len} tokens")
        self.sampler = ResumableSampler(self.dataset.num_samples, seed=config.seed,
                                        shuffle=config.shuffle)
        self.autocast_dtype, self.autocast_note = autocast_dtype(config.autocast, plan,
                                                                 self.layout.device)
        self.autocast = self.autocast_dtype is not None
        self.predicted_step_time_s = predicted_step_time_s
        self.step = 0
        self.stop_reason: str | None = None
        self.num_saves = 0
        self.last_save = None  # the newest SaveHandle (set by elastic.steps)
        self._fence_s = 0.0  # this step's wait for a checkpoint copy
        self._step_times: list[float] = []

    def new_layout(self) -> Layout:
        """A layout over the current process group for this trainer's model (again after a
        recovery rebuilt the group). A factory with its own ``parallelize`` (e.g.
        ``runtime.hf_parallel.HFModel``) checks the plan itself; a plain custom module runs
        data parallel only."""
        factory = self.model_factory
        if factory is not None and hasattr(factory, "check"):
            factory.check(self.plan)
        return build_layout(self.plan, model=self.spec if factory is None else None,
                            custom_model=factory is not None
                            and not hasattr(factory, "parallelize"))

    def _build(self, layout: Layout) -> None:
        """Model, optimizers, schedulers and comm hook on ``layout`` (again after a recovery)."""
        plan, config = self.plan, self.config
        self.layout = layout
        # fp16: dynamic loss scaling (a pass-through scaler otherwise); see _unscale.
        self.scaler = build_grad_scaler(plan.precision, layout.device,
                                        distributed=layout.is_distributed)
        self._unscaled = False
        schedule_loss = self._scaled_loss if self.scaler.is_enabled() else self.loss_fn
        # None only between teardown() and the rebuild of a recovery (see _pm).
        self.model: ParallelModel | None
        if self.spec is not None:
            self.model = parallelize(self.spec, layout, seed=config.seed,
                                     max_seq_len=plan.seq_len, loss_fn=schedule_loss)
        else:
            factory = self.model_factory
            assert factory is not None  # __init__: exactly one of model and model_factory
            if hasattr(factory, "parallelize"):  # torchtitan's model protocol
                self.model = factory.parallelize(layout, seed=config.seed, loss_fn=schedule_loss)
            else:
                self.model = wrap_custom(factory(), layout)
        self.model.train()
        # One optimizer per model chunk (interleaved pipelines hold several): parameter names
        # are global, so their state dicts merge without clashes.
        self.optimizers = [build_optimizer(m.named_parameters(), lr=config.lr,
                                           weight_decay=config.weight_decay,
                                           betas=(config.beta1, config.beta2))
                           for m in self.model.modules]
        assert config.warmup_steps is not None  # TrainConfig's validator fills it in
        self.schedulers = [build_lr_scheduler(o, warmup_steps=config.warmup_steps,
                                              total_steps=config.steps,
                                              min_ratio=config.min_lr_ratio)
                           for o in self.optimizers]
        # The pipeline schedule divides gradients by the micro-batch count itself.
        aux_scale = 1.0 if self.model.schedule is not None else 1.0 / plan.num_micro_batches
        for moe in self.model.moe_layers():
            cast("MoE", moe).aux_scale = aux_scale
        if self.use_comm_hook and self.model.data_parallel == "ddp" and layout.is_distributed:
            from trainpilot.runtime.comm import make_comm_hook

            self.comm_hook = make_comm_hook(plan.comm, self.cluster,
                                            process_group=layout.group(layout.grad_axis),
                                            seed=config.seed)
            # data_parallel "ddp": the chunk is the DDP wrapper (parallelize._data_parallel)
            self.comm_hook.register(cast("DistributedDataParallel", self.model.chunks[0]))
        elif self.use_comm_hook and self.model.data_parallel == "fsdp" and plan.zero >= 1:
            from trainpilot.runtime.comm import make_fsdp_comm

            # The same surface as the DDP hook (counters, end_step, close, state_dict).
            group = layout.group("dp_shard") if plan.dp_shard else layout.group(layout.grad_axis)
            self.comm_hook = make_fsdp_comm(plan.comm, self.cluster, process_group=group)
            for chunk in self.model.chunks:
                self.comm_hook.register(chunk)
        if self.monitor is not None:
            self.monitor.scheduler = self.schedulers[0]  # halve_lr scales its base LRs too
        self._hooks: list[Any] | None = None  # set by _prepare_update
        self._norm = torch.zeros(())
        self._params = self.model.parameters()
        # A checkpoint copy may overlap the next forward/backward only if they change no
        # saved tensor: parameters and optimizer state change at the update, buffers may not.
        self.overlap_checkpoint_copy = config.checkpoint_overlap and not any(
            set(m.state_dict(keep_vars=True)) - {n for n, _ in m.named_parameters()}
            for m in self.model.modules)

    def teardown(self) -> None:
        """Release the model, optimizers and hook threads (before the groups are rebuilt)."""
        self._fence()
        if self.comm_hook is not None:
            self.comm_hook.close()
            self.comm_hook = None
        if self.monitor is not None:
            self.monitor.detach()
        for handle in self._hooks or []:
            handle.remove()
        self._hooks = None
        self.model, self.optimizers, self.schedulers = None, [], []

    def _pm(self) -> ParallelModel:
        """The built model (``model`` is None only between teardown() and the rebuild)."""
        pm = self.model
        if pm is None:  # AttributeError, as reading an attribute of None raised before
            raise AttributeError("the trainer's model was torn down; rebuild() it first")
        return pm

    def rebuild(self, layout: Layout) -> None:
        """Build the model, optimizer and hooks again on a new layout (new process group); the
        state is then restored from a checkpoint (:meth:`restore`)."""
        if self.model is not None:
            self.teardown()
        self._build(layout)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer when this rank has one model chunk (None under an interleaved
        pipeline, which keeps one per chunk in ``optimizers``)."""
        return self.optimizers[0] if len(self.optimizers) == 1 else None

    # ---- pieces of a step -------------------------------------------------------------------
    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the next global batch, on the device: its dp share of the
        samples, and with context parallelism its cp share of their tokens."""
        indices = self.sampler.next_indices(self.plan.global_batch_size)
        mine = ResumableSampler.shard(indices, self.layout.dp_rank, self.plan.dp)
        inputs, targets = self.dataset.get_batch(mine)
        if self.plan.cp > 1 and self.spec is not None:
            from trainpilot.runtime.models.context import shard_sequence

            cp_rank, cp = self.layout.cp_rank, self.plan.cp
            inputs = shard_sequence(inputs, cp_rank=cp_rank, cp=cp)
            targets = shard_sequence(targets, cp_rank=cp_rank, cp=cp)
        return inputs.to(self.layout.device), targets.to(self.layout.device)

    def _autocast_ctx(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.layout.device.type, dtype=self.autocast_dtype)

    def _scaled_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The pipeline schedule's loss under fp16: scaled before its backward."""
        return self.scaler.scale(self.loss_fn(logits, targets))

    def _unscale(self) -> None:
        """fp16: divide the gradients by the loss scale, once per step, before anything reads
        them; the scaler records (and all-reduces) whether any is non-finite."""
        if self.scaler.is_enabled() and not self._unscaled:
            for opt in self.optimizers:
                self.scaler.unscale_(opt)
            self._unscaled = True

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Gradients of the mean loss over this rank's batch; returns that loss (0 on pipeline
        ranks without the last stage)."""
        pm = self._pm()
        if pm.schedule is not None:
            losses: list[torch.Tensor] = []
            target = targets if pm.has_last_stage else None
            with self._autocast_ctx():
                if pm.has_first_stage:
                    pm.schedule.step(inputs, target=target, losses=losses)
                else:
                    pm.schedule.step(target=target, losses=losses)
            if not losses:
                return torch.zeros(())
            mean = torch.stack(losses).mean().detach()
            return mean / self.scaler.get_scale() if self.scaler.is_enabled() else mean
        n, chunk = self.plan.num_micro_batches, pm.chunks[0]
        total = torch.zeros((), device=inputs.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            with _grad_sync(chunk, pm.data_parallel, last=i == n - 1):
                with self._autocast_ctx():
                    logits = chunk(x)
                loss = self.loss_fn(logits, y)
                (self.scaler.scale(loss) / n).backward()  # scale(): identity unless fp16
            total += loss.detach()
        return total / n

    def clip(self) -> float:
        """Expert-gradient sync and clipping; returns the global pre-clip grad norm."""
        pm = self._pm()
        self._unscale()
        sync_expert_grads(pm)
        return float(clip_grad_norm_(pm.parameters(), self.config.grad_clip,
                                     expert_params=pm.expert_params,
                                     ep_group=self.layout.group("ep"),
                                     pp_group=self.layout.group("pp")))

    def _norm_groups(self) -> dict[str, Any]:
        return dict(expert_params=self._pm().expert_params, ep_group=self.layout.group("ep"),
                    pp_group=self.layout.group("pp"))

    def grad_norm(self) -> float:
        """Expert-gradient sync, then the global gradient norm (identical on every rank, with
        the gradients of this rank's replica); clipping happens inside ``optimizer.step()``,
        after the health monitor saw the unclipped gradients."""
        self._unscale()
        pm = self._pm()
        sync_expert_grads(pm)
        self._params = pm.parameters()  # the clip hook of this step reuses the list
        self._norm = global_grad_norm(self._params, **self._norm_groups())
        return float(self._norm)

    def _clip_hook(self, optimizer, args, kwargs) -> None:
        """Optimizer pre-step hook, after the monitor's: clip to ``config.grad_clip`` with the
        norm of this step (measured again if a monitor intervention changed the gradients)."""
        if self.config.grad_clip is None or optimizer is not self.optimizers[0]:
            return
        params = [p for p in self._params if p.grad is not None]
        if not params:
            return  # the update is skipped (the monitor dropped the gradients)
        norm = self._norm
        if self.monitor is not None and self.monitor.config.interventions.clip.enabled:
            norm = global_grad_norm(self._params, **self._norm_groups())
        for kind in (True, False):  # one foreach kernel cannot mix DTensor and plain tensors
            subset = [p for p in params if isinstance(p.grad, DTensor) == kind]
            if subset:
                torch.nn.utils.clip_grads_with_norm_(subset, self.config.grad_clip, norm)

    def _prepare_update(self) -> None:
        """Once per build, before the first real update: the monitor's optimizer hooks, then
        the clip hook (hooks run in registration order). Not earlier: torch's state_dict
        helpers initialise a fresh optimizer with a zero-gradient step that the monitor must
        not see as a training step."""
        if self._hooks is not None:
            return
        if self.monitor is not None and self.optimizer is not None:
            self.monitor.attach(self.model, self.optimizer)
        self._hooks = [opt.register_step_pre_hook(self._clip_hook) for opt in self.optimizers]

    def apply_update(self) -> bool:
        """Clip, AdamW and the LR schedule: this commits the step. Returns False when the fp16
        loss scaler skipped the update (a non-finite gradient on some rank: every rank skips,
        the scale is halved and, as in Megatron, the LR schedule does not advance)."""
        self._fence_s += self._fence()  # an overlapped checkpoint copy must finish first
        self._prepare_update()
        self._unscale()
        scale = self.scaler.get_scale()
        for opt in self.optimizers:
            self.scaler.step(opt)  # opt.step() unless the scaler found inf/NaN
        self.scaler.update()
        applied = not self.scaler.is_enabled() or self.scaler.get_scale() >= scale
        for opt, sched in zip(self.optimizers, self.schedulers):
            if applied:
                sched.step()
            opt.zero_grad(set_to_none=True)
        self._unscaled = False
        return applied

    def optimizer_step(self) -> float:
        """Expert-gradient sync, clip, AdamW, LR schedule; returns the pre-clip grad norm."""
        norm = self.grad_norm()
        self.apply_update()
        return norm

    def _reduce_stats(self, loss: torch.Tensor, nonfinite: bool, step: int) -> StepStats:
        """Issue the step's one small all-reduce (loss, MoE aux loss, non-finite flag) without
        waiting: it overlaps the optimizer update (:meth:`StepStats.wait` collects it). A failure
        before the wire is retried here (``elastic.retry``)."""
        device = self.layout.device
        aux = sum((cast("MoE", m).take_aux_loss().to(device) for m in self._pm().moe_layers()),
                  torch.zeros((), device=device))
        preempt = float(self.preempt is not None and self.preempt.requested)
        drain = float(self.drain_requested is not None and self.drain_requested())
        stats = torch.stack([loss.float().to(device), aux.float(),
                             torch.tensor(float(nonfinite), device=device),
                             torch.tensor(preempt, device=device),
                             torch.tensor(drain, device=device)])
        num_moe = self.spec.num_moe_layers if self.spec is not None else 0
        out = StepStats(stats, nonfinite=nonfinite, num_moe=num_moe,
                        strict=not self.scaler.is_enabled())
        if not self.layout.is_distributed:
            return out
        rank, faults = self.layout.rank, self.faults
        max_retries = self.elastic.config.max_collective_retries if self.elastic else 0

        def on_retry(attempt: int, err: BaseException) -> None:
            out.retries = attempt
            self.emit("collective_retry", dict(step=step, rank=rank, attempt=attempt,
                                               error=str(err)[:200]))

        def issue() -> Any:
            return dist.all_reduce(stats, async_op=True)

        out.work = retry_collective(issue, step=step, max_retries=max_retries,
                                    before=(lambda: faults.before_collective(step, rank=rank))
                                    if faults is not None else None, on_retry=on_retry)
        # Every dp x cp x tp rank of the last stage; cp ranks hold equal token counts.
        out.replicas = self.plan.dp * self.plan.cp * self.plan.tp
        out.world, out.phase = dist.get_world_size(), self.set_phase
        return out

    def _position(self) -> tuple[dict[str, Any], Any]:
        """Where the data and the RNG are: enough to compute a step again."""
        return self.sampler.state_dict(), _rng_state()

    def _rewind(self, position: tuple[dict[str, Any], Any]) -> None:
        self.sampler.load_state_dict(position[0])
        _set_rng_state(position[1])
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def _gradients(self, step: int) -> tuple[int, float, float, float, StepStats]:
        """This step's gradients, reduced: forward/backward of the step's batch, computed once
        more from the same batch and RNG state if the gradient came out non-finite. Returns
        (attempts, data wait s, forward/backward s, pre-clip grad norm, the stats in flight)."""
        rank = self.layout.rank
        poison = (self.faults.poison_backward(self._pm().modules, step, rank=rank)
                  if self.faults is not None else [])
        recompute = self.elastic is None or self.elastic.config.recompute_nonfinite
        # Under fp16 a non-finite gradient is the loss scaler's business (skip, halve).
        recompute = recompute and not self.scaler.is_enabled()
        try:
            for attempt in (1, 2):
                position = self._position()
                t0 = time.perf_counter()
                inputs, targets = self.next_batch()
                data_wait = time.perf_counter() - t0
                self.set_phase("collective")  # DDP/FSDP/pipeline wait on peers inside it
                loss = self.forward_backward(inputs, targets)
                fb_s = time.perf_counter() - t0 - data_wait
                self.set_phase("compute")
                if self.faults is not None:
                    self.faults.poison_gradients(self._pm().parameters(), step, rank=rank)
                grad_norm = self.grad_norm()
                # The norm is of the reduced gradients (DDP all-reduce, FSDP reduce-scatter,
                # TP/PP/EP norm all-reduces): identical on every rank, so each rank decides
                # alone and the stats all-reduce only checks that they agreed.
                nonfinite = not math.isfinite(grad_norm)
                stats = self._reduce_stats(loss, nonfinite, step)
                if not (nonfinite and attempt == 1 and recompute):
                    return attempt, data_wait, fb_s, grad_norm, stats
                # A transient fault (a flipped bit, a bad device) does not come back when the
                # same batch is computed again; a NaN the data causes does, and then the health
                # monitor (skip batch) decides. All ranks recompute (wait() checks they agree).
                stats.wait(step)
                self.emit("nonfinite_recompute", dict(step=step, grad_norm=grad_norm))
                self._rewind(position)
        finally:
            for handle in poison:
                handle.remove()
        raise AssertionError("unreachable")

    def train_step(self) -> StepRecord:
        """One optimizer step; returns its record (after calling the callbacks)."""
        step, rank = self.step + 1, self.layout.rank
        start = time.perf_counter()
        self._fence_s = 0.0
        self.set_phase("compute")
        if self.faults is not None:
            self.faults.on_step(step, rank=rank, step_time_s=self._usual_step_time_s())
        # A slowed rank (an injected slow fault, a throttled device) is slow in its compute:
        # what it did before its forward counts there, so the straggler rule sees it.
        before_s = time.perf_counter() - start
        lr = self.optimizers[0].param_groups[0]["lr"]
        attempt, data_wait, fb_s, grad_norm, stats = self._gradients(step)
        fb_s += before_s
        skipped = False
        if self.monitor is not None:
            # The monitor's verdict (e.g. skip a loss spike) gates the update: wait for it.
            self._prepare_update()
            skipped = self.monitor.observe_loss(step, stats.wait(step)[0])
        if not self.apply_update():
            skipped = True
            self.emit("loss_scale_skip", dict(step=step, grad_norm=grad_norm,
                                              new_scale=self.scaler.get_scale()))
        loss_value, aux = stats.wait(step)
        if stats.num_preempted:  # a rank was signalled: every rank stops after this step
            self.stop_reason = "preempted"
        elif stats.num_drain:  # rank 0 saw a drain request: the same, then leave the host
            self.stop_reason = "drain"
        comm = self.comm_hook.end_step() if self.comm_hook is not None else None
        _synchronize(self.layout.device)
        # A wait for the checkpoint copy is the checkpoint's stall, not the step's.
        elapsed = time.perf_counter() - start - self._fence_s
        self.step = step
        self._step_times = (self._step_times + [elapsed])[-16:]
        comm_s = comm.comm_s if comm is not None else None
        comm_max = max(stats.wait_s, comm.max_bucket_s if comm is not None else 0.0)
        timings = self._rank_timings(step, elapsed, fb_s, comm_s, data_wait)  # a collective
        tokens = self.plan.tokens_per_step
        record = StepRecord(step=step, loss=loss_value, lr=lr, grad_norm=grad_norm,
                            step_time_s=elapsed, data_wait_s=data_wait, tokens=tokens,
                            tokens_per_s=tokens / elapsed,
                            predicted_step_time_s=self.predicted_step_time_s, aux_loss=aux,
                            epoch=self.sampler.epoch,
                            samples_seen=self.sampler_position(),
                            compute_time_s=max(0.0, fb_s - (comm_s or 0.0)),
                            comm_time_s=comm_s, comm_max_s=comm_max,
                            comm_bytes=comm.wire_bytes if comm is not None else None,
                            comm_payload_bytes=comm.payload_bytes if comm is not None else None,
                            rank_timings=timings, attempts=attempt,
                            collective_retries=stats.retries, skipped_update=skipped,
                            checkpoint_wait_s=self._fence_s)
        if not np.isfinite(loss_value):
            self.emit("nonfinite_loss", dict(step=self.step, loss=loss_value))
        directive = None
        for cb in self.callbacks:
            out = cb.on_step_end(self, record)
            if cb is self.monitor:
                directive = out
        if self.elastic is not None and self.elastic.heartbeat is not None:
            self.elastic.heartbeat.update(step=self.step)
        self._honour(directive)
        return record

    def sampler_position(self) -> int:
        """Samples consumed since the start (all ranks), as the sampler counts them."""
        state = self.sampler.state_dict()
        return int(state["epoch"]) * self.dataset.num_samples + int(state["position"])

    def _usual_step_time_s(self) -> float | None:
        return float(np.median(self._step_times)) if self._step_times else None

    def _fence(self) -> float:
        """Wait for a checkpoint copy still running (``checkpoint_overlap``) before a saved
        tensor changes; returns the seconds waited."""
        return self.checkpointer.fence() if self.checkpointer is not None else 0.0

    def _rank_timings(self, step: int, step_s: float, fb_s: float, comm_s: float | None,
                      data_s: float) -> Any:
        """Every rank's timings on rank 0 (one all-gather of 4 floats), for the monitor's
        straggler rule; None elsewhere or without a monitor."""
        if self.monitor is None or not self.layout.is_distributed:
            return None
        from trainpilot.runtime.ranktimes import gather_rank_timings

        self.set_phase("collective")
        out = gather_rank_timings(step, step_s=step_s, compute_s=max(0.0, fb_s - (comm_s or 0)),
                                  comm_s=comm_s or 0.0, data_s=data_s)
        self.set_phase("compute")
        return out

    def set_phase(self, name: str) -> None:
        """Tell the heartbeat whether this rank may now wait on its peers (``"collective"``)
        or computes alone (``"compute"``); a hang is judged only in the latter."""
        if self.elastic is not None:
            self.elastic.phase(name)

    def _honour(self, directive: Any) -> None:
        """A health directive: a rollback restored the state already (through
        :meth:`restore_to`); skip the data window it names."""
        if directive is None or getattr(directive, "rollback_to", None) is None:
            return
        for _ in range(directive.skip_batches):
            self.sampler.next_indices(self.plan.global_batch_size)
        self.emit("data_skipped", dict(step=self.step, batches=directive.skip_batches))

    # ---- the loop ---------------------------------------------------------------------------
    def emit(self, kind: str, payload: dict[str, Any]) -> None:
        for cb in self.callbacks:
            cb.on_event(kind, payload)

    def request_stop(self, reason: str) -> None:
        """Stop after the current step (callbacks call this: a health rule, a time budget)."""
        self.stop_reason = reason

    def fit(self, steps: int | None = None) -> dict[str, Any]:
        """Run until ``steps`` (default ``config.steps``) optimizer steps are done or a stop is
        requested; returns a summary (first/last loss, median step time and tokens/s).

        With a checkpointer the newest checkpoint is restored first (a restarted or replacement
        process resumes), and one is saved every ``checkpoint_every`` steps. With an elastic
        session a failure is recovered in process and training goes on."""
        from trainpilot.runtime.elastic.steps import (
            recover_or_raise,
            report_failed_save,
            resume,
            save_if_due,
            save_now,
        )

        target = steps if steps is not None else self.config.steps
        for cb in self.callbacks:
            cb.on_train_start(self)
        self.emit("autocast", dict(setting=self.autocast_note))
        resume(self)
        records: dict[int, StepRecord] = {}
        while self.step < target and self.stop_reason is None:
            try:
                record = self.train_step()
                records[record.step] = record  # a step run again after a rollback replaces it
                save_if_due(self)
            except Exception as err:  # noqa: BLE001 - recover_or_raise re-raises what it cannot
                recover_or_raise(self, err)
        if self.stop_reason == "preempted":
            self.emit("preempted", dict(step=self.step, signal=self.preempt.signal_name
                                        if self.preempt is not None else None))
            save_now(self)
        elif self.stop_reason == "drain":
            self.emit("drain", dict(step=self.step))
            save_now(self)
        if self.checkpointer is not None:
            self.set_phase("collective")
            report_failed_save(self, wait=True)
        summary = summarize([records[s] for s in sorted(records)], self.predicted_step_time_s)
        if self.stop_reason:
            summary["stopped"] = self.stop_reason
        for cb in self.callbacks:
            cb.on_train_end(self, summary)
        return summary

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self, *, rng: bool = True) -> dict[str, Any]:
        """Everything needed to resume bit-exactly: model and optimizer (this rank's shards, with
        global names, via torch.distributed.checkpoint.state_dict), LR schedule, sampler
        position, RNG state and step. ``rng=False`` leaves the RNG out: it differs per rank, and
        the checkpointer captures every rank's own (in the global state it would be
        deduplicated as a replicated tensor)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        model_state: dict[str, Any] = {}
        optim_state: dict[str, Any] = {}
        for chunk, opt in zip(self._pm().chunks, self.optimizers):
            model_state.update(get_model_state_dict(chunk, options=options))
            optim_state.update(get_optimizer_state_dict(chunk, opt, options=options))
        self._experts_as_dtensors(model_state, optim_state)
        out: dict[str, Any] = dict(
            model=model_state, optimizer=optim_state, scheduler=self.schedulers[0].state_dict(),
            sampler=self.sampler.state_dict(), step=self.step)
        if self.scaler.is_enabled():  # fp16: the loss scale and its growth counter
            out["grad_scaler"] = self.scaler.state_dict()
        if rng:
            out["rng"] = dict(cpu=torch.get_rng_state())
            if self.layout.device.type == "cuda":
                out["rng"]["cuda"] = torch.cuda.get_rng_state(self.layout.device)
        return out

    def _experts_as_dtensors(self, model_state: dict[str, Any],
                             optim_state: dict[str, Any]) -> None:
        """Expert weights under expert parallelism are plain tensors holding each rank's own
        experts under the same name on every rank: DCP would take them for one replicated
        tensor and save rank 0's only (every other rank then restored rank 0's experts). As
        DTensors sharded over ``ep`` each rank's experts are saved at their offset, and the
        checkpoint reshards like any other; their AdamW moments likewise."""
        expert_params = self._pm().expert_params
        if not expert_params or self.layout.size("ep") == 1:
            return
        from torch.distributed.tensor import Shard

        mesh = self.layout.submesh("ep")
        ptrs = {p.data_ptr() for p in expert_params}
        names = {k for k, v in model_state.items() if torch.is_tensor(v)
                 and not isinstance(v, DTensor) and v.data_ptr() in ptrs}

        def shard(t: torch.Tensor) -> DTensor:
            return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)

        for key in names:
            model_state[key] = shard(model_state[key])
        for key, value in optim_state.items():
            if key.startswith("state.") and torch.is_tensor(value) and value.dim() > 0 \
                    and key[len("state."):].rsplit(".", 1)[0] in names:
                optim_state[key] = shard(value)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self._fence()

        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        state = dict(state, model=_local_experts(state["model"]),
                     optimizer=_local_experts(state["optimizer"]))
        for chunk, opt in zip(self._pm().chunks, self.optimizers):
            set_model_state_dict(chunk, state["model"], options=options)
            set_optimizer_state_dict(chunk, opt, state["optimizer"], options=options)
        for sched in self.schedulers:
            sched.load_state_dict(state["scheduler"])
        self.sampler.load_state_dict(state["sampler"])
        if self.scaler.is_enabled() and "grad_scaler" in state:
            # A fresh scaler: a failure between unscale_ and update leaves per-step state.
            self.scaler = build_grad_scaler(self.plan.precision, self.layout.device,
                                            distributed=self.layout.is_distributed)
            self.scaler.load_state_dict(state["grad_scaler"])
            self._unscaled = False
        if "rng" in state:
            torch.set_rng_state(state["rng"]["cpu"])
            if "cuda" in state["rng"] and self.layout.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng"]["cuda"], self.layout.device)
        self.step = int(state["step"])

    def rank_state(self) -> dict[str, Any]:
        """What differs per rank and is not in :meth:`state_dict`: the comm hook's state (top-k
        residuals) and the health monitor's (windows, alerts, rollback targets). The
        checkpointer saves it per rank."""
        out: dict[str, Any] = {
            "comm": self.comm_hook.state_dict() if self.comm_hook is not None else {}}
        if self.monitor is not None:
            out["monitor"] = self.monitor.state_dict()
        return out

    def load_rank_state(self, state: dict[str, Any] | None, *, monitor: bool = True) -> None:
        """``monitor=False``: leave the monitor as it is (its own rollback: it has already
        rewound itself, and it keeps the alert it acted on)."""
        if state and self.comm_hook is not None and state.get("comm"):
            self.comm_hook.load_state_dict(state["comm"])
        if state and monitor and self.monitor is not None and state.get("monitor"):
            self.monitor.load_state_dict(state["monitor"])

    def restore(self, *, max_step: int | None = None, source: str = "auto",
                monitor: bool = True) -> Any:
        """Restore the newest checkpoint (at or before ``max_step``) through the checkpointer;
        returns its ``Restored`` or None (nothing saved yet: the initial state is rebuilt).
        ``monitor``: also the health monitor's state. Collective over the checkpointer's
        group."""
        from trainpilot.runtime.elastic.steps import restore

        return restore(self, max_step=max_step, source=source, monitor=monitor)

    def reset(self) -> None:
        """Back to the state at construction (seeded weights, first sample, step 0)."""
        set_determinism(self.config.seed, self.config.deterministic, self.layout.device)
        random.seed(self.config.seed)
        np.random.seed(self.config.seed % 2**32)
        self.rebuild(self.layout)
        self.sampler = ResumableSampler(self.dataset.num_samples, seed=self.config.seed,
                                        shuffle=self.config.shuffle)
        self.step = 0


def _local_experts(section: dict[str, Any]) -> dict[str, Any]:
    """Expert DTensors (:meth:`Trainer._experts_as_dtensors`) back to this rank's tensors;
    FSDP's and TP's DTensors stay as they are."""
    out = {}
    for key, value in section.items():
        if isinstance(value, DTensor) and value.device_mesh.mesh_dim_names == ("ep",):
            value = value.to_local()
        out[key] = value
    return out


def _rng_state() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Any, ...]) -> None:
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])
    if state[3] is not None:
        torch.cuda.set_rng_state_all(state[3])


def _grad_sync(chunk: nn.Module, kind: str, *, last: bool):
    """Accumulate locally on all but the last micro-batch (DDP no_sync / FSDP2 sync flag)."""
    if kind == "ddp" and not last:
        return cast("DistributedDataParallel", chunk).no_sync()
    if kind == "fsdp":  # fully_shard or replicate: an FSDPModule
        cast("FSDPModule", chunk).set_requires_gradient_sync(last)
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
