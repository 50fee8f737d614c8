"""The reference expert-parallel serving loop on real processes, and its recovery from a killed
rank.

``run_serving(world_size=3, kill=(1, 5))`` spawns ``world_size`` worker processes that decode a
seeded queue of requests with the engine of ``engine.py`` (greedy, KV cache, DP attention,
experts spread over the ranks, ``ProcessGroupGloo`` all-to-alls). The launcher hosts the
``TCPStore`` and plays the coordinator (torchft's lighthouse): when a worker dies it publishes
the surviving membership. Each worker also holds a *peer copy* of its successor's experts in
host memory, and streams every request's tokens to the store after every pass, the way a
serving frontend sees them.

Kill one rank (it ``SIGKILL``\\s itself at the start of a step) and the survivors: notice (their
collective raises), read the new membership, build a new process group, adopt the dead rank's
experts from the peer copy (its predecessor in the ring holds them), roll their own partial pass
back, and retry the dead rank's requests at token level: each is re-prefilled from its prompt
and the tokens already streamed, then decodes on. Timings of every phase are returned, with
each rank's completed requests; ``retry=False`` and ``peer_copy=False`` are the negative
controls (requests lost; tokens that differ).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field

import torch

from trainpilot.runtime.serve.engine import Engine, ExpertPlacement, Sequence, expert_weights

POLL_S = 0.005


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """What the workers serve and which fault they suffer (``kill``: (rank, step) or None)."""

    world_size: int
    model: str = "tiny-moe"
    seed: int = 0
    num_requests: int = 12
    max_batch: int = 3
    max_seq_len: int = 64
    kill: tuple[int, int] | None = None
    retry: bool = True
    peer_copy: bool = True
    timeout_s: float = 30.0


def make_requests(cfg: ServeConfig, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt tokens, max new tokens) per request, from ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    out = []
    for _ in range(cfg.num_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 10))]
        out.append((prompt, rng.randint(6, 14)))
    return out


def build_model(cfg: ServeConfig):
    """The full model, deterministically initialised (every rank builds the same numbers and
    keeps only its experts: see ``_placement``)."""
    from trainpilot.runtime.models.gpt import build_gpt
    from trainpilot.specs import load_model

    spec = load_model(cfg.model)
    model = build_gpt(spec, max_seq_len=cfg.max_seq_len, device="cpu")
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.eval()
    return spec, model


def _placement(model, spec, world: int) -> dict[tuple[int, int], int]:
    """Experts dealt round-robin over the ranks, per MoE layer."""
    return {(layer, e): e % world for layer in range(spec.num_layers)
            if spec.is_moe_layer(layer) for e in range(spec.moe.num_experts)}


@dataclass
class _Timings:
    phases: dict[str, float] = field(default_factory=dict)
    pass_s: list[tuple[int, float]] = field(default_factory=list)  # (rows, seconds)


class _Worker:
    def __init__(self, rank: int, cfg: ServeConfig, port: int):
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.dist = dist
        self.rank, self.cfg = rank, cfg
        self.store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False,
                                   timeout=datetime.timedelta(seconds=cfg.timeout_s))
        self.spec, model = build_model(cfg)
        owner = _placement(model, self.spec, cfg.world_size)
        mine = [k for k, r in owner.items() if r == rank]
        successor = (rank + 1) % cfg.world_size
        theirs = [k for k, r in owner.items() if r == successor]
        t0 = time.perf_counter()
        self.peer_copy = {k: expert_weights(model, k) for k in theirs} if cfg.peer_copy else {}
        self.timings = _Timings(phases=dict(peer_copy_s=time.perf_counter() - t0))
        weights = {k: expert_weights(model, k) for k in mine}
        with torch.no_grad():  # drop every expert this rank does not own
            for layer in range(self.spec.num_layers):
                if self.spec.is_moe_layer(layer):
                    ex = model.layers[str(layer)].feed_forward.experts
                    for w in (ex.w1, ex.w2, ex.w3):
                        if w is not None:
                            w.zero_()
        self.placement = ExpertPlacement(owner=owner, weights=weights)
        self.engine = Engine(model, self.placement, rank)
        self.members = list(range(cfg.world_size))
        self.gen = 0
        t0 = time.perf_counter()
        self.pg = self._group()
        self.timings.phases["group_init_s"] = time.perf_counter() - t0
        reqs = make_requests(cfg, self.spec.vocab_size)
        self.requests = reqs
        self.queue = [Sequence(i, list(p), len(p), n) for i, (p, n) in enumerate(reqs)
                      if i % cfg.world_size == rank]
        self.active: list[Sequence] = []
        self.results: dict[int, list[int]] = {}
        self.lost: list[int] = []

    def _group(self):
        d = self.dist
        prefix = d.PrefixStore(f"gen{self.gen}/", self.store)
        return d.ProcessGroupGloo(prefix, self.members.index(self.rank), len(self.members),
                                  datetime.timedelta(seconds=self.cfg.timeout_s))

    # ------------------------------------------------------------------ collectives
    def _exchange(self, layer: int, xs: list[torch.Tensor], experts_per_row: list[list[int]]
                  ) -> list[list[torch.Tensor | None]]:
        """Each routed copy's expert output (row i's j-th expert), computed on the rank that
        holds the expert; every slot is filled (``order`` lists them all)."""
        world = len(self.members)
        h = self.spec.hidden_size
        sends: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
        for i, experts in enumerate(experts_per_row):
            for j, e in enumerate(experts):
                sends[self.members.index(self.placement.owner[(layer, e)])].append((i, j, e))
        order = [item for dst in sends for item in dst]
        counts = torch.tensor([len(s) for s in sends], dtype=torch.int64)
        recv_counts = torch.empty(world, dtype=torch.int64)
        self.pg.alltoall_base(recv_counts, counts, [1] * world, [1] * world).wait()
        payload = torch.cat([torch.cat([xs[i], torch.tensor([[float(e)]])], dim=1)
                             for i, _, e in order]) if order else torch.empty(0, h + 1)
        recv = torch.empty(int(recv_counts.sum()), h + 1)
        self.pg.alltoall_base(recv, payload, recv_counts.tolist(), counts.tolist()).wait()
        outs = [self.engine.expert_row(self.placement.weights[(layer, int(row[h]))],
                                       row[:h].view(1, h)) for row in recv]
        back = torch.cat(outs) if outs else torch.empty(0, h)
        returned = torch.empty(len(order), h)
        self.pg.alltoall_base(returned, back, counts.tolist(), recv_counts.tolist()).wait()
        result: list[list[torch.Tensor | None]] = [[None] * len(e) for e in experts_per_row]
        for (i, j, _), row in zip(order, returned):
            result[i][j] = row.view(1, h)
        return result

    def _pending(self) -> int:
        t = torch.tensor([float(len(self.active) + len(self.queue))])
        self.pg.allreduce([t]).wait()
        return int(t.item())

    # ------------------------------------------------------------------ the loop
    def serve(self) -> None:
        step, resuming = 0, False
        while True:
            if self.cfg.kill and self.cfg.kill == (self.rank, step):
                self.store.set("fault/time", repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            while self.queue and len(self.active) < self.cfg.max_batch:
                self.active.append(self.queue.pop(0))
            rows = [(s, s.tokens[p], p) for s in self.active for p in range(s.cached,
                                                                            len(s.tokens))]
            marks = {s.request_id: s.cached for s in self.active}
            t0 = time.perf_counter()
            try:
                nxt = self.engine.forward(rows, self._exchange)
            except RuntimeError:
                for s in self.active:  # roll the partial pass back
                    for layer in range(len(s.cache_k)):
                        del s.cache_k[layer][marks[s.request_id]:]
                        del s.cache_v[layer][marks[s.request_id]:]
                self._recover()
                resuming = True
                continue
            self.timings.pass_s.append((len(rows), time.perf_counter() - t0))
            last = {}
            for (s, _, _), tok in zip(rows, nxt):
                last[s.request_id] = tok
            for s in list(self.active):
                s.tokens.append(last[s.request_id])
                self.store.set(f"tok/{s.request_id}", json.dumps(s.generated))
                if s.done:
                    self.results[s.request_id] = s.generated
                    self.store.set(f"done/{s.request_id}", "1")
                    self.active.remove(s)
            if resuming:
                self.timings.phases["resumed_at"] = time.time()
                self.timings.phases["resume_pass_rows"] = len(rows)
                resuming = False
            step += 1
            try:
                pending = self._pending()
            except RuntimeError:
                self._recover()
                continue
            if pending == 0:
                break

    def _recover(self) -> None:
        ph = self.timings.phases
        ph["detected_at"] = time.time()
        key = f"members/{self.gen + 1}"
        self.store.wait([key])
        ph["members_at"] = time.time()
        old = self.members
        self.members = json.loads(self.store.get(key))
        self.gen += 1
        t0 = time.perf_counter()
        self.pg = self._group()
        ph["regroup_s"] = time.perf_counter() - t0
        ph["regrouped_at"] = time.time()
        dead = [r for r in old if r not in self.members]
        t0 = time.perf_counter()
        moved = 0
        for d in dead:
            holder = (d - 1) % self.cfg.world_size
            if holder not in self.members:
                raise RuntimeError(f"rank {d} and the holder of its peer copy are both gone")
            keys = self.placement.experts_of(d)
            moved += len(keys)
            for k in keys:
                self.placement.owner[k] = holder
                if self.rank == holder:
                    if self.cfg.peer_copy:
                        self.placement.weights[k] = self.peer_copy[k]
                    else:  # negative control: nothing to reload the experts from
                        w1, w2, w3 = self.placement.weights[self.placement.experts_of(
                            self.rank)[0]]
                        self.placement.weights[k] = (torch.zeros_like(w1),
                                                     torch.zeros_like(w2),
                                                     None if w3 is None else torch.zeros_like(w3))
        ph["reload_s"] = time.perf_counter() - t0
        ph["reloaded_experts"] = moved
        retried = 0
        for d in dead:
            orphans = [i for i in range(len(self.requests)) if i % self.cfg.world_size == d
                       and not self.store.check([f"done/{i}"])]
            for index, req in enumerate(orphans):
                if self.members[index % len(self.members)] != self.rank:
                    continue
                prompt, max_new = self.requests[req]
                streamed = (json.loads(self.store.get(f"tok/{req}"))
                            if self.store.check([f"tok/{req}"]) else [])
                if not self.cfg.retry:
                    if streamed:
                        self.lost.append(req)  # in flight on the dead rank: dropped
                        continue
                seq = Sequence(req, list(prompt) + streamed, len(prompt), max_new)
                self.queue.insert(retried, seq)
                retried += 1
        ph["retried_requests"] = retried
        # A retried request joins at once (beyond max_batch): its stream must not stall.
        while retried:
            self.active.append(self.queue.pop(0))
            retried -= 1

    def finish(self) -> None:
        self.store.set(f"result/{self.rank}", json.dumps(dict(
            results={str(k): v for k, v in self.results.items()}, lost=self.lost,
            phases=self.timings.phases, passes=self.timings.pass_s)))


def _worker_main(rank: int, cfg: ServeConfig, port: int) -> None:
    from trainpilot.runtime.procexit import end_process

    code = 0
    try:
        worker = _Worker(rank, cfg, port)
        worker.serve()
        worker.finish()
    except Exception:  # noqa: BLE001 - report and leave with a failure code
        import traceback

        traceback.print_exc()
        code = 1
    end_process(code, join_threads=False)


@dataclass
class ServeRun:
    """What the launcher saw: every rank's completed requests, the lost ones, phase timings,
    exit codes (None: a rank still alive after the kill and the join's timeout), and whether
    the injected fault fired (its time, from the killed rank)."""

    results: dict[int, list[int]]
    lost: list[int]
    phases: dict[int, dict[str, float]]
    passes: dict[int, list[tuple[int, float]]]
    exit_codes: list[int | None]
    fault_time: float | None
    members_published_at: float | None
    wall_s: float


def run_serving(cfg: ServeConfig) -> ServeRun:
    """Spawn the workers, coordinate membership on a death, collect the results."""
    import multiprocessing as mp

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True,
                          timeout=datetime.timedelta(seconds=cfg.timeout_s),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(r, cfg, store.port), daemon=True)
             for r in range(cfg.world_size)]
    start = time.time()
    for p in procs:
        p.start()
    members, gen, published = list(range(cfg.world_size)), 0, None
    try:
        while any(p.is_alive() for p in procs):
            if time.time() - start > cfg.timeout_s * 3:
                raise TimeoutError(f"serving did not finish in {cfg.timeout_s * 3:.0f} s")
            for r, p in enumerate(procs):
                if r in members and not p.is_alive() and p.exitcode not in (0, None):
                    members = [m for m in members if m != r]
                    gen += 1
                    store.set(f"members/{gen}", json.dumps(members))
                    published = time.time()
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    results, lost, phases, passes = {}, [], {}, {}
    for r in range(cfg.world_size):
        if store.check([f"result/{r}"]):
            data = json.loads(store.get(f"result/{r}"))
            results.update({int(k): v for k, v in data["results"].items()})
            lost += data["lost"]
            phases[r] = data["phases"]
            passes[r] = [tuple(x) for x in data["passes"]]
    fault = float(store.get("fault/time")) if store.check(["fault/time"]) else None
    return ServeRun(results=results, lost=sorted(lost), phases=phases, passes=passes,
                    exit_codes=[p.exitcode for p in procs], fault_time=fault,
                    members_published_at=published, wall_s=time.time() - start)


def reference_tokens(cfg: ServeConfig) -> dict[int, list[int]]:
    """The same requests decoded in this process with every expert local (no process group):
    by the engine's batch and placement invariance, what any fault-free run must produce."""
    spec, model = build_model(cfg)
    owner = _placement(model, spec, 1)
    placement = ExpertPlacement(owner=owner, weights={k: expert_weights(model, k) for k in owner})
    engine = Engine(model, placement, 0)

    def exchange(layer, xs, experts_per_row):
        return [[engine.expert_row(placement.weights[(layer, e)], x) for e in experts]
                for x, experts in zip(xs, experts_per_row)]

    out = {}
    for i, (prompt, max_new) in enumerate(make_requests(cfg, spec.vocab_size)):
        seq = Sequence(i, list(prompt), len(prompt), max_new)
        while not seq.done:
            rows = [(seq, seq.tokens[p], p) for p in range(seq.cached, len(seq.tokens))]
            seq.tokens.append(engine.forward(rows, exchange)[-1])
        out[i] = seq.generated
    return out
