"""Route accounting aggregated over sets (issue 32: the route and status pages of a 100,000-execution
store) gives exactly what the per-execution implementation gave (kept here as ``reference``).

Stores: the demo's workload (24 generated executions and two real Claude Code sessions, the demo's
governance, one source withdrawn with erase), the ``ledger serve`` benchmark workload (split-rejected
and erased executions over 25 collection runs), and every store the accounting tests of
test_export / test_evidence / test_semantics3 / test_use_specific build (costs per cohort, caps,
lineage families, injected and natural disruptions), checked through a wrapper."""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict

import pytest

from ledger.cli import main
from ledger.corpus import accounting as A
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections import evidence as E

from .helpers import signed_store

pytestmark = pytest.mark.timeout(600)


# ------------------------------------------------------------------ the per-execution reference (before issue 32)
def _subtree_sizes(db: sqlite3.Connection, ex: str, leaves: list[tuple[str, int, str]]) -> dict[str, int]:
    nodes = {nid: (parent, length) for nid, parent, length in db.execute(
        "SELECT node_id, parent, length(tokens) / 4 FROM tree_nodes WHERE execution_id = ?", (ex,))}
    req_node = dict(db.execute("SELECT request_id, node_id FROM tree_requests WHERE execution_id = ?", (ex,)).fetchall())
    seen: set[int] = set()
    out: dict[str, int] = defaultdict(int)
    for leaf, _draw, role in sorted(leaves, key=lambda x: x[1]):
        node = req_node.get(leaf)
        while node is not None and node not in seen:
            seen.add(node)
            parent, length = nodes[node]
            out[role] += length
            node = parent
    return dict(out)


def _behavior(db, r, ex: str) -> str:
    from ledger.projections.admission import selection_for

    if r.use_specific:
        return selection_for(db, ex, r.semantics).role or "unlabelled"
    roles = [row[0] for row in db.execute("SELECT behavioral_role FROM target_selections WHERE execution_id = ? "
                                          "AND behavioral_role IS NOT NULL ORDER BY selection_id", (ex,))]
    return roles[0] if roles else "unlabelled"


def _add_paths(db, route: str, ex: str, b: dict, totals: dict, by_role: dict) -> None:
    st = db.execute("SELECT stored_tokens, expanded_tokens FROM tree_stats WHERE execution_id = ?", (ex,)).fetchone()
    stored, expanded = st if st else (0, 0)
    totals["tree_tokens"] += stored
    totals["processed_tokens"]["naive"] += expanded
    leaves = db.execute("SELECT leaf_request_id, draw_index, role_class, path_tokens, target_tokens FROM admitted_paths "
                        "WHERE route = ? AND execution_id = ?", (route, ex)).fetchall()
    for _lf, _d, role, path_tokens, targets in leaves:
        for row in (by_role.setdefault(role, A.zero()), b):
            row["records"] += 1
            row["processed_tokens_path"] += path_tokens
            row["target_tokens"] += targets
        totals["records"] += 1
        totals["processed_tokens"]["path"] += path_tokens
        totals["target_tokens"] += targets
    for role, n in _subtree_sizes(db, ex, [(lf, d, role) for lf, d, role, _, _ in leaves]).items():
        for row in (by_role.setdefault(role, A.zero()), b):
            row["processed_tokens_tree"] += n
            row["stored_tokens"] += n
        totals["processed_tokens"]["tree"] += n
        totals["stored_tokens"] += n


def reference(db: sqlite3.Connection, route: str) -> dict:
    """The accounting as computed before issue 32: about nine queries per execution."""
    from ledger.projections.admission import route_definition
    from ledger.projections.evidence import emitted_executions, execution_disruptions

    r = route_definition(db, route)
    by_role: dict = {}
    by_behavior: dict = {}
    totals = {"records": 0, "dummies": 0, "executions": 0, "stored_tokens": 0, "tree_tokens": 0, "target_tokens": 0,
              "processed_tokens": {"path": 0, "tree": 0, "naive": 0}}
    dispositions = A.empty_dispositions(r)
    cost = {"cohort": 0.0, "emitted": 0, "cohorts": {}}
    for ex, state, predicate, verdict, missing, reason in db.execute(
            "SELECT execution_id, state, predicate, verdict, missing_evidence, reason FROM admission WHERE route = ? "
            "ORDER BY execution_id", (route,)).fetchall():
        amount = db.execute("SELECT COALESCE(SUM(amount), 0) FROM execution_costs WHERE execution_id = ?", (ex,)).fetchone()[0]
        cost["cohort"] += amount
        co = cost["cohorts"].setdefault(A.cohort_of(db, ex), {"attempts": 0, "emitted": 0, "cost": 0.0})
        co["attempts"] += 1
        co["cost"] += amount
        if state not in ("admitted", "dummy"):
            bucket, key = A.disposition(r, state, predicate, verdict, missing, reason)
            dispositions[bucket][key] = dispositions[bucket].get(key, 0) + 1
            continue
        dispositions["emitted"] += 1
        cost["emitted"] += 1
        co["emitted"] += 1
        totals["executions"] += 1
        b = by_behavior.setdefault(_behavior(db, r, ex), A.zero())
        if state == "dummy":
            totals["records"] += 1
            totals["dummies"] += 1
            b["records"] += 1
            continue
        _add_paths(db, route, ex, b, totals, by_role)
    doc = A.document(db, route, r, (totals, by_role, by_behavior), dispositions, cost)
    if "disruptions" in doc:  # every emitted execution read one by one
        by, tot = {}, {"injected": 0, "natural": 0}
        for ex in emitted_executions(db, route):
            execution_disruptions(db, ex, by, tot)
        doc["disruptions"] = {**tot, "by_role_class": dict(sorted(by.items()))}
    return doc


def reference_tasks(db: sqlite3.Connection, route: str) -> set[str]:
    """The tasks of the route's emitted executions as probe_evidence found them before: one execution at a time."""
    from ledger.projections.evidence import _task_of, emitted_executions

    return {t for t in (_task_of(db, ex) for ex in emitted_executions(db, route)) if t is not None}


def _routes(db) -> list[str]:
    from ledger.projections.admission import current_routes

    return sorted(current_routes(db))


def assert_same(db: sqlite3.Connection) -> int:
    """Every route's aggregated accounting equals the reference, to the byte of its JSON; returns the routes."""
    routes = _routes(db)
    for name in routes:
        got, want = A.accounting(db, name), reference(db, name)
        assert json.dumps(got, sort_keys=False) == json.dumps(want, sort_keys=False), name
        assert E.emitted_tasks(db, name) == reference_tasks(db, name), name
    return len(routes)


# ------------------------------------------------------------------ stores
def _ingest(paths, signer, lines: list[dict]) -> None:
    with open_log(paths.url) as log:
        rep = Ingestor(log, signer.trust).ingest_lines(enumerate(lines, 1))
    assert not rep.conflicts and rep.appended == len(lines), rep


def test_demo_store(tmp_path, monkeypatch):
    from examples import demo
    from ledger.projections.engine import connect

    monkeypatch.setattr(demo, "OUT", tmp_path)
    signer, paths, _key = signed_store(tmp_path)
    events = [json.loads(line) for line in open(demo.executions_file(), encoding="utf-8")]
    gov = [json.loads(line) for line in open(demo.governance_file(), encoding="utf-8")]
    _ingest(paths, signer, events + [signer.sign(g) for g in gov])
    assert main(["--store", paths.url, "project"]) == 0
    with connect(paths.db) as db:
        assert assert_same(db) == 1
    _ingest(paths, signer, [signer.sign({"type": "withdrawal", "subject": "source:internal-bugbash",
                                         "reason": "provider revoked consent", "authority": "legal", "erase": True})])
    assert main(["--store", paths.url, "project"]) == 0
    with connect(paths.db) as db:
        erased = db.execute("SELECT COUNT(DISTINCT execution_id) FROM withdrawn_executions WHERE erase = 1").fetchone()[0]
        states = dict(db.execute("SELECT state, COUNT(*) FROM admission GROUP BY state").fetchall())
        assert erased > 0 and states.get("rejected", 0) > 0 and states.get("admitted", 0) > 0, (erased, states)
        assert assert_same(db) == 1


def test_serve_benchmark_workload_with_erased_and_rejected_executions(tmp_path):
    from benchmarks.bench_serve import build
    from ledger.projections.engine import connect

    paths = build(400, tmp_path)
    with connect(paths.db) as db:
        states = dict(db.execute("SELECT state, COUNT(*) FROM admission GROUP BY state").fetchall())
        erased = db.execute("SELECT COUNT(DISTINCT execution_id) FROM withdrawn_executions WHERE erase = 1").fetchone()[0]
        assert erased == 52 and states["rejected"] > 0 and states["admitted"] > 0, (erased, states)
        acc = A.accounting(db, "rl")
        assert len(acc["cohorts"]) == 25 and acc["attempts"] == 400
        assert assert_same(db) == 1


def _wrapped(monkeypatch) -> list[str]:
    """Every accounting() call of the tests run below is checked against the reference."""
    import ledger.corpus.export as X

    from . import test_export

    seen: list[str] = []
    real, real_tasks = A.accounting, E.emitted_tasks

    def checked(db, route):
        got = real(db, route)
        assert json.dumps(got) == json.dumps(reference(db, route)), route
        seen.append(route)
        return got

    def checked_tasks(db, route):
        got = real_tasks(db, route)
        assert got == reference_tasks(db, route), route
        seen.append(f"tasks of {route}")
        return got

    for mod in (A, X, test_export):
        monkeypatch.setattr(mod, "accounting", checked)
    monkeypatch.setattr(E, "emitted_tasks", checked_tasks)
    return seen


@pytest.mark.parametrize("case", ["test_export:test_accounting_exact",
                                  "test_export:test_accounting_with_a_cap_stores_only_the_admitted_subtree",
                                  "test_export:test_unresolved_and_rejected_executions_export_nothing",
                                  "test_export:test_cost_per_emitted_artifact_per_cohort",
                                  "test_evidence:test_accounting_separates_injected_from_natural_disruptions_and_the_datasheet_reports_coverage",
                                  "test_evidence:test_napkin_math_15_1_only_the_300_residual_failures_reach_the_corpus",
                                  "test_evidence:test_capability_gap_manifest_lists_the_probe_evidence_per_task",
                                  "test_semantics3:test_one_member_per_lineage_family",
                                  "test_use_specific:test_per_task_cap_keeps_the_lowest_keyed_hashes_and_counts_redundancy"])
def test_the_accounting_tests_stores(case, tmp_path, monkeypatch, request):
    import importlib

    module, name = case.split(":")
    mod = importlib.import_module(f"tests.{module}")
    fn = getattr(mod, name)
    marks = [*(lambda m: m if isinstance(m, list) else [m])(getattr(mod, "pytestmark", [])), *getattr(fn, "pytestmark", [])]
    if any(m.name == "usefixtures" and "earlier_release" in m.args for m in marks):
        request.getfixturevalue("earlier_release")  # the test's store is on an earlier release's rules
    seen = _wrapped(monkeypatch)
    fn(tmp_path)
    assert seen
