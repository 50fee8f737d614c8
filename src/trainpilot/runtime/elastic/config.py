"""ElasticConfig: how failures are detected and recovered. Defaults are sized for CPU tests
(seconds, not the minutes a GPU cluster would use); every value is validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainpilot.specs.errors import SpecError


@dataclass(frozen=True, kw_only=True)
class ElasticConfig:
    """Detection and recovery settings (seconds).

    ``recovery``: ``"in_process"`` rebuilds the process group and restores from host memory
    without leaving Python (a dead rank needs a replacement process from the supervisor);
    ``"restart"`` exits the process on a failure so that torchrun (``--max-restarts``)
    restarts every rank, which then restores from storage.
    ``heartbeat_timeout_s``: a rank whose heartbeat has not changed for this long is declared
    failed (and killed when it runs on this host). ``collective_timeout_s``: the training
    group's timeout; a collective past it raises, which starts a recovery.
    ``hang_grace_s``: a live rank still in an older generation this long after the others moved
    on is declared hung and killed. ``join_timeout_s``: how long a new generation's rendezvous
    waits for every rank (a replacement included). ``drain_timeout_s``: how long a recovery
    lets a checkpoint save of the failed generation finish. ``max_collective_retries``: re-issues of a
    collective that failed before it reached the wire, before escalating to a recovery.
    ``link_probe_s``: a multi-node job's launchers probe each other's links this often (None:
    off; ``runtime.elastic.linkprobe``); ``drain_slow_links``: a host whose link is judged slow
    for ``slow_link_rounds`` rounds in a row (under ``slow_link_ratio`` x the other hosts')
    asks for its own drain.
    """

    recovery: Literal["in_process", "restart"] = "in_process"
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 3.0
    collective_timeout_s: float = 10.0
    hang_grace_s: float = 2.0
    join_timeout_s: float = 60.0
    drain_timeout_s: float = 0.5  # a checkpoint save in flight when a failure hits
    max_collective_retries: int = 2
    max_recoveries: int = 20
    kill_hung: bool = True
    recompute_nonfinite: bool = True
    link_probe_s: float | None = None
    drain_slow_links: bool = False
    slow_link_ratio: float = 0.5
    slow_link_rounds: int = 3

    def __post_init__(self) -> None:
        if self.recovery not in ("in_process", "restart"):
            raise SpecError("elastic.recovery", self.recovery, "valid: in_process, restart")
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "collective_timeout_s",
                     "hang_grace_s", "join_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise SpecError(f"elastic.{name}", value, "valid: seconds > 0")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise SpecError("elastic.heartbeat_timeout_s", self.heartbeat_timeout_s,
                            f"valid: >= 2 x heartbeat_interval_s = {2 * self.heartbeat_interval_s}")
        if self.link_probe_s is not None and not (isinstance(self.link_probe_s, (int, float))
                                                  and self.link_probe_s > 0):
            raise SpecError("elastic.link_probe_s", self.link_probe_s, "valid: seconds > 0")
        if self.drain_slow_links and self.link_probe_s is None:
            raise SpecError("elastic.drain_slow_links", True,
                            "needs link probes (elastic.link_probe_s, --probe-links S)")
        if not 0 < self.slow_link_ratio < 1:
            raise SpecError("elastic.slow_link_ratio", self.slow_link_ratio, "valid: 0 < ratio < 1")
        if not isinstance(self.slow_link_rounds, int) or self.slow_link_rounds < 1:
            raise SpecError("elastic.slow_link_rounds", self.slow_link_rounds,
                            "valid: an integer >= 1")
        for name in ("max_collective_retries", "max_recoveries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise SpecError(f"elastic.{name}", value, "valid: an integer >= 0")
