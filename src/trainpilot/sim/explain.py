"""Every cost the availability engines add, with where its value came from.

The engines charge an interruption for detection, waiting for a replacement node (hardware
classes without a hot spare), restart, and restore (from a peer's memory or from storage), and
each save for its blocking stall and the time until it is durable. A result that hides any of
these misleads: the Llama 3 mix with the generic defaults loses 20% of the wall time to a
30-minute cold replacement per hardware failure that nobody asked for. ``cost_lines`` lists
each cost with its value, what it applies to, the share of interruptions it hits and its source
("default", "set" by the user, or a scenario); ``summary`` is the one-line form the CLI always
prints, ``explain_rows`` the ``--explain`` table with the badput each cost produced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainpilot.sim.availability import AvailabilityResult, CheckpointSpec, RecoverySpec
from trainpilot.sim.failures import FailureModel


@dataclass(frozen=True, kw_only=True)
class CostLine:
    """One cost: ``value_s`` seconds charged per ``per`` (an interruption or a save), hitting
    ``share`` of them; ``badput`` names the badput category it lands in."""

    name: str
    field: str  # the RecoverySpec / CheckpointSpec field (and CLI flag, with dashes)
    value_s: float
    per: str  # "interruption" or "save"
    share: float  # of interruptions (or of saves) it applies to
    applies_to: str
    badput: str | None
    source: str


def _shares(failures: FailureModel, ckpt: CheckpointSpec, rec: RecoverySpec,
            ) -> tuple[float, float, float]:
    """(hardware share, storage-restore share, absorbed share) of failure events; the first two
    are shares of the interruptions left after operator retries."""
    shares = failures.shares()
    absorbed = sum(s * rec.retry_fraction for s, c in zip(shares, failures.classes)
                   if c.transient)
    keep = [s * (1.0 - (rec.retry_fraction if c.transient else 0.0))
            for s, c in zip(shares, failures.classes)]
    total = sum(keep) or 1.0
    hardware = sum(k for k, c in zip(keep, failures.classes) if c.needs_replacement) / total
    corr = failures.correlated_fraction
    storage = 1.0 if not ckpt.in_memory_peer else hardware * corr
    return hardware, storage, absorbed


def cost_lines(failures: FailureModel, ckpt: CheckpointSpec, rec: RecoverySpec, *,
               sources: Mapping[str, str] | None = None) -> list[CostLine]:
    """Each cost the engines will charge for this failure model and policy. ``sources`` maps a
    field name to where its value came from (missing: "default")."""
    src = dict(sources or {})
    hardware, storage, absorbed = _shares(failures, ckpt, rec)

    def line(name, field, value, per, share, applies, badput):
        return CostLine(name=name, field=field, value_s=float(value), per=per, share=share,
                        applies_to=applies, badput=badput, source=src.get(field, "default"))

    spare = (f"hardware classes ({hardware:.0%} of interruptions)"
             + (f", none while one of {rec.num_spares} hot spares is free" if rec.num_spares
                else ", no hot spares"))
    lines = [
        line("detection", "detect_s", rec.detect_s, "interruption", 1.0,
             "every interruption", "detection"),
        line("cold replacement", "replace_s", rec.replace_s, "interruption",
             0.0 if rec.num_spares else hardware, spare, "spare_wait"),
        line("restart / re-rendezvous", "restart_s", rec.restart_s, "interruption", 1.0,
             "every interruption", "restart"),
        line("restore from storage", "restore_storage_s", rec.restore_storage_s, "interruption",
             storage, "storage-only saves" if not ckpt.in_memory_peer
             else "correlated events that take a peer down too", "restore"),
    ]
    if ckpt.in_memory_peer:
        lines.append(line("restore from a peer", "restore_peer_s", rec.restore_peer_s,
                          "interruption", 1.0 - storage, "the other interruptions", "restore"))
    lines.append(line("checkpoint stall", "stall_s", ckpt.stall_s, "save", 1.0,
                      f"every save (every {ckpt.interval_min:.3g} min of compute)",
                      "checkpoint_stall"))
    lines.append(line("until durable in storage", "durable_s", ckpt.durable_s, "save",
                      1.0 if not ckpt.in_memory_peer else 1.0 / ckpt.storage_every,
                      "a save is lost if an interruption comes before (counted in lost "
                      "progress)", "lost_progress"))
    if ckpt.in_memory_peer:
        lines.append(line("until the peer copy lands", "peer_durable_s", ckpt.peer_durable_s,
                          "save", 1.0, "every save", "lost_progress"))
    if rec.retry_fraction:
        lines.append(line("operator retry", "retry_s", rec.retry_s, "absorbed fault",
                          absorbed, f"{rec.retry_fraction:.0%} of transient faults", "retry"))
    return lines


def summary(lines: list[CostLine]) -> str:
    """One line: what each interruption and each save is charged, and which value was not the
    user's own (marked with its source)."""
    def fmt(c: CostLine) -> str:
        share = "" if c.share >= 0.999 else f" on {c.share:.0%}"
        mark = "" if c.source == "set" else f" ({c.source})"
        return f"{c.name} {c.value_s:.4g} s{share}{mark}"

    per_int = [fmt(c) for c in lines if c.per == "interruption" and c.value_s and c.share > 0]
    per_save = [fmt(c) for c in lines if c.per == "save"]
    text = "costs per interruption: " + (" + ".join(per_int) or "none")
    return text + "; per save: " + ", ".join(per_save)


def explain_rows(lines: list[CostLine], result: AvailabilityResult) -> list[dict]:
    """The ``--explain`` table: each cost, its value, what it applies to, where it came from,
    and the hours of badput of its category in ``result`` (a category shared by two costs is
    split in proportion to value x share)."""
    weight: dict[str, float] = {}
    for c in lines:
        if c.badput:
            weight[c.badput] = weight.get(c.badput, 0.0) + c.value_s * c.share
    rows = []
    for c in lines:
        hours = None
        if c.badput and c.badput != "lost_progress":
            total = weight[c.badput]
            hours = result.badput_h.get(c.badput, 0.0) * (c.value_s * c.share / total
                                                           if total else 0.0)
        rows.append(dict(cost=c.name, flag="--" + c.field.replace("_", "-"),
                         value_s=c.value_s, per=c.per, share=c.share, applies_to=c.applies_to,
                         source=c.source, badput=c.badput, badput_h=hours,
                         wall_share=None if hours is None else hours / result.horizon_h))
    rows.append(dict(cost="lost progress (work redone)", flag="--interval-min",
                     value_s=None, per="interruption", share=1.0,
                     applies_to="since the last durable save", source="follows",
                     badput="lost_progress", badput_h=result.badput_h.get("lost_progress", 0.0),
                     wall_share=result.badput_h.get("lost_progress", 0.0) / result.horizon_h))
    return rows
