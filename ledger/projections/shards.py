"""Partitioned projection state ("shards") and their deterministic merge (scale-out on Kafka).

A projector in a consumer group (``ledger project --follow --group G``) keeps one SQLite file
per execution partition it owns, ``<state-dir>/executions-<p>.db``.  A shard is an ordinary
projection database holding

* the state derived from **all** of the governance topic (every shard applies it in full:
  it is low volume, and it makes each shard self-contained), and
* the state derived from the records of **its** execution partition ``p``,

with ``_positions`` rows for both, written in the same transactions as the state.  It also
has two bookkeeping tables that the merge drops: ``_shard`` (which partition and topics the
file belongs to) and ``_shard_executions`` (every execution id with an execution-scoped
record in the partition: the rows the shard is authoritative for).

Merging (:func:`merge_shards`) builds one database equal to a single-process replay of the
same log position: governance topic at the (common) governance position of the shards,
each execution partition at its shard's position.  Per table:

* **positions, dead letters, rejections** (``_positions``, ``_dead_letter``, ``_rejected``):
  rows of execution partition ``p`` come from shard ``p``; governance rows must be
  identical in every shard (they are: same records, deterministic projections).
* **identical tables** (everything derived from governance only: splits, groups, routes,
  permissions, withdrawals, lineage, manifests, ...): must be identical in every shard and
  are copied once.  A shard that is behind on governance makes the merge fail with
  :class:`MergeError` (the shards are not a consistent cut); retry once they caught up.
* **per-execution tables** (a column ``execution_id``: trees, scores, admissions, admitted
  paths, costs, credits facts, ...): a row of execution ``x`` is taken from the shard that
  owns the *root* of ``x`` -- ``x`` itself, or for a derived view (RecordDerived, governance
  topic) the original execution at the top of its lineage chain, because only the shard
  holding the parent's records can derive the view's tree, score and admission.  An
  execution no shard owns (a view of an execution not seen yet) takes the lowest shard's rows.
* **aggregates over executions** are recomputed from the merged facts with the projections'
  own functions: ``route_telemetry`` (:func:`projections.admission.refresh_telemetry`) and
  the credit fold (``credit_decisions``, ``credit_held``, ``credit_status``:
  :func:`projections.credits.refold`) and the preference pairs, whose two sides may sit in
  different partitions (``preference_pairs``, ``preference_unassigned``:
  :func:`projections.preference.recompute_route`).
* **union tables** (:data:`projections.consumers.MERGE_BY_UNION`: feed consumers' acknowledged batches,
  partitioned by consumer): the union of every shard's rows.

A table that is neither identical across shards nor per-execution nor a known aggregate
cannot be merged safely: :class:`MergeError` names it (a new projection must say how it merges).
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from ledger.algorithms.errors import StateError
from ledger.projections.consumers import MERGE_BY_UNION
from ledger.projections.engine import Applied, connect
from ledger.projections.admission import current_routes, refresh_telemetry
from ledger.projections.credits import refold
from ledger.projections.admission import current_routes
from ledger.projections.preference import recompute_route

__all__ = ["MergeError", "MergeReport", "ShardIndexProjection", "SHARD_META", "merge_shards", "shard_files",
           "shard_path", "shard_positions", "write_shard_meta"]

SHARD_META = "_shard"
SHARD_EXECUTIONS = "_shard_executions"
_BOOKKEEPING = {SHARD_META, SHARD_EXECUTIONS, "_projection_schema"}  # the schema fingerprints are per database
_POSITIONAL = ("_positions", "_dead_letter", "_rejected")
_TELEMETRY = "route_telemetry"
_CREDIT_AGGREGATES = ("credit_decisions", "credit_held", "credit_status")
_PREFERENCE_AGGREGATES = ("preference_pairs", "preference_unassigned")  # pairs span executions (and partitions)
_SHARD_NAME = re.compile(r"^executions-(\d+)\.db$")


class MergeError(StateError):
    """The shards cannot be merged into one consistent projection database."""


def shard_path(state_dir: str | Path, partition: int) -> Path:
    """``<state-dir>/executions-<partition>.db``."""
    return Path(state_dir) / f"executions-{int(partition)}.db"


def shard_files(state_dir: str | Path) -> dict[int, Path]:
    """Execution partition -> shard file, for every shard in ``state_dir``."""
    out = {}
    d = Path(state_dir)
    if not d.is_dir():
        return out
    for f in d.iterdir():
        m = _SHARD_NAME.match(f.name)
        if m and f.is_file():
            out[int(m.group(1))] = f
    return dict(sorted(out.items()))


def write_shard_meta(db: sqlite3.Connection, *, partition: int, executions_topic: str, governance_topic: str) -> None:
    """Record which partition a shard file holds (refuses a file that belongs to another one)."""
    db.execute(f"CREATE TABLE IF NOT EXISTS {SHARD_META} (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    want = {"partition": str(partition), "executions_topic": executions_topic, "governance_topic": governance_topic}
    have = dict(db.execute(f"SELECT key, value FROM {SHARD_META}"))
    for k, v in want.items():
        if k in have and have[k] != v:
            raise MergeError(f"shard file holds {k} {have[k]!r}, not {v!r}")
    db.executemany(f"INSERT OR IGNORE INTO {SHARD_META} VALUES (?, ?)", sorted(want.items()))


class ShardIndexProjection:
    """Records the execution ids that have records on the shard's own execution partition.

    Bookkeeping for :func:`merge_shards` (which drops the table): the rows of those
    executions are the ones this shard is authoritative for.
    """

    name = "shard_index"

    def __init__(self, executions_topic: str) -> None:
        self.executions_topic = executions_topic
        self._seen: set[str] = set()
        self._known: set[str] = set()

    def create(self, db: sqlite3.Connection) -> None:
        db.execute(f"CREATE TABLE IF NOT EXISTS {SHARD_EXECUTIONS} (execution_id TEXT PRIMARY KEY)")

    def reset(self) -> None:
        self._seen.clear()
        self._known.clear()

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        rec = item.record
        if rec.stream == self.executions_topic and rec.key and rec.key not in self._known:
            self._seen.add(rec.key)

    def finish(self, db: sqlite3.Connection) -> None:
        if self._seen:
            db.executemany(f"INSERT OR IGNORE INTO {SHARD_EXECUTIONS} VALUES (?)", [(k,) for k in sorted(self._seen)])
            self._known |= self._seen
            if len(self._known) > 100_000:
                self._known.clear()
            self._seen.clear()


@dataclass
class MergeReport:
    out: str
    shards: dict[int, str]
    governance_position: int | None
    positions: dict[str, int]
    tables: dict[str, str] = field(default_factory=dict)  # table -> how it was merged
    rows: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"out": self.out, "shards": {str(k): v for k, v in self.shards.items()},
                "governance_position": self.governance_position, "positions": self.positions,
                "tables": self.tables, "rows": self.rows}


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _columns(db: sqlite3.Connection, schema: str, table: str) -> list[str]:
    return [r[1] for r in db.execute(f"PRAGMA {schema}.table_info({_quote(table)})")]


def _same(db: sqlite3.Connection, a: str, b: str, table: str) -> bool:
    """Are ``a.table`` and ``b.table`` the same multiset of rows?"""
    t = _quote(table)
    na = db.execute(f"SELECT COUNT(*) FROM {a}.{t}").fetchone()[0]
    nb = db.execute(f"SELECT COUNT(*) FROM {b}.{t}").fetchone()[0]
    if na != nb:
        return False
    if na == 0:
        return True
    diff = db.execute(f"SELECT COUNT(*) FROM (SELECT * FROM {a}.{t} EXCEPT SELECT * FROM {b}.{t})").fetchone()[0]
    if diff:
        return False
    return db.execute(f"SELECT COUNT(*) FROM (SELECT * FROM {b}.{t} EXCEPT SELECT * FROM {a}.{t})").fetchone()[0] == 0


def _table_digest(db: sqlite3.Connection, schema: str, table: str) -> str:
    h = hashlib.sha256()
    for row in db.execute(f"SELECT * FROM {schema}.{_quote(table)} ORDER BY 1"):
        h.update(repr(row).encode())
    return h.hexdigest()[:16]


def merge_shards(state_dir: str | Path, out: str | Path, *, skip_tables: Iterable[str] = (),
                 require_partitions: Sequence[int] | None = None) -> MergeReport:
    """Merge the shards of ``state_dir`` into a fresh projection database at ``out`` (replaced atomically).

    ``require_partitions``: partitions that must have a shard (the executions partitions
    holding data).  ``skip_tables``: tables left out of the merged database.
    Raises :class:`MergeError` when the shards are not a consistent cut (see module doc).
    """
    files = shard_files(state_dir)
    if not files:
        raise MergeError(f"no shard files (executions-<p>.db) in {state_dir}")
    missing = sorted(set(require_partitions or ()) - set(files))
    if missing:
        raise MergeError(f"no shard for partition(s) {', '.join(map(str, missing))} in {state_dir}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.merge-{os.getpid()}.tmp")
    for suffix in ("", "-wal", "-shm", "-journal"):
        Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    skip = set(skip_tables)
    db = connect(tmp)
    try:
        report = _merge_into(db, files, skip, str(out))
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except BaseException:
        db.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{tmp}{suffix}").unlink(missing_ok=True)
        raise
    db.close()
    for suffix in ("-wal", "-shm", "-journal"):  # a stale WAL beside the new file would be replayed into it
        Path(f"{tmp}{suffix}").unlink(missing_ok=True)
        Path(f"{out}{suffix}").unlink(missing_ok=True)
    os.replace(tmp, out)
    return report


def _merge_into(db: sqlite3.Connection, files: dict[int, Path], skip: set[str], out: str) -> MergeReport:
    aliases: dict[int, str] = {}
    for p, f in files.items():
        alias = f"s{p}"
        db.execute(f"ATTACH DATABASE ? AS {alias}", (str(f),))
        aliases[p] = alias
    try:
        # One transaction over every shard: a consistent snapshot of each file (projectors may
        # be writing them; WAL readers see the last commit), and the merged tables written with it.
        db.execute("BEGIN")
        return _merge_snapshot(db, files, aliases, skip, out)
    finally:
        if db.in_transaction:
            db.execute("ROLLBACK")
        for alias in aliases.values():
            db.execute(f"DETACH DATABASE {alias}")


def _merge_snapshot(db: sqlite3.Connection, files: dict[int, Path], aliases: dict[int, str], skip: set[str],
                    out: str) -> MergeReport:
    parts = sorted(aliases)
    first = aliases[parts[0]]
    # ---- shard identity and topics
    topics = None
    for p in parts:
        a = aliases[p]
        if db.execute(f"SELECT 1 FROM {a}.sqlite_master WHERE type='table' AND name=?", (SHARD_META,)).fetchone() is None:
            raise MergeError(f"{files[p]} is not a shard (no {SHARD_META} table)")
        meta = dict(db.execute(f"SELECT key, value FROM {a}.{SHARD_META}"))
        if meta.get("partition") != str(p):
            raise MergeError(f"{files[p]} holds partition {meta.get('partition')}, not {p}")
        t = (meta.get("governance_topic"), meta.get("executions_topic"))
        if topics is None:
            topics = t
        elif t != topics:
            raise MergeError(f"{files[p]} belongs to topics {t}, the other shards to {topics}")
    gov_topic, exec_topic = topics  # type: ignore[misc]
    # ---- schema: the same tables everywhere
    schema = {}
    for p in parts:
        a = aliases[p]
        objs = db.execute(f"SELECT type, name, tbl_name, sql FROM {a}.sqlite_master WHERE sql IS NOT NULL "
                          "AND name NOT LIKE 'sqlite_%' ORDER BY type DESC, name").fetchall()
        tables = {n: s for ty, n, _t, s in objs if ty == "table"}
        if p == parts[0]:
            schema = {"objects": objs, "tables": tables}
        elif set(tables) != set(schema["tables"]):
            extra = sorted(set(tables) ^ set(schema["tables"]))
            raise MergeError(f"shards have different tables ({', '.join(extra)}): run the same projector version "
                             f"on every shard")
    # ---- the governance position must be the same in every shard
    gov_pos = {}
    for p in parts:
        row = db.execute(f"SELECT next_offset FROM {aliases[p]}._positions WHERE stream = ? AND partition = 0",
                         (gov_topic,)).fetchone()
        gov_pos[p] = row[0] if row else 0
    if len(set(gov_pos.values())) > 1:
        raise MergeError("the shards are at different governance positions "
                         f"({', '.join(f'partition {p}: {o}' for p, o in sorted(gov_pos.items()))}); "
                         "merge once the projectors caught up on the governance topic")
    # ---- create the merged schema (tables first, then indexes)
    keep_tables = [n for n in schema["tables"] if n not in _BOOKKEEPING and n not in skip]
    for ty, name, tbl, sql in schema["objects"]:
        if (ty == "table" and name in keep_tables) or (ty != "table" and tbl in keep_tables):
            if ty == "table" and db.execute("SELECT 1 FROM main.sqlite_master WHERE name = ?", (name,)).fetchone():
                db.execute(f"DROP TABLE main.{_quote(name)}")  # the engine's own tables were created by connect()
            if ty != "table" and db.execute("SELECT 1 FROM main.sqlite_master WHERE name = ?", (name,)).fetchone():
                continue
            db.execute(sql)
    report = MergeReport(out, {p: str(f) for p, f in files.items()}, gov_pos[parts[0]], {})
    _owners(db, aliases)
    recompute: list[str] = []
    for table in sorted(keep_tables):
        cols = _columns(db, first, table)
        qt = _quote(table)
        if table in _POSITIONAL:
            for p in parts:
                a = aliases[p]
                db.execute(f"INSERT OR IGNORE INTO main.{qt} SELECT * FROM {a}.{qt} WHERE stream = ? AND partition = ?",
                           (exec_topic, p))
            base = f"SELECT * FROM {{a}}.{qt} WHERE NOT (stream = '{exec_topic}')"
            _require_identical(db, aliases, table, base, files)
            db.execute(f"INSERT OR IGNORE INTO main.{qt} " + base.format(a=first))
            report.tables[table] = "by partition (governance rows identical)"
        elif table == _TELEMETRY or table in _CREDIT_AGGREGATES or table in _PREFERENCE_AGGREGATES:
            recompute.append(table)
            report.tables[table] = "recomputed from the merged facts"
        elif table in MERGE_BY_UNION:  # rows partitioned by another key than the execution (feed consumers)
            for p in parts:
                db.execute(f"INSERT OR IGNORE INTO main.{qt} SELECT * FROM {aliases[p]}.{qt}")
            report.tables[table] = "union of the shards (partitioned by consumer)"
        elif all(_same(db, first, aliases[p], table) for p in parts[1:]):
            db.execute(f"INSERT INTO main.{qt} SELECT * FROM {first}.{qt}")
            empty = db.execute(f"SELECT 1 FROM main.{qt} LIMIT 1").fetchone() is None
            report.tables[table] = "empty in every shard" if empty else "identical in every shard"
        elif "execution_id" in cols:
            for p in parts:
                a = aliases[p]
                db.execute(f"INSERT INTO main.{qt} SELECT * FROM {a}.{qt} WHERE execution_id IN "
                           f"(SELECT execution_id FROM temp.merge_owner WHERE shard = ?)", (p,))
            report.tables[table] = "per execution (rows of the shard owning the execution's root)"
        else:
            raise MergeError(f"table {table} differs between shards and has no execution_id column, so it cannot be "
                             f"merged (digests: {', '.join(f'{p}={_table_digest(db, aliases[p], table)}' for p in parts)})"
                             "; a shard may be behind on governance, or the projection needs a merge rule")
    _recompute(db, recompute)
    db.execute("DROP TABLE IF EXISTS temp.merge_owner")
    db.execute("COMMIT")
    report.positions = {f"{s}:{p}": o for s, p, o in db.execute("SELECT stream, partition, next_offset FROM _positions "
                                                                "ORDER BY stream, partition")}
    for table in sorted(keep_tables):
        report.rows[table] = db.execute(f"SELECT COUNT(*) FROM main.{_quote(table)}").fetchone()[0]
    return report


def _require_identical(db, aliases, table, base_sql, files) -> None:
    parts = sorted(aliases)
    a0 = aliases[parts[0]]
    for p in parts[1:]:
        a = aliases[p]
        q0, q1 = base_sql.format(a=a0), base_sql.format(a=a)
        if db.execute(f"SELECT COUNT(*) FROM ({q0} EXCEPT {q1})").fetchone()[0] or \
                db.execute(f"SELECT COUNT(*) FROM ({q1} EXCEPT {q0})").fetchone()[0]:
            raise MergeError(f"governance rows of {table} differ between {files[parts[0]]} and {files[p]}")


def _owners(db: sqlite3.Connection, aliases: dict[int, str]) -> dict[str, int]:
    """``temp.merge_owner(execution_id, shard)``: the shard authoritative for each execution id."""
    parts = sorted(aliases)
    owned: dict[str, int] = {}
    for p in parts:
        for (ex,) in db.execute(f"SELECT execution_id FROM {aliases[p]}.{SHARD_EXECUTIONS}"):
            if ex in owned and owned[ex] != p:
                raise MergeError(f"execution {ex!r} has records on partitions {owned[ex]} and {p}: the partition key "
                                 f"is not the execution id (a producer bypassed the ledger?)")
            owned[ex] = p
    # Every execution id any shard holds rows for: owned ones plus views and ids named by governance.
    ids: set[str] = set(owned)
    first = aliases[parts[0]]
    tables = [r[0] for r in db.execute(f"SELECT name FROM {first}.sqlite_master WHERE type='table' "
                                       "AND name NOT LIKE 'sqlite_%'")]
    for t in tables:
        if t in _BOOKKEEPING:
            continue
        if "execution_id" in _columns(db, first, t):
            for p in parts:
                ids.update(r[0] for r in db.execute(f"SELECT DISTINCT execution_id FROM {aliases[p]}.{_quote(t)} "
                                                    "WHERE execution_id IS NOT NULL"))
    parent = _parents(db, first, tables)
    out: dict[str, int] = {}
    for ex in ids:
        root, seen = ex, {ex}
        while root in parent and parent[root] not in seen and root not in owned:
            root = parent[root]
            seen.add(root)
        out[ex] = owned.get(root, parts[0])
    db.execute("CREATE TEMP TABLE IF NOT EXISTS merge_owner (execution_id TEXT PRIMARY KEY, shard INTEGER NOT NULL)")
    db.execute("DELETE FROM temp.merge_owner")
    db.executemany("INSERT INTO temp.merge_owner VALUES (?, ?)", sorted(out.items()))
    return out


def _parents(db: sqlite3.Connection, schema: str, tables: list[str]) -> dict[str, str]:
    """Derived view -> parent, from the governance tables (identical in every shard)."""
    if "lineage" in tables:
        return dict(db.execute(f"SELECT derived_execution_id, parent_execution_id FROM {schema}.lineage"))
    if "split_derived" in tables:
        return dict(db.execute(f"SELECT derived_execution_id, MIN(parent_execution_id) FROM {schema}.split_derived "
                               "GROUP BY derived_execution_id"))
    if "assessment_executions" in tables:
        return dict(db.execute(f"SELECT execution_id, parent_execution_id FROM {schema}.assessment_executions "
                               "WHERE parent_execution_id IS NOT NULL"))
    return {}


def _recompute(db: sqlite3.Connection, tables: list[str]) -> None:
    if _TELEMETRY in tables:

        with_rows = {r[0] for r in db.execute("SELECT DISTINCT route FROM admission")}
        for name, route in current_routes(db).items():
            if name in with_rows:
                refresh_telemetry(db, route)
    if any(t in tables for t in _CREDIT_AGGREGATES):

        pools = {r[0] for r in db.execute("SELECT pool FROM credit_pools")}
        pools |= {r[0] for r in db.execute("SELECT DISTINCT pool FROM credit_events")}
        for pool in sorted(pools):
            refold(db, pool)
    if any(t in tables for t in _PREFERENCE_AGGREGATES):

        for route in current_routes(db).values():
            recompute_route(db, route)


def shard_positions(state_dir: str | Path) -> dict[tuple[str, int], int]:
    """Applied positions of a shard directory: each execution partition from its own shard,
    the governance topic at the *lowest* position of any shard (what every shard has applied).

    Reads committed state only (WAL readers), so it is safe while projectors run."""
    out: dict[tuple[str, int], int] = {}
    gov: dict[str, int] = {}
    for p, f in shard_files(state_dir).items():
        try:
            db = sqlite3.connect(f"file:{f}?mode=ro", uri=True, timeout=5)
        except sqlite3.OperationalError:
            continue
        try:
            meta = dict(db.execute(f"SELECT key, value FROM {SHARD_META}"))
            rows = db.execute("SELECT stream, partition, next_offset FROM _positions").fetchall()
        except sqlite3.OperationalError:  # being created
            continue
        finally:
            db.close()
        g = meta.get("governance_topic")
        have_gov = False
        for stream, part, off in rows:
            if stream == g:
                gov[g] = min(gov.get(g, off), off)
                have_gov = True
            elif stream == meta.get("executions_topic") and part == p:
                out[(stream, part)] = off
        if g and not have_gov:
            gov[g] = 0
    for g, off in gov.items():
        out[(g, 0)] = off
    return out
