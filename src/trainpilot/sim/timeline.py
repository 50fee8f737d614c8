"""Discrete-event simulation of one training step: pipeline schedule, links, DP overlap.

Each pipeline rank has a compute stream that issues its schedule's operations in order; an
operation starts when the stream is free and its input has arrived. Activations and gradients
travel between stages as transfers on links, and every link is a FIFO resource, so two
transfers that want the same link wait for each other (contention is simulated, not assumed).
Data-parallel gradient buckets become ready during each chunk's last backward and go out on the
rank's DP stream (its own link, or with ``shared_nic`` the same NIC as the pipeline sends).
Expert-parallel all-to-alls and exposed tensor-parallel collectives block the compute stream
inside each forward and backward. The optimizer step runs when the rank's compute and its
gradient reduction are both done. Step time = the last rank's optimizer end.

Durations come from ``StageCosts`` (seconds, per pipeline rank, per micro-batch), which mirrors
the cost model's ``StageCost``; ``from_prediction`` adapts a ``perf.predict`` result.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainpilot.sim.schedules import SCHEDULES, Op, rank_ops
from trainpilot.specs.errors import SpecError

TRACK_COMPUTE, TRACK_PP, TRACK_DP = 0, 1, 2


@dataclass(frozen=True, kw_only=True)
class StageCosts:
    """One pipeline rank's costs (seconds). Per micro-batch: ``fwd_s``, ``bwd_s`` (recompute
    included), ``p2p_s`` (one activation or gradient transfer), ``ep_comm_s`` and
    ``tp_comm_s`` (exposed, forward + backward). Per step: ``dp_comm_s`` (all gradient buckets)
    and ``optimizer_s``. ``dp_bucket_bytes`` lists bucket sizes in launch order (last layers
    first); only their proportions matter. ``weight_grad_share`` is the part of ``bwd_s`` that
    computes weight gradients (split off as W by the zero-bubble schedule)."""

    fwd_s: float
    bwd_s: float
    p2p_s: float = 0.0
    dp_comm_s: float = 0.0
    dp_bucket_bytes: tuple[float, ...] = ()
    optimizer_s: float = 0.0
    ep_comm_s: float = 0.0
    tp_comm_s: float = 0.0
    weight_grad_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("fwd_s", "bwd_s", "p2p_s", "dp_comm_s", "optimizer_s", "ep_comm_s",
                     "tp_comm_s"):
            if getattr(self, name) < 0:
                raise SpecError(f"stage.{name}", getattr(self, name), "valid: >= 0 seconds")
        if not 0.0 <= self.weight_grad_share < 1.0:
            raise SpecError("stage.weight_grad_share", self.weight_grad_share, "valid: [0, 1)")
        if any(b <= 0 for b in self.dp_bucket_bytes):
            raise SpecError("stage.dp_bucket_bytes", self.dp_bucket_bytes, "valid: sizes > 0")


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """A step to simulate: per-rank costs, micro-batches and schedule."""

    stages: tuple[StageCosts, ...]
    num_micro_batches: int
    schedule: str = "1f1b"
    vp: int = 1
    dp_overlap: bool = True  # launch buckets during backward (else after it)
    shared_nic: bool = False  # pipeline sends and DP buckets share the rank's NIC

    def __post_init__(self) -> None:
        if not self.stages:
            raise SpecError("stages", [], "valid: at least one pipeline stage")
        if self.num_micro_batches < 1:
            raise SpecError("num_micro_batches", self.num_micro_batches, "valid: >= 1")
        if self.schedule not in SCHEDULES:
            raise SpecError("schedule", self.schedule, f"valid: {', '.join(SCHEDULES)}")

    @property
    def pp(self) -> int:
        return len(self.stages)


@dataclass
class RankStats:
    """Seconds on one pipeline rank over the step."""

    compute_s: float = 0.0  # forward, backward, weight-gradient and optimizer kernels
    blocking_comm_s: float = 0.0  # EP all-to-alls and exposed TP collectives (stall compute)
    pp_comm_s: float = 0.0  # time its outgoing activation/gradient transfers occupy links
    dp_comm_s: float = 0.0  # time its gradient buckets occupy the DP stream
    compute_end_s: float = 0.0  # last forward/backward ends
    dp_end_s: float = 0.0  # last bucket lands
    end_s: float = 0.0  # optimizer step ends

    def to_dict(self, step_s: float) -> dict[str, float]:
        busy = self.compute_s + self.blocking_comm_s
        return dict(busy_s=busy, compute_s=self.compute_s, idle_s=step_s - busy,
                    comm_s=self.blocking_comm_s + self.pp_comm_s + self.dp_comm_s,
                    pp_comm_s=self.pp_comm_s, dp_comm_s=self.dp_comm_s,
                    blocking_comm_s=self.blocking_comm_s,
                    exposed_dp_s=max(0.0, self.dp_end_s - self.compute_end_s))


@dataclass
class StepResult:
    """What the step simulation found. Times in seconds; ``events`` are trace slices
    (rank, track, name, start_s, dur_s) in start order."""

    step_time_s: float
    pipeline_end_s: float  # last backward (or W) ends on any rank: the pipeline flush
    ideal_pipeline_s: float  # busiest rank's forward+backward (+ blocking comm): no bubble
    bubble_fraction: float  # (pipeline_end - ideal) / ideal, the (p-1)/(v m) quantity
    closed_form_bubble: float  # (p - 1) / (v m)
    exposed_comm_s: float  # step time not covered by compute on the critical rank
    ranks: list[RankStats]
    events: list[tuple[int, int, str, float, float]] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return dict(step_time_s=self.step_time_s, pipeline_end_s=self.pipeline_end_s,
                    ideal_pipeline_s=self.ideal_pipeline_s,
                    bubble_fraction=self.bubble_fraction,
                    closed_form_bubble=self.closed_form_bubble,
                    exposed_comm_s=self.exposed_comm_s,
                    ranks=[r.to_dict(self.step_time_s) for r in self.ranks])


class _Link:
    """A resource that carries one transfer at a time. Waiting transfers go by priority, then
    request order; a transfer in flight is not pre-empted (a pipeline send that finds a
    gradient bucket on the wire waits for that bucket, not for the whole queue)."""

    def __init__(self) -> None:
        self.busy = False
        self.queue: list[tuple[int, int, Callable[[], None]]] = []


class _Engine:
    def __init__(self, spec: StepSpec):
        self.spec = spec
        self.now = 0.0
        self.heap: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.links: dict[str, _Link] = {}
        self.events: list[tuple[int, int, str, float, float]] = []
        pp, vp, m = spec.pp, spec.vp, spec.num_micro_batches
        zb = spec.schedule == "zero_bubble"
        self.ops = [[op for op in rank_ops(spec.schedule, pp, r, m, vp) if op.kind != "W"]
                    for r in range(pp)]
        self.next = [0] * pp
        self.busy = [False] * pp
        self.pending_w: list[deque[Op]] = [deque() for _ in range(pp)]
        self.w_cap = [pp - r for r in range(pp)] if zb else [0] * pp
        self.arrived: set[tuple[str, int, int]] = set()
        self.waiting: dict[tuple[str, int, int], int] = {}
        self.stats = [RankStats() for _ in range(pp)]
        self.buckets_left = [0] * pp
        self.compute_done = [False] * pp
        self.last_grad_op = [self._last_grad_ops(r) for r in range(pp)]

    # -- event loop
    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.heap, (time, next(self.seq), action))

    def run(self) -> None:
        for r in range(self.spec.pp):
            self.at(0.0, functools.partial(self.try_start, r))
        while self.heap:
            self.now, _, action = heapq.heappop(self.heap)
            action()

    # -- links
    def transfer(self, name: str, duration: float, rank: int, track: int, label: str,
                 done: Callable[[float], None]) -> None:
        link = self.links.setdefault(name, _Link())
        priority = 0 if track == TRACK_PP else 1  # latency-critical sends before buckets

        def start() -> None:
            link.busy = True
            begin = self.now
            self.events.append((rank, track, label, begin, duration))

            def finish() -> None:
                link.busy = False
                if link.queue:  # hand the link to the next waiting transfer first
                    heapq.heappop(link.queue)[2]()
                done(self.now)

            self.at(begin + duration, finish)

        if link.busy:
            heapq.heappush(link.queue, (priority, next(self.seq), start))
        else:
            start()

    # -- compute streams
    def _stage_costs(self, rank: int) -> StageCosts:
        return self.spec.stages[rank]

    def durations(self, rank: int, op: Op) -> tuple[float, float]:
        """(compute, blocking comm) seconds of ``op`` on ``rank``'s stream."""
        c, vp = self._stage_costs(rank), self.spec.vp
        comm = (c.ep_comm_s + c.tp_comm_s) / (2 * vp)
        zb = self.spec.schedule == "zero_bubble"
        if op.kind == "F":
            return c.fwd_s / vp, comm
        if op.kind == "W":
            return c.bwd_s * c.weight_grad_share / vp, 0.0
        share = (1.0 - c.weight_grad_share) if zb else 1.0
        return c.bwd_s * share / vp, comm

    def needs(self, rank: int, op: Op) -> tuple[str, int, int] | None:
        v, last = op.chunk * self.spec.pp + rank, self.spec.pp * self.spec.vp - 1
        if op.kind == "F" and v > 0:
            return ("act", v, op.micro_batch)
        if op.kind == "B" and v < last:
            return ("grad", v, op.micro_batch)
        return None

    def try_start(self, rank: int) -> None:
        if self.busy[rank]:
            return
        ops, i = self.ops[rank], self.next[rank]
        pending = self.pending_w[rank]
        if pending and len(pending) >= self.w_cap[rank]:
            return self.start(rank, pending.popleft())
        if i < len(ops):
            key = self.needs(rank, ops[i])
            if key is None or key in self.arrived:
                self.next[rank] += 1
                return self.start(rank, ops[i])
            if pending:  # zero-bubble: fill the wait with deferred weight gradients
                return self.start(rank, pending.popleft())
            self.waiting[key] = rank
            return
        if pending:
            return self.start(rank, pending.popleft())
        if not self.compute_done[rank]:
            self.compute_done[rank] = True
            self.stats[rank].compute_end_s = self.now
            if not self.spec.dp_overlap:
                self.launch_buckets(rank, None, self.now, 0.0)
            self.maybe_optimizer(rank)

    def start(self, rank: int, op: Op) -> None:
        compute, comm = self.durations(rank, op)
        self.busy[rank] = True
        begin = self.now
        self.events.append((rank, TRACK_COMPUTE, op.label, begin, compute))
        if comm:
            self.events.append((rank, TRACK_COMPUTE, f"{op.label} a2a/tp", begin + compute, comm))
        st = self.stats[rank]
        st.compute_s += compute
        st.blocking_comm_s += comm
        if self.spec.dp_overlap and op in self.last_grad_op[rank]:
            self.launch_buckets(rank, op.chunk, begin, compute)
        self.at(begin + compute + comm, lambda: self.finish(rank, op))

    def finish(self, rank: int, op: Op) -> None:
        self.busy[rank] = False
        if op.kind == "B" and self.spec.schedule == "zero_bubble":
            self.pending_w[rank].append(Op("W", op.chunk, op.micro_batch))
        self.send(rank, op)
        self.try_start(rank)

    def send(self, rank: int, op: Op) -> None:
        pp, vp = self.spec.pp, self.spec.vp
        v = op.chunk * pp + rank
        if op.kind == "F" and v < pp * vp - 1:
            key = ("act", v + 1, op.micro_batch)
        elif op.kind == "B" and v > 0:
            key = ("grad", v - 1, op.micro_batch)
        else:
            return
        dst = key[1] % pp
        if dst == rank:
            return self.arrive(key)
        cost = self._stage_costs(rank).p2p_s
        self.stats[rank].pp_comm_s += cost
        link = f"nic{rank}" if self.spec.shared_nic else f"pp{rank}->{dst}"
        label = f"send {op.label}->{dst}"
        self.transfer(link, cost, rank, TRACK_PP, label, lambda _: self.arrive(key))

    def arrive(self, key: tuple[str, int, int]) -> None:
        self.arrived.add(key)
        rank = self.waiting.pop(key, None)
        if rank is not None:
            self.try_start(rank)

    # -- data-parallel gradient reduction and the optimizer
    def _last_grad_ops(self, rank: int) -> set[Op]:
        kind = "W" if self.spec.schedule == "zero_bubble" else "B"
        last: dict[int, Op] = {}
        for op in rank_ops(self.spec.schedule, self.spec.pp, rank, self.spec.num_micro_batches,
                           self.spec.vp):
            if op.kind == kind:
                last[op.chunk] = op
        return set(last.values())

    def _buckets(self, rank: int) -> list[tuple[int, float, float]]:
        """(chunk, share of the chunk's gradient ready when it launches, seconds) per bucket."""
        c, vp = self._stage_costs(rank), self.spec.vp
        sizes = list(c.dp_bucket_bytes) or ([1.0] if c.dp_comm_s > 0 else [])
        total, out = sum(sizes), []
        by_chunk: dict[int, list[float]] = {}
        for i, size in enumerate(sizes):  # launch order: last chunk's layers first
            by_chunk.setdefault(vp - 1 - (i * vp) // len(sizes), []).append(size)
        for chunk in sorted(by_chunk, reverse=True):
            chunk_sizes, acc = by_chunk[chunk], 0.0
            for size in chunk_sizes:
                acc += size
                out.append((chunk, acc / sum(chunk_sizes), c.dp_comm_s * size / total))
        return out

    def launch_buckets(self, rank: int, chunk: int | None, begin: float, span: float) -> None:
        for i, (bucket_chunk, ready, seconds) in enumerate(self._buckets(rank)):
            if chunk is not None and bucket_chunk != chunk:
                continue
            self.buckets_left[rank] += 1
            self.stats[rank].dp_comm_s += seconds
            link = f"nic{rank}" if self.spec.shared_nic else f"dp{rank}"
            label = f"grad bucket {i}"

            def go(link=link, seconds=seconds, label=label) -> None:
                self.transfer(link, seconds, rank, TRACK_DP, label,
                              lambda _: self.bucket_done(rank))

            self.at(begin + ready * span, go)

    def bucket_done(self, rank: int) -> None:
        self.buckets_left[rank] -= 1
        self.stats[rank].dp_end_s = self.now
        self.maybe_optimizer(rank)

    def maybe_optimizer(self, rank: int) -> None:
        if not self.compute_done[rank] or self.buckets_left[rank] or self.busy[rank]:
            return
        seconds = self._stage_costs(rank).optimizer_s
        self.busy[rank] = True
        self.events.append((rank, TRACK_COMPUTE, "optimizer", self.now, seconds))
        self.stats[rank].compute_s += seconds
        self.stats[rank].end_s = self.now + seconds


def simulate_step(spec: StepSpec) -> StepResult:
    """Run the step; see the module docstring for the model."""
    engine = _Engine(spec)
    engine.run()
    stats = engine.stats
    step = max(s.end_s for s in stats)
    pipeline_end = max(s.compute_end_s for s in stats)
    # Blocking EP/TP collectives occupy the stream like compute: they are not bubble.
    ideal = max(spec.num_micro_batches * (c.fwd_s + c.bwd_s + c.ep_comm_s + c.tp_comm_s)
                for c in spec.stages)
    bubble = (pipeline_end - ideal) / ideal if ideal > 0 else 0.0
    closed = (spec.pp - 1) / (spec.vp * spec.num_micro_batches)
    critical = max(range(spec.pp), key=lambda r: stats[r].end_s)
    exposed = stats[critical].blocking_comm_s + max(
        0.0, stats[critical].dp_end_s - stats[critical].compute_end_s)
    events = sorted(engine.events, key=lambda e: (e[3], e[0], e[1]))
    return StepResult(step_time_s=step, pipeline_end_s=pipeline_end, ideal_pipeline_s=ideal,
                      bubble_fraction=bubble, closed_form_bubble=closed,
                      exposed_comm_s=exposed, ranks=stats, events=events)
