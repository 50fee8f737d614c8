"""Recovery drills: a short training run on local ranks, with faults, recovered automatically,
leaving behind what an oracle needs to compare it with an uninterrupted run. A test fixture
(the oracle's), built on the same composition root as ``trainpilot train``
(:func:`trainpilot.app.rank.build_rank`): what a drill changes goes through ``RankHooks``.

    spec = DrillSpec(run_dir="runs/d1", plan="dp=2,zero=0,...", steps=20,
                     inject="crash:rank=1,step=7", checkpoint_every=2)
    report = run_drill(spec, world_size=2)       # LocalSupervisor: a dead rank is replaced
    outcome = read_outcome(spec.run_dir)          # final state, losses, samples per step

Each rank runs the real pieces, wired as ``trainpilot train`` wires them: an
:class:`ElasticSession` over the supervisor's store, a :class:`Checkpointer` (memory + peer +
storage, from the plan's checkpoint policy), a :class:`FaultInjector` with a journal, the
:class:`Trainer` with its comm hook, the run store on rank 0 (and the health monitor with
``health=True``). At the end every rank writes
``final_r<rank>.pt``: the full model and optimizer state (sharded tensors gathered), the loss of
every committed step and the global sample indices each step trained on. A step run twice (a
replay after a rollback) keeps its last run: that is the step that was committed.

The default model, :class:`DropoutLM`, draws dropout masks from the global RNG, so a restore
that lost the RNG state diverges (the reference GPT draws no random numbers in training).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainpilot.runtime.checkpoint import Checkpointer
from trainpilot.runtime.trainer import Trainer


class DropoutLM(nn.Module):
    """A tiny language model whose training consumes the RNG: embedding -> dropout -> MLP
    (GELU) -> dropout -> vocabulary head."""

    def __init__(self, vocab_size: int = 64, dim: int = 64, p: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.mix = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens))
        x = x + torch.tanh(self.mix(x)).cumsum(dim=1) / torch.arange(
            1, x.shape[1] + 1, device=x.device).unsqueeze(-1)  # causal mixing (prefix mean)
        x = x + self.drop(self.mlp(x))
        return self.head(x)


@dataclass(kw_only=True)
class DrillSpec:
    """One drill. ``model``: ``"dropout-lm"`` or a model preset/ModelSpec dict.
    ``drop_on_restore``: negative controls (``"sampler"``: restores keep the live sampler
    position; ``"rng"``: restores keep the live RNG state)."""

    run_dir: str
    plan: str
    steps: int = 20  # the run's length (the LR schedule's too)
    stop_at: int | None = None  # stop there (a stage of a resized run); None: at ``steps``
    model: Any = "dropout-lm"
    seed: int = 0
    lr: float = 1e-2
    inject: str = ""
    checkpoint_every: int = 2
    storage_every: int = 1
    in_memory_peer: bool = True
    async_save: bool = True
    incremental: bool = False
    keep_last: int = 3
    elastic: dict[str, Any] = field(default_factory=dict)
    drop_on_restore: tuple[str, ...] = ()
    vocab_size: int = 64
    store: bool = True
    health: bool = False

    def save(self) -> None:
        Path(self.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.run_dir) / "drill.json").write_text(json.dumps(asdict(self), default=list))


class _Log:
    """One process's record of what it did, a JSON line at a time (flushed: a rank killed
    later keeps what it logged). Each line carries the torchrun attempt and the generation, so
    a step run again after a recovery is told apart from its first run."""

    def __init__(self, path: Path, session: Any):
        self.handle = open(path, "a", encoding="utf-8")
        self.session = session

    def write(self, **entry: Any) -> None:
        entry.update(t=time.time(), gen=self.session.gen, attempt=self.session.env.restart_count)
        self.handle.write(json.dumps(entry) + "\n")
        self.handle.flush()


class _RecordingDataset:
    """Wraps a dataset: logs the global sample indices each step reads on this rank."""

    def __init__(self, base: Any, part: Any, log: _Log):
        self.base, self.part, self.log = base, part, log
        self.seq_len, self.num_samples = base.seq_len, base.num_samples

    def get_batch(self, indices):
        trainer = self.part.trainer
        self.log.write(kind="samples", step=trainer.step + 1, dp_rank=trainer.layout.dp_rank,
                       indices=[int(i) for i in indices])
        return self.base.get_batch(indices)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def job_of(spec: DrillSpec) -> Any:
    """The drill as the job document ``trainpilot train`` would write for it."""
    from trainpilot.runtime.config import TrainConfig
    from trainpilot.runtime.workerjob import WorkerJob
    from trainpilot.specs import load_model, load_plan

    plan = load_plan(spec.plan)
    plan = plan.replace(checkpoint=dict(
        plan.checkpoint.to_dict(), interval_steps=spec.checkpoint_every,
        async_save=spec.async_save, in_memory_peer=spec.in_memory_peer,
        incremental=spec.incremental, keep_last=spec.keep_last))
    config = TrainConfig(steps=spec.steps, seed=spec.seed, lr=spec.lr, warmup_steps=2,
                         predict=False, checkpoint_every=spec.checkpoint_every,
                         storage_every=spec.storage_every, data_num_samples=4096)
    model = None if spec.model == "dropout-lm" else load_model(spec.model)
    return WorkerJob(model=model, plan=plan, config=config, run_dir=spec.run_dir,
                     inject=spec.inject, elastic=dict(spec.elastic), health=spec.health)


def rank_main(rank: int, spec_path: str) -> None:
    """What one rank runs (under the LocalSupervisor or torchrun)."""
    import torch.distributed as dist

    from trainpilot.app.rank import RankHooks, build_rank, finish
    from trainpilot.runtime.callbacks import Callback
    from trainpilot.runtime.data import MarkovCorpus

    spec = DrillSpec(**json.loads(Path(spec_path).read_text()))
    spec.drop_on_restore = tuple(spec.drop_on_restore)
    job = job_of(spec)
    run_dir = Path(spec.run_dir)
    vocab = spec.vocab_size if job.model is None else job.model.vocab_size
    logs: dict[str, _Log] = {}

    def log_of(part: Any) -> _Log:
        if "log" not in logs:
            logs["log"] = _Log(run_dir / f"log_r{rank}_a{part.session.env.restart_count}_i"
                                         f"{part.session.gens.incarnation}.jsonl", part.session)
        return logs["log"]

    class Losses(Callback):
        def __init__(self, log: _Log):
            self.log = log

        def on_step_end(self, trainer, record):
            self.log.write(kind="loss", step=record.step, loss=record.loss)

    hooks = RankHooks(
        model_factory=(lambda: DropoutLM(vocab)) if job.model is None else None,
        dataset=MarkovCorpus(vocab_size=vocab, seq_len=job.plan.seq_len, seed=spec.seed,
                             num_samples=4096),
        wrap_dataset=lambda data, part: _RecordingDataset(data, part, log_of(part)),
        callbacks=lambda part: [Losses(log_of(part))],
        trainer_cls=_SamplerKeepingTrainer if "sampler" in spec.drop_on_restore else None,
        checkpointer_cls=_RngDroppingCheckpointer if "rng" in spec.drop_on_restore else None)
    part = build_rank(job, hooks=hooks)
    try:
        trainer, session = part.trainer, part.session
        finish(part, trainer.fit(spec.stop_at))
        final = _full_state(trainer)
        torch.save(dict(state=final, rank=rank, incarnation=session.gens.incarnation,
                        recoveries=session.history, world_size=trainer.layout.world_size,
                        heartbeat_verdicts=[asdict(v) for v in (session.heartbeat.verdicts
                                                                if session.heartbeat else [])]),
                   run_dir / f"final_r{rank}.pt")
        dist.barrier()
        part.close(status="completed")
    finally:
        part.close()


def _full_state(trainer) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors by name, full (DTensors gathered: a collective)."""
    from torch.distributed.tensor import DTensor

    out = {}
    state = trainer.state_dict(rng=False)
    for section in ("model", "optimizer"):
        for key, value in state[section].items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if torch.is_tensor(value):
                out[f"{section}/{key}"] = value.detach().cpu().clone()
    return out


class _RngDroppingCheckpointer(Checkpointer):
    """The RNG negative control: the real Checkpointer, restoring without the RNG state."""

    def restore_latest(self, template=None, **kwargs):
        kwargs["restore_rng"] = False
        return super().restore_latest(template, **kwargs)


class _SamplerKeepingTrainer(Trainer):
    """The sampler negative control: a restore leaves the live sampler position as it is."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        kept = self.sampler.state_dict()
        super().load_state_dict(state)
        self.sampler.load_state_dict(kept)


def warm_up(spec: DrillSpec) -> None:
    """Build the drill's model and train one step in this process, without a process group:
    torch initialises its lazy state (dispatch tables, kernels) on first use, which costs a
    fresh process most of a second. Ranks forked afterwards start warm, as a spare process
    that has run the model once would."""
    from trainpilot.runtime.config import TrainConfig
    from trainpilot.runtime.data import MarkovCorpus
    from trainpilot.runtime.elastic.resize import plan_for_world
    from trainpilot.runtime.trainer import Trainer
    from trainpilot.specs import load_model, load_plan

    custom = spec.model == "dropout-lm"
    model = None if custom else load_model(spec.model)
    plan = plan_for_world(load_plan(spec.plan), 1)
    vocab = spec.vocab_size if custom else model.vocab_size
    data = MarkovCorpus(vocab_size=vocab, seq_len=plan.seq_len, seed=0, num_samples=64)
    trainer = Trainer(plan=plan, config=TrainConfig(steps=1, predict=False), dataset=data,
                      model=model, model_factory=(lambda: DropoutLM(vocab)) if custom else None)
    trainer.train_step()
    trainer.state_dict(rng=False)


def run_drill(spec: DrillSpec, *, world_size: int, policy: str = "replace",
              max_restarts: int = 6, timeout_s: float = 120.0,
              start_method: str = "fork") -> Any:
    """Run ``spec`` on ``world_size`` local ranks; returns the supervisor's report. Forked
    ranks (the default) start warm (:func:`warm_up`)."""
    from trainpilot.runtime.elastic.local import LocalSupervisor

    spec.save()
    if start_method == "fork":
        warm_up(spec)
    supervisor = LocalSupervisor(rank_main, world_size,
                                 args=(str(Path(spec.run_dir) / "drill.json"),),
                                 policy=policy, max_restarts=max_restarts,
                                 start_method=start_method)
    return supervisor.run(timeout_s=timeout_s)


@dataclass(kw_only=True)
class Outcome:
    """What a finished drill left: rank 0's final state (every rank's, when asked), the loss of
    every committed step, and the global sample indices of every committed step."""

    states: dict[int, dict[str, torch.Tensor]]
    losses: dict[int, float]
    samples: dict[int, list[int]]
    recoveries: list[dict[str, Any]]
    verdicts: list[dict[str, Any]]


def read_outcome(run_dir: str | Path) -> Outcome:
    """Collect what the drill's processes left. For each step, only its last run counts (the
    newest (attempt, generation) that ran it; within it, the last read): the committed one."""
    run_dir = Path(run_dir)
    finals = [torch.load(p, weights_only=True) for p in sorted(run_dir.glob("final_r*.pt"))]
    entries = [json.loads(line) for p in sorted(run_dir.glob("log_r*.jsonl"))
               for line in p.read_text().splitlines() if line.strip()]
    newest: dict[int, tuple[int, int]] = {}
    for e in entries:
        era = (e["attempt"], e["gen"])
        newest[e["step"]] = max(newest.get(e["step"], era), era)
    losses: dict[int, tuple[float, float]] = {}
    reads: dict[tuple[int, int], tuple[float, list[int]]] = {}
    for e in entries:
        if (e["attempt"], e["gen"]) != newest[e["step"]]:
            continue
        if e["kind"] == "loss" and e["t"] >= losses.get(e["step"], (-1.0, 0.0))[0]:
            losses[e["step"]] = (e["t"], e["loss"])
        if e["kind"] == "samples":
            key = (e["step"], e["dp_rank"])
            if key not in reads or e["t"] >= reads[key][0]:
                reads[key] = (e["t"], e["indices"])
    samples: dict[int, list[int]] = {}
    for step, dp_rank in sorted(reads):
        samples.setdefault(step, []).extend(reads[(step, dp_rank)][1])
    return Outcome(states={f["rank"]: f["state"] for f in finals},
                   losses={s: v for s, (_, v) in sorted(losses.items())}, samples=samples,
                   recoveries=[r for f in finals for r in f["recoveries"]],
                   verdicts=[v for f in finals for v in f["heartbeat_verdicts"]])
