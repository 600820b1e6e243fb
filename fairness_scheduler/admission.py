"""Gang admission: start the highest-priority gangs that fit *entirely*, placed node by node.

Pure: no clock, no client. The simulator and the Kubernetes controller both call :func:`admit`
with a :class:`PendingQueue`, a :class:`NodePool` and a prepared policy.

Pending workloads sit in FIFO queues per (user, shape); a policy never ranks a younger workload
of the same user and shape above an older one, so only queue heads compete. One cycle:

1. **Starving heads** (the policy decides; ours: workloads that waited several typical waits,
   at least a day, and five times their estimated run time up to a week; those a reservation
   may hold nodes for also several typical waits of large gangs) start if they fit, else get
   a *reservation*: the nodes closest to fitting them (most free GPUs) are held, with a shadow
   time estimated from the running workloads' run-time history.
   Only workloads estimated to end before the shadow time may still use held nodes (EASY
   backfilling, with history instead of user-given limits). Hard-starving heads go first; for
   the others, the work of *protected* users (ours: below their share) that fits starts first,
   so a drain is paid for by the users above their share. Reservations are capped (count and
   ``reserve_cap`` of the GPUs); a gang above the cap reserves only where the policy allows it
   (ours: ``oversize_reserve_after``, off by default).
2. **Defragmentation** (``defrag_reservations``): whole-node gangs the policy names, blocked
   only because the free GPUs are scattered, get the nodes closest to free held the same way.
3. **Greedy backfill**: a heap holds the heads by policy key. Pop the best: if it fits, place
   it (pods below a node's size by the pool's ``placement``, ``binpack`` or ``spread``; whole
   free nodes for pods of a node's size or more), start it and push its queue's next head; if
   the policy's user keys changed (DRF, Kueue's entry penalty, our current-allocation term),
   that user's heads are re-pushed and stale entries skipped by version. If it does not fit,
   its queue is set aside for the rest of the cycle (capacity only shrinks within a cycle).
4. Every workload that did not start gets a reason (``pending_reasons``).

Reservations are re-derived every cycle from the pool and the queue, so they need no extra state
and survive a controller restart.

Edge cases, decided here: a workload that cannot fit even an empty cluster, or asks for more
GPUs than its user's quota, is *unschedulable* (``NodePool.never_starts``) and is reported once
at enqueue, never queued (no endless loop); quota is checked before placement; ties in key are
impossible (keys end with submit time and arrival sequence).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter

from .errors import SchedulerConfigError
from .model import Node, Resources, Workload, placement_problem
from .policy import CycleContext, Policy
from .usage import format_duration


def _above_quota(w: Workload, quota: float | None) -> str | None:
    """Why ``w`` exceeds its user's GPU quota on its own (None: it does not)."""
    if quota is not None and w.gpus > quota + 1e-9:
        return f"needs {w.gpus:g} GPUs, more than user {w.user}'s GPU quota of {quota:g}"
    return None


class NodePool:
    """Free resources per node, indexed by free GPUs for O(levels) fit checks."""

    def __init__(self, nodes: list[Node], placement: str = "binpack"):
        problem = placement_problem(placement)
        if problem:
            raise SchedulerConfigError([problem])
        self.placement = placement
        self.nodes = list(nodes)
        self.alloc = [n.allocatable for n in self.nodes]
        self.free = list(self.alloc)
        self.max_gpu = int(max((a.gpu for a in self.alloc), default=0))
        self.levels: list[set[int]] = [set() for _ in range(self.max_gpu + 1)]
        self.whole: set[int] = set()
        for i, a in enumerate(self.alloc):
            self._index(i)
        self.held: dict[int, float] = {}
        """Reserved nodes -> the reservation's estimated start (its shadow time)."""
        self.running: list[dict[int, tuple[Workload, float, float]]] = [{} for _ in self.nodes]
        """Per node: workload id -> (workload, start time, GPUs it holds there), for estimates."""
        self._ever_fits: dict[tuple[Resources, ...], bool] = {}
        self.total = Resources()
        for a in self.alloc:
            self.total = self.total + a

    # -- indexing ------------------------------------------------------------------------------
    def _level(self, i: int) -> int:
        return int(self.free[i].gpu + 1e-9)

    def _index(self, i: int) -> None:
        self.levels[self._level(i)].add(i)
        if self.free[i] == self.alloc[i]:
            self.whole.add(i)

    def _unindex(self, i: int) -> None:
        self.levels[self._level(i)].discard(i)
        self.whole.discard(i)

    # -- queries -------------------------------------------------------------------------------
    def needs_whole_node(self, pod: Resources, node: int) -> bool:
        """Pods of a node's GPU count or more take whole nodes (no sharing with small pods)."""
        return pod.gpu >= self.alloc[node].gpu > 0

    def ever_fits(self, w: Workload) -> bool:
        """Could ``w`` run on this cluster if it were empty? (Cached by pod shapes: nodes are fixed.)"""
        known = self._ever_fits.get(w.pods)
        if known is None:
            known = self._ever_fits[w.pods] = self._fits_empty(w.pods)
        return known

    def never_starts(self, w: Workload, quota: float | None = None) -> str | None:
        """Why ``w`` can never start here (None: it can): larger than the empty cluster, or than its
        user's GPU quota. Such a workload is reported once, not queued to wait for ever."""
        if not self.ever_fits(w):
            return (f"needs {w.gpus:g} GPUs in {len(w.pods)} pod(s), more than the empty cluster can place "
                    f"({self.total.gpu:g} GPUs on {len(self.nodes)} nodes)")
        return _above_quota(w, quota)

    def _fits_empty(self, pods: tuple[Resources, ...]) -> bool:
        free = [a for a in self.alloc]
        for pod in sorted(pods, key=lambda p: -p.gpu):
            for i, f in enumerate(free):
                if pod.fits_in(f) and (not self.needs_whole_node(pod, i) or f == self.alloc[i]):
                    free[i] = Resources(0, 0, 0) if self.needs_whole_node(pod, i) else f - pod
                    break
            else:
                return False
        return True

    def place(self, w: Workload, ends_by: float | None = None) -> list[int] | None:
        """Node index per pod (best fit), or None if the gang does not fit entirely now.

        Reserved nodes are used only by a workload estimated to end (``ends_by``) before the
        reservation's shadow time (EASY backfilling)."""
        chosen: list[int] = []
        taken: dict[int, Resources] = {}
        for pod in w.pods:
            i = self._place_one(pod, taken, ends_by)
            if i is None:
                return None
            chosen.append(i)
            taken[i] = self.free[i] if self.needs_whole_node(pod, i) else taken.get(i, Resources()) + pod
        return chosen

    def _usable(self, i: int, ends_by: float | None) -> bool:
        shadow = self.held.get(i)
        return shadow is None or (ends_by is not None and ends_by <= shadow)

    def _place_one(self, pod: Resources, taken: dict[int, Resources], ends_by: float | None = None) -> int | None:
        """Whole free node for node-sized pods; else the fullest (``binpack``) or the emptiest
        (``spread``) node that still fits."""
        if self.max_gpu and pod.gpu >= self.max_gpu:
            for i in sorted(self.whole):
                if self._usable(i, ends_by) and i not in taken and pod.fits_in(self.alloc[i]):
                    return i
            return None
        levels = range(int(pod.gpu + 0.999999), self.max_gpu + 1)
        for level in (levels if self.placement == "binpack" else reversed(levels)):
            for i in sorted(self.levels[level]):
                if not self._usable(i, ends_by):
                    continue
                free = self.free[i] - taken[i] if i in taken else self.free[i]
                if pod.fits_in(free) and not self.needs_whole_node(pod, i):
                    return i
        return None

    def allocate(self, w: Workload, placement: list[int], start: float = 0.0) -> None:
        on: dict[int, float] = {}
        for pod, i in zip(w.pods, placement):
            on[i] = on.get(i, 0.0) + (self.alloc[i].gpu if self.needs_whole_node(pod, i) else pod.gpu)
        for i, g in on.items():
            self.running[i][id(w)] = (w, start, g)
        for pod, i in zip(w.pods, placement):
            self._unindex(i)
            self.free[i] = Resources() if self.needs_whole_node(pod, i) else self.free[i] - pod
            self._index(i)

    def release(self, w: Workload, placement: list[int]) -> None:
        for i in set(placement):
            self.running[i].pop(id(w), None)
        for pod, i in zip(w.pods, placement):
            self._unindex(i)
            self.free[i] = self.alloc[i] if self.needs_whole_node(pod, i) else self.free[i] + pod
            self._index(i)

    def reserve_for(self, w: Workload, end_of=None) -> list[int] | None:
        """Hold the nodes closest to fitting ``w`` (most free GPUs, lowest index first).

        ``end_of(workload, start)`` estimates when a running workload ends; the reservation's
        shadow time is when the held nodes are estimated to be free enough (inf without estimates).
        """
        n_nodes = len(w.pods) if len(w.pods) > 1 or w.pods[0].gpu >= self.max_gpu else 1
        candidates = [i for i in range(len(self.nodes)) if i not in self.held and w.pods[0].fits_in(self.alloc[i])]
        if len(candidates) < n_nodes:
            return None
        candidates.sort(key=lambda i: (-self.free[i].gpu, i))
        chosen = candidates[:n_nodes]
        whole = n_nodes > 1 or w.pods[0].gpu >= self.max_gpu
        shadow = 0.0
        for i in chosen:
            runs = sorted(((end_of(x, st) if end_of else math.inf), g) for x, st, g in self.running[i].values())
            free_at, free = 0.0, self.free[i].gpu
            need = self.alloc[i].gpu if whole else w.pods[0].gpu
            for end, g in runs:  # GPUs come back as the running workloads end
                if free >= need:
                    break
                free += g
                free_at = end
            shadow = max(shadow, free_at)
        for i in chosen:
            self.held[i] = shadow
        return chosen

    def largest_free_gpu(self, include_held: bool = False) -> int:
        """Most free GPUs on one node that is not reserved (``include_held``: on any node)."""
        held = None if include_held else self.held
        for level in range(self.max_gpu, 0, -1):
            nodes = self.levels[level]
            if nodes and (not held or any(i not in held for i in nodes)):
                return level
        return 0


class PendingQueue:
    """FIFO queues per (user, shape); insertion must follow (submit_time, seq) per queue."""

    def __init__(self, workloads: Iterable[Workload] = ()):
        """Optionally filled with ``workloads`` in any order (sorted here by submit time, then seq)."""
        self.queues: dict[tuple, deque[Workload]] = {}
        self.by_user: dict[str, set[tuple]] = {}
        self.size = 0
        queues = self.queues
        for w in sorted(workloads, key=attrgetter("submit_time", "seq")):  # push() inlined: a snapshot has many
            q = queues.get(w.shape)
            if q is None:
                q = queues[w.shape] = deque()
                self.by_user.setdefault(w.user, set()).add(w.shape)
            q.append(w)
        self.size = sum(map(len, queues.values()))

    def push(self, w: Workload) -> None:
        k = w.shape
        q = self.queues.get(k)
        if q is None:
            q = self.queues[k] = deque()
            self.by_user.setdefault(w.user, set()).add(k)
        q.append(w)
        self.size += 1

    def pop(self, k: tuple) -> Workload:
        q = self.queues[k]
        w = q.popleft()
        if not q:
            del self.queues[k]
            self.by_user[k[0]].discard(k)
        self.size -= 1
        return w

    def __len__(self) -> int:
        return self.size


@dataclass
class CycleResult:
    started: list[tuple[Workload, list[int]]] = field(default_factory=list)
    reservations: list[tuple[Workload, list[int]]] = field(default_factory=list)
    pending_reasons: dict[str, str] = field(default_factory=dict)
    """Reasons for the queue heads that did not start (name -> reason)."""


def admit(queue: PendingQueue, pool: NodePool, policy: Policy, ctx: CycleContext, reserve_cap: float = 0.5,
          quotas: dict[str, float] | None = None, explain: bool = True, max_reservations: int = 1,
          defrag_reservations: int = 0) -> CycleResult:
    """One admission cycle; mutates ``queue`` (started workloads leave) and ``pool`` (allocations)."""
    now = ctx.now
    res = CycleResult()
    policy.prepare(ctx)
    version: dict[str, int] = {}
    blocked: set[tuple] = set()
    held_gpu = {u: s.held.gpu for u, s in ctx.users.items()} if quotas else {}  # read for quotas only
    reserved_gpu = 0.0
    cap = reserve_cap * pool.total.gpu
    pool.held.clear()

    estimates: dict[tuple, float | None] = {}  # (user, GPUs) -> estimate; history is fixed within a cycle
    ranked: dict[tuple, tuple] = {}  # queue -> (head, user's key version, key) when a pass ranked it

    def estimate(w: Workload) -> float | None:
        uk = (w.user, w.total.gpu)
        est = estimates.get(uk, estimates)
        if est is estimates:
            est = estimates[uk] = ctx.runtimes.estimate(*uk)
        return est

    def end_of(x: Workload, started: float) -> float:
        est = estimate(x)
        return math.inf if est is None else max(started + est, now + 60.0)

    def over_quota(w: Workload) -> float | None:
        quota = quotas.get(w.user) if quotas else None
        return quota if quota is not None and held_gpu.get(w.user, 0.0) + w.gpus > quota + 1e-9 else None

    def start(k: tuple, w: Workload, placement: list[int]) -> None:
        pool.allocate(w, placement, now)
        queue.pop(k)
        res.started.append((w, placement))
        held_gpu[w.user] = held_gpu.get(w.user, 0.0) + w.gpus
        if policy.on_admit(w, ctx):
            version[w.user] = version.get(w.user, 0) + 1

    def handle_starving(heads: list[tuple]) -> None:
        """Starving heads, oldest first: start if they fit, else reserve the nodes to drain."""
        nonlocal reserved_gpu
        for k in heads:
            if len(res.reservations) >= max_reservations:
                break
            w = queue.queues[k][0]
            if over_quota(w) is not None:
                continue
            placement = pool.place(w)
            if placement is not None:
                start(k, w, placement)
                continue
            reserve_in = policy.oversize_reserve_in(w, now) if reserved_gpu + w.gpus > cap else 0.0
            if reserve_in > 0:
                blocked.add(k)  # it did not fit, and capacity only shrinks within a cycle
                if explain:
                    res.pending_reasons[w.name] = (
                        f"starving: needs {w.gpus:g} GPUs, more than reservations may hold "
                        f"({reserve_cap:.0%} of the cluster's GPUs); it starts first as soon as it fits"
                        + (f", and may reserve nodes in {format_duration(reserve_in)}" if math.isfinite(reserve_in) else ""))
                continue
            nodes = pool.reserve_for(w, end_of)
            if nodes is not None:
                reserved_gpu += sum(pool.alloc[i].gpu for i in nodes)
                res.reservations.append((w, nodes))
                blocked.add(k)
                if explain:
                    res.pending_reasons[w.name] = (f"starving: nodes {[pool.nodes[i].name for i in nodes]} "
                                                   "are reserved and draining for this gang")

    def backfill(keys: list[tuple], remember: bool = False) -> None:
        """Greedy: every head among ``keys`` that fits, in key order, around the reservations.
        A head that does not fit is set aside (``blocked``) for the rest of the cycle: capacity
        only shrinks within a cycle. Its reason is written at the end, from the final state.
        ``remember``: keep the keys for a later pass of this cycle."""
        allowed = None if len(keys) == len(queue.queues) else set(keys)  # None: every queue
        max_gpu, queues, key, held = pool.max_gpu, queue.queues, policy.key, pool.held

        def free_shapes() -> tuple[int, int, int, int]:
            """Largest free GPUs on one node and whole free nodes, outside held nodes and (``big``,
            ``n_whole``) with them: a head estimated to end before a reservation's shadow time
            may use held nodes."""
            largest, whole = pool.largest_free_gpu(), len(pool.whole - held.keys() if held else pool.whole)
            return (largest, whole, pool.largest_free_gpu(True), len(pool.whole)) if held else (largest, whole) * 2

        # A head fits only if its shape does, so rank only those (most cycles end here).
        largest, whole, big, n_whole = free_shapes()
        fit = []
        for k in keys:
            if k[1] <= big if k[2] == 1 and k[1] < max_gpu else k[2] <= n_whole:
                fit.append(k)
            else:
                blocked.add(k)
        keys = fit
        if ranked:
            heap = []
            for k in keys:
                if k in blocked or k not in queues:
                    continue
                w, ver = queues[k][0], version.get(k[0], 0)
                hit = ranked.get(k)  # this head's key from an earlier pass of this cycle, still valid?
                heap.append((hit[2] if hit is not None and hit[0] is w and hit[1] == ver else key(w, now), ver, k))
        else:
            heap = [(key(queues[k][0], now), version.get(k[0], 0), k) for k in keys
                    if k not in blocked and k in queues]
        if remember:
            ranked.update((k, (queues[k][0], ver, r)) for r, ver, k in heap)
        heapq.heapify(heap)
        while heap:
            _, ver, k = heapq.heappop(heap)
            if k in blocked or k not in queues or ver != version.get(k[0], 0):
                continue
            single = k[2] == 1 and k[1] < max_gpu  # k: (user, GPUs, pods, ...)
            if k[1] > big if single else k[2] > n_whole:
                blocked.add(k)  # the shape no longer fits anywhere: no placement search
                continue
            w = queues[k][0]
            if quotas and over_quota(w) is not None:
                blocked.add(k)
                continue
            if held:
                est = estimate(w)
                if est is None and (k[1] > largest if single else k[2] > whole):
                    blocked.add(k)  # without an estimate it may not use held nodes
                    continue
                placement = pool.place(w, None if est is None else now + est)
            else:
                placement = pool.place(w)
            if placement is None:
                blocked.add(k)
                continue
            before = version.get(w.user, 0)
            start(k, w, placement)
            largest, whole, big, n_whole = free_shapes()
            if version.get(w.user, 0) != before:  # the user's keys changed: re-rank its heads
                for k2 in queue.by_user.get(w.user, ()):
                    if k2 not in blocked and (allowed is None or k2 in allowed):
                        heapq.heappush(heap, (key(queues[k2][0], now), version[w.user], k2))
            elif k in queues:
                heapq.heappush(heap, (key(queues[k][0], now), version.get(k[0], 0), k))
            if largest == 0 and whole == 0 and all(k2[1] for k2 in keys):
                break  # a full cluster fits nothing more, unless a head needs no GPU (a CPU-only job)

    def explain_pending() -> None:
        """A reason for every queue head that did not start, from the state the cycle leaves."""
        largest = pool.largest_free_gpu()
        whole = len(pool.whole - pool.held.keys())
        reasons = res.pending_reasons
        for q in queue.queues.values():
            w = q[0]
            if w.name in reasons:
                continue  # starving or defragmenting: said when its nodes were reserved
            quota = over_quota(w) if quotas else None
            pod, n = w.pods[0], len(w.pods)
            single = n == 1 and pod.gpu < pool.max_gpu
            if quota is not None and (above := _above_quota(w, quota)):
                why = f"{above}: it cannot start until the quota is raised"  # quotas change in the controller
            elif quota is not None:
                why = f"user {w.user} is at its GPU quota ({held_gpu.get(w.user, 0.0):g}/{quota:g} held)"
            elif largest == 0 and whole == 0:
                why = "cluster full: no free GPUs" + (" outside reserved nodes" if pool.held else "")
            elif single and pod.gpu > largest:
                why = f"waiting for {w.gpus:g} GPUs on one node (largest free: {largest})"
            elif not single and n > whole:
                why = f"gang of {n} pods needs {n} free nodes (free now: {whole})"
            else:  # enough GPUs on a node, but not the CPUs or memory beside them
                why = (f"waiting for {pod.gpu:g} GPUs with {pod.cpu:g} CPUs and {pod.memory_gb:g} GB "
                       "of memory free on one node")
            reasons[w.name] = why

    # Pass 1: starving heads start, or get a reservation, before anything else may take the
    # capacity they are draining for. Hard-starving heads go first of all; merely starving ones
    # let protected (light) users' work that fits start first, so light users do not pay for
    # the drain.
    if policy.reserves:
        # Heads submitted after ``since`` cannot be starving (a second of slack for rounding:
        # is_starving decides).
        since = now - policy.starving_after() + 1.0
        starving = [k for _, k in sorted(((q[0].submit_time, q[0].seq), k) for k, q in queue.queues.items()
                                         if q[0].submit_time <= since and policy.is_starving(q[0], now))]
        hard = [k for k in starving if policy.is_hard_starving(queue.queues[k][0], now)]
        handle_starving(hard)
        hard_set = set(hard)
        soft = [k for k in starving if k not in hard_set and k in queue.queues]
        if soft:
            protected = {u for u in queue.by_user if policy.is_protected(u)}
            if protected:
                backfill([k for k in queue.queues if k[0] in protected], remember=True)
            handle_starving([k for k in soft if k in queue.queues])

    # Pass 2: defragmentation. The best whole-node gangs that do not fit only because the free
    # GPUs are scattered over nodes get the nodes closest to free held for them (EASY again).
    if defrag_reservations:
        free_gpu = sum(f.gpu for i, f in enumerate(pool.free) if i not in pool.held)
        # k[1] is the gang's GPUs: a cheap first test (a whole-node pod needs a node's GPUs or more).
        wanting = sorted((policy.key(q[0], now), k) for k, q in queue.queues.items()
                         if pool.max_gpu <= k[1] <= free_gpu and k not in blocked
                         and q[0].pods[0].gpu >= pool.max_gpu and policy.wants_defrag(q[0], now))
        held_for = 0
        for _, k in wanting:
            w = queue.queues[k][0]
            if held_for >= defrag_reservations:
                break
            if w.gpus > free_gpu:
                continue
            if pool.place(w) is not None:
                continue  # fits as it is: pass 3 starts it in key order
            nodes = pool.reserve_for(w, end_of)
            if nodes is None:
                break
            held_for += 1
            free_gpu -= sum(pool.free[i].gpu for i in nodes)
            res.reservations.append((w, nodes))
            blocked.add(k)
            if explain:
                res.pending_reasons[w.name] = (f"defragmenting: nodes {[pool.nodes[i].name for i in nodes]} "
                                               "are held so whole nodes free up for this gang")

    # Pass 3: greedy backfill of everything else, around the reservations.
    backfill(list(queue.queues))
    if explain:
        explain_pending()
    pool.held.clear()
    return res
