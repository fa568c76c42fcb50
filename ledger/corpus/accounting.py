"""SPEC §6.7 accounting of a route, aggregated over sets (issue 32: the route and status pages of a
100,000-execution store).

The figures are those of the first, per-execution implementation (kept as the reference in
``tests/test_accounting_sets.py``): a handful of statements per route instead of about nine per
execution.  Grouped queries give the dispositions, the role-class and behavioural-role token sums
and the admitted subtrees (a recursive walk from every drawn leaf to the root, each node counted
once, for the lowest draw that covers it); Python folds the per-execution costs in execution order
(float sums keep the order of the reference) and looks up, one execution at a time, only what has
no set-based form: the cohort of a derived view with no ``execution_opened`` and the inherited
selection of a derived view.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ledger.algorithms.economics import family_of
from ledger.corpus.records import ROLE_CLASSES
from ledger.projections.admission import route_definition
from ledger.projections.splits import split_tables_present
from ledger.projections.admission import current_routes
from ledger.projections.lineage import iter_ancestors
from ledger.projections.admission import selection_for
from ledger.projections.evidence import disrupted_candidates, disruptions

__all__ = ["accounting", "accounting_all", "cohort_of", "disposition", "document", "empty_dispositions", "zero"]

_INELIGIBLE = ("record_adequacy", "permitted_use")
_EMITTED = ("admitted", "dummy")


def _has(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone() is not None


def zero() -> dict[str, int]:
    return {"records": 0, "stored_tokens": 0, "processed_tokens_path": 0, "processed_tokens_tree": 0, "target_tokens": 0}


def accounting(db: sqlite3.Connection, route: str) -> dict:
    """SPEC §6.7 accounting of one route from the projection (no token payload is read).

    ``records`` / ``stored_tokens`` (the admitted subtrees, each node once: what the tree
    export stores) / ``processed_tokens`` (``path`` export, ``tree`` export, ``naive``
    per-request expansion) / ``target_tokens``, plus ``tree_tokens`` (the whole prefix
    trees of the emitted executions, as the ledger keeps them), by role class (main/sub ×
    task/summary) and by behavioural role (TargetSelection: direct / recovery /
    hard_negative, else ``unlabelled``); the disposition of every execution exactly once
    (``emitted``, ``assessed_not_selected`` with reasons, ``ineligible``, ``pending``,
    ``unknown``); and the cost per emitted artifact (cohort cost / emitted executions,
    dummies included), overall and per cohort (``collection_run_id``).
    """

    r = route_definition(db, route)
    cost, dispositions, states = _attempts(db, route, r)
    return document(db, route, r, _tokens(db, route, r, states), dispositions, cost)

def document(db: sqlite3.Connection, route: str, r, tokens: tuple[dict, dict, dict], dispositions: dict, cost: dict) -> dict:
    """The accounting document of ``route`` (definition ``r``) from its ``(totals, by_role_class, by_behavioral_role)`` token
    sums, its dispositions and its costs (``cohort``, ``emitted``, per cohort ``attempts``/``emitted``/``cost``)."""

    totals, by_role, by_behavior = tokens
    evaluated = sum([dispositions["emitted"]] + [sum(v.values()) for k, v in dispositions.items() if k != "emitted"])
    return {
        "route": route,
        "route_version": r.version,
        "use": r.use,
        "split": r.split,
        **totals,
        "by_role_class": {k: by_role[k] for k in sorted(by_role, key=lambda c: (ROLE_CLASSES.index(c) if c in ROLE_CLASSES else 9, c))},
        "by_behavioral_role": dict(sorted(by_behavior.items())),
        "dispositions": {k: (dict(sorted(v.items())) if isinstance(v, dict) else v) for k, v in dispositions.items()},
        "attempts": evaluated,
        "cost": {"cohort": cost["cohort"], "emitted": cost["emitted"],
                 "per_emitted_artifact": (cost["cohort"] / cost["emitted"]) if cost["emitted"] else None},
        "cohorts": {k: {**v, "per_emitted_artifact": (v["cost"] / v["emitted"]) if v["emitted"] else None}
                    for k, v in sorted(cost["cohorts"].items())},
        "notes": [] if split_tables_present(db) else ["no split map: group_id is the task id"],
        **(_disruptions(db, route) if r.use_specific else {}),
    }


def accounting_all(db: sqlite3.Connection) -> dict:
    """Accounting of every declared route (for ``ledger status --json``)."""

    return {name: accounting(db, name) for name in current_routes(db)}


def empty_dispositions(r) -> dict[str, Any]:
    out: dict[str, Any] = {"emitted": 0, "assessed_not_selected": {}, "ineligible": {}, "pending": {}, "unknown": {}}
    if r.use_specific:
        out["redundancy"] = {}  # SPEC §6.7: a retention cap's choice (semantics 2)
    return out


def disposition(r, state: str, predicate: str | None, verdict: str, missing: str | None, reason: str | None) -> tuple[str, str]:
    """``(bucket, key)`` of an execution route ``r`` did not emit: ``predicate: reason`` (rejected) or
    ``predicate: missing evidence`` (pending, unknown)."""
    declared = {p.name: p.family for p in r.predicates}
    family = family_of(predicate, declared) if r.semantics >= 3 else declared.get(predicate)
    if state == "rejected" and r.use_specific and predicate in ("per_task_cap", "lineage_family"):
        return "redundancy", f"{predicate}: {reason}"
    if state == "rejected":  # semantics 3 files the ledger's own checks by family too (SPEC 11.1)
        return "ineligible" if family in _INELIGIBLE else "assessed_not_selected", f"{predicate}: {reason}"
    return "pending" if verdict == "pending" else "unknown", f"{predicate}: {missing}"


def _attempts(db: sqlite3.Connection, route: str, r) -> tuple[dict, dict, dict[str, int]]:
    """``(cost, dispositions, executions per state)`` of the route's admission rows, in one grouped scan.

    ``cost``: cohort cost, emitted executions and per cohort (``collection_run_id``) attempts / emitted /
    cost; ``dispositions``: every execution once, the not emitted under their :func:`disposition`.  Costs
    are added in execution order, as the per-execution reference added them (an execution without a cost
    adds nothing)."""
    has_ex = _has(db, "executions")
    cohort, known = ("COALESCE(e.collection_run_id, 'unknown')", "e.execution_id IS NOT NULL") if has_ex else ("'unknown'", "1")
    join = "LEFT JOIN executions e ON e.execution_id = a.execution_id" if has_ex else ""
    cohorts: dict[str, dict[str, Any]] = {}
    out, states = empty_dispositions(r), {"admitted": 0, "dummy": 0}

    def add(name: str, state: str, predicate, verdict, missing, reason, n: int) -> None:
        co = cohorts.setdefault(name, {"attempts": 0, "emitted": 0, "cost": 0.0})
        co["attempts"] += n
        states[state] = states.get(state, 0) + n
        if state in _EMITTED:
            co["emitted"] += n
            out["emitted"] += n
        else:
            bucket, key = disposition(r, state, predicate, verdict, missing, reason)
            out[bucket][key] = out[bucket].get(key, 0) + n

    columns = "a.state, a.predicate, a.verdict, a.missing_evidence, a.reason"
    for row in db.execute(f"SELECT {cohort}, {columns}, COUNT(*) FROM admission a {join} WHERE a.route = ? AND {known} "
                          "GROUP BY 1, 2, 3, 4, 5, 6", (route,)):
        add(*row)
    views = {}  # no execution_opened (a derived view): the cohort of its nearest ancestor with one
    for ex, *row in db.execute(f"SELECT a.execution_id, {columns} FROM admission a {join} WHERE a.route = ? AND NOT {known}",
                               (route,)):
        views[ex] = cohort_of(db, ex)
        add(views[ex], *row, 1)
    total = 0.0
    for ex, name, amount in db.execute(
            f"SELECT c.execution_id, CASE WHEN {known} THEN {cohort} END, SUM(c.amount) FROM execution_costs c JOIN admission a "
            f"ON a.route = ? AND a.execution_id = c.execution_id {join} GROUP BY c.execution_id ORDER BY c.execution_id",
            (route,)):
        total += amount
        cohorts[name if name is not None else views[ex]]["cost"] += amount
    return {"cohort": total, "emitted": out["emitted"], "cohorts": cohorts}, out, states


def cohort_of(db: sqlite3.Connection, ex: str) -> str:
    """The collection run (ExecutionOpened.collection_run_id) of an execution; a derived view
    belongs to its parent's; ``"unknown"`` when none was declared."""

    for cur in iter_ancestors(db, ex):
        try:
            row = db.execute("SELECT collection_run_id FROM executions WHERE execution_id = ?", (cur,)).fetchone()
        except sqlite3.OperationalError:
            return "unknown"
        if row is not None:
            return row[0] or "unknown"
    return "unknown"


def _labels(db: sqlite3.Connection, route: str, r) -> dict[str, str]:
    """Emitted execution -> its behavioural role, for those with one (the others are ``unlabelled``).

    Before semantics 2: the first labelled selection made on the execution.  From semantics 2
    (SPEC §6.8) the selection in force: an original's own (a ``hard_negative`` anywhere wins, else
    the first labelled one); a derived view's is resolved along its chain
    (:func:`projections.admission.selection_for`)."""
    emitted = "JOIN admission a ON a.route = ? AND a.execution_id = t.execution_id AND a.state IN ('admitted', 'dummy')"
    out: dict[str, str] = {}
    for ex, role in db.execute(f"SELECT t.execution_id, t.behavioral_role FROM target_selections t {emitted} WHERE "
                               "t.behavioral_role IS NOT NULL ORDER BY t.execution_id, t.selection_id", (route,)):
        if ex not in out or (r.use_specific and role == "hard_negative"):
            out[ex] = role
    if r.use_specific and _has(db, "assessment_executions"):

        for (ex,) in db.execute(f"SELECT t.execution_id FROM assessment_executions t {emitted} WHERE "
                                "t.parent_execution_id IS NOT NULL", (route,)):
            role = selection_for(db, ex, r.semantics).role
            if role is None:
                out.pop(ex, None)
            else:
                out[ex] = role
    return out


# each execution once: grouped by execution for the labelled ones (json_each: their ids), else together (NULL)
_BY_LABEL = "CASE WHEN {col} IN (SELECT value FROM json_each(?)) THEN {col} END"
_ADMITTED = "JOIN admission a ON a.route = p.route AND a.execution_id = p.execution_id AND a.state = 'admitted'"
# the admitted subtree of every admitted execution: walk up from each drawn leaf, keep each node's lowest draw
_SUBTREES = f"""
WITH RECURSIVE walk(ex, draw, role, node, parent, len) AS (
  SELECT p.execution_id, p.draw_index, p.role_class, n.node_id, n.parent, length(n.tokens) / 4 FROM admitted_paths p
  {_ADMITTED}
  JOIN tree_requests q ON q.execution_id = p.execution_id AND q.request_id = p.leaf_request_id
  JOIN tree_nodes n ON n.execution_id = p.execution_id AND n.node_id = q.node_id
  WHERE p.route = ?
  UNION ALL
  SELECT w.ex, w.draw, w.role, n.node_id, n.parent, length(n.tokens) / 4 FROM walk w
  JOIN tree_nodes n ON n.execution_id = w.ex AND n.node_id = w.parent),
owner(ex, role, len) AS (SELECT ex, role, len FROM (SELECT ex, MIN(draw), role, len FROM walk GROUP BY ex, node))
SELECT {_BY_LABEL.format(col="ex")}, role, SUM(len) FROM owner GROUP BY 1, 2
"""


def _tokens(db: sqlite3.Connection, route: str, r, states: dict[str, int]):
    """``(totals, by_role_class, by_behavioral_role)`` of the emitted executions (``states``: how many
    executions the route has in each state)."""
    labels = _labels(db, route, r)
    ids = json.dumps(sorted(labels))
    emitted, dummies = states["admitted"] + states["dummy"], states["dummy"]
    totals: dict[str, Any] = {"records": dummies, "dummies": dummies, "executions": emitted, "stored_tokens": 0,
                              "tree_tokens": 0, "target_tokens": 0, "processed_tokens": {"path": 0, "tree": 0, "naive": 0}}
    by_role: dict[str, dict[str, int]] = {}
    by_behavior = {b: zero() for b in {*labels.values(), *(["unlabelled"] if emitted > len(labels) else [])}}
    for (ex,) in db.execute("SELECT a.execution_id FROM json_each(?) j JOIN admission a ON a.route = ? AND "
                            "a.execution_id = j.value AND a.state = 'dummy'", (ids, route)):
        by_behavior[labels[ex]]["records"] += 1
        dummies -= 1
    if dummies:
        by_behavior["unlabelled"]["records"] += dummies
    if _has(db, "tree_stats"):
        stored, expanded = db.execute(
            "SELECT COALESCE(SUM(s.stored_tokens), 0), COALESCE(SUM(s.expanded_tokens), 0) FROM admission a "
            "JOIN tree_stats s ON s.execution_id = a.execution_id WHERE a.route = ? AND a.state = 'admitted'",
            (route,)).fetchone()
        totals["tree_tokens"] += stored
        totals["processed_tokens"]["naive"] += expanded
    for ex, role, n, path_tokens, targets in db.execute(
            f"SELECT {_BY_LABEL.format(col='p.execution_id')}, p.role_class, COUNT(*), SUM(p.path_tokens), "
            f"SUM(p.target_tokens) FROM admitted_paths p {_ADMITTED} WHERE p.route = ? GROUP BY 1, 2", (ids, route)):
        for row in (by_role.setdefault(role, zero()), by_behavior[labels.get(ex, "unlabelled")]):
            row["records"] += n
            row["processed_tokens_path"] += path_tokens
            row["target_tokens"] += targets
        totals["records"] += n
        totals["processed_tokens"]["path"] += path_tokens
        totals["target_tokens"] += targets
    for ex, role, n in db.execute(_SUBTREES, (route, ids)):
        for row in (by_role.setdefault(role, zero()), by_behavior[labels.get(ex, "unlabelled")]):
            row["processed_tokens_tree"] += n
            row["stored_tokens"] += n
        totals["processed_tokens"]["tree"] += n
        totals["stored_tokens"] += n
    return totals, by_role, by_behavior


def _disruptions(db: sqlite3.Connection, route: str) -> dict:
    """SPEC 6.10: injected vs natural disruptions of the emitted executions by role class (ledger/projections/evidence.py)."""

    candidates = disrupted_candidates(db)  # most executions have neither a fault nor an error result
    emitted = [r[0] for r in db.execute("SELECT a.execution_id FROM json_each(?) j JOIN admission a ON a.route = ? AND "
                                        "a.execution_id = j.value AND a.state IN ('admitted', 'dummy')",
                                        (json.dumps(sorted(candidates)), route))]
    return {"disruptions": disruptions(db, emitted, candidates)}
