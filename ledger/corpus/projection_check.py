"""Projection databases checked against the log (SPEC 11.7).

A projection database is derived state: whatever it holds must be what a replay of the log
derives.  :func:`rederived` replays the log into a fresh temporary database up to the positions
the database under test has applied (``_positions``), attaches that database read-only and
compares every projection table row for row in SQL (:func:`projections.engine.table_differences`),
inside one read transaction, so a projector advancing it meanwhile is caught (the replay follows
it, up to :data:`ATTEMPTS` times).  ``ledger audit`` reports each difference naming the database,
the table, a row and the changed columns; ``manifest publish`` builds the manifest from the fresh
replay and refuses (:class:`ProjectionMismatch`, exit 1) when the store's database differs, so it
never signs a member the log does not derive.

No table and no row is exempt.  A database that applied a withdrawal with ``erase`` while the
data key still opened the covered requests was purged in place (:mod:`projections.tree`); the
purge leaves exactly what this replay -- which runs after the key is destroyed, so refuses those
requests -- derives, the ``_rejected`` rows of the purged requests included (the engine records
them at their log positions: ``refused_after_apply``), so the comparison needs no allowance for
erasures.

A database whose projections were made by other code (another release: the fingerprints in
``_projection_schema`` differ) is not compared: the next replay engine that opens it rebuilds it
from the log before anything reads it (``Rederived.skipped`` says why).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ledger.algorithms.errors import IntegrityError
from ledger.events.signing import Trust
from ledger.log.base import Log, Partition
from ledger.projections.engine import ReplayEngine, connect_scratch
from ledger.projections.engine import schema_fingerprint
from ledger.projections.engine import table_differences

ATTEMPTS = 3  # replays catching up with a database another projector keeps advancing
_SHOWN = 10  # differing tables named one by one
_STORE = "under_test"  # the attached database's schema name


class ProjectionMismatch(IntegrityError):
    """The projection database holds state the log does not derive (publish refuses, exit 1)."""

    def __init__(self, path: str | Path, problems: Sequence[str]) -> None:
        self.path, self.problems = str(path), list(problems)
        super().__init__(f"{path} does not match a replay of the log; nothing was signed or written: "
                         + "; ".join(self.problems))


@dataclass
class Rederived:
    """A fresh replay of the log and how the database under test compares with it."""

    db: sqlite3.Connection  # the fresh database (valid inside the ``with`` of :func:`rederived`)
    positions: dict[Partition, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    skipped: str | None = None  # why the database was not compared (made by other code)


@contextmanager
def rederived(log: Log, path: str | Path, projections: list, trust: Trust) -> Iterator[Rederived]:
    """Replay ``log`` with ``projections`` into a temporary database to the positions of the
    projection database at ``path`` and compare the two (see the module doc)."""

    fresh = connect_scratch()
    try:
        engine = ReplayEngine(log, fresh, projections, trust=trust)
        out = Rederived(fresh)
        _compare(engine, Path(path), out)
        yield out
    finally:
        fresh.close()


def _attach(db: sqlite3.Connection, path: Path) -> None:
    db.execute(f"ATTACH DATABASE ? AS {_STORE}", (path.resolve().as_uri() + "?mode=ro",))


def _compare(engine, path: Path, out: Rederived) -> None:
    db, ends = engine.db, engine.log.end_offsets()
    for _attempt in range(ATTEMPTS):
        _attach(db, path)
        try:
            wanted, out.skipped = _state_of(db, engine.projections)
        finally:
            db.execute(f"DETACH DATABASE {_STORE}")
        if out.skipped:
            return
        beyond = [f"{s}:{p}" for (s, p), o in wanted.items() if o > ends.get((s, p), 0)]
        if beyond:
            out.problems.append(f"{path}: applied positions {', '.join(beyond)} lie beyond the log's end "
                                "(a database of another log, or the log was rolled back)")
            return
        if any(o < engine.positions().get(w, 0) for w, o in wanted.items()):
            break  # went backwards (rebuilt meanwhile): the fresh replay cannot follow
        engine.run(until=wanted)
        _attach(db, path)
        try:
            db.execute("BEGIN")  # one snapshot of the attached database for the position check and the rows
            if _state_of(db, engine.projections)[0] == wanted:
                out.positions = wanted
                out.problems += _describe(path, db, engine.projections)
                return
        finally:
            db.execute("COMMIT")
            db.execute(f"DETACH DATABASE {_STORE}")
    out.problems.append(f"{path}: changed while it was being compared with the log ({ATTEMPTS} attempts); "
                        "run the check again")


def _state_of(db: sqlite3.Connection, projections: list) -> tuple[dict[Partition, int], str | None]:
    """The attached database's applied positions, and why it cannot be compared (if so)."""

    has = {r[0] for r in db.execute(f"SELECT name FROM {_STORE}.sqlite_master WHERE type = 'table'")}
    if not {"_positions", "_projection_schema"} <= has:
        return {}, "not a projection database made by this release (the replay engine rebuilds it)"
    made = dict(db.execute(f"SELECT projection, fingerprint FROM {_STORE}._projection_schema").fetchall())
    other = [p.name for p in projections if made.get(p.name) != schema_fingerprint(p)]
    if other:
        return {}, (f"projection(s) {', '.join(other)} made by other code (another release): the next "
                    "`ledger project` rebuilds it from the log")
    return {(s, p): o for s, p, o in db.execute(f"SELECT stream, partition, next_offset FROM {_STORE}._positions")}, None


def _describe(path: Path, db: sqlite3.Connection, projections: list) -> list[str]:

    names = sorted({p.name for p in projections} | {"engine"})
    only_ours = (f"projection IN ({','.join('?' * len(names))})", names)  # a plug-in projection's refusals are its own
    diffs = table_differences(db, _STORE, where={"_rejected": only_ours})
    out = [f"{path}: table {d.table}: {_what(d)}" for d in diffs[:_SHOWN]]
    if len(diffs) > _SHOWN:
        out.append(f"{path}: ... and {len(diffs) - _SHOWN} more tables differ from the log's replay")
    if out:
        out.append(f"{path}: rebuild it from the log with `ledger project --rebuild` (it is derived state)")
    return out


def _what(d) -> str:
    if d.missing:
        return "missing (a replay of the log creates it)"
    if d.definition:
        return "its definition differs from the one a replay of the log creates"
    counts = f"{d.extra} row(s) the log does not derive, {d.absent} row(s) it derives missing"
    if d.changed:
        cols = ", ".join(f"{c} = {_show(a)} where the log gives {_show(b)}" for c, (a, b) in d.changed.items())
        return f"{counts}; e.g. the row {_key(d.sample)} has {cols}"
    if d.sample is not None:
        return f"{counts}; e.g. {'' if d.extra else 'missing: '}the row {_key(d.sample)}"
    return counts


def _key(row: dict) -> str:
    items = list(row.items())[:4]
    return "(" + ", ".join(f"{c}={_show(v)}" for c, v in items) + (", ...)" if len(row) > 4 else ")")


def _show(v) -> str:
    if isinstance(v, (bytes, memoryview)):
        b = bytes(v)
        return f"<{len(b)} bytes {b[:8].hex()}{'...' if len(b) > 8 else ''}>"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def database_problems(log: Log, path: str | Path, projections: list, trust: Trust) -> tuple[list[str], str | None]:
    """``ledger audit``'s check of one projection database: (problems, why it was not compared)."""
    with rederived(log, path, projections, trust) as check:
        return check.problems, check.skipped
