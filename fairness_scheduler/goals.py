"""The fairness goals of issue #4, judged on one run: a policy against the baselines of the same run.

Pure: metrics in (``{policy: {metric: value}}``, the protocol's names), verdicts out. The runs
themselves are :func:`.report.evaluate_goals`'s job; ``make bench`` and ``kfp-pytorch goals`` both
judge with this module, so a tuning claim in TUNING.md can be re-run from the command line.

Goals (ratios are to FIFO's figure of the same run):

- ``jain``: ``jain_service`` >= the best baseline's - 0.005 (and >= 0.95 on cluster07 and cluster09);
- ``light_wait_p95``: <= 0.35x FIFO's (0.15x on cluster02, cluster07 and cluster09);
- ``wait_max``: <= 1.5x FIFO's;
- ``utilization``: >= 0.98x FIFO's;
- ``jct_mean``: <= 1.05x FIFO's;
- ``min_service``: >= FIFO's (and >= 0.6 on cluster07 and cluster09).

The stricter targets belong to the named full traces only; a cut of a trace (``cluster07a``) is a
new job mix and gets the generic ones. A fair baseline judged by the same goals is held to the
best of the *other* baselines' Jain index.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

GOALS = ("jain", "light_wait_p95", "wait_max", "utilization", "jct_mean", "min_service")
BASELINES = ("fifo", "static-priority", "drf", "slurm-fairshare", "kueue-afs")
FAIR_BASELINES = ("drf", "slurm-fairshare", "kueue-afs")


@dataclass(frozen=True)
class Targets:
    jain_margin: float = 0.005
    """``jain_service`` may be this far below the best baseline's."""
    jain_min: float = 0.0
    light_wait_p95: float = 0.35
    """Most ``light_wait_p95`` may be, as a multiple of FIFO's."""
    wait_max: float = 1.5
    utilization: float = 0.98
    """Least ``utilization`` may be, as a multiple of FIFO's."""
    jct_mean: float = 1.05
    min_service_min: float = 0.0


GENERIC = Targets()
STRICT = {
    "cluster02": replace(GENERIC, light_wait_p95=0.15),
    "cluster07": replace(GENERIC, jain_min=0.95, light_wait_p95=0.15, min_service_min=0.6),
    "cluster09": replace(GENERIC, jain_min=0.95, light_wait_p95=0.15, min_service_min=0.6),
}
"""The issue's stricter targets, by trace name (:func:`.trace.trace_name`: cluster02.csv.gz is cluster02)."""


def targets_for(trace_name: str) -> Targets:
    return STRICT.get(trace_name, GENERIC)


@dataclass(frozen=True)
class Check:
    value: float
    """The candidate's figure (a ratio to FIFO's for the goals stated that way)."""
    target: str
    met: bool
    margin: float = 0.0
    """How far past the target, in the goal's unit (:data:`UNITS`): >= 0 met, < 0 missed by that much."""


UNITS = {"jain": "0.01 of the index", "light_wait_p95": "10 % of the target ratio", "wait_max": "0.05 of the ratio",
         "utilization": "0.005 of the ratio", "jct_mean": "0.02 of the ratio", "min_service": "0.02 of the ratio"}
"""The unit of each goal's margin, about the size of a move one setting makes; the *miss score*
(:func:`miss_score`) sums the missed margins, so it says how far a setting is from passing, where
the count of runs says only how often it fails."""


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a <= 0 else float("inf"))


def check(trace_name: str, metrics: dict[str, dict[str, float]], candidate: str = "fairshare",
          targets: Targets | None = None) -> dict[str, Check]:
    """Every goal for ``candidate`` on one run. ``metrics`` holds FIFO, the baselines (all or some
    of them) and the candidate; the Jain target is the best of the others except ``fairshare``."""
    t = targets or targets_for(trace_name)
    f, o = metrics["fifo"], metrics[candidate]
    best = max(v["jain_service"] for p, v in metrics.items() if p not in (candidate, "fairshare"))
    eps = 1e-9
    jain_floor = max(best - t.jain_margin, t.jain_min)
    mins_floor = max(f["min_service"], t.min_service_min)
    r_light = _ratio(o["light_wait_p95"], f["light_wait_p95"])
    r_wait = _ratio(o["wait_max"], f["wait_max"])
    r_util = _ratio(o["utilization"], f["utilization"])
    r_jct = _ratio(o["jct_mean"], f["jct_mean"])
    return {
        "jain": Check(o["jain_service"], f">= {jain_floor:.4f}", o["jain_service"] >= jain_floor - eps,
                      (o["jain_service"] - jain_floor) / 0.01),
        "light_wait_p95": Check(r_light, f"<= {t.light_wait_p95:g}",
                                o["light_wait_p95"] <= t.light_wait_p95 * f["light_wait_p95"] + eps,
                                (t.light_wait_p95 - r_light) / (0.1 * t.light_wait_p95)),
        "wait_max": Check(r_wait, f"<= {t.wait_max:g}", o["wait_max"] <= t.wait_max * f["wait_max"] + eps,
                          (t.wait_max - r_wait) / 0.05),
        "utilization": Check(r_util, f">= {t.utilization:g}", o["utilization"] >= t.utilization * f["utilization"] - eps,
                             (r_util - t.utilization) / 0.005),
        "jct_mean": Check(r_jct, f"<= {t.jct_mean:g}", o["jct_mean"] <= t.jct_mean * f["jct_mean"] + eps,
                          (t.jct_mean - r_jct) / 0.02),
        "min_service": Check(o["min_service"], f">= {mins_floor:.4f}", o["min_service"] >= mins_floor - eps,
                             (o["min_service"] - mins_floor) / 0.02),
    }


def meets_all(checks: dict[str, Check]) -> bool:
    return all(c.met for c in checks.values())


def miss_score(checks: dict[str, Check]) -> float:
    """The sum of the missed goals' margins (0 when every goal is met)."""
    return sum(min(c.margin, 0.0) for c in checks.values() if not c.met)


def missed(checks: dict[str, Check]) -> list[str]:
    return [g for g, c in checks.items() if not c.met]


def baseline_checks(trace_name: str, metrics: dict[str, dict[str, float]]) -> dict[str, dict[str, Check]]:
    """Every goal for each fair baseline in ``metrics``, judged as ``fairshare`` is (Jain against
    the best of the *other* baselines)."""
    return {p: check(trace_name, metrics, p) for p in FAIR_BASELINES if p in metrics}


def shared_misses(checks: dict[str, Check], baselines: dict[str, dict[str, Check]]) -> list[str]:
    """The goals that ``checks`` misses and that no fair baseline (:func:`baseline_checks`) meets
    either. Such a miss is set by the run's job mix and user draw as far as the known fair
    policies show: none of them orders its way past it. (Jain's goal is rarely among them: the
    best baseline is held only to the best of the others.)"""
    return [g for g, c in checks.items() if not c.met and not any(b[g].met for b in baselines.values())]
