"""Exponentially decayed resource usage, exact between events.

A user holding ``r`` resource units (GPUs, CPUs, GB) over ``dt`` seconds accrues ``r * dt``
unit-seconds. Usage decays with half-life ``h``: ``U(t + dt) = U(t) * 2^(-dt/h) + r * (1 - 2^(-dt/h)) / lambda``
with ``lambda = ln 2 / h``: the closed form of ``dU/dt = r - lambda U`` for constant ``r``, so
the value does not depend on how often it is updated (no sampling error, unlike periodic
accumulation in Slurm or Kueue).

Edge cases, decided here: ``dt <= 0`` returns ``U`` unchanged (clocks may repeat a timestamp;
they never rewind usage); ``h = inf`` (no decay) is the plain integral.
"""
from __future__ import annotations

import math

LN2 = math.log(2.0)


def decay_factor(dt: float, half_life: float) -> float:
    if dt <= 0:
        return 1.0
    if math.isinf(half_life):
        return 1.0
    return 2.0 ** (-dt / half_life)


def accrue(usage: float, rate: float, dt: float, half_life: float) -> float:
    """Usage after ``dt`` seconds at constant ``rate``, decayed with ``half_life``."""
    if dt <= 0:
        return usage
    if math.isinf(half_life):
        return usage + rate * dt
    f = 2.0 ** (-dt / half_life)
    return usage * f + rate * (1.0 - f) * half_life / LN2


def parse_duration(text: str | float | int) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"inf"`` or a number of seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().lower()
    if s in ("inf", "infinity", "never"):
        return math.inf
    units = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}
    if s and s[-1] in units:
        return float(s[:-1]) * units[s[-1]]
    return float(s)


def parse_time(text: str, now: float) -> float:
    """``now``, seconds since the epoch, or an ISO 8601 date-time (UTC unless it names a zone)
    -> seconds since the epoch. Raises ValueError."""
    from datetime import datetime, timezone

    s = str(text).strip()
    if s.lower() == "now":
        return now
    try:
        v = float(s)
    except ValueError:
        t = datetime.fromisoformat(s)
        return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(v):
        raise ValueError(f"not a finite time: {text!r}")
    return v


def format_time(t: float) -> str:
    """Seconds since the epoch as an ISO 8601 UTC date-time: ``2026-11-30T22:40:00Z``."""
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_duration(seconds: float) -> str:
    """The inverse of :func:`parse_duration`, for people: ``42s``, ``12.5m``, ``5.2h``, ``3.10d``."""
    a = abs(seconds)
    if a < 90:
        return f"{seconds:.0f}s"
    if a < 90 * 60:
        return f"{seconds / 60:.1f}m"
    if a < 48 * 3600:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.2f}d"


class RuntimeHistory:
    """Run-time estimates from finished workloads, as a real scheduler has them (never the
    workload's own duration).

    ``estimate(user, gpus)`` is the mean run time of the most specific class with history:
    the user's workloads of that size, then everyone's of that size, then the user's, then
    everyone's; ``None`` without any history. Size comes before the user: large gangs tend to be
    long training runs, and a user's many small jobs say little about its rare large ones.
    """

    def __init__(self):
        self._sums: dict[tuple, list[float]] = {}

    def record(self, user: str, gpus: float, seconds: float) -> None:
        for key in ((user, gpus), (None, gpus), (user, None), (None, None)):
            s = self._sums.get(key)
            if s is None:
                self._sums[key] = [seconds, 1.0]
            else:
                s[0] += seconds
                s[1] += 1.0

    def estimate(self, user: str, gpus: float) -> float | None:
        for key in ((user, gpus), (None, gpus), (user, None), (None, None)):
            s = self._sums.get(key)
            if s is not None:
                return s[0] / s[1]
        return None
