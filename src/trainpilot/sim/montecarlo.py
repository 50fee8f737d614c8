"""Monte-Carlo discrete-event engine for availability, vectorised across trials with numpy.

Each trial is one run of the job over ``duration_h`` of wall time. Failure events are drawn per
trial (one Poisson stream for exponential nodes; per-node renewal draws for Weibull nodes and
lemons). Each trial's wall time is then cut into windows between interruptions; a window's
outcome depends only on the interruption that opened it and on the checkpoint interval, so all
windows of all trials are evaluated at once. Two rules carry state from one interruption to the
next and are walked in lock-step, one Python iteration per event rank for every trial: the
hot-spare queue, and the rollback to an older storage save when peers' copies are lost. The
windows do not depend on the interval, so the interval search re-evaluates the same windows
(common random numbers). ``reference.py`` is the scalar oracle for all of this.

What it covers beyond the closed forms: a finite hot-spare pool with repair times, Weibull
inter-arrivals, correlated multi-node events (which also lose the peers' in-memory copies),
lemon nodes (optionally quarantined after their first failure), rollbacks across windows to an
older storage save, and the spread of single runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainpilot.sim.availability import (
    BADPUT_KEYS,
    AvailabilityJob,
    AvailabilityResult,
    CheckpointSpec,
    RecoverySpec,
    search_bounds_min,
)
from trainpilot.sim.failures import FailureModel
from trainpilot.specs.errors import SpecError

KIND_INTERRUPT, KIND_RETRY = 0, 1


@dataclass
class Events:
    """Failure events of ``num_trials`` runs, padded to a common length with time = inf."""

    time_h: np.ndarray  # (T, K) sorted per trial
    cls: np.ndarray  # (T, K) failure-class index
    kind: np.ndarray  # (T, K) KIND_INTERRUPT or KIND_RETRY (absorbed by an operator retry)
    nodes: np.ndarray  # (T, K) nodes to replace (0: none)
    storage: np.ndarray  # (T, K) bool: peers' copies lost too (correlated event)


def _pack(trial: np.ndarray, time_h: np.ndarray, num_trials: int, *, presorted: bool = False,
          ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Scatter flat (trial, time) events into a (T, K) time array sorted per trial, plus the
    (trial, column) of each event."""
    if not presorted:
        # One float key (trial, then time) sorts faster than lexsort on two keys; times are
        # below the horizon, so trial * (horizon + 1) + time keeps trials apart.
        span = float(time_h.max(initial=0.0)) + 1.0
        order = np.argsort(trial * span + time_h)
        trial, time_h = trial[order], time_h[order]
    counts = np.bincount(trial, minlength=num_trials)
    width = max(int(counts.max(initial=0)), 1)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    column = np.arange(trial.size) - starts[trial]
    packed = np.full((num_trials, width), np.inf)
    packed[trial, column] = time_h
    return packed, (trial, column)


def _renewal_times(rng: np.random.Generator, num_trials: int, num_slots: int, mean_h: float,
                   horizon_h: float, shape: float | None, first_only: bool,
                   stationary: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Failure times of ``num_slots`` independent renewal processes per trial (flat arrays).

    ``shape`` None: exponential; else Weibull of that shape with the given mean. With
    ``stationary`` the process has been running long before t = 0, so the first failure comes
    after a forward-recurrence time: a uniform fraction of a length-biased interval (for a
    Weibull, X^k of the length-biased law is Gamma(1 + 1/k)); else every slot starts new at
    t = 0. Slots are extended a few draws at a time, only while before the horizon.
    """
    if num_slots == 0:
        return np.empty(0, dtype=np.int64), np.empty(0)
    scale = mean_h if shape is None else mean_h / math.gamma(1.0 + 1.0 / shape)
    slot_trial = np.repeat(np.arange(num_trials), num_slots)
    alive = np.arange(slot_trial.size)
    base = np.zeros(slot_trial.size)
    draws = 1 if first_only else int(horizon_h / mean_h) + 2
    trials, times = [], []
    first = True
    while alive.size:
        size = (alive.size, draws)
        gaps = rng.exponential(scale, size) if shape is None else scale * rng.weibull(shape, size)
        if first and stationary and shape is not None:
            biased = scale * rng.gamma(1.0 + 1.0 / shape, 1.0, alive.size) ** (1.0 / shape)
            gaps[:, 0] = rng.random(alive.size) * biased
        first = False
        t = base[alive, None] + np.cumsum(gaps, axis=1)
        hit = t < horizon_h
        trials.append(np.repeat(slot_trial[alive], hit.sum(axis=1)))
        times.append(t[hit])
        if first_only:
            break
        going = t[:, -1] < horizon_h
        alive = alive[going]
        base[alive] = t[going, -1]
        draws = 2
    return np.concatenate(trials), np.concatenate(times)


def _poisson_times(rng: np.random.Generator, num_trials: int, rate_per_h: float,
                   horizon_h: float) -> tuple[np.ndarray, np.ndarray]:
    """Event times of a Poisson stream per trial (flat trial-major arrays, sorted per trial)."""
    counts = rng.poisson(rate_per_h * horizon_h, num_trials)
    trial = np.repeat(np.arange(num_trials), counts)
    # Given the count, Poisson times are sorted uniforms: sort within each trial.
    times = np.sort(rng.random(trial.size) + trial) - trial
    return trial, times * horizon_h


def draw_events(rng: np.random.Generator, job: AvailabilityJob, failures: FailureModel,
                rec: RecoverySpec, num_trials: int) -> Events:
    """Draw every trial's failure events over the job's horizon."""
    horizon = job.duration_h
    rate_node = failures.per_node_per_hour
    if failures.distribution == "exponential":
        # A superposition of exponential nodes is one Poisson stream.
        trial, times = _poisson_times(rng, num_trials, rate_node * job.num_nodes, horizon)
        shape = None
    else:
        shape = failures.weibull_shape
        trial, times = _renewal_times(rng, num_trials, job.num_nodes, 1.0 / rate_node, horizon,
                                      shape, first_only=False,
                                      stationary=failures.weibull_start == "stationary")
    if failures.num_lemon_nodes:
        # A lemon is an ordinary node plus an extra failure process at (multiplier - 1) x base.
        extra_rate = rate_node * (failures.lemon_multiplier - 1.0)
        lt, ltimes = _renewal_times(rng, num_trials, failures.num_lemon_nodes, 1.0 / extra_rate,
                                    horizon, shape, first_only=failures.quarantine_lemons,
                                    stationary=failures.weibull_start == "stationary")
        trial, times = np.concatenate((trial, lt)), np.concatenate((times, ltimes))
    presorted = failures.distribution == "exponential" and not failures.num_lemon_nodes
    packed, (flat_trial, column) = _pack(trial.astype(np.int64), times, num_trials,
                                         presorted=presorted)
    shape2 = packed.shape
    shares = np.asarray(failures.shares())
    cls = np.zeros(shape2, dtype=np.int64)
    cls[flat_trial, column] = rng.choice(len(shares), size=flat_trial.size, p=shares)
    transient = np.array([c.transient for c in failures.classes])[cls]
    swap = np.array([c.needs_replacement for c in failures.classes])[cls]
    absorbed = transient & (rng.random(shape2) < rec.retry_fraction)
    correlated = swap & (rng.random(shape2) < failures.correlated_fraction)
    nodes = np.where(swap, np.where(correlated, failures.correlated_nodes, 1), 0)
    kind = np.where(absorbed, KIND_RETRY, KIND_INTERRUPT)
    return Events(packed, cls, kind, nodes, correlated)


@dataclass
class Walk:
    """Per-trial totals (hours, shape (T,)) from walking the events of every trial."""

    acc: dict[str, np.ndarray]
    interruptions: np.ndarray
    retries: np.ndarray


def _packed_by_rank(rows: np.ndarray, num_trials: int) -> tuple[np.ndarray, int]:
    """Position of each entry within its trial (entries are in trial-major time order)."""
    counts = np.bincount(rows, minlength=num_trials)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return np.arange(rows.size) - starts[rows], int(counts.max(initial=0))


def _rank_major(rows: np.ndarray, num_trials: int):
    """For entries in trial-major time order: (rank, row) scatter indices into a (K, T) matrix
    whose k-th row holds every trial's k-th entry, so a sequential rule runs once per rank for
    all trials on contiguous arrays."""
    rank, width = _packed_by_rank(rows, num_trials)
    return (rank, rows), width


def _spare_waits(rows: np.ndarray, times: np.ndarray, need: np.ndarray, rec: RecoverySpec,
                 num_trials: int) -> np.ndarray:
    """Hours each interruption waits for replacement nodes. A hot spare swaps in at once (the
    failed node goes to repair and rejoins the pool ``repair_h`` later); with the pool empty,
    or no pool, a cold replacement takes ``replace_s``. The pool's state carries from one
    interruption to the next, so this walks them in time order, all trials in lock-step."""
    if rec.num_spares == 0:
        return np.where(need > 0, rec.replace_s / 3600.0, 0.0)
    swaps = np.flatnonzero(need > 0)  # only these touch the pool
    out = np.zeros(rows.size)
    out[swaps] = _pool_waits(rows[swaps], times[swaps], need[swaps], rec, num_trials)
    return out


def _pool_waits(rows: np.ndarray, times: np.ndarray, need: np.ndarray, rec: RecoverySpec,
                num_trials: int) -> np.ndarray:
    """The hot-pool queue for interruptions that need nodes, in lock-step across trials."""
    at, width = _rank_major(rows, num_trials)
    t_m = np.zeros((width, num_trials))
    n_m = np.zeros((width, num_trials), dtype=np.int64)  # 0 where a trial has no k-th entry
    t_m[at], n_m[at] = times, need
    wait_m = np.zeros((width, num_trials))
    pool = np.zeros((num_trials, rec.num_spares))  # when each spare is (again) available
    trials = np.arange(num_trials)
    for k in range(width):
        t, n = t_m[k], n_m[k]
        got = np.zeros(num_trials)
        for i in range(int(n.max(initial=0))):
            slot = np.argmin(pool, axis=1)
            ready = pool[trials, slot]
            hot = (n > i) & (ready <= t)
            cold = (n > i) & ~hot  # pool empty: fall back to a cold replacement
            got = np.where(cold, np.maximum(got, rec.replace_s / 3600.0), got)
            pool[trials, slot] = np.where(hot, t + rec.repair_h, ready)
        wait_m[k] = got
    return wait_m[at]


@dataclass
class Windows:
    """The stretches between interruptions of every trial in a block, which do not depend on
    the checkpoint interval: computed once, then evaluated at any interval.

    Window w of a trial opens at t = 0 or at an interruption (with that interruption's recovery
    phases) and ends at the next interruption or at the horizon (``final``)."""

    num_trials: int
    row: np.ndarray  # trial of each window, trial-major and in time order
    span_h: np.ndarray
    phases_h: np.ndarray  # (4, W): detection, spare wait, restart, restore
    pause_h: np.ndarray  # absorbed-fault pauses while computing
    final: np.ndarray  # ends at the horizon (the job saves on completion)
    to_storage: np.ndarray  # the interruption ending it needs a restore from storage
    interruptions: np.ndarray  # per trial
    retries: np.ndarray  # per trial


def prepare(events: Events, job: AvailabilityJob, ckpt: CheckpointSpec,
            rec: RecoverySpec) -> Windows:
    """Cut every trial's wall time into windows (vectorised; the spare queue in lock-step)."""
    num_trials, width = events.time_h.shape
    horizon = job.duration_h
    valid = events.time_h < horizon
    intr = valid & (events.kind == KIND_INTERRUPT)
    retry = valid & ~intr
    col = np.broadcast_to(np.arange(width), (num_trials, width))
    last = np.maximum.accumulate(np.where(intr, col, -1), axis=1)  # last interrupt <= j

    # Interruptions, trial-major and in time order.
    rows, cols = np.nonzero(intr)
    t_end = events.time_h[rows, cols]
    peer_mode = ckpt.in_memory_peer
    to_storage = events.storage[rows, cols] | (not peer_mode)
    phases = np.stack([
        np.full(rows.size, rec.detect_s / 3600.0),
        _spare_waits(rows, t_end, events.nodes[rows, cols], rec, num_trials),
        np.full(rows.size, rec.restart_s / 3600.0),
        np.where(to_storage, rec.restore_storage_s,
                 rec.restore_peer_s if peer_mode else rec.restore_storage_s) / 3600.0,
    ])
    rank, _ = _packed_by_rank(rows, num_trials)
    counts = np.bincount(rows, minlength=num_trials)
    offset = np.concatenate(([0], np.cumsum(counts + 1)[:-1]))
    num_windows = int((counts + 1).sum())
    w_start = np.zeros(num_windows)
    w_phases = np.zeros((4, num_windows))
    opened = offset[rows] + rank + 1  # the window each interruption opens
    w_start[opened] = t_end
    w_phases[:, opened] = phases
    w_end = np.full(num_windows, horizon)
    w_end[opened - 1] = t_end
    w_final = np.ones(num_windows, dtype=bool)
    w_final[opened - 1] = False
    w_storage = np.zeros(num_windows, dtype=bool)
    w_storage[opened - 1] = to_storage

    # Absorbed faults pause the window they fall in, if it is computing then.
    r_rows, r_cols = np.nonzero(retry)
    r_win = offset[r_rows] + np.where(last[r_rows, r_cols] >= 0,
                                      _rank_of(last, rows, cols, r_rows, r_cols, rank) + 1, 0)
    in_compute = events.time_h[r_rows, r_cols] > w_start[r_win] + w_phases[:, r_win].sum(axis=0)
    pause = np.bincount(r_win[in_compute], minlength=num_windows) * (rec.retry_s / 3600.0)
    return Windows(num_trials, np.repeat(np.arange(num_trials), counts + 1), w_end - w_start,
                   w_phases, pause, w_final, w_storage, counts.astype(float),
                   np.bincount(r_rows, minlength=num_trials).astype(float))


def walk(events: Events, job: AvailabilityJob, ckpt: CheckpointSpec, rec: RecoverySpec,
         interval_min: float) -> Walk:
    """Every trial's time split into productive work and badput categories (hours)."""
    return evaluate([prepare(events, job, ckpt, rec)], ckpt, interval_min)


def _rank_of(last: np.ndarray, rows: np.ndarray, cols: np.ndarray, r_rows: np.ndarray,
             r_cols: np.ndarray, rank: np.ndarray) -> np.ndarray:
    """Rank (within its trial) of the interruption each retry event follows."""
    lookup = np.full(last.shape, -1, dtype=np.int64)
    lookup[rows, cols] = rank
    return lookup[r_rows, last[r_rows, r_cols]]


def evaluate(blocks: list[Windows], ckpt: CheckpointSpec, interval_min: float) -> Walk:
    """Split every window into recovery phases, retry pauses, stalls, kept and lost work at
    ``interval_min``; per-trial totals over all blocks, in block order."""
    parts = [_split(w, ckpt, interval_min) for w in blocks]
    tau = interval_min / 60.0
    if ckpt.in_memory_peer and not any(w.to_storage.any() for w in blocks):
        # Every restore comes from a peer: the newest durable peer save survives, and the
        # storage saves behind it never matter (they are older).
        for w, part in zip(blocks, parts):
            part["kept"] = np.where(w.final, part["work"], part["peer"] * tau)
    elif ckpt.in_memory_peer:
        # Rollbacks carry across windows: one lock-step pass over every trial of every block.
        sizes = np.array([w.num_trials for w in blocks])
        base = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        row = np.concatenate([w.row + b for w, b in zip(blocks, base)])
        cat = lambda key: np.concatenate([p[key] for p in parts])  # noqa: E731
        kept = _peer_rollbacks(row, cat("peer"), cat("durable"),
                               np.concatenate([w.to_storage for w in blocks]),
                               np.concatenate([w.final for w in blocks]), cat("work"), tau,
                               ckpt.storage_every, int(sizes.sum()))
        bounds = np.cumsum([w.row.size for w in blocks])[:-1]
        for part, k in zip(parts, np.split(kept, bounds)):
            part["kept"] = k
    acc: dict[str, list[np.ndarray]] = {}
    for w, part in zip(blocks, parts):
        tot = lambda x: np.bincount(w.row, weights=x, minlength=w.num_trials)  # noqa: E731,B023
        part["productive"] = part["kept"]
        part["lost_progress"] = part["work"] - part["kept"]
        for key in ("productive",) + BADPUT_KEYS:
            acc.setdefault(key, []).append(part[key] if key in _SUMMED
                                           else tot(part[key]))
    return Walk({k: np.concatenate(v) for k, v in acc.items()},
                np.concatenate([w.interruptions for w in blocks]),
                np.concatenate([w.retries for w in blocks]))


# The categories ``_split`` already totals per trial (the others are per window).
_SUMMED = ("detection", "spare_wait", "restart", "restore", "retry", "checkpoint_stall")


def _split(w: Windows, ckpt: CheckpointSpec, interval_min: float) -> dict[str, np.ndarray]:
    """Per-window hours by category (``kept`` only without peer copies; with them ``peer`` and
    ``durable`` save counts for the lock-step rollback)."""
    tot = lambda x: np.bincount(w.row, weights=x, minlength=w.num_trials)  # noqa: E731,B023
    out: dict[str, np.ndarray] = {}
    start = np.zeros_like(w.span_h)
    for i, key in enumerate(("detection", "spare_wait", "restart", "restore")):
        out[key] = tot(np.clip(w.span_h - start, 0.0, w.phases_h[i]))
        start = start + w.phases_h[i]
    compute = np.maximum(w.span_h - start, 0.0)
    paused = np.minimum(w.pause_h, compute)
    out["retry"] = tot(paused)
    r = compute - paused
    tau = interval_min / 60.0
    s = tau + ckpt.stall_s / 3600.0
    done = np.floor(r / s)
    work = done * tau + np.minimum(r - done * s, tau)
    out["checkpoint_stall"] = tot(r - work)
    out["work"] = work
    durable = np.maximum(np.floor((r - ckpt.durable_s / 3600.0) / s), 0.0)
    if ckpt.in_memory_peer:
        out["peer"] = np.maximum(np.floor((r - ckpt.peer_durable_s / 3600.0) / s), 0.0)
        out["durable"] = durable
    else:
        out["kept"] = np.where(w.final, work, durable * tau)
    return out


def _peer_rollbacks(w_row, peer, durable, storage, final, work, tau, every, num_trials):
    """Work kept per window with peer copies: a peer restore keeps the newest peer save; a
    storage restore (peers lost) goes back to the newest durable storage save, which may lie in
    an earlier window. Walks the windows in time order, all trials in lock-step."""
    at, width = _rank_major(w_row, num_trials)
    mats = []
    for values, dtype in ((peer, np.int64), (durable, np.int64), (storage, bool)):
        m = np.zeros((width, num_trials), dtype=dtype)
        m[at] = values
        mats.append(m)
    peer_m, dur_m, st_m = mats
    kept_m = np.zeros((width, num_trials))
    lag = np.zeros(num_trials)  # kept work newer than the last durable storage save
    since = np.zeros(num_trials, dtype=np.int64)  # peer saves since that storage save
    for k in range(width):
        dur, st = dur_m[k], st_m[k]
        last_storage = dur - (since + dur) % every
        has = last_storage >= 1
        pk = np.maximum(peer_m[k], np.where(has, last_storage, 0))
        kept_m[k] = np.where(st, np.where(has, last_storage * tau, -lag), pk * tau)
        # Trials with no k-th window get peer = durable = 0 and storage False: no change.
        lag = np.where(st, 0.0, np.where(has, (pk - last_storage) * tau, lag + pk * tau))
        since = np.where(st, 0, np.where(has, pk - last_storage, since + pk))
    return np.where(final, work, kept_m[at])


def chunk_trials(ckpt: CheckpointSpec, rec: RecoverySpec) -> int:
    """Trials per block: small blocks keep temporaries cache-sized, while the lock-step walks
    (spare queue, peer rollbacks) cost a Python iteration per event rank per block; 200 was the
    fastest for both on a 2-core machine (benchmarks/availability_speed.py)."""
    del ckpt, rec
    return 200


def draw_chunks(rng: np.random.Generator, job: AvailabilityJob, failures: FailureModel,
                rec: RecoverySpec, num_trials: int, chunk: int = 100) -> list[Events]:
    """Events of ``num_trials`` trials, in blocks of ``chunk`` trials."""
    sizes = [min(chunk, num_trials - i) for i in range(0, num_trials, chunk)]
    return [draw_events(rng, job, failures, rec, n) for n in sizes]


def prepare_chunks(chunks: list[Events], job: AvailabilityJob, ckpt: CheckpointSpec,
                   rec: RecoverySpec) -> list[Windows]:
    return [prepare(c, job, ckpt, rec) for c in chunks]


def walk_chunks(chunks: list[Events], job: AvailabilityJob, ckpt: CheckpointSpec,
                rec: RecoverySpec, interval_min: float) -> Walk:
    """``walk`` over every block, concatenated per trial."""
    return evaluate(prepare_chunks(chunks, job, ckpt, rec), ckpt, interval_min)


def monte_carlo(job: AvailabilityJob, failures: FailureModel, ckpt: CheckpointSpec,
                rec: RecoverySpec, *, num_trials: int = 1000, seed: int = 0,
                optimize: bool = True, optimize_trials: int = 200) -> AvailabilityResult:
    """The Monte-Carlo engine: mean ETTR with its 95% interval (Monte-Carlo error), the middle
    95% of single runs, badput by category (hours, mean over trials), and with ``optimize`` the
    interval that maximises the Monte-Carlo ETTR (on the first ``optimize_trials`` trials)."""
    if num_trials < 2:
        raise SpecError("num_trials", num_trials, "valid: at least 2 (for an interval)")
    rng = np.random.default_rng(seed)
    chunks = draw_chunks(rng, job, failures, rec, num_trials, chunk_trials(ckpt, rec))
    blocks = prepare_chunks(chunks, job, ckpt, rec)
    w = evaluate(blocks, ckpt, ckpt.interval_min)
    horizon = job.duration_h
    ettr = w.acc["productive"] / horizon
    mean = float(ettr.mean())
    half = 1.96 * float(ettr.std(ddof=1)) / math.sqrt(num_trials)
    best = ckpt.interval_min
    if optimize:
        subset, used = [], 0
        for block in blocks:
            if used >= optimize_trials:
                break
            subset.append(block)
            used += block.num_trials
        best = mc_optimal_interval(subset, job, failures, ckpt,
                                   center_min=_closed_form_center(job, failures, ckpt, rec))
    badput = {k: float(w.acc[k].mean()) for k in BADPUT_KEYS}
    low95, high95 = np.percentile(ettr, [2.5, 97.5])
    return AvailabilityResult(
        engine="monte_carlo", ettr=mean, ettr_ci95=(mean - half, mean + half),
        interruptions=float(w.interruptions.mean()), lost_work_h=badput["lost_progress"],
        badput_h=badput, optimal_interval_min=best, mtbf_h=failures.mtbf_h(job.num_nodes),
        horizon_h=horizon, interval_min=ckpt.interval_min, retries=float(w.retries.mean()),
        ettr_range95=(float(low95), float(high95)),
        num_trials=num_trials,
    )


def _closed_form_center(job: AvailabilityJob, failures: FailureModel, ckpt: CheckpointSpec,
                        rec: RecoverySpec) -> float:
    """The closed-form optimal interval of the exponential counterpart (same mean rates): the
    centre of the Monte-Carlo search."""
    from trainpilot.sim.availability import closed_form_ettr, optimal_interval_min

    expo = failures.replace(distribution="exponential")
    lo, hi = search_bounds_min(failures.mtbf_h(job.num_nodes), ckpt)
    return optimal_interval_min(lambda m: closed_form_ettr(job, expo, ckpt, rec, m)[0], lo, hi)


def mc_ettr_curve(blocks: list[Windows], job: AvailabilityJob, ckpt: CheckpointSpec,
                  intervals_min) -> np.ndarray:
    """Mean ETTR at each interval over the same windows (common random numbers)."""
    return np.array([evaluate(blocks, ckpt, float(m)).acc["productive"].mean() / job.duration_h
                     for m in intervals_min])


def mc_optimal_interval(blocks: list[Windows], job: AvailabilityJob, failures: FailureModel,
                        ckpt: CheckpointSpec, *, num_grid: int = 9, rounds: int = 3,
                        center_min: float | None = None) -> float:
    """The interval (minutes) with the highest Monte-Carlo ETTR: a log-spaced grid zoomed in
    ``rounds`` times around the best point, then the vertex of a parabola (in log interval)
    through the last grid (the top of the curve is flat, so the vertex beats the argmax).

    With ``center_min`` (a good guess: the closed-form optimum of the exponential counterpart)
    the first grid spans only a factor 4 either side of it, in 7 points and 2 zooms (21 curve
    evaluations instead of 36); if the best point lands on that grid's edge the full bracket
    is searched instead."""
    lo, hi = search_bounds_min(failures.mtbf_h(job.num_nodes), ckpt)
    if center_min is not None:
        grid = np.geomspace(max(lo, center_min / 4), min(hi, center_min * 4), 7)
        curve = mc_ettr_curve(blocks, job, ckpt, grid)
        i = int(np.argmax(curve))
        at_edge = (i == 0 and grid[0] > lo * 1.0001) or (i == len(grid) - 1 and grid[-1] < hi)
        if not at_edge:
            i = int(np.clip(i, 1, len(grid) - 2))
            return _zoom(blocks, job, ckpt, np.geomspace(grid[i - 1], grid[i + 1], 7), 1)
    return _zoom(blocks, job, ckpt, np.geomspace(lo, hi, num_grid), rounds)


def _zoom(blocks: list[Windows], job: AvailabilityJob, ckpt: CheckpointSpec, grid: np.ndarray,
          rounds: int) -> float:
    """Zoom ``rounds`` times around the best grid point, then the parabola's vertex."""
    num_grid = len(grid)
    for _ in range(rounds):
        curve = mc_ettr_curve(blocks, job, ckpt, grid)
        i = int(np.clip(np.argmax(curve), 1, len(grid) - 2))
        grid = np.geomspace(grid[i - 1], grid[i + 1], num_grid)
    curve = mc_ettr_curve(blocks, job, ckpt, grid)
    x = np.log(grid)
    a, b, _ = np.polyfit(x, curve, 2)
    if a < 0 and x[0] <= -b / (2 * a) <= x[-1]:
        return float(math.exp(-b / (2 * a)))
    return float(grid[int(np.argmax(curve))])
