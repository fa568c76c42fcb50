"""The replay engine (SPEC §3).

Projections register with the engine and receive every event in log order (per partition
on Kafka).  The engine applies a batch of events to every projection and stores the
applied offsets in table ``_positions`` **in the same SQLite transaction**, so a process
killed at any point restarts exactly where its last commit ended: nothing lost, nothing
applied twice.

Every event's bytes are checked against the digest the log recorded before anything else
(SPEC §9 "Replay trusts no byte"): a mismatch goes to ``_dead_letter`` with its position and
the reason ``digest mismatch``, and is never applied.  Events that cannot be decoded go to
``_dead_letter`` with their position; events that
decode but must not take effect (untrusted governance signature, a request after its
execution closed, a prefix reference that does not verify, ...) go to ``_rejected`` with
the reason.  Nothing is ever skipped silently.
"""

from __future__ import annotations

import gc
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol, Sequence

from ledger.algorithms.errors import InputError
from ledger.events.codec import Codec, CodecError, default_codec, event_digest
from ledger.events.signing import Trust
from ledger.log.base import CorruptStore, Log, LogRecord, Partition
from ledger.projections.governance_check import governance_problem
import hashlib
import sys
from ledger.log.sealing import bind_store_keystore

BATCH = 2000  # events per transaction of a run (fewer commits: each rewrites the pages the batch touched)
BATCH_BYTES = 64 << 20  # ... or fewer, once their values reach this size (large requests: as many bytes as 500 of 130 KiB)
DIGEST_MISMATCH = "digest mismatch"  # the dead-letter reason of an event whose bytes are not the log's digest
_ENGINE_SCHEMA = """
CREATE TABLE IF NOT EXISTS _positions (stream TEXT NOT NULL, partition INTEGER NOT NULL, next_offset INTEGER NOT NULL,
                                       PRIMARY KEY (stream, partition));
CREATE TABLE IF NOT EXISTS _dead_letter (stream TEXT NOT NULL, partition INTEGER NOT NULL, "offset" INTEGER NOT NULL,
                                         event_id TEXT, error TEXT NOT NULL, PRIMARY KEY (stream, partition, "offset"));
CREATE TABLE IF NOT EXISTS _projection_schema (projection TEXT PRIMARY KEY, fingerprint TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS _rejected (stream TEXT NOT NULL, partition INTEGER NOT NULL, "offset" INTEGER NOT NULL,
                                      event_id TEXT NOT NULL, event_type TEXT NOT NULL, projection TEXT NOT NULL,
                                      reason TEXT NOT NULL, PRIMARY KEY (stream, partition, "offset", projection));
CREATE TABLE IF NOT EXISTS _erase_scrub (execution_id TEXT PRIMARY KEY);
"""


class Rejected(InputError):
    """Raised by a projection's ``apply`` when an event must not take effect (reason recorded)."""


def record_rejected(db: sqlite3.Connection, rows: Sequence[tuple[str, int, int, str, str, str, str]]) -> None:
    """Write ``_rejected`` rows ``(stream, partition, offset, event_id, event_type, projection, reason)``:
    the engine's record of a :class:`Rejected`, and of an event a projection applied and later had
    to undo the way a replay refuses it (an erase purge: ``projections.tree``)."""
    db.executemany("INSERT OR REPLACE INTO _rejected VALUES (?,?,?,?,?,?,?)", rows)


class Applied:
    """What the engine hands a projection: the decoded event and where it sits in the log
    (``type``: the event's type, read once here rather than by every projection)."""

    __slots__ = ("event", "record", "type")

    def __init__(self, event: dict, record: LogRecord) -> None:
        self.event, self.record, self.type = event, record, event["event_type"]

    def __repr__(self) -> str:
        return f"Applied({self.type}, {self.event.get('event_id')!r})"


class Projection(Protocol):
    name: str
    # optional ``event_types``: a frozenset of the event types ``apply`` acts on; the engine then
    # calls ``apply`` only for those (absent or ``None``: every event)

    def create(self, db: sqlite3.Connection) -> None:
        """Create the projection's tables (idempotent)."""

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        """Fold one event into the state; raise :class:`Rejected` to refuse it."""

    def finish(self, db: sqlite3.Connection) -> None:
        """Called once per batch, inside the batch's transaction, after all ``apply`` calls.  A
        projection that undoes there events it applied (an erase purge) may list them in an
        attribute ``refused_after_apply`` of ``(natural key, event type, reason)``: the engine
        records each in ``_rejected`` at the event's log position, as a replay refusing it would."""

    def reset(self) -> None:
        """Forget in-memory caches (after a rollback or a rebuild)."""


class TableProjection:
    """Base of a projection whose whole state is its tables: ``create`` runs ``SCHEMA`` (idempotent DDL),
    and there is no in-memory cache to forget and no per-batch work (subclasses override as needed)."""

    name: str
    SCHEMA: str = ""

    def create(self, db: sqlite3.Connection) -> None:
        db.executescript(self.SCHEMA)

    def finish(self, db: sqlite3.Connection) -> None:
        pass

    def reset(self) -> None:
        pass


def connect(path: str | Path, *, busy_timeout: float = 30.0) -> sqlite3.Connection:
    """Open a projection database (WAL, synchronous=NORMAL is safe: WAL + atomic commits); a lock held
    by another process is waited for up to ``busy_timeout`` seconds."""
    db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=busy_timeout)
    try:
        db.execute("PRAGMA page_size=16384")  # only takes effect on a new database: packed token blobs fit in fewer pages
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        db.execute("PRAGMA secure_delete=ON")  # deleted rows and freed pages are zeroed: an erase purge leaves no copy
        db.executescript(_ENGINE_SCHEMA)
    except sqlite3.DatabaseError as exc:
        db.close()
        raise CorruptStore(f"{path}: the projection database is damaged or not a SQLite database ({exc}); "
                           "delete it and run `ledger project --rebuild`") from None
    return db


@dataclass
class RunStats:
    applied: int = 0
    dead_letters: int = 0
    rejected: int = 0


def schema_fingerprint(projection) -> str:
    """What a projection's stored state depends on besides the log: its module's table definitions
    (``_SCHEMA``) and its ``rules_version`` (bumped when a rule changes what rows it writes)."""

    module = sys.modules.get(type(projection).__module__)
    text = f"{type(projection).__qualname__}\x00{getattr(module, '_SCHEMA', '')}\x00{getattr(projection, 'rules_version', '')}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class ReplayEngine:
    """Drives projections from a log into one SQLite database."""

    def __init__(self, log: Log, db: sqlite3.Connection, projections: Sequence[Projection], *,
                 trust: Trust | None = None, codec: Codec | None = None, dispatch: bool = True) -> None:
        """``dispatch=False``: call every projection's ``apply`` for every event, ignoring their
        ``event_types`` (the slow path the dispatch is checked against, tests/test_perf_paths.py)."""
        self.log, self.db, self.projections = log, db, list(projections)
        self._dispatch = dispatch
        self._by_type: dict[str, tuple[Projection, ...]] = {}
        self.trust = trust or Trust()
        self.codec = codec or default_codec()

        bind_store_keystore(self.projections, log)  # sealed requests open with the store's own data keys
        self.rebuilt_for: list[str] = self._check_schemas()
        for p in self.projections:
            p.create(db)
        self._record_schemas()

    def _record_schemas(self) -> None:
        self.db.executemany("INSERT OR REPLACE INTO _projection_schema VALUES (?,?)",
                            [(p.name, schema_fingerprint(p)) for p in self.projections])
        self.db.commit()

    def _check_schemas(self) -> list[str]:
        """Projections whose tables were made by other code than this release's: the database is
        derived state, so it is rebuilt from the log (a release that adds a column or changes a rule
        never reads stale rows).  A database from before fingerprints existed that holds applied
        positions is rebuilt too.  Returns the names that forced the rebuild."""
        db = self.db
        has = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        stored = dict(db.execute("SELECT projection, fingerprint FROM _projection_schema").fetchall()) \
            if "_projection_schema" in has else {}
        if not stored:
            applied = "_positions" in has and db.execute("SELECT 1 FROM _positions LIMIT 1").fetchone() is not None
            stale = [p.name for p in self.projections] if applied else []
        else:
            stale = [p.name for p in self.projections if p.name in stored and stored[p.name] != schema_fingerprint(p)]
        if stale:
            self.rebuild()
        else:
            db.executescript(_ENGINE_SCHEMA)
        return stale

    def positions(self) -> dict[Partition, int]:
        return {(s, p): o for s, p, o in self.db.execute("SELECT stream, partition, next_offset FROM _positions")}

    def rebuild(self) -> None:
        """Drop every table and start from an empty database."""
        tables = [r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%'")]
        self.db.execute("BEGIN IMMEDIATE")
        for t in tables:
            self.db.execute(f'DROP TABLE "{t}"')
        self.db.execute("COMMIT")
        self.db.executescript(_ENGINE_SCHEMA)
        for p in self.projections:
            p.reset()
            p.create(self.db)
        self._record_schemas()
        if not self._truncate_wal():  # the dropped pages' older images may sit in the WAL: scrub it later
            self.db.execute("INSERT OR IGNORE INTO _erase_scrub VALUES ('')")

    def _truncate_wal(self) -> bool:
        """Checkpoint the WAL into the database and truncate it to zero bytes (True when done; False
        when a reader kept it busy, or the database is not in WAL mode)."""
        busy, _, _ = self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return busy == 0

    def scrub(self) -> bool:
        """Finish an erase purge (SPEC 11.7): a projection that deleted erased token payloads left a
        row in ``_erase_scrub``; the deleted bytes are zeroed in the database file (``secure_delete``)
        but older page images may remain in the WAL until it is truncated.  Truncates it and clears
        the rows; returns False (the rows stay, ``ledger audit`` reports them) when a reader kept
        the WAL busy.  Called at the end of :meth:`run` and :meth:`apply`; cheap when nothing is
        pending."""
        if self.db.execute("SELECT 1 FROM _erase_scrub LIMIT 1").fetchone() is None:
            return True
        if not self._truncate_wal():
            return False
        self.db.execute("DELETE FROM _erase_scrub")
        return self._truncate_wal()

    def run(self, *, until: dict[Partition, int] | None = None,
            progress: Callable[[int, int], None] | None = None) -> RunStats:
        """Apply everything from the stored positions up to ``until`` (default: the log's end)."""
        ends = until if until is not None else self.log.end_offsets()
        done = self.positions()
        total = sum(max(0, e - done.get(w, 0)) for w, e in ends.items())
        stats = RunStats()
        for where in self.log.partitions():
            if where not in ends:
                continue
            start = done.get(where, 0)
            if start >= ends[where]:
                continue
            batch: list[LogRecord] = []
            size = 0
            for rec in self.log.read(where, start, ends[where]):
                batch.append(rec)
                size += len(rec.value)
                if len(batch) >= BATCH or size >= BATCH_BYTES:
                    self._apply_batch(where, batch, stats)
                    batch, size = [], 0
                    if progress:
                        progress(stats.applied + stats.dead_letters + stats.rejected, total)
            if batch:
                self._apply_batch(where, batch, stats)
                if progress:
                    progress(stats.applied + stats.dead_letters + stats.rejected, total)
        self.scrub()
        return stats

    def apply(self, where: Partition, records: Sequence[LogRecord]) -> RunStats:
        """Apply ``records`` of one partition (in offset order) as one transaction, with the new position.

        For followers that are handed records by a consumer (``ledger project --follow``):
        records below the position stored for ``where`` -- read inside the transaction -- are
        skipped, so a record delivered twice (a rebalance, a re-seek) is never applied twice.
        """
        stats = RunStats()
        if records:
            self._apply_batch(where, records, stats, skip_applied=True)
            self.scrub()
        return stats

    def _apply_batch(self, where: Partition, batch: Iterable[LogRecord], stats: RunStats, *,
                     skip_applied: bool = False) -> None:
        """One transaction: ``batch`` applied, the position after it stored.  Python's cyclic garbage
        collector waits until the batch is done (its young-generation passes, every 700 allocations,
        were 7-11 % of a replay; the batch's objects die by reference counting or are collected right
        after it, so memory stays bounded by a batch)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._apply_transaction(where, batch, stats, skip_applied=skip_applied)
        finally:
            if collecting:
                gc.enable()

    def _apply_transaction(self, where: Partition, batch: Iterable[LogRecord], stats: RunStats, *,
                           skip_applied: bool) -> None:
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            if skip_applied:
                row = db.execute("SELECT next_offset FROM _positions WHERE stream = ? AND partition = ?",
                                 (where[0], where[1])).fetchone()
                if row is not None:
                    batch = [rec for rec in batch if rec.offset >= row[0]]
                    if not batch:
                        db.execute("COMMIT")
                        return
            last = None
            for rec in batch:
                last = rec
                if event_digest(rec.value) != rec.digest:  # SPEC §9 "Replay trusts no byte"
                    db.execute('INSERT OR REPLACE INTO _dead_letter VALUES (?,?,?,?,?)',
                               (rec.stream, rec.partition, rec.offset, rec.event_id, DIGEST_MISMATCH))
                    stats.dead_letters += 1
                    continue
                try:
                    ev = self.codec.decode(rec.value)
                except CodecError as exc:
                    db.execute('INSERT OR REPLACE INTO _dead_letter VALUES (?,?,?,?,?)',
                               (rec.stream, rec.partition, rec.offset, rec.event_id, str(exc)))
                    stats.dead_letters += 1
                    continue
                problem = governance_problem(ev, self.trust)
                if problem:
                    self._reject(rec, ev, "engine", problem)
                    stats.rejected += 1
                    continue
                item = Applied(ev, rec)
                targets = self._by_type.get(item.type)
                if targets is None:
                    targets = self._targets(item.type)
                for p in targets:
                    try:
                        p.apply(db, item)
                    except Rejected as exc:
                        self._reject(rec, ev, p.name, str(exc))
                        stats.rejected += 1
                stats.applied += 1
            for p in self.projections:
                p.finish(db)
                self._record_refused_after_apply(p)
            if last is not None:
                db.execute("INSERT OR REPLACE INTO _positions VALUES (?,?,?)", (where[0], where[1], last.offset + 1))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            for p in self.projections:
                p.reset()
            raise

    def _targets(self, event_type: str) -> tuple[Projection, ...]:
        """The projections whose ``apply`` acts on ``event_type`` (all of them without dispatch), in order."""
        found = tuple(p for p in self.projections if not self._dispatch
                      or getattr(p, "event_types", None) is None or event_type in p.event_types)
        self._by_type[event_type] = found
        return found

    def _record_refused_after_apply(self, p) -> None:
        """``_rejected`` rows for the events ``p`` applied and then undid (see :meth:`Projection.finish`),
        each at its position in the log (looked up by natural key: rare, an erasure's requests)."""
        late = getattr(p, "refused_after_apply", None)
        if not late:
            return
        rows = []
        for key, event_type, reason in late:
            rec = self.log.lookup(key)
            if rec is not None:
                rows.append((rec.stream, rec.partition, rec.offset, rec.event_id, event_type, p.name, reason))
        late.clear()
        record_rejected(self.db, rows)

    def _reject(self, rec: LogRecord, ev: dict, projection: str, reason: str) -> None:
        record_rejected(self.db, [(rec.stream, rec.partition, rec.offset, rec.event_id, ev["event_type"], projection, reason)])


def canonical_dump(db: sqlite3.Connection) -> str:
    """Every table's schema and rows in a stable order (blobs as hex): equal dumps = equal state.
    (``_projection_schema`` says which code made the tables, not what the log holds, so it is left out.)"""
    out = []
    for name, sql in db.execute("SELECT name, sql FROM sqlite_master WHERE type='table' AND name NOT LIKE 'sqlite_%' "
                                "AND name != '_projection_schema' ORDER BY name"):
        out.append(sql)
        cols = [r[1] for r in db.execute(f'PRAGMA table_info("{name}")')]
        rows = db.execute(f'SELECT * FROM "{name}"').fetchall()
        rendered = sorted(
            "|".join(v.hex() if isinstance(v, (bytes, memoryview)) else repr(v) for v in (bytes(x) if isinstance(x, memoryview) else x for x in row))
            for row in rows
        )
        out.append(",".join(cols))
        out.extend(rendered)
    return "\n".join(out)


def connect_scratch() -> sqlite3.Connection:
    """A throwaway projection database (a replay to compare against): SQLite's private temporary
    database, kept in memory until it outgrows the page cache, then spilled to a temporary file
    deleted on close; no durability (journal in memory, no fsync).  Opened with URI file names,
    so that the database under test can be attached read-only (``file:...?mode=ro``)."""
    db = sqlite3.connect("", isolation_level=None, check_same_thread=False, uri=True)
    db.execute("PRAGMA page_size=16384")
    db.execute("PRAGMA journal_mode=MEMORY")
    db.execute("PRAGMA synchronous=OFF")
    db.execute("PRAGMA cache_size=-65536")  # 64 MiB in memory before it spills to its temporary file
    db.executescript(_ENGINE_SCHEMA)
    return db


@dataclass
class TableDifference:
    """One table of an attached database that differs from the same table in ``main``.

    ``missing``: the table is absent there; ``definition``: its CREATE statement differs; else
    ``extra`` rows are there but not in ``main``, ``absent`` rows in ``main`` but not there, and
    ``sample`` is one such row as ``{column: value}`` with, when a row of ``main`` has the same
    primary key, the columns whose values differ as ``{column: (there, main)}`` in ``changed``."""

    table: str
    missing: bool = False
    definition: bool = False
    extra: int = 0
    absent: int = 0
    sample: dict | None = None
    changed: dict | None = None


def table_differences(db: sqlite3.Connection, other: str, *, skip: Iterable[str] = ("_projection_schema",),
                      where: dict[str, tuple[str, Sequence]] | None = None) -> list[TableDifference]:
    """Every table of ``main`` compared row for row with the same table in the attached schema
    ``other`` (set semantics plus row counts, in SQL: no row is copied into Python unless it
    differs).  ``where``: per table, an SQL condition and its parameters limiting both sides."""
    out = []
    theirs = dict(db.execute(f'SELECT name, sql FROM "{other}".sqlite_master WHERE type = \'table\'').fetchall())
    for name, sql in db.execute("SELECT name, sql FROM main.sqlite_master WHERE type = 'table' AND name NOT LIKE "
                                "'sqlite_%' ORDER BY name").fetchall():
        if name in skip:
            continue
        if name not in theirs or theirs[name] != sql:
            out.append(TableDifference(name, missing=name not in theirs, definition=name in theirs))
            continue
        cond, params = (where or {}).get(name, ("1", ()))
        diff = _rows_differ(db, other, name, cond, tuple(params))
        if diff is not None:
            out.append(diff)
    return out


def _rows_differ(db: sqlite3.Connection, other: str, name: str, cond: str, params: tuple) -> TableDifference | None:
    cols = [(r[1], r[5]) for r in db.execute(f'PRAGMA main.table_info("{name}")')]
    names, keyed = [c for c, _pk in cols], any(pk for _c, pk in cols)
    sizes = [db.execute(f'SELECT count(*) FROM {s}."{name}" WHERE {cond}', params).fetchone()[0] for s in (other, "main")]
    extra = _unmatched(db, other, "main", name, names if keyed else None, cond, params)
    if keyed and not extra and sizes[0] == sizes[1]:
        return None  # a primary key: no duplicate rows, so equal counts and nothing unmatched = equal
    absent = _unmatched(db, "main", other, name, names if keyed else None, cond, params)
    if not extra and not absent and sizes[0] == sizes[1]:
        return None
    diff = TableDifference(name, extra=extra or max(0, sizes[0] - sizes[1]), absent=absent or max(0, sizes[1] - sizes[0]))
    mine, there = f'SELECT * FROM main."{name}" WHERE {cond}', f'SELECT * FROM "{other}"."{name}" WHERE {cond}'
    row = db.execute(f"{there} EXCEPT {mine} LIMIT 1" if extra else f"{mine} EXCEPT {there} LIMIT 1",
                     params + params).fetchone()
    if row is not None:
        diff.sample = dict(zip(names, row))
        keys = [c for c, pk in sorted(cols, key=lambda c: c[1]) if pk]
        if extra and keys:
            match = db.execute(f'SELECT * FROM main."{name}" WHERE ' + " AND ".join(f'"{k}" IS ?' for k in keys),
                               [diff.sample[k] for k in keys]).fetchone()
            if match is not None:
                diff.changed = {c: (a, b) for c, a, b in zip(names, row, match) if a != b}
    return diff


def _unmatched(db: sqlite3.Connection, a: str, b: str, name: str, cols: list[str] | None, cond: str,
               params: tuple) -> int:
    """Rows of ``a.name`` (those meeting ``cond``) with no identical row in ``b.name``: with ``cols``
    (a table with a primary key) a correlated lookup on every column, which the key's index
    answers without copying a row; without, ``EXCEPT`` (distinct rows)."""
    if cols is None:
        return db.execute(f'SELECT count(*) FROM (SELECT * FROM "{a}"."{name}" WHERE {cond} EXCEPT '
                          f'SELECT * FROM "{b}"."{name}" WHERE {cond})', params + params).fetchone()[0]
    same = " AND ".join(f'y."{c}" IS x."{c}"' for c in cols)
    return db.execute(f'SELECT count(*) FROM "{a}"."{name}" AS x WHERE ({cond}) AND NOT EXISTS '
                      f'(SELECT 1 FROM "{b}"."{name}" AS y WHERE {same})', params).fetchone()[0]
