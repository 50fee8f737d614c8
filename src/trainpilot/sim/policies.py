"""Recovery policies side by side: restart from storage, in-memory peer checkpoints, hot spares.

Checkpoint and restore times follow from the checkpoint's size and the wires, so the comparison
is specific to a job: a sharded checkpoint of ``bytes_per_param`` bytes per parameter (bf16
weights 2 + fp32 master weights 4 + two fp32 Adam moments 8 = 14 by default), snapshotted to host
memory over PCIe (the blocking stall), then written to shared storage at its aggregate
bandwidth (time until durable) or copied to a peer node over the inter-node network. The
defaults are assumptions to replace with your own measurements; each is a field below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    its own optimum. Hot spares: ``spare_fraction`` of the job's nodes (at least 2)."""
    storage = Policy(
        "restart from storage",
        CheckpointSpec(stall_s=costs.stall_s, durable_s=costs.storage_s),
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
    """The policy with its checkpoint interval set to the closed-form optimum."""
    lo, hi = search_bounds_min(failures.mtbf_h(job.num_nodes), policy.checkpoint)
    best = optimal_interval_min(
        lambda m: closed_form_ettr(job, failures, policy.checkpoint, policy.recovery, m)[0],
        lo, hi)
    return Policy(policy.name, policy.checkpoint.at_interval(best), policy.recovery)


def compare(job: AvailabilityJob, failures: FailureModel, policies: list[Policy], *,
            num_trials: int = 500, seed: int = 0,
            ) -> list[tuple[Policy, AvailabilityResult, AvailabilityResult | None]]:
    """(policy at its best interval, Monte-Carlo result, closed-form result or None when the
    closed form cannot represent the failure model) per policy."""
    rows = []
    for policy in policies:
        tuned = with_best_interval(job, failures, policy)
        mc = monte_carlo(job, failures, tuned.checkpoint, tuned.recovery,
                         num_trials=num_trials, seed=seed, optimize=False)
        cf = None
        if failures.distribution == "exponential":
            cf = closed_form(job, failures, tuned.checkpoint, tuned.recovery)
        rows.append((tuned, mc, cf))
    return rows
