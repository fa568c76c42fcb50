"""Self-improvement loop telemetry (seed 002 §15.7; `ledger telemetry`).

Per **fixture** and **round**, from the projection database:

* **fixture** = ``task_registered.fixture`` of the execution's task (the task id when the
  task was registered without one, or never registered);
* **round** = the ``round`` key of ``execution_opened.metadata`` when present, else the
  execution's ``collection_run_id`` (else ``"-"``).  Rounds are ordered by the number in
  the ``round`` key when every round is numeric, else by their first ``execution_opened``
  time (then name).

Signals (training executions only, i.e. tasks whose split is not held out; held-out =
``dev`` / ``final_test`` by default):

* **distinct normalised action sequences**: per execution, the tool names of its cached
  tool *calls* (``tool_payload`` kind ``call``; the name is the payload's
  ``tool``/``name``/``type``/``action`` key) in request order (the order of the requests
  that emitted the call ids, then the position in ``emitted_tool_call_ids``; calls no
  request emitted come last by call id), normalised with
  :func:`ledger.algorithms.economics.normalise_action_sequence`;
* **pass@1 and pass@k** from the execution scores (pass = scored reward >= ``threshold``,
  default 1.0; the unbiased estimator of :func:`ledger.algorithms.economics.pass_at_k`; ``k``
  defaults to the cell's number of scored attempts, i.e. "any success");
* the **informative-task fraction** ``1 - (1-p)^k - p^k`` (equation 3) with ``p`` the
  cell's pass rate, next to the observed share of fixtures with mixed outcomes;
* **retention**: executions admitted on some route per fixture and round, against an
  optional per-fixture cap (``retention_cap``: fixtures over it are flagged);
* **anchors**: the share of retained (and of attempted) executions whose
  ``execution_opened.origin`` is an external anchor (``human`` / ``production``) vs
  self-generated (``synthetic``) or unspecified.

Per round: the mean distinct sequences per fixture, mean pass@1 / pass@k, training
acceptance (retained / attempted) and the **held-out score** (pass rate of the round's
held-out executions).  :func:`ledger.algorithms.economics.coverage_narrowing_warnings` then warns when
diversity falls while held-out scores stay flat (and on the pass@1-up/pass@k-flat and
acceptance-up/held-out-flat rules); rounds without held-out scores are left out of the
comparison and named in ``notes``.
"""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from typing import Any, Iterable

from ledger.algorithms.errors import InputError
from ledger.algorithms.economics import (
    RoundTelemetry,
    coverage_narrowing_warnings,
    informative_task_fraction,
    mean_distinct_per_fixture,
    normalise_action_sequence,
    pass_at_k,
)
from ledger.projections.splits import execution_split

__all__ = ["loop_telemetry", "format_telemetry", "EXTERNAL_ORIGINS"]

EXTERNAL_ORIGINS = ("human", "production")


def _has(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone() is not None


def _fixtures(db: sqlite3.Connection) -> dict[str, str]:
    for sql in ("SELECT task_id, fixture FROM tasks WHERE fixture IS NOT NULL",
                "SELECT task_id, fixture FROM split_registrations WHERE fixture IS NOT NULL ORDER BY event_id"):
        try:
            return {t: f for t, f in db.execute(sql)}
        except sqlite3.OperationalError:
            continue
    return {}


def _round_of(metadata: str | None, run: str | None) -> str:
    if metadata:
        try:
            meta = json.loads(metadata)
        except ValueError:
            meta = None
        if isinstance(meta, dict) and meta.get("round") is not None:
            return str(meta["round"])
    return run if run is not None else "-"


def _action_sequences(db: sqlite3.Connection, executions: set[str]) -> dict[str, list[Any]]:
    """Execution -> its tool-call payloads in request order."""
    if not (_has(db, "tool_payloads") and _has(db, "tree_requests")):
        return {}
    order: dict[tuple[str, str], tuple] = {}
    for ex, seq, emitted in db.execute("SELECT execution_id, seq, emitted_tool_call_ids FROM tree_requests"):
        if ex not in executions:
            continue
        try:
            ids = json.loads(emitted) if emitted else []
        except ValueError:
            ids = []
        for pos, call in enumerate(ids):
            order.setdefault((ex, call), (0, seq, pos, call))
    out: dict[str, list[tuple[tuple, Any]]] = defaultdict(list)
    for ex, call, payload in db.execute("SELECT execution_id, call_id, payload FROM tool_payloads WHERE kind = 'call'"):
        if ex not in executions:
            continue
        try:
            value = json.loads(payload)
        except ValueError:
            value = payload
        out[ex].append((order.get((ex, call), (1, 0, 0, call)), value))
    return {ex: [v for _, v in sorted(items, key=lambda kv: kv[0])] for ex, items in out.items()}


def _split(db: sqlite3.Connection):
    return lambda ex: execution_split(db, ex)[0]


def _tally(db: sqlite3.Connection, rows: list, held_out: set[str], threshold: float, include_args: bool,
           collapse_repeats: bool) -> tuple[dict, dict, dict, dict]:
    """One pass over the executions: per (fixture, round) cell, the held-out outcomes per round, the
    anchors (origin kinds) per round and the first time each round was seen."""
    fixtures = _fixtures(db)
    split_of = _split(db)
    scores: dict[str, tuple[str, float | None]] = {}
    if _has(db, "execution_scores"):
        scores = {ex: (st, r) for ex, st, r in db.execute("SELECT execution_id, state, reward FROM execution_scores")}
    retained: set[str] = set()
    if _has(db, "admission"):
        retained = {r[0] for r in db.execute("SELECT DISTINCT execution_id FROM admission WHERE state = 'admitted'")}
    seqs = _action_sequences(db, {r[0] for r in rows})
    first_seen: dict[str, int] = {}
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    held: dict[str, list[bool]] = defaultdict(list)
    rounds_origin: dict[str, dict[str, dict[str, int]]] = defaultdict(lambda: {"attempted": defaultdict(int),
                                                                                "retained": defaultdict(int)})
    for ex, task, origin, run, meta, opened in rows:
        rnd = _round_of(meta, run)
        first_seen[rnd] = min(first_seen.get(rnd, opened), opened)
        state, reward = scores.get(ex, ("pending", None))
        passed = None if state != "scored" or reward is None else reward >= threshold
        if split_of(ex) in held_out:
            if passed is not None:
                held[rnd].append(passed)
            continue
        fixture = fixtures.get(task, task)
        c = cells.setdefault((fixture, rnd), {"fixture": fixture, "round": rnd, "attempts": 0, "scored": 0, "passed": 0,
                                              "retained": 0, "sequences": set(), "with_actions": 0})
        c["attempts"] += 1
        if passed is not None:
            c["scored"] += 1
            c["passed"] += int(passed)
        if ex in retained:
            c["retained"] += 1
        actions = seqs.get(ex, [])
        if actions:
            c["with_actions"] += 1
        c["sequences"].add(normalise_action_sequence(actions, include_args=include_args,
                                                     collapse_repeats=collapse_repeats))
        kind = "external" if origin in EXTERNAL_ORIGINS else ("self_generated" if origin == "synthetic" else "unspecified")
        rounds_origin[rnd]["attempted"][kind] += 1
        if ex in retained:
            rounds_origin[rnd]["retained"][kind] += 1
    return cells, held, rounds_origin, first_seen


def _fixture_rows(cells: dict, index: dict[str, int], k: int | None, retention_cap: int | None) -> list[dict]:
    fixture_rows = []
    for (fixture, rnd), c in sorted(cells.items(), key=lambda kv: (kv[0][0], index[kv[0][1]])):
        n, npass = c["scored"], c["passed"]
        p = npass / n if n else None
        kk = None if not n else (min(k, n) if k is not None else n)
        fixture_rows.append({
            "fixture": fixture, "round": rnd, "attempts": c["attempts"], "scored": n, "passed": npass,
            "pass_at_1": p, "k": kk, "pass_at_k": pass_at_k(n, npass, kk) if n else None,
            "informative_expected": informative_task_fraction(p, kk) if n else None,
            "mixed_outcomes": (0 < npass < n) if n else None,
            "distinct_sequences": len(c["sequences"]), "with_actions": c["with_actions"],
            "retained": c["retained"],
            "over_cap": (c["retained"] > retention_cap) if retention_cap is not None else None,
        })
    return fixture_rows


def _round_rows(order: list[str], index: dict[str, int], fixture_rows: list[dict], held: dict,
                rounds_origin: dict) -> list[dict]:
    round_rows = []
    for rnd in order:
        mine = [r for r in fixture_rows if r["round"] == rnd]
        scored = [r for r in mine if r["scored"]]
        attempts = sum(r["attempts"] for r in mine)
        kept = sum(r["retained"] for r in mine)
        ho = held.get(rnd, [])
        origin = rounds_origin.get(rnd, {"attempted": {}, "retained": {}})
        shares = {}
        for what in ("attempted", "retained"):
            counts = dict(origin[what])
            total = sum(counts.values())
            shares[what] = {kind: (counts.get(kind, 0) / total if total else None)
                            for kind in ("external", "self_generated", "unspecified")}
            shares[what]["count"] = total
        mixed = [r["mixed_outcomes"] for r in scored]
        round_rows.append({
            "round": rnd, "index": index[rnd], "fixtures": len(mine), "attempts": attempts, "retained": kept,
            "distinct_sequences": mean_distinct_per_fixture({r["fixture"]: r["distinct_sequences"] for r in mine}),
            "pass_at_1": _mean(r["pass_at_1"] for r in scored), "pass_at_k": _mean(r["pass_at_k"] for r in scored),
            "informative_expected": _mean(r["informative_expected"] for r in scored),
            "informative_observed": (sum(mixed) / len(mixed)) if mixed else None,
            "train_acceptance": kept / attempts if attempts else None,
            "held_out_score": (sum(ho) / len(ho)) if ho else None, "held_out_scored": len(ho),
            "anchors": shares,
            "fixtures_over_cap": sorted(r["fixture"] for r in mine if r["over_cap"]),
        })
    return round_rows


def loop_telemetry(db: sqlite3.Connection, *, threshold: float = 1.0, k: int | None = None,
                   retention_cap: int | None = None, held_out_splits: Iterable[str] = ("dev", "final_test"),
                   include_args: bool = False, collapse_repeats: bool = False, min_diversity_drop: float = 0.10,
                   flat_tolerance: float = 0.01) -> dict:
    """Compute the §15.7 telemetry of every fixture and round (see the module docstring)."""
    if k is not None and k < 1:
        raise InputError("k must be >= 1")
    held_out = set(held_out_splits)
    notes: list[str] = []
    if not _has(db, "executions"):
        return {"rounds": [], "fixtures": [], "warnings": [], "notes": ["no executions projected"],
                "threshold": threshold, "k": k, "retention_cap": retention_cap}
    rows = db.execute("SELECT execution_id, task_id, origin, collection_run_id, metadata, opened_at_us FROM executions "
                      "ORDER BY opened_at_us, execution_id").fetchall()
    cells, held, rounds_origin, first_seen = _tally(db, rows, held_out, threshold, include_args, collapse_repeats)
    names = sorted(set(first_seen))
    numeric = all(_is_number(r) for r in names)
    order = sorted(names, key=(lambda r: (float(r), r)) if numeric else (lambda r: (first_seen[r], r)))
    index = {r: i for i, r in enumerate(order)}
    fixture_rows = _fixture_rows(cells, index, k, retention_cap)
    if k is not None and any(r["k"] is not None and r["k"] < k for r in fixture_rows):
        notes.append(f"some cells have fewer than k={k} scored attempts: pass@k uses k = their count there")
    round_rows = _round_rows(order, index, fixture_rows, held, rounds_origin)
    comparable = [r for r in round_rows if r["held_out_score"] is not None]
    missing = [r["round"] for r in round_rows if r["held_out_score"] is None]
    if missing:
        notes.append(f"no held-out scores in round(s) {', '.join(missing)}: left out of the narrowing comparison")
    warnings = coverage_narrowing_warnings(
        [RoundTelemetry(r["index"], r["distinct_sequences"], r["held_out_score"], r["pass_at_1"], r["pass_at_k"],
                        r["train_acceptance"]) for r in comparable],
        min_diversity_drop=min_diversity_drop, flat_tolerance=flat_tolerance)
    return {
        "threshold": threshold, "k": k, "retention_cap": retention_cap, "held_out_splits": sorted(held_out),
        "rounds": round_rows, "fixtures": fixture_rows,
        "warnings": [{"rule": w.rule, "round": order[w.round], "since_round": order[w.since_round], "detail": w.detail}
                     for w in warnings],
        "notes": notes,
    }


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def format_telemetry(rep: dict) -> str:
    lines = [f"loop telemetry (pass = reward >= {rep['threshold']:g}; k = {rep['k'] or 'scored attempts per cell'}"
             + (f"; retention cap {rep['retention_cap']}/fixture" if rep.get("retention_cap") is not None else "") + ")"]
    if not rep["rounds"]:
        lines.append("no data: no executions")
    else:
        lines.append(f"{'round':<16} {'fixtures':>8} {'attempts':>8} {'distinct':>8} {'pass@1':>7} {'pass@k':>7} "
                     f"{'inform.':>7} {'accept':>7} {'held-out':>8} {'external':>8}")
        for r in rep["rounds"]:
            lines.append(f"{r['round']:<16} {r['fixtures']:>8} {r['attempts']:>8} {r['distinct_sequences']:>8.2f} "
                         f"{_pct(r['pass_at_1']):>7} {_pct(r['pass_at_k']):>7} {_pct(r['informative_expected']):>7} "
                         f"{_pct(r['train_acceptance']):>7} {_pct(r['held_out_score']):>8} "
                         f"{_pct(r['anchors']['retained']['external']):>8}")
            if r["fixtures_over_cap"]:
                lines.append(f"  over the retention cap: {', '.join(r['fixtures_over_cap'])}")
        lines.append("")
        lines.append(f"{'fixture':<20} {'round':<12} {'n':>4} {'pass':>4} {'pass@1':>7} {'pass@k':>7} {'k':>3} "
                     f"{'distinct':>8} {'kept':>5}")
        for f in rep["fixtures"]:
            lines.append(f"{f['fixture']:<20} {f['round']:<12} {f['scored']:>4} {f['passed']:>4} {_pct(f['pass_at_1']):>7} "
                         f"{_pct(f['pass_at_k']):>7} {f['k'] or '-':>3} {f['distinct_sequences']:>8} {f['retained']:>5}"
                         + (" OVER CAP" if f["over_cap"] else ""))
    for w in rep["warnings"]:
        lines.append(f"WARNING {w['rule']} (round {w['round']} vs {w['since_round']}): {w['detail']}")
    for n in rep["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)
