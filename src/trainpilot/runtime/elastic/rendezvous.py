"""Generations of the training process group over one torch.distributed store.

torchrun (or :class:`~trainpilot.runtime.elastic.local.LocalSupervisor`) provides the store:
``MASTER_ADDR``/``MASTER_PORT``, hosted by the agent or by rank 0 exactly as ``env://``
rendezvous does it (``TORCHELASTIC_USE_AGENT_STORE``). A restarted job must never read the
previous attempt's keys (pytorch#135712): on the agent's store every key lives under a
namespace per attempt; rank 0's store is new in every round anyway (``WorkerEnv.namespace``).

A *generation* is one process group. Generation ``g`` rendezvouses through
``PrefixStore("gen<g>", store)``, so a rebuilt group never touches the broken group's keys. After
a failure in generation ``g`` every rank (survivors and replacements alike) moves to
``max(stored, g + 1)``; the stored counter only grows (compare-and-set).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class WorkerEnv:
    """What torchrun (or the local supervisor) tells a worker about itself."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    restart_count: int
    run_id: str
    agent_store: bool = False  # the store outlives a restart (hosted by the agent)

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        env = os.environ
        return cls(rank=int(env.get("RANK", "0")), world_size=int(env.get("WORLD_SIZE", "1")),
                   local_rank=int(env.get("LOCAL_RANK", "0")),
                   master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                   master_port=int(env.get("MASTER_PORT", "0")),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")

    @property
    def namespace(self) -> str:
        """Key prefix. A store that outlives restarts (the agent's) gets one per attempt: the
        attempt counter is the same on every rank when one agent (or the local supervisor)
        restarts them all. A store hosted by rank 0 (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
        what ``trainpilot train`` sets with ``--max-restarts``) is new in every rendezvous
        round, so no prefix is needed there, and none would be right: each agent of a
        multi-node job counts its own restarts."""
        if self.agent_store:
            return f"trainpilot/{self.run_id}/attempt{self.restart_count}"
        return f"trainpilot/{self.run_id}"


def base_store(env: WorkerEnv, timeout_s: float) -> Any:
    """The job's store, created as ``env://`` rendezvous creates it (agent's or rank 0's)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    return store


def client_store(env: WorkerEnv, timeout_s: float) -> Any:
    """A second connection to the job's store (for the heartbeat thread: one client per
    thread, so a blocking call on one never stalls the other)."""
    return dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class Generations:
    """The generation counter and the per-generation process-group rendezvous."""

    def __init__(self, store: Any, env: WorkerEnv):
        self.store = dist.PrefixStore(env.namespace, store)
        self.env = env
        # Which process this is for its rank: 1 for the original, 2+ for replacements.
        self.incarnation = int(self.store.add(f"incarnation/{env.rank}", 1))

    def current(self) -> int:
        if not self.store.check(["gen"]):
            return 0
        return int(self.store.get("gen"))

    def advance(self, failed_gen: int) -> int:
        """Move past ``failed_gen``: returns max(stored, failed_gen + 1), stored atomically."""
        while True:
            cur = self.current()
            if cur > failed_gen:
                return cur
            expected = str(cur) if self.store.check(["gen"]) else ""
            got = self.store.compare_set("gen", expected, str(failed_gen + 1))
            if int(got) >= failed_gen + 1:
                return int(got)

    def generation_to_join(self) -> int:
        """A fresh process joins the current generation; a replacement joins one newer than the
        generation its predecessor was in (its survivors are moving there), waiting for it."""
        if self.incarnation == 1:
            return self.current()
        prev = predecessor_generation(self.store, self.env.rank)
        return self.advance(prev)

    def join(self, gen: int, *, backend: str, timeout_s: float) -> None:
        """``init_process_group`` for generation ``gen`` (blocks until every rank arrives;
        raises ``DistStoreError`` after ``timeout_s``)."""
        prefix = dist.PrefixStore(f"gen{gen}", self.store)
        dist.init_process_group(backend, store=prefix, rank=self.env.rank,
                                world_size=self.env.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))


def predecessor_generation(store: Any, rank: int) -> int:
    """The generation the previous process of ``rank`` last reported (0 if none)."""
    key = f"hb/{rank}"
    if not store.check([key]):
        return 0
    return int(json.loads(store.get(key)).get("gen", 0))


def abort_world() -> None:
    """Abort and forget every process group of this process (a new generation builds new
    ones). On NCCL, aborting makes peers blocked on the group fail at once; on gloo (torch
    2.13) ``abort`` does not close the connections (measured: a peer blocked in an all-reduce
    still waits for its timeout), so peers of a rank that leaves alive notice at their
    collective timeout, while peers of a rank that died notice at once (its sockets close)."""
    if not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort()
        else:  # pragma: no cover - older torch
            dist.destroy_process_group()
    except (RuntimeError, ValueError, AssertionError):
        if dist.is_initialized():
            dist.destroy_process_group()


def host_name() -> str:
    return socket.gethostname()

