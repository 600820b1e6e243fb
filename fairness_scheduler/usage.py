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
import re

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


_UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6,
          "ns": 1e-9}
# one number (an exponent too: 1e3s, as one part was read before) and its unit; "ms" before "m":
# the regex takes the first alternative that matches
_PART = re.compile(r"((?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)(ms|us|µs|ns|w|d|h|m|s)")


def parse_duration(text: str | float | int) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"inf"``, a number of seconds, or parts in a row
    as Go writes durations (Kueue's ``usageHalfLifeTime: 168h0m0s``) with days and weeks too:
    ``"1d12h"``, ``"1h30m"``. Raises ValueError."""
    if isinstance(text, (int, float)):
        return float(text)
    s = str(text).strip().lower()
    if s == "never":
        return math.inf
    try:
        return float(s)  # seconds, inf
    except ValueError:
        pass
    sign, body = (-1.0, s[1:]) if s[:1] == "-" else (1.0, s.lstrip("+"))
    body = "".join(body.split())  # "7 d", "1d 12h"
    parts = _PART.findall(body)
    if not parts or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"not a duration: {text!r}")
    return sign * sum(float(n) * _UNITS[u] for n, u in parts)


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
