"""An independent, deliberately naive FIFO run of the benchmark protocol, written from
``shared/traces/itp-2021/README.md`` alone: no code shared with ``fairness_scheduler``.

It exists to check the fast simulator's FIFO figures (its node index, its skip-the-cycle test,
its per-(user, shape) queues, its incremental integrals), which the protocol says will be
compared with an independent implementation. Everything here is brute force: at every event the
whole queue is scanned, every node is looked at, the fair allocation is found by progressive
filling. Fine for a few thousand jobs; far too slow for a benchmark.

Placement conventions (the README leaves them open; these are the simulator's documented ones):
a job below a node's 8 GPUs goes on the node with the fewest free GPUs that still fit it
(``binpack``) or the most (``spread``), lowest index on ties; a job of 8 or more GPUs takes
``g / 8`` wholly free nodes, lowest index first.
"""
from __future__ import annotations

import csv
import math

import numpy as np

NODE = 8


def read(path: str) -> list[tuple[float, float, int]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [(float(r["submission_time"]), float(r["duration"]), int(r["num_gpu"])) for r in rows]


def protocol(jobs, n_users=20, zipf=1.1, seed=0, load=0.9):
    p = 1.0 / (np.arange(n_users) + 1.0) ** zipf
    users = np.random.default_rng(seed).choice(n_users, size=len(jobs), p=p / p.sum())
    subs = [s for s, _, _ in jobs]
    demand = sum(g * d for _, d, g in jobs) / (max(subs) - min(subs))
    biggest = max(g for _, _, g in jobs)
    cap = max(math.ceil(demand / load / NODE) * NODE, math.ceil(biggest / NODE) * NODE)
    return users.tolist(), cap


def fair_allocation(demand: list[float], capacity: float) -> list[float]:
    """Max-min fair shares (equal weights) by progressive filling: raise everyone's level until
    the capacity is gone, freezing users whose demand is met."""
    alloc = [0.0] * len(demand)
    active = [i for i, d in enumerate(demand) if d > 0]
    left = float(capacity)
    while active and left > 1e-12:
        step = min(left / len(active), min(demand[i] - alloc[i] for i in active))
        for i in active:
            alloc[i] += step
        left -= step * len(active)
        active = [i for i in active if demand[i] - alloc[i] > 1e-12]
    return alloc


def run_fifo(jobs, users, cap, n_users=20, light_users=10, placement="binpack") -> dict:
    n = len(jobs)
    free = [NODE] * (cap // NODE)
    start = [None] * n
    end = [None] * n
    where: dict[int, list[int]] = {}
    queue: list[int] = []
    order = sorted(range(n), key=lambda i: (jobs[i][0], i))
    held_int = [0.0] * n_users
    fair_int = [0.0] * n_users
    held = [0.0] * n_users
    demand = [0.0] * n_users
    running: list[int] = []
    t_prev = None
    nxt = 0
    while nxt < n or running:
        t_arr = jobs[order[nxt]][0] if nxt < n else math.inf
        t_end = min((end[i] for i in running), default=math.inf)
        t = min(t_arr, t_end)
        if t_prev is not None:
            fair = fair_allocation(demand, cap)
            for u in range(n_users):
                held_int[u] += held[u] * (t - t_prev)
                fair_int[u] += fair[u] * (t - t_prev)
        t_prev = t
        for i in [i for i in running if end[i] <= t]:
            running.remove(i)
            g = jobs[i][2]
            for node in where.pop(i):
                free[node] += min(g, NODE)
            held[users[i]] -= g
            demand[users[i]] -= g
        while nxt < n and jobs[order[nxt]][0] <= t:
            i = order[nxt]
            nxt += 1
            queue.append(i)
            demand[users[i]] += jobs[i][2]
        for i in list(queue):  # scan in creation order; everything that fits starts
            g = jobs[i][2]
            if g < NODE:
                fits = [(free[k], k) for k in range(len(free)) if free[k] >= g]
                if placement == "spread":  # most free GPUs first, lowest index on ties
                    fits = [(-f, k) for f, k in fits]
                nodes = [min(fits)[1]] if fits else None
            else:
                whole = [k for k in range(len(free)) if free[k] == NODE]
                nodes = whole[: g // NODE] if len(whole) >= g // NODE else None
            if nodes is None:
                continue
            for k in nodes:
                free[k] -= min(g, NODE)
            where[i] = nodes
            queue.remove(i)
            running.append(i)
            start[i], end[i] = t, t + jobs[i][1]
            held[users[i]] += g
    sub = np.array([s for s, _, _ in jobs])
    st, en = np.array(start, dtype=float), np.array(end, dtype=float)
    wait, jct = st - sub, en - sub
    work = sum(g * d for _, d, g in jobs)
    makespan = en.max() - sub.min()
    ratios = np.array([h / f for h, f in zip(held_int, fair_int) if f > 0])
    submitted = np.zeros(n_users)
    for (_, d, g), u in zip(jobs, users):
        submitted[u] += g * d
    light = set(np.argsort(submitted, kind="stable")[:light_users].tolist())
    lw = np.array([w for w, u in zip(wait, users) if u in light])
    return {"wait_p50": float(np.percentile(wait, 50)), "wait_p95": float(np.percentile(wait, 95)),
            "wait_max": float(wait.max()), "jct_mean": float(jct.mean()), "makespan": float(makespan),
            "utilization": work / (cap * makespan),
            "jain_service": float(ratios.sum() ** 2 / (len(ratios) * (ratios ** 2).sum())),
            "min_service": float(ratios.min()), "light_wait_p95": float(np.percentile(lw, 95))}
