"""Where each user stands: decayed usage, share and the user's part of the priority.

What Slurm's ``sshare`` shows, for the ``fairshare`` policy: the same :class:`.policy.FairShare`
code the scheduler orders by, run on the usage a ledger holds. Pure: the CLI reads the ledger.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .config import SchedulerConfig
from .model import Resources
from .policy import CycleContext, FairShare, UserState
from .usage import format_duration

CAPACITY_KEYS = {"gpu": "gpu", "cpu": "cpu", "memory": "memory_gb"}


@dataclass(frozen=True)
class UserStanding:
    user: str
    shares: float
    priority: int
    """Static tier from the config."""
    usage: Resources
    """Decayed GPU-s, CPU-s and GB-s."""
    usage_share: float
    """U: the user's fraction of all users' decayed usage, resources weighed by capacity."""
    share: float
    """S: the user's fraction of all shares."""
    fairshare_factor: float
    """F in [0, 1] (``classic``: ``2^(-U/S)``)."""
    tier_factor: float
    """T in [0, 1]."""
    user_priority: float
    """``w_fs * F + w_prio * T``: the part of every job's priority that comes from its user
    (each job adds its own age, and size where weighted)."""
    protected: bool
    """Below ``protect_below_share`` of its share: its work goes before a (soft-)starving gang."""

    def to_json(self) -> dict:
        d = asdict(self)
        d["usage"] = {"gpu_s": self.usage.gpu, "cpu_s": self.usage.cpu, "gb_s": self.usage.memory_gb}
        return d


def parse_capacity(text: str) -> tuple[Resources | None, list[str]]:
    """``gpu=64,cpu=512,memory=2048`` (memory in GB) -> (Resources, problems)."""
    values, problems = {}, []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in CAPACITY_KEYS:
            problems.append(f"--capacity: {part!r} is not one of gpu=N, cpu=N, memory=N (GB)")
            continue
        try:
            v = float(value)
        except ValueError:
            v = math.nan
        if not (math.isfinite(v) and v >= 0):
            problems.append(f"--capacity: {key} must be a number >= 0, got {value.strip()!r}")
            continue
        values[CAPACITY_KEYS[key]] = v
    if not problems and not any(values.values()):
        problems.append(f"--capacity: give at least one resource above 0, got {text!r}")
    return (Resources(**values) if not problems else None), problems


def user_standings(usage: dict[str, Resources], cfg: SchedulerConfig, capacity: Resources,
                   now: float) -> list[UserStanding]:
    """Every user of the config and of ``usage``, highest user priority first (then by name).

    Resource kinds with zero ``capacity`` do not count towards U (``capacity`` of GPUs only: U
    is the share of GPU-seconds)."""
    names = [u.name for u in cfg.users] + sorted(set(usage) - {u.name for u in cfg.users})
    states = {n: UserState(cfg.user(n), usage=usage.get(n, Resources())) for n in names}
    ctx = CycleContext(now, states, capacity)
    policy = FairShare(cfg.fairshare)
    policy.prepare(ctx)
    out = [UserStanding(n, s.config.shares, s.config.priority, s.usage, policy.usage_hist[n], policy.shares[n],
                        policy.fs[n], policy.tier[n], policy.f[n], policy.is_protected(n))
           for n, s in states.items()]
    return sorted(out, key=lambda s: (-s.user_priority, s.user))


def format_standings(rows: list[UserStanding], header: list[str]) -> str:
    lines = list(header)
    if not rows:  # no table of headings over nothing, as `kubectl get` says "No resources found"
        return "\n".join(lines)
    cols = ("user", "shares", "tier", "GPU-h", "CPU-h", "GB-h", "usage U", "share S", "F", "user prio", "protected")
    table = [cols]
    for r in rows:
        u = r.usage
        table.append((r.user, f"{r.shares:g}", str(r.priority), f"{u.gpu / 3600:.1f}", f"{u.cpu / 3600:.1f}",
                      f"{u.memory_gb / 3600:.1f}", f"{r.usage_share:.2%}", f"{r.share:.2%}",
                      f"{r.fairshare_factor:.3f}", f"{r.user_priority:.1f}", "yes" if r.protected else ""))
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for j, row in enumerate(table):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe_half_life(seconds: float) -> str:
    return "none (no decay)" if math.isinf(seconds) else format_duration(seconds)
