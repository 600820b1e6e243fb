"""Judge a ``fairshare`` setting by the goals of issue #4 over many runs: traces, cuts of them
and overlays of two (new job mixes), and user draws, each run against the five baselines of the same input.

``fairness_scheduler/TUNING.md`` counts runs with this judge (``kfp-pytorch goals``).
The goals count runs, and one job's start can flip a run, so compare settings over many runs,
and jitter a weight to see the noise before believing a gap (TUNING.md: about ±3 runs in 112).

I/O lives here (processes, the baseline cache); the verdicts are :mod:`.goals`'s, pure.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import FairShareConfig
from .errors import SchedulerOptionsError, TraceError
from .goals import (BASELINES, FAIR_BASELINES, GOALS, Check, baseline_checks, check, meets_all, miss_score,
                    missed, shared_misses)
from .report import UserLookup, init_pool_worker, run_jobs, stop_pool_workers, trace_people, workers_problems
from .simulator import METRICS
from .trace import (CUTS, PAIRS, TraceJob, capacity, cut, near_trace, overlay, read_trace, trace_files_in,
                    trace_name, trace_users)

CACHE_VERSION = 2  # 2: every run's users (shares, tiers, quotas) are part of the key
"""Bump when a baseline's behaviour changes, so cached baseline metrics are not reused."""


@dataclass
class GoalRun:
    """One run: a trace or a cut of one, under one user draw."""

    set: str
    trace: str
    """The trace's name (:func:`.trace.trace_name`), plus the cut's suffix (``cluster03a``: the first half)."""
    seed: int
    metrics: dict[str, dict[str, float]]
    """Every policy's metrics, the protocol's names."""
    checks: dict[str, Check]
    """``fairshare``'s goals."""
    baselines_met: dict[str, bool]
    """Whether each fair baseline, judged by the same goals, meets every one."""
    shared: list[str] = field(default_factory=list)
    """``fairshare``'s missed goals that no fair baseline meets in this run either
    (:func:`.goals.shared_misses`)."""
    own_users: bool = False
    """The trace names its jobs' users: they are kept, so the seed (a user draw) did not apply."""

    @property
    def met(self) -> bool:
        return meets_all(self.checks)


def parse_seeds(text: str) -> list[int]:
    """``0-5``, ``0,3,7`` or a mix (``0-3,8``), in the order given, without repeats."""
    seeds: list[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            rng = range(int(lo), int(hi) + 1) if sep else [int(lo)]
        except ValueError:
            raise ValueError(f"--seeds: {part!r} is not a seed or a range like 0-5") from None
        if sep and int(hi) < int(lo):
            raise ValueError(f"--seeds: range {part!r} is empty (write low-high)")
        seeds += [s for s in rng if s not in seeds]
    if not seeds:
        raise ValueError("--seeds: empty; give seeds like 0-5 or 0,3,7")
    if any(s < 0 for s in seeds):
        raise ValueError("--seeds: must be >= 0")
    return seeds


SETS = (*CUTS, PAIRS)
"""Every job-mix set: the cuts of each trace (:data:`.trace.CUTS`) and the overlays of two."""


def set_problems(sets: list[str], n_traces: int | None = None) -> list[str]:
    """Problems with ``--sets``; ``n_traces`` (when known) checks that ``pairs`` has two traces."""
    if not sets:
        return [f"--sets: empty; use a comma-separated list of: {', '.join(SETS)}"]
    problems = [f"--sets: unknown set {s!r} (known: {', '.join(SETS)})" for s in sets if s not in SETS]
    if PAIRS in sets and n_traces is not None and n_traces < 2:
        problems.append(f"--sets {PAIRS}: overlays each trace with the next one, so it needs at least two "
                        f"traces; {n_traces} given")
    return problems


def trace_files(paths: list[str | Path]) -> tuple[list[Path], list[str]]:
    """CSV files named, or found (``*.csv``, ``*.csv.gz``) in the folders named; problems for the rest."""
    files: list[Path] = []
    problems: list[str] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = [p / name for name in trace_files_in(p)]
            if not found:
                problems.append(f"--traces: no *.csv or *.csv.gz in folder {p}")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            near = near_trace(p)
            problems.append(f"--traces: {p} does not exist" + (f" (did you mean {near}?)" if near else ""))
    unique: dict[Path, Path] = {}  # each file once, in the order first named
    for f in files:
        unique.setdefault(f.resolve(), f)
    files = list(unique.values())
    if not paths:
        problems.append("--traces: give trace CSVs or folders of them")
    return files, problems


@dataclass(frozen=True)
class _Unit:
    set: str
    trace: str
    seed: int
    jobs: list[TraceJob]
    policies: tuple[str, ...]
    params: tuple
    own_users: bool = False


def _run_unit(u: _Unit) -> dict[str, dict[str, float]]:
    users, zipf, load, half_life, placement, fairshare, user_config = u.params
    res, _ = run_jobs(u.jobs, list(u.policies), users, zipf, u.seed, load, half_life, fairshare,
                      placement=placement, trace=u.trace, user_config=user_config)
    return {p: r.metrics for p, r in res.items()}


def _cache_key(jobs: list[TraceJob], seed: int, params: tuple) -> str:
    users, zipf, load, half_life, placement, _, user_config = params
    h = hashlib.sha256(json.dumps([CACHE_VERSION, users, zipf, seed, load, half_life, placement]).encode())
    people = trace_people(jobs, users, user_config)  # shares, tiers and quotas: the config's where it lists them
    h.update(json.dumps([[u.name, u.shares, u.priority, u.gpu_quota] for u in people]).encode())
    for j in jobs:
        h.update(f"{j.submit!r},{j.duration!r},{j.gpus}{'' if j.user is None else ',' + j.user}\n".encode())
    return h.hexdigest()[:20]


def _read_cached(path: Path) -> dict | None:
    """The baselines' metrics kept at ``path``, or None when missing or unusable (cut short,
    edited, or from another version): the run is then simply made again."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and all(isinstance(data.get(p), dict) and set(METRICS) <= set(data[p])
                                        for p in BASELINES)
    return data if ok else None


def _write_cached(path: Path, data: dict) -> None:
    """Atomically (a reader never sees half a file), best effort: a cache that cannot be written
    costs time, not results."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def evaluate_goals(traces: list[str | Path], seeds: list[int], sets: list[str] = ("full",),
                   fairshare: FairShareConfig | None = None, placement: str = "binpack", workers: int = 1,
                   cache_dir: str | Path | None = None, progress: bool | Callable[[int, int], None] = False,
                   users: int = 20, zipf: float = 1.1, load: float = 0.9,
                   half_life: float = 7 * 86400.0,
                   user_config: UserLookup | None = None) -> list[GoalRun]:
    """``fairshare`` (with ``fairshare``'s setting) and the five baselines on every cut of every
    trace in ``sets``, under every seed; each run judged by :func:`.goals.check`. A trace with a
    ``user`` column keeps its users, so it runs under the first seed only (user draws do not
    apply); ``user_config`` gives the shares, tiers and quotas of the users it lists (see
    :func:`.report.run_jobs`).

    ``cache_dir`` keeps the baselines' metrics (they do not depend on the ``fairshare`` setting),
    keyed by the jobs and the protocol options, so comparing settings re-runs only ``fairshare``.
    ``workers`` runs that many runs at once, one process each; results do not depend on it."""
    files, problems = trace_files(list(traces))
    problems += set_problems(list(sets), len(files) if not problems else None)
    problems += workers_problems(workers)
    if problems:
        raise SchedulerOptionsError(problems)
    parsed: dict[Path, list[TraceJob]] = {}
    bad: list[TraceError] = []
    for f in files:  # every bad trace is reported, before any run
        try:
            parsed[f] = read_trace(f)
        except TraceError as e:
            bad.append(e)
    if bad:
        raise TraceError("\n".join(e.message for e in bad), bad[0].hint)
    if PAIRS in sets:  # a draw of users for one trace and named users for the other would mix two kinds
        items = list(parsed.items())
        mixed = [f"--sets {PAIRS}: {items[i][0]} names its jobs' users and {items[k][0]} does not; overlay "
                 "traces of one kind (both with a user column, or neither)"
                 for i, k in _pairs(len(items)) if bool(trace_users(items[i][1])) != bool(trace_users(items[k][1]))]
        if mixed:
            raise SchedulerOptionsError(mixed)
    params = (users, zipf, load, half_life, placement, fairshare, user_config)
    cache = Path(cache_dir) if cache_dir else None
    if cache:
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SchedulerOptionsError([f"--cache: cannot create folder {cache}: {e.strerror or e}"],
                                       "give a writable folder, or leave --cache out") from None
    mixes = list(_mixes(parsed, sets))
    too_big: list[TraceError] = []
    for _, name, part in mixes:  # every cluster the protocol cannot size is reported, before any run
        try:
            capacity(part, load, source=name)
        except TraceError as e:
            too_big.append(e)
    if too_big:
        raise TraceError("\n".join(e.message for e in too_big), too_big[0].hint)
    units: list[_Unit] = []
    cached: dict[int, dict] = {}
    keys: dict[int, Path] = {}
    for set_name, name, part in mixes:
        own_users = bool(trace_users(part))
        for seed in (seeds[:1] if own_users else seeds):
            policies = BASELINES + ("fairshare",)
            i = len(units)
            if cache:
                keys[i] = cache / f"{name}-s{seed}-{_cache_key(part, seed, params)}.json"
                if (hit := _read_cached(keys[i])) is not None:
                    cached[i] = hit
                    policies = ("fairshare",)
            units.append(_Unit(set_name, name, seed, part, policies, params, own_users))
    metrics = _run_all(units, workers, progress)
    runs = []
    for i, (u, m) in enumerate(zip(units, metrics)):
        if i in cached:
            m = {**cached[i], **m}
        elif cache:
            _write_cached(keys[i], {p: m[p] for p in BASELINES})
        m = {p: m[p] for p in BASELINES + ("fairshare",)}
        checks, baselines = check(u.trace, m), baseline_checks(u.trace, m)
        runs.append(GoalRun(u.set, u.trace, u.seed, m, checks, {p: meets_all(c) for p, c in baselines.items()},
                            shared_misses(checks, baselines), u.own_users))
    return runs


def _pairs(n: int) -> list[tuple[int, int]]:
    """Which traces ``pairs`` overlays: each with the next, the last with the first (two: once)."""
    return [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)] if n > 2 else []


def _mixes(parsed: dict[Path, list[TraceJob]], sets: list[str]):
    """(set, name, jobs) of every job mix: each trace's cuts (``cluster03a``), or for ``pairs``
    each trace overlaid with the next one named (``cluster03+cluster05``; the last with the first)."""
    items = list(parsed.items())
    for set_name in sets:
        if set_name == PAIRS:
            for i, k in _pairs(len(items)):
                (f, a), (g, b) = items[i], items[k]
                yield set_name, f"{trace_name(f)}+{trace_name(g)}", overlay(a, b, (trace_name(f), trace_name(g)))
            continue
        for f, jobs in items:
            for lo, hi, suffix in CUTS[set_name]:
                part = cut(jobs, lo, hi)
                if part:  # else a trace too short to cut this way
                    yield set_name, trace_name(f) + suffix, part


def _run_all(units: list[_Unit], workers: int, progress) -> list[dict]:
    """Every unit, largest first across ``workers`` processes (standard library pool: each run
    is one pure task), results in the units' order."""
    bar = None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=len(units), desc="runs", unit="run", leave=False)
    done = 0

    def report() -> None:
        nonlocal done
        done += 1
        if bar is not None:
            bar.update(1)
        elif callable(progress):
            progress(done, len(units))

    order = sorted(range(len(units)), key=lambda i: -len(units[i].jobs) * len(units[i].policies))
    out: list[dict | None] = [None] * len(units)
    try:
        if workers == 1 or len(units) <= 1:
            for i in order:
                out[i] = _run_unit(units[i])
                report()
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            before = set(mp.active_children())
            with ProcessPoolExecutor(min(workers, len(units)), mp_context=ctx, initializer=init_pool_worker) as ex:
                try:  # the submitting too: thousands of runs take a while to queue
                    futures = {ex.submit(_run_unit, units[i]): i for i in order}
                    for fut in as_completed(futures):
                        out[futures[fut]] = fut.result()
                        report()
                except BaseException:  # Ctrl-C, a kill: do not wait for the runs under way
                    stop_pool_workers(before)
                    raise
    finally:
        if bar is not None:
            bar.close()
    return out


def summarize(runs: list[GoalRun]) -> dict[str, dict]:
    """Per set and overall (``all``): runs, runs meeting every goal for ``fairshare`` and for each
    fair baseline, ``fairshare``'s misses per goal and its miss score (:func:`.goals.miss_score`);
    ``shared``: of those misses, the ones no fair baseline met in the same run either, per goal;
    ``shared_only``: runs missed only by such goals."""
    out: dict[str, dict] = {}
    for name in list(dict.fromkeys(r.set for r in runs)) + ["all"]:
        sel = [r for r in runs if name in ("all", r.set)]
        misses = Counter(g for r in sel for g, c in r.checks.items() if not c.met)
        shared = Counter(g for r in sel for g in r.shared)
        out[name] = {"runs": len(sel), "fairshare": sum(r.met for r in sel),
                     **{p: sum(r.baselines_met.get(p, False) for r in sel) for p in FAIR_BASELINES},
                     "missed": {g: misses.get(g, 0) for g in GOALS},
                     "shared": {g: shared.get(g, 0) for g in GOALS},
                     "shared_only": sum(not r.met and len(r.shared) == len(missed(r.checks)) for r in sel),
                     "miss_score": round(sum(miss_score(r.checks) for r in sel), 1)}
    return out


def format_goals(runs: list[GoalRun], verbose: bool = False) -> str:
    """A table of runs meeting every goal per set, ``fairshare``'s misses per goal, and (verbose)
    every run that missed, with its figures."""
    s = summarize(runs)
    head = (f"{'set':<8}{'runs':>6}{'fairshare':>11}" + "".join(f"{p:>17}" for p in FAIR_BASELINES)
            + f"{'fairshare miss score':>22}")
    lines = ["runs meeting every goal of issue #4 (each policy against the baselines of the same run)", head]
    for name, row in s.items():
        if name == "all" and len(s) == 2:
            continue  # one set: its row is the total
        lines.append(f"{name:<8}{row['runs']:>6}{row['fairshare']:>11}"
                     + "".join(f"{row[p]:>17}" for p in FAIR_BASELINES) + f"{row['miss_score']:>22.0f}")
    total = s["all"]
    lines.append("fairshare's misses by goal (runs): "
                 + ", ".join(f"{g} {n}" for g, n in total["missed"].items()))
    lines.append("  of those, no fair baseline met the goal in the same run either: "
                 + ", ".join(f"{g} {n}" for g, n in total["shared"].items())
                 + f" ({total['shared_only']} of {total['runs'] - total['fairshare']} missed runs miss only such goals)")
    if total["runs"] > total["fairshare"]:
        lines.append("miss score: minus the missed goals' shortfalls summed, each in units of about one setting's move "
                     "(0.01 of Jain's index, 0.005 of the utilization ratio...); 0 when every goal is met"
                     + ("" if verbose else "; -v lists each missed run with its figures"))
    own = sorted({r.trace for r in runs if r.own_users})
    if own:
        lines.append(f"kept their own users (a user column), so ran once, not per seed: {', '.join(own)}")
    if verbose:
        for r in runs:
            if not r.met:
                lines.append(f"  {r.trace}/seed {r.seed}: " + ", ".join(
                    f"{g} {c.value:.4g} (target {c.target}{'; no fair baseline meets it' if g in r.shared else ''})"
                    for g, c in r.checks.items() if not c.met))
    return "\n".join(lines)


SET_TITLES = {"full": "full traces", "halves": "half traces", "thirds": "thirds", "middle": "middle halves",
              PAIRS: "pairs of traces overlaid"}
_SHORT = {"jain": "J", "light_wait_p95": "L", "wait_max": "W", "utilization": "U", "jct_mean": "C", "min_service": "M"}


def goal_grid(runs: list[GoalRun]):
    """One panel per set, one cell per trace (or cut) and user draw: green where ``fairshare``
    meets every goal, else yellow to red by the number missed, labelled with the goals missed.
    A pyplot-free matplotlib Figure (neither needs nor changes a backend)."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure

    cmap = ListedColormap(["#66bb6a", "#ffe082", "#ffab40", "#e53935"])  # 0, 1, 2, 3+ goals missed
    sets = list(dict.fromkeys(r.set for r in runs))
    rows = {name: sorted({r.trace for r in runs if r.set == name}) for name in sets}
    fig = Figure(figsize=(max(9.0, 7.0 * len(sets)), max(4.0, 0.3 * max(len(v) for v in rows.values()) + 2.5)))
    axes = fig.subplots(1, len(sets), squeeze=False)[0]
    for ax, name in zip(axes, sets):
        mine = [r for r in runs if r.set == name]
        traces, seeds = rows[name], sorted({r.seed for r in mine})
        n_missed = np.full((len(traces), len(seeds)), np.nan)
        for r in mine:
            miss = [g for g, c in r.checks.items() if not c.met]
            n_missed[traces.index(r.trace), seeds.index(r.seed)] = len(miss)
            label = "".join(_SHORT[g].lower() if g in r.shared else _SHORT[g] for g in miss)
            ax.text(seeds.index(r.seed), traces.index(r.trace), label or "ok",
                    ha="center", va="center", fontsize=8)
        ax.imshow(np.minimum(n_missed, 3), cmap=cmap, vmin=-0.5, vmax=3.5, aspect="auto")
        ax.set_title(f"{SET_TITLES.get(name, name)}: {sum(r.met for r in mine)}/{len(mine)} runs meet every goal")
        ax.set_xticks(range(len(seeds)), [str(x) for x in seeds])
        ax.set_yticks(range(len(traces)), [t.replace("cluster", "") for t in traces])
        ax.set_xlabel("user-draw seed")
    fig.suptitle("fairshare against the issue #4 goals, same run as the baselines\nmissed: J Jain's index, "
                 "L light users' p95 wait, W worst wait, U utilization, C mean JCT, M worst-served user\n"
                 "(lower case: no fair baseline met that goal in the run either)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def to_json(runs: list[GoalRun]) -> dict:
    """``{"summary": summarize(runs), "runs": [...]}``, each run with its metrics and checks."""
    return {"summary": summarize(runs),
            "runs": [{"set": r.set, "trace": r.trace, "seed": r.seed, "own_users": r.own_users, "met": r.met,
                      "checks": {g: asdict(c) for g, c in r.checks.items()},
                      "baselines_met": r.baselines_met, "shared_misses": r.shared, "metrics": r.metrics}
                     for r in runs]}
