"""The scheduler's data model: workloads (gangs), users, nodes. Plain dataclasses, no I/O.

Units: GPUs and CPUs in devices/cores, memory in GB, times in seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Resources:
    """A resource vector. Requests and allocatable capacity use the same type."""

    gpu: float = 0.0
    cpu: float = 0.0
    memory_gb: float = 0.0

    def __add__(self, o: "Resources") -> "Resources":
        return Resources(self.gpu + o.gpu, self.cpu + o.cpu, self.memory_gb + o.memory_gb)

    def __sub__(self, o: "Resources") -> "Resources":
        return Resources(self.gpu - o.gpu, self.cpu - o.cpu, self.memory_gb - o.memory_gb)

    def scale(self, k: float) -> "Resources":
        return Resources(self.gpu * k, self.cpu * k, self.memory_gb * k)

    def fits_in(self, o: "Resources") -> bool:
        return self.gpu <= o.gpu + 1e-9 and self.cpu <= o.cpu + 1e-9 and self.memory_gb <= o.memory_gb + 1e-9


def _init_resources(self: Resources, gpu: float = 0.0, cpu: float = 0.0, memory_gb: float = 0.0) -> None:
    _set_gpu(self, gpu)
    _set_cpu(self, cpu)
    _set_memory(self, memory_gb)


# Why a hand-written __init__: a frozen dataclass's sets each field through object.__setattr__,
# and the simulator builds millions of these vectors (about a tenth of its time). Writing the
# slots through their descriptors is about 3x faster; the instances stay frozen (assignment
# raises FrozenInstanceError) and everything else is the dataclass's.
_set_gpu, _set_cpu, _set_memory = Resources.gpu.__set__, Resources.cpu.__set__, Resources.memory_gb.__set__
_init_resources.__qualname__ = "Resources.__init__"
Resources.__init__ = _init_resources


@dataclass(eq=False)
class Workload:
    """A gang: every pod must be placed at once, or none is.

    ``pods`` are the per-pod requests. The trace form of a g-GPU job is one pod of g GPUs when it
    fits a node, else ``ceil(g / node_gpus)`` pods of whole nodes.
    """

    name: str
    user: str
    submit_time: float
    pods: tuple[Resources, ...]
    group: str | None = None
    """Optional group (team/queue) for reporting; fair share is per user."""
    duration: float | None = None
    """True run time: the simulator uses it to end the job. Policies never read it."""
    seq: int = 0
    """Arrival sequence number: the final, total tie-break of every ordering."""
    total: Resources = field(init=False)
    shape: tuple = field(init=False, repr=False)
    """(user, GPUs, pods, CPUs, memory): workloads of one shape queue together, FIFO."""

    def __post_init__(self):
        t = Resources()
        for p in self.pods:
            t = t + p
        self.total = t
        self.shape = (self.user, t.gpu, len(self.pods), t.cpu, t.memory_gb)

    @property
    def gpus(self) -> float:
        return self.total.gpu


@dataclass(frozen=True)
class UserConfig:
    """A user of the cluster (a namespace or a KFP user)."""

    name: str
    shares: float = 1.0
    """Weight of the user's fair share (relative; must be > 0)."""
    priority: int = 1
    """Static priority tier (higher is more important), as in the thesis."""
    gpu_quota: float | None = None
    """Most GPUs the user may hold at once; None is unlimited."""


@dataclass(frozen=True)
class Node:
    name: str
    allocatable: Resources


def gang_for_gpus(gpus: int, node_gpus: int = 8, cpu_per_gpu: float = 0.0, mem_per_gpu: float = 0.0
                  ) -> tuple[Resources, ...]:
    """The pods of a g-GPU job: one pod below a node's size, whole-node pods at or above it."""
    if gpus < node_gpus:
        return (Resources(gpus, gpus * cpu_per_gpu, gpus * mem_per_gpu),)
    n = -(-gpus // node_gpus)
    per = gpus / n
    return tuple(Resources(per, per * cpu_per_gpu, per * mem_per_gpu) for _ in range(n))


PLACEMENTS = ("binpack", "spread")
"""Where a pod smaller than a node goes: ``binpack`` (the fullest node that fits: kube-scheduler's
``MostAllocated`` scoring, Volcano's binpack plugin; keeps whole nodes free for whole-node gangs)
or ``spread`` (the emptiest node that fits: kube-scheduler's default ``LeastAllocated``). Ties go to
the lowest node index. Pods of a node's size or more always take whole free nodes."""


def placement_problem(value: object, path: str = "placement") -> str | None:
    """The error for a placement that is not one of :data:`PLACEMENTS`, or None when it is."""
    return None if value in PLACEMENTS else f"{path}: must be one of {', '.join(PLACEMENTS)}, got {value!r}"
