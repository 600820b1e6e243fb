"""Queue-ordering policies: pure functions of user state, the workload and ``now``.

Every policy orders pending workloads by an ascending key; the last two elements are always
``(submit_time, seq)``, so ordering is total and deterministic (tie-break: earlier submission,
then arrival order). Within one user and one workload shape a key never prefers a younger job
to an older one, which lets admission keep one FIFO queue per (user, shape) and compare only
the heads (see :mod:`.admission`).

No policy reads a workload's true duration.

Policies:

- ``fifo``: kube-scheduler's order, by creation time.
- ``static-priority``: the user's static tier only (then FIFO); the thesis's problem case.
- ``drf``: instantaneous dominant-resource fairness: lowest current dominant share first; no history.
- ``slurm-fairshare``: Slurm multifactor, classic fair-share: ``1000*F + 1000*A``,
  ``F = 2^(-U/S)`` with U the user's share of decayed usage and S its normalised shares,
  ``A = min(wait / 7d, 1)``.
- ``kueue-afs``: Kueue admission fair sharing: decayed consumed usage plus an entry penalty per
  admission, divided by the user's weight, lowest first.
- ``fairshare`` (ours): see :class:`FairShare`.

Fair-share factor alternatives (documented; ``fairshare_mode`` in config): ``classic`` is Slurm's
``2^(-U/S)``; ``ratio`` is ``S / (S + U)`` (Kueue-like, never saturates), ``fair-tree`` ranks
users by U/S and maps rank to [0, 1] (Slurm Fair Tree).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import FairShareConfig
from .model import Resources, UserConfig, Workload

WEEK = 7 * 86400.0


@dataclass
class UserState:
    """What a policy may know about a user at a point in time."""

    config: UserConfig
    usage: Resources = field(default_factory=Resources)
    """Decayed usage in GPU-s, CPU-s and GB-s."""
    held: Resources = field(default_factory=Resources)
    """Resources currently held by the user's running workloads."""
    penalty: float = 0.0
    """Kueue entry penalty (capacity-normalised), decays like usage."""
    estimated_runtime: float | None = None
    """Mean run time of the user's finished workloads (a real scheduler's estimate)."""


@dataclass
class CycleContext:
    """Everything a policy may read during one scheduling cycle."""

    now: float
    users: dict[str, UserState]
    capacity: Resources
    """Total allocatable resources of the cluster (normalises usage and shares)."""
    default_runtime: float | None = None
    """Run-time estimate for users without history (mean over all finished workloads)."""
    typical_wait: float = 0.0
    """Decayed mean wait of recently started workloads (seconds): the current regime's normal
    wait, against which a starving workload is recognised."""

    def __post_init__(self):
        c = self.capacity
        self._inv = (1.0 / c.gpu if c.gpu else 0.0, 1.0 / c.cpu if c.cpu else 0.0,
                     1.0 / c.memory_gb if c.memory_gb else 0.0)

    def norm(self, r: Resources) -> float:
        """Capacity-normalised size of a resource vector (sum over the resource kinds present)."""
        ig, ic, im = self._inv
        return r.gpu * ig + r.cpu * ic + r.memory_gb * im

    def dominant(self, r: Resources) -> float:
        c = self.capacity
        return max(r.gpu / c.gpu if c.gpu else 0.0, r.cpu / c.cpu if c.cpu else 0.0,
                   r.memory_gb / c.memory_gb if c.memory_gb else 0.0)


class Policy:
    """Base class. ``prepare`` runs once per cycle; ``key`` per candidate; ``on_admit`` after each
    admission and returns True when that user's keys changed (admission then re-ranks them)."""

    name = "base"
    reserves = False
    reads_usage = True
    """False for policies that never read users' usage or allocation (the caller may skip
    refreshing them)."""

    def prepare(self, ctx: CycleContext) -> None:
        self.ctx = ctx

    def key(self, w: Workload, now: float) -> tuple:
        raise NotImplementedError

    def on_admit(self, w: Workload, ctx: CycleContext) -> bool:
        return False

    def is_starving(self, w: Workload, now: float) -> bool:
        return False


class Fifo(Policy):
    name = "fifo"
    reads_usage = False

    def key(self, w, now):
        return (w.submit_time, w.seq)


class StaticPriority(Policy):
    name = "static-priority"
    reads_usage = False

    def key(self, w, now):
        return (-self.ctx.users[w.user].config.priority, w.submit_time, w.seq)


class Drf(Policy):
    """Lowest dominant share first, recomputed after every admission (classic DRF progressive filling)."""

    name = "drf"

    def prepare(self, ctx):
        super().prepare(ctx)
        self.held = {u: s.held for u, s in ctx.users.items()}
        self.share = {u: ctx.dominant(s.held) / s.config.shares for u, s in ctx.users.items()}

    def key(self, w, now):
        return (self.share[w.user], w.submit_time, w.seq)

    def on_admit(self, w, ctx):
        self.held[w.user] = self.held[w.user] + w.total
        self.share[w.user] = ctx.dominant(self.held[w.user]) / ctx.users[w.user].config.shares
        return True


def _usage_shares(ctx: CycleContext) -> tuple[dict[str, float], dict[str, float]]:
    """(share of decayed usage U, normalised shares S) per user."""
    norm = {u: ctx.norm(s.usage) for u, s in ctx.users.items()}
    total_u = sum(norm.values())
    total_s = sum(s.config.shares for s in ctx.users.values())
    usage = {u: (v / total_u if total_u > 0 else 0.0) for u, v in norm.items()}
    shares = {u: s.config.shares / total_s for u, s in ctx.users.items()}
    return usage, shares


class SlurmFairShare(Policy):
    """``1000 * 2^(-U/S) + 1000 * min(wait / 7d, 1)``, highest first."""

    name = "slurm-fairshare"

    def prepare(self, ctx):
        super().prepare(ctx)
        usage, shares = _usage_shares(ctx)
        self.f = {u: 1000.0 * 2.0 ** (-usage[u] / shares[u]) for u in ctx.users}

    def key(self, w, now):
        age = min(max(now - w.submit_time, 0.0) / WEEK, 1.0)
        return (-(self.f[w.user] + 1000.0 * age), w.submit_time, w.seq)


class KueueAfs(Policy):
    """(decayed usage + entry penalty) / weight, lowest first; the penalty grows on admission."""

    name = "kueue-afs"

    def __init__(self, penalty_seconds: float = 300.0):
        self.penalty_seconds = penalty_seconds
        """Kueue's entry penalty: the admitted requests times the usage sampling interval (5 min)."""

    def prepare(self, ctx):
        super().prepare(ctx)
        self.score = {u: (ctx.norm(s.usage) + s.penalty) / s.config.shares for u, s in ctx.users.items()}

    def key(self, w, now):
        return (self.score[w.user], w.submit_time, w.seq)

    def on_admit(self, w, ctx):
        s = ctx.users[w.user]
        self.score[w.user] += ctx.norm(w.total) * self.penalty_seconds / s.config.shares
        return True


class FairShare(Policy):
    """Ours: a weighted sum of factors in [0, 1], plus starvation-proof reservations.

    ``P = w_fs * F + w_age * A + w_prio * T + w_size * Z``, highest first, where

    - ``F`` is the fair-share factor of the user's *effective usage*: a blend of the decayed
      history (the thesis: who used a lot lately yields) and the user's current allocation
      (so a user whose many jobs are running right now yields at once, as DRF does);
    - ``A = min(wait / age_cap, 1)`` grows with the workload's own wait;
    - ``T`` maps the user's static tier onto [0, 1];
    - ``Z = 1 - size / capacity`` optionally favours small gangs.

    Starvation: a workload that has waited ``starvation_after`` seconds and still does not fit is
    given a reservation (see :func:`.admission.admit`): the nodes closest to fitting it stop taking
    new work until it starts, while the rest of the cluster keeps backfilling. This is what lets
    large gangs finish waiting without "stop everything until the head fits".
    """

    name = "fairshare"
    reserves = True

    def __init__(self, cfg: FairShareConfig | None = None):
        self.cfg = cfg or FairShareConfig()

    def _prepare(self, ctx):
        Policy.prepare(self, ctx)
        c = self.cfg
        usage, shares = _usage_shares(ctx)
        tiers = [s.config.priority for s in ctx.users.values()] or [1]
        lo, hi = min(tiers), max(tiers)
        self.base = {}
        self.shares = shares
        self.usage_hist = usage
        for u, s in ctx.users.items():
            tier = (s.config.priority - lo) / (hi - lo) if hi > lo else 0.0
            self.base[u] = c.weight_priority * tier
        self.held = {u: ctx.norm(s.held) / max(ctx.norm(ctx.capacity), 1e-12) for u, s in ctx.users.items()}
        self.f = {u: self._factor(u) for u in ctx.users}

    def _factor(self, u: str) -> float:
        c = self.cfg
        eff = (1.0 - c.current_weight) * self.usage_hist[u] + c.current_weight * self.held[u]
        s = self.shares[u]
        if c.fairshare_mode == "ratio":
            f = s / (s + eff)
        else:  # classic
            f = 2.0 ** (-eff / s)
        return c.weight_fairshare * f + self.base[u]

    def starvation_threshold(self) -> float:
        c = self.cfg
        return max(c.starvation_after, c.starvation_factor * self.ctx.typical_wait)

    def prepare(self, ctx):
        self._prepare(ctx)
        self.threshold = self.starvation_threshold()
        self.cap_norm = ctx.norm(ctx.capacity)

    def key(self, w, now):
        c = self.cfg
        wait = now - w.submit_time
        if c.starvation_first and wait >= self.threshold:
            # Starving workloads go first, oldest first: this bounds the worst wait.
            return (0, 0.0, w.submit_time, w.seq)
        if c.age_mode == "tail":
            # Zero for normal waits; ramps from the starvation threshold to 1 at twice it, so
            # fair-share alone orders the bulk and age only rescues the tail.
            t = max(self.threshold, 1.0)
            age = min(max(wait - t, 0.0) / t, 1.0)
        else:
            age = min(max(wait, 0.0) / c.age_cap, 1.0)
        p = self.f[w.user] + c.weight_age * age
        if c.weight_size:
            p += c.weight_size * (1.0 - self.ctx.norm(w.total) / max(self.ctx.norm(self.ctx.capacity), 1e-12))
        return (1, -p, w.submit_time, w.seq)

    def on_admit(self, w, ctx):
        if not self.cfg.current_weight:
            return False
        self.held[w.user] += ctx.norm(w.total) / max(ctx.norm(ctx.capacity), 1e-12)
        self.f[w.user] = self._factor(w.user)
        return True

    def is_starving(self, w, now):
        # Wait first: it is the cheap test, and almost every head fails it.
        return (now - w.submit_time >= self.threshold
                and self.ctx.norm(w.total) >= self.cfg.reserve_min_fraction * self.cap_norm)


POLICIES = {"fifo": Fifo, "static-priority": StaticPriority, "drf": Drf, "slurm-fairshare": SlurmFairShare,
            "kueue-afs": KueueAfs, "fairshare": FairShare}


def make_policy(name: str, cfg: FairShareConfig | None = None) -> Policy:
    if name not in POLICIES:
        from .errors import SchedulerConfigError

        raise SchedulerConfigError([f"policy: unknown policy {name!r}; known: {', '.join(POLICIES)}"])
    return FairShare(cfg) if name == "fairshare" else POLICIES[name]()

