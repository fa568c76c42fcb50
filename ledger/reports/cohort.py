"""Cohort dispositions at a cutoff and the cost per emitted artifact (seed 002 §15.10.3,
table 15, equation 5; SPEC §6.7).

A **cohort** is the set of executions whose ``execution_opened.collection_run_id`` names it
(every initiated attempt; derived views belong to their parent's attempt).  At a cutoff
``T`` every attempt gets exactly one disposition:

``emitted``
    the attempt or one of its derived views is admitted (or admitted as a zero-reward
    dummy: a manifest member) on a route (``--route`` restricts to one consumer).
``assessed_not_selected``
    record and use conditions passed, then a recorded decision excluded it, filed under the
    family of the failing check (SPEC §11.1; ``ledger.algorithms.economics.CHECK_FAMILIES``):
    ``process`` (a process predicate, ``protected_paths``), ``outcome`` (an outcome predicate, ``min_reward``,
    ``required_criteria``), ``target`` (no target after masking, a hard negative on sft), or
    ``redundancy`` — the route's ``per_task_cap``, a process/outcome predicate whose name says
    so (``redundancy``, ``dedup``, ``duplicate``, ``cap``...), or the report's own
    ``--per-task-cap K`` (at most ``K`` emitted attempts per task, earliest opened first; the
    rest move here).
``ineligible``
    a use condition failed: ``split`` (the task group's split is not the route's),
    ``permission``, ``withdrawal``, ``capability_gap``, ``grader_control`` (a calibration
    control is never training data), or ``transformation`` (a derived view failed
    revalidation, so the transformed record the use needs does not exist).
``pending``
    a required decision is still expected: the execution is still open, a verifier verdict
    or an assessment has not arrived, a quarantine or permission review is open.
``unknown``
    required evidence is unavailable or insufficient: a verifier answered ``unknown``, the
    record is inadequate (missing log-probs, capture gap, never closed within its budget),
    no valid reward arrived within the time budget, no split map, no route declared.

Every row keeps the predicate and its reason (``detail``).  When several routes (or the
attempt and its derived views) disagree, the attempt takes the most favourable state in
the order emitted > pending > unknown > assessed_not_selected > ineligible: an attempt
still pending on one route may yet be emitted; one that passed the use conditions of some
route and then lost on a decision was assessed, not ineligible.

**The cutoff.**  Only events with ``occurred_at <= T`` count.  Most projection tables do
not carry per-fact timestamps (costs, verdicts, admission states), so the report replays
the log into a temporary database through every registered projection, each wrapped in
:class:`CutoffFilter`, which drops events dated after ``T``.  That is exactly the state the
projections would hold had the log contained only those events — cascade decisions,
assessment deadlines and costs included — at the price of one full replay per report.
Without a cutoff the live projection database (brought up to date) is used.

**Cost per emitted artifact** (equation 5) = the sum of ``cost_recorded`` amounts of the
cohort's executions and their derived views / emitted attempts; with nothing emitted the
cohort cost is reported as the loss (no division).
"""

from __future__ import annotations

import re
import sqlite3
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from ledger.algorithms.errors import InputError
from ledger.algorithms.economics import DISPOSITIONS, artifact_cost_from_dispositions, family_of
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.admission import current_routes
from ledger.events.signing import Trust
from ledger.events.validate import format_micros, timestamp_micros
from ledger.log import open_log
from ledger.projections.registry import store_keystore, with_keystore
from ledger.corpus.publish import projections as publish_projections

__all__ = ["CutoffFilter", "replay_until", "cohort_dispositions", "cohort_report", "format_cohort", "cohorts",
           "REDUNDANCY_NAME", "RANK"]

RANK = {"emitted": 0, "pending": 1, "unknown": 2, "assessed_not_selected": 3, "ineligible": 4}
"""Precedence when routes / views disagree (lower wins)."""

REDUNDANCY_NAME = re.compile(r"redundan|dedup|duplicate|(^|[^a-z])(per_task_)?cap([^a-z]|$)", re.IGNORECASE)
"""Process/outcome predicate names read as a redundancy (selector) decision."""

Progress = Callable[[int, int], None] | None


# ---------------------------------------------------------------------- cutoff replay
class CutoffFilter:
    """Wraps a projection so that only events with ``occurred_at <= cutoff_us`` reach it."""

    def __init__(self, inner: Any, cutoff_us: int) -> None:
        self.inner, self.cutoff_us = inner, cutoff_us
        self.name = inner.name

    def create(self, db: sqlite3.Connection) -> None:
        self.inner.create(db)

    def apply(self, db: sqlite3.Connection, item: Any) -> None:
        if item.event["occurred_at"] <= self.cutoff_us:
            self.inner.apply(db, item)

    def finish(self, db: sqlite3.Connection) -> None:
        self.inner.finish(db)

    def reset(self) -> None:
        self.inner.reset()

    def __getattr__(self, name: str) -> Any:  # e.g. AdmissionProjection.evidence
        return getattr(self.inner, name)


def replay_until(log: Any, db_path: str | Path, cutoff_us: int, *, trust: Any = None,
                 projections_factory: Callable[[], list] | None = None, progress: Progress = None) -> sqlite3.Connection:
    """Replay ``log`` into a fresh database at ``db_path`` keeping only events dated ``<= cutoff_us``."""

    if projections_factory is None:
        projections_factory = publish_projections  # the registry + manifests
    db = connect(db_path)
    engine = ReplayEngine(log, db, [CutoffFilter(p, cutoff_us) for p in projections_factory()], trust=trust)
    engine.run(progress=progress)
    return db


# ---------------------------------------------------------------------- classification
@dataclass(frozen=True)
class _Verdict:
    disposition: str
    reason: str
    route: str | None
    execution_id: str
    detail: str
    depth: int = 0  # 0 = the attempt itself, 1+ = a derived view

    def key(self) -> tuple:
        # most favourable disposition first; then the deepest view (the record meant for use); then names
        return (RANK[self.disposition], -self.depth, self.route or "", self.execution_id)


def _has(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone() is not None


_USE_CHECKS = ("capability_gap", "grader_control")
"""Use conditions filed under their own name as the ineligibility reason."""


def _ineligible_reason(predicate: str | None, reason: str | None) -> str:
    if predicate in _USE_CHECKS:
        return str(predicate)
    why = (reason or "").lower()
    return "withdrawal" if why.startswith("withdrawn") else ("split" if why.startswith("split") else "permission")


def _family_reason(family: str) -> str:
    return {"record_adequacy": "record", "permitted_use": "use", "target_suitability": "target"}.get(family, family)


def _classify(db: sqlite3.Connection, route: Any, families: dict[str, str], ex: str, depth: int,
              row: tuple | None) -> _Verdict:
    if row is None:
        return _Verdict("pending", "route", route.name, ex, f"not evaluated on route {route.name} yet", depth)
    state, predicate, verdict, missing, reason = row
    family = family_of(predicate, families)
    text = f"{predicate}: {reason}" + (f" (missing: {missing})" if missing else "")
    if state in ("admitted", "dummy"):
        return _Verdict("emitted", "dummy" if state == "dummy" else "admitted", route.name, ex,
                        reason or state, depth)
    if state == "unresolved":
        disp = "pending" if verdict == "pending" else "unknown"
        return _Verdict(disp, _family_reason(family), route.name, ex, text, depth)
    # rejected
    if family == "permitted_use":
        return _Verdict("ineligible", _ineligible_reason(predicate, reason), route.name, ex, text, depth)
    if family == "record_adequacy":
        return _Verdict("unknown", "record", route.name, ex, text, depth)
    if family == "target_suitability":
        reval = db.execute("SELECT revalidated FROM assessment_executions WHERE execution_id = ?", (ex,)).fetchone()
        if reval is not None and reval[0] == "fail":
            return _Verdict("ineligible", "transformation", route.name, ex, text, depth)
        score = db.execute("SELECT state FROM execution_scores WHERE execution_id = ?", (ex,)).fetchone()
        if score is not None and score[0] == "excluded":
            return _Verdict("unknown", "target", route.name, ex, text, depth)
        return _Verdict("assessed_not_selected", "target", route.name, ex, text, depth)
    if family == "redundancy" or REDUNDANCY_NAME.search(predicate or ""):
        return _Verdict("assessed_not_selected", "redundancy", route.name, ex, text, depth)
    return _Verdict("assessed_not_selected", family or "process", route.name, ex, text, depth)


def _views(db: sqlite3.Connection) -> dict[str, list[str]]:
    """Parent execution -> its derived views (direct children)."""
    out: dict[str, list[str]] = defaultdict(list)
    if _has(db, "assessment_executions"):
        for child, parent in db.execute("SELECT execution_id, parent_execution_id FROM assessment_executions "
                                        "WHERE parent_execution_id IS NOT NULL ORDER BY execution_id"):
            out[parent].append(child)
    return out


def _with_views(ex: str, views: dict[str, list[str]]) -> list[tuple[str, int]]:
    out, seen, frontier = [(ex, 0)], {ex}, [(ex, 0)]
    while frontier:
        nxt = []
        for e, d in frontier:
            for v in views.get(e, ()):
                if v not in seen:
                    seen.add(v)
                    out.append((v, d + 1))
                    nxt.append((v, d + 1))
        frontier = nxt
    return out


def cohorts(db: sqlite3.Connection) -> dict[str, int]:
    """Every collection run with its number of attempts (derived views and ``None`` runs left out)."""
    if not _has(db, "executions"):
        return {}
    derived = {v for vs in _views(db).values() for v in vs}
    out: dict[str, int] = defaultdict(int)
    for ex, run in db.execute("SELECT execution_id, collection_run_id FROM executions WHERE collection_run_id IS NOT NULL"):
        if ex not in derived:
            out[run] += 1
    return dict(sorted(out.items()))


def _attempt_rows(db: sqlite3.Connection, attempts: list, views: dict, declared: dict, families: dict) -> list[dict]:
    """One row per attempt: its best verdict over every route and every derived view."""
    rows: list[dict] = []
    for ex, task, opened_at, closed_status in attempts:
        cands: list[_Verdict] = []
        for e, depth in _with_views(ex, views):
            for name, route in declared.items():
                row = db.execute("SELECT state, predicate, verdict, missing_evidence, reason FROM admission "
                                 "WHERE route = ? AND execution_id = ?", (name, e)).fetchone() if _has(db, "admission") \
                    else None
                cands.append(_classify(db, route, families[name], e, depth, row))
        if not cands:  # no route at all
            if closed_status is None:
                cands.append(_Verdict("pending", "record", None, ex, "execution still open; no route declared"))
            else:
                cands.append(_Verdict("unknown", "no_route", None, ex, "no admission route declared"))
        best = min(cands, key=_Verdict.key)
        rows.append({"execution_id": ex, "task_id": task, "opened_at_us": opened_at, "disposition": best.disposition,
                     "reason": best.reason, "route": best.route, "record": best.execution_id, "detail": best.detail})
    return rows


def _apply_task_cap(rows: list[dict], per_task_cap: int | None) -> None:
    if per_task_cap is None:
        return
    kept: dict[str, int] = defaultdict(int)
    for r in rows:  # earliest opened first (rows are in that order)
        if r["disposition"] != "emitted":
            continue
        kept[r["task_id"]] += 1
        if kept[r["task_id"]] > per_task_cap:
            r.update(disposition="assessed_not_selected", reason="redundancy",
                     detail=f"per-task cap {per_task_cap}: task {r['task_id']} already emitted {per_task_cap}")


def _disposition_table(rows: list[dict]) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {d: {"attempts": 0, "reasons": {}} for d in DISPOSITIONS}
    for r in rows:
        t = table[r["disposition"]]
        t["attempts"] += 1
        t["reasons"][r["reason"]] = t["reasons"].get(r["reason"], 0) + 1
    for t in table.values():
        t["reasons"] = dict(sorted(t["reasons"].items()))
    return table


def _costs(db: sqlite3.Connection, rows: list[dict], views: dict) -> tuple[dict[str, float], dict[str, float]]:
    """The costs of the attempts and their derived views, by currency and by category."""
    cost_by_currency: dict[str, float] = defaultdict(float)
    cost_by_category: dict[str, float] = defaultdict(float)
    if _has(db, "execution_costs"):
        members = [e for r in rows for e, _ in _with_views(r["execution_id"], views)]
        for i in range(0, len(members), 500):
            chunk = members[i:i + 500]
            for cur, cat, amount in db.execute(
                    f"SELECT COALESCE(currency, 'USD'), COALESCE(category, 'uncategorised'), SUM(amount) FROM execution_costs "
                    f"WHERE execution_id IN ({','.join('?' * len(chunk))}) GROUP BY 1, 2", chunk):
                cost_by_currency[cur] += amount
                cost_by_category[cat] += amount
    return cost_by_currency, cost_by_category


def cohort_dispositions(db: sqlite3.Connection, cohort: str, *, routes: Iterable[str] | None = None,
                        per_task_cap: int | None = None, include_attempts: bool = False) -> dict:
    """The disposition table of ``cohort`` from a projection database (see the module docstring)."""

    if per_task_cap is not None and per_task_cap < 0:
        raise InputError("per_task_cap must be >= 0")
    if not _has(db, "executions"):
        raise KeyError("no executions projected (the tree projection's `executions` table is missing)")
    views = _views(db)
    derived = {v for vs in views.values() for v in vs}
    # derived views copy their parent's row (and collection run): they are not attempts of their own
    attempts = [r for r in db.execute("SELECT execution_id, task_id, opened_at_us, closed_status FROM executions "
                                      "WHERE collection_run_id = ? ORDER BY opened_at_us, execution_id", (cohort,))
                if r[0] not in derived]
    declared = current_routes(db) if _has(db, "routes") else {}
    if routes is not None:
        wanted = list(routes)
        missing = [r for r in wanted if r not in declared]
        if missing:
            raise KeyError(f"route(s) {', '.join(missing)} not declared (at the cutoff)")
        declared = {r: declared[r] for r in wanted}
    families = {name: {p.name: p.family for p in r.predicates} for name, r in declared.items()}
    notes: list[str] = []
    rows = _attempt_rows(db, attempts, views, declared, families)
    _apply_task_cap(rows, per_task_cap)
    if not declared:
        notes.append("no admission route declared: nothing can be emitted")
    table = _disposition_table(rows)
    n = len(rows)
    assert sum(t["attempts"] for t in table.values()) == n  # every attempt exactly once
    # cost: the attempts and their derived views
    cost_by_currency, cost_by_category = _costs(db, rows, views)
    currency = None
    if len(cost_by_currency) > 1:
        notes.append(f"costs in several currencies ({', '.join(sorted(cost_by_currency))}): no single cost per artifact")
        total = None
    else:
        currency = next(iter(cost_by_currency), "USD")
        total = float(cost_by_currency.get(currency, 0.0))
    counts = {d: table[d]["attempts"] for d in DISPOSITIONS}
    eq5 = artifact_cost_from_dispositions(total or 0.0, counts) if n else None
    out = {
        "cohort": cohort,
        "routes": sorted(declared),
        "per_task_cap": per_task_cap,
        "attempts": n,
        "dispositions": table,
        "emitted": counts["emitted"],
        "emission_yield": eq5.emission_yield if eq5 else None,
        "cost": {
            "total": total,
            "currency": currency,
            "by_currency": dict(sorted(cost_by_currency.items())),
            "by_category": dict(sorted(cost_by_category.items())),
            "per_attempt": eq5.cost_per_attempt if (eq5 and total is not None) else None,
            "per_emitted_artifact": eq5.cost_per_artifact if (eq5 and total is not None) else None,
            "loss": total if (total is not None and counts["emitted"] == 0) else None,
        },
        "notes": notes,
    }
    if include_attempts:
        out["attempt_dispositions"] = rows
    return out


def cohort_report(paths: Any, cohort: str, *, cutoff: str | int | None = None, routes: Iterable[str] | None = None,
                  per_task_cap: int | None = None, include_attempts: bool = False, progress: Progress = None,
                  projections_factory: Callable[[], list] | None = None) -> dict:
    """:func:`cohort_dispositions` for a store at ``cutoff`` (RFC 3339 or µs; ``None`` = now).

    With a cutoff the log is replayed into a temporary database through :class:`CutoffFilter`;
    without one the store's projection database is brought up to date and read.
    """

    cutoff_us = None
    if cutoff is not None:
        cutoff_us = cutoff if isinstance(cutoff, int) else timestamp_micros(cutoff)
    trust = Trust.load(paths.trust)

    if projections_factory is None:
        projections_factory = publish_projections
    keystore = store_keystore(paths)  # sealed requests open with the store's data keys
    base_factory = projections_factory
    projections_factory = lambda: with_keystore(base_factory(), keystore)  # noqa: E731
    with open_log(paths.url) as log:
        if cutoff_us is None:

            engine = ReplayEngine(log, connect(paths.db), projections_factory(), trust=trust)
            try:
                engine.run(progress=progress)
                out = cohort_dispositions(engine.db, cohort, routes=routes, per_task_cap=per_task_cap,
                                          include_attempts=include_attempts)
            finally:
                engine.db.close()
        else:
            with tempfile.TemporaryDirectory(prefix="ledger-cutoff-") as tmp:
                db = replay_until(log, Path(tmp) / "cutoff.db", cutoff_us, trust=trust,
                                  projections_factory=projections_factory, progress=progress)
                try:
                    out = cohort_dispositions(db, cohort, routes=routes, per_task_cap=per_task_cap,
                                              include_attempts=include_attempts)
                finally:
                    db.close()
    out["cutoff"] = None if cutoff_us is None else format_micros(cutoff_us)
    return out


# ---------------------------------------------------------------------- text
_LABELS = {"emitted": "Selected and emitted", "assessed_not_selected": "Otherwise assessed but not selected",
           "ineligible": "Ineligible for this use", "pending": "Pending assessment", "unknown": "Unknown at the cutoff"}


def _money(x: float | None, currency: str | None) -> str:
    if x is None:
        return "n/a"
    return f"${x:,.2f}" if (currency or "USD") == "USD" else f"{x:,.2f} {currency}"


def format_cohort(rep: dict) -> str:
    """Table 15 layout: disposition, attempts, share, reasons; then yield and equation 5."""
    n = rep["attempts"]
    lines = [f"cohort {rep['cohort']} at cutoff {rep.get('cutoff') or 'now (live projections)'}; "
             f"routes: {', '.join(rep['routes']) or 'none'}"
             + (f"; per-task cap {rep['per_task_cap']}" if rep.get("per_task_cap") is not None else "")]
    width = max(len(v) for v in _LABELS.values())
    lines.append(f"{'Disposition at the cutoff':<{width}}  {'Attempts':>8}  {'Share':>7}  Reasons")
    for d in DISPOSITIONS:
        t = rep["dispositions"][d]
        share = f"{100 * t['attempts'] / n:6.2f}%" if n else "     -"
        reasons = ", ".join(f"{k} {v}" for k, v in t["reasons"].items())
        lines.append(f"{_LABELS[d]:<{width}}  {t['attempts']:>8}  {share:>7}  {reasons}")
    lines.append(f"{'Total accounted':<{width}}  {n:>8}")
    cost = rep["cost"]
    cur = cost.get("currency")
    y = rep.get("emission_yield")
    lines.append(f"emission yield: {rep['emitted']} / {n} = {100 * y:.2f}%" if y is not None and n else
                 "emission yield: n/a (no attempts)")
    if not cost.get("by_currency", True):  # no cost_recorded event for these attempts: no 0.00 claimed
        lines.append("cohort cost: no cost recorded; cost per emitted artifact: no cost recorded")
    elif cost["per_emitted_artifact"] is not None:
        lines.append(f"cohort cost: {_money(cost['total'], cur)}; per attempt: {_money(cost['per_attempt'], cur)}")
        lines.append(f"cost per emitted artifact (eq. 5): {_money(cost['per_emitted_artifact'], cur)}")
    else:
        lines.append(f"cohort cost: {_money(cost['total'], cur)}; per attempt: {_money(cost['per_attempt'], cur)}")
        if cost.get("loss") is not None:
            lines.append(f"cost per emitted artifact: none emitted; the cohort cost {_money(cost['loss'], cur)} "
                         "is the loss")
    for note in rep.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)

