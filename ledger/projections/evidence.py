"""Evidence for verifier integrity (SPEC §6.10; seed 002 §15.2.2, §15.6.3, §15.7.3).

Tables ``fault_injections`` (``fault_injected``), ``production_feedback`` (``production_feedback``)
and ``counterfactual_probes`` (``counterfactual_probe``).  ``apply`` only records facts; the
admission projection (registered after this one) reads them in its ``finish``:

* the ledger-computed predicate ``feedback`` (family ``outcome``, routes of semantics >= 2):
  :func:`feedback_predicate`, rules in :mod:`ledger.algorithms.feedback`;
* the route option ``capability_gap: true`` (semantics >= 2): :func:`capability_gap_gate`, run right
  after ``permitted_use`` passes, rules in :mod:`ledger.algorithms.capability_gap`.

Accounting and the manifest datasheet read :func:`disruptions`, :func:`fault_coverage` and
:func:`probe_evidence`.

**Natural disruption** (what the accounting counts beside the injected ones): a tool call of the
execution whose cached ``result`` payload is a JSON object with ``"is_error": true`` or a non-null
top-level ``"error"``, and that no ``fault_injected`` of the execution names as its
``target_call_id``.  Both kinds are attributed to the role class (agent tier / turn kind) of the
first request that consumed the call; a fault with no target call, or a call no request consumed,
counts under ``unattributed``.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Iterable

from ledger.algorithms.capability_gap import RUNGS, Probe, ladder_verdict
from ledger.algorithms.feedback import feedback_verdict
from ledger.projections.engine import Applied, TableProjection
from ledger.projections.lineage import ancestors, task_of
from ledger.algorithms.capability_gap import latest_per_rung

__all__ = ["EvidenceProjection", "TABLE9", "capability_gap_gate", "disrupted_candidates", "disruptions", "emitted_tasks",
           "execution_disruptions", "fault_coverage", "feedback_predicate",
           "probe_evidence", "route_option", "task_executions"]

# seed 002 Table 9: condition -> (required causal distinction, candidate response to assess)
TABLE9 = {
    "malformed_rejected": ("no operation was dispatched", "inspect the schema and correct the represented error"),
    "partial_result": ("missing content is distinguished from an empty complete result",
                       "request a valid continuation or report insufficient evidence"),
    "lost_ack": ("the endpoint may have acted despite the missing reply",
                 "reconcile the identified operation before a dependent retry (reconcile before retry)"),
    "capability_unavailable": ("the original goal may be unreachable within the grant",
                               "stop or hand off with accurate scope and owned residual duties"),
}
NATURAL_DEFINITION = ("a tool call whose cached result payload has \"is_error\": true or a non-null top-level \"error\", "
                      "not named by a fault_injected target_call_id; attributed to the role class of its first consumer")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS fault_injections (
    execution_id TEXT NOT NULL, injection_id TEXT NOT NULL, version TEXT NOT NULL, condition TEXT NOT NULL,
    target_call_id TEXT, simulated_state TEXT, expected_response TEXT,
    PRIMARY KEY (execution_id, injection_id)
);
CREATE TABLE IF NOT EXISTS production_feedback (
    execution_id TEXT NOT NULL, event_id TEXT NOT NULL, occurred_at INTEGER NOT NULL, signal TEXT NOT NULL,
    value REAL, consent_ref TEXT, evidence TEXT,
    PRIMARY KEY (execution_id, event_id)
);
CREATE TABLE IF NOT EXISTS counterfactual_probes (
    task_id TEXT NOT NULL, probe_id TEXT NOT NULL, rung TEXT NOT NULL, result TEXT NOT NULL, evidence TEXT,
    occurred_at INTEGER NOT NULL,
    PRIMARY KEY (task_id, probe_id)
);
"""


class EvidenceProjection(TableProjection):
    name = "evidence"
    event_types = frozenset(("fault_injected", "production_feedback", "counterfactual_probe"))  # what apply acts on (the engine dispatches by type)
    SCHEMA = _SCHEMA

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev, et = item.event, item.type
        if et == "fault_injected":
            db.execute("INSERT OR IGNORE INTO fault_injections VALUES (?,?,?,?,?,?,?)",
                       (ev["execution_id"], ev["injection_id"], ev["version"], ev["condition"], ev.get("target_call_id"),
                        ev.get("simulated_state"), ev.get("expected_response")))
        elif et == "production_feedback":
            db.execute("INSERT OR IGNORE INTO production_feedback VALUES (?,?,?,?,?,?,?)",
                       (ev["execution_id"], ev["event_id"], ev["occurred_at"], ev["signal"], ev.get("value"),
                        ev.get("consent_ref"), ev.get("evidence")))
        elif et == "counterfactual_probe":
            db.execute("INSERT OR IGNORE INTO counterfactual_probes VALUES (?,?,?,?,?,?)",
                       (ev["task_id"], ev["probe_id"], ev["rung"], ev["result"], ev.get("evidence"), ev["occurred_at"]))


# ------------------------------------------------------------------------------ reads (admission)


def _rows(db: sqlite3.Connection, sql: str, args: tuple = ()) -> list[tuple]:
    try:
        return db.execute(sql, args).fetchall()
    except sqlite3.OperationalError:  # this projection is not in the database: no evidence
        return []


def _chain(db: sqlite3.Connection, ex: str) -> list[str]:
    """``ex`` and its parents (a derived view inherits its parent's task and feedback)."""
    try:
        return ancestors(db, ex)
    except sqlite3.OperationalError:  # the assessment projection is not in the database
        return [ex]


def _task_of(db: sqlite3.Connection, ex: str) -> str | None:
    try:
        return task_of(db, ex)
    except sqlite3.OperationalError:  # the assessment projection is not in the database
        return None


def task_executions(db: sqlite3.Connection, task_id: str) -> set[str]:
    """The executions of a task that are known so far (a probe re-evaluates them)."""
    return {r[0] for r in _rows(db, "SELECT execution_id FROM assessment_executions WHERE task_id = ?", (task_id,))}


def route_option(db: sqlite3.Connection, route: str, version: int, key: str):
    """A SPEC §6.8/§6.10 option of a route version as stored by the admission projection."""
    row = _rows(db, "SELECT options FROM routes WHERE route = ? AND version = ?", (route, version))
    return json.loads(row[0][0] or "{}").get(key) if row else None


def feedback_predicate(db: sqlite3.Connection, ex: str) -> tuple[str, str, str | None]:
    """``(verdict, reason, missing)`` of the ``feedback`` predicate for ``ex`` (its own signals, else
    the nearest parent's with any)."""
    for cur in _chain(db, ex):
        rows = _rows(db, "SELECT occurred_at, event_id, signal, value, consent_ref FROM production_feedback "
                         "WHERE execution_id = ?", (cur,))
        if rows:
            return feedback_verdict(rows)
    return feedback_verdict([])


def _probes(db: sqlite3.Connection, task: str) -> list[Probe]:
    return [Probe(pid, rung, result, at) for pid, rung, result, at in _rows(
        db, "SELECT probe_id, rung, result, occurred_at FROM counterfactual_probes WHERE task_id = ?", (task,))]


def capability_gap_gate(db: sqlite3.Connection, route, ex: str):
    """``None`` when the route does not require a capability gap, else ``(verdict, reason, missing)``."""
    if not route_option(db, route.name, route.version, "capability_gap"):
        return None
    task = _task_of(db, ex)
    if task is None:
        return "pending", "the execution's task is not known", "task of the execution"
    v = ladder_verdict(_probes(db, task))
    if v.verdict == "pass":
        return "pass", v.reason, None
    if v.verdict == "pending":
        return "pending", f"task {task}: {v.reason}", f"counterfactual_probe at rung {v.rung}"
    return "fail", f"task {task}: {v.reason}", None


# ------------------------------------------------------------------------------ reads (accounting, datasheet)


def _role_classes(db: sqlite3.Connection, ex: str) -> dict[str, str]:
    """call id -> role class of the first request that consumed it."""
    roles = {rid: f"{tier}/{kind}" for rid, tier, kind in _rows(
        db, "SELECT request_id, agent_tier, turn_kind FROM tree_requests WHERE execution_id = ?", (ex,))}
    return {call: roles.get(first, "unattributed") for call, first in _rows(
        db, "SELECT call_id, first_consumer FROM capture_calls WHERE execution_id = ? AND consumed = 1", (ex,))}


def _is_error(payload: str) -> bool:
    try:
        obj = json.loads(payload)
    except ValueError:
        return False
    return isinstance(obj, dict) and (obj.get("is_error") is True or obj.get("error") is not None)


def disruptions(db: sqlite3.Connection, executions: Iterable[str], candidates: set[str] | None = None) -> dict:
    """Injected and natural disruptions of ``executions`` by role class (see the module notes).

    Only executions with a fault or a result payload that could be an error (``candidates``, by default
    :func:`disrupted_candidates`) are read one by one; the others contribute nothing."""
    by_role: dict[str, dict[str, int]] = {}
    totals = {"injected": 0, "natural": 0}
    for ex in sorted(set(executions) & (disrupted_candidates(db) if candidates is None else candidates)):
        execution_disruptions(db, ex, by_role, totals)
    return {**totals, "by_role_class": dict(sorted(by_role.items()))}


def disrupted_candidates(db: sqlite3.Connection) -> set[str]:
    """Executions with a ``fault_injected`` or a cached result whose text holds ``error`` or a ``\\u`` escape
    (a JSON key that decodes to ``error`` / ``is_error`` is spelled with one or the other): a superset of
    the executions :func:`execution_disruptions` counts anything for, found in two scans."""
    faults = {r[0] for r in _rows(db, "SELECT DISTINCT execution_id FROM fault_injections")}
    return faults | {r[0] for r in _rows(db, "SELECT DISTINCT execution_id FROM tool_payloads WHERE kind = 'result' AND "
                                             "(instr(payload, 'error') > 0 OR instr(payload, '\\u') > 0)")}


def execution_disruptions(db: sqlite3.Connection, ex: str, by_role: dict, totals: dict) -> None:
    """Add the injected and natural disruptions of ``ex`` to ``by_role`` and ``totals``."""
    faults = _rows(db, "SELECT target_call_id FROM fault_injections WHERE execution_id = ?", (ex,))
    errors = [c for c, p in _rows(db, "SELECT call_id, payload FROM tool_payloads WHERE execution_id = ? "
                                      "AND kind = 'result'", (ex,)) if _is_error(p)]
    if not faults and not errors:
        return
    roles = _role_classes(db, ex)
    targeted = {c for (c,) in faults if c is not None}
    for (call,) in faults:
        row = by_role.setdefault(roles.get(call, "unattributed") if call else "unattributed", {"injected": 0, "natural": 0})
        row["injected"] += 1
        totals["injected"] += 1
    for call in errors:
        if call in targeted:
            continue
        row = by_role.setdefault(roles.get(call, "unattributed"), {"injected": 0, "natural": 0})
        row["natural"] += 1
        totals["natural"] += 1


def any_faults(db: sqlite3.Connection) -> bool:
    return bool(_rows(db, "SELECT 1 FROM fault_injections LIMIT 1"))


def fault_coverage(db: sqlite3.Connection, route: str) -> dict:
    """Per condition (Table 9's four always, custom ones when injected): executions of the route with
    it injected (``attempts``), those emitted (``admitted_executions``), their target tokens, and the
    expected responses stated (Table 9's default where none was)."""
    cov: dict[str, dict] = {c: {"attempts": 0, "admitted_executions": 0, "admitted_target_tokens": 0,
                                "expected_responses": set()} for c in TABLE9}
    rows = _rows(db, "SELECT a.execution_id, a.state, a.target_tokens, f.condition, f.expected_response "
                     "FROM admission a JOIN fault_injections f ON f.execution_id = a.execution_id "
                     "WHERE a.route = ? ORDER BY a.execution_id, f.injection_id", (route,))
    seen: set[tuple[str, str]] = set()
    for ex, state, targets, cond, expected in rows:
        c = cov.setdefault(cond, {"attempts": 0, "admitted_executions": 0, "admitted_target_tokens": 0,
                                  "expected_responses": set()})
        c["expected_responses"].add(expected or TABLE9[cond][1])
        if (ex, cond) in seen:
            continue
        seen.add((ex, cond))
        c["attempts"] += 1
        if state in ("admitted", "dummy"):
            c["admitted_executions"] += 1
            c["admitted_target_tokens"] += targets
    out = {}
    for cond in sorted(cov, key=lambda k: (k not in TABLE9, list(TABLE9).index(k) if k in TABLE9 else 0, k)):
        c = cov[cond]
        responses = sorted(c["expected_responses"]) or ([TABLE9[cond][1]] if cond in TABLE9 else [])
        out[cond] = {"attempts": c["attempts"], "admitted_executions": c["admitted_executions"],
                     "admitted_target_tokens": c["admitted_target_tokens"], "expected_responses": responses,
                     **({"causal_distinction": TABLE9[cond][0]} if cond in TABLE9 else {})}
    return out


def emitted_executions(db: sqlite3.Connection, route: str) -> list[str]:
    return [r[0] for r in _rows(db, "SELECT execution_id FROM admission WHERE route = ? AND state IN ('admitted', 'dummy') "
                                    "ORDER BY execution_id", (route,))]


def emitted_tasks(db: sqlite3.Connection, route: str) -> set[str]:
    """The tasks of a route's emitted executions (:func:`projections.lineage.task_of`): one query for
    the executions that name their own task, the chain walked for the derived views that do not."""
    emitted = ("FROM admission a JOIN assessment_executions e ON e.execution_id = a.execution_id WHERE a.route = ? "
               "AND a.state IN ('admitted', 'dummy') AND e.task_id IS")
    tasks = {r[0] for r in _rows(db, f"SELECT DISTINCT e.task_id {emitted} NOT NULL", (route,))}
    views = (_task_of(db, ex) for (ex,) in _rows(db, f"SELECT a.execution_id {emitted} NULL", (route,)))
    return tasks | {t for t in views if t is not None}


def probe_evidence(db: sqlite3.Connection, route: str) -> dict:
    """Per task of the route's emitted executions: the deciding (latest) probe of each rung."""

    probed = {r[0] for r in _rows(db, "SELECT DISTINCT task_id FROM counterfactual_probes")}
    out: dict[str, list] = {}
    for task in sorted(emitted_tasks(db, route)):
        if task not in probed:  # no probe: no rung decided
            out[task] = []
            continue
        latest = latest_per_rung(_probes(db, task))
        ev = dict(_rows(db, "SELECT probe_id, evidence FROM counterfactual_probes WHERE task_id = ?", (task,)))
        out[task] = [{"rung": r, "probe_id": latest[r].probe_id, "result": latest[r].result,
                      "evidence": json.loads(ev[latest[r].probe_id]) if ev.get(latest[r].probe_id) else None}
                     for r in RUNGS if r in latest]
    return out


def datasheet_sections(db: sqlite3.Connection, route) -> dict:
    """What a route's manifest datasheet adds (semantics >= 2 only, and only when the evidence or the
    option exists, so manifests published before SPEC 6.10 rebuild to the same document):
    ``fault_injection`` (coverage per condition, injected vs natural disruptions of the emitted
    executions by role class) once any ``fault_injected`` is on the log; ``capability_gap`` (the
    deciding probe of each rung, per task of the emitted executions) on a ``capability_gap`` route."""
    if not route.use_specific:
        return {}
    out: dict = {}
    if any_faults(db):
        out["fault_injection"] = {"coverage": fault_coverage(db, route.name),
                                  "disruptions": disruptions(db, emitted_executions(db, route.name)),
                                  "natural_disruption": NATURAL_DEFINITION}
    if route_option(db, route.name, route.version, "capability_gap"):
        out["capability_gap"] = {"rule": "admitted only when the latest probe of each rung (context, interface, runtime) "
                                         "of the task is failure_persists",
                                 "probes_by_task": probe_evidence(db, route.name)}
    return out
