"""Preference projection: the pairs of ``preference`` routes (SPEC §6.9; seed 002 §15.2.3, §15.5.1).

Admission (``projections.admission``) runs a preference route's cascade and stores every
execution whose score is decided as ``admitted`` with reason "preference candidate" and no
paths.  This projection turns those candidates into pairs with
:func:`ledger.algorithms.preference_pairs.form_pairs`:

* a **decision point** is a set of requests with byte-identical input (SHA-256 of the packed
  uint32 input tokens) among the candidate executions of one task -- independent samples
  within one execution or across executions of the task;
* a **side** is a root-to-leaf path through one of those requests; its reward is the path's
  counting reward (:func:`projections.assessment.path_reward`: the deepest branch-scoped score
  on the path, else the execution's), its evidence the ``fail`` criteria of that counting
  assessment and a ``hard_negative`` TargetSelection (:func:`projections.admission.selection_for`,
  which carries a parent's selection over to its views);
* executions of one lineage (an original and its derived views) never pair with each other.

Tables: ``preference_pairs`` (one row per drawn pair: both sides' execution and leaf, the
common-prefix length, both continuation lengths, both rewards, the criterion and the draw
rank) and ``preference_unassigned`` (candidates in no pair, with the reason).  Only routes of
use ``preference`` declared under semantics 2 or later have pairs; a semantics-1 preference
route keeps the first release's per-execution records.

**Determinism.**  Pairs of a task are recomputed from scratch, from the projected state,
whenever a candidate of the task may have changed: an execution-scoped event of one of its
executions (derived views follow their parents) or any write admission makes to a row of
the route (seen through a connection-local TEMP trigger, so nothing of it is stored in the
database file).  The result is a function of the candidate set alone, so it is the same
for every interleaving of execution partitions and every batching.  Put this projection
after admission: it reads admission's rows in ``finish``.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterable

import numpy as np

from ledger.algorithms.preference_pairs import DecisionMember, Side, decision_groups, form_pairs
from ledger.projections import assessment as _assessment
from ledger.projections.descendants import descendants
from ledger.projections.engine import Applied
from ledger.projections.lineage import ancestors, task_of
from ledger.projections.tree import FLAG_OUTPUT
from ledger.projections.admission import AdmissionProjection
from ledger.projections.admission import current_routes
from ledger.projections.admission import counting_criteria, selection_for
from ledger.projections.tree import load_tree

__all__ = ["PreferenceProjection", "pair_rows", "preference_route", "recompute_route", "recompute_task",
           "route_summary", "side_arrays", "unassigned_rows"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS preference_pairs (
    route TEXT NOT NULL, member_id TEXT NOT NULL, task_id TEXT NOT NULL,
    chosen_execution_id TEXT NOT NULL, chosen_leaf_request_id TEXT NOT NULL,
    rejected_execution_id TEXT NOT NULL, rejected_leaf_request_id TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL, chosen_tokens INTEGER NOT NULL, rejected_tokens INTEGER NOT NULL,
    chosen_reward REAL, rejected_reward REAL, criterion TEXT NOT NULL, draw_rank TEXT NOT NULL,
    PRIMARY KEY (route, member_id)
);
CREATE INDEX IF NOT EXISTS preference_pairs_task ON preference_pairs (route, task_id);
CREATE TABLE IF NOT EXISTS preference_unassigned (
    route TEXT NOT NULL, execution_id TEXT NOT NULL, task_id TEXT NOT NULL, reason TEXT NOT NULL,
    PRIMARY KEY (route, execution_id)
);
CREATE INDEX IF NOT EXISTS preference_unassigned_task ON preference_unassigned (route, task_id);
"""
# Connection-local: which (route, execution) rows admission wrote in the current batch.
_TOUCH = """
CREATE TEMP TABLE IF NOT EXISTS preference_touched (route TEXT NOT NULL, execution_id TEXT NOT NULL,
                                                    PRIMARY KEY (route, execution_id));
CREATE TEMP TRIGGER IF NOT EXISTS preference_touch_insert AFTER INSERT ON main.admission
BEGIN INSERT OR IGNORE INTO preference_touched VALUES (NEW.route, NEW.execution_id); END;
CREATE TEMP TRIGGER IF NOT EXISTS preference_touch_update AFTER UPDATE ON main.admission
BEGIN INSERT OR IGNORE INTO preference_touched VALUES (NEW.route, NEW.execution_id); END;
CREATE TEMP TRIGGER IF NOT EXISTS preference_touch_delete AFTER DELETE ON main.admission
BEGIN INSERT OR IGNORE INTO preference_touched VALUES (OLD.route, OLD.execution_id); END;
"""
_ROUTE_EVENTS = {"admission_policy"}


def preference_route(route) -> bool:
    """True for a route whose members are pairs (use ``preference``, semantics 2 or later)."""
    return route is not None and route.use == "preference" and int(getattr(route, "semantics", 1)) >= 2


class PreferenceProjection:
    """Tables ``preference_pairs`` and ``preference_unassigned``."""

    name = "preference"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.dirty: set[str] = set()
        self.routes_changed = False

    def create(self, db: sqlite3.Connection) -> None:

        AdmissionProjection().create(db)  # the tables read here (no-op when present)
        db.executescript(_SCHEMA)
        db.executescript(_TOUCH)

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev = item.event
        ex = ev.get("execution_id")
        if isinstance(ex, str):
            self.dirty.add(ex)
        elif item.type in ("record_derived", "revalidated"):
            self.dirty.add(ev["derived_execution_id"])
        elif item.type in _ROUTE_EVENTS:
            self.routes_changed = True

    def finish(self, db: sqlite3.Connection) -> None:
        touched: dict[str, set[str]] = {}
        for route, ex in db.execute("SELECT route, execution_id FROM temp.preference_touched"):
            touched.setdefault(route, set()).add(ex)
        db.execute("DELETE FROM temp.preference_touched")
        dirty, routes_changed = self.dirty, self.routes_changed
        self.reset()
        if not (touched or dirty or routes_changed):
            return

        routes = current_routes(db)
        if routes_changed:  # a route that is no longer a v2 preference route keeps no pairs
            for name in _routes_with_rows(db):
                if not preference_route(routes.get(name)):
                    db.execute("DELETE FROM preference_pairs WHERE route = ?", (name,))
                    db.execute("DELETE FROM preference_unassigned WHERE route = ?", (name,))
        wanted = {n: r for n, r in routes.items() if preference_route(r)}
        if not wanted:
            return
        dirty_all = dirty | _views_of(db, dirty) if dirty else set()
        for name, route in sorted(wanted.items()):
            if routes_changed:
                recompute_route(db, route)
                continue
            exs = touched.get(name, set()) | dirty_all
            tasks = {t for t in (task_of(db, ex) for ex in sorted(exs)) if t is not None}
            for task in sorted(tasks):
                recompute_task(db, route, task)


def _routes_with_rows(db: sqlite3.Connection) -> set[str]:
    return ({r[0] for r in db.execute("SELECT DISTINCT route FROM preference_pairs")}
            | {r[0] for r in db.execute("SELECT DISTINCT route FROM preference_unassigned")})


def _views_of(db: sqlite3.Connection, exs: set[str]) -> set[str]:
    if db.execute("SELECT 1 FROM assessment_executions WHERE parent_execution_id IS NOT NULL LIMIT 1").fetchone() is None:
        return set()
    return descendants(db, exs, table="assessment_executions", child="execution_id", parent="parent_execution_id")


# ---------------------------------------------------------------------------- recomputation


def recompute_route(db: sqlite3.Connection, route) -> None:
    """Every task of ``route`` from scratch (a route declared or changed; a merge of shards)."""
    db.execute("DELETE FROM preference_pairs WHERE route = ?", (route.name,))
    db.execute("DELETE FROM preference_unassigned WHERE route = ?", (route.name,))
    if not preference_route(route):
        return
    exs = [r[0] for r in db.execute("SELECT execution_id FROM admission WHERE route = ? AND state = 'admitted' "
                                    "ORDER BY execution_id", (route.name,))]
    for task in sorted({t for t in (task_of(db, ex) for ex in exs) if t is not None}):
        recompute_task(db, route, task)


def _candidates(db: sqlite3.Connection, route: str, task: str) -> list[str]:
    """Executions (derived views included) of ``task`` admitted on ``route``."""
    own = {r[0] for r in db.execute("SELECT execution_id FROM assessment_executions WHERE task_id = ?", (task,))}
    exs = sorted(own | _views_of(db, own))
    out: list[str] = []
    for i in range(0, len(exs), 500):
        chunk = exs[i:i + 500]
        out += [r[0] for r in db.execute(
            f"SELECT execution_id FROM admission WHERE route = ? AND state = 'admitted' AND execution_id IN "
            f"({','.join('?' * len(chunk))})", (route, *chunk))]
    return sorted(out)


def recompute_task(db: sqlite3.Connection, route, task: str) -> None:
    """The pairs and unassigned candidates of ``route`` among the executions of ``task``, from scratch."""
    db.execute("DELETE FROM preference_pairs WHERE route = ? AND task_id = ?", (route.name, task))
    db.execute("DELETE FROM preference_unassigned WHERE route = ? AND task_id = ?", (route.name, task))
    cands = _candidates(db, route.name, task)
    if not cands:
        return
    loaded: dict[str, _Candidate] = {}
    no_side: dict[str, str | None] = {}
    requests: list[tuple[str, str, bytes, str]] = []
    for ex in cands:
        c = _Candidate.load(db, ex, int(getattr(route, "semantics", 2)))
        loaded[ex] = c
        no_side[ex] = c.no_side
        if c.no_side is None:
            requests += [(ex, rid, key, task) for rid, key in c.input_keys().items()]
    sides: list[Side] = []
    index: dict[tuple[str, int], int] = {}
    groups = []
    for group in decision_groups(requests):
        members = []
        for ex, rid in group:
            c = loaded[ex]
            idx = []
            for leaf in c.leaves_below(rid):
                key = (ex, leaf)
                if key not in index:
                    side = c.side(leaf)
                    if side is None:
                        continue
                    index[key] = len(sides)
                    sides.append(side)
                idx.append(index[key])
            members.append(DecisionMember(ex, rid, tuple(sorted(idx))))
        groups.append(members)
    result = form_pairs(route.name, sides, groups, seed=route.seed, j_max=route.j_max, candidates=no_side)
    rows = []
    for p in result.pairs:
        c, r = sides[p.chosen], sides[p.rejected]
        rows.append((route.name, p.member_id, task, c.execution_id, c.leaf_request_id, r.execution_id,
                     r.leaf_request_id, p.prompt_tokens, int(c.tokens.shape[0]) - p.prompt_tokens,
                     int(r.tokens.shape[0]) - p.prompt_tokens, c.reward, r.reward, p.criterion, p.rank))
    db.executemany("INSERT INTO preference_pairs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    db.executemany("INSERT INTO preference_unassigned VALUES (?,?,?,?)",
                   [(route.name, ex, task, why) for ex, why in sorted(result.unassigned.items())])


def _hard_negative_citation(sel, semantics: int) -> str | None:
    """What a pair's ``criterion`` cites after ``hard_negative:`` -- the selection id, and under semantics
    3 its basis (SPEC 11.2) as canonical JSON: ``s1 basis={"divergence_request_id":"r3",...}``."""
    if sel.role != "hard_negative":
        return None
    if semantics >= 3 and sel.basis is not None:
        return f"{sel.selection_id} basis={sel.basis}"
    return sel.selection_id


class _Candidate:
    """One candidate execution's tree, rewards and evidence, as the pairing needs them."""

    def __init__(self) -> None:
        self.ex = ""
        self.no_side: str | None = None
        self.tree = None
        self.leaf_info: dict[int, tuple[float | None, tuple[str, ...]]] = {}  # leaf node -> (reward, fail criteria)
        self.hard_negative: str | None = None
        self.lineage = ""
        self.policy: np.ndarray | None = None
        self.owner: dict[int, str] = {}

    @classmethod
    def load(cls, db: sqlite3.Connection, ex: str, semantics: int = 2) -> "_Candidate":

        c = cls()
        c.ex = ex
        c.lineage = ancestors(db, ex)[-1]
        try:
            c.tree = t = load_tree(db, ex)
        except KeyError:
            c.no_side = "no side: no prefix tree for this execution"
            return c
        score = _assessment.execution_score(db, ex)
        sel = selection_for(db, ex, semantics)
        c.hard_negative = _hard_negative_citation(sel, semantics)
        branches = _assessment.branch_rewards(db, ex)
        branch_assessment = _branch_assessments(db, ex) if branches else {}
        exec_reward = score.reward if score is not None and score.state == "scored" else None
        exec_aid = score.assessment_id if score is not None else None
        crit_cache: dict[str | None, tuple[str, ...]] = {}

        def fails(aid: str | None) -> tuple[str, ...]:
            if aid not in crit_cache:
                crit_cache[aid] = tuple(n for n, v in counting_criteria(db, ex, aid).items() if v == "fail")
            return crit_cache[aid]

        by_node: dict[int, list[str]] = {}
        for rid, req in t.requests.items():
            by_node.setdefault(req.node_id, []).append(rid)
        owner: dict[int, str] = {}
        for r in t.requests.values():  # seq order: the first request mapped to a node owns it
            owner.setdefault(r.node_id, r.request_id)
        c.owner = owner
        for n in t.nodes:
            if n.node_id in t.children or n.node_id not in owner:
                continue
            path_reqs = [r for m in t.path_nodes(n.node_id) for r in sorted(by_node.get(m, ()))]
            branch = next((r for r in reversed(path_reqs) if r in branches), None)
            covered, reward = _assessment.path_reward(path_reqs, exec_reward, branches)
            if not covered and c.hard_negative is None:
                continue
            aid = branch_assessment.get(branch) if branch is not None else exec_aid
            c.leaf_info[n.node_id] = (reward if covered else None, fails(aid) if covered else ())
        if not c.leaf_info:
            c.no_side = "no side: no root-to-leaf path carries a reward and none is a declared hard negative"
        gens = {rid: r.generator for rid, r in t.requests.items()}
        c.policy = np.array([gens.get(n.origin_request_id) == "policy" for n in t.nodes], dtype=bool)
        return c

    def input_keys(self) -> dict[str, bytes]:
        """Request id -> SHA-256 of its input tokens (packed uint32), by streaming node segments."""
        t = self.tree
        start = np.zeros(len(t.nodes), dtype=np.int64)
        ends: list = [None] * len(t.nodes)  # hash state at the end of each node's segment
        root = hashlib.sha256()
        for n in t.nodes:  # parents before children
            base = root if n.parent is None else ends[n.parent]
            start[n.node_id] = 0 if n.parent is None else start[n.parent] + t.nodes[n.parent].tokens.shape[0]
            h = base.copy()
            h.update(np.ascontiguousarray(n.tokens, dtype="<u4").tobytes())
            ends[n.node_id] = h
        out: dict[str, bytes] = {}
        for rid, req in t.requests.items():
            node = req.node_id
            while node is not None and start[node] > req.input_len:
                node = t.nodes[node].parent
            if node is None:
                continue
            off = req.input_len - int(start[node])
            parent = t.nodes[node].parent
            h = (root if parent is None else ends[parent]).copy()
            h.update(np.ascontiguousarray(t.nodes[node].tokens[:off], dtype="<u4").tobytes())
            out[rid] = h.digest()
        return out

    def leaves_below(self, request_id: str) -> list[int]:
        t = self.tree
        top = t.requests[request_id].node_id
        out, stack = [], [top]
        while stack:
            n = stack.pop()
            kids = t.children.get(n)
            if kids:
                stack.extend(kids)
            elif n in self.leaf_info:
                out.append(n)
        return sorted(out)

    def side(self, leaf: int) -> Side | None:
        info = self.leaf_info.get(leaf)
        if info is None:
            return None
        tokens, logprobs = side_arrays(self.tree, self.policy, leaf)
        return Side(self.ex, self.owner[leaf], self.lineage, tokens, logprobs, info[0], info[1], self.hard_negative)


def side_arrays(tree, policy_nodes: np.ndarray, leaf_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Root-to-leaf tokens (uint32) and behaviour log-probs (float32, NaN where not a policy output)."""

    nodes = tree.path_nodes(leaf_node)
    if not nodes:
        return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.float32)
    tokens = np.concatenate([tree.nodes[n].tokens for n in nodes]).astype(np.uint32, copy=False)
    parts = []
    for n in nodes:
        node = tree.nodes[n]
        lp = node.logprobs.astype(np.float32, copy=True)
        if policy_nodes[n]:
            lp[(node.flags & FLAG_OUTPUT) == 0] = np.nan
        else:
            lp[:] = np.nan
        parts.append(lp)
    return tokens, np.concatenate(parts)


def _branch_assessments(db: sqlite3.Connection, ex: str) -> dict[str, str]:
    """Branch request id -> the winning branch-scoped assessment (a view's are its parent's, as in
    :func:`projections.assessment.branch_rewards`)."""
    row = db.execute("SELECT parent_execution_id, revalidated, revalidated_reward FROM assessment_executions "
                     "WHERE execution_id = ?", (ex,)).fetchone()
    if row is not None and row[0] is not None:
        if row[1] != "pass" or row[2] is not None:
            return {}
        return _branch_assessments(db, row[0])
    return dict(db.execute("SELECT branch_request_id, assessment_id FROM branch_scores WHERE execution_id = ?", (ex,)))


# ---------------------------------------------------------------------------- reads


def pair_rows(db: sqlite3.Connection, route: str) -> Iterable[tuple]:
    """The route's pairs in ``member_id`` byte order (SQLite's default BINARY collation on UTF-8)."""
    return db.execute("SELECT member_id, task_id, chosen_execution_id, chosen_leaf_request_id, rejected_execution_id, "
                      "rejected_leaf_request_id, prompt_tokens, chosen_tokens, rejected_tokens, chosen_reward, "
                      "rejected_reward, criterion FROM preference_pairs WHERE route = ? ORDER BY member_id", (route,))


def unassigned_rows(db: sqlite3.Connection, route: str) -> list[tuple[str, str, str]]:
    """``(execution_id, task_id, reason)`` of the route's unassigned comparison candidates."""
    return db.execute("SELECT execution_id, task_id, reason FROM preference_unassigned WHERE route = ? "
                      "ORDER BY execution_id", (route,)).fetchall()


def route_summary(db: sqlite3.Connection, route: str) -> dict:
    """Pairs, token counts and unassigned candidates of a preference route (``ledger admission show``)."""
    n, prompt, cont, execs = db.execute(
        "SELECT COUNT(*), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(chosen_tokens + rejected_tokens), 0), "
        "COUNT(DISTINCT chosen_execution_id) FROM preference_pairs WHERE route = ?", (route,)).fetchone()
    by_criterion = dict(db.execute("SELECT criterion, COUNT(*) FROM preference_pairs WHERE route = ? GROUP BY 1 "
                                   "ORDER BY 1", (route,)).fetchall())
    unassigned = [{"execution_id": ex, "task_id": task, "reason": why} for ex, task, why in unassigned_rows(db, route)]
    return {"pairs": n, "prompt_tokens": prompt, "continuation_tokens": cont, "chosen_executions": execs,
            "by_criterion": by_criterion, "unassigned": unassigned}
