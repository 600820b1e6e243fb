"""Run several policies side by side on one trace (the benchmark protocol), and show results."""
from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path
from typing import Callable

from .config import FairShareConfig
from .errors import SchedulerOptionsError
from .model import UserConfig, placement_problem
from .policy import POLICIES
from .simulator import METRICS, SimResult, simulate
from .trace import MAX_USERS, TraceJob, capacity_bounds, protocol_nodes, protocol_users, protocol_workloads, read_trace, trace_users
from .usage import format_duration


def _policy_names(text: str) -> list[str]:
    return list(POLICIES) if text.strip() == "all" else [p.strip() for p in text.split(",") if p.strip()]


def policy_problems(text: str) -> list[str]:
    names = _policy_names(text)
    if not names:
        return ["--policies: empty; use 'all' or a comma-separated list of: " + ", ".join(POLICIES)]
    return [f"--policies: unknown policy {b!r} (known: {', '.join(POLICIES)})" for b in names if b not in POLICIES]


def parse_policies(text: str) -> list[str]:
    if problems := policy_problems(text):
        raise SchedulerOptionsError(problems, f"use 'all' or a comma-separated list of: {', '.join(POLICIES)}")
    return _policy_names(text)


def option_problems(users: int, zipf: float, load: float, half_life: float, placement: str,
                    seed: int = 0) -> list[str]:
    """Every bad protocol option, each with its flag."""
    problems = []
    if problem := placement_problem(placement, "--placement"):
        problems.append(problem)
    if not 1 <= users <= MAX_USERS:
        problems.append(f"--users: must be from 1 to {MAX_USERS:,}, got {users}")
    if not 0 < load < math.inf:  # inf sized the cluster by its largest job alone
        problems.append(f"--load: must be a finite number > 0, got {load}")
    if not zipf >= 0:
        problems.append(f"--zipf: must be >= 0, got {zipf}")
    if not half_life > 0:
        problems.append(f"--half-life: must be > 0, got {half_life}")
    if seed < 0:  # numpy's default_rng takes non-negative seeds only
        problems.append(f"--seed: must be >= 0, got {seed}")
    return problems


UserLookup = Callable[[str, "UserConfig | None"], UserConfig]
"""A user's config given its name and its default (the protocol's; None: the config's own default,
``default_shares`` at tier 1): ``SchedulerConfig.user``."""


def trace_people(jobs: list[TraceJob], users: int = 20, user_config: UserLookup | None = None) -> list[UserConfig]:
    """The users a run simulates. A trace with a ``user`` column keeps its users; otherwise the
    protocol draws ``users`` of them (1 share each, tiers 3/2/1). Either way a user that
    ``user_config`` lists (the scheduler config's ``users``) is as it says: shares, tier and quota."""
    named = trace_users(jobs)
    if named:
        return [user_config(n, None) if user_config else UserConfig(n) for n in named]
    drawn = protocol_users(users)
    return [user_config(u.name, u) for u in drawn] if user_config else drawn


PROTOCOL_DEFAULTS = {"users": 20, "zipf": 1.1, "load": 0.9, "half_life_s": 7 * 86400.0}
"""The benchmark protocol's defaults (shared/traces/itp-2021/README.md), at which issue #4's goals
are set."""


def run_protocol(trace: str | Path, policies: list[str], users: int = 20, zipf: float = 1.1, seed: int = 0,
                 load: float = 0.9, half_life: float = 7 * 86400.0, fairshare: FairShareConfig | None = None,
                 progress: bool = False, placement: str = "binpack",
                 workers: int = 1, user_config: UserLookup | None = None
                 ) -> tuple[dict[str, SimResult], dict]:
    """Every policy on the same input. ``workers`` > 1 runs policies in that many processes at once;
    each simulation is deterministic, so the results are the same as one after the other."""
    if problems := option_problems(users, zipf, load, half_life, placement, seed) + workers_problems(workers):
        raise SchedulerOptionsError(problems)
    return run_jobs(read_trace(trace), policies, users, zipf, seed, load, half_life, fairshare, progress, placement,
                    workers, trace=str(trace), user_config=user_config)


def run_jobs(jobs: list[TraceJob], policies: list[str], users: int = 20, zipf: float = 1.1, seed: int = 0,
             load: float = 0.9, half_life: float = 7 * 86400.0, fairshare: FairShareConfig | None = None,
             progress: bool = False, placement: str = "binpack", workers: int = 1,
             trace: str = "", user_config: UserLookup | None = None
             ) -> tuple[dict[str, SimResult], dict]:
    """:func:`run_protocol` on parsed jobs (a trace, or a cut of one: :func:`.trace.cut`).

    Jobs with users of their own (a ``user`` column) keep them: ``users``, ``zipf`` and ``seed`` do
    not apply. Users that ``user_config`` lists (the scheduler config's
    :meth:`.config.SchedulerConfig.user`) have its shares, tier and quota, under every policy; the
    others 1 share and the protocol's tier (tier 1 for a trace's own users)."""
    by_load, biggest = capacity_bounds(jobs, load, source=trace or "the trace")
    c = max(by_load, biggest)
    people = trace_people(jobs, users, user_config)
    if trace_users(jobs):
        info_users = {"users": len(people), "users_from": "trace"}
    else:
        info_users = {"users": users, "zipf": zipf, "seed": seed}
    info = {"trace": trace, "jobs": len(jobs), "capacity_gpus": c, "nodes": c // 8,
            "load_gpus": by_load, **info_users, "load": load,
            "half_life_s": half_life, "placement": placement, "user_names": [u.name for u in people]}
    workloads = protocol_workloads(jobs, users, zipf, seed)  # read-only to the simulator: one set for all
    # The protocol's light users are the 10 of its 20 with the least submitted GPU-time: the lighter
    # half, which is what other user counts (and a trace's own users) get too.
    args = (people, protocol_nodes(c), half_life, fairshare, placement, max(1, len(people) // 2))
    if workers > 1 and len(policies) > 1:
        return _run_parallel(workloads, policies, args, workers, progress), info
    return {p: _simulate_one(workloads, p, args, progress) for p in policies}, info


def workers_problems(workers: int) -> list[str]:
    return [] if isinstance(workers, int) and workers >= 1 else [f"--workers: must be an integer >= 1, got {workers!r}"]


def usable_cpus() -> int:
    """The CPUs this process may use (its affinity mask on Linux)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def default_workers(n_policies: int) -> int:
    """One process per policy, up to the CPUs this process may use."""
    return max(1, min(usable_cpus(), n_policies))


def _simulate_one(workloads, policy: str, args: tuple, progress) -> SimResult:
    users, nodes, half_life, fairshare, placement, light = args
    return simulate(workloads, users, nodes, policy, half_life, fairshare, progress=progress, light_users=light,
                    placement=placement)


# Costliest first, so that the last process to finish does not start the longest run last.
_COST_ORDER = ("fairshare", "slurm-fairshare", "drf", "kueue-afs", "static-priority", "fifo")

_worker_state: dict = {}


def init_pool_worker() -> None:
    """In a pool's worker process: Ctrl-C, a kill or a hang-up ends it as the signals' defaults do,
    silently. A forked worker inherits the parent's Python handlers, so Ctrl-C (which reaches the
    whole terminal group) printed a KeyboardInterrupt traceback from every worker; the parent
    says what happened, once. And the worker ends when its parent does, however that ends."""
    import os
    import signal
    import threading
    import time

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    parent = os.getppid()

    def watch_parent() -> None:
        """A parent killed outright (kill -9, the OOM killer, a notebook kernel's restart) cannot
        stop its workers: they finished the simulation under way, then waited on the pool's queue
        for ever, each holding its copy of the traces (they hold the queue's pipes too, so they
        never see it close). The standard library pool has no such check."""
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch_parent, name="watch-parent", daemon=True).start()


def stop_pool_workers(before: set) -> None:
    """End a pool's workers at once: on an interrupt the pool's shutdown would wait for every
    simulation under way (minutes on a long trace). The executor keeps its processes private, so
    they are this process's ``multiprocessing.active_children()`` that were not there ``before``
    the pool started: a caller's own processes (a notebook's) are left alone."""
    import multiprocessing as mp

    for child in mp.active_children():
        if child not in before:
            child.terminate()


def _worker_init(workloads, args, counter) -> None:
    init_pool_worker()
    _worker_state.update(workloads=workloads, args=args, counter=counter)


def _worker_tick(k: int) -> None:
    counter = _worker_state["counter"]
    with counter.get_lock():
        counter.value += k


def _worker_run(policy: str) -> SimResult:
    st = _worker_state
    r = _simulate_one(st["workloads"], policy, st["args"], _worker_tick if st["counter"] is not None else False)
    r.workloads = []  # the parent has them: do not pickle 10k+ workloads back
    return r


def _run_parallel(workloads, policies: list[str], args: tuple, workers: int, progress: bool) -> dict[str, SimResult]:
    """Policies in worker processes (standard library pools: each simulation is one pure task). The
    workloads travel once per worker (inherited on fork); results come back pickled. A shared
    counter feeds one progress bar for the whole run."""
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    counter = ctx.Value("q", 0) if progress else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(workloads) * len(policies), desc=f"{len(policies)} policies", unit="job",
                   leave=False, mininterval=0.5)
    ordered = sorted(policies, key=lambda p: _COST_ORDER.index(p) if p in _COST_ORDER else -1)
    results: dict[str, SimResult] = {}
    before = set(mp.active_children())
    with ProcessPoolExecutor(min(workers, len(policies)), mp_context=ctx, initializer=_worker_init,
                             initargs=(workloads, args, counter)) as ex:
        try:
            pending = {ex.submit(_worker_run, p): p for p in ordered}
            while pending:
                done, _ = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for f in done:
                    r = results[pending.pop(f)] = f.result()
                    r.workloads = workloads
                if bar is not None:
                    bar.update(counter.value - bar.n)
        except BaseException:  # Ctrl-C, a kill: do not wait for the simulations under way
            stop_pool_workers(before)
            raise
    if bar is not None:
        bar.close()
    return {p: results[p] for p in policies}


_FRACTION_METRICS = ("utilization", "jain_service", "min_service")
_AGAINST_FIFO = ("wait_p95", "wait_max", "jct_mean", "utilization", "light_wait_p95")


def _sized_by(info: dict) -> str:
    """Where the largest job sizes the cluster, say so: else two --load values that give one table
    look like a --load that does nothing."""
    if info.get("load_gpus", info["capacity_gpus"]) >= info["capacity_gpus"]:
        return ""
    return f"; the largest job's size: at load {info['load']} the mean demand needs {info['load_gpus']}"


def format_table(results: dict[str, SimResult], info: dict) -> str:
    """Metrics per policy (times in s/m/h/d) and, when ``fifo`` ran, each policy against it."""
    w = 15
    head = f"{'policy':<16}" + "".join(f"{m:>{w}}" for m in METRICS)
    who = (f"{info['users']} users from the trace's user column" if info.get("users_from") == "trace" else
           f"{info['users']} users, zipf {info['zipf']}, seed {info['seed']}")
    lines = [f"trace {info['trace']}: {info['jobs']} jobs, C = {info['capacity_gpus']} GPUs "
             f"({info['nodes']} node{'s' if info['nodes'] != 1 else ''} of 8{_sized_by(info)}), {who}, load {info['load']}, "
             f"placement {info.get('placement', 'binpack')}",
             head, "-" * len(head)]
    for p, r in results.items():
        cells = [f"{r.metrics[m]:>{w}.4f}" if m in _FRACTION_METRICS else f"{format_duration(r.metrics[m]):>{w}}"
                 for m in METRICS]
        lines.append(f"{p:<16}" + "".join(cells))
    fifo = results.get("fifo")
    others = [p for p in results if p != "fifo"]
    if fifo is not None and others:
        lines += ["", f"{'against fifo':<16}" + "".join(f"{m:>{w}}" for m in _AGAINST_FIFO)]
        for p in others:
            cells = []
            for m in _AGAINST_FIFO:
                base = fifo.metrics[m]
                cells.append(f"{results[p].metrics[m] / base:>{w - 1}.3f}x" if base > 0 else f"{'-':>{w}}")
            lines.append(f"{p:<16}" + "".join(cells))
    lines += unschedulable_lines(results)
    lines.append("service = GPU-time held / max-min fair GPU-time (1.0 = fair share); "
                 "--json gives every metric with times in seconds")
    return "\n".join(lines)


def format_per_user(results: dict[str, SimResult]) -> str:
    """Per user, heaviest first: jobs, submitted GPU-hours, whether light, then each policy's service
    ratio (what Jain's index and the worst-served user are taken over) and p95 wait."""
    import numpy as np

    first = next(iter(results.values()))
    jobs: dict[str, int] = {}
    gpu_s: dict[str, float] = {}
    for w in first.workloads:
        jobs[w.user] = jobs.get(w.user, 0) + 1
        gpu_s[w.user] = gpu_s.get(w.user, 0.0) + w.gpus * (w.duration or 0.0)
    users = sorted(jobs, key=lambda u: (-gpu_s[u], u))
    light = set(first.light_users)
    p95: dict[str, dict[str, float]] = {}
    for p, r in results.items():
        waits: dict[str, list[float]] = {}
        for w, st in zip(r.workloads, r.start):
            if not math.isnan(st):
                waits.setdefault(w.user, []).append(st - w.submit_time)
        p95[p] = {u: float(np.percentile(v, 95)) for u, v in waits.items()}
    w = max(10, *(len(p) + 1 for p in results))
    uw = max(8, *(len(u) for u in users))
    head = f"{'user':<{uw}}{'jobs':>7}{'GPU-h':>10}{'light':>7}"
    lines = ["per user, heaviest first: service ratio (GPU-time held / max-min fair GPU-time) by policy",
             head + "".join(f"{p:>{w}}" for p in results)]
    rows = [(u, f"{jobs[u]:>7}{gpu_s[u] / 3600:>10.0f}{'yes' if u in light else '':>7}") for u in users]
    for u, left in rows:
        lines.append(f"{u:<{uw}}{left}" + "".join(
            f"{r.service[u]:>{w}.3f}" if u in r.service else f"{'-':>{w}}" for r in results.values()))
    lines += ["", "per user: p95 wait by policy", head + "".join(f"{p:>{w}}" for p in results)]
    for u, left in rows:
        lines.append(f"{u:<{uw}}{left}" + "".join(
            f"{format_duration(p95[p][u]):>{w}}" if u in p95[p] else f"{'-':>{w}}" for p in results))
    return "\n".join(lines)


SCHEDULE_COLUMNS = ("policy", "job_id", "user", "gpus", "submit_s", "start_s", "end_s", "wait_s", "status")


MAX_UNSCHEDULABLE_LISTED = 5


def unschedulable_lines(results: dict[str, SimResult]) -> list[str]:
    """The jobs that could never start, each with why (the same under every policy: the cluster and
    the quotas are), the first few by name."""
    why: dict[str, str] = {}
    for r in results.values():
        why.update(r.unschedulable_why)
    if not why:
        return []
    lines = [f"unschedulable, reported and not run under any policy: {len(why)} job(s)"]
    lines += [f"  {name}: {reason}" for name, reason in list(why.items())[:MAX_UNSCHEDULABLE_LISTED]]
    if len(why) > MAX_UNSCHEDULABLE_LISTED:
        lines.append(f"  ... and {len(why) - MAX_UNSCHEDULABLE_LISTED} more (--schedule FILE.csv lists every job)")
    return lines


def write_schedule(results: dict[str, SimResult], path: str | Path) -> int:
    """One CSV row per job and policy, in trace order: when each policy started and ended it.

    Unschedulable jobs keep their row, with empty times and ``status`` ``unschedulable``. Returns
    the number of rows written."""
    rows = 0
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(SCHEDULE_COLUMNS)
        for name, r in results.items():
            for w, st, en in zip(r.workloads, r.start.tolist(), r.end.tolist()):
                if math.isnan(st):  # a simulation runs until every job that can ever start has run
                    status, times = "unschedulable", ("", "", "")
                else:
                    status, times = "done", (f"{st:.3f}", f"{en:.3f}", f"{st - w.submit_time:.3f}")
                out.writerow((name, w.name, w.user, f"{w.gpus:g}", f"{w.submit_time:.3f}", *times, status))
                rows += 1
    return rows


def figure(results: dict[str, SimResult]):
    """Per-user service ratios (bars) and wait CDFs (lines) per policy, as a matplotlib Figure.

    Built without pyplot, so it neither needs nor changes a backend: a notebook shows it inline,
    :func:`plot` writes it to a file."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(14, 5))
    a1, a2 = fig.subplots(1, 2)
    # users in natural order (user-2 before user-10)
    names = sorted({u for r in results.values() for u in r.service},
                   key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)])
    width = 0.8 / max(1, len(results))
    for k, (p, r) in enumerate(results.items()):
        a1.bar(np.arange(len(names)) + k * width, [r.service.get(u, np.nan) for u in names], width,
               label=f"{p} (Jain {r.metrics['jain_service']:.3f}, min {r.metrics['min_service']:.2f})")
    a1.axhline(1.0, color="k", lw=0.8, ls="--")
    # every user named up to 30 of them; beyond, 20 spread over the axis (the labels ran together)
    shown = range(len(names)) if len(names) <= 30 else sorted(set(np.linspace(0, len(names) - 1, 20).round().astype(int)))
    a1.set(title="Service ratio per user (1.0 = fair share)", xticks=[i + 0.4 - width / 2 for i in shown],
           ylabel="held / fair")
    a1.set_xticklabels([names[i].replace("user-", "u") for i in shown], rotation=0 if len(names) <= 20 else 90,
                       fontsize=8)
    a1.legend(fontsize=8)
    for p, r in results.items():
        w = np.sort(r.waits)
        a2.plot(np.maximum(w, 1) / 3600.0, np.arange(1, len(w) + 1) / len(w),
                label=f"{p} (p95 {format_duration(r.metrics['wait_p95'])}, max {format_duration(r.metrics['wait_max'])})")
    a2.set(title="Wait CDF (waits under 1 s drawn at 1 s)", xlabel="wait (hours, log)", ylabel="fraction of jobs", xscale="log")
    a2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(results: dict[str, SimResult], path: str | Path) -> None:
    """:func:`figure`, written to ``path`` (PNG, SVG or PDF by its ending)."""
    figure(results).savefig(path, dpi=110)
