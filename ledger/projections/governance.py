"""Lineage, use permissions and withdrawal (SPEC §6.4; seed 002 §15.9).

Projection ``governance``.  Its tables:

``gov_tasks(task_id, source)``                 from TaskRegistered (its own minimal copy)
``gov_executions(execution_id, task_id)``      from ExecutionOpened
``lineage(derived_execution_id, parent_execution_id, transformation, withheld_fields,
          replaced_requests, event_id)``        one row per RecordDerived (the reverse
                                               reference is the index on the parent)
``lineage_replacements(derived_execution_id, request_id, input_ids, output_ids)``
``revalidations(event_id, derived_execution_id, verdict, reward, evidence, seq)``
``permission_events(event_id, subject, use, action, authority, supersedes, occurred_at)``
``permission_status(event_id, subject, use, action, status, note)``   derived (ledger.algorithms.permissions)
``withdrawals(event_id, subject, reason, authority, erase, occurred_at)``
``withdrawn_executions(execution_id, withdrawal_event_id, subject, erase)``  derived:
                                               every (execution or view, withdrawal covering it)
``sealed_keys(execution_id, key_id)``          which data keys seal which execution's requests

Convergence (SPEC §3): everything except ``revalidations.seq`` is a function of the *sets*
of events seen.  Governance events sit on one totally ordered topic, so ``seq`` (their
offset) orders revalidations identically on every interleaving with the execution
partitions.  Derived tables are recomputed in ``finish()`` from the base tables for every
execution whose inputs changed in the batch (and their derived views), so the state never
depends on which partition was read first.

Query functions (for admission, export, the CLI): :func:`permitted`, :func:`withdrawn`,
:func:`erased`, :func:`view_state`, :func:`lineage_chain`, :func:`derived_views`,
:func:`derived_requests`, :func:`impact`, :func:`covered_executions`.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Callable, Iterable

from ledger.algorithms.errors import IntegrityError
from ledger.algorithms.identifiers import join_key
from ledger.algorithms.permissions import Entry, decide
from ledger.projections.descendants import descendants
from ledger.projections.engine import Applied, Rejected
from ledger.algorithms.permissions import resolve
from ledger.projections.consumers import steps_touching
from ledger.projections.collections import name_checkpoints
import hashlib
from ledger.algorithms.canonical import canonical_json

__all__ = ["GovernanceProjection", "permitted", "withdrawn", "erased", "erased_among", "withdrawals_covering", "view_state",
           "lineage_chain", "lineage_of", "derived_views", "derived_requests", "impact", "covered_executions",
           "covered_subjects", "execution_task", "task_source"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS gov_tasks (task_id TEXT PRIMARY KEY, source TEXT);
CREATE INDEX IF NOT EXISTS gov_tasks_source ON gov_tasks(source);
CREATE TABLE IF NOT EXISTS gov_executions (execution_id TEXT PRIMARY KEY, task_id TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS gov_executions_task ON gov_executions(task_id);
CREATE TABLE IF NOT EXISTS lineage (
    derived_execution_id TEXT PRIMARY KEY, parent_execution_id TEXT NOT NULL, transformation TEXT NOT NULL,
    withheld_fields TEXT NOT NULL, replaced_requests TEXT NOT NULL, event_id TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS lineage_parent ON lineage(parent_execution_id);
CREATE TABLE IF NOT EXISTS lineage_replacements (
    derived_execution_id TEXT NOT NULL, request_id TEXT NOT NULL, input_ids BLOB, output_ids BLOB,
    PRIMARY KEY (derived_execution_id, request_id));
CREATE TABLE IF NOT EXISTS revalidations (
    event_id TEXT PRIMARY KEY, derived_execution_id TEXT NOT NULL, verdict TEXT NOT NULL, reward REAL,
    evidence TEXT, seq INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS revalidations_view ON revalidations(derived_execution_id);
CREATE TABLE IF NOT EXISTS permission_events (
    event_id TEXT PRIMARY KEY, subject TEXT NOT NULL, use TEXT NOT NULL, action TEXT NOT NULL,
    authority TEXT NOT NULL, supersedes TEXT, occurred_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS permission_status (
    event_id TEXT PRIMARY KEY, subject TEXT NOT NULL, use TEXT NOT NULL, action TEXT NOT NULL,
    status TEXT NOT NULL, note TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS permission_status_subject ON permission_status(subject);
CREATE TABLE IF NOT EXISTS withdrawals (
    event_id TEXT PRIMARY KEY, subject TEXT NOT NULL, reason TEXT NOT NULL, authority TEXT NOT NULL,
    erase INTEGER NOT NULL, occurred_at INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS withdrawals_subject ON withdrawals(subject);
CREATE TABLE IF NOT EXISTS withdrawn_executions (
    execution_id TEXT NOT NULL, withdrawal_event_id TEXT NOT NULL, subject TEXT NOT NULL, erase INTEGER NOT NULL,
    PRIMARY KEY (execution_id, withdrawal_event_id));
CREATE TABLE IF NOT EXISTS sealed_keys (execution_id TEXT NOT NULL, key_id TEXT NOT NULL, PRIMARY KEY (execution_id, key_id));
"""

MAX_DEPTH = 64  # lineage chains longer than this are treated as broken (cycles are cut anyway)


class GovernanceProjection:
    """Lineage, permissions and withdrawals; see the module docstring."""

    name = "governance"
    event_types = frozenset(("execution_opened", "request", "task_registered", "record_derived", "revalidated", "permission",
                             "withdrawal"))  # what apply acts on (the engine dispatches by type)

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.dirty_execs: set[str] = set()
        self.dirty_tasks: set[str] = set()
        self.dirty_subjects: set[str] = set()
        self.permissions_dirty = False
        self.sealed_seen: set[tuple[str, str]] = set()  # sealed_keys rows inserted in this batch (a repeat is a no-op)

    def create(self, db: sqlite3.Connection) -> None:
        db.executescript(_SCHEMA)

    # ------------------------------------------------------------------ apply
    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev, et = item.event, item.type
        if et == "execution_opened":
            db.execute("INSERT OR IGNORE INTO gov_executions VALUES (?,?)", (ev["execution_id"], ev["task_id"]))
            self.dirty_execs.add(ev["execution_id"])
        elif et == "request":
            sealed = ev.get("sealed")
            if sealed is not None:
                key = (ev["execution_id"], sealed["key_id"])
                if key not in self.sealed_seen:
                    self.sealed_seen.add(key)
                    db.execute("INSERT OR IGNORE INTO sealed_keys VALUES (?,?)", key)
        elif et == "task_registered":
            db.execute("INSERT OR IGNORE INTO gov_tasks VALUES (?,?)", (ev["task_id"], ev.get("source")))
            self.dirty_tasks.add(ev["task_id"])
        elif et == "record_derived":
            d, p = ev["derived_execution_id"], ev["parent_execution_id"]
            if d == p:
                raise Rejected("a record cannot be derived from itself")
            reps = ev.get("replacements") or {}
            cur = db.execute("INSERT OR IGNORE INTO lineage VALUES (?,?,?,?,?,?)",
                             (d, p, ev["transformation"], json.dumps(list(ev.get("withheld_fields") or [])),
                              json.dumps(sorted(reps)), ev["event_id"]))
            if cur.rowcount:
                db.executemany("INSERT OR IGNORE INTO lineage_replacements VALUES (?,?,?,?)",
                               [(d, rid, r.get("input_ids"), r.get("output_ids")) for rid, r in sorted(reps.items())])
            self.dirty_execs.add(d)
        elif et == "revalidated":
            db.execute("INSERT OR IGNORE INTO revalidations VALUES (?,?,?,?,?,?)",
                       (ev["event_id"], ev["derived_execution_id"], ev["verdict"], ev.get("reward"), ev.get("evidence"),
                        item.record.offset))
        elif et == "permission":
            db.execute("INSERT OR IGNORE INTO permission_events VALUES (?,?,?,?,?,?,?)",
                       (ev["event_id"], ev["subject"], ev["use"], ev["action"], ev["authority"], ev.get("supersedes"),
                        ev["occurred_at"]))
            self.permissions_dirty = True
        elif et == "withdrawal":
            db.execute("INSERT OR IGNORE INTO withdrawals VALUES (?,?,?,?,?,?)",
                       (ev["event_id"], ev["subject"], ev["reason"], ev["authority"], int(bool(ev.get("erase"))),
                        ev["occurred_at"]))
            self.dirty_subjects.add(ev["subject"])

    # ------------------------------------------------------------------ finish
    def finish(self, db: sqlite3.Connection) -> None:
        self.sealed_seen.clear()
        if self.permissions_dirty:
            _recompute_permissions(db)
        todo = set(self.dirty_execs)
        for t in sorted(self.dirty_tasks):
            todo.update(r[0] for r in db.execute("SELECT execution_id FROM gov_executions WHERE task_id = ?", (t,)))
        for s in sorted(self.dirty_subjects):
            todo.update(_subject_roots(db, s))
        # Nothing can be covered while no withdrawal exists (and the derived table is then empty).
        if todo and db.execute("SELECT 1 FROM withdrawals LIMIT 1").fetchone() is not None:
            _recompute_withdrawn_many(db, _with_descendants(db, todo))
        self.reset()


# ---------------------------------------------------------------------- derived state
def _recompute_permissions(db: sqlite3.Connection) -> None:

    events = [{"event_id": r[0], "subject": r[1], "use": r[2], "action": r[3], "authority": r[4], "supersedes": r[5]}
              for r in db.execute("SELECT event_id, subject, use, action, authority, supersedes FROM permission_events")]
    db.execute("DELETE FROM permission_status")
    db.executemany("INSERT INTO permission_status VALUES (?,?,?,?,?,?)",
                   [(e.event_id, e.subject, e.use, e.action, e.status, e.note) for e in resolve(events)])


def _subject_roots(db: sqlite3.Connection, subject: str) -> set[str]:
    """Executions (and views) a subject names directly, before following derivations."""
    if subject == "*":
        rows = db.execute("SELECT execution_id FROM gov_executions UNION SELECT derived_execution_id FROM lineage")
        return {r[0] for r in rows}
    kind, _, ident = subject.partition(":")
    if kind == "execution":
        return {ident}
    if kind == "task":
        return {r[0] for r in db.execute("SELECT execution_id FROM gov_executions WHERE task_id = ?", (ident,))}
    if kind == "source":
        return {r[0] for r in db.execute("SELECT e.execution_id FROM gov_executions e JOIN gov_tasks t ON t.task_id = e.task_id "
                                         "WHERE t.source = ?", (ident,))}
    return set()


def _with_descendants(db: sqlite3.Connection, roots: Iterable[str]) -> set[str]:
    roots = set(roots)
    return roots | descendants(db, roots, table="lineage", child="derived_execution_id", parent="parent_execution_id")


_COVERING = """
SELECT d.execution_id, w.event_id, w.subject, w.erase FROM temp.gov_dirty d
    JOIN withdrawals w ON w.subject = 'execution:' || d.execution_id
UNION ALL SELECT d.execution_id, w.event_id, w.subject, w.erase FROM temp.gov_dirty d
    JOIN gov_executions e ON e.execution_id = d.execution_id JOIN withdrawals w ON w.subject = 'task:' || e.task_id
UNION ALL SELECT d.execution_id, w.event_id, w.subject, w.erase FROM temp.gov_dirty d
    JOIN gov_executions e ON e.execution_id = d.execution_id JOIN gov_tasks t ON t.task_id = e.task_id
    JOIN withdrawals w ON w.subject = 'source:' || t.source
UNION ALL SELECT d.execution_id, w.event_id, w.subject, w.erase FROM temp.gov_dirty d
    JOIN withdrawals w ON w.subject = '*'
"""
_BULK_COVERING = "INSERT OR IGNORE INTO withdrawn_executions" + _COVERING


def _split_views(db: sqlite3.Connection, executions: Iterable[str]) -> tuple[list[str], list[str]]:
    """(original executions, derived views) of ``executions``, each sorted."""
    views = set()
    todo = sorted(executions)
    for i in range(0, len(todo), 500):
        chunk = todo[i:i + 500]
        views.update(r[0] for r in db.execute(
            f"SELECT derived_execution_id FROM lineage WHERE derived_execution_id IN ({','.join('?' * len(chunk))})", chunk))
    return [e for e in todo if e not in views], sorted(views)


def _fill_dirty(db: sqlite3.Connection, originals: list[str]) -> None:
    db.execute("CREATE TEMP TABLE IF NOT EXISTS gov_dirty (execution_id TEXT PRIMARY KEY)")
    db.execute("DELETE FROM temp.gov_dirty")
    db.executemany("INSERT INTO temp.gov_dirty VALUES (?)", [(e,) for e in originals])


def _recompute_withdrawn_many(db: sqlite3.Connection, executions: set[str]) -> None:
    """Same rows as :func:`_recompute_withdrawn` for each execution, in bulk for original
    executions (a derived view walks its lineage chain one by one)."""
    originals, views = _split_views(db, executions)
    _fill_dirty(db, originals)
    db.execute("DELETE FROM withdrawn_executions WHERE execution_id IN (SELECT execution_id FROM temp.gov_dirty)")
    db.execute(_BULK_COVERING)
    db.execute("DELETE FROM temp.gov_dirty")
    for ex in views:
        _recompute_withdrawn(db, ex)


def erased_among(db: sqlite3.Connection, executions: Iterable[str]) -> set[str]:
    """Those of ``executions`` a withdrawal with ``erase`` covers (SPEC 11.7), from the base tables
    (so it is right inside a batch, before :meth:`GovernanceProjection.finish`): in bulk for
    original executions, through the lineage chain for derived views."""
    originals, views = _split_views(db, executions)
    _fill_dirty(db, originals)
    out = {r[0] for r in db.execute(f"SELECT DISTINCT execution_id FROM ({_COVERING}) WHERE erase = 1")}
    db.execute("DELETE FROM temp.gov_dirty")
    out.update(v for v in views if erased(db, v))
    return out


def _recompute_withdrawn(db: sqlite3.Connection, ex: str) -> None:
    db.execute("DELETE FROM withdrawn_executions WHERE execution_id = ?", (ex,))
    rows = withdrawals_covering(db, ex)
    db.executemany("INSERT OR IGNORE INTO withdrawn_executions VALUES (?,?,?,?)",
                   [(ex, w["event_id"], w["subject"], int(w["erase"])) for w in rows])


# ---------------------------------------------------------------------- queries
def execution_task(db: sqlite3.Connection, execution_id: str) -> str | None:
    """The task of an execution; a derived view has its parent's task."""
    for ex in lineage_chain(db, execution_id):
        row = db.execute("SELECT task_id FROM gov_executions WHERE execution_id = ?", (ex,)).fetchone()
        if row is not None:
            return row[0]
    return None


def task_source(db: sqlite3.Connection, task_id: str | None) -> str | None:
    if task_id is None:
        return None
    row = db.execute("SELECT source FROM gov_tasks WHERE task_id = ?", (task_id,)).fetchone()
    return None if row is None else row[0]


def lineage_of(db: sqlite3.Connection, execution_id: str) -> dict | None:
    """The lineage row of a derived view (``None`` for an original execution)."""
    row = db.execute("SELECT parent_execution_id, transformation, withheld_fields, replaced_requests, event_id FROM lineage "
                     "WHERE derived_execution_id = ?", (execution_id,)).fetchone()
    if row is None:
        return None
    return {"derived_execution_id": execution_id, "parent_execution_id": row[0], "transformation": row[1],
            "withheld_fields": json.loads(row[2]), "replaced_requests": json.loads(row[3]), "event_id": row[4]}


def lineage_chain(db: sqlite3.Connection, execution_id: str) -> list[str]:
    """``[execution_id, parent, grandparent, ...]`` up to the original execution (cycles cut)."""
    chain = [execution_id]
    while len(chain) <= MAX_DEPTH:
        row = db.execute("SELECT parent_execution_id FROM lineage WHERE derived_execution_id = ?", (chain[-1],)).fetchone()
        if row is None or row[0] in chain:
            break
        chain.append(row[0])
    return chain


def derived_views(db: sqlite3.Connection, execution_id: str, *, transitive: bool = True) -> list[str]:
    """The reverse references: views derived from ``execution_id`` (transitively by default)."""
    if not transitive:
        return [r[0] for r in db.execute("SELECT derived_execution_id FROM lineage WHERE parent_execution_id = ? "
                                         "ORDER BY derived_execution_id", (execution_id,))]
    return sorted(_with_descendants(db, [execution_id]) - {execution_id})


def covering_subjects(db: sqlite3.Connection, execution_id: str) -> list[str]:
    """Every subject whose permissions/withdrawals reach ``execution_id``, most specific first:
    the execution and each view it derives from, then their tasks, then sources, then ``*``."""
    chain = lineage_chain(db, execution_id)
    out = [f"execution:{e}" for e in chain]
    tasks = []
    for e in chain:
        row = db.execute("SELECT task_id FROM gov_executions WHERE execution_id = ?", (e,)).fetchone()
        if row is not None and row[0] not in tasks:
            tasks.append(row[0])
    out += [f"task:{t}" for t in tasks]
    for t in tasks:
        s = task_source(db, t)
        if s is not None and f"source:{s}" not in out:
            out.append(f"source:{s}")
    out.append("*")
    return out


def permitted(db: sqlite3.Connection, execution_id: str, use: str) -> tuple[str, str]:
    """``("pass"|"fail", reason)``: may ``execution_id`` serve ``use``?  Deny by default.

    A grant for ``use`` (or ``*``) must cover it through its execution, its task, its task's
    source or ``*`` — for a derived view also through every execution it derives from —
    and no effective revocation may cover it (SPEC §6.4)."""
    subjects = covering_subjects(db, execution_id)
    placeholders = ",".join("?" * len(subjects))
    entries = [Entry(r[0], r[1], r[2], r[3], r[4], r[5], None, r[6] or "") for r in db.execute(
        f"SELECT s.subject, s.use, s.action, s.event_id, s.status, s.note, p.authority FROM permission_status s "
        f"JOIN permission_events p ON p.event_id = s.event_id WHERE s.subject IN ({placeholders})", subjects)]
    return decide(entries, subjects, use, describe=", ".join(s for s in subjects if s != "*"))


def withdrawals_covering(db: sqlite3.Connection, execution_id: str) -> list[dict]:
    """Every withdrawal that covers ``execution_id`` (directly, via its task, source, ``*`` or a parent)."""
    subjects = covering_subjects(db, execution_id)
    rows = db.execute(f"SELECT event_id, subject, reason, authority, erase FROM withdrawals WHERE subject IN "
                      f"({','.join('?' * len(subjects))}) ORDER BY event_id", subjects)
    return [{"event_id": r[0], "subject": r[1], "reason": r[2], "authority": r[3], "erase": bool(r[4])} for r in rows]


def withdrawn(db: sqlite3.Connection, execution_id: str) -> bool:
    """True when a withdrawal covers the execution (source -> tasks -> executions -> derived views)."""
    return bool(withdrawals_covering(db, execution_id))


def erased(db: sqlite3.Connection, execution_id: str) -> bool:
    """True when a withdrawal with ``erase`` covers the execution (its sealed tokens are to be shredded)."""
    return any(w["erase"] for w in withdrawals_covering(db, execution_id))


def _revalidation(db: sqlite3.Connection, execution_id: str) -> tuple[str | None, float | None, str | None]:
    """(verdict, own reward, event id): a fail is final; otherwise the first pass (governance order) stands."""
    rows = db.execute("SELECT verdict, reward, event_id FROM revalidations WHERE derived_execution_id = ? ORDER BY seq, event_id",
                      (execution_id,)).fetchall()
    fail = next((r for r in rows if r[0] == "fail"), None)
    if fail is not None:
        return "fail", None, fail[2]
    if rows:
        return "pass", rows[0][1], rows[0][2]
    return None, None, None


def _own_reward(db: sqlite3.Connection, execution_id: str) -> float | None:
    """The valid reward of an original execution, from the assessment projection when present."""
    try:
        row = db.execute("SELECT state, reward FROM execution_scores WHERE execution_id = ?", (execution_id,)).fetchone()
    except sqlite3.OperationalError:  # assessment projection not in this database
        return None
    if row is None or row[0] not in ("scored", "dummy"):
        return None
    return row[1]


def view_state(db: sqlite3.Connection, execution_id: str, _seen: frozenset = frozenset()) -> dict:
    """``{"parent", "revalidated": None|"pass"|"fail", "reward"}`` of an execution or derived view.

    A view is pending (``revalidated`` None, ``reward`` None) until Revalidated; a pass
    carries its own ``reward`` or else its parent's valid reward (the parent's own
    ``view_state`` reward, recursively); a fail keeps it out of every route (reward None).
    An original execution has ``parent`` None and its own valid reward (if scored)."""
    lin = lineage_of(db, execution_id)
    if lin is None:
        return {"parent": None, "revalidated": None, "reward": _own_reward(db, execution_id)}
    verdict, own, event_id = _revalidation(db, execution_id)
    reward = None
    if verdict == "pass":
        if own is not None:
            reward = own
        elif lin["parent_execution_id"] not in _seen | {execution_id}:  # a lineage cycle carries nothing
            reward = view_state(db, lin["parent_execution_id"], _seen | {execution_id})["reward"]
    return {"parent": lin["parent_execution_id"], "revalidated": verdict, "reward": reward,
            "transformation": lin["transformation"], "revalidation_event_id": event_id}


def derived_requests(db: sqlite3.Connection, derived_id: str, parent_requests: Iterable[dict]) -> list[dict]:
    """The request events of a derived view, built from its parent's requests.

    ``parent_requests`` are the parent's decoded request events **in the parent's log order
    (seq)**, unsealed (see :func:`ledger.log.sealing.unseal`); the tree projection owns them.
    Each is copied into ``derived_id``; inputs are materialised in full (prefix references
    are resolved against the parent's own paths, because a replacement may change the
    referenced tokens), then the view's replacements apply:

    * a replaced ``input_ids`` becomes the request's whole input;
    * a replaced ``output_ids`` becomes its output, with ``output_logprobs`` None and
      ``reconstructed`` True: the policy never sampled those tokens, so they are context,
      never training targets;
    * ``withheld_fields`` entries ``request:RID`` drop that request from the view.

    Raises ``KeyError`` if ``derived_id`` is not a derived view, ``ValueError`` if a prefix
    reference cannot be resolved from the given requests."""
    lin = lineage_of(db, derived_id)
    if lin is None:
        raise KeyError(f"{derived_id} is not a derived view (no record_derived)")
    reps = {r[0]: (r[1], r[2]) for r in db.execute(
        "SELECT request_id, input_ids, output_ids FROM lineage_replacements WHERE derived_execution_id = ?", (derived_id,))}
    withheld = {f.split(":", 1)[1] for f in lin["withheld_fields"] if f.startswith("request:")}
    paths: dict[str, bytes] = {}
    out = []
    for ev in parent_requests:
        rid = ev["request_id"]
        prefix = ev.get("input_prefix")
        if prefix is not None:
            base = paths.get(prefix["request_id"])
            if base is None or len(base) < prefix["length"] * 4:
                raise IntegrityError(f"prefix reference of {rid!r} to {prefix['request_id']!r} cannot be resolved")
            full_input = base[: prefix["length"] * 4] + (ev.get("input_suffix_ids") or b"")
        else:
            full_input = ev.get("input_ids") or b""
        paths[rid] = full_input + ev["output_ids"]
        if rid in withheld:
            continue
        new = dict(ev)
        new.update(execution_id=derived_id, input_ids=full_input, input_prefix=None, input_suffix_ids=None)
        new["event_id"] = join_key("derived", derived_id, rid)
        if rid in reps:
            rin, rout = reps[rid]
            if rin is not None:
                new["input_ids"] = bytes(rin)
            if rout is not None:
                new.update(output_ids=bytes(rout), output_logprobs=None, reconstructed=True)
        new["sealed"] = None
        out.append(new)
    return out


def covered_executions(db: sqlite3.Connection, subject: str) -> tuple[list[str], list[str]]:
    """(original executions, derived views) a subject covers, transitively."""
    roots = _subject_roots(db, subject)
    every = _with_descendants(db, roots)
    views = {r[0] for r in db.execute("SELECT derived_execution_id FROM lineage")} & every
    originals = {e for e in every - views
                 if db.execute("SELECT 1 FROM gov_executions WHERE execution_id = ?", (e,)).fetchone() is not None}
    return sorted(originals), sorted(views)


def covered_subjects(db: sqlite3.Connection, subject: str) -> list[str]:
    """Every subject string whose data falls under ``subject``: itself, its tasks and its executions/views."""
    originals, views = covered_executions(db, subject)
    out = {subject}
    out.update(f"execution:{e}" for e in originals + views)
    kind, _, ident = subject.partition(":")
    if kind == "source":
        out.update(f"task:{r[0]}" for r in db.execute("SELECT task_id FROM gov_tasks WHERE source = ?", (ident,)))
    elif subject == "*":
        out.update(f"task:{r[0]}" for r in db.execute("SELECT task_id FROM gov_tasks"))
        out.update(f"source:{r[0]}" for r in db.execute("SELECT DISTINCT source FROM gov_tasks WHERE source IS NOT NULL"))
    return sorted(out)


def _table_columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f'PRAGMA table_info("{table}")')}


def impact(db: sqlite3.Connection, subject: str, documents: Callable[[dict], dict | None] | None = None,
           document_sha256: Callable[[dict], str] | None = None) -> dict:
    """What ``subject`` touches: tasks, executions, derived views, published manifest versions and members.

    Published manifests are the rows of table ``manifests`` (projection ``manifests``).
    Their members come from table ``manifest_members(route, version, member_id,
    execution_id, ...)`` when a projection maintains one, else from the published documents:
    ``documents(manifest_row)`` returns the archived document (or ``None``); a document is
    used only if its SHA-256 equals the row's ``manifest_sha256`` (the log authenticates
    the archive; ``document_sha256(document)``: that hash when the caller has it already, say a
    server that read the archive before).  Without any published manifest, ``manifests`` is empty
    and ``note`` says "no manifests published"."""
    originals, views = covered_executions(db, subject)
    kind, _, ident = subject.partition(":")
    if kind == "source":
        tasks = [r[0] for r in db.execute("SELECT task_id FROM gov_tasks WHERE source = ? ORDER BY task_id", (ident,))]
    elif kind == "task":
        tasks = [ident]
    elif subject == "*":
        tasks = [r[0] for r in db.execute("SELECT task_id FROM gov_tasks ORDER BY task_id")]
    else:
        t = execution_task(db, ident)
        tasks = [] if t is None else [t]
    ws = [{"event_id": r[0], "reason": r[1], "authority": r[2], "erase": bool(r[3])} for r in db.execute(
        "SELECT event_id, reason, authority, erase FROM withdrawals WHERE subject = ? ORDER BY event_id", (subject,))]
    out: dict = {"subject": subject, "withdrawn": bool(ws), "withdrawals": ws, "tasks": tasks, "executions": originals,
                 "derived_views": views, "manifests": [], "members": 0}
    covered = set(originals) | set(views)

    out["consumer_steps"] = steps_touching(db, covered)  # SPEC 11.6: feed steps (and checkpoints) that trained on it
    have = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    published: list[dict] = []
    if "manifests" in have and {"route", "version"} <= _table_columns(db, "manifests"):
        cur = db.execute("SELECT * FROM manifests ORDER BY route, version")
        cols = [d[0] for d in cur.description]
        published = [dict(zip(cols, r)) for r in cur]
    member_table = "manifest_members" in have and \
        {"route", "version", "member_id", "execution_id"} <= _table_columns(db, "manifest_members")
    if not published and not member_table:
        out["note"] = "no manifests published"
        return out
    found: dict[tuple[str, int], dict] = {}
    if member_table:
        for route, version, member_id, ex in db.execute(
                "SELECT route, version, member_id, execution_id FROM manifest_members ORDER BY route, version, member_id"):
            if ex in covered:
                found.setdefault((route, version), {"route": route, "version": version, "members": []})["members"].append(
                    {"member_id": member_id, "execution_id": ex})
    else:
        unreadable = []
        for row in published:
            doc = documents(row) if documents is not None else None
            if doc is None:
                unreadable.append({"route": row["route"], "version": row["version"],
                                   "why": "manifest document not available (no archive copy)"})
                continue
            want = row.get("manifest_sha256")
            if want is not None and (document_sha256 or _document_sha256)(doc) != want:
                unreadable.append({"route": row["route"], "version": row["version"],
                                   "why": "archived document does not match the published manifest_sha256"})
                continue
            hits = [{"member_id": m["member_id"], "execution_id": m.get("execution_id")}
                    for m in doc.get("members", []) if m.get("execution_id") in covered]
            if hits:
                found[(row["route"], row["version"])] = {"route": row["route"], "version": row["version"], "members": hits}
        if unreadable:
            out["unverifiable_manifests"] = unreadable
    out["manifests"] = [found[k] for k in sorted(found)]
    out["members"] = sum(len(m["members"]) for m in found.values())

    name_checkpoints(db, out["manifests"])  # SPEC 6.10: the checkpoints trained on each manifest version
    if not published and not found and not db.execute("SELECT 1 FROM manifest_members LIMIT 1").fetchone():
        out["note"] = "no manifests published"
    return out


def _document_sha256(doc: dict) -> str:


    return hashlib.sha256(canonical_json(doc)).hexdigest()
