"""The usage ledger: an append-only record of usage intervals plus decayed aggregates.

Storage is SQL through SQLAlchemy: ``sqlite:///path`` (WAL mode, the embedded default) or any
SQLAlchemy URL, e.g. ``postgresql+psycopg://...`` for an HA controller pair.

Tables:

- ``usage_intervals``: one row per finished (or checkpointed) interval of a workload holding
  resources: user, workload, GPUs/CPUs/GB, start, end. Append-only, one row per workload and
  start, so a retried ``record`` is a no-op (until compaction folds the first copy away).
- ``usage_aggregates``: per user, decayed GPU-s/CPU-s/GB-s *as of* a time: the intervals that
  compaction folded in.
- ``ledger_meta``: the half-life the ledger was written with and the compaction watermark.
  Aggregates were decayed with that half-life, so once there are any, opening the ledger with
  another one is refused (the aggregates cannot be re-decayed); before that, the first write
  records the new one.

Crash safety: each ``record`` is one transaction; compaction folds intervals into aggregates and
deletes them in *one* transaction, so a ``kill -9`` at any point leaves either the state before
or after, never half. Nothing derived is trusted across restarts: :meth:`recover` rebuilds the
in-memory aggregates from the tables on open.

Decay is exact (see :mod:`.usage`): an interval ``[s, e]`` at rate ``r`` contributes, at ``t >= e``,
``r * h/ln2 * (2^-((t-e)/h) - 2^-((t-s)/h))``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import LedgerError
from .model import Resources
from .usage import LN2, RuntimeHistory


@dataclass(frozen=True)
class Interval:
    workload: str
    user: str
    resources: Resources
    start: float
    end: float


def interval_usage(r: Resources, start: float, end: float, now: float, half_life: float) -> Resources:
    """Decayed resource-seconds of an interval, evaluated at ``now`` (clipped to ``now``)."""
    end = min(end, now)
    if end <= start:
        return Resources()
    if math.isinf(half_life):
        k = end - start
    else:
        k = half_life / LN2 * (2.0 ** (-(now - end) / half_life) - 2.0 ** (-(now - start) / half_life))
    return r.scale(k)


def redact_url(url: str) -> str:
    """``url`` with its password masked (``postgresql+psycopg://kfp:***@db/ledger``)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy parses: mask what looks like user:password@
        return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


def _check_sqlite_file(url: str) -> None:
    """SQLite creates a missing file on connect: a mistyped path would read as an empty ledger."""
    from sqlalchemy.engine import make_url

    try:
        u = make_url(url)
    except Exception:
        return  # create_engine reports a bad URL
    if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:" and not Path(u.database).is_file():
        db = Path(u.database)
        where = str(db) if db.is_absolute() else f"{db} (relative to {Path.cwd()})"
        hint = "check --ledger: it is the scheduler's ledger URL, created when the scheduler first starts"
        if not db.is_absolute() and Path("/", db).is_file():  # SQLAlchemy's classic: three slashes, a relative path
            hint = (f"sqlite:///{db} names a path relative to this folder; the absolute path /{db} takes four "
                    f"slashes: --ledger sqlite:////{db}")
        if db.is_dir():
            raise LedgerError(f"{where} is a folder, not a usage ledger",
                              f"give the ledger's file in it: --ledger sqlite:///{db}/FILE.db")
        raise LedgerError(f"no usage ledger at {where}", hint)


def _db_reason(e: BaseException) -> str:
    """The database's own words for ``e``: SQLAlchemy wraps them with the SQL it ran and a
    "Background on this error" link, which tell a user of the CLI nothing."""
    orig = getattr(e, "orig", None)
    return " ".join(str(orig if orig is not None else e).split())


def _db_hint(url: str, e: BaseException) -> str:
    if url.startswith("sqlite") and "not a database" in str(e):
        return "that file is not a SQLite database: check --ledger (sqlite:///PATH of the scheduler's ledger)"
    if url.startswith("sqlite"):
        return "check --ledger (sqlite:///PATH of the scheduler's ledger) and that its folder may be written"
    return "check --ledger (sqlite:///PATH of the scheduler's ledger, or a database URL) and that the database server is up"


def _decay(r: Resources, dt: float, half_life: float) -> Resources:
    if dt <= 0 or math.isinf(half_life):
        return r
    return r.scale(2.0 ** (-dt / half_life))


DEFAULT_HALF_LIFE = 7 * 86400.0


class UsageLedger:
    """``half_life`` None: the one the ledger was written with, else 7 days. ``must_exist``: open
    only a ledger that is there (for reading it), never create one."""

    def __init__(self, url: str | Path = "sqlite:///fairshare-ledger.db", half_life: float | None = None,
                 must_exist: bool = False):
        from sqlalchemy import (Column, Float, Index, Integer, MetaData, String, Table, create_engine, event)

        if half_life is not None and not half_life > 0:  # NaN too; math.inf means no decay
            raise LedgerError(f"half_life: must be > 0 seconds, got {half_life!r}", "Slurm's default is 7 days (604800)")
        url = str(url)
        if "://" not in url:
            url = f"sqlite:///{url}"
        self.url = url
        self.display_url = redact_url(url)
        """The URL with any password masked: the one messages and listings show."""
        if must_exist:
            _check_sqlite_file(url)
        from sqlalchemy.exc import NoSuchModuleError

        try:
            self.engine = create_engine(url, future=True)
        except NoSuchModuleError as e:  # a scheme SQLAlchemy has no dialect or driver for (a typo, bogus://)
            scheme = url.split("://", 1)[0]
            raise LedgerError(f"cannot open usage ledger {self.display_url!r}: SQLAlchemy has no database "
                              f"dialect or driver {scheme!r}",
                              "use sqlite:///PATH, or postgresql+psycopg://USER@HOST/DB for a shared one "
                              "(pip install 'kfp-pytorch[postgres]')") from e
        except ImportError as e:  # the URL names a driver that is not installed
            raise LedgerError(f"cannot open usage ledger {self.display_url!r}: {e}",
                              "for PostgreSQL: pip install 'kfp-pytorch[postgres]' and use postgresql+psycopg://...") from e
        except Exception as e:  # bad URL
            raise LedgerError(f"cannot open usage ledger {self.display_url!r}: {e}",
                              "use sqlite:///PATH or a SQLAlchemy URL such as postgresql+psycopg://...") from e
        if url.startswith("sqlite"):
            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn, _):  # WAL + full sync: committed means on disk
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=FULL")
                cur.close()
        md = MetaData()
        self.intervals = Table(
            "usage_intervals", md,
            Column("id", Integer, primary_key=True, autoincrement=True),
            Column("workload", String(253), nullable=False), Column("user", String(253), nullable=False, index=True),
            Column("gpu", Float, nullable=False), Column("cpu", Float, nullable=False),
            Column("memory_gb", Float, nullable=False), Column("start", Float, nullable=False),
            Column("end", Float, nullable=False, index=True))
        # one interval per workload and start: a retried record (the writer died before it learnt
        # that its commit landed) is recognised, not counted twice
        self._once = Index("uq_usage_intervals_workload_start", self.intervals.c.workload, self.intervals.c.start,
                           unique=True)
        self.aggregates = Table(
            "usage_aggregates", md,
            Column("user", String(253), primary_key=True), Column("gpu_s", Float, nullable=False),
            Column("cpu_s", Float, nullable=False), Column("gb_s", Float, nullable=False),
            Column("as_of", Float, nullable=False))
        self.meta = Table("ledger_meta", md, Column("key", String(64), primary_key=True),
                          Column("value", String(256), nullable=False))
        try:
            self._open(md, half_life, must_exist)
        except LedgerError:
            self.engine.dispose()  # no pooled connection outlives a refused open
            raise

    def _open(self, md, half_life: float | None, must_exist: bool) -> None:
        url = self.display_url
        if must_exist:
            self._check_tables()
        try:
            md.create_all(self.engine)
        except Exception as e:
            hint = _db_hint(self.url, e)
            if not self.url.startswith("sqlite"):
                hint += ", and that the URL's user may create tables"
            raise LedgerError(f"cannot create the ledger tables at {url}: {_db_reason(e)}", hint) from e
        try:  # a ledger written before the index existed gets it now
            self._once.create(self.engine, checkfirst=True)
        except Exception as e:
            raise LedgerError(f"cannot index the usage intervals of {url}: {_db_reason(e)}",
                              "a workload has two intervals with the same start: remove the duplicate row") from e
        meta = self._read_meta()
        stored = float(meta["half_life"]) if "half_life" in meta else None
        self.half_life = half_life if half_life is not None else (stored or DEFAULT_HALF_LIFE)
        self._meta_half_life = stored
        self.compacted_before: float | None = float(meta["compacted_before"]) if "compacted_before" in meta else None
        """Intervals that ended at or before this were folded into the aggregates (None: never compacted)."""
        self.recover()
        if stored is not None and not math.isclose(stored, self.half_life) and self._base:
            raise LedgerError(
                f"usage ledger {url} holds usage compacted with a half-life of {stored:g} s; it cannot be read "
                f"with {self.half_life:g} s (compacted usage cannot be re-decayed)",
                f"read it with a half-life of {stored:g} s (--half-life, or the scheduler config's half_life), "
                "or start a new ledger to change the half-life")

    def _check_tables(self) -> None:
        from sqlalchemy import inspect

        try:
            names = set(inspect(self.engine).get_table_names())
        except Exception as e:
            raise LedgerError(f"cannot open usage ledger {self.display_url}: {_db_reason(e)}",
                              _db_hint(self.url, e)) from e
        missing = [t for t in ("usage_intervals", "usage_aggregates", "ledger_meta") if t not in names]
        if missing:
            raise LedgerError(f"{self.display_url} holds no usage ledger (missing tables: {', '.join(missing)})",
                              "check --ledger: it is the scheduler's ledger URL, created when the scheduler first starts")

    def _read_meta(self) -> dict[str, str]:
        from sqlalchemy import select

        with self.engine.connect() as conn:
            return {r.key: r.value for r in conn.execute(select(self.meta)).all()}

    def _set_meta(self, conn, key: str, value: float) -> None:
        conn.execute(self.meta.delete().where(self.meta.c.key == key))
        conn.execute(self.meta.insert().values(key=key, value=repr(float(value))))

    # -- writes --------------------------------------------------------------------------------
    def record(self, iv: Interval) -> bool:
        """Append one interval (one transaction: committed means durable). Idempotent: recording
        the same interval again (a retry after a crash) changes nothing and returns False; another
        interval of the same workload with the same start is refused."""
        from sqlalchemy import select
        from sqlalchemy.exc import IntegrityError

        r = iv.resources
        if not all(math.isfinite(v) for v in (iv.start, iv.end, r.gpu, r.cpu, r.memory_gb)):
            raise LedgerError(f"interval of {iv.workload}: start, end and resources must be finite numbers, got {iv}")
        if min(r.gpu, r.cpu, r.memory_gb) < 0:
            raise LedgerError(f"interval of {iv.workload}: resources must be >= 0, got {r}",
                              "record what the workload held: GPUs, CPUs and GB of memory")
        if iv.end < iv.start:
            raise LedgerError(f"interval of {iv.workload} ends before it starts ({iv.start} > {iv.end})")
        try:
            with self.engine.begin() as conn:
                conn.execute(self.intervals.insert().values(
                    workload=iv.workload, user=iv.user, gpu=iv.resources.gpu, cpu=iv.resources.cpu,
                    memory_gb=iv.resources.memory_gb, start=iv.start, end=iv.end))
                if self._meta_half_life != self.half_life:
                    self._set_meta(conn, "half_life", self.half_life)
        except IntegrityError:
            t = self.intervals
            with self.engine.connect() as conn:
                row = conn.execute(select(t).where(t.c.workload == iv.workload, t.c.start == iv.start)).first()
            if row is None:
                raise
            if (row.user, row.gpu, row.cpu, row.memory_gb, row.end) == (iv.user, r.gpu, r.cpu, r.memory_gb, iv.end):
                return False  # recorded already: the earlier commit landed
            raise LedgerError(
                f"interval of {iv.workload} starting at {iv.start:g} is already recorded, as user {row.user}, "
                f"{Resources(row.gpu, row.cpu, row.memory_gb)}, ending at {row.end:g}; got {iv}",
                "an interval is recorded once: record what followed as a new interval starting where it ended") from None
        self._meta_half_life = self.half_life
        self._add(iv.user, iv.resources, iv.start, iv.end)
        return True

    def compact(self, before: float) -> int:
        """Fold intervals that ended at or before ``before`` into the aggregates; returns how many.

        The aggregates are decayed to ``before``, so ``before`` must not be in the future: until
        then, :meth:`usage` would count the folded usage as already decayed."""
        from sqlalchemy import delete, select

        h = self.half_life
        with self.engine.begin() as conn:  # one transaction: all or nothing
            rows = conn.execute(select(self.intervals).where(self.intervals.c.end <= before)).all()
            if not rows:
                return 0
            aggs = {r.user: (Resources(r.gpu_s, r.cpu_s, r.gb_s), r.as_of)
                    for r in conn.execute(select(self.aggregates)).all()}
            for r in rows:
                base, as_of = aggs.get(r.user, (Resources(), before))
                t = max(as_of, before)
                base = _decay(base, t - as_of, h) + interval_usage(Resources(r.gpu, r.cpu, r.memory_gb),
                                                                     r.start, r.end, t, h)
                aggs[r.user] = (base, t)
            for user, (res, as_of) in aggs.items():
                conn.execute(self.aggregates.delete().where(self.aggregates.c.user == user))
                conn.execute(self.aggregates.insert().values(user=user, gpu_s=res.gpu, cpu_s=res.cpu,
                                                             gb_s=res.memory_gb, as_of=as_of))
            conn.execute(delete(self.intervals).where(self.intervals.c.end <= before))
            self._set_meta(conn, "half_life", h)
            watermark = max(before, self.compacted_before) if self.compacted_before is not None else before
            self._set_meta(conn, "compacted_before", watermark)
        self._meta_half_life, self.compacted_before = h, watermark
        self.recover()
        return len(rows)

    # -- reads ---------------------------------------------------------------------------------
    def recover(self) -> None:
        """Rebuild the in-memory aggregates from the tables (after open, crash or compaction)."""
        from sqlalchemy import select

        self._base: dict[str, tuple[Resources, float]] = {}
        self._open: dict[str, list[tuple[Resources, float, float]]] = {}
        with self.engine.connect() as conn:
            for r in conn.execute(select(self.aggregates)).all():
                self._base[r.user] = (Resources(r.gpu_s, r.cpu_s, r.gb_s), r.as_of)
            for r in conn.execute(select(self.intervals)).all():
                self._open.setdefault(r.user, []).append((Resources(r.gpu, r.cpu, r.memory_gb), r.start, r.end))

    def _add(self, user: str, r: Resources, start: float, end: float) -> None:
        self._open.setdefault(user, []).append((r, start, end))

    def usage(self, now: float) -> dict[str, Resources]:
        """Decayed usage of every user at ``now`` (resource-seconds). Exact at or after
        :attr:`compacted_before`; before it, folded usage is as of the watermark (nothing finer is kept)."""
        out: dict[str, Resources] = {}
        for user, (base, as_of) in self._base.items():
            out[user] = _decay(base, now - as_of, self.half_life)
        for user, ivs in self._open.items():
            acc = out.get(user, Resources())
            for r, s, e in ivs:
                acc = acc + interval_usage(r, s, e, now, self.half_life)
            out[user] = acc
        return out

    def intervals_count(self) -> int:
        from sqlalchemy import func, select

        with self.engine.connect() as conn:
            return conn.execute(select(func.count()).select_from(self.intervals)).scalar_one()

    def all_intervals(self) -> list[Interval]:
        from sqlalchemy import select

        with self.engine.connect() as conn:
            return [Interval(r.workload, r.user, Resources(r.gpu, r.cpu, r.memory_gb), r.start, r.end)
                    for r in conn.execute(select(self.intervals).order_by(self.intervals.c.id)).all()]

    def runtime_history(self) -> RuntimeHistory:
        """Run-time estimates (by user and gang size) from the intervals not yet compacted: what
        admission's EASY backfilling and reservations estimate with after a controller restart."""
        h = RuntimeHistory()
        for iv in self.all_intervals():
            h.record(iv.user, iv.resources.gpu, iv.end - iv.start)
        return h

    def close(self) -> None:
        self.engine.dispose()
