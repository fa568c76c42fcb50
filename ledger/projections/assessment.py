"""Assessment and scoring projection (SPEC §6.2; seed 000 "Why Scoring Can Survive an
Incomplete Run").

Every AssessmentRecorded is kept (table ``assessments``); nothing ever overwrites an
earlier assessment.  Per execution the projection derives one score (table
``execution_scores``) and, for branch-scoped assessments, one score per branch (table
``branch_scores``):

* The **committed artifact version** is the last of ExecutionClosed.artifact_versions
  (the first closure by log order fixes it).  Only assessments of that version count.  A
  closure that lists no artifact versions has nothing to bind to, so its assessments count
  whatever version they name.
* An assessment counts only if it was recorded **no later than the deadline**: its
  ``occurred_at`` is ``<= deadline`` *and* it reached the log before the budget ended.  The
  budget ends at the first ExecutionFinalized or at the first event of the execution stamped
  after the deadline, whichever comes first in the execution's log order.  (Requiring both
  keeps every decision final: once excluded, a back-dated assessment cannot revive it.)
* ``scored`` and ``not_assessable`` are decisive; ``evaluator_error`` is not (the evaluator
  may retry against the same preserved artifact).  Per scope — the whole execution, or one
  ``branch_request_id`` — the **first valid decisive assessment in log order wins**; every
  later decisive assessment of the committed version in the same scope is kept with
  ``status = 'conflict'``, ``conflict = 1`` and ``agrees`` telling whether it says the same.
* Execution state: ``scored`` (valid reward, zero included; or branch-scoped rewards only,
  then ``reward`` is NULL and only the scored branches' paths carry a reward), ``dummy``
  (first decisive is ``not_assessable``: zero reward, no targets, still counted),
  ``excluded`` (budget over without a valid reward), else ``pending``.  Termination status,
  elapsed time and length never enter.
* Derived views (RecordDerived, SPEC §6.4) are ``pending`` until Revalidated(pass); a pass
  carries the parent's decided score over (or its own ``reward``), a fail excludes the view.

Convergence: everything is keyed by execution and ordered by ``seq``, the position of the
event among *that execution's* events, which is the same on every interleaving of
partitions (execution-scoped events share one partition key).  Cross-partition inputs
(derived views and their revalidation) are combined from sets, and the affected scores are
recomputed from scratch whenever one of their inputs changes.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass

from ledger.projections.descendants import descendants
from ledger.projections.engine import Applied
from ledger.projections.lineage import ancestors

__all__ = ["AssessmentProjection", "ExecutionScore", "execution_score", "branch_rewards", "path_reward"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS assessment_executions (
    execution_id TEXT PRIMARY KEY,
    task_id TEXT, deadline INTEGER, opened INTEGER NOT NULL DEFAULT 0,
    n_events INTEGER NOT NULL DEFAULT 0,
    closed_seq INTEGER, status TEXT, artifact_versions TEXT, committed_version TEXT,
    finalized_seq INTEGER, late_seq INTEGER, max_occurred_at INTEGER,
    parent_execution_id TEXT, revalidated TEXT, revalidated_reward REAL
);
CREATE INDEX IF NOT EXISTS assessment_executions_task ON assessment_executions (task_id);
CREATE INDEX IF NOT EXISTS assessment_executions_parent ON assessment_executions (parent_execution_id);
CREATE TABLE IF NOT EXISTS assessments (
    execution_id TEXT NOT NULL, assessment_id TEXT NOT NULL, seq INTEGER NOT NULL,
    artifact_version TEXT NOT NULL, branch_request_id TEXT, evaluator TEXT NOT NULL,
    outcome TEXT NOT NULL, reward REAL, occurred_at INTEGER NOT NULL, criteria TEXT NOT NULL,
    status TEXT NOT NULL, conflict INTEGER NOT NULL DEFAULT 0, agrees INTEGER,
    PRIMARY KEY (execution_id, assessment_id)
);
CREATE TABLE IF NOT EXISTS execution_scores (
    execution_id TEXT PRIMARY KEY,
    state TEXT NOT NULL CHECK (state IN ('pending', 'scored', 'excluded', 'dummy')),
    reward REAL, reason TEXT NOT NULL, conflict INTEGER NOT NULL DEFAULT 0,
    assessment_id TEXT
);
CREATE TABLE IF NOT EXISTS branch_scores (
    execution_id TEXT NOT NULL, branch_request_id TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('scored', 'not_assessable')),
    reward REAL, assessment_id TEXT NOT NULL, conflict INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (execution_id, branch_request_id)
);
CREATE TABLE IF NOT EXISTS execution_costs (
    execution_id TEXT NOT NULL, event_id TEXT NOT NULL, amount REAL NOT NULL,
    category TEXT, currency TEXT,
    PRIMARY KEY (execution_id, event_id)
);
"""

_EXECUTION_SCOPED = {"execution_opened", "request", "tool_payload", "execution_closed", "assessment",
                     "execution_finalized", "target_selection", "predicate_evaluated", "cost_recorded"}
_DECISIVE = ("scored", "not_assessable")


@dataclass(frozen=True)
class ExecutionScore:
    state: str  # pending | scored | excluded | dummy
    reward: float | None
    reason: str
    conflict: bool
    assessment_id: str | None = None


class AssessmentProjection:
    """Tables ``assessments``, ``execution_scores``, ``branch_scores``, ``execution_costs``
    (and its working table ``assessment_executions``)."""

    name = "assessment"

    def __init__(self) -> None:
        self.reset()

    # ------------------------------------------------------------------ protocol
    def create(self, db: sqlite3.Connection) -> None:
        db.executescript(_SCHEMA)

    def reset(self) -> None:
        self.dirty: set[str] = set()
        # Per-execution counters touched in the current batch: [n_events, deadline, late_seq,
        # max_occurred_at]; written back in finish() (one UPDATE per execution, not per event).
        self._counters: dict[str, list] = {}

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev, et = item.event, item.type
        if et in _EXECUTION_SCOPED:
            self._execution_event(db, ev, et)
        elif et == "record_derived":
            ex = ev["derived_execution_id"]
            db.execute("INSERT OR IGNORE INTO assessment_executions (execution_id) VALUES (?)", (ex,))
            db.execute("UPDATE assessment_executions SET parent_execution_id = COALESCE(parent_execution_id, ?) "
                       "WHERE execution_id = ?", (ev["parent_execution_id"], ex))
            self.dirty.add(ex)
        elif et == "revalidated":
            ex = ev["derived_execution_id"]
            db.execute("INSERT OR IGNORE INTO assessment_executions (execution_id) VALUES (?)", (ex,))
            row = db.execute("SELECT revalidated FROM assessment_executions WHERE execution_id = ?", (ex,)).fetchone()
            verdict = ev["verdict"]
            # A fail is final whatever else arrives; otherwise the first verdict stands.
            if row[0] is None or (verdict == "fail" and row[0] != "fail"):
                db.execute("UPDATE assessment_executions SET revalidated = ?, revalidated_reward = ? WHERE execution_id = ?",
                           (verdict, ev.get("reward"), ex))
            self.dirty.add(ex)

    def finish(self, db: sqlite3.Connection) -> None:
        if self._counters:
            db.executemany("UPDATE assessment_executions SET n_events = ?, late_seq = ?, max_occurred_at = ? "
                           "WHERE execution_id = ?", [(c[0], c[2], c[3], ex) for ex, c in self._counters.items()])
            self._counters = {}
        if not self.dirty:
            return
        todo = set(self.dirty)
        # Derived views follow their parents (transitively).
        if db.execute("SELECT 1 FROM assessment_executions WHERE parent_execution_id IS NOT NULL LIMIT 1").fetchone():
            todo |= descendants(db, todo, table="assessment_executions", child="execution_id",
                                parent="parent_execution_id")
        # Parents before children so a view sees its parent's fresh score.
        for ex in sorted(todo, key=lambda e: (_depth(db, e), e)):
            recompute(db, ex)
        self.dirty = set()

    # ------------------------------------------------------------------ events
    def _execution_event(self, db: sqlite3.Connection, ev: dict, et: str) -> None:
        ex = ev["execution_id"]
        c = self._counters.get(ex)
        if c is None:
            db.execute("INSERT OR IGNORE INTO assessment_executions (execution_id) VALUES (?)", (ex,))
            c = list(db.execute("SELECT n_events, deadline, late_seq, max_occurred_at FROM assessment_executions "
                                "WHERE execution_id = ?", (ex,)).fetchone())
            self._counters[ex] = c
        seq = c[0]
        at = ev["occurred_at"]
        changed = False
        if et == "execution_opened" and c[1] is None:
            c[1] = ev["deadline"]
            db.execute("UPDATE assessment_executions SET task_id = ?, deadline = ?, opened = 1 WHERE execution_id = ?",
                       (ev["task_id"], c[1], ex))
            changed = True
        if c[1] is not None and c[2] is None and at > c[1]:
            c[2] = seq  # the first event stamped after the deadline ends the budget
            changed = True
        c[0] = seq + 1
        c[3] = at if c[3] is None else max(c[3], at)
        if et == "execution_closed":
            versions = list(ev.get("artifact_versions") or [])
            db.execute("UPDATE assessment_executions SET closed_seq = ?, status = ?, artifact_versions = ?, committed_version = ? "
                       "WHERE execution_id = ? AND closed_seq IS NULL",
                       (seq, ev["status"], json.dumps(versions), versions[-1] if versions else None, ex))
            changed = True
        elif et == "execution_finalized":
            db.execute("UPDATE assessment_executions SET finalized_seq = ? WHERE execution_id = ? AND finalized_seq IS NULL",
                       (seq, ex))
            changed = True
        elif et == "assessment":
            db.execute("INSERT OR IGNORE INTO assessments (execution_id, assessment_id, seq, artifact_version, branch_request_id, "
                       "evaluator, outcome, reward, occurred_at, criteria, status) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       (ex, ev["assessment_id"], seq, ev["artifact_version"], ev.get("branch_request_id"), ev["evaluator"],
                        ev["outcome"], ev.get("reward"), at, json.dumps(ev.get("criteria") or [], sort_keys=True), "unbound"))
            changed = True
        elif et == "cost_recorded":
            db.execute("INSERT OR IGNORE INTO execution_costs VALUES (?,?,?,?,?)",
                       (ex, ev["event_id"], ev["amount"], ev.get("category"), ev.get("currency")))
        if changed:
            self.dirty.add(ex)


def _depth(db: sqlite3.Connection, ex: str) -> int:
    return len(ancestors(db, ex)) - 1


# ---------------------------------------------------------------------- scoring rules


def recompute(db: sqlite3.Connection, ex: str) -> ExecutionScore:
    """Re-derive the score of ``ex`` (and the status of each of its assessments) from scratch."""
    row = db.execute("SELECT opened, deadline, closed_seq, committed_version, artifact_versions, finalized_seq, late_seq, "
                     "parent_execution_id, revalidated, revalidated_reward FROM assessment_executions WHERE execution_id = ?",
                     (ex,)).fetchone()
    if row is None:
        raise KeyError(ex)
    opened, deadline, closed_seq, committed, versions, finalized_seq, late_seq, parent, reval, reval_reward = row
    if parent is not None:
        score = _derived_score(db, parent, reval, reval_reward)
        _store(db, ex, score)
        return score

    ends = [s for s in (finalized_seq, late_seq) if s is not None]
    budget_end = min(ends) if ends else None
    any_version = closed_seq is not None and not json.loads(versions or "[]")

    winners: dict[str | None, tuple] = {}  # scope -> winning assessment row
    statuses: list[tuple[str, int, int | None, str, str]] = []
    conflicts: dict[str | None, bool] = {}
    errors = 0
    for a_id, seq, version, branch, outcome, reward, at in db.execute(
            "SELECT assessment_id, seq, artifact_version, branch_request_id, outcome, reward, occurred_at "
            "FROM assessments WHERE execution_id = ? ORDER BY seq", (ex,)):
        conflict, agrees = 0, None
        if closed_seq is None:
            status = "unbound"  # the committed version is not known yet
        elif not any_version and version != committed:
            status = "stale_version"
        elif outcome == "evaluator_error":
            status = "evaluator_error"
            errors += 1
        elif branch in winners:
            w = winners[branch]
            status, conflict = "conflict", 1
            agrees = int(w[4] == outcome and w[5] == reward)
            conflicts[branch] = True
        elif deadline is None or at > deadline or (budget_end is not None and seq >= budget_end):
            status = "late"  # stamped after the deadline, or logged after the budget ended
        else:
            status = "counts"
            winners[branch] = (a_id, seq, version, branch, outcome, reward)
        statuses.append((status, conflict, agrees, ex, a_id))
    db.executemany("UPDATE assessments SET status = ?, conflict = ?, agrees = ? WHERE execution_id = ? AND assessment_id = ?",
                   statuses)

    db.execute("DELETE FROM branch_scores WHERE execution_id = ?", (ex,))
    db.executemany("INSERT INTO branch_scores VALUES (?,?,?,?,?,?)",
                   [(ex, b, "scored" if w[4] == "scored" else "not_assessable",
                     w[5] if w[4] == "scored" else None, w[0], int(conflicts.get(b, False)))
                    for b, w in sorted(winners.items(), key=lambda kv: kv[0] or "") if b is not None])

    conflict = bool(conflicts.get(None, False))
    top = winners.get(None)
    branch_scored = [w for b, w in winners.items() if b is not None and w[4] == "scored"]
    budget_over = budget_end is not None
    if not opened:
        score = ExecutionScore("pending", None, "execution not opened", conflict)
    elif top is not None and top[4] == "scored":
        score = ExecutionScore("scored", float(top[5]), f"scored by {top[0]}", conflict, top[0])
    elif top is not None:
        score = ExecutionScore("dummy", 0.0, f"not assessable ({top[0]}): zero-reward dummy", conflict, top[0])
    elif branch_scored:
        score = ExecutionScore("scored", None, "branch-scoped rewards only: "
                               + ", ".join(sorted(w[3] for w in branch_scored)), conflict)
    elif budget_over:
        why = "no valid reward by the deadline"
        if closed_seq is None:
            why += " (never closed)"
        elif errors:
            why += f" ({errors} evaluator error{'s' if errors > 1 else ''})"
        score = ExecutionScore("excluded", None, why, conflict)
    elif closed_seq is None:
        score = ExecutionScore("pending", None, "awaiting closure", conflict)
    elif errors:
        score = ExecutionScore("pending", None, "evaluator error; awaiting a retry within the budget", conflict)
    else:
        score = ExecutionScore("pending", None, "awaiting assessment", conflict)
    _store(db, ex, score)
    return score


def _derived_score(db: sqlite3.Connection, parent: str, verdict: str | None, own_reward: float | None) -> ExecutionScore:
    if verdict is None:
        return ExecutionScore("pending", None, "derived view awaiting Revalidated(pass)", False)
    if verdict == "fail":
        return ExecutionScore("excluded", None, "derived view failed revalidation", False)
    if own_reward is not None:
        return ExecutionScore("scored", float(own_reward), "revalidated with its own reward", False)
    p = db.execute("SELECT state, reward, reason, conflict, assessment_id FROM execution_scores WHERE execution_id = ?",
                   (parent,)).fetchone()
    if p is None:
        return ExecutionScore("pending", None, f"parent {parent} not scored yet", False)
    state, reward, reason, conflict, a_id = p
    return ExecutionScore(state, reward, f"inherited from parent {parent}: {reason}", bool(conflict), a_id)


def _store(db: sqlite3.Connection, ex: str, score: ExecutionScore) -> None:
    db.execute("INSERT OR REPLACE INTO execution_scores VALUES (?,?,?,?,?,?)",
               (ex, score.state, score.reward, score.reason, int(score.conflict), score.assessment_id))


# ---------------------------------------------------------------------- queries


def execution_score(db: sqlite3.Connection, execution_id: str) -> ExecutionScore | None:
    row = db.execute("SELECT state, reward, reason, conflict, assessment_id FROM execution_scores WHERE execution_id = ?",
                     (execution_id,)).fetchone()
    return None if row is None else ExecutionScore(row[0], row[1], row[2], bool(row[3]), row[4])


def branch_rewards(db: sqlite3.Connection, execution_id: str) -> dict[str, float | None]:
    """Branch request id -> its reward (``None`` for a not-assessable branch).

    For a derived view, the parent's branch scores apply unless the view was revalidated
    with its own reward."""
    row = db.execute("SELECT parent_execution_id, revalidated, revalidated_reward FROM assessment_executions "
                     "WHERE execution_id = ?", (execution_id,)).fetchone()
    if row is not None and row[0] is not None:
        if row[1] != "pass" or row[2] is not None:
            return {}
        return branch_rewards(db, row[0])
    return {b: r for b, r in db.execute("SELECT branch_request_id, reward FROM branch_scores WHERE execution_id = ?",
                                        (execution_id,))}


def path_reward(path_requests: list[str], execution_reward: float | None,
                branches: dict[str, float | None]) -> tuple[bool, float | None]:
    """The reward of a root-to-leaf path whose requests (root side first) are ``path_requests``.

    The deepest branch-scoped score on the path applies (a path belongs to branch B when
    its leaf is B or descends from it); otherwise the execution's reward.  Returns
    ``(covered, reward)``: ``covered`` is False when no reward applies to the path (no
    execution reward and no scored branch on it, or a not-assessable branch).
    """
    for rid in reversed(path_requests):
        if rid in branches:
            r = branches[rid]
            return (r is not None, r)
    return (execution_reward is not None, execution_reward)
