"""Trace CSVs (``shared/traces/itp-2021`` format) and the fair-share benchmark protocol.

Columns: ``job_id, submission_time, duration, num_gpu`` (seconds from trace start, seconds of
run time, GPUs), and optionally ``user``. A job of 0 GPUs (CPU only) is kept: it draws its user
like any other row (dropping it would shift every later job's user) and, needing no GPU, starts
when it is submitted under every policy. The published traces have no users and no cluster size,
so the protocol fixes both (see that folder's README, implemented here exactly):

- users: ``rng = numpy.random.default_rng(seed)``; ``rng.choice(users, size=n, p=p)`` in file
  order, ``p[k] ~ 1 / (k + 1) ** zipf``;
- shares 1 each; static priority 3 for users 0-4, 2 for 5-9, 1 for the rest;
- capacity ``C = max(ceil(mean_demand / load / 8) * 8, max_job_gpus rounded up to 8)``,
  ``mean_demand = sum(gpus * duration) / (last submission - first submission)``; nodes of 8 GPUs.

A trace of one's own cluster may name each job's ``user``: the jobs then keep their real users
(the Zipf draw does not apply), with shares and tiers from the scheduler config's ``users``
(1 share and tier 1 for those it does not list). Capacity follows the protocol either way.
"""
from __future__ import annotations

import csv
import difflib
import gzip
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import TraceError
from .model import Node, Resources, UserConfig, Workload, gang_for_gpus

COLUMNS = ("job_id", "submission_time", "duration", "num_gpu")
USER_COLUMN = "user"
"""Optional: the job's real user (a trace of one's own cluster)."""
NODE_GPUS = 8
MAX_NODES = 100_000
"""The largest cluster the simulator models: 800,000 GPUs, beyond any cluster built so far. Past it
a mistyped ``num_gpu`` or a tiny ``--load`` would build billions of nodes and exhaust memory."""
MAX_USERS = 100_000
"""The most users the protocol draws (``--users``): its arrays are per user."""


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    submit: float
    duration: float
    gpus: int
    line: int
    user: str | None = None
    """From the trace's ``user`` column; None: the protocol draws one."""


MAX_LISTED = 20  # bad rows named in one error; the count says how many more there are

_GZIP_MAGIC = b"\x1f\x8b"


def trace_name(path: str | Path) -> str:
    """A trace's name, as the goals' targets know it: the file name without ``.csv`` or ``.csv.gz``."""
    name = Path(path).name
    for suffix in (".gz", ".csv"):
        name = name.removesuffix(suffix)
    return name


def _open_text(path: Path):
    """The trace as text: plain, or gzip-compressed (traces are published as ``.csv.gz`` too),
    told by its first bytes rather than its name."""
    with open(path, "rb") as raw:
        compressed = raw.read(2) == _GZIP_MAGIC
    opener = gzip.open if compressed else open
    return opener(path, "rt", newline="", encoding="utf-8-sig")  # a BOM (spreadsheet exports) is not part of the header


_NOT_TEXT = "give a CSV, plain or gzip-compressed (extract a .tar.gz or .zip first)"


def trace_files_in(folder: Path) -> list[str]:
    """The names of the trace files (``*.csv``, ``*.csv.gz``) in ``folder``, sorted; none if unreadable."""
    try:
        return sorted(p.name for p in folder.iterdir() if p.name.endswith((".csv", ".csv.gz")) and p.is_file())
    except OSError:
        return []


def near_trace(path: Path) -> Path | None:
    """The trace beside ``path`` (which is not there) whose name is nearest its own: a typo such as
    cluster7.csv for cluster07.csv. None when no name is near."""
    import difflib

    near = difflib.get_close_matches(path.name, trace_files_in(path.parent), n=1, cutoff=0.8)
    return path.parent / near[0] if near else None


def _missing_hint(path: Path) -> str:
    """What to give for a trace ``path`` that is not there (or a folder): the trace it likely meant,
    else what a trace holds and the CSVs its folder has."""
    is_dir = path.is_dir()
    if not is_dir and (near := near_trace(path)):
        return f"did you mean {near}?"
    folder = path if is_dir else path.parent
    hint, names = "give a CSV with columns " + ", ".join(COLUMNS), trace_files_in(folder)
    if names:
        hint += f"; {folder} holds " + ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        if is_dir:  # a folder of traces: goals takes it whole
            hint += f" (`kfp-pytorch goals --traces {folder}` judges them all)"
    return hint


def read_trace(path: str | Path) -> list[TraceJob]:
    """Parse and validate. Every bad row is named (``file:line: what``) in one TraceError, so a
    trace is fixed in one pass rather than one error per run."""
    path = Path(path)
    if path.is_dir():
        raise TraceError(f"{path} is a folder: give one trace CSV in it", _missing_hint(path))
    try:
        f = _open_text(path)
    except FileNotFoundError as e:
        raise TraceError(f"trace file not found: {path}", _missing_hint(path)) from e
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}", "give a readable CSV file") from e
    jobs: list[TraceJob] = []
    problems: list[str] = []
    reader = csv.reader(f)
    try:
        with f:
            _read_rows(reader, path, jobs, problems)
    except UnicodeDecodeError:  # decoded ahead in blocks: no line number to give
        raise TraceError(f"{path}: not UTF-8 text", _NOT_TEXT) from None
    except csv.Error as e:
        raise TraceError(f"{path}:{reader.line_num}: {e}", _NOT_TEXT) from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:  # a truncated download, a corrupt member
        raise TraceError(f"{path}: not a readable gzip file ({e})", "download the trace again, or give it "
                         "decompressed") from None
    if problems:
        shown = problems[:MAX_LISTED]
        more = f"\n... and {len(problems) - MAX_LISTED} more bad rows" if len(problems) > MAX_LISTED else ""
        raise TraceError("\n".join(shown) + more,
                         "every job needs its own job_id, submission_time and duration must be numbers >= 0 "
                         "and num_gpu an integer from 0 to " f"{MAX_NODES * NODE_GPUS:,}; fix or drop the rows above")
    if not jobs:
        raise TraceError(f"{path}: no jobs", "the trace has a header but no rows")
    if not any(j.gpus for j in jobs):
        raise TraceError(f"{path}: no job requests a GPU (every num_gpu is 0)",
                         "the cluster's size comes from GPU demand: give a trace with GPU jobs")
    return jobs


def _read_rows(reader, path: Path, jobs: list[TraceJob], problems: list[str]) -> None:
    header = next(reader, None)
    if header is None:
        raise TraceError(f"{path}:1: empty file", "expected a header: " + ",".join(COLUMNS))
    header = [h.strip() for h in header]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        shown = ",".join(header[:12]) + (f",... ({len(header)} columns)" if len(header) > 12 else "")
        by_lower = {h.lower(): h for h in reversed(header) if h not in COLUMNS}  # 'Duration', 'submit_time'
        near = {c: by_lower[m[0]] for c in missing
                if (m := difflib.get_close_matches(c.lower(), list(by_lower), n=1, cutoff=0.6))}
        raise TraceError(f"{path}:1: missing column(s) {', '.join(missing)} (header: {shown})"
                         + ("; did you mean " + ", ".join(f"{h!r} for {c!r}" for c, h in near.items()) + "?"
                            if near else ""),
                         "the header must name " + ", ".join(COLUMNS) + (" (rename those columns)" if near else ""))
    idx = [header.index(c) for c in COLUMNS]
    user_idx = header.index(USER_COLUMN) if USER_COLUMN in header else None
    first_line: dict[str, int] = {}  # job_id -> the line it was first seen on
    for row in reader:
        if not row or all(not c.strip() for c in row):
            continue
        line = reader.line_num
        job = _parse_row(row, len(header), idx, line, user_idx)
        if isinstance(job, str):
            problems.append(f"{path}:{line}: {job}")
            continue
        # A job's id is its identity (pending reasons, the ledger, a pod's name in the controller):
        # a repeated id is most often the same job twice, from traces concatenated or exported twice.
        seen = first_line.setdefault(job.job_id, line)
        if seen != line:
            problems.append(f"{path}:{line}: duplicate job_id {job.job_id!r} (first on line {seen})")
        else:
            jobs.append(job)


def _parse_row(row: list[str], n_fields: int, idx: list[int], line: int, user_idx: int | None = None
               ) -> TraceJob | str:
    """One row as a TraceJob, or what is wrong with it."""
    if len(row) < n_fields:
        return f"expected {n_fields} fields, got {len(row)}: {','.join(row)}"
    jid, sub, dur, gpu = (row[i].strip() for i in idx)
    if not jid:
        return f"empty job_id in {','.join(row)}"
    user = row[user_idx].strip() if user_idx is not None else None
    if user == "":
        return f"empty user in {','.join(row)} (the header has a user column: name every job's user)"
    try:
        submit, duration, gpus_f = float(sub), float(dur), float(gpu)
    except ValueError:
        return f"non-numeric value in {','.join(row)}"
    if not all(map(math.isfinite, (submit, duration, gpus_f))):
        return f"non-finite value in {','.join(row)}"
    if duration < 0:
        return f"negative duration {dur}"
    if submit < 0:
        return f"negative submission_time {sub}"
    if gpus_f < 0 or gpus_f != int(gpus_f):
        return f"num_gpu must be an integer >= 0, got {gpu}"
    if gpus_f > MAX_NODES * NODE_GPUS:
        return f"num_gpu {gpu} is more than the largest cluster the simulator models ({MAX_NODES * NODE_GPUS:,} GPUs)"
    return TraceJob(jid, submit, duration, int(gpus_f), line, user)


def zipf_probabilities(n_users: int, zipf: float) -> np.ndarray:
    w = 1.0 / (np.arange(n_users) + 1.0) ** zipf
    return w / w.sum()


def assign_users(n_jobs: int, n_users: int = 20, zipf: float = 1.1, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.choice(n_users, size=n_jobs, p=zipf_probabilities(n_users, zipf))


def user_name(k: int) -> str:
    return f"user-{k:02d}"


def protocol_users(n_users: int = 20) -> list[UserConfig]:
    """1 share each; priority 3 for users 0-4, 2 for 5-9, 1 for the rest."""
    return [UserConfig(user_name(k), 1.0, 3 if k < 5 else 2 if k < 10 else 1) for k in range(n_users)]


def capacity(jobs: list[TraceJob], load: float = 0.9, node_gpus: int = NODE_GPUS, source: str = "the trace") -> int:
    """The protocol's cluster size in GPUs; a TraceError (naming ``source``) past :data:`MAX_NODES`."""
    return max(capacity_bounds(jobs, load, node_gpus, source))


def capacity_bounds(jobs: list[TraceJob], load: float = 0.9, node_gpus: int = NODE_GPUS, source: str = "the trace"
                    ) -> tuple[int, int]:
    """The protocol's two lower bounds on the cluster, in GPUs: what the mean demand needs at
    ``load``, and the largest job (each rounded up to whole nodes). The larger is the cluster; where
    it is the largest job, ``load`` changes nothing until the demand's bound passes it."""
    span = max(j.submit for j in jobs) - min(j.submit for j in jobs)
    demand = sum(j.gpus * j.duration for j in jobs) / span if span > 0 else 0.0
    nodes = demand / load / node_gpus  # inf for demand beyond a float: refused below, never ceil'd
    if not nodes <= MAX_NODES:
        raise TraceError(
            f"{source}: at load {load:g} the protocol sizes the cluster at {nodes:,.0f} nodes of {node_gpus} GPUs "
            f"(mean GPU demand {demand:,.4g} GPUs), more than the simulator models ({MAX_NODES:,})",
            "raise --load (the protocol's is 0.9), or check the trace's duration and num_gpu columns")
    by_load = math.ceil(nodes) * node_gpus
    biggest = math.ceil(max(j.gpus for j in jobs) / node_gpus) * node_gpus
    return by_load, biggest


def trace_users(jobs: list[TraceJob]) -> list[str]:
    """The users a trace names, sorted by name ([] without a ``user`` column)."""
    return sorted({j.user for j in jobs if j.user is not None})


def protocol_workloads(jobs: list[TraceJob], n_users: int = 20, zipf: float = 1.1, seed: int = 0
                       ) -> list[Workload]:
    """The trace's jobs as gangs, owned by the users the protocol draws (or, for a trace with a
    ``user`` column, by those users: ``n_users``, ``zipf`` and ``seed`` do not apply)."""
    if jobs and jobs[0].user is not None:
        owners = [j.user for j in jobs]
    else:
        owners = [user_name(int(u)) for u in assign_users(len(jobs), n_users, zipf, seed)]
    return [Workload(j.job_id, u, j.submit, gang_for_gpus(j.gpus, NODE_GPUS), duration=j.duration, seq=seq)
            for seq, (j, u) in enumerate(zip(jobs, owners))]


def protocol_nodes(c: int, node_gpus: int = NODE_GPUS) -> list[Node]:
    return [Node(f"node-{i:03d}", Resources(node_gpus)) for i in range(c // node_gpus)]


CUTS: dict[str, tuple[tuple[float, float, str], ...]] = {
    "full": ((0.0, 1.0, ""),),
    "halves": ((0.0, 0.5, "a"), (0.5, 1.0, "b")),
    "thirds": ((0.0, 1 / 3, "t1"), (1 / 3, 2 / 3, "t2"), (2 / 3, 1.0, "t3")),
    "middle": ((0.25, 0.75, "m"),),
}
"""Job mixes cut from a trace by submission-time quantiles: set -> (from, to, name suffix) per cut.
A cut is a job mix no setting was tuned on (new user draws only change who owns the same jobs)."""


PAIRS = "pairs"
"""The set of overlays (:func:`overlay`): each trace with the next one named, the last with the
first (two traces: one overlay)."""


def overlay(a: list[TraceJob], b: list[TraceJob], names: tuple[str, str]) -> list[TraceJob]:
    """Two traces' jobs as one cluster's workload: each re-based so its first job submits at 0,
    merged in submission-time order (``a``'s job first at equal times), each job id prefixed with
    its trace's name (``names``) so ids stay unique; named users keep their names (one name on both
    traces is one user). This is two clusters consolidated onto one, its capacity set by the
    protocol from the merged demand: job mixes whose bursts overlap, with deeper backlogs than
    either trace has alone."""
    def rebased(jobs: list[TraceJob], name: str) -> list[TraceJob]:
        t0 = min((j.submit for j in jobs), default=0.0)
        return [TraceJob(f"{name}/{j.job_id}", j.submit - t0, j.duration, j.gpus, j.line, j.user) for j in jobs]

    merged = [(j.submit, 0, i, j) for i, j in enumerate(rebased(a, names[0]))]
    merged += [(j.submit, 1, i, j) for i, j in enumerate(rebased(b, names[1]))]
    return [j for *_, j in sorted(merged, key=lambda x: x[:3])]


def cut(jobs: list[TraceJob], lo: float, hi: float) -> list[TraceJob]:
    """The jobs submitted from the ``lo`` to (not including) the ``hi`` quantile of submission
    time, in file order, times re-based so the first submits at 0. The quantile ``q`` is the
    submission time of the ``int(n * q)``-th job in time order (0 and 1: no bound); the halves
    cut at the median, as ``make bench`` does."""
    subs = sorted(j.submit for j in jobs)
    n = len(subs)

    def bound(q: float) -> float:
        return -math.inf if q <= 0 else math.inf if q >= 1 else subs[min(int(n * q), n - 1)]

    low, high = bound(lo), bound(hi)
    sel = [j for j in jobs if low <= j.submit < high]
    if not sel:
        return []
    t0 = min(j.submit for j in sel)
    return [TraceJob(j.job_id, j.submit - t0, j.duration, j.gpus, j.line, j.user) for j in sel]
