"""Run several policies side by side on one trace (the benchmark protocol), and show results."""
from __future__ import annotations

import csv
import math
from pathlib import Path

from .config import FairShareConfig
from .errors import SchedulerConfigError
from .model import placement_problem
from .policy import POLICIES
from .simulator import METRICS, SimResult, simulate
from .trace import capacity, protocol_nodes, protocol_users, protocol_workloads, read_trace
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
        raise SchedulerConfigError(problems, f"use 'all' or a comma-separated list of: {', '.join(POLICIES)}")
    return _policy_names(text)


def option_problems(users: int, zipf: float, load: float, half_life: float, placement: str) -> list[str]:
    """Every bad protocol option, each with its flag."""
    problems = []
    if problem := placement_problem(placement, "--placement"):
        problems.append(problem)
    if users < 1:
        problems.append(f"--users: must be >= 1, got {users}")
    if not load > 0:
        problems.append(f"--load: must be > 0, got {load}")
    if not zipf >= 0:
        problems.append(f"--zipf: must be >= 0, got {zipf}")
    if not half_life > 0:
        problems.append(f"--half-life: must be > 0, got {half_life}")
    return problems


def run_protocol(trace: str | Path, policies: list[str], users: int = 20, zipf: float = 1.1, seed: int = 0,
                 load: float = 0.9, half_life: float = 7 * 86400.0, fairshare: FairShareConfig | None = None,
                 progress: bool = False, placement: str = "binpack") -> tuple[dict[str, SimResult], dict]:
    if problems := option_problems(users, zipf, load, half_life, placement):
        raise SchedulerConfigError(problems)
    jobs = read_trace(trace)
    c = capacity(jobs, load)
    info = {"trace": str(trace), "jobs": len(jobs), "capacity_gpus": c, "nodes": c // 8, "users": users,
            "zipf": zipf, "seed": seed, "load": load, "half_life_s": half_life, "placement": placement}
    results = {}
    workloads = protocol_workloads(jobs, users, zipf, seed)  # read-only to the simulator: one set for all
    for p in policies:
        results[p] = simulate(workloads, protocol_users(users), protocol_nodes(c),
                              p, half_life, fairshare, progress=progress, placement=placement)
    return results, info


_FRACTION_METRICS = ("utilization", "jain_service", "min_service")
_AGAINST_FIFO = ("wait_p95", "wait_max", "jct_mean", "utilization", "light_wait_p95")


def format_table(results: dict[str, SimResult], info: dict) -> str:
    """Metrics per policy (times in s/m/h/d) and, when ``fifo`` ran, each policy against it."""
    w = 15
    head = f"{'policy':<16}" + "".join(f"{m:>{w}}" for m in METRICS)
    lines = [f"trace {info['trace']}: {info['jobs']} jobs, C = {info['capacity_gpus']} GPUs "
             f"({info['nodes']} nodes of 8), {info['users']} users, zipf {info['zipf']}, seed {info['seed']}, "
             f"load {info['load']}, placement {info.get('placement', 'binpack')}", head, "-" * len(head)]
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
    unsched = {p: len(r.unschedulable) for p, r in results.items() if r.unschedulable}
    if unsched:
        lines.append(f"unschedulable (larger than the cluster, reported, not run): {unsched}")
    lines.append("service = GPU-time held / max-min fair GPU-time (1.0 = fair share); "
                 "--json gives every metric with times in seconds")
    return "\n".join(lines)


SCHEDULE_COLUMNS = ("policy", "job_id", "user", "gpus", "submit_s", "start_s", "end_s", "wait_s", "status")


def write_schedule(results: dict[str, SimResult], path: str | Path) -> int:
    """One CSV row per job and policy, in trace order: when each policy started and ended it.

    Unschedulable jobs keep their row, with empty times and ``status`` ``unschedulable``. Returns
    the number of rows written."""
    rows = 0
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(SCHEDULE_COLUMNS)
        for name, r in results.items():
            never = set(r.unschedulable)
            for w, st, en in zip(r.workloads, r.start.tolist(), r.end.tolist()):
                if math.isnan(st):
                    status, times = ("unschedulable" if w.name in never else "not started"), ("", "", "")
                else:
                    status, times = "done", (f"{st:.3f}", f"{en:.3f}", f"{st - w.submit_time:.3f}")
                out.writerow((name, w.name, w.user, f"{w.gpus:g}", f"{w.submit_time:.3f}", *times, status))
                rows += 1
    return rows


def plot(results: dict[str, SimResult], path: str | Path) -> None:
    """Per-user service ratios (bars) and wait CDFs (lines) per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 5))
    names = sorted({u for r in results.values() for u in r.service})
    width = 0.8 / max(1, len(results))
    for k, (p, r) in enumerate(results.items()):
        a1.bar(np.arange(len(names)) + k * width, [r.service.get(u, np.nan) for u in names], width,
               label=f"{p} (Jain {r.metrics['jain_service']:.3f}, min {r.metrics['min_service']:.2f})")
    a1.axhline(1.0, color="k", lw=0.8, ls="--")
    a1.set(title="Service ratio per user (1.0 = fair share)", xticks=np.arange(len(names)) + 0.4 - width / 2,
           xticklabels=[n.replace("user-", "u") for n in names], ylabel="held / fair")
    a1.legend(fontsize=8)
    for p, r in results.items():
        w = np.sort(r.waits)
        a2.plot(np.maximum(w, 1) / 3600.0, np.arange(1, len(w) + 1) / len(w),
                label=f"{p} (p95 {format_duration(r.metrics['wait_p95'])}, max {format_duration(r.metrics['wait_max'])})")
    a2.set(title="Wait CDF (waits under 1 s drawn at 1 s)", xlabel="wait (hours, log)", ylabel="fraction of jobs", xscale="log")
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
