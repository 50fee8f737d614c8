"""Availability under failures: the job, checkpoint and recovery documents, and the closed forms.

Model (shared with the Monte-Carlo engine in ``montecarlo.py``): the job computes for
``interval`` then stalls ``stall`` to snapshot; the snapshot commits at the end of the stall and
becomes durable ``durable`` later (asynchronous upload; training goes on meanwhile). An
interruption rolls progress back to the last durable checkpoint and starts a recovery:
detection, waiting for a replacement node (hardware classes), restart / re-rendezvous, and
restore (from a peer's host memory, or from storage). An interruption during a recovery starts a
new one. ETTR = productive time / wall time (Kokolis et al. 2024's "effective training time
ratio"); productive time is the training progress that survives.

Closed forms here:
- Young 1974 first-order interval sqrt(2 delta M); Daly 2006 higher-order interval.
- Kokolis et al. 2024 first-order E[ETTR] = (1 - N r_f (u0 + dt_cp / 2)) / (1 + w / dt_cp), w the
  checkpoint write (blocking) time; w = 0 for non-blocking saves.
- ``closed_form``: the exact long-run ETTR of the model above for exponential (memoryless)
  interruptions with a mix of classes. Per cycle between interruptions (length ~ Exp(lambda)),
  the work that survives is tau * sum_k P(cycle compute >= k s + d) with s = tau + delta, which
  sums to tau * exp(-lambda (R_c + d)) / (exp(lambda s) - 1); for one class and d = 0 it is Daly
  2006's T_w = M e^{R/M} (e^{(tau+delta)/M} - 1) T_s / tau exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pydantic
from pydantic import NonNegativeFloat, PositiveFloat, PositiveInt

from trainpilot.sim.failures import FailureModel
from trainpilot.specs.base import Spec
from trainpilot.specs.errors import SpecError

BADPUT_KEYS = ("checkpoint_stall", "lost_progress", "detection", "spare_wait", "restart",
               "restore", "retry")


class AvailabilityJob(Spec):
    """The job: nodes, devices per node, and how long it runs (hours of wall time)."""

    num_nodes: PositiveInt
    devices_per_node: PositiveInt = 8
    duration_h: PositiveFloat = 24.0 * 30

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node


class CheckpointSpec(Spec):
    """When state is saved and how long until a save survives a failure."""

    interval_min: PositiveFloat = 30.0  # compute time between saves
    stall_s: NonNegativeFloat = 0.0  # blocking time per save (training paused)
    durable_s: NonNegativeFloat = 0.0  # after the stall, until the storage copy is complete
    in_memory_peer: bool = False  # every save is also copied to a peer node's host memory
    peer_durable_s: NonNegativeFloat = 0.0  # after the stall, until the peer copy lands
    storage_every: PositiveInt = 1  # with peers: every n-th save also goes to storage

    @pydantic.model_validator(mode="after")
    def _check(self) -> CheckpointSpec:
        if self.interval_min < self.min_interval_min:
            raise SpecError("interval_min", self.interval_min,
                            f"a save cannot start before the previous one is written; "
                            f"valid: >= {self.min_interval_min:.3g}")
        if self.in_memory_peer and self.peer_durable_s > self.durable_s:
            raise SpecError("peer_durable_s", self.peer_durable_s,
                            f"valid: <= durable_s={self.durable_s} (a storage save includes "
                            "the in-memory snapshot)")
        return self


    @property
    def min_interval_min(self) -> float:
        """Shortest interval at which the writes keep up: a save's storage write (every
        ``storage_every``-th save with peers) and peer copy end before the next one starts."""
        cycles = self.storage_every if self.in_memory_peer else 1
        write_s = max(self.durable_s / cycles, self.peer_durable_s if self.in_memory_peer else 0)
        return max(write_s - self.stall_s, 0.0) / 60.0

    def at_interval(self, interval_min: float) -> CheckpointSpec:
        """A copy at ``interval_min`` (validated)."""
        return self.replace(interval_min=interval_min)


class RecoverySpec(Spec):
    """What an interruption costs, in seconds, and the spare-node pool."""

    detect_s: NonNegativeFloat = 60.0  # until the failure is noticed (watchdog, heartbeat)
    restart_s: NonNegativeFloat = 300.0  # reschedule, torchrun re-rendezvous, comm init
    restore_storage_s: NonNegativeFloat = 300.0  # read the checkpoint back from storage
    restore_peer_s: NonNegativeFloat = 30.0  # pull the snapshot from a peer's host memory
    num_spares: int = pydantic.Field(default=0, ge=0)  # hot spare nodes (0: cold replacement)
    replace_s: NonNegativeFloat = 1800.0  # cold path: get and health-check a replacement node
    repair_h: PositiveFloat = 72.0  # a failed node's return to the hot spare pool
    retry_fraction: float = pydantic.Field(default=0.0, ge=0, le=1)  # transient faults absorbed
    retry_s: NonNegativeFloat = 30.0  # pause per absorbed fault (timeout + re-issue)


@dataclass
class AvailabilityResult:
    """What one engine says about a job under a failure model and policies.

    ``ettr_ci95`` is the 95% interval of the expected ETTR (Monte-Carlo error; the closed form
    gives a point, so both ends are equal); ``ettr_range95`` spans the middle 95% of single
    runs (Monte-Carlo only). Hours in ``badput_h`` sum with productive hours to ``horizon_h``.
    """

    engine: str
    ettr: float
    ettr_ci95: tuple[float, float]
    interruptions: float
    lost_work_h: float
    badput_h: dict[str, float]
    optimal_interval_min: float
    mtbf_h: float
    horizon_h: float
    interval_min: float
    retries: float = 0.0
    ettr_range95: tuple[float, float] | None = None
    num_trials: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = dict(engine=self.engine, ettr=self.ettr, ettr_ci95=list(self.ettr_ci95),
                   interruptions=self.interruptions, lost_work_h=self.lost_work_h,
                   badput_h=dict(self.badput_h), optimal_interval_min=self.optimal_interval_min,
                   mtbf_h=self.mtbf_h, horizon_h=self.horizon_h,
                   interval_min=self.interval_min, retries=self.retries)
        if self.ettr_range95 is not None:
            out["ettr_range95"] = list(self.ettr_range95)
        if self.num_trials is not None:
            out["num_trials"] = self.num_trials
        out.update(self.extra)
        return out


# ---------------------------------------------------------------- textbook closed forms


def young_interval(stall: float, mtbf: float) -> float:
    """Young 1974: optimal compute time between saves, sqrt(2 delta M) (any unit, same in/out)."""
    return math.sqrt(2.0 * stall * mtbf)


def daly_interval(stall: float, mtbf: float) -> float:
    """Daly 2006's higher-order optimum: for delta < 2M,
    sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta; else M."""
    if stall >= 2.0 * mtbf:
        return mtbf
    x = stall / (2.0 * mtbf)
    return math.sqrt(2.0 * stall * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - stall


def daly_wall_time(work: float, interval: float, stall: float, restart: float,
                   mtbf: float) -> float:
    """Daly 2006's expected wall time for ``work`` of solve time (exponential failures, failures
    possible during restart): M e^{R/M} (e^{(tau+delta)/M} - 1) T_s / tau."""
    return mtbf * math.exp(restart / mtbf) * math.expm1((interval + stall) / mtbf) * work / interval


def kokolis_ettr(*, num_nodes: int, failures_per_node_day: float, restart_min: float,
                 interval_min: float, write_min: float = 0.0) -> float:
    """Kokolis et al. 2024 (sec. V, "Revisiting Reliability in Large-Scale Machine Learning
    Research Clusters", arXiv 2410.21680) first-order expected ETTR:

        E[ETTR] = (1 - N r_f (u0 + dt_cp / 2)) / (1 + w / dt_cp)

    with rate r_f per node-day, restart overhead u0, interval dt_cp and checkpoint write time w
    (training paused while writing), all in minutes. ``write_min`` = 0 is the non-blocking case
    1 - N r_f (u0 + dt_cp / 2). Accurate while N r_f (u0 + dt_cp) << 1; it linearises the
    exact renewal result (``closed_form_ettr`` with ``stall_s`` = w)."""
    if write_min < 0:
        raise SpecError("write_min", write_min, "valid: >= 0 minutes")
    rate_per_min = num_nodes * failures_per_node_day / (24.0 * 60.0)
    return (1.0 - rate_per_min * (restart_min + interval_min / 2.0)) / (
        1.0 + write_min / interval_min)


def kokolis_interval_min(*, num_nodes: int, failures_per_node_day: float,
                         write_min: float) -> float:
    """The interval maximising ``kokolis_ettr`` to first order: sqrt(2 w / (N r_f)) minutes
    (Young's rule with the write time as the checkpoint cost)."""
    rate_per_min = num_nodes * failures_per_node_day / (24.0 * 60.0)
    return math.sqrt(2.0 * write_min / rate_per_min)


# ---------------------------------------------------------------- the exact renewal form


@dataclass(frozen=True)
class _ClassCost:
    share: float  # of interruptions
    phases_h: tuple[float, float, float, float]  # detection, spare wait, restart, restore
    durable_h: float  # after commit, until a save usable by this class's restore survives
    every: int = 1  # only every n-th save is usable (storage restores when peers hold the rest)


def _interrupt_rate_and_classes(job: AvailabilityJob, failures: FailureModel,
                                ckpt: CheckpointSpec, rec: RecoverySpec,
                                ) -> tuple[float, float, list[_ClassCost]]:
    """Interrupt rate and retry rate per hour, and each interrupting class's recovery."""
    rate = failures.job_rate_per_hour(job.num_nodes)
    shares = failures.shares()
    absorbed = sum(s * rec.retry_fraction for s, c in zip(shares, failures.classes)
                   if c.transient)
    costs: list[_ClassCost] = []
    for share, cls in zip(shares, failures.classes):
        keep = share * (1.0 - (rec.retry_fraction if cls.transient else 0.0))
        if keep <= 0:
            continue
        wait_h = rec.replace_s / 3600 if (cls.needs_replacement and rec.num_spares == 0) else 0.0
        # A correlated event takes down a node and (we assume) its peer, so peers' copies are
        # gone and the restore comes from storage.
        corr = failures.correlated_fraction if cls.needs_replacement else 0.0
        for sub, peer_ok in ((1.0 - corr, ckpt.in_memory_peer), (corr, False)):
            if sub <= 0:
                continue
            restore_s = rec.restore_peer_s if peer_ok else rec.restore_storage_s
            durable_s = ckpt.peer_durable_s if peer_ok else ckpt.durable_s
            every = ckpt.storage_every if (ckpt.in_memory_peer and not peer_ok) else 1
            phases = (rec.detect_s / 3600, wait_h, rec.restart_s / 3600, restore_s / 3600)
            costs.append(_ClassCost(keep * sub / (1.0 - absorbed), phases, durable_s / 3600,
                                    every))
    return rate * (1.0 - absorbed), rate * absorbed, costs


def _renewal(lam: float, tau: float, delta: float, costs: list[_ClassCost],
             ) -> tuple[float, dict[str, float]]:
    """Long-run ETTR and badput shares of wall time, exponential interruptions at ``lam`` per h.

    Exact for classes restoring from every save (``every`` = 1). With ``every`` = n > 1 (storage
    restores while peers hold the newer saves) it counts only every n-th save of the current
    cycle, which ignores rollbacks into earlier cycles: an approximation, flagged by the caller.
    """
    s = tau + delta
    saved = stall = 0.0
    phases = [0.0, 0.0, 0.0, 0.0]
    for c in costs:
        recovery = sum(c.phases_h)
        # Sum over k >= 1 of P(compute time in the cycle >= k * every * s + durable).
        saved += c.share * c.every * tau * math.exp(-lam * (recovery + c.durable_h)) / math.expm1(
            lam * c.every * s)
        stall += c.share * math.exp(-lam * recovery) * math.expm1(lam * delta) / (
            lam * math.expm1(lam * s))
        start = 0.0
        for i, dur in enumerate(c.phases_h):
            phases[i] += c.share * (math.exp(-lam * start) - math.exp(-lam * (start + dur))) / lam
            start += dur
    fractions = dict(checkpoint_stall=lam * stall, detection=lam * phases[0],
                     spare_wait=lam * phases[1], restart=lam * phases[2],
                     restore=lam * phases[3])
    ettr = lam * saved
    fractions["lost_progress"] = 1.0 - ettr - sum(fractions.values())
    return ettr, fractions


def closed_form_ettr(job: AvailabilityJob, failures: FailureModel, ckpt: CheckpointSpec,
                     rec: RecoverySpec, interval_min: float | None = None,
                     ) -> tuple[float, dict[str, float]]:
    """(ETTR, badput shares of wall time) at ``interval_min`` (default: the checkpoint's).

    Absorbed transient faults pause training ``retry_s`` each; that is counted to first order
    (the retry share of compute time), the rest is the exact renewal form.
    """
    lam, retry_rate, costs = _interrupt_rate_and_classes(job, failures, ckpt, rec)
    tau = (interval_min if interval_min is not None else ckpt.interval_min) / 60.0
    ettr, fractions = _renewal(lam, tau, ckpt.stall_s / 3600.0, costs)
    retry_share = retry_rate * rec.retry_s / 3600.0
    if retry_share:
        computing = ettr + fractions["checkpoint_stall"]
        fractions["retry"] = computing * retry_share
        ettr *= 1.0 - retry_share
        fractions["checkpoint_stall"] *= 1.0 - retry_share
    else:
        fractions["retry"] = 0.0
    return ettr, fractions


def optimal_interval_min(objective, lo_min: float, hi_min: float, *, iters: int = 60) -> float:
    """Golden-section search for the interval (minutes) maximising ``objective(interval_min)``
    on [lo, hi], in log space (the ETTR curve is unimodal in the interval)."""
    a, b = math.log(lo_min), math.log(hi_min)
    g = (math.sqrt(5.0) - 1.0) / 2.0
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = objective(math.exp(c)), objective(math.exp(d))
    for _ in range(iters):
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = objective(math.exp(c))
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = objective(math.exp(d))
    return math.exp((a + b) / 2.0)


def search_bounds_min(mtbf_h: float, ckpt: CheckpointSpec) -> tuple[float, float]:
    """A bracket for the optimal interval (minutes): around Young's value, from 10 s (or the
    shortest interval the writes keep up with) to a week."""
    young = young_interval(max(ckpt.stall_s, 1.0) / 60.0, mtbf_h * 60.0)
    lo = max(young / 50.0, 1.0 / 6.0, ckpt.min_interval_min * 1.0001)
    return lo, max(min(max(young * 20.0, 60.0), 24.0 * 60.0 * 7), lo * 2)


def closed_form(job: AvailabilityJob, failures: FailureModel, ckpt: CheckpointSpec,
                rec: RecoverySpec) -> AvailabilityResult:
    """The closed-form engine: exact long-run ETTR for exponential interruptions, badput by
    category, and the interval that maximises ETTR. Raises SpecError for inputs it cannot
    represent (Weibull, hot-spare queues: use the Monte-Carlo engine)."""
    if failures.distribution != "exponential":
        raise SpecError("failures.distribution", failures.distribution,
                        "the closed form needs exponential inter-arrivals; use the Monte-Carlo "
                        "engine for Weibull")
    ettr, fractions = closed_form_ettr(job, failures, ckpt, rec)
    mtbf = failures.mtbf_h(job.num_nodes)
    lo, hi = search_bounds_min(mtbf, ckpt)
    best = optimal_interval_min(
        lambda m: closed_form_ettr(job, failures, ckpt, rec, m)[0], lo, hi)
    lam, retry_rate, costs = _interrupt_rate_and_classes(job, failures, ckpt, rec)
    horizon = job.duration_h
    badput = {k: fractions.get(k, 0.0) * horizon for k in BADPUT_KEYS}
    # Exact: every restore can use every save, no spare queue, no first-order retry term, and
    # lemons (if any) never leave.
    exact = (all(c.every == 1 for c in costs) and not rec.num_spares and not rec.retry_fraction
             and not (failures.num_lemon_nodes and failures.quarantine_lemons))
    notes = dict(exact=exact, young_interval_min=young_interval(ckpt.stall_s / 60, mtbf * 60),
                 daly_interval_min=daly_interval(ckpt.stall_s / 60, mtbf * 60))
    return AvailabilityResult(
        engine="closed_form", ettr=ettr, ettr_ci95=(ettr, ettr),
        interruptions=lam * horizon, lost_work_h=badput["lost_progress"], badput_h=badput,
        optimal_interval_min=best, mtbf_h=mtbf, horizon_h=horizon,
        interval_min=ckpt.interval_min, retries=retry_rate * horizon, extra=notes,
    )
