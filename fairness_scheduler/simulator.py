"""Discrete-event simulator of a GPU cluster, driven by a trace, running the real policy and
admission code (:mod:`.policy`, :mod:`.admission`) exactly as the controller does.

Events are arrivals and completions. At each distinct timestamp: completions free their nodes,
arrivals join the queue, then one admission cycle runs. Between events, held GPUs, each user's
max-min fair allocation and decayed usage are integrated exactly (piecewise constant rates).

Metrics (names and definitions from the benchmark protocol; times in seconds):
``wait_p50, wait_p95, wait_max`` (wait = start - submit), ``jct_mean`` (end - submit),
``makespan`` (last end - first submit), ``utilization`` (busy GPU-s / (C * makespan)),
``jain_service`` and ``min_service`` over users' service ratios (GPU-time held / GPU-time of the
weighted max-min fair allocation of C over current demand), ``light_wait_p95`` (p95 wait of the
jobs of the 10 users with the least submitted GPU-seconds).
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .admission import NodePool, PendingQueue, admit
from .config import FairShareConfig
from .model import Node, Resources, UserConfig, Workload
from .policy import CycleContext, UserState, make_policy

METRICS = ("wait_p50", "wait_p95", "wait_max", "jct_mean", "makespan", "utilization", "jain_service",
           "min_service", "light_wait_p95")


def water_fill(demand: np.ndarray, weights: np.ndarray, capacity: float) -> np.ndarray:
    """Weighted max-min fair allocation of ``capacity``, each user capped by its demand.

    Users saturate in order of demand/weight; the rest share what is left by weight."""
    return np.array(_water_fill(demand.tolist(), weights.tolist(), capacity))


def _water_fill(d: list[float], w: list[float], capacity: float) -> list[float]:
    """:func:`water_fill` on plain lists. Plain Python on purpose: with tens of users this is
    several times faster than numpy's per-call overhead, and it runs at every event."""
    return _water_fill_level(d, w, capacity)[0]


def _water_fill_level(d: list[float], w: list[float], capacity: float) -> tuple[list[float], float]:
    """The allocation and the water level (inf when every demand is met). Users whose demand per
    weight is above the level are capped at it."""
    if sum(d) <= capacity:
        return list(d), math.inf
    order = sorted([(x / wi, i) for i, (x, wi) in enumerate(zip(d, w)) if x > 0])
    alloc = [0.0] * len(d)
    remaining = capacity
    wsum = sum([w[i] for _, i in order])
    for k, (ratio, i) in enumerate(order):
        level = remaining / wsum
        if ratio <= level:
            alloc[i] = d[i]
            remaining -= d[i]
            wsum -= w[i]
        else:
            for _, j in order[k:]:
                alloc[j] = level * w[j]
            return alloc, level
    return alloc, math.inf  # not reached: demand above capacity saturates someone


def _still_capped(demand_was: dict[int, float], demand: list[float], weights: list[float], level: float) -> bool:
    """True when every user whose demand changed (index -> old demand) was above the water
    ``level`` and still is: such users stay capped at it, so the allocation is exactly the same
    and need not be recomputed (in a backlog, most arrivals and ends are of such users)."""
    return level < math.inf and all(old > level * weights[u] and demand[u] > level * weights[u]
                                    for u, old in demand_was.items())


def jain(x: np.ndarray) -> float:
    return float(x.sum() ** 2 / (len(x) * (x ** 2).sum())) if len(x) and (x ** 2).sum() > 0 else 1.0


@dataclass
class SimResult:
    policy: str
    metrics: dict
    start: np.ndarray
    end: np.ndarray
    service: dict[str, float]
    unschedulable_why: dict[str, str] = field(default_factory=dict)
    """Workloads that could never start (reported at submission, not run), in submission order:
    name -> why (:meth:`.admission.NodePool.never_starts`)."""
    wall_seconds: float = 0.0
    waits: np.ndarray = field(default_factory=lambda: np.zeros(0))
    workloads: list[Workload] = field(default_factory=list, repr=False)
    """The simulated workloads; ``start[i]`` and ``end[i]`` are those of ``workloads[i]`` (NaN: never started)."""
    light_users: list[str] = field(default_factory=list)
    """The users ``light_wait_p95`` is taken over (least submitted GPU-time first)."""

    @property
    def unschedulable(self) -> list[str]:
        return list(self.unschedulable_why)


def simulate(workloads: list[Workload], users: list[UserConfig], nodes: list[Node], policy_name: str,
             half_life: float = 7 * 86400.0, fairshare: FairShareConfig | None = None,
             progress: bool | Callable[[int], None] = False, light_users: int = 10,
             placement: str = "binpack") -> SimResult:
    """Replay ``workloads`` under one policy. ``progress``: True for a progress bar of its own, or a
    callable given the number of arrivals processed since its last call (a caller's shared bar)."""
    import time

    t_wall = time.perf_counter()
    fs_cfg = fairshare or FairShareConfig()
    policy = make_policy(policy_name, fs_cfg)
    pool = NodePool(nodes, placement)
    capacity = pool.total
    C = capacity.gpu
    names = [u.name for u in users]
    uidx = {n: i for i, n in enumerate(names)}
    weights = [float(u.shares) for u in users]
    quotas = {u.name: u.gpu_quota for u in users if u.gpu_quota is not None} or None
    states = {u.name: UserState(u) for u in users}
    ctx = CycleContext(0.0, states, capacity)
    lam = math.log(2) / half_life if math.isfinite(half_life) else 0.0

    n = len(workloads)
    order = sorted(range(n), key=lambda i: (workloads[i].submit_time, workloads[i].seq))
    start = np.full(n, np.nan)
    end = np.full(n, np.nan)
    pos = {id(w): i for i, w in enumerate(workloads)}
    queue = PendingQueue()
    unschedulable: dict[str, str] = {}  # name -> why it can never start
    # Per-user state as plain lists: with tens of users, Python floats beat numpy's per-call cost.
    n_users = len(users)
    held = [0.0] * n_users
    demand = [0.0] * n_users
    usage = [0.0] * n_users
    penalty = [0.0] * n_users
    held_int = [0.0] * n_users
    fair_int = [0.0] * n_users
    fair = [0.0] * n_users
    held_since = [0.0] * n_users  # when each user's held GPUs last changed
    fair_since = 0.0
    reads_usage = policy.reads_usage
    reads_held = policy.reads_held or quotas is not None  # admission reads held GPUs for quotas
    reads_history = policy.reads_history or policy.reserves  # reservations' shadow times use the history
    state_list = [states[n] for n in names]  # in user-index order
    held_changed: set[int] = set()
    running: list = []  # (end, seq, workload, placement, start)
    queued_sizes: dict[float, int] = {}
    k_penalty = getattr(policy, "penalty_seconds", 0.0)
    tw = TypicalWait(fs_cfg.typical_wait_half_life)
    tw_large = TypicalWait(fs_cfg.large_gang_wait_half_life)
    large_from = fs_cfg.reserve_min_fraction * ctx.norm(capacity)
    inv_gpu = ctx._inv[0]  # trace workloads ask for GPUs only: norm(usage) = GPU-s / capacity

    def move_held(u: int, gpus: float) -> None:
        held_int[u] += held[u] * (t - held_since[u])  # held is piecewise constant: integrate lazily
        held_since[u] = t
        held[u] += gpus
        held_changed.add(u)

    def fair_integrated_to(now: float) -> list[float]:
        return [fi + f * (now - fair_since) for fi, f in zip(fair_int, fair)]

    bar = None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=f"{policy_name:>16}", unit="job", leave=False, mininterval=0.5)
    tick = bar.update if bar is not None else (progress if callable(progress) else None)
    ticked = 0

    t = workloads[order[0]].submit_time if n else 0.0
    first_submit = t
    ai = 0
    demand_dirty = True
    level = math.inf
    demand_was: dict[int, float] = {}  # users whose demand changed since the last water-fill -> old demand

    submits = [workloads[i].submit_time for i in order] + [math.inf]  # a sentinel past the last arrival
    while ai < n or running:
        t_next = min(submits[ai], running[0][0] if running else math.inf)
        dt = t_next - t
        if dt > 0 and reads_usage:
            if lam:
                f = math.exp(-lam * dt)
                omf = 1 - f
                usage = [u * f + h * omf / lam for u, h in zip(usage, held)]
                if k_penalty:
                    penalty = [p * f for p in penalty]
            else:
                usage = [u + h * dt for u, h in zip(usage, held)]
        t = t_next
        while running and running[0][0] <= t:
            e, _, w, placement, began = heapq.heappop(running)
            pool.release(w, placement)
            u = uidx[w.user]
            move_held(u, -w.gpus)
            demand_was.setdefault(u, demand[u])
            demand[u] -= w.gpus
            if reads_history:
                ctx.runtimes.record(w.user, w.gpus, e - began)  # a real scheduler's estimate: history
            demand_dirty = True
        while submits[ai] <= t:
            w = workloads[order[ai]]
            ai += 1
            if tick is not None and ai - ticked >= 256:
                tick(ai - ticked)
                ticked = ai
            if (why := pool.never_starts(w, quotas.get(w.user) if quotas else None)) is not None:
                unschedulable[w.name] = why  # never queued: its demand would count into the fair shares
                continue
            queue.push(w)
            u = uidx[w.user]
            demand_was.setdefault(u, demand[u])
            demand[u] += w.gpus
            queued_sizes[w.gpus] = queued_sizes.get(w.gpus, 0) + 1
            demand_dirty = True
        if len(queue) and _something_may_fit(pool, queued_sizes):
            if reads_usage:  # usage as floats (GPU-s over capacity): no Resources per user and cycle
                ctx.usage_norm = dict(zip(names, [u_i * inv_gpu for u_i in usage]))
                if k_penalty:
                    for s, p_i in zip(state_list, penalty):
                        s.penalty = p_i / C
            if reads_held:
                for i in held_changed:  # held moves only with starts and ends
                    state_list[i].held = Resources(held[i])
                held_changed.clear()
            ctx.now = t
            if reads_history:
                ctx.typical_wait = tw.value(t)
                ctx.large_gang_wait = tw_large.value(t)
            result = admit(queue, pool, policy, ctx, fs_cfg.reserve_cap, quotas, explain=False,
                           max_reservations=fs_cfg.max_reservations,
                           defrag_reservations=fs_cfg.defrag_reservations if policy.reserves else 0)
            for w, placement in result.started:
                i = pos[id(w)]
                e = t + w.duration
                start[i], end[i] = t, e
                if reads_history:
                    tw.add(t, t - w.submit_time)
                    if ctx.norm(w.total) >= large_from:
                        tw_large.add(t, t - w.submit_time)
                heapq.heappush(running, (e, w.seq, w, placement, t))  # Python floats: fast to compare
                u = uidx[w.user]
                move_held(u, w.gpus)
                penalty[u] += w.gpus * k_penalty
                c = queued_sizes[w.gpus] - 1
                if c:
                    queued_sizes[w.gpus] = c
                else:
                    del queued_sizes[w.gpus]
        if demand_dirty:
            if not _still_capped(demand_was, demand, weights, level):
                fair_int = fair_integrated_to(t)
                fair_since = t
                fair, level = _water_fill_level(demand, weights, C)
            demand_was.clear()
            demand_dirty = False
    if tick is not None and ai > ticked:
        tick(ai - ticked)
    if bar is not None:
        bar.close()
    held_int = [hi + h * (t - hs) for hi, h, hs in zip(held_int, held, held_since)]
    fair_int = fair_integrated_to(t)
    metrics, light = _metrics(workloads, start, end, held_int, fair_int, names, C, first_submit, light_users, uidx)
    service = {names[i]: float(held_int[i] / fair_int[i]) for i in range(len(names)) if fair_int[i] > 0}
    submit = np.array([w.submit_time for w in workloads])
    waits = (start - submit)[~np.isnan(start)]
    return SimResult(policy_name, metrics, start, end, service, unschedulable, time.perf_counter() - t_wall, waits,
                     workloads, light)


class TypicalWait:
    """Exponentially decayed mean of start waits: sum(w_i * 2^(-(t - t_i)/h)) / sum(2^(-(t - t_i)/h))."""

    def __init__(self, half_life: float):
        self.lam = math.log(2) / half_life
        self.t = 0.0
        self.num = 0.0
        self.den = 0.0

    def _decay(self, t: float) -> None:
        if t > self.t:
            f = math.exp(-self.lam * (t - self.t))
            self.num *= f
            self.den *= f
            self.t = t

    def add(self, t: float, wait: float) -> None:
        self._decay(t)
        self.num += wait
        self.den += 1.0

    def value(self, t: float) -> float:
        self._decay(t)
        return self.num / self.den if self.den > 0 else 0.0


def _something_may_fit(pool: NodePool, queued_sizes: dict[float, int]) -> bool:
    if not queued_sizes:
        return False
    smallest = min(queued_sizes)
    if smallest < pool.max_gpu:
        return pool.largest_free_gpu() >= smallest or (len(pool.whole) > 0)
    return len(pool.whole) >= smallest / pool.max_gpu - 1e-9 or pool.largest_free_gpu() > 0


def _metrics(workloads, start, end, held_int, fair_int, names, C, first_submit, light_users, uidx
             ) -> tuple[dict, list[str]]:
    """The protocol's metrics, and the light users' names."""
    ok = ~np.isnan(start)
    submit = np.array([w.submit_time for w in workloads])
    wait = (start - submit)[ok]
    jct = (end - submit)[ok]
    gpus = np.array([w.gpus for w in workloads])
    dur = np.array([w.duration for w in workloads])
    last_end = float(np.nanmax(end)) if ok.any() else first_submit
    makespan = last_end - first_submit
    busy = float((gpus * dur)[ok].sum())
    ratios = np.array([held_int[i] / fair_int[i] for i in range(len(names)) if fair_int[i] > 0])
    submitted = np.zeros(len(names))
    for w, g, d in zip(workloads, gpus, dur):
        submitted[uidx[w.user]] += g * d
    light_order = np.argsort(submitted, kind="stable")[:light_users].tolist()
    light = set(light_order)
    user_of = np.array([uidx[w.user] for w in workloads])
    light_mask = np.array([u in light for u in user_of]) & ok
    light_wait = (start - submit)[light_mask]
    return {
        "wait_p50": float(np.percentile(wait, 50)) if len(wait) else 0.0,
        "wait_p95": float(np.percentile(wait, 95)) if len(wait) else 0.0,
        "wait_max": float(wait.max()) if len(wait) else 0.0,
        "jct_mean": float(jct.mean()) if len(jct) else 0.0,
        "makespan": makespan,
        "utilization": busy / (C * makespan) if makespan > 0 else 0.0,
        "jain_service": jain(ratios),
        "min_service": float(ratios.min()) if len(ratios) else 0.0,
        "light_wait_p95": float(np.percentile(light_wait, 95)) if len(light_wait) else 0.0,
    }, [names[i] for i in light_order]
