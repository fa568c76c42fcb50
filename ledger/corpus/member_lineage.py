"""Per-member lineage of a semantics-3 manifest (SPEC §11.2; seed 002 §15.10.2, Table 13).

Every member of a route declared under semantics 3 carries, inside its trainer record (so inside
its digest), where it came from::

    {"collection_id", "collection_version", "collection_run_id", "task_id", "fixture",
     "artifact_version", "evaluator", "transformations": [{"execution_id", "transformation"}, ...],
     "selection": {"selection_id", "policy", "behavioral_role"} | null, "route_version", "semantics"}

``transformations`` walks from the member's execution up to its original, root last (the root's
``transformation`` is null; an original execution has just itself).  ``evaluator`` is the counting
assessment's evaluator id@version for the member's path: the deepest branch-scoped counting
assessment on it, else the execution's (a view inherits its parent's; a view revalidated with its
own reward has none).  Everything is read from the projection database as it stands at the
manifest's log position, so ``manifest verify --deep`` rebuilds the same lineage.  A fact the store
never recorded is null, never guessed.
"""

from __future__ import annotations

import sqlite3
from typing import Any
from ledger.projections.lineage import ancestors, task_of
from ledger.projections.admission import selection_for

__all__ = ["ExecutionLineage", "LineageCache", "execution_lineage", "path_requests"]


def _one(db: sqlite3.Connection, sql: str, args: tuple) -> tuple | None:
    try:
        return db.execute(sql, args).fetchone()
    except sqlite3.OperationalError:  # the projection holding that fact is not in this database
        return None


class ExecutionLineage:
    """The lineage facts one execution's members share, and the per-path evaluator."""

    def __init__(self, base: dict[str, Any], chain: list[str], branch_evaluators: dict[str, str | None],
                 execution_evaluator: str | None) -> None:
        self.base = base
        self.chain = chain
        self.branch_evaluators = branch_evaluators
        self.execution_evaluator = execution_evaluator

    def for_path(self, path_requests: list[str] | None) -> dict[str, Any]:
        """The lineage object of a member whose path holds ``path_requests`` (root side first; None for
        a dummy entry, which has no path)."""
        evaluator = self.execution_evaluator
        for rid in reversed(path_requests or ()):
            if rid in self.branch_evaluators:
                evaluator = self.branch_evaluators[rid]
                break
        return {**self.base, "evaluator": evaluator}


def path_requests(loaded, nodes: list[int]) -> list[str]:
    """The request ids on the root-to-leaf ``nodes`` of a loaded tree (root side first)."""
    by_node: dict[int, list[str]] = {}
    for rid, req in loaded.requests.items():
        by_node.setdefault(req.node_id, []).append(rid)
    return [rid for n in nodes for rid in sorted(by_node.get(n, ()))]


class LineageCache:
    """Lineage of the executions a preference export meets (pairs revisit their sides' executions)."""

    def __init__(self, db: sqlite3.Connection, route) -> None:

        self.db, self.route, self._selection = db, route, selection_for
        self._got: dict[str, ExecutionLineage] = {}

    def of_side(self, ex: str, loaded, leaf_request_id: str) -> dict[str, Any]:
        lin = self._got.get(ex)
        if lin is None:
            lin = self._got[ex] = execution_lineage(self.db, self.route, ex,
                                                    self._selection(self.db, ex, self.route.semantics))
        return lin.for_path(path_requests(loaded, loaded.path_nodes(loaded.requests[leaf_request_id].node_id)))


def execution_lineage(db: sqlite3.Connection, route, ex: str, selection) -> ExecutionLineage:
    """The lineage of execution ``ex`` on ``route`` (a :class:`projections.admission.Route`), with
    ``selection`` the :class:`projections.admission.Selection` in force for it."""

    chain = ancestors(db, ex)
    root = chain[-1]
    task = task_of(db, ex)
    run = _one(db, "SELECT collection_run_id FROM executions WHERE execution_id = ?", (root,))
    campaign = _one(db, "SELECT collection_id FROM collection_executions WHERE execution_id = ?", (root,))
    campaign_id = campaign[0] if campaign else None
    version = _one(db, "SELECT MAX(version) FROM collection_manifests WHERE collection_id = ?", (campaign_id,)) \
        if campaign_id is not None else None
    fixture = _one(db, "SELECT fixture FROM tasks WHERE task_id = ?", (task,)) if task is not None else None
    committed = _one(db, "SELECT committed_version FROM assessment_executions WHERE execution_id = ?", (root,))
    transformations = []
    for cur in chain:
        row = _one(db, "SELECT transformation FROM lineage WHERE derived_execution_id = ?", (cur,)) \
            if cur != root else None
        transformations.append({"execution_id": cur, "transformation": row[0] if row else None})
    sel = None if selection is None or selection.selection_id is None else {
        "selection_id": selection.selection_id, "policy": selection.policy, "behavioral_role": selection.role}
    base = {"collection_id": campaign_id, "collection_version": version[0] if version else None,
            "collection_run_id": run[0] if run else None, "task_id": task, "fixture": fixture[0] if fixture else None,
            "artifact_version": committed[0] if committed else None, "transformations": transformations,
            "selection": sel, "route_version": route.version, "semantics": route.semantics}
    branches, whole = _evaluators(db, chain)
    return ExecutionLineage(base, chain, branches, whole)


def _evaluators(db: sqlite3.Connection, chain: list[str]) -> tuple[dict[str, str | None], str | None]:
    """(branch request id -> evaluator, the execution's counting evaluator) from the nearest execution of
    ``chain`` that holds a score (a view revalidated with its own reward holds its own: no evaluator)."""
    for cur in chain:
        score = _one(db, "SELECT state, assessment_id FROM execution_scores WHERE execution_id = ?", (cur,))
        reval = _one(db, "SELECT parent_execution_id, revalidated, revalidated_reward FROM assessment_executions "
                         "WHERE execution_id = ?", (cur,))
        if reval is not None and reval[0] is not None:
            if reval[2] is not None:
                return {}, None  # revalidated with its own reward: no assessment counts
            continue  # a view: its parent's assessments count
        try:
            rows = db.execute("SELECT b.branch_request_id, a.evaluator FROM branch_scores b JOIN assessments a "
                              "ON a.execution_id = b.execution_id AND a.assessment_id = b.assessment_id "
                              "WHERE b.execution_id = ?", (cur,)).fetchall()
        except sqlite3.OperationalError:
            rows = []
        branches = {rid: ev for rid, ev in rows}
        whole = None
        if score is not None and score[1] is not None:
            row = _one(db, "SELECT evaluator FROM assessments WHERE execution_id = ? AND assessment_id = ?",
                       (cur, score[1]))
            whole = row[0] if row else None
        return branches, whole
    return {}, None
