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

Fair-share factor alternatives (``fairshare_mode`` in config):

- ``classic``: Slurm's ``2^(-U/S)`` (the default);
- ``ratio``: ``S / (S + U)`` (Kueue-like, never saturates);
- ``fairtree``: Slurm's Fair Tree (its default since 19.05) for a flat tree of users: users are
  ranked by level fair share ``S / U`` (infinite without usage; ties share a rank) and the factor
  is ``rank / n``, so it depends only on the order of users, never on how far apart they are.
  Ranks are recomputed once per cycle, as Slurm does once per ``PriorityCalcPeriod``.
  On the itp-2021 traces it scored below ``classic`` (TUNING.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .config import FairShareConfig
from .model import Resources, UserConfig, Workload
from .usage import RuntimeHistory

WEEK = 7 * 86400.0


@dataclass
class UserState:
    """What a policy may know about a user at a point in time."""

    config: UserConfig
    usage: Resources = field(default_factory=Resources)
    """Decayed usage in GPU-s, CPU-s and GB-s. A caller that keeps usage as floats (the simulator)
    leaves this unset and fills ``CycleContext.usage_norm``: read it through
    ``CycleContext.normalised_usage()``."""
    held: Resources = field(default_factory=Resources)
    """Resources currently held by the user's running workloads."""
    penalty: float = 0.0
    """Kueue entry penalty (capacity-normalised), decays like usage."""


@dataclass
class CycleContext:
    """Everything a policy may read during one scheduling cycle."""

    now: float
    users: dict[str, UserState]
    capacity: Resources
    """Total allocatable resources of the cluster (normalises usage and shares)."""
    runtimes: RuntimeHistory = field(default_factory=RuntimeHistory)
    """Run-time estimates from finished workloads (by user and gang size)."""
    typical_wait: float = 0.0
    """Decayed mean wait of recently started workloads (seconds): the current regime's normal
    wait, against which a starving workload is recognised."""
    large_gang_wait: float = 0.0
    """Decayed mean wait of recently started large gangs (``reserve_min_fraction`` of the cluster
    or more; seconds): how long gangs of that kind normally wait."""
    usage_norm: dict[str, float] | None = None
    """Each user's decayed usage already capacity-normalised, when the caller keeps usage that
    way (the simulator: one float per user, so no ``Resources`` per user and cycle); None: policies
    compute it from ``users[u].usage``. Policies read usage through :meth:`normalised_usage`."""

    def __post_init__(self):
        c = self.capacity
        self._inv = (1.0 / c.gpu if c.gpu else 0.0, 1.0 / c.cpu if c.cpu else 0.0,
                     1.0 / c.memory_gb if c.memory_gb else 0.0)

    def normalised_usage(self) -> dict[str, float]:
        """Each user's decayed usage as ``norm(usage)``: ``usage_norm`` when the caller keeps it,
        else computed from ``users``."""
        if self.usage_norm is not None:
            return self.usage_norm
        ig, ic, im = self._inv  # norm() inlined: this runs every cycle, for every user
        return {u: (r := s.usage).gpu * ig + r.cpu * ic + r.memory_gb * im for u, s in self.users.items()}

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
    """False for policies that never read users' decayed usage or entry penalty (the caller may
    skip keeping them)."""
    reads_held = True
    """False for policies that never read users' current allocation (``UserState.held``)."""
    reads_history = True
    """False for policies that never read run-time history or typical waits (``CycleContext``'s
    ``runtimes``, ``typical_wait`` and ``large_gang_wait``) and never reserve nodes."""

    def prepare(self, ctx: CycleContext) -> None:
        self.ctx = ctx

    def key(self, w: Workload, now: float) -> tuple:
        raise NotImplementedError

    def on_admit(self, w: Workload, ctx: CycleContext) -> bool:
        return False

    def is_starving(self, w: Workload, now: float) -> bool:
        """Start first, or reserve nodes for, this (queue-head) workload."""
        return False

    def starving_after(self) -> float:
        """No workload is starving before it has waited this long (seconds; set by ``prepare``)."""
        return math.inf

    def is_hard_starving(self, w: Workload, now: float) -> bool:
        """A starving workload that goes before everything, protected users included."""
        return True

    def is_protected(self, user: str) -> bool:
        """Users whose work may still start before a starving (not hard-starving) gang."""
        return False

    def oversize_reserve_in(self, w: Workload, now: float) -> float:
        """Seconds until this starving workload, larger than the reservation cap, may reserve all
        the same (<= 0: now; inf: never)."""
        return math.inf

    def wants_defrag(self, w: Workload, now: float) -> bool:
        """May this blocked whole-node workload have nodes held for it to defragment?"""
        return False


class Fifo(Policy):
    name = "fifo"
    reads_history = False
    reads_usage = False
    reads_held = False

    def key(self, w, now):
        return (w.submit_time, w.seq)


class StaticPriority(Policy):
    name = "static-priority"
    reads_history = False
    reads_usage = False
    reads_held = False

    def key(self, w, now):
        return (-self.ctx.users[w.user].config.priority, w.submit_time, w.seq)


class Drf(Policy):
    """Lowest dominant share first, recomputed after every admission (classic DRF progressive filling)."""

    name = "drf"
    reads_history = False
    reads_usage = False  # the current allocation only

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


def _usage_fractions(ctx: CycleContext) -> dict[str, float]:
    """U per user: the user's share of all decayed usage."""
    norm = ctx.normalised_usage()
    total_u = sum(norm.values())
    return {u: (v / total_u if total_u > 0 else 0.0) for u, v in norm.items()}


def _normalised_shares(ctx: CycleContext) -> dict[str, float]:
    """S per user: the user's shares over everyone's."""
    total_s = sum(s.config.shares for s in ctx.users.values())
    return {u: s.config.shares / total_s for u, s in ctx.users.items()}



class SlurmFairShare(Policy):
    """``1000 * 2^(-U/S) + 1000 * min(wait / 7d, 1)``, highest first."""

    name = "slurm-fairshare"
    reads_history = False
    reads_held = False  # decayed usage only

    def prepare(self, ctx):
        super().prepare(ctx)
        usage, shares = _usage_fractions(ctx), _normalised_shares(ctx)
        self.f = {u: 1000.0 * 2.0 ** (-usage[u] / shares[u]) for u in ctx.users}

    def key(self, w, now):
        wait = now - w.submit_time  # A = min(max(wait, 0) / 7d, 1), without the builtins' calls
        age = wait / WEEK if wait > 0.0 else 0.0
        if age > 1.0:
            age = 1.0
        return (-(self.f[w.user] + 1000.0 * age), w.submit_time, w.seq)


class KueueAfs(Policy):
    """(decayed usage + entry penalty) / weight, lowest first; the penalty grows on admission."""

    name = "kueue-afs"
    reads_history = False
    reads_held = False  # decayed usage only

    def __init__(self, penalty_seconds: float = 300.0):
        self.penalty_seconds = penalty_seconds
        """Kueue's entry penalty: the admitted requests times the usage sampling interval (5 min)."""

    def prepare(self, ctx):
        super().prepare(ctx)
        usage = ctx.normalised_usage()
        self.score = {u: (usage[u] + s.penalty) / s.config.shares for u, s in ctx.users.items()}

    def key(self, w, now):
        return (self.score[w.user], w.submit_time, w.seq)

    def on_admit(self, w, ctx):
        s = ctx.users[w.user]
        self.score[w.user] += ctx.norm(w.total) * self.penalty_seconds / s.config.shares
        return True


class FairShare(Policy):
    """Ours: a weighted sum of factors in [0, 1], and a starvation guarantee that light users
    do not pay for.

    Ordering: ``P = w_fs * F + w_age * A + w_prio * T + w_size * Z``, highest first, where

    - ``F`` is the fair-share factor of the user's *effective usage*: the decayed history (the
      thesis: who used a lot lately yields), optionally blended with the current allocation
      (``current_weight``: a user who just flooded the cluster yields before history catches up);
    - ``A = min(wait / cap, 1) ** age_exponent`` grows with the workload's own wait, fastest
      at first (square root by default; 1 is Slurm's linear age); ``cap`` is ``age_cap`` or, in
      a backlog, ``age_cap_typical_waits`` typical waits, so age does not saturate for every job
      at once;
    - ``T`` maps the user's static tier onto [0, 1];
    - ``Z = 1 - size / capacity`` optionally favours small gangs (off by default).

    Starvation (carried out by :func:`.admission.admit`): greedy backfill never leaves many nodes
    empty at once, so a large gang may wait for ever, and a heavy user's small job may wait long
    behind fair share. A workload (of ``starve_min_fraction`` of the cluster or more; by default
    any) that has waited ``threshold``
    (a multiple of the current typical wait, at least ``starvation_after``; for a gang within
    ``reserve_cap`` also a multiple of large gangs' own typical wait, up to
    ``large_gang_wait_ceiling``; and ``starvation_slowdown`` times its estimated run time, up to
    ``starvation_slowdown_ceiling``, so long runs wait in proportion) is *starving*: it
    starts first if it fits, else the nodes closest to fitting it are reserved and drain (EASY
    backfilling with history estimates). Until it is *hard*-starving (``hard_starvation_factor``
    thresholds), *protected* users (effective usage below ``protect_below_share`` of their share:
    the light users) still start work before it, so the drain is paid for by the heavy users.

    Defragmentation: a whole-node gang that has waited ``defrag_after`` typical waits while the
    free GPUs are scattered gets the nodes closest to free held for it, so whole nodes appear.
    """

    name = "fairshare"
    reserves = True

    def __init__(self, cfg: FairShareConfig | None = None):
        self.cfg = cfg or FairShareConfig()
        self._users: tuple[list[str], list[UserConfig]] | None = None
        """The users (names, configs) that ``shares`` and ``tier`` were computed for."""

    def prepare(self, ctx):
        super().prepare(ctx)
        c = self.cfg
        users = (list(ctx.users), [s.config for s in ctx.users.values()])
        if users != self._users:  # users' shares and tiers: recomputed only when they change
            self._users = users
            self.shares = _normalised_shares(ctx)
            tiers = [uc.priority for uc in users[1]] or [1]
            lo, hi = min(tiers), max(tiers)
            self.tier = {u: (uc.priority - lo) / (hi - lo) if hi > lo else 0.0 for u, uc in zip(*users)}
            """T per user, in [0, 1]."""
        self.usage_hist = _usage_fractions(ctx)
        self.cap_norm = cap = max(ctx.norm(ctx.capacity), 1e-12)
        ig, ic, im = ctx._inv  # ctx.norm inlined: this runs every cycle, for every user
        self.held = {u: ((r := s.held).gpu * ig + r.cpu * ic + r.memory_gb * im) / cap for u, s in ctx.users.items()}
        self.fs = self._fair_tree() if c.fairshare_mode == "fairtree" else self._factors()
        """F per user, in [0, 1]."""
        wf, wp, tier = c.weight_fairshare, c.weight_priority, self.tier
        self.f = {u: wf * f + wp * tier[u] for u, f in self.fs.items()}
        """The user's part of P: ``w_fs * F + w_prio * T`` (age and size are the workload's)."""
        self._age_weight, self._age_exponent = c.weight_age, c.age_exponent
        self.threshold = max(c.starvation_after, c.starvation_factor * ctx.typical_wait)
        # Gangs a reservation may hold nodes for also wait out their own kind's typical wait
        # (bounded by the ceiling): their starvation costs a drain. Gangs above the cap never drain.
        self.drain_threshold = max(self.threshold, min(c.large_gang_wait_factor * ctx.large_gang_wait,
                                                       c.large_gang_wait_ceiling))
        self.reservable = c.reserve_cap * self.cap_norm + 1e-12
        # In a backlog the age cap stretches with the typical wait, so age does not saturate
        # for every job at once and leave fair share (the thesis' factor) to break ties only.
        self.age_cap = max(c.age_cap, c.age_cap_typical_waits * ctx.typical_wait)
        self.starve_from = c.starve_min_fraction * self.cap_norm

    def effective_usage(self, u: str) -> float:
        c = self.cfg
        return (1.0 - c.current_weight) * self.usage_hist[u] + c.current_weight * self.held[u]

    def _user_part(self, u: str) -> float:
        return self.cfg.weight_fairshare * self.fs[u] + self.cfg.weight_priority * self.tier[u]

    def _factor(self, u: str) -> float:
        """F of ``classic`` and ``ratio``, in [0, 1]."""
        eff, s = self.effective_usage(u), self.shares[u]
        return s / (s + eff) if self.cfg.fairshare_mode == "ratio" else 2.0 ** (-eff / s)

    def _factors(self) -> dict[str, float]:
        """:meth:`_factor` of every user in one loop (the same arithmetic; it runs every cycle)."""
        c = self.cfg
        a, b, ratio = 1.0 - c.current_weight, c.current_weight, c.fairshare_mode == "ratio"
        hist, held, shares = self.usage_hist, self.held, self.shares
        fs = {}
        for u, s in shares.items():
            eff = a * hist[u] + b * held[u]
            fs[u] = s / (s + eff) if ratio else 2.0 ** (-eff / s)
        return fs

    def _fair_tree(self) -> dict[str, float]:
        """Slurm Fair Tree on a flat tree: rank by level fair share S/U, factor rank/n (ties equal)."""
        level = {}
        for u, s in self.shares.items():
            eff = self.effective_usage(u)
            level[u] = s / eff if eff > 0 else math.inf
        ordered = sorted(level.values(), reverse=True)
        n = len(ordered)
        first = {}
        for i, v in enumerate(ordered):
            first.setdefault(v, i)  # tied users take the rank of the first of them
        return {u: (n - first[level[u]]) / n for u in level}

    def key(self, w, now):
        wait = now - w.submit_time  # A = min(max(wait, 0) / cap, 1), without the builtins' calls
        age = wait / self.age_cap if wait > 0.0 else 0.0
        if age > 1.0:
            age = 1.0
        p = self.f[w.user] + self._age_weight * age ** self._age_exponent
        if self.cfg.weight_size:
            p += self.cfg.weight_size * (1.0 - self.ctx.norm(w.total) / self.cap_norm)
        return (-p, w.submit_time, w.seq)

    def on_admit(self, w, ctx):
        if not self.cfg.current_weight or self.cfg.fairshare_mode == "fairtree":
            return False  # Fair Tree ranks every user at once: once per cycle, in prepare
        u = w.user
        self.held[u] += ctx.norm(w.total) / self.cap_norm
        self.fs[u] = self._factor(u)
        self.f[u] = self._user_part(u)
        return True

    def starving_after(self):
        return self.threshold

    def is_starving(self, w, now):
        wait = now - w.submit_time
        if wait < self.threshold:  # the cheap test first: almost every head fails it
            return False
        return (self.ctx.norm(w.total) >= self.starve_from
                and wait >= self._threshold(w))

    def is_hard_starving(self, w, now):
        return now - w.submit_time >= self.cfg.hard_starvation_factor * self._threshold(w)

    def _threshold(self, w: Workload) -> float:
        """The starvation threshold of this gang: the drain threshold if a reservation may hold it,
        and at least ``starvation_slowdown`` times its estimated run time (up to the ceiling)."""
        c = self.cfg
        base = self.drain_threshold if self.ctx.norm(w.total) <= self.reservable else self.threshold
        if c.starvation_slowdown:
            est = self.ctx.runtimes.estimate(w.user, w.gpus)
            if est is not None:
                return max(base, min(c.starvation_slowdown * est, c.starvation_slowdown_ceiling))
        return base

    def is_protected(self, user):
        return self.effective_usage(user) < self.cfg.protect_below_share * self.shares[user]

    def oversize_reserve_in(self, w, now):
        return self.cfg.oversize_reserve_after - (now - w.submit_time)

    def wants_defrag(self, w, now):
        return now - w.submit_time >= self.cfg.defrag_after * self.ctx.typical_wait


POLICIES = {"fifo": Fifo, "static-priority": StaticPriority, "drf": Drf, "slurm-fairshare": SlurmFairShare,
            "kueue-afs": KueueAfs, "fairshare": FairShare}


def make_policy(name: str, cfg: FairShareConfig | None = None) -> Policy:
    if name not in POLICIES:
        from .errors import SchedulerConfigError

        raise SchedulerConfigError([f"policy: unknown policy {name!r}; known: {', '.join(POLICIES)}"])
    return FairShare(cfg) if name == "fairshare" else POLICIES[name]()

