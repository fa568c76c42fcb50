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

import dataclasses
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
from ledger.algorithms.canonical import canonical_str
from ledger.algorithms.identifiers import join_key
from ledger.events import semantics as semantics_mod
from ledger.events.catalog import EVENT_TYPES
from ledger.projections import assessment as _assessment
from ledger.projections import verifier as _verifier
from ledger.projections import evidence as _evidence
from ledger.projections import collections as _collections
from ledger.projections.descendants import descendants
from ledger.projections.engine import Applied
from ledger.projections.lineage import ancestors, iter_ancestors, parent_of, root_of, task_of
from ledger.projections.treeview import view_of
from ledger.projections.tree import FLAG_OUTPUT, load_tree
import hashlib

__all__ = ["AdmissionProjection", "Evidence", "PREFERENCE_CANDIDATE", "Selection", "apply_lineage_family", "apply_task_cap",
           "cap_rank", "family_representative", "hard_negative_counts", "inherited_selection", "own_selection",
           "counting_criteria", "selection_for", "use_gate", "use_specific_view", "FAMILIES", "LEDGER_FAMILIES", "Route", "Verdict", "cascade_plan",
           "current_routes", "effective_predicates", "evaluate", "execution_view", "measured_predicates", "member_id",
           "route_definition"]

FAMILIES = ("record_adequacy", "permitted_use", "process", "outcome", "target_suitability")
LEDGER_FAMILIES = ("record_adequacy", "permitted_use", "target_suitability")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS routes (
    route TEXT NOT NULL, version INTEGER NOT NULL, use TEXT NOT NULL, split TEXT NOT NULL, j_max INTEGER NOT NULL,
    role_priority TEXT NOT NULL, predicates TEXT NOT NULL, declared_predicates TEXT, seed TEXT NOT NULL,
    consumer TEXT, evaluation_claim TEXT, event_id TEXT NOT NULL,
    semantics INTEGER NOT NULL DEFAULT 1, options TEXT NOT NULL DEFAULT '{}',
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
    verdict TEXT NOT NULL, verifier TEXT NOT NULL, slot_seconds REAL, evidence TEXT, attempt INTEGER, seed TEXT,
    PRIMARY KEY (execution_id, seq)
);
CREATE INDEX IF NOT EXISTS predicate_verdicts_route ON predicate_verdicts (route, predicate);
CREATE TABLE IF NOT EXISTS target_selections (
    execution_id TEXT NOT NULL, selection_id TEXT NOT NULL, policy TEXT NOT NULL, behavioral_role TEXT,
    context_only TEXT NOT NULL, selected TEXT NOT NULL, basis TEXT,
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
CREATE TABLE IF NOT EXISTS verified_requests (
    execution_id TEXT NOT NULL, request_id TEXT NOT NULL, PRIMARY KEY (execution_id, request_id)
);
CREATE TABLE IF NOT EXISTS view_replaced (
    execution_id TEXT NOT NULL, request_id TEXT NOT NULL, PRIMARY KEY (execution_id, request_id)
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
            from ledger.projections import splits  # type: ignore[attr-defined]

            ev.split = getattr(splits, "execution_split", None)
            ev.split_facts = getattr(splits, "task_split_facts", None) or _split_facts_from_tables
        except ImportError:
            pass
        try:
            from ledger.projections import governance  # type: ignore[attr-defined]

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
    repetitions: tuple[int, str, int] | None = None  # (runs, aggregate, k), SPEC §6.8 repeated verifiers


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
    semantics: int = semantics_mod.LEGACY
    min_reward: float | None = None
    required_criteria: tuple[str, ...] = ()
    outcome_scope: str = "execution"
    per_task_cap: int | None = None

    @property
    def use_specific(self) -> bool:
        """SPEC §6.8 rules apply (semantics 2 and later)."""
        return self.semantics >= 2

    @property
    def per_path_rewards(self) -> bool:
        """SPEC §11.1 (semantics 3): branch rewards, inherited roles and one member per lineage family."""
        return self.semantics >= 3

    @property
    def reward_floor(self) -> float | None:
        """The counting reward an execution needs (``min_reward``; 1.0 by default on sft routes)."""
        if not self.use_specific:
            return None
        if self.min_reward is not None:
            return self.min_reward
        return 1.0 if self.use == "sft" else None


_OPTION_KEYS = ("min_reward", "required_criteria", "outcome_scope", "per_task_cap", "collection_id",
                "calibrated_evaluators", "capability_gap")


def route_options(ev: dict) -> dict:
    """The SPEC §6.8/§6.10 options of an ``admission_policy`` event that are set (stored as JSON)."""
    out = {}
    for k in _OPTION_KEYS:
        v = ev.get(k)
        if v is not None and v != [] and v is not False:
            out[k] = v
    return out


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


def _repetitions(p: dict) -> tuple[int, str, int] | None:
    r = p.get("repetitions")
    return None if r is None else (int(r["runs"]), r["aggregate"], int(r["k"]))


def _route_from_row(row) -> Route:
    name, version, use, split, j_max, prio, preds, seed, consumer, claim, sem, options = row
    opts = json.loads(options or "{}")
    return Route(name, version, use, split, j_max, tuple(json.loads(prio)),
                 tuple(RoutePredicate(p["name"], p["family"], tuple(p.get("depends_on", ())), _repetitions(p))
                       for p in json.loads(preds)),
                 seed, consumer, claim, int(sem), opts.get("min_reward"), tuple(opts.get("required_criteria") or ()),
                 opts.get("outcome_scope") or "execution", opts.get("per_task_cap"))


_ROUTE_COLS = ("route, version, use, split, j_max, role_priority, predicates, seed, consumer, evaluation_claim, semantics, "
               "options")


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
    predicate: str | None = None  # reported instead of the cascade step's name (a use-specific rule)


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
        _verifier.VerifierProjection().create(db)  # protected paths, grader controls (SPEC 6.10)
        _collections.CollectionsProjection().create(db)  # collection manifests (SPEC 6.10)
        db.executescript(_SCHEMA)

    # -------------------------------------------------------------- apply
    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev, et = item.event, item.type
        if et in _verifier.DIRTYING:  # SPEC 6.10: a task's path policy, a grader's controls (ledger/projections/verifier.py)
            self.dirty |= _verifier.dirty_executions(db, ev, et)
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
                db.execute("INSERT INTO predicate_verdicts VALUES (?,?,?,?,?,?,?,?,?,?)",
                           (ex, seq, ev["route"], ev["predicate"], ev["verdict"], ev["verifier"], ev.get("slot_seconds"),
                            ev.get("evidence"), ev.get("attempt"), ev.get("seed")))
            elif et == "target_selection":
                db.execute("INSERT OR IGNORE INTO target_selections VALUES (?,?,?,?,?,?,?)",
                           (ex, ev["selection_id"], ev["policy"], ev.get("behavioral_role"),
                            json.dumps(sorted(set(ev.get("context_only_request_ids") or []))),
                            json.dumps(sorted(set(ev.get("selected_request_ids") or []))),
                            None if ev.get("basis") is None else canonical_str({k: v for k, v in ev["basis"].items() if v is not None})))
        elif et == "admission_policy":
            declared = json.loads(ev["predicates"]) if ev.get("predicates") else None
            preds = effective_predicates(declared)
            db.execute("INSERT OR IGNORE INTO routes VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                       (ev["route"], ev["version"], ev["use"], ev["split"], ev["j_max"],
                        json.dumps(list(ev.get("role_priority") or DEFAULT_PRIORITY)), json.dumps(preds),
                        None if declared is None else json.dumps(declared), ev.get("seed") or ev["route"],
                        ev.get("consumer"), ev.get("evaluation_claim"), ev["event_id"],
                        semantics_mod.of_route(ev.get("semantics")), json.dumps(route_options(ev), sort_keys=True)))
            self.dirty_routes.add(ev["route"])
        elif et in ("record_derived", "revalidated"):
            self.dirty.add(ev["derived_execution_id"])
            if et == "record_derived":  # semantics 3: a view's own selection reaches only what it replaced
                db.executemany("INSERT OR IGNORE INTO view_replaced VALUES (?,?)",
                               [(ev["derived_execution_id"], rid) for rid in sorted(ev.get("replacements") or {})])
            if et == "revalidated" and ev["verdict"] == "pass":
                db.executemany("INSERT OR IGNORE INTO verified_requests VALUES (?,?)",
                               [(ev["derived_execution_id"], rid) for rid in ev.get("verified_request_ids") or ()])
        elif et in ("permission", "withdrawal"):
            if et == "permission" and ev.get("supersedes"):
                self.all_dirty = True  # lifting a revocation reaches whatever the revocation covered
            else:
                self.gov_subjects.add(ev["subject"])
        elif et == "collection_manifest":  # SPEC 6.10: the routes naming the campaign re-check its capture
            self.dirty_routes |= _collections.routes_naming(db, ev["collection_id"])
        elif et == "counterfactual_probe":  # task-scoped: the task's executions are re-evaluated
            self.dirty |= _evidence.task_executions(db, ev["task_id"])
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
            todo = set(known if route_changed else dirty)
            capped = route.use_specific and route.per_task_cap is not None
            if route.per_path_rewards and todo:
                todo |= _families(db, todo)  # one member per lineage family: a family is decided together
            if capped and todo:
                todo |= _same_task(db, todo)  # the cap ranks every execution of a task together
            todo = sorted(todo)
            for ex in todo:
                self._evaluate_store(db, route, ex, reuse=not route_changed and ex not in exec_dirty)
            if route.per_path_rewards and todo:
                apply_lineage_family(db, route, todo)
            if capped and todo:
                apply_task_cap(db, route, todo)
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
        no_targets = route.use_specific and route.use == "evaluation"  # evaluation routes carry no targets
        total = sum(d.n_targets for d in out.draws) if out.state == "admitted" and not no_targets else 0
        rows = []
        if out.state == "admitted":
            for d, reward in zip(out.draws, out.rewards):
                mask = path_target_mask(out.tree, d)
                pos = np.zeros(0, dtype="<u4") if no_targets else np.flatnonzero(mask).astype("<u4")
                rows.append((route.name, ex, d.draw_index, member_id(route.name, ex, d.leaf.request_id, route.semantics),
                             d.leaf.request_id, d.leaf.node_id, d.leaf.role_class, int(mask.shape[0]),
                             0 if no_targets else d.n_targets, reward, pos.tobytes()))
            db.executemany("INSERT INTO admitted_paths VALUES (?,?,?,?,?,?,?,?,?,?,?)", rows)
        db.execute("INSERT OR REPLACE INTO admission VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                   (route.name, ex, route.version, out.state, out.predicate, out.verdict, out.missing, out.reason,
                    out.reward, total, len(rows)))


def member_id(route: str, execution_id: str, leaf_request_id: str | None, semantics: int = semantics_mod.CURRENT) -> str:
    """``route/execution/leaf`` (``route/execution/dummy`` for a dummy entry), components escaped
    as natural-key components (SPEC §9 "Identifiers are opaque": ids holding ``/`` never
    collide; ids without ``%``, ``/`` or control characters keep their old member ids).  Routes of
    semantics 1 keep the first release's unescaped join, so their manifests still rebuild."""
    leaf = "dummy" if leaf_request_id is None else leaf_request_id
    if semantics < 2:
        return f"{route}/{execution_id}/{leaf}"
    return join_key(route, execution_id, leaf)


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


def _any_views(db: sqlite3.Connection) -> bool:
    """Whether any derived view is known (most stores have none: the lineage walks are skipped)."""
    return db.execute("SELECT 1 FROM assessment_executions WHERE parent_execution_id IS NOT NULL LIMIT 1").fetchone() is not None


def _derived_closure(db: sqlite3.Connection, exs: set[str]) -> set[str]:
    """Derived views (transitively) of ``exs``."""
    out: set[str] = set()
    if not exs or not _any_views(db):
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
    v2 = route.use_specific
    for pred in (_verifier.cascade(db, route, ex, RoutePredicate) if v2 else route.predicates):  # + protected_paths
        if pred.family == "record_adequacy":
            v = _record_adequacy(facts)
            if v2 and (camp := _collections.campaign_gate(db, route, ex, v)) is not None:  # collection_id (SPEC 6.10)
                v = Verdict(*camp)
        elif pred.family == "permitted_use":
            v = _permitted_use(db, ex, route, evidence)
        elif pred.family == "target_suitability":
            score = facts.score
            if score is None or score.state == "pending":
                v = Verdict("pending", score.reason if score else "no assessment state", "valid reward (assessment)")
            elif score.state == "excluded":
                v = Verdict("fail", score.reason)
            elif v2 and (gate := use_gate(db, route, ex, facts)).verdict != "pass":
                v = gate
            elif score.state == "dummy":
                return _Outcome("dummy", pred.name, "pass", None, "zero-reward dummy: " + score.reason, reward=0.0)
            elif v2 and route.use == "preference":
                return _Outcome("admitted", None, "pass", None, PREFERENCE_CANDIDATE, reward=score.reward)
            elif reuse_paths:
                v = PASS
            else:
                out = _targets(db, route, ex, facts)
                if isinstance(out, Verdict):
                    v = out
                else:
                    facts.selection = out
                    v = PASS
        elif v2 and pred.name == "feedback" and pred.family == "outcome":  # production feedback (SPEC 6.10)
            v = Verdict(*_evidence.feedback_predicate(db, ex))
        elif v2 and pred.name == "protected_paths" and pred.family == "process":  # ledger-computed (SPEC 6.10)
            v = Verdict(*_verifier.protected_paths_verdict(db, ex))
        else:  # process / outcome: external verifiers
            v = _external_aggregate(db, ex, route.name, pred) if v2 else _external(db, ex, route.name, pred.name)
        if v2 and v.verdict == "pass" and pred.family == "permitted_use":  # capability_gap: true (SPEC 6.10)
            gap = _evidence.capability_gap_gate(db, route, ex)
            v = v if gap is None else Verdict(*gap, predicate="capability_gap")
        if v2 and v.verdict == "pass" and pred.family == "permitted_use" and (ctl := _verifier.control_exclusion(db, ex)):
            v = Verdict("fail", ctl, predicate="grader_control")  # grader controls are never admitted (SPEC 6.10)
        if v.verdict != "pass":
            state = "rejected" if v.verdict == "fail" else "unresolved"
            return _Outcome(state, v.predicate or pred.name, v.verdict, v.missing if state == "unresolved" else None,
                            v.reason, reward=facts.score.reward if facts.score else None)
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
    from ledger.projections.tree import load_tree  # the tree projection's read API

    try:
        t = load_tree(db, ex)
    except KeyError:
        return None, None
    ctx = set(context_only_requests(db, ex) if context_only is None else context_only)
    candidate = [np.zeros(n.tokens.shape[0], dtype=np.uint8) if n.origin_request_id in ctx else n.target for n in t.nodes]
    return t, view_of(t, candidate)


def _targets(db: sqlite3.Connection, route: Route, ex: str, facts: _Facts):
    if route.use_specific:
        return _targets_use_specific(db, route, ex, facts)
    loaded, view = execution_view(db, ex)
    if view is None:
        return Verdict("unknown", "no prefix tree for this execution", "prefix tree")
    score = facts.score
    branches = _assessment.branch_rewards(db, ex)
    leaves = view.leaves
    leaf_reward: dict[int, float | None] = {}
    if branches:
        leaves, leaf_reward = _branch_leaves(loaded, view, branches, score.reward)
    elif score.reward is None:
        leaves = []
    return _draw(route, ex, view, leaves, leaf_reward, score.reward)


def _branch_leaves(loaded, view: TreeView, branches: dict, execution_reward: float | None,
                   floor: float | None = None) -> tuple[list[Leaf], dict[int, float | None]]:
    """The leaves a reward covers (:func:`projections.assessment.path_reward`, at least ``floor``)
    and their rewards."""
    by_node: dict[int, list[str]] = {}
    for rid, req in loaded.requests.items():
        by_node.setdefault(req.node_id, []).append(rid)
    keep, leaf_reward = [], {}
    for lf in view.leaves:
        path_reqs = [r for n in path_nodes(view.parent, lf) for r in sorted(by_node.get(n, ()))]
        covered, reward = _assessment.path_reward(path_reqs, execution_reward, branches)
        if covered and (floor is None or reward >= floor):
            keep.append(lf)
            leaf_reward[lf.node_id] = reward
    return keep, leaf_reward


def _draw(route: Route, ex: str, view: TreeView, leaves: list[Leaf], leaf_reward: dict, reward: float | None):
    """Path draws over ``leaves`` of ``view`` (SPEC §6.5 step 3) with each draw's reward."""
    if len(leaves) != len(view.leaves):
        view = TreeView(view.parent, view.seg_len, view.candidate, leaves)
    draws = select_paths(view, j_max=route.j_max, priority=route.role_priority, seed=route.seed, execution_id=ex)
    if not draws:
        return Verdict("fail", "no target after masking")
    return view, draws, [leaf_reward.get(d.leaf.node_id, reward) for d in draws]


# ------------------------------------------------------------------------------ use-specific rules (SPEC §6.8)

PREFERENCE_CANDIDATE = "preference candidate"  # an admitted execution of a preference route: pairs are formed apart


@dataclass(frozen=True)
class Selection:
    """The target selection in force for an execution (its own, else inherited from its parent)."""

    selected: frozenset[str] | None  # None: no selected_request_ids given
    context_only: frozenset[str]
    role: str | None  # direct | recovery | hard_negative
    selection_id: str | None
    made_on: str | None  # the execution the selection was recorded on
    policy: str | None = None
    basis: str | None = None  # canonical JSON of the hard-negative basis (SPEC §11.2), when given
    # semantics 3: (requests a view replaced and revalidated, the view's own selection), deepest view first
    overrides: tuple = ()

    def is_context(self, request_id: str) -> bool:
        """Whether ``request_id``'s outputs are context under this selection (never a target)."""
        for requests, own in self.overrides:
            if request_id in requests:
                return own.is_context(request_id)
        return request_id in self.context_only or (self.selected is not None and request_id not in self.selected)


NO_SELECTION = Selection(None, frozenset(), None, None, None)


def own_selection(db: sqlite3.Connection, ex: str) -> Selection | None:
    """The selections recorded on ``ex`` itself, combined: context-only and selected requests are
    unions, and any ``hard_negative`` role makes the execution a hard negative.  None without any."""
    rows = db.execute("SELECT selection_id, behavioral_role, context_only, selected, policy, basis FROM target_selections "
                      "WHERE execution_id = ? ORDER BY selection_id", (ex,)).fetchall()
    if not rows:
        return None
    ctx: set[str] = set()
    sel: set[str] = set()
    any_selected = False
    role, pick = None, rows[0]
    for row in rows:
        selection_id, r, c, chosen = row[:4]
        ctx.update(json.loads(c))
        chosen = json.loads(chosen)
        if chosen:
            any_selected = True
            sel.update(chosen)
        if (r == "hard_negative" and role != "hard_negative") or (role is None and r is not None):
            role, pick = r, row
    return Selection(frozenset(sel) if any_selected else None, frozenset(ctx), role, pick[0], ex, pick[4], pick[5])


def selection_for(db: sqlite3.Connection, ex: str, semantics: int = 2) -> Selection:
    """The selection in force for ``ex`` under a route's semantics version.

    Semantics 2 (SPEC §6.8): a selection made on the execution itself wins; otherwise its parent's (by
    request id, up the derivation chain).  Semantics 3 (SPEC §11.1): :func:`inherited_selection`."""
    if semantics >= 3:
        return inherited_selection(db, ex)
    for cur in iter_ancestors(db, ex):
        own = own_selection(db, cur)
        if own is not None:
            return own
    return NO_SELECTION


def inherited_selection(db: sqlite3.Connection, ex: str) -> Selection:
    """SPEC §11.1 "views inherit roles": the original's selection decides every request; a view's own
    selection decides only the requests the view replaced *and* a ``revalidated`` pass lists in
    ``verified_request_ids`` (the deepest such view decides); a hard negative anywhere in the chain is
    a hard negative in every view (a no-op view cannot launder it into a direct demonstration)."""
    chain = ancestors(db, ex)
    levels = [(cur, own_selection(db, cur)) for cur in chain]
    root, base = levels[-1]
    overrides = []
    for cur, own in levels[:-1]:
        if own is None:
            continue
        decided = _replaced_and_verified(db, cur)
        if decided:
            overrides.append((decided, own))
    own_levels = [own for _cur, own in reversed(levels) if own is not None]  # root first
    hard = [o for o in own_levels if o.role == "hard_negative"]
    roled = hard or [o for o in ([base] if base is not None else []) + [o for _r, o in reversed(overrides)]
                     if o is not None and o.role is not None]
    label = roled[0] if roled else (base if base is not None else (overrides[-1][1] if overrides else None))
    if base is None:
        base = NO_SELECTION
    if label is None:
        return dataclasses.replace(base, overrides=tuple(overrides))
    return Selection(base.selected, base.context_only, label.role, label.selection_id, label.made_on, label.policy,
                     label.basis, tuple(overrides))


def hard_negative_counts(db: sqlite3.Connection, route: Route) -> dict[str, int]:
    """The manifest datasheet's hard-negative row (SPEC 11.2, seed 002 §15.6.1): the route's evaluated
    executions whose selection in force is a hard negative, with and without a recorded basis."""
    out = {"with_basis": 0, "without_basis": 0}
    for (ex,) in db.execute("SELECT execution_id FROM admission WHERE route = ? ORDER BY execution_id", (route.name,)):
        sel = selection_for(db, ex, route.semantics)
        if sel.role == "hard_negative":
            out["with_basis" if sel.basis is not None else "without_basis"] += 1
    return out


def _replaced_and_verified(db: sqlite3.Connection, view: str) -> frozenset[str]:
    return frozenset(r[0] for r in db.execute(
        "SELECT v.request_id FROM view_replaced v JOIN verified_requests q ON q.execution_id = v.execution_id "
        "AND q.request_id = v.request_id WHERE v.execution_id = ?", (view,)))


def counting_criteria(db: sqlite3.Connection, ex: str, assessment_id: str | None) -> dict[str, str]:
    """Criterion name -> verdict of the execution's counting assessment (a derived view's is its parent's)."""
    if assessment_id is None:
        return {}
    for cur in iter_ancestors(db, ex):
        row = db.execute("SELECT criteria FROM assessments WHERE execution_id = ? AND assessment_id = ?",
                         (cur, assessment_id)).fetchone()
        if row is not None:
            return {c["name"]: c["verdict"] for c in json.loads(row[0] or "[]")}
    return {}


def use_gate(db: sqlite3.Connection, route: Route, ex: str, facts: "_Facts") -> Verdict:
    """The outcome conditions a use imposes once the score is decided: required criteria, the reward
    floor of imitation, hard negatives on sft, the scope of the outcome."""
    score = facts.score
    if (cal := _verifier.calibration_verdict(db, route, ex)) is not None:  # calibrated_evaluators (SPEC 6.10)
        return Verdict(*cal, predicate="calibrated_evaluators")
    if route.required_criteria:
        crit = counting_criteria(db, ex, score.assessment_id)
        for name in route.required_criteria:
            verdict = crit.get(name)
            if verdict == "pass":
                continue
            if verdict == "fail":
                return Verdict("fail", f"criterion {name} failed in {score.assessment_id}", predicate="required_criteria")
            what = "not assessed" if verdict is None else verdict
            return Verdict("pending" if verdict in (None, "pending") else "unknown",
                           f"criterion {name} is {what} in the counting assessment", f"criterion {name}",
                           predicate="required_criteria")
    if route.outcome_scope == "execution" and score.state == "scored" and score.reward is None:
        return Verdict("pending", "branch-scoped rewards only; this route needs the whole-task outcome",
                       "execution-scoped assessment", predicate="outcome")
    floor = route.reward_floor
    per_path = route.per_path_rewards and score.state == "scored" and _assessment.branch_rewards(db, ex)
    if floor is not None and route.outcome_scope == "execution" and not per_path:  # else: per path, in the draw
        reward = 0.0 if score.state == "dummy" else score.reward
        if reward is not None and reward < floor:
            return Verdict("fail", f"reward {reward:g} below min_reward {floor:g}: imitation needs a passing outcome",
                           predicate="outcome")
    if route.use == "sft":
        sel = selection_for(db, ex, route.semantics)
        if sel.role == "hard_negative":
            return Verdict("fail", f"hard negative ({sel.selection_id} on {sel.made_on}): no imitation targets on an "
                           "sft route", predicate="target_suitability")
    return PASS


def _external_aggregate(db: sqlite3.Connection, ex: str, route: str, pred: RoutePredicate) -> Verdict:
    """SPEC §6.8 repeated verifiers: the verdict of the latest verifier version, aggregated over its
    distinct attempts (``repetitions``), never the latest verdict; without ``repetitions``, differing
    verdicts of one verifier version are inconsistent and leave the predicate ``unknown``."""
    rows = db.execute("SELECT seq, verdict, verifier, attempt, evidence FROM predicate_verdicts WHERE execution_id = ? "
                      "AND route = ? AND predicate = ? ORDER BY seq", (ex, route, pred.name)).fetchall()
    if not rows:
        return Verdict("pending", f"no verdict for {pred.name} yet", f"PredicateEvaluated {pred.name}")
    verifier = rows[-1][2]  # the verifier version heard from last decides; its own attempts are aggregated
    mine = [r for r in rows if r[2] == verifier]
    if pred.repetitions is None:
        verdicts = sorted({r[1] for r in mine})
        if len(verdicts) > 1:
            return Verdict("unknown", f"inconsistent verdicts from {verifier}: " + ", ".join(r[1] for r in mine)
                           + " (a rerun until it passes never admits; declare repetitions)",
                           f"{pred.name}: consistent verdict from {verifier}")
        verdict = verdicts[0]
        if verdict == "pass":
            return PASS
        ev = mine[-1][4]
        reason = f"{verdict} by {verifier}" + (f" ({ev})" if ev else "")
        return Verdict(verdict, reason, None if verdict == "fail" else f"{pred.name} evidence from {verifier}")
    runs, aggregate, k = pred.repetitions
    attempts: dict[int, str] = {}
    for _seq, verdict, _v, attempt, _e in mine:
        if attempt is not None and 1 <= attempt <= runs:
            attempts.setdefault(int(attempt), verdict)  # the first verdict of an attempt (a later copy cannot win)
    if len(attempts) < runs:
        return Verdict("pending", f"{len(attempts)} of {runs} attempts of {verifier} recorded",
                       f"{pred.name}: attempts {', '.join(str(a) for a in range(1, runs + 1) if a not in attempts)} "
                       f"from {verifier}")
    values = [attempts[a] for a in range(1, runs + 1)]
    passes = values.count("pass")
    undecided = [a for a in range(1, runs + 1) if attempts[a] not in ("pass", "fail")]
    need = runs if aggregate == "all" else k
    if passes >= need:
        return PASS
    if passes + len(undecided) >= need:  # the undecided attempts could still reach the bar
        return Verdict("unknown", f"{passes} of {runs} attempts pass, {len(undecided)} undecided ({aggregate}, need {need})",
                       f"{pred.name}: decided attempts from {verifier}")
    return Verdict("fail", f"{passes} of {runs} attempts of {verifier} pass ({aggregate}, need {need}): "
                   + ", ".join(values))


def use_specific_view(db: sqlite3.Connection, ex: str, sel: Selection | None = None, semantics: int = 2):
    """``(LoadedTree, TreeView)`` with SPEC §6.8 target candidates: a derived view's replaced outputs
    stay context unless a Revalidated pass names them in ``verified_request_ids``; with
    ``selected_request_ids`` only those requests' policy outputs are candidates; ``context_only``
    requests are context."""

    try:
        t = load_tree(db, ex)
    except KeyError:
        return None, None
    sel = selection_for(db, ex, semantics) if sel is None else sel
    verified = {r[0] for r in db.execute("SELECT request_id FROM verified_requests WHERE execution_id = ?", (ex,))}
    restorable: set[str] = set()
    if verified:
        parent = parent_of(db, ex)
        if parent:
            try:
                parent_reqs = load_tree(db, parent).requests
            except KeyError:
                parent_reqs = {}
            restorable = {rid for rid in verified if rid in t.requests and t.requests[rid].generator == "policy"
                          and rid in parent_reqs and not parent_reqs[rid].reconstructed}
    candidate = []
    for n in t.nodes:
        rid = n.origin_request_id
        if sel.is_context(rid):
            candidate.append(np.zeros(n.tokens.shape[0], dtype=np.uint8))
        elif rid in restorable:
            candidate.append(((n.flags & FLAG_OUTPUT) != 0).astype(np.uint8))
        else:
            candidate.append(n.target)
    return t, view_of(t, candidate)


def _targets_use_specific(db: sqlite3.Connection, route: Route, ex: str, facts: "_Facts"):
    loaded, view = use_specific_view(db, ex, semantics=route.semantics)
    if view is None:
        return Verdict("unknown", "no prefix tree for this execution", "prefix tree")
    score = facts.score
    leaves = view.leaves
    leaf_reward: dict[int, float | None] = {}
    if route.per_path_rewards and route.outcome_scope == "execution" and score.reward is not None:
        branches = _assessment.branch_rewards(db, ex)  # SPEC 11.1: the deepest branch score on a path wins
        if branches:
            floor = route.reward_floor
            leaves, leaf_reward = _branch_leaves(loaded, view, branches, score.reward, floor)
            if not leaves:
                bar = f"reaches min_reward {floor:g}" if floor is not None else "has a reward"
                return Verdict("fail", f"no path {bar} (a branch-scoped score decides the paths through its branch)",
                               predicate="outcome")
    elif route.outcome_scope == "branch":
        branches = _assessment.branch_rewards(db, ex)
        if not branches:
            return Verdict("pending", "no branch-scoped assessment: a recovery segment needs one",
                           "branch-scoped assessment", predicate="outcome")
        floor = route.reward_floor
        keep, leaf_reward = _branch_leaves(loaded, view, branches, None, floor)
        if not keep:
            return Verdict("fail", "no branch-scoped assessment on any path reaches the route's bar"
                           + (f" (min_reward {floor:g})" if floor is not None else ""), predicate="outcome")
        leaves = keep
    elif score.reward is None:
        leaves = []
    return _draw(route, ex, view, leaves, leaf_reward, score.reward)


def _same_task(db: sqlite3.Connection, exs: set[str]) -> set[str]:
    """Every known execution (derived views included) of the tasks of ``exs``."""
    tasks = {t for t in (task_of(db, ex) for ex in exs) if t is not None}
    out: set[str] = set()
    for chunk in _chunks(tasks):
        out.update(r[0] for r in db.execute(f"SELECT execution_id FROM assessment_executions WHERE task_id IN "
                                            f"({','.join('?' * len(chunk))})", chunk))
    return _known(db, out | _derived_closure(db, out))


def _families(db: sqlite3.Connection, exs: set[str]) -> set[str]:
    """Every known member of the lineage families of ``exs`` (each root and all its derived views)."""
    if not _any_views(db):
        return set(exs)
    roots = {root_of(db, ex) for ex in exs}
    return _known(db, roots | _derived_closure(db, roots))


def family_representative(db: sqlite3.Connection, root: str, members: Iterable[str]) -> str:
    """SPEC 11.1 "one episode, one member": the most derived view of ``root``'s family whose
    revalidation passed (ties: the smallest execution id), else the root itself."""
    best: tuple[int, str] | None = None
    for ex in members:
        if ex == root:
            continue
        row = db.execute("SELECT revalidated FROM assessment_executions WHERE execution_id = ?", (ex,)).fetchone()
        if row is None or row[0] != "pass":
            continue
        key = (-len(ancestors(db, ex)), ex)
        if best is None or key < best:
            best = key
    return root if best is None else best[1]


def apply_lineage_family(db: sqlite3.Connection, route: Route, executions: Iterable[str]) -> None:
    """Semantics 3: a route emits at most one execution per lineage family
    (:func:`family_representative`); every other emitted member of the family is rejected on
    ``lineage_family`` with the disposition ``redundancy`` and the reason ``superseded by <execution>``."""
    if not _any_views(db):
        return  # no derived view anywhere: every family is a single execution
    families: dict[str, set[str]] = {}
    for ex in executions:
        families.setdefault(root_of(db, ex), set()).add(ex)
    for root in sorted(families):
        members = _known(db, {root} | _derived_closure(db, {root}))
        if len(members) < 2:
            continue
        keep = family_representative(db, root, members)
        _reject_redundant(db, route, members - {keep}, "lineage_family", f"superseded by {keep}")


def _reject_redundant(db: sqlite3.Connection, route: Route, executions: Iterable[str], predicate: str, reason: str) -> None:
    """Reject the emitted (admitted or dummy) ``executions`` of ``route`` on ``predicate`` with ``reason``: their
    paths go, their disposition is ``redundancy`` (SPEC §6.7; the retention cap and the lineage family)."""
    for chunk in _chunks(executions):
        marks = ",".join("?" * len(chunk))
        db.execute(f"DELETE FROM admitted_paths WHERE route = ? AND execution_id IN ({marks})", (route.name, *chunk))
        db.execute("UPDATE admission SET state = 'rejected', predicate = ?, verdict = 'fail', missing_evidence = NULL, "
                   "reason = ?, target_tokens = 0, paths = 0 WHERE route = ? AND state IN ('admitted', 'dummy') AND "
                   f"execution_id IN ({marks})", (predicate, reason, route.name, *chunk))


def cap_rank(seed: str, execution_id: str) -> bytes:
    """The keyed hash that orders a task's executions for ``per_task_cap`` (lowest kept first)."""

    return hashlib.sha256(f"per_task_cap\x00{seed}\x00{execution_id}".encode()).digest()


def apply_task_cap(db: sqlite3.Connection, route: Route, executions: Iterable[str]) -> None:
    """Keep at most ``per_task_cap`` emitted executions per task (ranked by :func:`cap_rank`); the rest
    are rejected on ``per_task_cap`` with the disposition ``redundancy`` (SPEC §6.7, §6.8)."""
    by_task: dict[str, list[str]] = {}
    for ex in executions:
        task = task_of(db, ex)
        if task is not None:
            by_task.setdefault(task, [])
    for task in sorted(by_task):
        members = [ex for ex in _same_task(db, {ex for ex in executions if task_of(db, ex) == task})
                   if task_of(db, ex) == task]
        emitted = [r[0] for chunk in _chunks(members) for r in db.execute(
            f"SELECT execution_id FROM admission WHERE route = ? AND state IN ('admitted', 'dummy') AND execution_id IN "
            f"({','.join('?' * len(chunk))})", (route.name, *chunk))]
        emitted.sort(key=lambda ex: cap_rank(route.seed, ex))
        _reject_redundant(db, route, emitted[route.per_task_cap:], "per_task_cap",
                          f"redundancy: per_task_cap {route.per_task_cap} reached for task {task}")


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
            attempts = [0, 0]  # passes, recorded attempts
            for ex, verdict, slot, attempt in db.execute(
                    "SELECT execution_id, verdict, slot_seconds, attempt FROM predicate_verdicts "
                    "WHERE route = ? AND predicate = ? ORDER BY execution_id, seq", (route, p.name)):
                latest[ex] = verdict
                if slot is not None:
                    seconds[ex] = seconds.get(ex, 0.0) + slot
                    timed.add(ex)
                if attempt is not None:
                    attempts[0] += verdict == "pass"
                    attempts[1] += 1
            if r.use_specific:  # the verdict admission used: the aggregate, or unknown when inconsistent
                latest = {ex: _external_aggregate(db, ex, route, p).verdict for ex in latest}
            obs = [(latest[ex], seconds.get(ex) if ex in timed else None) for ex in sorted(latest)]
            m = measure_predicate(p.name, obs, p.depends_on, p.family)
            if p.repetitions is not None:
                m = dataclasses.replace(m, repetitions=p.repetitions,
                                        attempt_pass_rate=attempts[0] / attempts[1] if attempts[1] else None)
            out.append(m)
    return out


def cascade_plan(db: sqlite3.Connection, route: str) -> CascadePlan:
    """``ledger cascade plan ROUTE``: the cheapest permissible order from measured rates."""
    preds = measured_predicates(db, route)
    return plan_cascade(preds, [p.name for p in preds])


def admission_rows(db: sqlite3.Connection, route: str) -> Iterable[tuple]:
    return db.execute("SELECT execution_id, state, predicate, verdict, missing_evidence, reason, reward, target_tokens, paths "
                      "FROM admission WHERE route = ? ORDER BY execution_id", (route,))
