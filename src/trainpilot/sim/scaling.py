"""Scaling, time, cost and energy: plan each device count and price the training run.

For each device count N: the planner picks a layout, the cost model predicts its step time,
and from it follow throughput, MFU, linearity (throughput(N) / (throughput(N0) * N / N0)), the
failure-free time to train the token budget, device-hours, cost, energy and CO2. With an
availability model the expected wall-clock days include failures (time / ETTR, the closed-form
ETTR at that size's optimal checkpoint interval).

Cross-rack congestion (``Oversubscription``): a cluster preset's racks are joined by a
non-blocking fat tree (the inter-rack tier has the inter-node bandwidth, more latency). Real
fabrics taper above a non-blocking domain: Meta's Llama 3 clusters join 3,072-GPU pods (384
nodes, full bisection inside) through an aggregation layer oversubscribed 1:7 (Llama 3 report,
sec. 3.3.1). With ``Oversubscription(ratio, domain_nodes)`` a job spanning several domains gets
the cross-domain tier at ``inter_node / ratio`` per device: every device of a domain sending
across it at once, as the data-parallel ring (placed outermost by the cost model) does. That is
pessimistic where a schedule keeps cross-domain traffic to a few ranks (pipeline boundaries).

Energy = devices x board power (``DeviceSpec.power_w``, full load) x PUE x wall time: a
ceiling, since devices draw less while waiting on communication or a restart.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from trainpilot.sim.availability import (
    AvailabilityJob,
    CheckpointSpec,
    RecoverySpec,
    closed_form_ettr,
    optimal_interval_min,
    search_bounds_min,
)
from trainpilot.sim.failures import FailureModel
from trainpilot.specs import ClusterSpec, ModelSpec, Plan, SpecError

# A planner returns the chosen plan and its prediction for one cluster size.
Planner = Callable[[ModelSpec, ClusterSpec, int, int], tuple[Plan, Any]]


@dataclass(frozen=True, kw_only=True)
class CostInputs:
    """Prices and the energy model (units in the names)."""

    price_per_device_hour: float | None = None  # USD; default: the cluster's, else none
    power_w: float | None = None  # per device; default: DeviceSpec.power_w
    pue: float = 1.1  # facility power / IT power (hyperscale data centres report ~1.1)
    grid_kg_co2_per_kwh: float = 0.4  # grid carbon intensity

    def __post_init__(self) -> None:
        if self.pue < 1.0:
            raise SpecError("pue", self.pue, "valid: >= 1.0")
        if self.grid_kg_co2_per_kwh < 0:
            raise SpecError("grid_kg_co2_per_kwh", self.grid_kg_co2_per_kwh, "valid: >= 0")


@dataclass(frozen=True, kw_only=True)
class Oversubscription:
    """Bandwidth taper above a non-blocking domain of ``domain_nodes`` nodes (default: the
    cluster's racks): traffic between domains gets ``1 / ratio`` of the per-device bandwidth.
    ``ratio`` 7 and 384 nodes are the Llama 3 clusters' (report sec. 3.3.1)."""

    ratio: float = 1.0
    domain_nodes: int | None = None

    def __post_init__(self) -> None:
        if self.ratio < 1.0:
            raise SpecError("oversubscription", self.ratio, "valid: >= 1 (1 = non-blocking)")
        if self.domain_nodes is not None and self.domain_nodes < 1:
            raise SpecError("domain_nodes", self.domain_nodes, "valid: >= 1 node")

    def apply(self, cluster: ClusterSpec) -> ClusterSpec:
        """``cluster`` with its racks set to the domains and the tier between them tapered."""
        per_rack = self.domain_nodes or cluster.rack_nodes
        per_rack = min(per_rack, cluster.num_nodes)
        if self.ratio == 1.0 and per_rack == cluster.nodes_per_rack:
            return cluster
        link = cluster.inter_rack
        tapered = link.replace(gbytes_per_s=cluster.network.inter_node.gbytes_per_s / self.ratio)
        network = cluster.network.replace(inter_rack=tapered)
        return cluster.replace(nodes_per_rack=per_rack, network=network)


@dataclass(frozen=True, kw_only=True)
class ScalingRow:
    num_devices: int
    layout: str
    step_time_s: float
    tokens_per_s: float
    mfu: float
    linearity: float
    train_days: float  # failure-free
    device_hours: float
    cost_usd: float | None
    energy_mwh: float | None
    co2_t: float | None
    ettr: float | None = None
    wall_days: float | None = None  # with failures
    interval_min: float | None = None  # optimal checkpoint interval used

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def layout_str(plan: Plan) -> str:
    parts = [f"tp={plan.tp}", f"pp={plan.pp}", f"dp={plan.dp}"]
    for key in ("vp", "ep", "cp"):
        if getattr(plan, key) > 1:
            parts.append(f"{key}={getattr(plan, key)}")
    parts.append(f"mbs={plan.micro_batch_size}")
    if plan.recompute != "none":
        parts.append(f"recompute={plan.recompute}")
    return " ".join(parts)


def expected_ettr(num_devices: int, devices_per_node: int, failures: FailureModel,
                  ckpt: CheckpointSpec, rec: RecoverySpec) -> tuple[float, float]:
    """(ETTR, interval in minutes) at the optimal checkpoint interval, closed form."""
    job = AvailabilityJob(num_nodes=max(1, math.ceil(num_devices / devices_per_node)),
                          devices_per_node=min(devices_per_node, num_devices))
    lo, hi = search_bounds_min(failures.mtbf_h(job.num_nodes), ckpt)
    best = optimal_interval_min(lambda m: closed_form_ettr(job, failures, ckpt, rec, m)[0],
                                lo, hi)
    return closed_form_ettr(job, failures, ckpt, rec, best)[0], best


def scaling_table(model: ModelSpec, cluster: ClusterSpec, device_counts: list[int], *,
                  global_batch_size: int, seq_len: int, total_tokens: float,
                  planner: Planner, costs: CostInputs = CostInputs(),
                  availability: tuple[FailureModel, CheckpointSpec, RecoverySpec] | None = None,
                  oversubscription: Oversubscription = Oversubscription(),
                  on_row: Callable[[ScalingRow], None] | None = None) -> list[ScalingRow]:
    """One row per device count (in the order given; linearity is against the first), each
    planned on the cluster with ``oversubscription`` applied."""
    if not device_counts:
        raise SpecError("devices", device_counts, "valid: one or more device counts")
    if total_tokens <= 0:
        raise SpecError("tokens", total_tokens, "valid: a positive token budget")
    price = costs.price_per_device_hour
    if price is None:
        price = cluster.price_per_device_hour
    power = costs.power_w if costs.power_w is not None else cluster.device.power_w
    rows: list[ScalingRow] = []
    base: tuple[int, float] | None = None
    for n in device_counts:
        sized = oversubscription.apply(cluster.with_devices(n))
        plan, pred = planner(model, sized, global_batch_size, seq_len)
        tps = pred.tokens_per_s
        base = base or (n, tps)
        seconds = total_tokens / tps
        ettr = interval = wall_days = None
        if availability is not None:
            ettr, interval = expected_ettr(n, sized.devices_per_node, *availability)
            wall_days = seconds / ettr / 86400.0
        held_s = seconds / ettr if ettr else seconds
        device_hours = n * held_s / 3600.0
        energy_mwh = (n * power * costs.pue * held_s / 3.6e9) if power else None
        row = ScalingRow(
            num_devices=n, layout=layout_str(plan), step_time_s=pred.step_time_s,
            tokens_per_s=tps, mfu=pred.mfu, linearity=tps / (base[1] * n / base[0]),
            train_days=seconds / 86400.0, device_hours=device_hours,
            cost_usd=device_hours * price if price is not None else None,
            energy_mwh=energy_mwh,
            co2_t=energy_mwh * costs.grid_kg_co2_per_kwh if energy_mwh is not None else None,
            ettr=ettr, wall_days=wall_days, interval_min=interval,
        )
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


def default_planner(model: ModelSpec, cluster: ClusterSpec, global_batch_size: int,
                    seq_len: int) -> tuple[Plan, Any]:
    """The planner's best layout (``trainpilot.plan.search``) for this size."""
    from trainpilot.plan import search  # noqa: PLC0415 (the layer above perf, optional here)

    found = search(model, cluster, global_batch_size=global_batch_size, seq_len=seq_len, top=1)
    if not found:
        raise SpecError("devices", cluster.num_devices,
                        f"no layout of {model.name} fits {cluster.num_devices} devices with "
                        f"global_batch_size={global_batch_size}")
    best = found[0]
    plan = getattr(best, "plan", None) or best[0]
    pred = getattr(best, "prediction", None) or best[1]
    return plan, pred


def grid_planner(model: ModelSpec, cluster: ClusterSpec, global_batch_size: int,
                 seq_len: int) -> tuple[Plan, Any]:
    """A small exhaustive planner used until ``trainpilot.plan.search`` is available: every
    tp (powers of two within a node) x pp (dividing the layers) x recompute mode with
    micro-batch 1 and ZeRO-1; the fastest predicted plan that fits in memory wins."""
    from trainpilot.perf import Estimator, predict
    from trainpilot.specs import check_job

    est = Estimator(model, cluster)
    n, best = cluster.num_devices, None
    tps = [t for t in (1, 2, 4, 8) if t <= cluster.devices_per_node]
    pps = [p for p in range(1, model.num_hidden_layers + 1) if model.num_hidden_layers % p == 0]
    for tp in tps:
        for pp in pps:
            if n % (tp * pp) or global_batch_size % (n // (tp * pp)):
                continue
            for recompute in ("none", "selective", "full"):
                try:
                    plan = Plan(tp=tp, pp=pp, dp=n // (tp * pp), seq_len=seq_len,
                                global_batch_size=global_batch_size, recompute=recompute,
                                sequence_parallel=tp > 1)
                    check_job(model, cluster, plan)
                except (SpecError, ValueError):
                    continue
                pred = predict(model, cluster, plan, estimator=est)
                if pred.fits and (best is None or pred.tokens_per_s > best[1].tokens_per_s):
                    best = (plan, pred)
                if pred.fits:
                    break  # less recomputation is always faster: stop at the first that fits
    if best is None:
        raise SpecError("devices", n, f"no tp x pp x dp layout of {model.name} fits {n} devices "
                        f"with global_batch_size={global_batch_size}")
    return best


def planner_or_fallback() -> tuple[Planner, str]:
    """The layout search when it is installed, else ``grid_planner``; and which one."""
    import importlib

    try:
        plan = importlib.import_module("trainpilot.plan")
    except ImportError:
        return grid_planner, "grid"
    return (default_planner, "search") if hasattr(plan, "search") else (grid_planner, "grid")
