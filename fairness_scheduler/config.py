"""Typed scheduler configuration: defaults, then validation that reports every bad field.

Example (YAML)::

    half_life: 7d
    policy: fairshare
    placement: binpack
    fairshare: {weight_fairshare: 1000, weight_age: 1000, age_cap: 3d, starvation_after: 12h,
                oversize_reserve_after: 14d}
    users:
      - {name: alice, shares: 2, priority: 3, gpu_quota: 16}
      - {name: bob}
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from kfp_pytorch.components.errors import unknown_field

from .errors import SchedulerConfigError
from .model import UserConfig, placement_problem
from .usage import parse_duration


@dataclass
class FairShareConfig:
    """Weights and thresholds of our ``fairshare`` policy (factors are in [0, 1]).

    The weights and thresholds are the best found on the itp-2021 traces over user-assignment
    seeds 0-2; the age shape was then chosen on seeds 3-5 and confirmed on 6-11, which no setting
    had been tuned on, and the large-gang wait on the traces cut in half (new job mixes; see
    ``fairness_scheduler/TUNING.md``)."""

    weight_fairshare: float = 1000.0
    """Weight of the fair-share factor F (usage against shares)."""
    weight_age: float = 1000.0
    """Weight of the age factor A = min(wait / age_cap, 1) ** age_exponent."""
    weight_priority: float = 10.0
    """Weight of the static tier T: a tie-breaker between users of similar usage. Kept far below
    the fair-share weight on purpose: on the itp-2021 traces a tier weight of 5% of the
    fair-share weight already cost up to 0.03 of Jain's index (heavy users rank highest there)."""
    weight_size: float = 0.0
    """Weight of the size factor Z (favour small gangs); off by default."""
    age_cap: float = 7 * 86400.0
    """Seconds of wait at which A reaches 1 (Slurm's PriorityMaxAge default: 7 days), unless
    ``age_cap_typical_waits`` typical waits are longer."""
    age_cap_typical_waits: float = 10.0
    """The age cap stretches to this many current typical waits when they are longer than
    ``age_cap``: in a backlog where every job waits days, a fixed 7-day age saturates and swamps
    fair share, and the order decays towards FIFO. In a calm cluster (typical wait under 17 h) it
    changes nothing. The worst wait is then bounded by the starvation rule, which every workload
    is under (``starve_min_fraction``). At load 1.0 (protocol otherwise) every goal is met in
    13 of 48 runs instead of 6, and at Zipf 0.8 in 7 instead of 3; at the protocol defaults the
    same as before, within the noise (TUNING.md). 0: the fixed cap."""
    age_exponent: float = 0.5
    """Shape of the age factor: 1 is Slurm's linear age; below 1 age rises fastest in the first
    hours of a wait, so a job that has waited a while is no longer overtaken by every fresh job of
    a user slightly below it in fair share, while fair share still orders the long-waiting backlog.
    0.5 met every goal in 25 of 48 runs on user draws never used while tuning (seeds 6-11),
    against 15 for linear age (TUNING.md)."""
    current_weight: float = 0.0
    """Blend of current allocation into effective usage (0: history only, as Slurm; 1: DRF-like).
    Off by default: with protection and defragmentation in place, history alone scored best
    (over 8 traces x 3 seeds, 14 runs meet every goal; 11 with 0.05, 12 with 0.1)."""
    fairshare_mode: str = "classic"
    """``classic`` (Slurm 2^(-U/S)), ``ratio`` (S/(S+U)) or ``fairtree`` (Slurm's Fair Tree: rank of
    S/U among users, over n); see :mod:`.policy`."""
    starvation_after: float = 86400.0
    """Floor of the starvation threshold (seconds): no workload is starving before this."""
    starvation_factor: float = 4.0
    """The starvation threshold is this many times the current typical wait (decayed mean wait of
    recently started workloads), and at least ``starvation_after``. Relative, so it adapts to
    load: in a calm cluster a day is long, in a flooded one it is not."""
    typical_wait_half_life: float = 86400.0
    """Half-life (seconds) of the decayed mean behind the typical wait."""
    large_gang_wait_factor: float = 3.0
    """A gang that a reservation may drain nodes for (within ``reserve_cap``) is starving only once
    it has also waited this many *large-gang* typical waits (the decayed mean wait of recently
    started gangs of ``reserve_min_fraction`` or more), counted up to ``large_gang_wait_ceiling``.
    Where large gangs queue behind one another anyway, a drain for one only reorders them and the
    many smaller jobs behind pay for it in JCT; a gang is stalled when it waits far longer than
    gangs of its kind do. Gangs above the cap never drain, so the plain threshold stays theirs.
    On the itp-2021 traces cut in half (job mixes no setting was tuned on) this cut the misses of
    the JCT goal from 10 to 8 of 64 runs and of the worst-wait goal on the full traces from 8 to 6
    of 48 (TUNING.md). 0: off."""
    starvation_slowdown: float = 5.0
    """A workload is starving only once it has also waited this many times its estimated run
    time (the user's history for its size; see :class:`.usage.RuntimeHistory`), counted up to
    ``starvation_slowdown_ceiling``: its expansion factor ``(wait + run) / run``, which Maui and
    Moab rank by, has passed ``1 + starvation_slowdown``. A multi-day run that has waited a day
    is not starved; an hour-long job that has is. On the itp-2021 traces the heaviest users'
    multi-day runs had been jumping the fair order after one day (cluster07: 22 % of the
    GPU-hours), which over-served them. Over 640 runs (full traces at 24 user draws, halves at
    12, thirds and middles at 8) every goal is met in 231 instead of 221, and on the full traces
    in 97 of 192 instead of 86 (factors 4-6 give 91-97); Jain's index misses fall from 236 to
    187, worst-wait misses rise from 104 to 135, most of them ones no fair baseline meets either
    (TUNING.md). Without history (a new cluster) it does not apply. 0: off."""
    starvation_slowdown_ceiling: float = 7 * 86400.0
    """The run-time term never raises the starvation threshold above this (seconds), so long
    runs keep a bounded wait."""
    large_gang_wait_half_life: float = 7 * 86400.0
    """Half-life (seconds) of the large-gang typical wait: large gangs are rare, so it remembers
    longer than the typical wait of all workloads."""
    large_gang_wait_ceiling: float = 7 * 86400.0
    """The large-gang term never raises the threshold above this (seconds), so every gang within
    the reservation cap keeps a bounded wait even where large gangs' waits keep growing."""
    reserve_min_fraction: float = 0.25
    """Gangs asking for at least this fraction of the cluster are *large*: their waits make the
    large-gang typical wait (``large_gang_wait_factor``). Greedy backfill starves them, as they
    need many nodes empty at once, which it almost never leaves."""
    starve_min_fraction: float = 0.0
    """Workloads asking for at least this fraction of the cluster are starving once past the
    threshold (0: every workload). Small jobs are rarely starved by backfill, but the heavy
    users' ones can be starved by order, once the age cap stretches in a backlog
    (``age_cap_typical_waits``); the rule is their wait bound. 0.25 was the default before."""
    hard_starvation_factor: float = 4.0
    """A starving gang is *hard*-starving past this many thresholds: from then on it goes before
    protected users too, so a steady stream of light work cannot starve it."""
    protect_below_share: float = 0.75
    """Users whose effective usage is below this multiple of their share are *protected*: their
    work that fits starts before a starving gang takes or drains the cluster, until the gang is
    hard-starving. The drain is then paid for by the users above their share. 0: no protection."""
    reserve_cap: float = 0.5
    """At most this fraction of the cluster's GPUs is held by starvation reservations at once.
    A starving gang larger than that gets no reservation: it starts first as soon as it fits,
    as under every baseline, so under sustained load its wait has no bound (see
    ``oversize_reserve_after``)."""
    oversize_reserve_after: float = math.inf
    """A starving gang larger than ``reserve_cap`` may still reserve once it has waited this long
    (seconds; ``inf``/``never``: off). This bounds its wait, paid for by a drain of most of the
    cluster. Off by default: on the itp-2021 traces 64-GPU gangs on 96 GPUs wait weeks under
    FIFO too; draining for them after 7-28 days cut cluster02's worst wait from 1.41x FIFO's to
    1.10-1.38x, but light users' p95 wait went from 0.14x to 0.32-0.59x and utilization from
    0.973x to 0.91-0.95x (TUNING.md)."""
    max_reservations: int = 1
    """At most this many starving gangs hold reservations at once (oldest first), as EASY
    backfilling reserves for the head only. Workloads estimated (from run-time history) to end
    before the reservation's shadow time may still run on the reserved nodes."""
    defrag_reservations: int = 1
    """Defragmentation: at most this many blocked whole-node gangs (best priority first) get the
    nodes closest to free held for them when the free GPUs are scattered. 0: off."""
    defrag_after: float = 2.0
    """A whole-node gang may have nodes held for defragmentation once it has waited this many
    typical waits (so short fragmentation stalls cost no drain)."""


@dataclass
class SchedulerConfig:
    users: list[UserConfig] = field(default_factory=list)
    half_life: float = 7 * 86400.0
    """Half-life of decayed usage in seconds (Slurm's default: 7 days)."""
    policy: str = "fairshare"
    fairshare: FairShareConfig = field(default_factory=FairShareConfig)
    default_shares: float = 1.0
    """Shares of a user that is not listed."""
    placement: str = "binpack"
    """Node choice for pods smaller than a node: ``binpack`` (fullest node that fits) or
    ``spread`` (emptiest; kube-scheduler's default scoring). See :data:`.model.PLACEMENTS`."""

    def user(self, name: str, default: UserConfig | None = None) -> UserConfig:
        """The user as ``users`` lists it (every field: omitted ones take the config's defaults);
        a user it does not list is ``default`` (the protocol's, for a trace's drawn users) or one of
        ``default_shares`` shares at tier 1."""
        for u in self.users:
            if u.name == name:
                return u
        return default if default is not None else UserConfig(name, shares=self.default_shares)

    def unused_users(self, names) -> list[str]:
        """The users ``users`` lists that are not among ``names`` (their entries apply to nothing)."""
        present = set(names)
        return [u.name for u in self.users if u.name not in present]


FAIRSHARE_MODES = ("classic", "ratio", "fairtree")
_DURATIONS = {"half_life", "age_cap", "starvation_after", "typical_wait_half_life", "oversize_reserve_after",
              "large_gang_wait_half_life", "large_gang_wait_ceiling", "starvation_slowdown_ceiling"}
_POSITIVE = {"age_cap", "age_exponent", "typical_wait_half_life", "large_gang_wait_half_life"}
"""Fields that must be > 0 (a zero half-life has no decay rate), not merely >= 0."""
_INTEGERS = {"max_reservations", "defrag_reservations"}
_FRACTIONS = {"current_weight", "reserve_cap", "reserve_min_fraction", "starve_min_fraction"}


def _num(problems, path, value, lo=None, lo_open=False, duration=False):
    try:
        v = parse_duration(value) if duration else float(value)
    except (TypeError, ValueError):
        problems.append(f"{path}: must be a {'duration like 7d, 12h, 1d12h or seconds' if duration else 'number'}, got {value!r}")
        return None
    if math.isnan(v):
        problems.append(f"{path}: must be a number, got NaN")
        return None
    if lo is not None and (v <= lo if lo_open else v < lo):
        problems.append(f"{path}: must be {'>' if lo_open else '>='} {lo:g}, got {value!r}")
        return None
    return v


def load_config(data: dict | None) -> SchedulerConfig:
    """Build and validate; raises SchedulerConfigError listing *every* problem with its path."""
    from .policy import POLICIES

    if data is not None and not isinstance(data, dict):
        raise SchedulerConfigError([f"(top level): must be a mapping of fields, got {type(data).__name__}"],
                                   "a scheduler config is a YAML mapping: users, half_life, policy, fairshare, ...")
    data = dict(data or {})
    problems: list[str] = []
    cfg = SchedulerConfig()
    known = {f.name for f in fields(SchedulerConfig)}
    for k in data:
        if k not in known:
            problems.append(unknown_field(str(k), k, known))
    if "half_life" in data:
        v = _num(problems, "half_life", data["half_life"], 0, lo_open=True, duration=True)
        if v is not None:
            cfg.half_life = v
    if "policy" in data:
        if data["policy"] not in POLICIES:
            problems.append(f"policy: must be one of {', '.join(POLICIES)}, got {data['policy']!r}")
        else:
            cfg.policy = data["policy"]
    if "placement" in data:
        problem = placement_problem(data["placement"])
        if problem:
            problems.append(problem)
        else:
            cfg.placement = data["placement"]
    if "default_shares" in data:
        v = _num(problems, "default_shares", data["default_shares"], 0, lo_open=True)
        if v is not None:
            cfg.default_shares = v
    fs = data.get("fairshare") or {}
    if not isinstance(fs, dict):
        problems.append(f"fairshare: must be a mapping, got {type(fs).__name__}")
        fs = {}
    fs_known = {f.name for f in fields(FairShareConfig)}
    for k, value in fs.items():
        path = f"fairshare.{k}"
        if k not in fs_known:
            problems.append(unknown_field(path, k, fs_known))
        elif k == "fairshare_mode":
            if value not in FAIRSHARE_MODES:
                problems.append(f"{path}: must be one of {', '.join(FAIRSHARE_MODES)}, got {value!r}")
            else:
                cfg.fairshare.fairshare_mode = value
        elif k in _INTEGERS:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                problems.append(f"{path}: must be an integer >= 0, got {value!r}")
            else:
                setattr(cfg.fairshare, k, value)
        else:
            v = _num(problems, path, value, 0, lo_open=k in _POSITIVE, duration=k in _DURATIONS)
            if v is not None:
                if k in _FRACTIONS and v > 1:
                    problems.append(f"{path}: must be in [0, 1], got {value!r}")
                else:
                    setattr(cfg.fairshare, k, v)
    users = data.get("users") or []
    if not isinstance(users, list):
        problems.append(f"users: must be a list, got {type(users).__name__}")
        users = []
    seen = set()
    for i, u in enumerate(users):
        path = f"users[{i}]"
        if not isinstance(u, dict):
            problems.append(f"{path}: must be a mapping with name, shares, priority, gpu_quota")
            continue
        name = u.get("name")
        if not name or not isinstance(name, str):
            problems.append(f"{path}.name: must be a non-empty string, got {name!r}")
        elif name in seen:
            problems.append(f"{path}.name: duplicate user {name!r}")
        seen.add(name)
        for k in u:
            if k not in ("name", "shares", "priority", "gpu_quota"):
                problems.append(unknown_field(f"{path}.{k}", k, ("name", "shares", "priority", "gpu_quota")))
        shares = _num(problems, f"{path}.shares", u.get("shares", cfg.default_shares), 0, lo_open=True)
        prio = u.get("priority", 1)
        if not isinstance(prio, int) or isinstance(prio, bool):
            problems.append(f"{path}.priority: must be an integer, got {prio!r}")
        quota = u.get("gpu_quota")
        if quota is not None:
            quota = _num(problems, f"{path}.gpu_quota", quota, 0)
        if isinstance(name, str) and shares is not None and isinstance(prio, int):
            cfg.users.append(UserConfig(name, shares, prio, quota))
    if problems:
        raise SchedulerConfigError(problems)
    return cfg
