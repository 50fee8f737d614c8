"""A scalar, event-by-event walk of the availability model: the oracle for the vectorised
Monte-Carlo engine and the baseline of its speed benchmark.

It follows one trial at a time through its events, and inside each compute window steps
through the save cycles one by one (compute, stall, commit, durable later), keeping the last
durable peer and storage saves as explicit progress values. Same model, written the slow and
obvious way, so the two implementations check each other.
"""

from __future__ import annotations

from trainpilot.sim.availability import BADPUT_KEYS, AvailabilityJob, CheckpointSpec, RecoverySpec
from trainpilot.sim.montecarlo import KIND_INTERRUPT, Events


class _Trial:
    def __init__(self, rec: RecoverySpec):
        self.acc = {k: 0.0 for k in ("productive",) + BADPUT_KEYS}
        self.t_prev = 0.0
        self.phases = [0.0, 0.0, 0.0, 0.0]  # detection, spare wait, restart, restore (h)
        self.pause = 0.0
        self.progress = 0.0  # work (h) at the restore point of the current window
        self.storage_progress = 0.0  # work at the newest durable storage save
        self.pool = [0.0] * rec.num_spares
        self.interruptions = 0
        self.retries = 0


def _window(tr: _Trial, end: float, to_storage: bool, final: bool, cfg: dict) -> None:
    """Account the wall time from the last interruption to ``end``: recovery phases, then save
    cycles stepped one by one; on an interruption, roll back to the newest durable save that
    the restore can use."""
    span = end - tr.t_prev
    start = 0.0
    for key, dur in zip(("detection", "spare_wait", "restart", "restore"), tr.phases):
        tr.acc[key] += min(max(span - start, 0.0), dur)
        start += dur
    compute = max(span - start, 0.0)
    paused = min(tr.pause, compute)
    tr.acc["retry"] += paused
    r = compute - paused
    tau, stall, every = cfg["tau"], cfg["stall"], cfg["every"]
    work, clock, k = 0.0, 0.0, 0
    newest_peer, newest_storage = tr.progress, tr.storage_progress
    while True:
        work += min(tau, r - clock)
        if r - clock <= tau:
            break
        clock += tau
        tr.acc["checkpoint_stall"] += min(stall, r - clock)
        if r - clock < stall:
            break
        clock += stall
        k += 1  # save k commits now, holding progress + k tau
        saved = tr.progress + k * tau
        # Every n-th save after the newest durable storage save also goes to storage.
        to_disk = round((saved - tr.storage_progress) / tau) % every == 0
        if clock + cfg["d_peer"] <= r:
            newest_peer = saved
        if to_disk and clock + cfg["d_storage"] <= r:
            newest_storage = saved
    if final:  # the job saves on completion: everything done counts
        tr.acc["productive"] += work
        return
    new = newest_storage if to_storage else max(newest_peer, newest_storage)
    kept = new - tr.progress
    tr.acc["productive"] += kept
    tr.acc["lost_progress"] += work - kept
    tr.progress, tr.storage_progress = new, newest_storage


def reference_walk(events: Events, job: AvailabilityJob, ckpt: CheckpointSpec,
                   rec: RecoverySpec, interval_min: float) -> list[dict[str, float]]:
    """Per-trial totals (hours) plus ``interruptions`` and ``retries`` counts."""
    peer = ckpt.in_memory_peer
    cfg = dict(tau=interval_min / 60.0, stall=ckpt.stall_s / 3600.0,
               every=ckpt.storage_every if peer else 1, d_storage=ckpt.durable_s / 3600.0,
               d_peer=(ckpt.peer_durable_s if peer else ckpt.durable_s) / 3600.0)
    out = []
    for i in range(events.time_h.shape[0]):
        tr = _Trial(rec)
        for j in range(events.time_h.shape[1]):
            t = float(events.time_h[i, j])
            if t >= job.duration_h:
                break
            if events.kind[i, j] != KIND_INTERRUPT:
                tr.retries += 1
                if t > tr.t_prev + sum(tr.phases):
                    tr.pause += rec.retry_s / 3600.0
                continue
            to_storage = bool(events.storage[i, j]) or not peer
            _window(tr, t, to_storage, False, cfg)
            wait = 0.0
            for _ in range(int(events.nodes[i, j])):
                if not tr.pool:
                    wait = max(wait, rec.replace_s / 3600.0)
                    continue
                slot = min(range(len(tr.pool)), key=tr.pool.__getitem__)
                if tr.pool[slot] <= t:
                    tr.pool[slot] = t + rec.repair_h
                else:
                    wait = max(wait, rec.replace_s / 3600.0)
            restore = rec.restore_storage_s if to_storage else rec.restore_peer_s
            tr.phases = [rec.detect_s / 3600.0, wait, rec.restart_s / 3600.0, restore / 3600.0]
            tr.t_prev, tr.pause = t, 0.0
            tr.interruptions += 1
        _window(tr, job.duration_h, False, True, cfg)
        out.append(dict(tr.acc, interruptions=tr.interruptions, retries=tr.retries))
    return out
