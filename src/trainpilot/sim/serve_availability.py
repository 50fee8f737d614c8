"""Availability of a serving deployment: instances that fail whole, and the remedy ladder.

A deployment is ``num_instances`` identical instances of ``nodes_per_instance`` nodes (an
expert-parallel decode unit: one failed device stops its whole instance, so the blast radius
grows with the EP size). Failures arrive per node at the failure model's rate (default: the
Llama 3 mix), so an instance fails at ``nodes x rate``. A *remedy* says what a failure costs:

* ``down_s``: the instance serves nothing for this long (detection, then the remedy's action);
* then, for ``degraded_s``, it serves at ``degraded_capacity`` of its throughput (expert
  migration: the survivors hold the lost device's experts until a replacement joins); a
  failure while degraded costs a full ``fallback_down_s`` restart instead;
* the requests in flight on the instance are ``lost`` (the client must resend them, and their
  tokens are redone) or ``retried`` at token level (they resume from their last token).

Demand is a fraction ``load`` of the deployment's nominal token rate; at any moment the
deployment serves min(demand, the sum of its instances' capacities): a request that arrives
when demand exceeds capacity queues and misses its SLO, as does one in flight when its instance
goes down for longer than ``slo_stall_s`` (and every lost one).

Closed form: each instance is a semi-Markov process UP -> DOWN -> DEGRADED -> UP (or ->
FALLBACK -> UP), independent of the others; by the renewal-reward theorem its long-run share
of time in each state is that state's mean sojourn per cycle over the mean cycle; the capacity
of the deployment is then a sum of independent per-instance capacities, whose distribution is
enumerated exactly, and served tokens = E[min(demand, capacity)]. A failure during DOWN is
absorbed (the instance is already down). Exact for that model; the Monte-Carlo engine walks
the same model event by event and must agree within its interval (tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pydantic
from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt

from trainpilot.sim.failures import FailureModel
from trainpilot.specs.base import Spec
from trainpilot.specs.errors import SpecError


class ServeDeployment(Spec):
    """Instances, their throughput and what is in flight on each (units in the names)."""

    num_instances: PositiveInt
    nodes_per_instance: PositiveInt
    tokens_per_s_per_instance: PositiveFloat  # nominal output throughput (Sim2Infer)
    concurrency_per_instance: PositiveFloat  # sequences decoding at once
    output_len: PositiveInt  # tokens per request
    load: float = pydantic.Field(default=0.7, gt=0, le=1)  # demand / nominal throughput
    duration_h: PositiveFloat = 24.0 * 30
    slo_stall_s: NonNegativeFloat = 10.0  # a request stalled longer than this misses its SLO

    @property
    def demand_tokens_per_s(self) -> float:
        return self.load * self.num_instances * self.tokens_per_s_per_instance


class Remedy(Spec):
    """What one failure costs an instance (see the module docstring)."""

    name: str
    down_s: NonNegativeFloat
    degraded_capacity: float = pydantic.Field(default=1.0, ge=0, le=1)
    degraded_s: NonNegativeFloat = 0.0
    fallback_down_s: NonNegativeFloat = 0.0
    requests: Literal["lost", "retried"] = "lost"
    note: str = ""


def standard_remedies(*, nodes_per_instance: int, detect_s: float = 10.0,
                      cold_restart_s: float = 1200.0, restart_s: float = 300.0,
                      token_retry_s: float = 45.0, migrate_s: float | None = None,
                      spare_s: float = 120.0, repair_h: float = 2.0) -> list[Remedy]:
    """The ladder with the issue's figures: switch to another instance while this one is
    restarted cold (20 min), restart inside the instance (5 min), retry at token level with the
    instance back in 30-60 s (45 s), migrate the lost node's experts to the survivors (serve at
    (n-1)/n until a replacement joins after ``repair_h``), or swap in a hot spare node
    (``spare_s``: join and load one node's weights). ``migrate_s`` default: detection plus 15 s
    to reload a node's experts from peer copies (about 41 GB of DeepSeek-V3 FP8 experts per
    node of an EP144 unit at ~3 GB/s per receiving device over InfiniBand, in parallel)."""
    migrate = detect_s + 15.0 if migrate_s is None else migrate_s
    n = nodes_per_instance
    return [
        Remedy(name="instance switch", down_s=detect_s + cold_restart_s, requests="lost",
               note="others absorb the traffic; cold restart 20 min"),
        Remedy(name="in-instance restart", down_s=detect_s + restart_s, requests="lost",
               note="restart the serving processes in place: 5 min"),
        Remedy(name="token-level retry", down_s=detect_s + token_retry_s, requests="retried",
               note="back in 30-60 s; requests resume from their last token"),
        Remedy(name="expert migration", down_s=migrate,
               degraded_capacity=(n - 1) / n if n > 1 else 0.0,
               degraded_s=repair_h * 3600 if n > 1 else 0.0,
               fallback_down_s=detect_s + restart_s, requests="retried",
               note="lost experts reloaded on the survivors; (n-1)/n capacity until repaired"),
        Remedy(name="hot spare", down_s=detect_s + spare_s, requests="retried",
               note="a spare node joins and loads its shard"),
    ]


@dataclass
class ServeAvailability:
    """One engine's answer for one remedy. Rates are per day; ``*_ci95`` from Monte-Carlo."""

    engine: str
    remedy: str
    availability: float  # mean capacity / nominal
    served_fraction: float  # tokens served / tokens demanded
    tokens_served: float  # over the horizon
    failures_per_day: float  # failures that hit a serving instance
    requests_lost_per_day: float
    requests_retried_per_day: float
    slo_attainment: float  # share of requests that met their SLO
    availability_ci95: tuple[float, float] | None = None
    served_ci95: tuple[float, float] | None = None
    failures_ci95: tuple[float, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


def instance_rate_per_h(dep: ServeDeployment, failures: FailureModel) -> float:
    """Failures per hour of one instance (every node's rate; any failure stops the instance)."""
    return failures.per_node_per_hour * dep.nodes_per_instance


def _state_shares(lam: float, r: Remedy) -> tuple[dict[str, float], float]:
    """(long-run share of time UP / DOWN / DEGRADED / FALLBACK, serving failures per hour)."""
    down, deg, fall = r.down_s / 3600, r.degraded_s / 3600, r.fallback_down_s / 3600
    p_fail = 1.0 - math.exp(-lam * deg) if deg > 0 else 0.0
    m_deg = p_fail / lam if deg > 0 else 0.0  # E[min(Exp(lam), deg)]
    times = dict(up=1.0 / lam, down=down, degraded=m_deg, fallback=p_fail * fall)
    cycle = sum(times.values())
    shares = {k: v / cycle for k, v in times.items()}
    return shares, (1.0 + p_fail) / cycle  # failures per cycle: the one from UP, one in DEG


def _capacity_distribution(n: int, shares: dict[str, float], degraded_capacity: float,
                           ) -> list[tuple[float, float]]:
    """(capacity in instances, probability) for ``n`` independent instances."""
    p_up, p_deg = shares["up"], shares["degraded"]
    p_zero = 1.0 - p_up - p_deg
    out = []
    log_fact = [math.lgamma(i + 1) for i in range(n + 1)]
    for up in range(n + 1):
        for deg in range(n - up + 1):
            zero = n - up - deg
            logp = log_fact[n] - log_fact[up] - log_fact[deg] - log_fact[zero]
            for count, p in ((up, p_up), (deg, p_deg), (zero, p_zero)):
                if count:
                    if p <= 0:
                        logp = -math.inf
                        break
                    logp += count * math.log(p)
            if logp > -700:
                out.append((up + deg * degraded_capacity, math.exp(logp)))
    return out


def closed_form(dep: ServeDeployment, failures: FailureModel, remedy: Remedy,
                ) -> ServeAvailability:
    """The exact long-run answer for independent instances (module docstring)."""
    lam = instance_rate_per_h(dep, failures)
    shares, fail_per_h = _state_shares(lam, remedy)
    n, demand = dep.num_instances, dep.load * dep.num_instances
    dist = _capacity_distribution(n, shares, remedy.degraded_capacity)
    served = sum(p * min(demand, cap) for cap, p in dist)
    availability = shares["up"] + shares["degraded"] * remedy.degraded_capacity
    rate = dep.tokens_per_s_per_instance
    hits_per_day = n * fail_per_h * 24
    return _result("closed_form", dep, remedy, availability, served / demand,
                   served * rate * dep.duration_h * 3600, hits_per_day, extra=dict(
                       state_shares=shares, instance_mtbf_h=1.0 / lam))


def _result(engine, dep, remedy, availability, served_fraction, tokens_served,
            hits_per_day, **kwargs) -> ServeAvailability:
    """Requests lost or retried follow from the failures that hit a serving instance: each
    holds ``concurrency x load`` requests in flight (Little's law at that load)."""
    in_flight = dep.concurrency_per_instance * dep.load
    touched = hits_per_day * in_flight
    requests_per_day = dep.demand_tokens_per_s * 86400 / dep.output_len
    stalled = touched if (remedy.requests == "lost" or remedy.down_s > dep.slo_stall_s) else 0.0
    slo = max(0.0, served_fraction - stalled / requests_per_day)
    return ServeAvailability(
        engine=engine, remedy=remedy.name, availability=availability,
        served_fraction=served_fraction, tokens_served=tokens_served,
        failures_per_day=hits_per_day,
        requests_lost_per_day=touched if remedy.requests == "lost" else 0.0,
        requests_retried_per_day=touched if remedy.requests == "retried" else 0.0,
        slo_attainment=slo, **kwargs)


def monte_carlo(dep: ServeDeployment, failures: FailureModel, remedy: Remedy, *,
                num_trials: int = 200, seed: int = 0) -> ServeAvailability:
    """The same model walked event by event over ``duration_h``, ``num_trials`` times: each
    instance's state timeline from exponential failure times and the remedy's fixed durations;
    served tokens integrate min(demand, capacity) over the merged timelines."""
    if num_trials < 2:
        raise SpecError("num_trials", num_trials, "valid: at least 2")
    rng = np.random.default_rng(seed)
    lam = instance_rate_per_h(dep, failures)
    horizon = dep.duration_h
    n, demand = dep.num_instances, dep.load * dep.num_instances
    avail, served, hits = [], [], []
    for _ in range(num_trials):
        changes: list[tuple[float, float]] = []  # (time, capacity delta)
        trial_hits = 0
        for _ in range(n):
            t, trial_hits = _walk_instance(rng, lam, remedy, horizon, changes, trial_hits)
        changes.sort()
        cap, last, area, serve = float(n), 0.0, 0.0, 0.0
        for time_h, delta in changes:
            if time_h > horizon:
                break
            area += cap * (time_h - last)
            serve += min(demand, cap) * (time_h - last)
            cap, last = cap + delta, time_h
        area += cap * (horizon - last)
        serve += min(demand, cap) * (horizon - last)
        avail.append(area / (n * horizon))
        served.append(serve / (demand * horizon))
        hits.append(trial_hits / (horizon / 24))
    a, s, h = np.array(avail), np.array(served), np.array(hits)

    def ci(x):
        half = 1.96 * float(x.std(ddof=1)) / math.sqrt(len(x))
        return (float(x.mean()) - half, float(x.mean()) + half)

    rate = dep.tokens_per_s_per_instance
    return _result("monte_carlo", dep, remedy, float(a.mean()), float(s.mean()),
                   float(s.mean()) * demand * rate * horizon * 3600, float(h.mean()),
                   availability_ci95=ci(a), served_ci95=ci(s), failures_ci95=ci(h),
                   extra=dict(num_trials=num_trials))


def _walk_instance(rng, lam: float, r: Remedy, horizon: float,
                   changes: list[tuple[float, float]], hits: int) -> tuple[float, int]:
    """Append one instance's capacity changes; return (end time, failures that hit it
    while serving). Starts UP at t = 0 (the long-run regime is reached after a cycle: the
    horizon spans many)."""
    down, deg, fall = r.down_s / 3600, r.degraded_s / 3600, r.fallback_down_s / 3600
    t = 0.0
    while True:
        t += rng.exponential(1.0 / lam)
        if t >= horizon:
            return t, hits
        hits += 1
        changes.append((t, -1.0))
        t += down
        if deg > 0:
            changes.append((t, r.degraded_capacity))
            fail = rng.exponential(1.0 / lam)
            if fail < deg:
                t += fail
                if t < horizon:
                    hits += 1
                changes.append((t, -r.degraded_capacity))
                t += fall
                changes.append((t, 1.0))
            else:
                t += deg
                changes.append((t, 1.0 - r.degraded_capacity))
        else:
            changes.append((t, 1.0))


@dataclass(frozen=True)
class EpRow:
    """One EP size of a fixed device budget, with both engines per remedy."""

    ep: int
    deployment: ServeDeployment
    results: list[tuple[Remedy, ServeAvailability, ServeAvailability]]


def compare_ep_sizes(model, cluster, plan, ep_sizes: list[int], failures: FailureModel, *,
                     load: float, duration_h: float, num_trials: int = 200, seed: int = 0,
                     eff=None, remedies_for=standard_remedies) -> list[EpRow]:
    """For each EP size: as many decode instances of that size as ``cluster`` holds, their
    throughput and batch from Sim2Infer (``plan`` with its decode layout set to EP = DP-attention
    = size, TP 1), then every remedy under both engines."""
    from trainpilot.sim.serve import simulate_serve
    from trainpilot.specs.serve import InstanceLayout

    rows = []
    per_node = cluster.devices_per_node
    for ep in ep_sizes:
        if ep % per_node and ep > per_node:
            raise SpecError("--ep-sizes", ep, f"valid: whole {per_node}-device nodes or fewer")
        experts = model.moe.num_experts if model.moe else 0
        redundant = plan.decode.num_redundant_experts
        if experts and (experts + redundant) % ep:
            redundant = (-experts) % ep
        layout = InstanceLayout(tp=1, dp_attention=ep, ep=ep if experts else 1,
                                num_redundant_experts=redundant if experts else 0)
        sized = plan.replace(decode=layout.to_dict(), batch_size=None)
        report = simulate_serve(model, cluster, sized, eff) if eff else \
            simulate_serve(model, cluster, sized)
        num = cluster.num_devices // ep
        if num < 1:
            raise SpecError("--ep-sizes", ep, f"larger than the cluster's {cluster.num_devices} "
                            "devices")
        dep = ServeDeployment(num_instances=num, nodes_per_instance=max(1, ep // per_node),
                              tokens_per_s_per_instance=report.output_tokens_per_s_per_instance,
                              concurrency_per_instance=report.batch_size,
                              output_len=plan.output_len, load=load, duration_h=duration_h)
        results = [(r, closed_form(dep, failures, r),
                    monte_carlo(dep, failures, r, num_trials=num_trials, seed=seed))
                   for r in remedies_for(nodes_per_instance=dep.nodes_per_instance)]
        rows.append(EpRow(ep, dep, results))
    return rows
