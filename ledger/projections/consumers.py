"""Feed consumers: which trainer step consumed which member (SPEC §11.6).

Projection ``consumers``.  Tables:

* ``consumer_batches(event_id, consumer, route, step, disposition, checkpoint_id, policy_version,
  members, position)`` -- one row per accepted ``batch_consumed`` event.  ``disposition`` is
  ``trained`` (the members were trained at ``step``) or ``stale`` (the feed gave them up as beyond the
  consumer's staleness bound, ``step`` being the last step acknowledged before).
* ``consumed_members(consumer, route, member_id, execution_id, digest, step, disposition)`` -- the
  members of those batches; ``execution_id`` is read from the member id (``route/execution/leaf``,
  components escaped as natural keys are).
* ``checkpoint_steps(checkpoint_id, consumer, step)`` -- a ``checkpoint_trained`` naming
  ``consumer_steps``, and a ``batch_consumed`` naming its ``checkpoint_id``.  A checkpoint named at
  (consumer, N) trained on every step <= N of that consumer (training is cumulative).
* ``policy_versions(execution_id, policy_version)`` -- ``execution_opened.policy_version``, the
  behaviour policy's version (the feed's staleness bound reads it).

Rules: the first ``trained`` batch of a (consumer, step) holds; a later one under another event id (a
producer writing to Kafka directly past ingest, which refuses it as a conflict) is rejected and listed
in ``_rejected``.  Nothing here reads the clock or a log offset beyond recording the position.
"""

from __future__ import annotations

import sqlite3

from ledger.algorithms.identifiers import split_key
from ledger.projections.engine import Applied, Rejected, TableProjection
from ledger.algorithms.identifiers import key_component

__all__ = ["MERGE_BY_UNION", "ConsumersProjection", "consumed", "consumer_lag", "last_step", "steps_touching"]

# Scale-out (ledger.projections.shards): batch_consumed is partitioned by consumer, not by execution, so these rows sit
# in the shard of the consumer's partition (checkpoint_trained ones in every shard); the merge takes their union.
MERGE_BY_UNION = ("consumer_batches", "consumed_members", "checkpoint_steps")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS consumer_batches (
    event_id TEXT PRIMARY KEY, consumer TEXT NOT NULL, route TEXT NOT NULL, step INTEGER NOT NULL,
    disposition TEXT NOT NULL, checkpoint_id TEXT, policy_version INTEGER, members INTEGER NOT NULL,
    position TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS consumer_batches_step ON consumer_batches (consumer, step) WHERE disposition = 'trained';
CREATE TABLE IF NOT EXISTS consumed_members (
    consumer TEXT NOT NULL, route TEXT NOT NULL, member_id TEXT NOT NULL, execution_id TEXT, digest TEXT NOT NULL,
    step INTEGER NOT NULL, disposition TEXT NOT NULL, PRIMARY KEY (consumer, member_id, disposition, step)
);
CREATE INDEX IF NOT EXISTS consumed_members_execution ON consumed_members (execution_id);
CREATE TABLE IF NOT EXISTS checkpoint_steps (
    checkpoint_id TEXT NOT NULL, consumer TEXT NOT NULL, step INTEGER NOT NULL, PRIMARY KEY (checkpoint_id, consumer, step)
);
CREATE TABLE IF NOT EXISTS policy_versions (execution_id TEXT PRIMARY KEY, policy_version INTEGER NOT NULL);
"""


def member_execution(member_id: str) -> str | None:
    """The execution of a member id ``route/execution/leaf`` (``None`` when it has another shape)."""
    parts = split_key(member_id)
    return parts[1] if len(parts) == 3 else None


class ConsumersProjection(TableProjection):
    """Records acknowledged feed batches, checkpoints naming consumer steps and behaviour policy versions."""

    name = "consumers"
    event_types = frozenset(("execution_opened", "checkpoint_trained", "batch_consumed"))  # what apply acts on (the engine dispatches by type)
    SCHEMA = _SCHEMA

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev = item.event
        if item.type == "execution_opened":
            if ev.get("policy_version") is not None:
                db.execute("INSERT OR IGNORE INTO policy_versions VALUES (?,?)", (ev["execution_id"], ev["policy_version"]))
        elif item.type == "checkpoint_trained":
            db.executemany("INSERT OR IGNORE INTO checkpoint_steps VALUES (?,?,?)",
                           [(ev["checkpoint_id"], s["consumer"], s["step"]) for s in ev.get("consumer_steps") or []])
        elif item.type == "batch_consumed":
            self._batch(db, item)

    @staticmethod
    def _batch(db: sqlite3.Connection, item: Applied) -> None:
        ev, rec = item.event, item.record
        disposition = ev.get("disposition") or "trained"
        if db.execute("SELECT 1 FROM consumer_batches WHERE event_id = ?", (ev["event_id"],)).fetchone():
            return  # the same event delivered again
        try:
            db.execute("INSERT INTO consumer_batches VALUES (?,?,?,?,?,?,?,?,?)",
                       (ev["event_id"], ev["consumer"], ev["route"], ev["step"], disposition, ev.get("checkpoint_id"),
                        ev.get("policy_version"), len(ev["members"]), f"{rec.stream}:{rec.partition}:{rec.offset}"))
        except sqlite3.IntegrityError:
            raise Rejected(f"consumer {ev['consumer']!r} already acknowledged step {ev['step']} with another batch") from None
        db.executemany("INSERT OR IGNORE INTO consumed_members VALUES (?,?,?,?,?,?,?)",
                       [(ev["consumer"], ev["route"], m["member_id"], member_execution(m["member_id"]), m["digest"],
                         ev["step"], disposition) for m in ev["members"]])
        if ev.get("checkpoint_id"):
            db.execute("INSERT OR IGNORE INTO checkpoint_steps VALUES (?,?,?)", (ev["checkpoint_id"], ev["consumer"], ev["step"]))


def _has(db: sqlite3.Connection) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'consumed_members'").fetchone() is not None


def consumed(db: sqlite3.Connection, consumer: str) -> dict[str, tuple[int, str]]:
    """member id -> (step, disposition) of every member ``consumer`` acknowledged (the first step when twice)."""
    if not _has(db):
        return {}
    out: dict[str, tuple[int, str]] = {}
    for mid, step, disp in db.execute("SELECT member_id, step, disposition FROM consumed_members WHERE consumer = ? "
                                      "ORDER BY step, disposition DESC", (consumer,)):
        out.setdefault(mid, (step, disp))
    return out


def last_step(db: sqlite3.Connection, consumer: str) -> int | None:
    """The highest step ``consumer`` acknowledged a trained batch at (``None`` before the first)."""
    if not _has(db):
        return None
    return db.execute("SELECT MAX(step) FROM consumer_batches WHERE consumer = ? AND disposition = 'trained'",
                      (consumer,)).fetchone()[0]


def _checkpoints(db: sqlite3.Connection, consumer: str, step: int) -> list[str]:
    """Checkpoints trained on (consumer, step): named at that step or at a later one of the same consumer."""
    return [r[0] for r in db.execute("SELECT DISTINCT checkpoint_id FROM checkpoint_steps WHERE consumer = ? AND step >= ? "
                                     "ORDER BY checkpoint_id", (consumer, step))]


def steps_touching(db: sqlite3.Connection, executions: set[str] | list[str]) -> list[dict]:
    """Every consumer step that trained on a member of ``executions``: ``{consumer, route, step, checkpoint_ids,
    members: [{member_id, execution_id}]}`` by consumer and step (``stale`` dispositions are not training)."""
    if not _has(db) or not executions:
        return []
    wanted = set(executions)
    found: dict[tuple[str, int], dict] = {}
    for consumer, route, step, mid, ex in db.execute(
            "SELECT consumer, route, step, member_id, execution_id FROM consumed_members WHERE disposition = 'trained' "
            "ORDER BY consumer, step, member_id"):
        if ex in wanted:
            entry = found.setdefault((consumer, step), {"consumer": consumer, "route": route, "step": step, "members": []})
            entry["members"].append({"member_id": mid, "execution_id": ex})
    for (consumer, step), entry in found.items():
        entry["checkpoint_ids"] = _checkpoints(db, consumer, step)
    return [found[k] for k in sorted(found)]


def consumer_lag(db: sqlite3.Connection) -> dict[str, dict]:
    """Per consumer: its route, last step, and the route's admitted members it has not consumed (``lag``)."""
    if not _has(db):
        return {}
    out: dict[str, dict] = {}
    for consumer, route, step in db.execute("SELECT consumer, route, MAX(CASE WHEN disposition = 'trained' THEN step END) "
                                            "FROM consumer_batches GROUP BY consumer, route ORDER BY consumer, route"):
        admitted = _admitted_members(db, route)
        done = {r[0] for r in db.execute("SELECT member_id FROM consumed_members WHERE consumer = ? AND route = ?",
                                         (consumer, route))}
        out[consumer] = {"route": route, "last_step": step, "admitted": len(admitted),
                         "consumed": len(admitted & done), "lag": len(admitted - done)}
    return out


def _admitted_members(db: sqlite3.Connection, route: str) -> set[str]:
    try:
        paths = {r[0] for r in db.execute("SELECT member_id FROM admitted_paths WHERE route = ?", (route,))}
        dummies = [r[0] for r in db.execute("SELECT execution_id FROM admission WHERE route = ? AND state = 'dummy'", (route,))]
    except sqlite3.OperationalError:
        return set()

    return paths | {f"{key_component(route)}/{key_component(ex)}/dummy" for ex in dummies}
