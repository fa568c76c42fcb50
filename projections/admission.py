"""Admission projection: routes, verifier cascades and training targets (SPEC §6.5; seed
002 §15.5, seed 000 "Why Admission Uses Provenance and Shared-Target Masks").

**Routes.**  AdmissionPolicyDeclared declares a route version; every version is kept in
``routes`` and the highest version of a route is the one in force.

**Cascade.**  A route's predicates run in the declared order and evaluation stops at the
first non-pass.  Each predicate belongs to one of the five families of seed 002 §15.5.1:

* ``record_adequacy`` (ledger-computed): the execution is opened and closed; every policy
  output that is not ``reconstructed`` has log-probs; no capture gap (a consumed tool call
  id with no cached ``result`` payload).  A derived view inherits its parent's adequacy.
* ``permitted_use`` (ledger-computed): not withdrawn, the task group's split equals the
  route's split, not quarantined, and a permission for the route's use.  The evidence comes
  from ``projections.splits`` / ``projections.governance`` when those modules exist (or from
  providers passed to the constructor); a missing source gives ``unknown`` with the missing
  evidence named — a missing check is never a pass.
* ``process`` / ``outcome`` (external verifiers): the latest PredicateEvaluated verdict for
  (execution, route, predicate name) in the execution's log order; none yet is ``pending``.
* ``target_suitability`` (ledger-computed): the execution's score must be decided
  (``pending`` until then, ``fail`` when excluded for want of a valid reward); a zero-reward
  dummy bypasses the target check and is admitted as a dummy; otherwise path selection
  (:func:`ledger.algorithms.path_draws.select_paths`) must fix at least one target.

The three ledger-computed families are mandatory: a route that does not list them gets
``record_adequacy`` and ``permitted_use`` prepended and ``target_suitability`` appended.
``fail`` rejects the execution for this route only; ``pending`` / ``unknown`` put it in the
route's unresolved queue tagged with the missing evidence.

**Targets.**  On the execution's :class:`~ledger.algorithms.path_draws.TreeView` (policy-target
candidates only, with the TargetSelection context-only requests turned into context), up to
``j_max`` paths are drawn with the route's role priority and seed (default: the route
name).  Leaves that no reward covers (branch-scoped scoring, see
:func:`projections.assessment.path_reward`) are not drawn.  ``admitted_paths`` stores each
drawn path with its fixed target positions (packed little-endian uint32 offsets into the
root-to-leaf token sequence).

**Determinism.**  ``apply`` only records facts and marks executions dirty (a governance or
route event marks everything dirty); ``finish`` recomputes the dirty executions from the
projected state, so the result does not depend on how events of different executions
interleave nor on batching.  Ordering inside an execution uses that execution's own event
sequence, never a log offset.  Put this projection after the tree, assessment, splits and
governance projections in the engine's list: it reads their tables in ``finish``.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from ledger.algorithms.cascade_plan import (
    CascadePlan,
    Predicate,
    measure_predicate,
    plan_cascade,
)
from ledger.algorithms.path_draws import (
    DEFAULT_PRIORITY,
    Draw,
    Leaf,
    TreeView,
    path_nodes,
    path_target_mask,
    select_paths,
)
from ledger.algorithms.identifiers import join_key
from ledger.events.catalog import EVENT_TYPES
from projections import assessment as _assessment
from projections.descendants import descendants
from projections.engine import Applied

__all__ = ["AdmissionProjection", "Evidence", "FAMILIES", "LEDGER_FAMILIES", "Route", "Verdict", "cascade_plan",
           "current_routes", "effective_predicates", "evaluate", "execution_view", "measured_predicates", "member_id",
           "route_definition"]

FAMILIES = ("record_adequacy", "permitted_use", "process", "outcome", "target_suitability")
LEDGER_FAMILIES = ("record_adequacy", "permitted_use", "target_suitability")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS routes (
    route TEXT NOT NULL, version INTEGER NOT NULL, use TEXT NOT NULL, split TEXT NOT NULL, j_max INTEGER NOT NULL,
    role_priority TEXT NOT NULL, predicates TEXT NOT NULL, declared_predicates TEXT, seed TEXT NOT NULL,
    consumer TEXT, evaluation_claim TEXT, event_id TEXT NOT NULL,
    PRIMARY KEY (route, version)
);
CREATE TABLE IF NOT EXISTS admission (
    route TEXT NOT NULL, execution_id TEXT NOT NULL, route_version INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('admitted', 'rejected', 'unresolved', 'dummy')),
    predicate TEXT, verdict TEXT NOT NULL, missing_evidence TEXT, reason TEXT,
    reward REAL, target_tokens INTEGER NOT NULL, paths INTEGER NOT NULL,
    PRIMARY KEY (route, execution_id)
);
CREATE TABLE IF NOT EXISTS admitted_paths (
    route TEXT NOT NULL, execution_id TEXT NOT NULL, draw_index INTEGER NOT NULL, member_id TEXT NOT NULL,
    leaf_request_id TEXT NOT NULL, leaf_node INTEGER NOT NULL, role_class TEXT NOT NULL,
    path_tokens INTEGER NOT NULL, target_tokens INTEGER NOT NULL, reward REAL, targets BLOB NOT NULL,
    PRIMARY KEY (route, execution_id, draw_index)
);
CREATE UNIQUE INDEX IF NOT EXISTS admitted_paths_member ON admitted_paths (route, member_id);
CREATE TABLE IF NOT EXISTS route_telemetry (
    route TEXT PRIMARY KEY, route_version INTEGER NOT NULL, evaluated INTEGER NOT NULL, admitted INTEGER NOT NULL,
    dummy INTEGER NOT NULL, rejected INTEGER NOT NULL, unresolved INTEGER NOT NULL,
    rejected_by TEXT NOT NULL, unresolved_by TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS predicate_verdicts (
    execution_id TEXT NOT NULL, seq INTEGER NOT NULL, route TEXT NOT NULL, predicate TEXT NOT NULL,
    verdict TEXT NOT NULL, verifier TEXT NOT NULL, slot_seconds REAL, evidence TEXT,
    PRIMARY KEY (execution_id, seq)
);
CREATE INDEX IF NOT EXISTS predicate_verdicts_route ON predicate_verdicts (route, predicate);
CREATE TABLE IF NOT EXISTS target_selections (
    execution_id TEXT NOT NULL, selection_id TEXT NOT NULL, policy TEXT NOT NULL, behavioral_role TEXT,
    context_only TEXT NOT NULL, selected TEXT NOT NULL,
    PRIMARY KEY (execution_id, selection_id)
);
CREATE TABLE IF NOT EXISTS capture_calls (
    execution_id TEXT NOT NULL, call_id TEXT NOT NULL, consumed INTEGER NOT NULL DEFAULT 0,
    result INTEGER NOT NULL DEFAULT 0, first_consumer TEXT,
    PRIMARY KEY (execution_id, call_id)
);
CREATE TABLE IF NOT EXISTS admission_split_facts (
    task_id TEXT PRIMARY KEY, split TEXT, group_id TEXT, quarantined INTEGER
);
CREATE TABLE IF NOT EXISTS capture_logprob_gaps (
    execution_id TEXT NOT NULL, request_id TEXT NOT NULL, PRIMARY KEY (execution_id, request_id)
);
"""

_EXECUTION_SCOPED = {t.type for t in EVENT_TYPES.values() if t.key_field == "execution_id"}
ALL = frozenset(["*"])  # marker: every execution is dirty


# ------------------------------------------------------------------------------ evidence


@dataclass
class Evidence:
    """Where ``permitted_use`` gets its facts.  Each is ``None`` when not available.

    * ``split(db, execution_id) -> (split, group_id, quarantined)``
    * ``permitted(db, execution_id, use) -> (verdict, reason)`` (verdict pass/fail/pending/unknown or bool)
    * ``withdrawn(db, execution_id) -> bool``
    * ``covered(db, subject) -> iterable of execution ids`` (optional): the executions and
      derived views a permission/withdrawal subject reaches, so such an event recomputes
      only those (without it, every execution is recomputed)
    * ``split_facts(db) -> {task_id: (split, group_id, quarantined)}`` (optional): the whole
      split map at once, so a split-map event recomputes only the executions of tasks whose
      facts changed (without it, every execution is recomputed)
    """

    split: Callable | None = None
    permitted: Callable | None = None
    withdrawn: Callable | None = None
    covered: Callable | None = None
    split_facts: Callable | None = None

    @classmethod
    def discover(cls) -> "Evidence":
        ev = cls()
        try:
            from projections import splits  # type: ignore[attr-defined]

            ev.split = getattr(splits, "execution_split", None)
            ev.split_facts = getattr(splits, "task_split_facts", None) or _split_facts_from_tables
        except ImportError:
            pass
        try:
            from projections import governance  # type: ignore[attr-defined]

            ev.permitted = getattr(governance, "permitted", None)
            ev.withdrawn = getattr(governance, "withdrawn", None)
            cov = getattr(governance, "covered_executions", None)
            if cov is not None:
                ev.covered = lambda db, subject: [x for part in cov(db, subject) for x in part]
        except ImportError:
            pass
        return ev

    @property
    def governance_available(self) -> bool:
        return self.permitted is not None and self.withdrawn is not None


def _split_facts_from_tables(db: sqlite3.Connection) -> dict:
    """``{task_id: (split, group_id, quarantined)}`` read in one query from the splits
    projection's ``task_groups`` / ``group_splits`` tables (the same join as
    ``projections.splits.task_split``)."""
    rows = db.execute("SELECT t.task_id, g.split, g.group_id, g.quarantined FROM task_groups t "
                      "JOIN group_splits g ON g.group_id = t.group_id")
    return {t: (sp, g, bool(q)) for t, sp, g, q in rows}


_SPLIT_EVENTS = {"task_registered", "task_linked", "task_link_rejected", "split_policy", "split_reclassified"}


# ------------------------------------------------------------------------------ routes


@dataclass(frozen=True)
class RoutePredicate:
    name: str
    family: str
    depends_on: tuple[str, ...] = ()


@dataclass(frozen=True)
class Route:
    name: str
    version: int
    use: str
    split: str
    j_max: int
    role_priority: tuple[str, ...]
    predicates: tuple[RoutePredicate, ...]
    seed: str
    consumer: str | None = None
    evaluation_claim: str | None = None


def effective_predicates(declared: list[dict] | None) -> list[dict]:
    """The declared predicates with the mandatory ledger-computed families added."""
    preds = [dict(p) for p in (declared or [])]
    families = {p["family"] for p in preds}
    head = [{"name": f, "family": f, "depends_on": []} for f in ("record_adequacy", "permitted_use") if f not in families]
    names = {p["name"] for p in preds}
    for h in head:
        if h["name"] in names:  # a differently-typed predicate already uses the family name
            h["name"] = f"{h['family']}#ledger"
    out = head + preds
    if "target_suitability" not in families:
        name = "target_suitability" if "target_suitability" not in names else "target_suitability#ledger"
        out.append({"name": name, "family": "target_suitability", "depends_on": []})
    return out


def _route_from_row(row) -> Route:
    name, version, use, split, j_max, prio, preds, seed, consumer, claim = row
    return Route(name, version, use, split, j_max, tuple(json.loads(prio)),
                 tuple(RoutePredicate(p["name"], p["family"], tuple(p.get("depends_on", ()))) for p in json.loads(preds)),
                 seed, consumer, claim)


_ROUTE_COLS = "route, version, use, split, j_max, role_priority, predicates, seed, consumer, evaluation_claim"


def current_routes(db: sqlite3.Connection) -> dict[str, Route]:
    """The route version in force for every route (its highest declared version)."""
    rows = db.execute(f"SELECT {_ROUTE_COLS} FROM routes r WHERE version = "
                      "(SELECT MAX(version) FROM routes WHERE route = r.route) ORDER BY route").fetchall()
    return {r[0]: _route_from_row(r) for r in rows}


def route_definition(db: sqlite3.Connection, route: str, version: int | None = None) -> Route:
    if version is None:
        row = db.execute(f"SELECT {_ROUTE_COLS} FROM routes WHERE route = ? ORDER BY version DESC LIMIT 1", (route,)).fetchone()
    else:
        row = db.execute(f"SELECT {_ROUTE_COLS} FROM routes WHERE route = ? AND version = ?", (route, version)).fetchone()
    if row is None:
        raise KeyError(f"no admission policy declared for route {route!r}")
    return _route_from_row(row)


# ------------------------------------------------------------------------------ verdicts


@dataclass(frozen=True)
class Verdict:
    verdict: str  # pass | fail | pending | unknown
    reason: str = ""
    missing: str | None = None  # missing evidence (pending / unknown)


PASS = Verdict("pass")


@dataclass
class _Outcome:
    state: str
    predicate: str | None
    verdict: str
    missing: str | None
    reason: str
    reward: float | None = None
    draws: list[Draw] = field(default_factory=list)
    tree: TreeView | None = None
    rewards: list[float | None] = field(default_factory=list)


# ------------------------------------------------------------------------------ projection


class AdmissionProjection:
    """Tables ``routes``, ``admission``, ``admitted_paths``, ``route_telemetry`` (plus the
    facts it gathers: ``predicate_verdicts``, ``target_selections``, ``capture_calls``,
    ``capture_logprob_gaps``)."""

    name = "admission"

    def __init__(self, evidence: Evidence | None = None) -> None:
        self._evidence = evidence
        self.reset()

    @property
    def evidence(self) -> Evidence:
        if self._evidence is None:
            self._evidence = Evidence.discover()
        return self._evidence

    def reset(self) -> None:
        self.dirty: set[str] = set()  # executions whose own facts changed (paths recomputed)
        self.all_dirty = False
        self.dirty_routes: set[str] = set()
        self.gov_subjects: set[str] = set()
        self.gov_tasks: set[str] = set()
        self.split_changed = False

    def create(self, db: sqlite3.Connection) -> None:
        _assessment.AssessmentProjection().create(db)  # the tables it reads (no-op when present)
        db.executescript(_SCHEMA)

    # -------------------------------------------------------------- apply
    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev, et = item.event, item.type
        if et in _EXECUTION_SCOPED:
            ex = ev["execution_id"]
            self.dirty.add(ex)
            if et == "request":
                self._request(db, ex, ev)
            elif et == "tool_payload":
                if ev["kind"] == "result":
                    db.execute("INSERT INTO capture_calls (execution_id, call_id, result) VALUES (?,?,1) "
                               "ON CONFLICT (execution_id, call_id) DO UPDATE SET result = 1", (ex, ev["call_id"]))
            elif et == "predicate_evaluated":
                seq = db.execute("SELECT COUNT(*) FROM predicate_verdicts WHERE execution_id = ?", (ex,)).fetchone()[0]
                db.execute("INSERT INTO predicate_verdicts VALUES (?,?,?,?,?,?,?,?)",
                           (ex, seq, ev["route"], ev["predicate"], ev["verdict"], ev["verifier"], ev.get("slot_seconds"),
                            ev.get("evidence")))
            elif et == "target_selection":
                db.execute("INSERT OR IGNORE INTO target_selections VALUES (?,?,?,?,?,?)",
                           (ex, ev["selection_id"], ev["policy"], ev.get("behavioral_role"),
                            json.dumps(sorted(set(ev.get("context_only_request_ids") or []))),
                            json.dumps(sorted(set(ev.get("selected_request_ids") or [])))))
        elif et == "admission_policy":
            declared = json.loads(ev["predicates"]) if ev.get("predicates") else None
            preds = effective_predicates(declared)
            db.execute("INSERT OR IGNORE INTO routes VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                       (ev["route"], ev["version"], ev["use"], ev["split"], ev["j_max"],
                        json.dumps(list(ev.get("role_priority") or DEFAULT_PRIORITY)), json.dumps(preds),
                        None if declared is None else json.dumps(declared), ev.get("seed") or ev["route"],
                        ev.get("consumer"), ev.get("evaluation_claim"), ev["event_id"]))
            self.dirty_routes.add(ev["route"])
        elif et in ("record_derived", "revalidated"):
            self.dirty.add(ev["derived_execution_id"])
        elif et in ("permission", "withdrawal"):
            if et == "permission" and ev.get("supersedes"):
                self.all_dirty = True  # lifting a revocation reaches whatever the revocation covered
            else:
                self.gov_subjects.add(ev["subject"])
        elif et in _SPLIT_EVENTS:
            self.split_changed = True
            if et == "task_registered":
                self.gov_tasks.add(ev["task_id"])  # its source now reaches the task's executions

    def _request(self, db: sqlite3.Connection, ex: str, ev: dict) -> None:
        closed = db.execute("SELECT closed_seq FROM assessment_executions WHERE execution_id = ?", (ex,)).fetchone()
        if closed is not None and closed[0] is not None:
            return  # a request after closure is ignored by every projection (the tree lists it in _rejected)
        if ev["generator"] == "policy" and not ev["reconstructed"] and ev["output_ids"] and not ev.get("output_logprobs"):
            db.execute("INSERT OR IGNORE INTO capture_logprob_gaps VALUES (?,?)", (ex, ev["request_id"]))
        for call in ev.get("consumed_tool_call_ids") or []:
            db.execute("INSERT INTO capture_calls (execution_id, call_id, consumed, first_consumer) VALUES (?,?,1,?) "
                       "ON CONFLICT (execution_id, call_id) DO UPDATE SET consumed = 1, "
                       "first_consumer = COALESCE(first_consumer, excluded.first_consumer)", (ex, call, ev["request_id"]))

    # -------------------------------------------------------------- finish
    def finish(self, db: sqlite3.Connection) -> None:
        governance = self._governance_dirty(db)
        if not (self.dirty or self.dirty_routes or governance):
            self.reset_batch()
            return
        routes = current_routes(db)
        if not routes:
            self.reset_batch()
            return
        known: set[str] | None = None
        if governance is ALL or self.dirty_routes & set(routes):
            known = {r[0] for r in db.execute("SELECT execution_id FROM assessment_executions")}
        exec_dirty = _known(db, self.dirty | _derived_closure(db, self.dirty))
        dirty = known if governance is ALL else exec_dirty | _known(db, governance)
        for name, route in routes.items():
            route_changed = name in self.dirty_routes
            todo = sorted(known if route_changed else dirty)
            for ex in todo:
                self._evaluate_store(db, route, ex, reuse=not route_changed and ex not in exec_dirty)
            if todo:
                refresh_telemetry(db, route)
        self.reset_batch()

    def reset_batch(self) -> None:
        self.reset()

    def _governance_dirty(self, db: sqlite3.Connection):
        """Executions whose permitted-use facts may have changed in this batch (or ALL)."""
        ev = self.evidence
        if self.all_dirty:
            return ALL
        out: set[str] = set()
        if self.split_changed and ev.split is not None:
            if ev.split_facts is None:
                return ALL
            try:
                facts = ev.split_facts(db)
            except sqlite3.OperationalError:  # split tables not in this database
                return ALL
            out |= _split_changes(db, facts)
        if ev.governance_available:
            for chunk in _chunks(self.gov_tasks):
                out.update(r[0] for r in db.execute(f"SELECT execution_id FROM assessment_executions WHERE task_id IN "
                                                    f"({','.join('?' * len(chunk))})", chunk))
            for subject in sorted(self.gov_subjects):
                if subject == "*" or ev.covered is None:
                    return ALL
                out |= set(ev.covered(db, subject))
        return out | _derived_closure(db, out)

    def _evaluate_store(self, db: sqlite3.Connection, route: Route, ex: str, *, reuse: bool) -> None:
        prev = db.execute("SELECT state, route_version FROM admission WHERE route = ? AND execution_id = ?",
                          (route.name, ex)).fetchone()
        can_reuse = reuse and prev is not None and prev[0] == "admitted" and prev[1] == route.version
        out = evaluate(db, route, ex, self.evidence, reuse_paths=can_reuse)
        if out.state == "admitted" and out.tree is None and can_reuse:
            # Paths unchanged (same tree, same route version): keep the stored rows.
            n, total = db.execute("SELECT COUNT(*), COALESCE(SUM(target_tokens), 0) FROM admitted_paths "
                                  "WHERE route = ? AND execution_id = ?", (route.name, ex)).fetchone()
            db.execute("INSERT OR REPLACE INTO admission VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       (route.name, ex, route.version, out.state, out.predicate, out.verdict, out.missing, out.reason,
                        out.reward, total, n))
            return
        db.execute("DELETE FROM admitted_paths WHERE route = ? AND execution_id = ?", (route.name, ex))
        total = sum(d.n_targets for d in out.draws) if out.state == "admitted" else 0
        rows = []
        if out.state == "admitted":
            for d, reward in zip(out.draws, out.rewards):
                mask = path_target_mask(out.tree, d)
                pos = np.flatnonzero(mask).astype("<u4")
                rows.append((route.name, ex, d.draw_index, member_id(route.name, ex, d.leaf.request_id),
                             d.leaf.request_id, d.leaf.node_id, d.leaf.role_class, int(mask.shape[0]), d.n_targets,
                             reward, pos.tobytes()))
            db.executemany("INSERT INTO admitted_paths VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
        db.execute("INSERT OR REPLACE INTO admission VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                   (route.name, ex, route.version, out.state, out.predicate, out.verdict, out.missing, out.reason,
                    out.reward, total, len(rows)))


def member_id(route: str, execution_id: str, leaf_request_id: str | None) -> str:
    """``route/execution/leaf`` (``route/execution/dummy`` for a dummy entry), components escaped
    as natural-key components (SPEC §9 "Identifiers are opaque": ids holding ``/`` never
    collide; ids without ``%``, ``/`` or control characters keep their old member ids)."""
    return join_key(route, execution_id, "dummy" if leaf_request_id is None else leaf_request_id)


def _chunks(items, n: int = 500):
    items = sorted(items)
    for i in range(0, len(items), n):
        yield items[i:i + n]


def _known(db: sqlite3.Connection, exs: set[str]) -> set[str]:
    """The members of ``exs`` that the assessment projection knows (opened or derived)."""
    out: set[str] = set()
    for chunk in _chunks(exs):
        out.update(r[0] for r in db.execute(f"SELECT execution_id FROM assessment_executions WHERE execution_id IN "
                                            f"({','.join('?' * len(chunk))})", chunk))
    return out


def _derived_closure(db: sqlite3.Connection, exs: set[str]) -> set[str]:
    """Derived views (transitively) of ``exs``."""
    out: set[str] = set()
    if not exs or db.execute("SELECT 1 FROM assessment_executions WHERE parent_execution_id IS NOT NULL LIMIT 1").fetchone() is None:
        return out
    return descendants(db, exs, table="assessment_executions", child="execution_id",
                       parent="parent_execution_id") - set(exs)


def _split_changes(db: sqlite3.Connection, facts: dict) -> set[str]:
    """Executions of the tasks whose split facts differ from the last snapshot (then update it)."""
    old = {t: (s, g, q) for t, s, g, q in db.execute("SELECT task_id, split, group_id, quarantined FROM admission_split_facts")}
    new = {t: (s, g, int(bool(q))) for t, (s, g, q) in facts.items()}
    changed = sorted(t for t in set(old) | set(new) if old.get(t) != new.get(t))
    if not changed:
        return set()
    db.executemany("DELETE FROM admission_split_facts WHERE task_id = ?", [(t,) for t in changed if t not in new])
    db.executemany("INSERT OR REPLACE INTO admission_split_facts VALUES (?,?,?,?)",
                   [(t, *new[t]) for t in changed if t in new])
    out: set[str] = set()
    for i in range(0, len(changed), 500):
        chunk = changed[i:i + 500]
        out |= {r[0] for r in db.execute(f"SELECT execution_id FROM assessment_executions WHERE task_id IN "
                                         f"({','.join('?' * len(chunk))})", chunk)}
    return out


def refresh_telemetry(db: sqlite3.Connection, route: Route) -> None:
    counts = dict(db.execute("SELECT state, COUNT(*) FROM admission WHERE route = ? GROUP BY state", (route.name,)).fetchall())
    rejected_by = dict(db.execute("SELECT predicate, COUNT(*) FROM admission WHERE route = ? AND state = 'rejected' "
                                  "GROUP BY predicate ORDER BY predicate", (route.name,)).fetchall())
    unresolved_by = dict(db.execute("SELECT predicate || ': ' || COALESCE(missing_evidence, verdict), COUNT(*) FROM admission "
                                    "WHERE route = ? AND state = 'unresolved' GROUP BY 1 ORDER BY 1", (route.name,)).fetchall())
    db.execute("INSERT OR REPLACE INTO route_telemetry VALUES (?,?,?,?,?,?,?,?,?)",
               (route.name, route.version, sum(counts.values()), counts.get("admitted", 0), counts.get("dummy", 0),
                counts.get("rejected", 0), counts.get("unresolved", 0),
                json.dumps(rejected_by, sort_keys=True), json.dumps(unresolved_by, sort_keys=True)))


# ------------------------------------------------------------------------------ cascade


def evaluate(db: sqlite3.Connection, route: Route, ex: str, evidence: Evidence, *, reuse_paths: bool = False) -> _Outcome:
    """Run ``route``'s cascade for execution ``ex`` on the projected state."""
    facts = _Facts(db, ex)
    for pred in route.predicates:
        if pred.family == "record_adequacy":
            v = _record_adequacy(facts)
        elif pred.family == "permitted_use":
            v = _permitted_use(db, ex, route, evidence)
        elif pred.family == "target_suitability":
            score = facts.score
            if score is None or score.state == "pending":
                v = Verdict("pending", score.reason if score else "no assessment state", "valid reward (assessment)")
            elif score.state == "excluded":
                v = Verdict("fail", score.reason)
            elif score.state == "dummy":
                return _Outcome("dummy", pred.name, "pass", None, "zero-reward dummy: " + score.reason, reward=0.0)
            elif reuse_paths:
                v = PASS
            else:
                out = _targets(db, route, ex, facts)
                if isinstance(out, Verdict):
                    v = out
                else:
                    facts.selection = out
                    v = PASS
        else:  # process / outcome: external verifiers
            v = _external(db, ex, route.name, pred.name)
        if v.verdict != "pass":
            state = "rejected" if v.verdict == "fail" else "unresolved"
            return _Outcome(state, pred.name, v.verdict, v.missing if state == "unresolved" else None, v.reason,
                            reward=facts.score.reward if facts.score else None)
    score = facts.score
    if facts.selection is None:  # reused paths
        return _Outcome("admitted", None, "pass", None, "admitted", reward=score.reward if score else None)
    tree, draws, rewards = facts.selection
    return _Outcome("admitted", None, "pass", None, "admitted", reward=score.reward if score else None,
                    draws=draws, tree=tree, rewards=rewards)


class _Facts:
    def __init__(self, db: sqlite3.Connection, ex: str) -> None:
        self.db, self.ex = db, ex
        row = db.execute("SELECT opened, closed_seq, parent_execution_id, task_id FROM assessment_executions "
                         "WHERE execution_id = ?", (ex,)).fetchone()
        self.opened, self.closed, self.parent, self.task_id = (bool(row[0]), row[1] is not None, row[2], row[3]) \
            if row else (False, False, None, None)
        self.score = _assessment.execution_score(db, ex)
        self.selection: tuple[TreeView, list[Draw], list[float | None]] | None = None


def _record_adequacy(f: _Facts) -> Verdict:
    if f.parent is not None:  # a derived view inherits its parent's adequacy
        parent = _Facts(f.db, f.parent)
        v = _record_adequacy(parent)
        if v.verdict != "pass":
            return Verdict(v.verdict, f"parent {f.parent}: {v.reason}", v.missing)
        return PASS
    if not f.opened:
        return Verdict("pending", "execution not opened", "execution_opened")
    if not f.closed:
        if f.score is not None and f.score.state == "excluded":
            return Verdict("fail", "never closed within its time budget")
        return Verdict("pending", "execution not closed", "execution_closed")
    gaps = [r[0] for r in f.db.execute("SELECT request_id FROM capture_logprob_gaps WHERE execution_id = ? ORDER BY 1 LIMIT 3",
                                       (f.ex,))]
    if gaps:
        return Verdict("fail", "policy output without log-probs: " + ", ".join(gaps))
    calls = [r[0] for r in f.db.execute("SELECT call_id FROM capture_calls WHERE execution_id = ? AND consumed = 1 AND result = 0 "
                                        "ORDER BY 1 LIMIT 3", (f.ex,))]
    if calls:
        return Verdict("fail", "capture gap: consumed tool call without a cached result: " + ", ".join(calls))
    return PASS


def _norm_verdict(v) -> str:
    if v is True:
        return "pass"
    if v is False:
        return "fail"
    return str(v)


def _permitted_use(db: sqlite3.Connection, ex: str, route: Route, evidence: Evidence) -> Verdict:
    if evidence.split is None:
        return Verdict("unknown", "split map not available", "split map")
    if evidence.permitted is None or evidence.withdrawn is None:
        return Verdict("unknown", "permissions and withdrawals not available", "permissions")
    if evidence.withdrawn(db, ex):
        return Verdict("fail", "withdrawn")
    split, group, quarantined = evidence.split(db, ex)
    if split is None:
        return Verdict("unknown", f"no split assigned to task group {group}", "split map")
    if split != route.split:
        return Verdict("fail", f"split {split} is not the route's split {route.split}")
    if quarantined:
        return Verdict("pending", f"task group {group} is quarantined", "quarantine review")
    verdict, reason = evidence.permitted(db, ex, route.use)
    verdict = _norm_verdict(verdict)
    if verdict == "pass":
        return PASS
    return Verdict(verdict, reason or f"no permission for {route.use}",
                   None if verdict == "fail" else f"permission for {route.use}")


def _external(db: sqlite3.Connection, ex: str, route: str, predicate: str) -> Verdict:
    row = db.execute("SELECT verdict, verifier, evidence FROM predicate_verdicts WHERE execution_id = ? AND route = ? "
                     "AND predicate = ? ORDER BY seq DESC LIMIT 1", (ex, route, predicate)).fetchone()
    if row is None:
        return Verdict("pending", f"no verdict for {predicate} yet", f"PredicateEvaluated {predicate}")
    verdict, verifier, ev = row
    if verdict == "pass":
        return PASS
    reason = f"{verdict} by {verifier}" + (f" ({ev})" if ev else "")
    return Verdict(verdict, reason, None if verdict == "fail" else f"{predicate} evidence from {verifier}")


# ------------------------------------------------------------------------------ targets


def context_only_requests(db: sqlite3.Connection, ex: str) -> list[str]:
    ids: set[str] = set()
    for (js,) in db.execute("SELECT context_only FROM target_selections WHERE execution_id = ?", (ex,)):
        ids.update(json.loads(js))
    return sorted(ids)


def execution_view(db: sqlite3.Connection, ex: str, context_only: Iterable[str] | None = None):
    """``(LoadedTree, TreeView)`` of ``ex`` (one load), or ``(None, None)`` without a tree.

    The view is exactly :func:`projections.tree.tree_view` (tested equal): candidate masks
    with the outputs of TargetSelection context-only requests turned into context, and the
    leaves owned by a request.
    """
    from projections.tree import load_tree  # the tree projection's read API

    try:
        t = load_tree(db, ex)
    except KeyError:
        return None, None
    ctx = set(context_only_requests(db, ex) if context_only is None else context_only)
    parent = np.array([-1 if n.parent is None else n.parent for n in t.nodes], dtype=np.int64)
    seg_len = np.array([n.tokens.shape[0] for n in t.nodes], dtype=np.int64)
    candidate = [np.zeros(n.tokens.shape[0], dtype=np.uint8) if n.origin_request_id in ctx else n.target for n in t.nodes]
    owner: dict[int, object] = {}
    for r in t.requests.values():  # seq order: the first request mapped to a node owns it
        owner.setdefault(r.node_id, r)
    leaves = [Leaf(n.node_id, owner[n.node_id].request_id, owner[n.node_id].role_class)
              for n in t.nodes if n.node_id not in t.children and n.node_id in owner]
    return t, TreeView(parent=parent, seg_len=seg_len, candidate=candidate, leaves=leaves)


def _targets(db: sqlite3.Connection, route: Route, ex: str, facts: _Facts):
    loaded, view = execution_view(db, ex)
    if view is None:
        return Verdict("unknown", "no prefix tree for this execution", "prefix tree")
    score = facts.score
    branches = _assessment.branch_rewards(db, ex)
    leaves = view.leaves
    leaf_reward: dict[int, float | None] = {}
    if branches:
        by_node: dict[int, list[str]] = {}
        for rid, req in loaded.requests.items():
            by_node.setdefault(req.node_id, []).append(rid)
        keep = []
        for lf in leaves:
            path_reqs = [r for n in path_nodes(view.parent, lf) for r in sorted(by_node.get(n, ()))]
            covered, reward = _assessment.path_reward(path_reqs, score.reward, branches)
            if covered:
                keep.append(lf)
                leaf_reward[lf.node_id] = reward
        leaves = keep
    elif score.reward is None:
        leaves = []
    if len(leaves) != len(view.leaves):
        view = TreeView(view.parent, view.seg_len, view.candidate, leaves)
    draws = select_paths(view, j_max=route.j_max, priority=route.role_priority, seed=route.seed, execution_id=ex)
    if not draws:
        return Verdict("fail", "no target after masking")
    rewards = [leaf_reward.get(d.leaf.node_id, score.reward) for d in draws]
    return view, draws, rewards


# ------------------------------------------------------------------------------ cascade plan


def measured_predicates(db: sqlite3.Connection, route: str) -> list[Predicate]:
    """Pass rates and slot seconds per predicate of ``route`` as measured so far.

    External predicates (process / outcome): per execution with a verdict, its latest
    verdict and the slot seconds of all its evaluations (retries cost too).  Ledger-computed
    predicates: pass rate among the executions that reached them in the admission table,
    slot seconds 0 (they cost the ledger a lookup, not a verifier slot).
    """
    r = route_definition(db, route)
    order = [p.name for p in r.predicates]
    stops = dict(db.execute("SELECT COALESCE(predicate, ''), COUNT(*) FROM admission WHERE route = ? "
                            "AND state IN ('rejected', 'unresolved') GROUP BY 1", (route,)).fetchall())
    through = db.execute("SELECT COUNT(*) FROM admission WHERE route = ? AND state IN ('admitted', 'dummy')",
                         (route,)).fetchone()[0]
    out = []
    for k, p in enumerate(r.predicates):
        if p.family in LEDGER_FAMILIES:
            stopped_here = stops.get(p.name, 0)
            reached = stopped_here + sum(stops.get(n, 0) for n in order[k + 1:]) + through
            obs = [("pass", 0.0)] * (reached - stopped_here) + [("fail", 0.0)] * stopped_here
            out.append(measure_predicate(p.name, obs, p.depends_on, p.family))
        else:
            latest: dict[str, str] = {}
            seconds: dict[str, float] = {}
            timed: set[str] = set()
            for ex, verdict, slot in db.execute("SELECT execution_id, verdict, slot_seconds FROM predicate_verdicts "
                                                "WHERE route = ? AND predicate = ? ORDER BY execution_id, seq", (route, p.name)):
                latest[ex] = verdict
                if slot is not None:
                    seconds[ex] = seconds.get(ex, 0.0) + slot
                    timed.add(ex)
            obs = [(latest[ex], seconds.get(ex) if ex in timed else None) for ex in sorted(latest)]
            out.append(measure_predicate(p.name, obs, p.depends_on, p.family))
    return out


def cascade_plan(db: sqlite3.Connection, route: str) -> CascadePlan:
    """``ledger cascade plan ROUTE``: the cheapest permissible order from measured rates."""
    preds = measured_predicates(db, route)
    return plan_cascade(preds, [p.name for p in preds])


def admission_rows(db: sqlite3.Connection, route: str) -> Iterable[tuple]:
    return db.execute("SELECT execution_id, state, predicate, verdict, missing_evidence, reason, reward, target_tokens, paths "
                      "FROM admission WHERE route = ? ORDER BY execution_id", (route,))
