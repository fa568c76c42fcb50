"""Verifier integrity (SPEC §6.10; seed 002 §15.3.2, §15.5.2): protected paths and grader
calibration.

**Facts** (tables, filled by :class:`VerifierProjection`, which runs before admission):

* ``task_path_policies``: one row per ``task_registered`` that declares ``protected_paths`` or
  ``allowed_paths``.  Every registration of a task is enforced (a changed path must satisfy
  each one), so the result does not depend on their order.
* ``artifact_diffs``: ``artifact_diff`` events (changed paths of one artifact version against
  its base commit).  Several diffs of one version are combined (a path any of them changes
  counts).
* ``grader_controls``: ``grader_control`` events (an execution is an adequate or inadequate
  control for one evaluator version, with its expected verdict).

**Rules** (used by :mod:`projections.admission`, routes of semantics >= 2 only; semantics-1
routes keep the first release's rules):

* ``protected_paths`` (family ``process``, ledger-computed): runs on every route when the
  execution's task declares protected paths (placed before the route's first process,
  outcome or target-suitability step: containment precedes untrusted checks), and where a
  route names it.  It checks the artifact version the counting assessment assessed (else
  the committed one): ``fail`` when its diff changes a protected path that no allowed glob
  covers, whatever any test verdict or reward says; ``pending`` without a diff of that
  version; ``unknown`` when a route names it but the task declares no protected paths.  A
  derived view inherits its parent's verdict.
* Controls are never admitted: an execution declared a control (or a view derived from one)
  is rejected on ``grader_control`` on every route.
* ``calibrated_evaluators: true``: the counting assessment counts only when its evaluator
  version is calibrated (:mod:`ledger.algorithms.grader_calibration`); otherwise the
  execution is ``unknown`` on ``calibrated_evaluators`` with the reason.
"""

from __future__ import annotations

import json
import sqlite3

from ledger.algorithms.grader_calibration import Calibration, calibrate, observed_verdict
from ledger.algorithms.path_globs import violations
from ledger.projections.engine import Applied, TableProjection
from ledger.projections.lineage import ancestors, iter_ancestors, task_of

__all__ = ["DIRTYING", "VerifierProjection", "calibration", "calibration_verdict", "cascade", "control_exclusion",
           "dirty_executions", "graders", "protected_paths_verdict", "task_policies"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS task_path_policies (
    task_id TEXT NOT NULL, event_id TEXT NOT NULL, protected TEXT NOT NULL, allowed TEXT NOT NULL,
    PRIMARY KEY (task_id, event_id)
);
CREATE TABLE IF NOT EXISTS artifact_diffs (
    execution_id TEXT NOT NULL, event_id TEXT NOT NULL, artifact_version TEXT NOT NULL, base_commit TEXT,
    changed_paths TEXT NOT NULL, has_diff INTEGER NOT NULL,
    PRIMARY KEY (execution_id, event_id)
);
CREATE INDEX IF NOT EXISTS artifact_diffs_version ON artifact_diffs (execution_id, artifact_version);
CREATE TABLE IF NOT EXISTS grader_controls (
    execution_id TEXT NOT NULL, evaluator TEXT NOT NULL, event_id TEXT NOT NULL, kind TEXT NOT NULL, expected TEXT NOT NULL,
    PRIMARY KEY (execution_id, evaluator, event_id)
);
CREATE INDEX IF NOT EXISTS grader_controls_evaluator ON grader_controls (evaluator);
"""

PREDICATE = "protected_paths"
_AFTER = ("process", "outcome", "target_suitability")  # protected_paths runs before the first of these


class VerifierProjection(TableProjection):
    """Tables ``task_path_policies``, ``artifact_diffs``, ``grader_controls``."""

    name = "verifier"
    event_types = frozenset(("task_registered", "artifact_diff", "grader_control"))  # what apply acts on (the engine dispatches by type)

    SCHEMA = _SCHEMA

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev, et = item.event, item.type
        if et == "task_registered" and (ev.get("protected_paths") or ev.get("allowed_paths")):
            db.execute("INSERT OR IGNORE INTO task_path_policies VALUES (?,?,?,?)",
                       (ev["task_id"], ev["event_id"], json.dumps(sorted(set(ev.get("protected_paths") or []))),
                        json.dumps(sorted(set(ev.get("allowed_paths") or [])))))
        elif et == "artifact_diff":
            db.execute("INSERT OR IGNORE INTO artifact_diffs VALUES (?,?,?,?,?,?)",
                       (ev["execution_id"], ev["event_id"], ev["artifact_version"], ev.get("base_commit"),
                        json.dumps(sorted(set(ev["changed_paths"]))), int(ev.get("diff") is not None)))
        elif et == "grader_control":
            db.execute("INSERT OR IGNORE INTO grader_controls VALUES (?,?,?,?,?)",
                       (ev["execution_id"], ev["evaluator"], ev["event_id"], ev["kind"], ev["expected_verdict"]))


# ------------------------------------------------------------------------------ dirty marking

DIRTYING = frozenset({"task_registered", "grader_control", "assessment"})


def dirty_executions(db: sqlite3.Connection, ev: dict, et: str) -> set[str]:
    """Executions (known so far) whose admission an event of this module's rules may change besides
    the event's own execution: a task's path policy reaches the task's executions; a control
    declaration, or an assessment of a control, changes its evaluator's calibration, which reaches
    every execution that evaluator assessed (only while some route asks for calibrated evaluators).
    Executions that arrive later are evaluated on their own events."""
    if et == "task_registered":
        if not (ev.get("protected_paths") or ev.get("allowed_paths")):
            return set()
        return {r[0] for r in db.execute("SELECT execution_id FROM assessment_executions WHERE task_id = ?",
                                         (ev["task_id"],))}
    if et == "grader_control":
        evaluator = ev["evaluator"]
    elif et == "assessment":
        evaluator = ev["evaluator"]
        if db.execute("SELECT 1 FROM grader_controls WHERE execution_id = ? AND evaluator = ? LIMIT 1",
                      (ev["execution_id"], evaluator)).fetchone() is None:
            return set()
    else:
        return set()
    if not _calibrated_routes_exist(db):
        return set()
    return {r[0] for r in db.execute("SELECT DISTINCT execution_id FROM assessments WHERE evaluator = ?", (evaluator,))}


def _calibrated_routes_exist(db: sqlite3.Connection) -> bool:
    return db.execute("SELECT 1 FROM routes WHERE options LIKE '%calibrated_evaluators%' LIMIT 1").fetchone() is not None


# ------------------------------------------------------------------------------ protected paths


def task_policies(db: sqlite3.Connection, task_id: str | None) -> list[tuple[list[str], list[str]]]:
    """``[(protected globs, allowed globs), ...]``: one per registration of the task that declares paths."""
    if task_id is None:
        return []
    return [(json.loads(p), json.loads(a)) for p, a in db.execute(
        "SELECT protected, allowed FROM task_path_policies WHERE task_id = ? ORDER BY event_id", (task_id,))]


def _protects(db: sqlite3.Connection, ex: str) -> bool:
    return any(p for p, _a in task_policies(db, task_of(db, ex)))


def cascade(db: sqlite3.Connection, route, ex: str, make_predicate) -> tuple:
    """``route.predicates`` with ``protected_paths`` inserted before the first process / outcome /
    target-suitability step when the execution's task protects paths and the route does not name it.
    ``make_predicate(name, family)`` builds a step (admission's ``RoutePredicate``)."""
    preds = tuple(route.predicates)
    if any(p.name == PREDICATE and p.family == "process" for p in preds) or not _protects(db, ex):
        return preds
    at = next((i for i, p in enumerate(preds) if p.family in _AFTER), len(preds))
    return preds[:at] + (make_predicate(PREDICATE, "process"),) + preds[at:]


def _checked_version(db: sqlite3.Connection, ex: str) -> str | None:
    """The artifact version the counting assessment assessed, else the committed (last closed) one."""
    score = db.execute("SELECT assessment_id FROM execution_scores WHERE execution_id = ?", (ex,)).fetchone()
    if score is not None and score[0] is not None:
        row = db.execute("SELECT artifact_version FROM assessments WHERE execution_id = ? AND assessment_id = ?",
                         (ex, score[0])).fetchone()
        if row is not None:
            return row[0]
    row = db.execute("SELECT committed_version FROM assessment_executions WHERE execution_id = ?", (ex,)).fetchone()
    return row[0] if row else None


def protected_paths_verdict(db: sqlite3.Connection, ex: str) -> tuple[str, str, str | None]:
    """``(verdict, reason, missing evidence)`` of the ``protected_paths`` predicate for ``ex``."""
    chain = ancestors(db, ex)
    if len(chain) > 1:  # a derived view inherits its parent's verdict
        v, reason, missing = protected_paths_verdict(db, chain[1])
        return (v, "", None) if v == "pass" else (v, f"parent {chain[1]}: {reason}", missing)
    task = task_of(db, ex)
    policies = task_policies(db, task)
    if not any(p for p, _a in policies):
        return ("unknown", f"task {task} declares no protected_paths", f"protected_paths of task {task}")
    version = _checked_version(db, ex)
    if version is None:
        return ("pending", "no artifact version to check (no counting assessment, no closed artifact version)",
                "artifact version")
    rows = db.execute("SELECT changed_paths FROM artifact_diffs WHERE execution_id = ? AND artifact_version = ?",
                      (ex, version)).fetchall()
    if not rows:
        return ("pending", f"no artifact_diff for {version}", f"artifact_diff {version}")
    changed = sorted({p for (js,) in rows for p in json.loads(js)})
    bad = violations(changed, policies)
    if not bad:
        return ("pass", "", None)
    shown = ", ".join(f"{path} (protected by {glob})" for path, glob in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return ("fail", f"artifact {version} changes protected path{'s' if len(bad) > 1 else ''} {shown}{more}, "
                    "not allowed by the task", None)


# ------------------------------------------------------------------------------ controls and calibration


def control_exclusion(db: sqlite3.Connection, ex: str) -> str | None:
    """Why ``ex`` may never be admitted (it, or the execution it derives from, is a grader control), or None."""
    for cur in iter_ancestors(db, ex):
        row = db.execute("SELECT evaluator, kind FROM grader_controls WHERE execution_id = ? ORDER BY evaluator, kind "
                         "LIMIT 1", (cur,)).fetchone()
        if row is not None:
            what = "" if cur == ex else f" (derived from {cur})"
            return f"calibration control{what}: {row[1]} control for {row[0]}; controls are never admitted"
    return None


def calibration(db: sqlite3.Connection, evaluator: str) -> Calibration:
    """The calibration of one evaluator version against its declared controls."""
    decl = db.execute("SELECT execution_id, kind, expected FROM grader_controls WHERE evaluator = ? ORDER BY 1, 2, 3",
                      (evaluator,)).fetchall()
    observed = {}
    for ex in sorted({d[0] for d in decl}):
        row = db.execute("SELECT outcome, reward FROM assessments WHERE execution_id = ? AND evaluator = ? AND outcome IN "
                         "('scored', 'not_assessable') ORDER BY seq LIMIT 1", (ex, evaluator)).fetchone()
        observed[ex] = observed_verdict(*row) if row else None
    return calibrate(evaluator, decl, observed)


def _counting_evaluators(db: sqlite3.Connection, ex: str) -> list[str]:
    """Evaluator versions of the assessments ``ex``'s score counts (a derived view's are its parent's)."""
    for cur in iter_ancestors(db, ex):
        row = db.execute("SELECT assessment_id FROM execution_scores WHERE execution_id = ?", (cur,)).fetchone()
        ids = [row[0]] if row is not None and row[0] is not None else \
            [r[0] for r in db.execute("SELECT assessment_id FROM branch_scores WHERE execution_id = ?", (cur,))]
        if ids:
            return sorted({r[0] for a in ids for r in db.execute(
                "SELECT evaluator FROM assessments WHERE execution_id = ? AND assessment_id = ?", (cur, a))})
        reval = db.execute("SELECT revalidated_reward FROM assessment_executions WHERE execution_id = ?", (cur,)).fetchone()
        if reval is not None and reval[0] is not None:
            return []  # a view revalidated with its own reward: no evaluator assessment counts
    return []


def _route_option(db: sqlite3.Connection, route, key: str):
    row = db.execute("SELECT options FROM routes WHERE route = ? AND version = ?", (route.name, route.version)).fetchone()
    return json.loads(row[0] or "{}").get(key) if row else None


def calibration_verdict(db: sqlite3.Connection, route, ex: str) -> tuple[str, str, str | None] | None:
    """``None`` (pass) unless the route asks for calibrated evaluators and the counting assessment's
    evaluator version is not calibrated: then ``("unknown", reason, missing evidence)``."""
    if not _route_option(db, route, "calibrated_evaluators"):
        return None
    for evaluator in _counting_evaluators(db, ex):
        cal = calibration(db, evaluator)
        if not cal.calibrated:
            return ("unknown", f"evaluator {evaluator} not calibrated: {cal.why_not()}", f"calibration of {evaluator}")
    return None


def graders(db: sqlite3.Connection) -> list[dict]:
    """``ledger graders``: per evaluator version (every one that has controls or assessed anything),
    its controls (id, kind, expected, observed), misclassifications, false acceptance / rejection
    rates and whether it is calibrated."""
    names = {r[0] for r in db.execute("SELECT DISTINCT evaluator FROM grader_controls")}
    names |= {r[0] for r in db.execute("SELECT DISTINCT evaluator FROM assessments")}
    out = []
    for name in sorted(names):
        cal = calibration(db, name)
        out.append({
            "evaluator": name,
            "controls": [{"execution_id": c.execution_id, "kind": c.kind, "expected": c.expected, "observed": c.observed}
                         for c in cal.controls],
            "misclassified": list(cal.misclassified),
            "not_assessed": list(cal.unassessed),
            "conflicting": list(cal.conflicting),
            "false_acceptance": {"inadequate_passed": cal.false_acceptance[0], "inadequate_assessed": cal.false_acceptance[1],
                                 "rate": cal.false_acceptance_rate},
            "false_rejection": {"adequate_failed": cal.false_rejection[0], "adequate_assessed": cal.false_rejection[1],
                                "rate": cal.false_rejection_rate},
            "calibrated": cal.calibrated,
            "why_not": cal.why_not(),
        })
    return out


def format_graders(rows: list[dict]) -> str:
    """The text form of :func:`graders`."""
    if not rows:
        return "no evaluator has assessed anything or been given controls"

    def rate(d: dict, k: str, n: str) -> str:
        return "n/a (0 assessed)" if d["rate"] is None else f"{d['rate']:.3f} ({d[k]}/{d[n]})"

    lines = []
    for g in rows:
        lines.append(f"{g['evaluator']}: {'calibrated' if g['calibrated'] else 'NOT calibrated'}"
                     + ("" if g["calibrated"] else f" ({g['why_not']})"))
        lines.append(f"  false acceptance {rate(g['false_acceptance'], 'inadequate_passed', 'inadequate_assessed')}, "
                     f"false rejection {rate(g['false_rejection'], 'adequate_failed', 'adequate_assessed')}")
        for c in g["controls"]:
            mark = "" if c["observed"] is None or c["observed"] == c["expected"] else "  MISCLASSIFIED"
            lines.append(f"  {c['execution_id']}: {c['kind']}, expected {c['expected']}, observed "
                         f"{c['observed'] or 'not yet assessed'}{mark}")
    return "\n".join(lines)
