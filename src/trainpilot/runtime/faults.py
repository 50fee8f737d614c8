"""Scripted faults for training runs, each journaled before it fires.

A :class:`FaultInjector` holds faults parsed from a compact spec (the ``--inject`` string)::

    crash:rank=1,step=5;corrupt:step=10;enospc:step=20,at=manifest;slow:rank=0,step=3,factor=4

and is called by the training loop and the checkpointer at fixed points (:meth:`on_step`,
:meth:`before_collective`, :meth:`poison_gradients`, :meth:`checkpoint_point`). A fault fires
at most ``times`` times over the whole run, restarts included: the journal (a JSONL file shared
by all ranks and attempts, fsync'd before the fault acts) is both the record tests assert on and
the memory that stops a restarted rank from crashing again at the same step.

Kinds (parameters in brackets have defaults):

=========== ======================================================================================
crash       rank, step, [at=step|data|manifest|latest], [file=1], [mode=sigkill|exit]: kill the
            rank at the start of ``step``, or inside the checkpoint write of ``step``: after its
            ``file``-th data file (between data files), before the manifest (between data and
            manifest), or after the manifest before ``latest`` moves.
hang        rank, step, [at=step|collective], [mode=sigstop|sleep], [seconds=3600]
slow        rank, step, [factor=3], [steps=1], [at=step|checkpoint], [seconds]: sleep
            ``(factor - 1) * step_time_s`` per step (a k-times slower rank), or ``seconds``
            before the checkpoint writer starts.
corrupt     step, [rank=0], [file=data|manifest]: after checkpoint ``step`` commits, flip bytes,
truncate    cut to half, or delete one of its files (rank's first data file, or the manifest).
missing
enospc      step, [rank=0], [at=data|manifest]: the checkpoint write raises
            ``OSError(ENOSPC)``; at ``data`` half of a chunk is on disk when it does, as with a
            real full disk.
collective  rank, step: the next collective of ``step`` raises :class:`InjectedCollectiveError`.
nan         rank, step, [at=backward|grad]: a NaN in this rank's gradient. ``backward`` (a NaN
            computed on this rank): the gradient flowing into the model's output becomes NaN in
            backward, so it spreads to every gradient and, through the gradient reduction, to
            every replica. ``grad``: one element of this rank's gradient becomes NaN after the
            reduction, on this rank only (silent corruption).
=========== ======================================================================================
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainpilot.specs.errors import SpecError

if TYPE_CHECKING:  # torch is imported where a fault needs it
    from torch.utils.hooks import RemovableHandle

_REQ = object()  # marks a required parameter
# kind -> {param: (type or tuple of choices, default)}
KINDS: dict[str, dict[str, tuple[Any, Any]]] = {
    "crash": {"rank": (int, _REQ), "step": (int, _REQ),
              "at": (("step", "data", "manifest", "latest"), "step"), "file": (int, 1),
              "mode": (("sigkill", "exit"), "sigkill")},
    "hang": {"rank": (int, _REQ), "step": (int, _REQ), "at": (("step", "collective"), "step"),
             "mode": (("sigstop", "sleep"), "sigstop"), "seconds": (float, 3600.0)},
    "slow": {"rank": (int, _REQ), "step": (int, _REQ), "factor": (float, 3.0),
             "steps": (int, 1), "at": (("step", "checkpoint"), "step"), "seconds": (float, None)},
    "corrupt": {"step": (int, _REQ), "rank": (int, 0), "file": (("data", "manifest"), "data")},
    "truncate": {"step": (int, _REQ), "rank": (int, 0), "file": (("data", "manifest"), "data")},
    "missing": {"step": (int, _REQ), "rank": (int, 0), "file": (("data", "manifest"), "data")},
    "enospc": {"step": (int, _REQ), "rank": (int, 0), "at": (("data", "manifest"), "data")},
    "collective": {"rank": (int, _REQ), "step": (int, _REQ)},
    "nan": {"rank": (int, _REQ), "step": (int, _REQ), "at": (("backward", "grad"), "backward")},
}


class InjectedCollectiveError(RuntimeError):
    """An injected failure of one collective (what a gloo/NCCL error looks like to a loop)."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One scripted fault; ``index`` is its position in the spec (its identity in the journal)."""

    kind: str
    index: int
    params: tuple[tuple[str, Any], ...]

    def get(self, name: str) -> Any:
        return dict(self.params)[name]

    @property
    def times(self) -> int:
        return self.get("steps") if self.kind == "slow" else 1

    @property
    def id(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.params if v is not None)
        return f"{self.kind}:{args}"


def parse_faults(spec: str, *, world_size: int | None = None,
                 num_steps: int | None = None) -> list[Fault]:
    """Parse ``kind:key=value,...;kind:...``; bad input raises SpecError naming the field.
    With ``world_size`` and ``num_steps``, a fault that could never fire (rank 99 of 2, step
    500 of 100) is bad input too."""
    faults = []
    for index, part in enumerate(p.strip() for p in spec.split(";")):
        if not part:
            continue
        kind, _, args = part.partition(":")
        kind = kind.strip()
        if kind == "chaos":
            raise SpecError(f"inject[{index}]", part, "chaos:... is expanded by the launcher "
                            "(expand_chaos) into concrete faults first")
        if kind not in KINDS:
            raise SpecError(f"inject[{index}]", kind,
                            f"unknown fault; valid: {', '.join(KINDS)}, chaos")
        fault = Fault(kind=kind, index=index, params=_params(kind, index, args))
        params = dict(fault.params)
        if world_size is not None and params.get("rank", 0) >= world_size:
            raise SpecError(f"inject[{index}].rank", params["rank"],
                            f"the job has {world_size} rank(s); valid: 0-{world_size - 1}")
        if num_steps is not None and not 1 <= params.get("step", 1) <= num_steps:
            raise SpecError(f"inject[{index}].step", params["step"],
                            f"the run has {num_steps} steps; valid: 1-{num_steps}")
        faults.append(fault)
    return faults


# chaos:rate=R,kinds=a+b,seed=S,first=F: R faults per step on average (exponential gaps).
CHAOS_KEYS = {"rate": float, "kinds": str, "seed": int, "first": int}


def expand_chaos(spec: str, *, num_steps: int, world_size: int, seed: int = 0) -> str:
    """Replace each ``chaos:...`` part of ``spec`` with the seeded schedule it stands for
    (:mod:`trainpilot.runtime.elastic.chaos`): ``rate`` faults per step on average, of the
    ``kinds`` given (``+``-separated; default: all), on uniformly drawn ranks, from step
    ``first`` (default 2). The same spec, steps, world size and seed give the same faults."""
    from trainpilot.runtime.elastic.chaos import DEFAULT_KINDS, chaos_inject, chaos_schedule

    out = []
    for index, part in enumerate(p.strip() for p in spec.split(";")):
        kind, _, args = part.partition(":")
        if kind.strip() != "chaos":
            if part:
                out.append(part)
            continue
        given: dict[str, Any] = {}
        for item in filter(None, (a.strip() for a in args.split(","))):
            key, eq, raw = item.partition("=")
            if key not in CHAOS_KEYS or not eq:
                raise SpecError(f"inject[{index}].{key}", item,
                                f"chaos takes {', '.join(f'{k}=' for k in CHAOS_KEYS)}")
            try:
                given[key] = CHAOS_KEYS[key](raw)
            except ValueError:
                raise SpecError(f"inject[{index}].{key}", raw, "not a number") from None
        rate = given.get("rate")
        if rate is None or not 0 < rate <= 1:
            raise SpecError(f"inject[{index}].rate", rate if rate is not None else "<missing>",
                            "faults per step; valid: 0 < rate <= 1")
        kinds = tuple(given.get("kinds", "+".join(DEFAULT_KINDS)).split("+"))
        from trainpilot.runtime.elastic.chaos import fault_spec

        for name in kinds:
            try:
                fault_spec(name, rank=0, step=1)
            except ValueError as err:
                raise SpecError(f"inject[{index}].kinds", name, str(err)) from None
        schedule = chaos_schedule(seed=given.get("seed", seed), num_steps=num_steps,
                                  mean_gap_steps=1.0 / rate, world_size=world_size, kinds=kinds,
                                  first_step=given.get("first", 2))
        if schedule:
            out.append(chaos_inject(schedule))
    return ";".join(out)


def _params(kind: str, index: int, args: str) -> tuple[tuple[str, Any], ...]:
    schema, given = KINDS[kind], {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if key not in schema:
            raise SpecError(f"inject[{index}].{key}", item, f"unknown key for {kind}; valid: "
                            f"{', '.join(schema)}")
        if not eq:
            raise SpecError(f"inject[{index}].{key}", item, "expected key=value")
        given[key] = _value(f"inject[{index}].{key}", raw.strip(), schema[key][0])
    out = {}
    for key, (_, default) in schema.items():
        if key not in given and default is _REQ:
            raise SpecError(f"inject[{index}].{key}", "<missing>", f"{kind} needs {key}=...")
        out[key] = given.get(key, default)
    _check(kind, index, out)
    return tuple(out.items())


def _value(field: str, raw: str, kind: Any) -> Any:
    if isinstance(kind, tuple):
        if raw not in kind:
            raise SpecError(field, raw, f"valid: {', '.join(kind)}")
        return raw
    try:
        value = kind(raw)
    except ValueError:
        raise SpecError(field, raw, f"expected {'an integer' if kind is int else 'a number'}"
                        ) from None
    if (kind is int and value < 0) or (kind is float and not (math.isfinite(value) and value >= 0)):
        raise SpecError(field, raw, "must be >= 0")
    return value


def _check(kind: str, index: int, p: dict[str, Any]) -> None:
    if p.get("at") in ("manifest", "latest") and kind == "crash" and p["rank"] != 0:
        raise SpecError(f"inject[{index}].rank", p["rank"], f"at={p['at']} runs on the "
                        "checkpoint coordinator; valid: 0")
    if kind == "crash" and p["at"] == "data" and p["file"] < 1:
        raise SpecError(f"inject[{index}].file", p["file"], "valid: 1 or more")
    if kind == "slow":
        if p["factor"] < 1:
            raise SpecError(f"inject[{index}].factor", p["factor"], "valid: >= 1")
        if p["steps"] < 1:
            raise SpecError(f"inject[{index}].steps", p["steps"], "valid: >= 1")
        if p["at"] == "checkpoint" and p["seconds"] is None:
            raise SpecError(f"inject[{index}].seconds", "<missing>", "slow at=checkpoint "
                            "needs seconds=...")


class FaultInjector:
    """Fires scripted faults at the points the loop and the checkpointer report.

    ``journal_path``: JSONL file shared by all ranks and restarts (None: keep it in memory).
    ``sink``: also called with every journal record (e.g. the run store's event table).
    """

    def __init__(self, faults: str | Sequence[Fault] = (), *,
                 journal_path: str | os.PathLike | None = None,
                 sink: Callable[[dict], None] | None = None):
        self.faults = parse_faults(faults) if isinstance(faults, str) else list(faults)
        self.journal_path = Path(journal_path) if journal_path is not None else None
        self.sink = sink
        self._memory: list[dict] = []
        self._counts = Counter(r["index"] for r in self.fired())

    # -- journal -------------------------------------------------------------------------
    def fired(self, kind: str | None = None) -> list[dict]:
        """Every journal record (all ranks and attempts when a file is used), oldest first."""
        if self.journal_path is None:
            records = list(self._memory)
        elif not self.journal_path.exists():
            records = []
        else:
            records = []
            for line in self.journal_path.read_text().splitlines():
                try:
                    records.append(json.loads(line))
                except ValueError:  # a line cut short (the disk filled up as it was written)
                    continue
        return [r for r in records if kind is None or r["kind"] == kind]

    def _fire(self, fault: Fault, **details: Any) -> None:
        record = {"kind": fault.kind, "fault": fault.id, "index": fault.index,
                  "pid": os.getpid(), "time_unix_s": time.time(), **details}
        self._counts[fault.index] += 1
        if self.journal_path is None:
            self._memory.append(record)
        else:
            append_journal(self.journal_path, record)
        if self.sink is not None:
            self.sink(record)

    def _due(self, kinds: Iterable[str], *, step: int, rank: int | None,
             at: str | None = None) -> list[Fault]:
        out = []
        for f in self.faults:
            if f.kind not in kinds or self._counts[f.index] >= f.times:
                continue
            first = f.get("step")
            span = f.get("steps") if f.kind == "slow" else 1
            if not first <= step < first + span:
                continue
            if rank is not None and f.get("rank") != rank:
                continue
            if at is not None and dict(f.params).get("at", at) != at:
                continue
            out.append(f)
        return out

    # -- training-loop hooks -------------------------------------------------------------
    def on_step(self, step: int, *, rank: int, step_time_s: float | None = None) -> None:
        """Call at the start of each step: crash, hang or slow this rank when scheduled.

        ``step_time_s``: the rank's normal step time, for ``slow`` (sleeps (factor-1) x it, or
        (factor-1) x the fault's ``seconds`` when it gives them).
        """
        for fault in self._due(("slow",), step=step, rank=rank, at="step"):
            # ``seconds`` given: (factor - 1) x that, whatever the step time is.
            base = fault.get("seconds") if fault.get("seconds") is not None else step_time_s
            if base is None:
                raise ValueError(f"{fault.id}: pass step_time_s or give seconds=...")
            delay = (fault.get("factor") - 1) * base
            self._fire(fault, rank=rank, step=step, point="step", sleep_s=delay)
            time.sleep(delay)
        for fault in self._due(("hang",), step=step, rank=rank, at="step"):
            self._hang(fault, rank=rank, step=step, point="step")
        for fault in self._due(("crash",), step=step, rank=rank, at="step"):
            self._crash(fault, rank=rank, step=step, point="step")

    def before_collective(self, step: int, *, rank: int) -> None:
        """Call before a collective: fail it once, or hang inside it, when scheduled."""
        for fault in self._due(("hang",), step=step, rank=rank, at="collective"):
            self._hang(fault, rank=rank, step=step, point="collective")
        for fault in self._due(("collective",), step=step, rank=rank):
            self._fire(fault, rank=rank, step=step, point="collective")
            raise InjectedCollectiveError(
                f"injected collective failure on rank {rank} at step {step} ({fault.id})")

    def poison_backward(self, modules: Iterable[Any], step: int, *, rank: int) -> list[Any]:
        """Call before the forward of ``step``: when a ``nan`` fault (``at=backward``) is due,
        the first forward of the first module makes its output's gradient NaN in the coming
        backward. Returns the hook handles (remove them after the step)."""
        due = self._due(("nan",), step=step, rank=rank, at="backward")
        modules = list(modules)
        if not due or not modules:
            return []
        fault = due[0]
        handles: list[RemovableHandle] = []

        def on_forward(module: Any, args: Any, output: Any) -> None:
            for handle in handles:  # once: the first micro-batch of the first attempt
                handle.remove()
            out = output[0] if isinstance(output, (tuple, list)) else output
            if getattr(out, "requires_grad", False):
                out.register_hook(poison)

        def poison(grad: Any) -> Any:
            # All of it: under TP a replicated output's gradient is sliced in backward, and
            # one element could fall in another rank's slice and be dropped.
            self._fire(fault, rank=rank, step=step, point="backward")
            return grad * float("nan")

        handles.append(modules[0].register_forward_hook(on_forward))
        return handles

    def poison_gradients(self, parameters: Iterable[Any], step: int, *, rank: int) -> bool:
        """Call after the gradient reduction: when a ``nan`` fault (``at=grad``) is due, set
        one element of this rank's gradient to NaN (this rank only)."""
        import torch

        for fault in self._due(("nan",), step=step, rank=rank, at="grad"):
            for p in parameters:
                grad = getattr(p, "grad", None)
                if grad is not None and grad.numel():
                    local = grad.to_local() if hasattr(grad, "to_local") else grad
                    if local.numel():
                        with torch.no_grad():
                            local.view(-1)[0] = float("nan")
                        self._fire(fault, rank=rank, step=step, point="grad")
                        return True
        return False

    def _hang(self, fault: Fault, *, rank: int, step: int, point: str) -> None:
        self._fire(fault, rank=rank, step=step, point=point, mode=fault.get("mode"))
        if fault.get("mode") == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(fault.get("seconds"))

    def _crash(self, fault: Fault, *, rank: int, step: int, point: str, **details: Any) -> None:
        self._fire(fault, rank=rank, step=step, point=point, mode=fault.get("mode"), **details)
        if fault.get("mode") == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(1)

    # -- checkpoint hooks ----------------------------------------------------------------
    def checkpoint_point(self, point: str, *, step: int, rank: int, file_index: int = 0,
                         step_dir: Path | None = None) -> None:
        """Called by the checkpoint writer at ``start``, ``write`` (mid-chunk), ``data``
        (after its ``file_index``-th data file), ``manifest``, ``latest`` and ``commit``."""
        if point == "start":
            for fault in self._due(("slow",), step=step, rank=rank, at="checkpoint"):
                self._fire(fault, rank=rank, step=step, point=point)
                time.sleep(fault.get("seconds"))
        if point in ("write", "manifest"):
            at = "data" if point == "write" else "manifest"
            for fault in self._due(("enospc",), step=step, rank=rank, at=at):
                self._fire(fault, rank=rank, step=step, point=point, file_index=file_index)
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
        if point in ("data", "manifest", "latest"):
            for fault in self._due(("crash",), step=step, rank=rank, at=point):
                if point != "data" or fault.get("file") == file_index:
                    self._crash(fault, rank=rank, step=step, point=point, file_index=file_index)
        if point == "commit" and step_dir is not None:
            for fault in self._due(("corrupt", "truncate", "missing"), step=step, rank=None):
                target = (step_dir / "manifest.json" if fault.get("file") == "manifest"
                          else step_dir / f"data_r{fault.get('rank')}_0.bin")
                damage_file(target, fault.kind)
                self._fire(fault, rank=rank, step=step, point=point, path=str(target))


def append_journal(path: str | os.PathLike, record: dict[str, Any], *, fsync: bool = True,
                   ) -> bool:
    """Append one JSON line to a journal shared by processes: one ``O_APPEND`` write (whole
    lines never interleave), fsync'd by default so the record survives the crash it announces.
    Returns False when the disk refused it (full): a journal must never end training."""
    line = (json.dumps(record, default=str) + "\n").encode()
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        return False
    return True


def damage_file(path: Path, how: str) -> None:
    """``corrupt``: flip 16 bytes in the middle; ``truncate``: cut to half; ``missing``: delete."""
    path = Path(path)
    if how == "missing":
        path.unlink()
        return
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        if how == "truncate":
            handle.truncate(size // 2)
        elif how == "corrupt":
            handle.seek(max(0, size // 2 - 8))
            data = handle.read(16)
            handle.seek(max(0, size // 2 - 8))
            handle.write(bytes(b ^ 0xFF for b in data))
        else:
            raise ValueError(f"unknown damage {how!r}")
        handle.flush()
        os.fsync(handle.fileno())
