"""Pure policy, admission and decay: table-driven, with fluent builders."""
import math

import pytest

from kfp_pytorch.fairness_scheduler.admission import NodePool, PendingQueue, admit
from kfp_pytorch.fairness_scheduler.config import FairShareConfig
from kfp_pytorch.fairness_scheduler.errors import SchedulerConfigError
from kfp_pytorch.fairness_scheduler.model import Node, Resources, UserConfig, Workload, gang_for_gpus
from kfp_pytorch.fairness_scheduler.policy import CycleContext, UserState, make_policy
from kfp_pytorch.fairness_scheduler.usage import RuntimeHistory, accrue, decay_factor, parse_duration

DAY = 86400.0


class W:
    """Fluent workload builder: W("a").user("u").gpus(8).at(10).build()"""

    _seq = 0

    def __init__(self, name):
        self.name, self._user, self._gpus, self._t = name, "u", 1, 0.0

    def user(self, u):
        self._user = u
        return self

    def gpus(self, g):
        self._gpus = g
        return self

    def at(self, t):
        self._t = t
        return self

    def build(self):
        W._seq += 1
        return Workload(self.name, self._user, self._t, gang_for_gpus(self._gpus), seq=W._seq)


def nodes(n, gpus=8):
    return [Node(f"n{i}", Resources(gpus)) for i in range(n)]


def queue(*jobs):
    """A pending queue holding ``jobs`` in submission order."""
    q = PendingQueue()
    for j in sorted(jobs, key=lambda j: (j.submit_time, j.seq)):
        q.push(j)
    return q


def ctx(users, pool, now=0.0, usage=None, held=None, typical_wait=0.0):
    states = {}
    for u in users:
        s = UserState(u)
        s.usage = Resources((usage or {}).get(u.name, 0.0))
        s.held = Resources((held or {}).get(u.name, 0.0))
        states[u.name] = s
    return CycleContext(now, states, pool.total, typical_wait=typical_wait)


# ---- usage decay ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dt,h,expected", [(0, DAY, 1.0), (-5, DAY, 1.0), (DAY, DAY, 0.5), (2 * DAY, DAY, 0.25),
                                           (10, math.inf, 1.0)])
def test_decay_factor(dt, h, expected):
    assert decay_factor(dt, h) == pytest.approx(expected)


def test_accrue_is_exact_between_events():
    one = accrue(0.0, 4.0, 3 * DAY, 7 * DAY)
    steps = 0.0
    for _ in range(300):  # the same interval in 300 steps gives the same value: no sampling error
        steps = accrue(steps, 4.0, 3 * DAY / 300, 7 * DAY)
    assert one == pytest.approx(steps, rel=1e-12)
    assert accrue(10.0, 0.0, 7 * DAY, 7 * DAY) == pytest.approx(5.0)
    assert accrue(0.0, 2.0, 100, math.inf) == 200


@pytest.mark.parametrize("text,seconds", [("7d", 604800), ("12h", 43200), ("30m", 1800), ("45s", 45), ("90", 90),
                                          (3.5, 3.5), ("inf", math.inf), ("never", math.inf), ("2w", 1209600),
                                          ("1.5d", 129600), ("7 D", 604800),
                                          # parts in a row, as Go writes a duration (Kueue's usageHalfLifeTime)
                                          ("1d12h", 129600), ("1h30m", 5400), ("168h0m0s", 604800),
                                          ("1d 12h", 129600), ("1m30s500ms", 90.5), ("-3d", -259200), ("1e3s", 1000),
                                          ("1.5e1m", 900)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1x", "1h30", "d1", "1d-2h", "7 days"])
def test_a_duration_that_is_none_is_refused(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


# ---- ordering ------------------------------------------------------------------------------------
USERS = [UserConfig("heavy", 1, 3), UserConfig("light", 1, 1)]


def order(policy_name, jobs, usage=None, held=None, now=1000.0, cfg=None, typical_wait=0.0):
    pool = NodePool(nodes(1))
    p = make_policy(policy_name, cfg)
    p.prepare(ctx(USERS, pool, now, usage, held, typical_wait))
    return [j.name for j in sorted(jobs, key=lambda j: p.key(j, now))]


@pytest.mark.parametrize("policy,usage,held,expected", [
    ("fifo", {"heavy": 1e6}, None, ["h-old", "l-new", "h-new"]),
    ("static-priority", None, None, ["h-old", "h-new", "l-new"]),
    ("drf", None, {"heavy": 4}, ["l-new", "h-old", "h-new"]),
    ("slurm-fairshare", {"heavy": 1e6, "light": 1e3}, None, ["l-new", "h-old", "h-new"]),
    ("kueue-afs", {"heavy": 1e6, "light": 1e3}, None, ["l-new", "h-old", "h-new"]),
    ("fairshare", {"heavy": 1e6, "light": 1e3}, {"heavy": 4}, ["l-new", "h-old", "h-new"]),
])
def test_policy_orders(policy, usage, held, expected):
    jobs = [W("h-old").user("heavy").at(0).build(), W("l-new").user("light").at(500).build(),
            W("h-new").user("heavy").at(600).build()]
    assert order(policy, jobs, usage, held) == expected


def test_age_rises_fastest_early_unless_linear_is_asked_for():
    """Fair share puts light ~270 points above heavy. After a day, square-root age (378 of 1000
    points) lifts heavy's job above a fresh light job; Slurm's linear age (143) does not."""
    jobs = [W("h-day-old").user("heavy").at(0).build(), W("l-fresh").user("light").at(86400).build()]
    usage = {"heavy": 0.7, "light": 0.3}
    assert order("fairshare", jobs, usage, now=86400.0) == ["h-day-old", "l-fresh"]
    linear = FairShareConfig(age_exponent=1.0)
    assert order("fairshare", jobs, usage, now=86400.0, cfg=linear) == ["l-fresh", "h-day-old"]
    assert order("slurm-fairshare", jobs, usage, now=86400.0) == ["l-fresh", "h-day-old"]


def test_age_cap_stretches_with_the_typical_wait_in_a_backlog():
    """Above, in a calm cluster, a day of wait lifts heavy's job over a fresh light one. Where jobs
    typically wait 2 days, the cap is 10 typical waits (20 days): a day is worth sqrt(1/20) of the
    age weight (224 points, not 378), and fair share decides again. Typical waits of 12 h leave the
    7-day cap as it is; ``age_cap_typical_waits: 0`` keeps it fixed."""
    jobs = [W("h-day-old").user("heavy").at(0).build(), W("l-fresh").user("light").at(86400).build()]
    usage = {"heavy": 0.7, "light": 0.3}
    assert order("fairshare", jobs, usage, now=86400.0, typical_wait=2 * DAY) == ["l-fresh", "h-day-old"]
    assert order("fairshare", jobs, usage, now=86400.0, typical_wait=DAY / 2) == ["h-day-old", "l-fresh"]
    fixed = FairShareConfig(age_cap_typical_waits=0)
    assert order("fairshare", jobs, usage, now=86400.0, cfg=fixed, typical_wait=2 * DAY) == ["h-day-old", "l-fresh"]


def test_every_workload_may_starve_unless_a_minimum_size_is_set():
    """With the age cap stretched in a backlog, the starvation rule bounds every job's wait, not only
    large gangs': a heavy user's 1-GPU job past the threshold (max(1 d, 4 typical waits)) is starving."""
    c = ctx(USERS, NodePool(nodes(4)), now=3 * DAY)
    one_gpu, gang = W("one").user("heavy").gpus(1).at(0).build(), W("gang").user("heavy").gpus(16).at(0).build()
    p = make_policy("fairshare")
    p.prepare(c)
    assert p.is_starving(one_gpu, 3 * DAY) and not p.is_starving(one_gpu, DAY / 2)
    big_only = make_policy("fairshare", FairShareConfig(starve_min_fraction=0.25))
    big_only.prepare(c)
    assert not big_only.is_starving(one_gpu, 3 * DAY) and big_only.is_starving(gang, 3 * DAY)


def test_fair_tree_ranks_users_by_level_fair_share():
    """Slurm Fair Tree, flat: rank by S/U (no usage: infinite, ties share the rank), factor rank/n.
    The factor depends on the order of users only: 2x and 1000x the usage of the next user rank alike."""
    users = [UserConfig("idle", 1), UserConfig("idle2", 1), UserConfig("mid", 2), UserConfig("big", 1),
             UserConfig("huge", 1)]
    pool = NodePool(nodes(1))
    cfg = FairShareConfig(fairshare_mode="fairtree", weight_priority=0)
    p = make_policy("fairshare", cfg)
    p.prepare(ctx(users, pool, 0.0, {"mid": 4.0, "big": 2.0, "huge": 2000.0}))
    # S/U: idle and idle2 infinite; mid (2 shares, usage 4) ties with big (1 share, usage 2); huge last.
    assert p.f == pytest.approx({"idle": 1000.0, "idle2": 1000.0, "mid": 600.0, "big": 600.0, "huge": 200.0})
    jobs = [W("h").user("huge").at(0).build(), W("b").user("big").at(10).build(), W("i").user("idle").at(20).build()]
    assert [j.name for j in sorted(jobs, key=lambda j: p.key(j, 20.0))] == ["i", "b", "h"]
    p.prepare(ctx(users, pool, 0.0, {"mid": 4.0, "big": 2.0, "huge": 4.0}))
    assert p.f["huge"] == pytest.approx(200.0)  # twice big's usage, not a thousand times: same rank


def test_ties_break_by_submit_then_arrival():
    a, b = W("a").user("light").at(5).build(), W("b").user("light").at(5).build()
    assert order("fairshare", [b, a]) == ["a", "b"]  # same submit time: arrival sequence


def test_static_priority_weight_matters_but_stays_below_fair_share():
    cfg = FairShareConfig(weight_priority=100, weight_age=0, current_weight=0)
    jobs = [W("h").user("heavy").at(0).build(), W("l").user("light").at(0).build()]
    assert order("fairshare", jobs, {"heavy": 1, "light": 1}, cfg=cfg) == ["h", "l"]  # equal usage: tier decides
    assert order("fairshare", jobs, {"heavy": 1e6, "light": 1}, cfg=cfg) == ["l", "h"]  # usage dominates


def test_a_changed_share_or_tier_counts_from_the_next_cycle():
    """The policy keeps users' shares and tiers between cycles; a change of config must count."""
    pool = NodePool(nodes(1))
    c = ctx([UserConfig("a", 1.0, 1), UserConfig("b", 1.0, 1)], pool, usage={"a": 1e5, "b": 1e5})
    p = make_policy("fairshare", FairShareConfig(weight_age=0))
    jobs = [W("ja").user("a").at(0).build(), W("jb").user("b").at(1).build()]
    p.prepare(c)
    assert sorted(jobs, key=lambda w: p.key(w, 10.0))[0].name == "ja"  # equal: the older job
    c.users["b"].config = UserConfig("b", 4.0, 1)  # b's share grows: its usage weighs less
    p.prepare(c)
    assert sorted(jobs, key=lambda w: p.key(w, 10.0))[0].name == "jb"
    c.users["a"].config = UserConfig("a", 4.0, 3)  # a back on par, and a higher tier
    p.prepare(c)
    assert sorted(jobs, key=lambda w: p.key(w, 10.0))[0].name == "ja" and p.tier == {"a": 1.0, "b": 0.0}


# ---- admission -----------------------------------------------------------------------------------
def run_cycle(jobs, n_nodes=2, policy="fifo", now=0.0, cfg=None, users=None, **kw):
    users = users or [UserConfig(u) for u in sorted({j.user for j in jobs})]
    pool = NodePool(nodes(n_nodes))
    q = queue(*jobs)
    p = make_policy(policy, cfg)
    res = admit(q, pool, p, ctx(users, pool, now, typical_wait=kw.pop("typical_wait", 0.0)), **kw)
    return res, pool, q


def test_gangs_start_only_entirely():
    res, pool, q = run_cycle([W("big").gpus(24).build(), W("small").gpus(4).at(1).build()], n_nodes=2)
    assert [w.name for w, _ in res.started] == ["small"]  # 24 GPUs need 3 whole nodes: never half
    assert "needs 3 free nodes" in res.pending_reasons["big"]


def test_whole_nodes_for_8_gpu_pods_and_best_fit_for_small():
    jobs = [W("a").gpus(4).build(), W("b").gpus(2).at(1).build(), W("c").gpus(8).at(2).build(),
            W("d").gpus(4).at(3).build()]
    res, pool, q = run_cycle(jobs, n_nodes=2)
    placed = {w.name: p for w, p in res.started}
    assert placed["a"] == placed["b"] == [0]  # best fit packs the small pods on one node
    assert placed["c"] == [1]  # the 8-GPU pod takes the free node whole
    assert "d" not in placed  # 2 GPUs left on node 0: d waits, it is not split
    assert pool.free[0].gpu == 2 and pool.free[1].gpu == 0


def test_spread_takes_the_emptiest_node_and_unknown_placements_are_refused():
    pool = NodePool(nodes(3), placement="spread")
    pool.allocate(W("x").gpus(2).build(), [1])
    small = W("s").gpus(2).build()
    assert pool.place(small) == [0]  # nodes 0 and 2 are empty: lowest index; binpack would pick 1
    packed = NodePool(nodes(3))
    packed.allocate(W("x").gpus(2).build(), [1])
    assert packed.place(small) == [1]
    assert pool.place(W("big").gpus(16).build()) == [0, 2]  # whole-node pods: whole free nodes either way
    with pytest.raises(SchedulerConfigError, match="placement: must be one of binpack, spread, got 'worst'"):
        NodePool(nodes(1), placement="worst")


def test_greedy_backfill_behind_a_blocked_head():
    pool = NodePool(nodes(2))
    pool.allocate(W("running").gpus(4).build(), [0])
    q = queue(W("head").gpus(16).build(), W("s1").gpus(1).at(1).build(), W("s2").gpus(1).at(2).build())
    res = admit(q, pool, make_policy("fifo"), ctx([UserConfig("u")], pool))
    assert {w.name: p for w, p in res.started} == {"s1": [0], "s2": [0]}  # fill node 0 (best fit)
    assert len(q) == 1 and "needs 2 free nodes" in res.pending_reasons["head"]


def test_pending_reasons_describe_the_state_the_cycle_leaves():
    """Every head that stays pending says why, in terms of the cluster after the cycle."""
    pool = NodePool([Node("n0", Resources(8, 16, 64)), Node("n1", Resources(8, 16, 64))])
    pool.allocate(W("running").gpus(5).build(), [0])
    q = queue(W("fills").gpus(3).build(), Workload("four", "u", 1.0, (Resources(4, 8, 8),), seq=10_001),
              Workload("cpu-hungry", "u", 2.0, (Resources(2, 12, 8),), seq=10_000),
              W("gang").gpus(24).at(3).build())
    res = admit(q, pool, make_policy("fifo"), ctx([UserConfig("u")], pool))
    assert [w.name for w, _ in res.started] == ["fills", "four"]  # node 0 full, node 1 holds 4
    reasons = res.pending_reasons
    assert reasons["cpu-hungry"] == "waiting for 2 GPUs with 12 CPUs and 8 GB of memory free on one node"
    assert reasons["gang"] == "gang of 3 pods needs 3 free nodes (free now: 0)"
    pool.allocate(W("more").gpus(4).build(), [1])
    res = admit(q, pool, make_policy("fifo"), ctx([UserConfig("u")], pool))
    assert res.started == [] and set(res.pending_reasons.values()) == {"cluster full: no free GPUs"}


def test_starving_gang_gets_a_reservation_and_backfill_avoids_it():
    users = [UserConfig("u")]
    pool = NodePool(nodes(3))
    pool.allocate(W("r0").gpus(4).build(), [0])
    pool.allocate(W("r1").gpus(4).build(), [1])
    big = W("big").gpus(16).at(0).build()
    smalls = [W(f"s{i}").gpus(2).at(10 + i).build() for i in range(4)]
    q = queue(big, *smalls)
    cfg = FairShareConfig(starvation_after=100, starvation_factor=0)
    res = admit(q, pool, make_policy("fairshare", cfg), ctx(users, pool, now=1000.0), reserve_cap=1.0)
    [(w, reserved)] = res.reservations
    assert w is big and sorted(reserved) == [0, 2]  # the two emptiest nodes drain for the gang
    started = {x.name: p for x, p in res.started}
    assert set(started) == {"s0", "s1"} and all(p == [1] for p in started.values())  # backfill elsewhere only
    assert "reserved" in res.pending_reasons["big"]


@pytest.mark.parametrize("large_gang_wait, ceiling, reserves", [
    (0.0, 14 * DAY, True),  # no large gang has started yet: the 100 s floor alone
    (200.0, 14 * DAY, True),  # gangs like it wait 200 s: 1000 s is past 3x that
    (1000.0, 14 * DAY, False),  # they wait 1000 s: this one is not stalled yet (threshold 3000 s)
    (1000.0, 500.0, True),  # ... but the ceiling keeps the threshold at 500 s
])
def test_large_gangs_starve_against_their_own_typical_wait_up_to_a_ceiling(large_gang_wait, ceiling, reserves):
    users = [UserConfig("u")]
    pool = NodePool(nodes(3))
    pool.allocate(W("r0").gpus(4).build(), [0])
    pool.allocate(W("r1").gpus(4).build(), [1])
    q = queue(W("big").gpus(16).at(0).build(), W("small").gpus(2).at(10).build())
    cfg = FairShareConfig(starvation_after=100, starvation_factor=0, large_gang_wait_ceiling=ceiling, reserve_cap=1.0)
    c = ctx(users, pool, now=1000.0)
    c.large_gang_wait = large_gang_wait
    res = admit(q, pool, make_policy("fairshare", cfg), c, reserve_cap=cfg.reserve_cap)
    held = {w.name: set(n) for w, n in res.reservations}
    assert list(held) == (["big"] if reserves else [])
    [(small, placed)] = res.started
    assert small.name == "small" and not set(placed) & held.get("big", set())  # off the draining nodes
    if reserves:
        assert 2 in held["big"] and len(held["big"]) == 2  # the empty node and one half-free node
    # A gang above the reservation cap never drains nodes, so its own kind's wait does not hold it
    # back: it is starving (and starts first once it fits) after the plain threshold.
    over_cap = make_policy("fairshare", FairShareConfig(starvation_after=100, starvation_factor=0, reserve_cap=0.5))
    over_cap.prepare(c)
    assert over_cap.is_starving(W("big2").gpus(16).at(0).build(), 1000.0)


def test_starving_gang_above_the_reservation_cap_says_so_and_starts_first_when_it_fits():
    users = [UserConfig("h"), UserConfig("l")]
    cfg = FairShareConfig(starvation_after=100, starvation_factor=0)  # hard-starving at 400 s

    def cycle(pool):
        # the light user's job has waited 50 s: under the threshold, so it is not starving itself
        q = queue(W("small").user("l").gpus(2).at(950).build(), W("big").user("h").gpus(16).at(0).build())
        c = ctx(users, pool, now=1000.0, usage={"h": 1e6, "l": 1.0})
        return admit(q, pool, make_policy("fairshare", cfg), c, reserve_cap=0.5)

    busy = NodePool(nodes(2))
    busy.allocate(W("r0").gpus(4).build(), [0])
    res = cycle(busy)
    assert res.reservations == [] and "more than reservations may hold (50%" in res.pending_reasons["big"]
    assert [w.name for w, _ in res.started] == ["small"]  # nothing held: the rest still backfills
    res = cycle(NodePool(nodes(2)))  # the cluster is empty
    assert [w.name for w, _ in res.started] == ["big"]  # before the light user's (higher-key) job

    cfg.oversize_reserve_after = 1000 + 5 * 3600.0  # a wait bound: it may reserve 5 h from now
    busy = NodePool(nodes(2))
    busy.allocate(W("r0").gpus(4).build(), [0])
    res = cycle(busy)
    assert res.reservations == [] and res.pending_reasons["big"].endswith("may reserve nodes in 5.0h")
    cfg.oversize_reserve_after = 1000.0  # reached: it reserves both nodes, past the cap
    busy = NodePool(nodes(2))
    busy.allocate(W("r0").gpus(4).build(), [0])
    res = cycle(busy)
    assert [(w.name, sorted(n)) for w, n in res.reservations] == [("big", [0, 1])]
    assert res.started == [] and "reserved and draining" in res.pending_reasons["big"]


def test_easy_backfill_lets_short_work_use_reserved_nodes():
    """With run-time estimates (user history), work that ends before the shadow time may use held nodes."""
    users = [UserConfig("long"), UserConfig("short")]
    pool = NodePool(nodes(2))
    pool.allocate(W("r0").user("long").gpus(4).build(), [0], start=0.0)
    pool.allocate(W("r1").user("long").gpus(4).build(), [1], start=0.0)
    big = W("big").user("long").gpus(16).at(0).build()
    quick = W("quick").user("short").gpus(2).at(500).build()
    slow = W("slow").user("long").gpus(2).at(600).build()
    q = queue(big, quick, slow)
    c = ctx(users, pool, now=1000.0)
    c.runtimes.record("long", 4, 5000.0)  # r0, r1 end at ~5000: the shadow time
    c.runtimes.record("long", 2, 5000.0)
    c.runtimes.record("short", 2, 100.0)
    cfg = FairShareConfig(starvation_after=100, starvation_factor=0, starvation_slowdown=0)
    res = admit(q, pool, make_policy("fairshare", cfg), c, reserve_cap=1.0)
    assert [w.name for w, _ in res.reservations] == ["big"]
    assert pool.held == {} and [w.name for w, _ in res.started] == ["quick"]  # slow would delay big


@pytest.mark.parametrize("history, ceiling, wait, starving", [
    (None, 7 * DAY, 1.5 * DAY, True),  # no history yet: the plain threshold (1 day)
    (2 * 3600.0, 7 * DAY, 1.5 * DAY, True),  # 2-hour runs: 5 x 2 h is under a day, so a day it is
    (10 * 3600.0, 7 * DAY, 1.5 * DAY, False),  # 10-hour runs: not starving before 50 h
    (10 * 3600.0, 7 * DAY, 50 * 3600.0, True),
    (3 * DAY, 7 * DAY, 6 * DAY, False),  # 3-day runs: 15 days, cut to the 7-day ceiling
    (3 * DAY, 7 * DAY, 7 * DAY, True),
    (3 * DAY, 2 * DAY, 2 * DAY, True),  # a lower ceiling
])
def test_a_long_run_starves_only_after_a_multiple_of_its_estimated_run_time(history, ceiling, wait, starving):
    """The expansion-factor rule: ``starvation_slowdown`` times the history's run-time estimate,
    up to ``starvation_slowdown_ceiling``, raises the starvation threshold; never the run's own duration."""
    users = [UserConfig("u")]
    pool = NodePool(nodes(2))
    c = ctx(users, pool, now=wait)
    if history is not None:
        c.runtimes.record("u", 8, history)
    cfg = FairShareConfig(starvation_after=DAY, starvation_factor=0, large_gang_wait_factor=0,
                          starvation_slowdown_ceiling=ceiling)
    p = make_policy("fairshare", cfg)
    p.prepare(c)
    job = Workload("j", "u", 0.0, gang_for_gpus(8), duration=60.0, seq=1)  # its true duration plays no part
    assert p.is_starving(job, wait) is starving
    off = make_policy("fairshare", FairShareConfig(starvation_after=DAY, starvation_factor=0, large_gang_wait_factor=0,
                                                   starvation_slowdown=0))
    off.prepare(c)
    assert off.is_starving(job, wait)  # without the rule a day is enough
    # Hard starvation counts in the same thresholds: 4 of them.
    assert p.is_hard_starving(job, 4 * wait + 1) is starving


def test_quota_is_respected():
    users = [UserConfig("u", gpu_quota=4)]
    res, _, _ = run_cycle([W(f"j{i}").gpus(2).at(i).build() for i in range(4)], n_nodes=2, users=users,
                          quotas={"u": 4})
    assert len(res.started) == 2
    assert set(res.pending_reasons.values()) == {"user u is at its GPU quota (4/4 held)"}


def test_a_head_above_its_users_quota_is_told_it_cannot_start_until_the_quota_is_raised():
    # In the controller quotas can change while a workload waits, so admission keeps it queued, but
    # its reason must not read as if the user's running work were in the way.
    users = [UserConfig("u", gpu_quota=4)]
    res, _, _ = run_cycle([W("big").gpus(8).build()], n_nodes=2, users=users, quotas={"u": 4})
    assert res.started == []
    assert res.pending_reasons["big"] == ("needs 8 GPUs, more than user u's GPU quota of 4: it cannot start "
                                          "until the quota is raised")
    pool = NodePool(nodes(2))
    assert pool.never_starts(W("ok").gpus(8).build(), quota=8) is None
    assert pool.never_starts(W("ok").gpus(8).build()) is None


def test_unschedulable_workload_is_recognised():
    pool = NodePool(nodes(2))
    assert pool.ever_fits(W("ok").gpus(16).build())
    assert not pool.ever_fits(W("too-big").gpus(24).build())
    assert not NodePool(nodes(1, gpus=4)).ever_fits(W("x").gpus(8).build())


def test_runtime_estimates_fall_back_from_user_and_size_to_everyone():
    h = RuntimeHistory()
    assert h.estimate("a", 8) is None  # no history at all: no estimate, never a made-up one
    h.record("a", 1, 100.0)
    h.record("a", 1, 300.0)
    h.record("b", 8, 5000.0)
    assert h.estimate("a", 1) == 200.0  # the user's own workloads of that size
    assert h.estimate("a", 8) == 5000.0  # else everyone's of that size: gang size predicts run time
    assert h.estimate("c", 2) == pytest.approx(5400.0 / 3)  # else everyone's


# ---- starvation: protected users, hard starvation, defragmentation -------------------------------
def _starving_setup(now):
    """3 nodes: node 0 half busy, node 1 busy; a 16-GPU gang of heavy user "h" waiting since 0;
    a small job of light user "l" and one of "h" waiting since 900."""
    users = [UserConfig("h"), UserConfig("l")]
    pool = NodePool(nodes(3))
    pool.allocate(W("r0").user("h").gpus(4).build(), [0])
    pool.allocate(W("r1").user("h").gpus(8).build(), [1])
    big = W("big").user("h").gpus(16).at(0).build()
    light = W("light").user("l").gpus(4).at(900).build()
    heavy = W("heavy").user("h").gpus(4).at(900).build()
    q = queue(big, light, heavy)
    c = ctx(users, pool, now=now, usage={"h": 1e6, "l": 1.0}, held={"h": 12})
    return pool, q, c


def test_light_users_start_before_a_starving_gang_drains_the_cluster():
    pool, q, c = _starving_setup(now=1000.0)
    cfg = FairShareConfig(starvation_after=100, starvation_factor=0, hard_starvation_factor=20)
    res = admit(q, pool, make_policy("fairshare", cfg), c, reserve_cap=1.0)
    assert [w.name for w, _ in res.started] == ["light"]  # protected: below its share
    assert [w.name for w, _ in res.reservations] == ["big"]  # the heavy user's own job pays for the drain
    assert "reserved" in res.pending_reasons["big"] and "heavy" in res.pending_reasons


def test_hard_starving_gang_goes_before_protected_users():
    pool, q, c = _starving_setup(now=1000.0)
    cfg = FairShareConfig(starvation_after=100, starvation_factor=0, hard_starvation_factor=2)  # 1000 >= 2 * 100
    res = admit(q, pool, make_policy("fairshare", cfg), c, reserve_cap=1.0)
    assert [w.name for w, _ in res.reservations] == ["big"]
    assert res.started == []  # nodes 0 and 2 drain for the gang; node 1 is full


def test_protection_off_means_the_gang_drains_for_everyone():
    pool, q, c = _starving_setup(now=1000.0)
    cfg = FairShareConfig(starvation_after=100, starvation_factor=0, hard_starvation_factor=20, protect_below_share=0)
    res = admit(q, pool, make_policy("fairshare", cfg), c, reserve_cap=1.0)
    assert res.started == [] and [w.name for w, _ in res.reservations] == ["big"]


def test_defragmentation_holds_the_node_closest_to_free_for_a_whole_node_gang():
    users = [UserConfig("u"), UserConfig("v")]
    pool = NodePool(nodes(3))
    for i, g in enumerate([6, 3, 7]):  # 8 GPUs free in all, but no whole node
        pool.allocate(W(f"r{i}").user("v").gpus(g).build(), [i], start=0.0)
    whole = W("whole").user("u").gpus(8).at(0).build()
    small = W("small").user("v").gpus(1).at(10).build()
    q = queue(whole, small)
    cfg = FairShareConfig(defrag_after=2, starvation_after=1e9)
    c = ctx(users, pool, now=1000.0, typical_wait=100.0)  # waited 10 typical waits
    res = admit(q, pool, make_policy("fairshare", cfg), c, defrag_reservations=1)
    [(w, held)] = res.reservations
    assert w.name == "whole" and held == [1]  # node 1 has the most free GPUs: it drains first
    assert "defragmenting" in res.pending_reasons["whole"]
    assert {x.name: p for x, p in res.started} == {"small": [2]}  # best fit, off the held node
    c = ctx(users, pool, now=150.0, typical_wait=100.0)  # waited 1.5 typical waits: no drain yet
    assert admit(q, NodePool(nodes(3)), make_policy("fairshare", cfg), c, defrag_reservations=1).reservations == []


@pytest.mark.parametrize("policy", ["fifo", "drf", "kueue-afs", "fairshare"])
def test_the_simulators_quiet_cycle_starts_what_the_explained_cycle_starts(policy):
    """``explain`` only adds the pending reasons (the controller's cycle; the simulator's runs
    without): the cycle must start and reserve exactly the same either way."""
    import copy
    import random

    rng = random.Random(0)
    cfg = FairShareConfig(starvation_after=50, starvation_factor=0, hard_starvation_factor=3, defrag_after=1)
    users = [UserConfig(f"u{i}") for i in range(5)]
    started = reserved = 0
    for trial in range(300):
        pool = NodePool(nodes(6))
        for i in range(6):
            if (g := rng.choice([0, 1, 2, 3, 5, 7, 8])):
                pool.allocate(W(f"r{trial}-{i}").user(rng.choice(users).name).gpus(g).build(), [i], start=0.0)
        jobs = [W(f"j{trial}-{k}").user(rng.choice(users).name).gpus(rng.choice([1, 2, 4, 8, 16, 24]))
                .at(rng.uniform(700, 990)).build() for k in range(rng.randint(1, 25))]
        usage = {u.name: rng.choice([0.0, 1e3, 1e6]) for u in users}  # some users protected, some not
        state = (pool, queue(*jobs), ctx(users, pool, now=1000.0, usage=usage, typical_wait=20.0))
        runs = []
        for explain in (True, False):
            p, q, c = copy.deepcopy(state)
            res = admit(q, p, make_policy(policy, cfg), c, explain=explain, defrag_reservations=1)
            runs.append(([(w.name, pl) for w, pl in res.started], [(w.name, n) for w, n in res.reservations]))
        assert runs[0] == runs[1], trial
        started, reserved = started + len(runs[0][0]), reserved + len(runs[0][1])
    assert started > 300 and (reserved > 30 if policy == "fairshare" else reserved == 0)  # the cases are not empty
