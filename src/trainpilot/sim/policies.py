"""Recovery policies side by side: restart from storage, in-memory peer checkpoints, hot spares.

Checkpoint and restore times follow from the checkpoint's size and the wires, so the comparison
is specific to a job: a sharded checkpoint of ``bytes_per_param`` bytes per parameter (bf16
weights 2 + fp32 master weights 4 + two fp32 Adam moments 8 = 14 by default), snapshotted to host
memory over PCIe (the blocking stall), then written to shared storage at its aggregate
bandwidth or copied to a peer node over the inter-node network. The defaults are assumptions to
replace with your own measurements; each is a field below.

What a save costs. The storage policy writes synchronously (``storage_write="blocking"``, the
default: Megatron-LM's save without ``--async-save``, and the write time w of Kokolis et al.'s
ETTR): each save pauses training for the snapshot plus the whole write, so its interval lands
near Young's sqrt(2 w M). With ``storage_write="async"`` only the snapshot blocks, and then the
storage must keep up: a save's write must end before the next save starts, i.e. the job needs
``total_bytes / cycle`` of sustained write bandwidth; ``check_sustainable`` refuses an interval
that needs more than ``storage_gbytes_per_s`` (the old policy ran at that limit, writing 5.7 TB
every 0.9 min for Llama 3 405B, because only the 14 ms snapshot was counted per save). The peer
policies copy every save to a peer's memory and write every ``storage_every``-th to storage in
the background, under the same check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainpilot.sim.availability import (
    AvailabilityJob,
    AvailabilityResult,
    CheckpointSpec,
    RecoverySpec,
    closed_form,
    closed_form_ettr,
    optimal_interval_min,
    search_bounds_min,
)
from trainpilot.sim.failures import FailureModel
from trainpilot.sim.montecarlo import monte_carlo
from trainpilot.specs.errors import SpecError


@dataclass(frozen=True, kw_only=True)
class CheckpointCosts:
    """What saving and restoring one checkpoint of a job costs (inputs in the names' units)."""

    params: float  # model parameters
    num_nodes: int
    devices_per_node: int = 8
    bytes_per_param: float = 14.0
    host_gbytes_per_s: float = 25.0  # device -> host snapshot per device (PCIe Gen4 x16 ~ 25)
    storage_gbytes_per_s: float = 100.0  # aggregate shared-storage bandwidth, write and read
    peer_gbytes_per_s: float = 25.0  # per-node inter-node bandwidth for the peer copy
    load_overhead_s: float = 30.0  # deserialise and place the state after reading it
    storage_write: Literal["blocking", "async"] = "blocking"  # the storage policy's saves

    def __post_init__(self) -> None:
        if self.storage_write not in ("blocking", "async"):
            raise SpecError("storage_write", self.storage_write, "valid: blocking, async")
        for name in ("params", "bytes_per_param", "host_gbytes_per_s", "storage_gbytes_per_s",
                     "peer_gbytes_per_s"):
            if getattr(self, name) <= 0:
                raise SpecError(name, getattr(self, name), "valid: > 0")

    @property
    def total_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def stall_s(self) -> float:
        per_device = self.total_bytes / (self.num_nodes * self.devices_per_node)
        return per_device / (self.host_gbytes_per_s * 1e9)

    @property
    def storage_s(self) -> float:
        return self.total_bytes / (self.storage_gbytes_per_s * 1e9)

    @property
    def peer_s(self) -> float:
        return self.total_bytes / self.num_nodes / (self.peer_gbytes_per_s * 1e9)

    def needed_gbytes_per_s(self, ckpt: CheckpointSpec, interval_min: float | None = None,
                            ) -> float:
        """Sustained (average) storage write bandwidth (GB/s) the saves of ``ckpt`` need at
        ``interval_min`` (default: its own): one checkpoint per storage cycle."""
        interval = ckpt.interval_min if interval_min is None else interval_min
        cycles = ckpt.storage_every if ckpt.in_memory_peer else 1
        return self.total_bytes / (cycles * (interval * 60.0 + ckpt.stall_s)) / 1e9


def check_sustainable(costs: CheckpointCosts, ckpt: CheckpointSpec,
                      interval_min: float | None = None) -> None:
    """SpecError when the storage cannot absorb the saves of ``ckpt`` at ``interval_min``: the
    bandwidth they need, what the storage gives, and the shortest interval it sustains."""
    interval = ckpt.interval_min if interval_min is None else interval_min
    if ckpt.durable_s == 0 and ckpt.stall_s >= costs.storage_s:
        return  # a blocking save writes inside its own stall, at the storage's bandwidth
    need = costs.needed_gbytes_per_s(ckpt, interval)
    if need <= costs.storage_gbytes_per_s * (1 + 1e-9):
        return
    cycles = ckpt.storage_every if ckpt.in_memory_peer else 1
    floor = max(costs.storage_s / cycles - ckpt.stall_s, 0.0) / 60.0
    raise SpecError("interval_min", round(interval, 4),
                    f"storage cannot sustain it: {costs.total_bytes / 1e12:.3g} TB every "
                    f"{cycles * (interval * 60 + ckpt.stall_s) / 60:.3g} min needs {need:.0f} "
                    f"GB/s, storage_gbytes_per_s={costs.storage_gbytes_per_s:g}; valid: >= "
                    f"{floor:.3g} min")


@dataclass(frozen=True)
class Policy:
    name: str
    checkpoint: CheckpointSpec
    recovery: RecoverySpec


def standard_policies(costs: CheckpointCosts, *, detect_s: float = 60.0,
                      restart_s: float = 300.0, replace_s: float = 1800.0,
                      storage_every: int = 10, spare_fraction: float = 0.02,
                      repair_h: float = 72.0) -> list[Policy]:
    """The three policies of the demo. Intervals are placeholders: ``compare`` sets each to
    its own optimum. Hot spares: ``spare_fraction`` of the job's nodes (at least 2). The
    storage policy's save blocks for the snapshot and the write (``costs.storage_write``
    "blocking") or for the snapshot only ("async")."""
    if costs.storage_write == "blocking":
        storage_ckpt = CheckpointSpec(stall_s=costs.stall_s + costs.storage_s, durable_s=0.0)
        name = "restart from storage (blocking save)"
    else:
        storage_ckpt = CheckpointSpec(stall_s=costs.stall_s, durable_s=costs.storage_s)
        name = "restart from storage (async save)"
    storage = Policy(
        name, storage_ckpt,
        RecoverySpec(detect_s=detect_s, restart_s=restart_s, replace_s=replace_s,
                     restore_storage_s=costs.storage_s + costs.load_overhead_s),
    )
    peer_ckpt = CheckpointSpec(stall_s=costs.stall_s, durable_s=costs.storage_s,
                               in_memory_peer=True, peer_durable_s=min(costs.peer_s,
                                                                       costs.storage_s),
                               storage_every=storage_every)
    peer_rec = storage.recovery.replace(restore_peer_s=costs.peer_s + costs.load_overhead_s)
    peer = Policy("in-memory peer checkpoints", peer_ckpt, peer_rec)
    spares = max(2, math.ceil(spare_fraction * costs.num_nodes))
    hot = Policy(f"peer checkpoints + {spares} hot spares", peer_ckpt,
                 peer_rec.replace(num_spares=spares, repair_h=repair_h))
    return [storage, peer, hot]


def with_best_interval(job: AvailabilityJob, failures: FailureModel, policy: Policy) -> Policy:
    """The policy with its checkpoint interval set to the closed-form optimum (within the
    intervals its writes keep up with: ``CheckpointSpec.min_interval_min``)."""
    lo, hi = search_bounds_min(failures.mtbf_h(job.num_nodes), policy.checkpoint)
    best = optimal_interval_min(
        lambda m: closed_form_ettr(job, failures, policy.checkpoint, policy.recovery, m)[0],
        lo, hi)
    return Policy(policy.name, policy.checkpoint.at_interval(best), policy.recovery)


def compare(job: AvailabilityJob, failures: FailureModel, policies: list[Policy], *,
            num_trials: int = 500, seed: int = 0, costs: CheckpointCosts | None = None,
            interval_min: float | None = None,
            ) -> list[tuple[Policy, AvailabilityResult, AvailabilityResult | None]]:
    """(policy at its best interval, or at ``interval_min`` for all when given, Monte-Carlo
    result, closed-form result or None when the closed form cannot represent the failure
    model) per policy. With ``costs``, every interval is checked against the storage's
    bandwidth (``check_sustainable``: SpecError if it cannot keep up)."""
    rows = []
    for policy in policies:
        if interval_min is None:
            tuned = with_best_interval(job, failures, policy)
        else:
            if costs is not None:
                check_sustainable(costs, policy.checkpoint, interval_min)
            tuned = Policy(policy.name, policy.checkpoint.at_interval(interval_min),
                           policy.recovery)
        if costs is not None:
            check_sustainable(costs, tuned.checkpoint)
        mc = monte_carlo(job, failures, tuned.checkpoint, tuned.recovery,
                         num_trials=num_trials, seed=seed, optimize=False)
        cf = None
        if failures.distribution == "exponential":
            cf = closed_form(job, failures, tuned.checkpoint, tuned.recovery)
        rows.append((tuned, mc, cf))
    return rows
