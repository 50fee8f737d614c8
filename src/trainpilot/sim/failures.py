"""Failure models: per-node interruption rates by class, inter-arrival law, lemons, correlation.

The default mix is the Llama 3 405B pre-training report (Meta, "The Llama 3 Herd of Models",
2024, sec. 3.3.4 and Table 5): 419 unexpected interruptions in a 54-day snapshot of a job on
16,384 H100 (2,048 nodes of 8), about one every 3.1 hours. The counts below are Table 5's
"Interruption Count" column (its percentage column does not match the counts; we use counts).
Each class says whether the failed node must be swapped out (hardware) and whether an
operator-level retry (re-issuing the collective, re-establishing the connection) can absorb it
(transient network faults); those two flags are our reading of the class names, not the report's.
"""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import PositiveFloat, PositiveInt

from trainpilot.specs.base import Spec
from trainpilot.specs.errors import SpecError

HOURS_PER_DAY = 24.0

# (name, count in 54 days on 2,048 nodes, needs a node swap, retry-absorbable transient)
LLAMA3_TABLE5: tuple[tuple[str, int, bool, bool], ...] = (
    ("faulty_gpu", 148, True, False),
    ("gpu_hbm3", 72, True, False),
    ("software_bug", 54, False, False),
    ("network_switch_cable", 35, False, True),
    ("host_maintenance", 32, True, False),
    ("gpu_sram", 19, True, False),
    ("gpu_system_processor", 17, True, False),
    ("nic", 7, True, False),
    ("nccl_watchdog_timeout", 7, False, True),
    ("silent_data_corruption", 6, True, False),
    ("gpu_thermal_interface_sensor", 6, True, False),
    ("ssd", 3, True, False),
    ("power_supply", 3, True, False),
    ("server_chassis", 2, True, False),
    ("io_expansion_board", 2, True, False),
    ("dependency", 2, False, False),
    ("cpu", 2, True, False),
    ("system_memory", 2, True, False),
)
LLAMA3_DAYS = 54.0
LLAMA3_NODES = 2048  # 16,384 H100 in nodes of 8
# The same snapshot also had 47 planned interruptions (automated maintenance: firmware
# upgrades, configuration or dataset updates), 466 in all (Llama 3 report, sec. 3.3.4).
LLAMA3_PLANNED = 47


class FailureClass(Spec):
    """One root cause with its rate per node."""

    name: str
    per_node_per_day: PositiveFloat  # interruptions per node-day
    needs_replacement: bool = True  # hardware: the node is swapped for a spare
    transient: bool = False  # an operator-level retry may absorb it


class FailureModel(Spec):
    """Interruptions of a job: rates by class, inter-arrival law, lemons and correlated events.

    Invariants: rates are per node and per day; the Weibull ``shape`` keeps each node's mean time
    between failures equal to ``1 / sum(rates)`` (shape < 1: infant mortality, bursty).
    """

    classes: tuple[FailureClass, ...]
    distribution: Literal["exponential", "weibull"] = "exponential"
    weibull_shape: PositiveFloat = 0.7
    # Weibull nodes at t = 0: "stationary" (in service for a long time: the first failure comes
    # after a forward-recurrence time) or "new" (all installed at t = 0: burn-in included).
    # Every replacement node starts new either way.
    weibull_start: Literal["stationary", "new"] = "stationary"
    num_lemon_nodes: int = pydantic.Field(default=0, ge=0)
    lemon_multiplier: PositiveFloat = 10.0  # a lemon fails this many times the base rate
    quarantine_lemons: bool = False  # a lemon is removed after its first failure
    correlated_fraction: float = pydantic.Field(default=0.0, ge=0, le=1)
    correlated_nodes: PositiveInt = 4  # nodes a correlated event takes down (shared switch, PDU)

    @pydantic.model_validator(mode="after")
    def _check(self) -> FailureModel:
        if not self.classes:
            raise SpecError("classes", [], "valid: at least one failure class")
        return self

    @property
    def per_node_per_hour(self) -> float:
        """Total interruption rate of one ordinary node, per hour."""
        return sum(c.per_node_per_day for c in self.classes) / HOURS_PER_DAY

    def shares(self) -> list[float]:
        """Each class's share of interruptions (sums to 1)."""
        total = sum(c.per_node_per_day for c in self.classes)
        return [c.per_node_per_day / total for c in self.classes]

    def job_rate_per_hour(self, num_nodes: int) -> float:
        """Expected interruptions per hour of a job on ``num_nodes`` nodes, lemons included."""
        extra = self.num_lemon_nodes * (self.lemon_multiplier - 1.0)
        if self.quarantine_lemons:
            extra = 0.0  # long-run: each lemon fails once, then leaves
        return self.per_node_per_hour * (num_nodes + extra)

    def mtbf_h(self, num_nodes: int) -> float:
        """Mean time between interruptions of the job, hours."""
        return 1.0 / self.job_rate_per_hour(num_nodes)


def llama3_mix(*, planned: bool = False, **overrides) -> FailureModel:
    """The Llama 3 405B Table 5 mix as per-node daily rates (419 / 54 days / 2,048 nodes).

    ``planned`` adds the snapshot's 47 planned interruptions as one more class (no node swap,
    not retry-absorbable). The engines treat it like any interruption, so work since the last
    durable save is lost: pessimistic for maintenance that is scheduled right after a save."""
    scale = 1.0 / (LLAMA3_DAYS * LLAMA3_NODES)
    rows = LLAMA3_TABLE5 + ((("planned_maintenance", LLAMA3_PLANNED, False, False),)
                            if planned else ())
    classes = tuple(
        FailureClass(name=name, per_node_per_day=count * scale, needs_replacement=swap,
                     transient=transient)
        for name, count, swap, transient in rows
    )
    return FailureModel(classes=classes, **overrides)


def single_mtbf(*, mtbf_h: float, num_nodes: int, needs_replacement: bool = False,
                **overrides) -> FailureModel:
    """One failure class giving the job (of ``num_nodes`` nodes) a mean time between failures
    of ``mtbf_h`` hours."""
    if mtbf_h <= 0:
        raise SpecError("mtbf_h", mtbf_h, "valid: a positive number of hours")
    per_node_per_day = HOURS_PER_DAY / (mtbf_h * num_nodes)
    cls = FailureClass(name="any", per_node_per_day=per_node_per_day,
                       needs_replacement=needs_replacement)
    return FailureModel(classes=(cls,), **overrides)


def per_node_per_day_from_rate(failures_per_1000_node_days: float) -> float:
    """Kokolis et al. quote r_f in failures per 1,000 node-days."""
    return failures_per_1000_node_days / 1000.0

