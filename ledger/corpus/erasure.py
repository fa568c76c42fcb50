"""Erase that always finishes (SPEC §11.7): every step, every file of the store, resumable.

A withdrawal with ``erase`` is on the log before anything is destroyed; what follows touches
files the ledger does not own exclusively (another process may hold a lock, a file may be
damaged).  :func:`complete` runs each step on its own, so one file's failure never stops the
others, waits (bounded, ``wait`` seconds) for a busy file and retries it, and reports what it
could not do.  Every step is idempotent, so re-running it — ``ledger withdraw --resume`` or
the same ``withdraw --erase`` again — finishes the erasure:

1. the store's projection database (``--db``) catches up with the log: applying the
   withdrawal purges the erased token payloads there (``projections.tree``, secure_delete,
   WAL truncated); with ``rebuild`` it is then rebuilt from the log;
2. ``data-keys.db``: the covered data keys are destroyed (``ledger.corpus.withdraw.erase_keys``);
3. every other projection database in the store's folder catches up the same way;
4. ``gateway.db``: the restoration state of the erased executions is deleted.

:class:`ErasureCheck` is the audit side: fed every event ``ledger audit`` decodes, it names
each erased execution whose tokens are still readable somewhere in the store, and the file:
a projection database holding its tree nodes (or a purge whose WAL was not truncated), the
gateway's restoration state, a data key still in ``data-keys.db``, a request in the clear on
the log.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from ledger.log.base import CorruptStore, LogError
from ledger.log.sealing import KeyStore
from ledger.projections.governance import covered_executions, covered_subjects
from ledger.events.codec import CodecError, default_codec
from ledger.projections.governance_check import governance_problem
from ledger.projections.governance import covered_executions
from ledger.projections.governance import GovernanceProjection
from ledger.projections.engine import Applied, Rejected
from ledger.projections.registry import open_engine, store_keystore

__all__ = ["ERASE_WAIT", "ErasureCheck", "complete", "coverage_from_log", "erased_executions", "projection_files",
           "readable_in_projection", "retry_busy"]

ERASE_WAIT = 30.0  # seconds a busy file is waited for (then the step is reported and left for --resume)
_FIXED = ("index.db", "data-keys.db", "gateway.db")  # the store's files that are not projection databases
_COVERAGE_TYPES = ("execution_opened", "task_registered", "record_derived", "withdrawal", "request")
T = TypeVar("T")


def sealed_keys_of(db: sqlite3.Connection, executions: list[str]) -> dict[str, list[str]]:
    """key id -> executions whose requests are sealed under it (from the governance projection)."""
    out: dict[str, list[str]] = {}
    for i in range(0, len(executions), 500):
        chunk = executions[i:i + 500]
        for ex, kid in db.execute(f"SELECT execution_id, key_id FROM sealed_keys WHERE execution_id IN "
                                  f"({','.join('?' * len(chunk))}) ORDER BY execution_id, key_id", chunk):
            out.setdefault(kid, []).append(ex)
    return out


def erase_keys(db: sqlite3.Connection, keystore: KeyStore, subject: str, *, reason: str | None = None) -> dict:
    """Destroy the data key of every subject ``subject`` covers; report what could not be destroyed.

    A key is destroyed when its own subject is covered by the withdrawal (the subject
    itself, ``task:`` of its tasks, ``execution:`` of its executions and derived views, or
    every key for ``*``).  A covered record sealed under a *broader* subject's key (say
    ``source:S`` when only ``execution:X`` is erased) is listed under ``not_destroyed``:
    destroying that key would erase records the withdrawal does not cover."""

    subjects = covered_subjects(db, subject)
    if subject == "*":
        subjects = sorted(set(subjects) | set(keystore.subjects()))
    destroyed = []
    for s in subjects:
        kid = keystore.destroy(s, reason)
        if kid is not None:
            destroyed.append({"subject": s, "key_id": kid})
    originals, views = covered_executions(db, subject)
    not_destroyed = []
    for kid, exs in sorted(sealed_keys_of(db, originals + views).items()):
        if keystore.key_by_id(kid) is None:
            continue  # destroyed now or earlier
        owner = keystore.subject_of(kid)
        not_destroyed.append({"key_id": kid, "subject": owner, "executions": exs,
                              "why": f"the key belongs to {owner}, which this withdrawal does not cover; "
                                     f"withdraw {owner} with --erase to shred it"})
    return {"destroyed": destroyed, "not_destroyed": not_destroyed}


def _busy(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, sqlite3.OperationalError) and ("locked" in text or "busy" in text)


def retry_busy(fn: Callable[[float], T], wait: float, *, clock=time.monotonic, sleep=time.sleep) -> T:
    """``fn(timeout)`` until it does not fail on a busy / locked SQLite file, for at most ``wait``
    seconds in all (``timeout`` is what is left, for the connection's own busy handler); the last
    error is raised when the time is up.  Other errors are raised at once."""
    deadline = clock() + wait
    delay = 0.05
    while True:
        try:
            return fn(max(0.05, deadline - clock()))
        except sqlite3.OperationalError as exc:
            if not _busy(exc) or clock() >= deadline:
                raise
        sleep(min(delay, max(0.0, deadline - clock())))
        delay = min(delay * 2, 1.0)


def _why(exc: BaseException, wait: float) -> str:
    if _busy(exc):
        return f"busy: locked by another process for more than {wait:g} s"
    return f"damaged or unreadable ({exc})"


def _readonly(path: Path, timeout: float = 5.0) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=timeout)


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def projection_files(paths) -> list[Path]:
    """The store's projection database (``--db``) and every other projection database (a SQLite file
    with the engine's ``_positions`` and the tree's ``tree_nodes``) directly in an embedded store's folder."""
    own = Path(paths.db)
    out = [own]
    if paths.is_kafka:
        return out
    for f in sorted(Path(paths.url).glob("*.db")):
        if f.name in _FIXED or (own.exists() and f.resolve() == own.resolve()):
            continue
        try:
            db = _readonly(f)
            try:
                if {"_positions", "tree_nodes"} <= _tables(db):
                    out.append(f)
            finally:
                db.close()
        except sqlite3.DatabaseError:
            continue  # not a database the ledger made: nothing it can purge
    return out


def _chunks(items: list[str], n: int = 500) -> Iterable[list[str]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def _erased_nodes(db: sqlite3.Connection, executions: Iterable[str]) -> list[str]:
    """Erased executions that still have tree nodes (token payloads) in a projection database."""
    if "tree_nodes" not in _tables(db):
        return []
    out = []
    for chunk in _chunks(sorted(set(executions))):
        out += [f"erased execution {r[0]} still has {r[1]} tree node(s) with its tokens" for r in db.execute(
            f"SELECT execution_id, COUNT(*) FROM tree_nodes WHERE execution_id IN ({','.join('?' * len(chunk))}) "
            "GROUP BY execution_id ORDER BY execution_id", chunk)]
    return out


def readable_in_projection(db: sqlite3.Connection, executions: Iterable[str]) -> list[str]:
    """Problems of one projection database: erased executions that still have tree nodes there, and
    a purge whose WAL truncation did not happen yet (``_erase_scrub``)."""
    out = _erased_nodes(db, executions)
    if "_erase_scrub" in _tables(db) and db.execute("SELECT 1 FROM _erase_scrub LIMIT 1").fetchone() is not None:
        out.append("an erase purge is not finished: its WAL may still hold the deleted token payloads (another "
                   "process kept it open)")
    return out


def _gateway_rows(db: sqlite3.Connection, executions: Iterable[str]) -> list[str]:
    if "state" not in _tables(db):
        return []
    out = []
    for chunk in _chunks(sorted(set(executions))):
        out += [f"erased execution {r[0]} still has {r[1]} restoration state row(s) (digests of its messages)"
                for r in db.execute(f"SELECT execution_id, COUNT(*) FROM state WHERE execution_id IN "
                                    f"({','.join('?' * len(chunk))}) GROUP BY execution_id ORDER BY execution_id", chunk)]
    return out


# ---------------------------------------------------------------------- coverage
class _Coverage:
    """The governance projection's base tables in memory, fed event by event: what an erasure
    covers, computed from the log alone (no projection database needed)."""

    def __init__(self) -> None:

        self.db = sqlite3.connect(":memory:")
        self.projection = GovernanceProjection()
        self.projection.create(self.db)

    def observe(self, ev: dict, rec) -> None:

        if ev["event_type"] in _COVERAGE_TYPES:
            try:
                self.projection.apply(self.db, Applied(ev, rec))
            except Rejected:
                pass


def coverage_from_log(log, trust) -> sqlite3.Connection:
    """An in-memory database with the governance tables of the whole log (trusted governance only,
    as the replay engine applies it): for an erasure whose projection database is unusable."""

    codec, cov = default_codec(), _Coverage()
    for where in log.partitions():
        for rec in log.read(where):
            if rec.event_type not in _COVERAGE_TYPES and rec.event_type != "":
                continue
            try:
                ev = codec.decode(rec.value)
            except (CodecError, ValueError):
                continue
            if not governance_problem(ev, trust):
                cov.observe(ev, rec)
    return cov.db


def erased_executions(db: sqlite3.Connection, subjects: Iterable[str]) -> list[str]:
    """Every execution and derived view the given erase subjects cover."""

    out: set[str] = set()
    for s in subjects:
        originals, views = covered_executions(db, s)
        out.update(originals, views)
    return sorted(out)


def erase_subjects(db: sqlite3.Connection) -> list[str]:
    """The subjects of every withdrawal with ``erase`` a governance database holds."""
    return [r[0] for r in db.execute("SELECT DISTINCT subject FROM withdrawals WHERE erase = 1 ORDER BY subject")]


# ---------------------------------------------------------------------- the steps
class _Steps:
    """Runs the steps of :func:`complete`, collecting what each did and what failed."""

    def __init__(self, paths, log, trust, wait: float, progress) -> None:
        self.paths, self.log, self.trust, self.wait, self.progress = paths, log, trust, wait, progress
        self.failed: list[dict] = []

    def attempt(self, step: str, file: Path, fn: Callable[[float], T]) -> T | None:
        try:
            return retry_busy(fn, self.wait)
        except (sqlite3.DatabaseError, CorruptStore, LogError, OSError) as exc:
            self.failed.append({"step": step, "file": str(file), "error": _why(exc, self.wait)})
            return None

    def catch_up(self, file: Path, executions: list[str], *, rebuild: bool = False, keep: bool = False):
        """Bring one projection database up to date (the purge happens in its replay) and check
        that nothing erased is left; rebuild it from the log when asked, or when something is."""

        def run(timeout: float):
            keys = store_keystore(self.paths)
            engine = None
            try:
                engine = open_engine(self.log, file, self.trust, keystore=keys, busy_timeout=timeout)
                engine.run(progress=self.progress)
                if rebuild or _erased_nodes(engine.db, executions):
                    engine.rebuild()
                    engine.run(progress=self.progress)
                if keep:
                    db, engine = engine.db, None
                    return db
                return readable_in_projection(engine.db, executions)
            finally:
                if engine is not None:
                    engine.db.close()
                if keys is not None:
                    keys.close()

        got = self.attempt("projections", file, run)
        if isinstance(got, list) and got:  # what a rebuild and replay still left (a reader kept the WAL busy): said, left for --resume
            self.failed.append({"step": "projections", "file": str(file), "error": "; ".join(got)})
            return None
        return got

    def destroy_keys(self, db: sqlite3.Connection, subjects: list[str], reason: str | None) -> dict:

        path = Path(self.paths.data_keys)
        out = {"destroyed": [], "not_destroyed": []}
        if not path.exists():
            return out

        def run(timeout: float) -> dict:
            with KeyStore(path) as ks:
                ks.db.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
                got = {"destroyed": [], "not_destroyed": []}
                for s in subjects:
                    r = erase_keys(db, ks, s, reason=reason)
                    got["destroyed"] += r["destroyed"]
                    got["not_destroyed"] += [k for k in r["not_destroyed"] if k not in got["not_destroyed"]]
                return got

        return self.attempt("data keys", path, run) or out

    def forget_gateway(self, executions: list[str]) -> int:
        from ledger.gateway.store import forget_executions, gateway_db_path  # cold path: gateway.db is read by these commands only

        path = gateway_db_path(Path(".") if self.paths.is_kafka else Path(self.paths.url))
        return self.attempt("gateway state", path, lambda timeout: forget_executions(path, executions, timeout=timeout)) or 0


def complete(paths, log, trust, subjects: list[str] | None = None, *, reason: str | None = None,
             wait: float = ERASE_WAIT, rebuild: bool = True,
             progress: Callable[[int, int], None] | None = None) -> tuple[dict, sqlite3.Connection]:
    """Run every erase step for ``subjects`` (None: every withdrawal with erase on the log).

    Returns ``(report, governance database)``: the report has ``destroyed`` / ``not_destroyed``
    keys, ``gateway_state_rows_deleted``, ``projections_rebuilt``, ``projection_files`` (each
    brought up to date) and ``failed`` (``{"step", "file", "error"}`` per step that could not be
    done: the others were done; re-running finishes it).  The governance database is the store's
    projection database when it could be used, else one built in memory from the log; the caller
    closes it."""
    steps = _Steps(paths, log, trust, wait, progress)
    own = Path(paths.db)
    db = steps.catch_up(own, [], keep=True)  # the withdrawal's own purge happens in this replay
    own_ok = db is not None
    if db is None:
        db = coverage_from_log(log, trust)
    subjects = erase_subjects(db) if subjects is None else subjects
    executions = erased_executions(db, subjects)
    out: dict = steps.destroy_keys(db, subjects, reason)
    done = []
    for f in projection_files(paths):
        if f == own and not own_ok:
            continue  # failed above (reported once): left for --resume
        if steps.catch_up(f, executions, rebuild=rebuild and f == own) is not None:
            done.append(str(f))
    out["projections_rebuilt"] = rebuild and str(own) in done
    out["projection_files"] = done
    out["gateway_state_rows_deleted"] = steps.forget_gateway(executions)
    out["failed"] = steps.failed
    return out, db


# ---------------------------------------------------------------------- audit
class ErasureCheck:
    """Fed every event ``ledger audit`` decodes (:meth:`observe`, trusted governance only), then
    :meth:`problems` names every erased execution whose tokens are still readable in the store."""

    def __init__(self, paths, keystore=None) -> None:
        self.paths, self.keystore = paths, keystore
        self.coverage = _Coverage()
        self.clear: dict[str, str] = {}  # execution -> position of its first request in the clear

    def observe(self, ev: dict, rec, where: str) -> None:
        if ev["event_type"] == "request" and ev.get("sealed") is None:
            self.clear.setdefault(ev["execution_id"], where)
        else:
            self.coverage.observe(ev, rec)

    def problems(self) -> list[str]:
        db = self.coverage.db
        executions = erased_executions(db, erase_subjects(db))
        if not executions:
            return []
        out = [f"log position {self.clear[e]}: erased execution {e} has a request in the clear (tokens readable "
               "from the log)" for e in executions if e in self.clear]
        out += self._keys(executions)
        for f in projection_files(self.paths):
            out += self._file(f, lambda con: readable_in_projection(con, executions))
        from ledger.gateway.store import gateway_db_path  # cold path: gateway.db is read by these commands only

        out += self._file(gateway_db_path(Path(".") if self.paths.is_kafka else Path(self.paths.url)),
                          lambda con: _gateway_rows(con, executions))
        return out

    def _keys(self, executions: list[str]) -> list[str]:
        if self.keystore is None:
            return []
        return [f"{self.paths.data_keys}: data key {kid} of erased execution(s) {', '.join(exs)} still exists (their "
                "tokens are readable from the log); run `ledger withdraw --resume`"
                for kid, exs in sorted(sealed_keys_of(self.coverage.db, executions).items())
                if self.keystore.key_by_id(kid) is not None]

    @staticmethod
    def _file(path: Path, check: Callable[[sqlite3.Connection], list[str]]) -> list[str]:
        if not path.exists():
            return []
        try:
            con = _readonly(path)
            try:
                found = check(con)
            finally:
                con.close()
        except sqlite3.DatabaseError as exc:
            return [f"{path}: cannot be checked for erased content ({_why(exc, 5.0)}); repair or delete it, then run "
                    "`ledger withdraw --resume`"]
        return [f"{path}: {p}; run `ledger withdraw --resume`" for p in found]
