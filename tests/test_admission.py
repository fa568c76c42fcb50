"""Admission: routes, the five predicate families, targets and determinism (SPEC §6.5)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ledger.projections.engine as engine_mod
from ledger.algorithms.cascade_plan import format_plan
from ledger.algorithms.path_draws import path_nodes
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections.admission import (
    AdmissionProjection,
    Evidence,
    cascade_plan,
    current_routes,
    effective_predicates,
    execution_view,
    measured_predicates,
)
from ledger.projections.assessment import AssessmentProjection
from ledger.projections.engine import ReplayEngine, canonical_dump, connect
from ledger.projections.tree import TreeProjection, tree_view
from tests.helpers import Signer, closed, request
from tests.helpers import opened as _opened

pytestmark = pytest.mark.usefixtures("earlier_release")  # routes of the first release's rules (SPEC §10)

DEADLINE = "2099-01-01T00:00:00Z"
AFTER = "2099-01-01T00:00:01Z"
STAMP = "2098-06-01T00:00:00Z"
SIGNER = Signer()


def opened(ex: str, task: str = "t1", **kw) -> dict:
    return _opened(ex, task, **{"deadline": DEADLINE, **kw})


def scored(ex: str, reward: float = 1.0, aid: str = "a1", **kw) -> dict:
    return {"type": "assessment", "assessment_id": aid, "execution_id": ex, "artifact_version": "v1",
            "outcome": "scored", "reward": reward, "evaluator": "grader@1", **kw}


def not_assessable(ex: str, aid: str = "a1") -> dict:
    return {"type": "assessment", "assessment_id": aid, "execution_id": ex, "artifact_version": "v1",
            "outcome": "not_assessable", "evaluator": "grader@1"}


def route(name: str = "sft", version: int = 1, *, use: str = "sft", split: str = "train", j_max: int = 8,
          predicates=None, semantics: int | None = 1, **kw) -> dict:
    """A signed route.  The tests of this file are the SPEC §6.5 rules, which routes of semantics 1
    keep forever (SPEC §10); ``semantics=None`` lets ingest stamp the current version (the §6.8
    rules, tests/test_use_specific.py)."""
    line = {"type": "admission_policy", "route": name, "version": version, "use": use, "split": split, "j_max": j_max,
            "occurred_at": STAMP, **kw}
    if semantics is not None:
        line["semantics"] = semantics
    if predicates is not None:
        line["predicates"] = predicates
    return SIGNER.sign(line)


def verdict(ex: str, pred: str, v: str, *, route_name: str = "sft", slot: float | None = None, verifier: str = "v@1",
            **kw) -> dict:
    line = {"type": "predicate_evaluated", "execution_id": ex, "route": route_name, "predicate": pred, "verdict": v,
            "verifier": verifier, **kw}
    if slot is not None:
        line["slot_seconds"] = slot
    return line


def tree_execution(ex: str = "e1", task: str = "t1") -> list[dict]:
    """A tree with three leaves of three role classes (see module notes in the tests).

    A = [1,2,3 | 4,5]            r1 main/task   (candidates 4,5)
    B = A + [6 | 7,8]            r2 main/task   (candidates 7,8)
    C = A + [9 | 10]             r3 sub/task    (candidate 10)       leaf
    D = B + [11 | 12,13]         s1 main/summary (candidates 12,13)  leaf
    E = B + [14 | 15,16,17]      r4 main/task   (candidates 15,16,17) leaf
    """
    return [opened(ex, task),
            request(ex, "r1", [1, 2, 3], [4, 5]),
            request(ex, "r2", [1, 2, 3, 4, 5, 6], [7, 8]),
            request(ex, "r3", [1, 2, 3, 4, 5, 9], [10], agent_id="helper", agent_tier="sub"),
            request(ex, "s1", [1, 2, 3, 4, 5, 6, 7, 8, 11], [12, 13], turn_kind="summary"),
            request(ex, "r4", [1, 2, 3, 4, 5, 6, 7, 8, 14], [15, 16, 17]),
            closed(ex)]


def simple(ex: str, task: str = "t1") -> list[dict]:
    return [opened(ex, task), request(ex, "r1", [1, 2], [3, 4]), closed(ex)]


def fake_evidence(split: str = "train", *, quarantined=(), withdrawn=(), denied=(), splits=None) -> Evidence:
    splits = splits or {}
    return Evidence(
        split=lambda db, ex: (splits.get(ex, split), f"g-{ex}", ex in quarantined),
        permitted=lambda db, ex, use: ("fail", f"no grant for {use}") if ex in denied else ("pass", "granted"),
        withdrawn=lambda db, ex: ex in withdrawn,
    )


def project(tmp_path, lines, evidence: Evidence | None = None, *, name: str = "s", extra=()):
    log = open_log(str(tmp_path / name), create=True)
    # unsealed: stores compared table by table must not differ in their random data-key ids
    Ingestor(log, SIGNER.trust, seal=None).ingest_lines(enumerate(lines, 1))
    db = connect(tmp_path / f"{name}.db")
    projs = [TreeProjection(), AssessmentProjection(), *extra,
             AdmissionProjection(fake_evidence() if evidence is None else evidence)]
    ReplayEngine(log, db, projs, trust=SIGNER.trust).run()
    return db


def adm(db, ex, r="sft"):
    return db.execute("SELECT state, predicate, verdict, missing_evidence, reason, reward, target_tokens, paths FROM admission "
                      "WHERE route = ? AND execution_id = ?", (r, ex)).fetchone()


def paths(db, ex, r="sft"):
    out = []
    for leaf, draw, role, n_path, n_t, reward, blob in db.execute(
            "SELECT leaf_request_id, draw_index, role_class, path_tokens, target_tokens, reward, targets FROM admitted_paths "
            "WHERE route = ? AND execution_id = ? ORDER BY draw_index", (r, ex)):
        out.append((draw, leaf, role, n_path, n_t, reward, np.frombuffer(blob, dtype="<u4").tolist()))
    return out


def telemetry(db, r="sft"):
    row = db.execute("SELECT evaluated, admitted, dummy, rejected, unresolved, rejected_by, unresolved_by FROM route_telemetry "
                     "WHERE route = ?", (r,)).fetchone()
    return row[:5] + (json.loads(row[5]), json.loads(row[6]))


# ============================================================================ routes


def test_route_versions_are_kept_and_the_latest_wins(tmp_path):
    lines = simple("e1") + [scored("e1"), route(version=2, j_max=1, split="dev"), route(version=1, j_max=5)]
    db = project(tmp_path, lines, fake_evidence(split="dev"))
    assert db.execute("SELECT route, version, split, j_max FROM routes ORDER BY version").fetchall() == [
        ("sft", 1, "train", 5), ("sft", 2, "dev", 1)]
    assert current_routes(db)["sft"].version == 2
    assert db.execute("SELECT route_version, state FROM admission").fetchall() == [(2, "admitted")]


def test_ledger_computed_families_are_mandatory():
    assert [p["name"] for p in effective_predicates(None)] == ["record_adequacy", "permitted_use", "target_suitability"]
    declared = [{"name": "diff_audit", "family": "process", "depends_on": []},
                {"name": "tests", "family": "outcome", "depends_on": ["diff_audit"]}]
    assert [(p["name"], p["family"]) for p in effective_predicates(declared)] == [
        ("record_adequacy", "record_adequacy"), ("permitted_use", "permitted_use"), ("diff_audit", "process"),
        ("tests", "outcome"), ("target_suitability", "target_suitability")]
    own = [{"name": "use", "family": "permitted_use", "depends_on": []},
           {"name": "targets", "family": "target_suitability", "depends_on": []},
           {"name": "rec", "family": "record_adequacy", "depends_on": []}]
    assert [p["name"] for p in effective_predicates(own)] == ["use", "targets", "rec"]


# ============================================================================ record adequacy


def test_record_adequacy(tmp_path):
    lines = [opened("open"), request("open", "r1", [1], [2]),
             opened("gap"), request("gap", "r1", [1], [2], emitted_tool_call_ids=["c1", "c2"]),
             {"type": "tool_payload", "execution_id": "gap", "call_id": "c1", "kind": "result", "payload": "ok"},
             {"type": "tool_payload", "execution_id": "gap", "call_id": "c2", "kind": "call", "payload": {"x": 1}},
             request("gap", "r2", [1, 2, 5], [6], consumed_tool_call_ids=["c1", "c2"]), closed("gap"), scored("gap"),
             opened("recon"), request("recon", "r1", [1], [2, 3], reconstructed=True, output_logprobs=None),
             request("recon", "r2", [1, 2, 3, 4], [5]), closed("recon"), scored("recon"),
             opened("late"), request("late", "r1", [1], [2]), {"type": "execution_finalized", "execution_id": "late"}]
    db = project(tmp_path, lines + [route()])
    assert adm(db, "open") == ("unresolved", "record_adequacy", "pending", "execution_closed", "execution not closed",
                               None, 0, 0)
    assert adm(db, "gap") == ("rejected", "record_adequacy", "fail", None,
                              "capture gap: consumed tool call without a cached result: c2", 1.0, 0, 0)
    # a reconstructed policy output has no log-probs and is no gap (it is never a target)
    assert adm(db, "recon") == ("admitted", None, "pass", None, "admitted", 1.0, 1, 1)
    assert adm(db, "late") == ("rejected", "record_adequacy", "fail", None, "never closed within its time budget", None, 0, 0)


# ============================================================================ permitted use


def test_missing_split_map_or_permissions_is_unknown_never_a_pass(tmp_path):
    lines = simple("e1") + [scored("e1"), route()]
    db = project(tmp_path, lines, Evidence())
    assert adm(db, "e1")[:4] == ("unresolved", "permitted_use", "unknown", "split map")
    db2 = project(tmp_path, lines, Evidence(split=lambda db, ex: ("train", "g", False)), name="noperm")
    assert adm(db2, "e1")[:4] == ("unresolved", "permitted_use", "unknown", "permissions")


def test_permitted_use_checks(tmp_path):
    lines = []
    for ex in ("ok", "withdrawn", "dev", "quarantined", "denied"):
        lines += simple(ex) + [scored(ex)]
    ev = fake_evidence(withdrawn={"withdrawn"}, quarantined={"quarantined"}, denied={"denied"}, splits={"dev": "dev"})
    db = project(tmp_path, lines + [route()], ev)
    assert adm(db, "ok")[:4] == ("admitted", None, "pass", None)
    assert adm(db, "withdrawn")[:5] == ("rejected", "permitted_use", "fail", None, "withdrawn")
    assert adm(db, "dev")[:5] == ("rejected", "permitted_use", "fail", None, "split dev is not the route's split train")
    assert adm(db, "quarantined")[:5] == ("unresolved", "permitted_use", "pending", "quarantine review",
                                          "task group g-quarantined is quarantined")
    assert adm(db, "denied")[:5] == ("rejected", "permitted_use", "fail", None, "no grant for sft")


@pytest.mark.parametrize("targeted", [False, True])
def test_permissions_and_withdrawals_from_the_governance_projection(tmp_path, monkeypatch, targeted):
    gov = pytest.importorskip("ledger.projections.governance")
    monkeypatch.setattr(engine_mod, "BATCH", 2)  # governance events land in later batches than the executions
    ev = Evidence(split=lambda db, ex: ("train", "g", False), permitted=gov.permitted, withdrawn=gov.withdrawn)
    if targeted:  # recompute only what a subject covers (as Evidence.discover() sets it up)
        ev.covered = lambda db, subject: [x for part in gov.covered_executions(db, subject) for x in part]
    lines = simple("e1", "t1") + [scored("e1")] + simple("e2", "t2") + [scored("e2")] + [route()]
    grant = SIGNER.sign({"type": "permission", "subject": "*", "use": "sft", "action": "grant", "authority": "legal"})
    withdraw = SIGNER.sign({"type": "withdrawal", "subject": "task:t2", "reason": "consent revoked", "authority": "legal"})
    db = project(tmp_path, lines, ev, extra=[gov.GovernanceProjection()])
    assert adm(db, "e1")[:3] == ("rejected", "permitted_use", "fail")  # deny by default
    db2 = project(tmp_path, lines + [grant], ev, extra=[gov.GovernanceProjection()], name="grant")
    assert [adm(db2, e)[0] for e in ("e1", "e2")] == ["admitted", "admitted"]
    db3 = project(tmp_path, lines + [grant, withdraw], ev, extra=[gov.GovernanceProjection()], name="withdraw")
    assert adm(db3, "e1")[0] == "admitted"
    assert adm(db3, "e2")[:5] == ("rejected", "permitted_use", "fail", None, "withdrawn")
    # the governance event landing after the executions recomputes everything
    db4 = project(tmp_path, [grant, withdraw] + lines, ev, extra=[gov.GovernanceProjection()], name="early")
    assert [adm(db4, e)[0] for e in ("e1", "e2")] == ["admitted", "rejected"]
    # a task-scoped revocation reaches only that task's executions
    revoke = SIGNER.sign({"type": "permission", "subject": "task:t1", "use": "sft", "action": "revoke", "authority": "legal"})
    db5 = project(tmp_path, lines + [grant, revoke], ev, extra=[gov.GovernanceProjection()], name="revoke")
    assert [adm(db5, e)[:3] for e in ("e1", "e2")] == [("rejected", "permitted_use", "fail"), ("admitted", None, "pass")]


# ============================================================================ process / outcome


def test_external_predicates_latest_verdict_and_short_circuit(tmp_path):
    preds = [{"name": "diff_audit", "family": "process"}, {"name": "tests", "family": "outcome"}]
    lines = []
    for ex in ("none", "pass", "flip", "unflip", "unknown", "procfail"):
        lines += simple(ex) + [scored(ex)]
    lines += [verdict("pass", "diff_audit", "pass"), verdict("pass", "tests", "pass"),
              verdict("flip", "diff_audit", "pass"), verdict("flip", "tests", "pass"), verdict("flip", "tests", "fail"),
              verdict("unflip", "diff_audit", "pass"), verdict("unflip", "tests", "fail", verifier="v@1"),
              verdict("unflip", "tests", "pass", verifier="v@2"),
              verdict("unknown", "diff_audit", "pass"), verdict("unknown", "tests", "unknown", evidence="sandbox timed out"),
              verdict("procfail", "diff_audit", "fail"), verdict("procfail", "tests", "pass")]
    db = project(tmp_path, lines + [route(predicates=preds)])
    assert adm(db, "none")[:4] == ("unresolved", "diff_audit", "pending", "PredicateEvaluated diff_audit")
    assert adm(db, "pass")[:2] == ("admitted", None)
    assert adm(db, "flip")[:5] == ("rejected", "tests", "fail", None, "fail by v@1")
    assert adm(db, "unflip")[:2] == ("admitted", None)
    assert adm(db, "unknown")[:5] == ("unresolved", "tests", "unknown", "tests evidence from v@1",
                                      'unknown by v@1 ("sandbox timed out")')
    assert adm(db, "procfail")[:3] == ("rejected", "diff_audit", "fail")  # stops at the first non-pass
    assert telemetry(db) == (6, 2, 0, 2, 2, {"diff_audit": 1, "tests": 1},
                             {"diff_audit: PredicateEvaluated diff_audit": 1, "tests: tests evidence from v@1": 1})


def test_fail_rejects_for_this_route_only(tmp_path):
    lines = simple("e1") + [scored("e1"), verdict("e1", "tests", "fail", route_name="demo"),
                            route("demo", predicates=[{"name": "tests", "family": "outcome"}]),
                            route("diag", use="sft", predicates=[{"name": "tests", "family": "outcome"}]),
                            verdict("e1", "tests", "pass", route_name="diag")]
    db = project(tmp_path, lines)
    assert adm(db, "e1", "demo")[:3] == ("rejected", "tests", "fail")
    assert adm(db, "e1", "diag")[:3] == ("admitted", None, "pass")


# ============================================================================ target suitability


def test_target_suitability_follows_the_score(tmp_path):
    lines = (simple("scored") + [scored("scored", 0.0)]
             + simple("dummy") + [not_assessable("dummy")]
             + simple("pending")
             + simple("excluded") + [{"type": "execution_finalized", "execution_id": "excluded"}]
             + [opened("context"), request("context", "r1", [1], [2], generator="harness"),
                request("context", "r2", [1, 2, 3], [4], generator="evaluator"), closed("context"), scored("context")]
             + [route()])
    db = project(tmp_path, lines)
    assert adm(db, "scored") == ("admitted", None, "pass", None, "admitted", 0.0, 2, 1)  # a valid zero is trainable
    assert adm(db, "dummy") == ("dummy", "target_suitability", "pass", None,
                                "zero-reward dummy: not assessable (a1): zero-reward dummy", 0.0, 0, 0)
    assert adm(db, "pending") == ("unresolved", "target_suitability", "pending", "valid reward (assessment)",
                                  "awaiting assessment", None, 0, 0)
    assert adm(db, "excluded") == ("rejected", "target_suitability", "fail", None, "no valid reward by the deadline",
                                   None, 0, 0)
    assert adm(db, "context") == ("rejected", "target_suitability", "fail", None, "no target after masking", 1.0, 0, 0)
    assert telemetry(db) == (5, 1, 1, 2, 1, {"target_suitability": 2},
                             {"target_suitability: valid reward (assessment)": 1})


def test_targets_priority_and_cap(tmp_path):
    lines = tree_execution() + [scored("e1", 0.5), route("all", j_max=8), route("cap", j_max=2),
                                route("subfirst", j_max=1, role_priority=["sub/task", "main/task"])]
    db = project(tmp_path, lines)
    e_path = [3, 4, 6, 7, 9, 10, 11]  # positions of 4,5 | 7,8 | 15,16,17 on [1,2,3,4,5,6,7,8,14,15,16,17]
    assert paths(db, "e1", "all") == [(0, "r4", "main/task", 12, 7, 0.5, e_path),
                                      (1, "s1", "main/summary", 11, 2, 0.5, [9, 10]),
                                      (2, "r3", "sub/task", 7, 1, 0.5, [6])]
    assert adm(db, "e1", "all")[6:] == (10, 3)
    assert paths(db, "e1", "cap") == paths(db, "e1", "all")[:2]
    assert adm(db, "e1", "cap")[6:] == (9, 2)
    assert paths(db, "e1", "subfirst") == [(0, "r3", "sub/task", 7, 3, 0.5, [3, 4, 6])]


def test_target_selection_turns_requests_into_context(tmp_path):
    sel = {"type": "target_selection", "execution_id": "e1", "selection_id": "ts1", "policy": "recovery_targets_v1",
           "behavioral_role": "recovery", "context_only_request_ids": ["r2", "r4"], "selected_request_ids": ["r1", "s1"]}
    db = project(tmp_path, tree_execution() + [sel, scored("e1"), route()])
    # r2's and r4's outputs are context now: r4's path keeps only r1's targets
    assert paths(db, "e1") == [(0, "r4", "main/task", 12, 2, 1.0, [3, 4]),
                               (1, "s1", "main/summary", 11, 2, 1.0, [9, 10]),
                               (2, "r3", "sub/task", 7, 1, 1.0, [6])]
    assert adm(db, "e1")[6:] == (5, 3)


def test_branch_scoped_rewards_select_and_label_paths(tmp_path):
    lines = tree_execution() + [scored("e1", 0.25, "a1", branch_request_id="r2"), route()]
    db = project(tmp_path, lines)
    # only r2's branch (leaves s1 and r4) carries a reward; r3 is not drawn
    assert adm(db, "e1")[:1] + adm(db, "e1")[5:] == ("admitted", None, 9, 2)
    assert [(p[1], p[5]) for p in paths(db, "e1")] == [("r4", 0.25), ("s1", 0.25)]
    lines2 = tree_execution() + [scored("e1", 1.0, "a1"), scored("e1", 0.0, "a2", branch_request_id="r3"),
                                 not_assessable("e1", "a3") | {"branch_request_id": "s1"}, route()]
    db2 = project(tmp_path, lines2, name="mixed")
    assert [(p[1], p[5]) for p in paths(db2, "e1")] == [("r4", 1.0), ("r3", 0.0)]


def test_targets_partition_all_candidates_and_never_context(tmp_path):
    """With a large J_max the fixed target sets are disjoint, their union is every unmasked
    policy target, and no context token (inputs, harness or evaluator output) is a target."""
    lines = tree_execution() + [request("e1", "h1", [1, 2, 3, 4, 5, 6, 7, 8, 14, 15, 16, 17, 20], [21, 22],
                                        generator="harness")]
    lines = lines[:-2] + [lines[-1], lines[-2]]  # the harness request before the closure
    db = project(tmp_path, lines + [scored("e1"), route(j_max=100)])
    loaded, view = execution_view(db, "e1")
    assert [lf.request_id for lf in view.leaves] == [lf.request_id for lf in tree_view(db, "e1", ()).leaves]
    claimed: dict[int, set[int]] = {}
    for leaf, blob in db.execute("SELECT leaf_request_id, targets FROM admitted_paths WHERE route = 'sft'"):
        nodes = path_nodes(view.parent, loaded.requests[leaf].node_id)
        offsets = np.concatenate(([0], np.cumsum(view.seg_len[nodes])[:-1]))
        for p in np.frombuffer(blob, dtype="<u4").tolist():
            k = int(np.searchsorted(offsets, p, side="right")) - 1
            node, pos = nodes[k], p - int(offsets[k])
            assert view.candidate[node][pos] == 1  # never a context token
            assert pos not in claimed.setdefault(node, set())  # disjoint
            claimed[node].add(pos)
    every = {n: set(np.flatnonzero(c).tolist()) for n, c in enumerate(view.candidate) if c.any()}
    assert {n: s for n, s in claimed.items() if s} == every
    assert sum(len(s) for s in every.values()) == 10 == adm(db, "e1")[6]


# ============================================================================ cascade plan


def test_cascade_plan_from_measured_rates(tmp_path):
    """Napkin math 15.2 shape: process (0.2 s, p=0.8) belongs before outcome (8 s, p=0.4)."""
    preds = [{"name": "out", "family": "outcome"}, {"name": "proc", "family": "process"}]
    lines = []
    for i in range(10):
        ex = f"e{i}"
        lines += simple(ex) + [scored(ex)]
        lines.append(verdict(ex, "out", "pass" if i < 4 else "fail", slot=8.0))
        lines.append(verdict(ex, "proc", "pass" if i < 8 else "fail", slot=0.2))
    db = project(tmp_path, lines + [route(predicates=preds)])
    measured = {p.name: (round(p.pass_rate, 6), round(p.slot_seconds, 6)) for p in measured_predicates(db, "sft")}
    assert measured == {"record_adequacy": (1.0, 0.0), "permitted_use": (1.0, 0.0), "out": (0.4, 8.0),
                        "proc": (0.8, 0.2), "target_suitability": (1.0, 0.0)}
    plan = cascade_plan(db, "sft")
    assert list(plan.chosen.order) == ["record_adequacy", "permitted_use", "proc", "out", "target_suitability"]
    assert plan.declared.seconds_per_attempted == pytest.approx(8.0 + 0.4 * 0.2)
    assert plan.chosen.seconds_per_attempted == pytest.approx(0.2 + 0.8 * 8.0)
    assert plan.chosen.route_yield == pytest.approx(0.32)
    assert "chosen order:   record_adequacy -> permitted_use -> proc -> out -> target_suitability" in format_plan(plan)


# ============================================================================ determinism


def _scenario() -> tuple[list[list[dict]], list[dict]]:
    """Per-execution event sequences, and governance lines (one totally ordered sequence)."""
    execs = [tree_execution("t-a", "ta") + [scored("t-a", 0.5)],
             tree_execution("t-b", "tb") + [scored("t-b", 1.0, "a1", branch_request_id="r2")],
             simple("d") + [not_assessable("d")],
             simple("x") + [scored("x", 1.0, occurred_at=AFTER)],
             simple("u") + [scored("u"), verdict("u", "tests", "unknown", route_name="demo")],
             simple("q") + [scored("q"), verdict("q", "tests", "pass", route_name="demo")]]
    gov = [route("sft", j_max=2), route("demo", predicates=[{"name": "tests", "family": "outcome"}]),
           route("sft", version=2, j_max=3, seed="s2")]
    return execs, gov


def _run(tmp, lines, name):
    """Replay with every line stamped explicitly (ingest would stamp the wall clock)."""
    lines = [ln if "occurred_at" in ln else {**ln, "occurred_at": STAMP} for ln in lines]
    return canonical_dump(project(tmp, lines, name=name))


def test_rebuild_gives_identical_tables(tmp_path):
    execs, gov = _scenario()
    lines = [ev for seq in execs for ev in seq] + gov
    log = open_log(str(tmp_path / "s"), create=True)
    Ingestor(log, SIGNER.trust).ingest_lines(enumerate(lines, 1))
    db = connect(tmp_path / "p.db")
    eng = ReplayEngine(log, db, [TreeProjection(), AssessmentProjection(), AdmissionProjection(fake_evidence())],
                       trust=SIGNER.trust)
    eng.run()
    first = canonical_dump(db)
    eng.rebuild()
    eng.run()
    assert canonical_dump(db) == first
    assert db.execute("SELECT route, execution_id, state FROM admission ORDER BY 1, 2").fetchall() == [
        ("demo", "d", "unresolved"), ("demo", "q", "admitted"), ("demo", "t-a", "unresolved"), ("demo", "t-b", "unresolved"),
        ("demo", "u", "unresolved"), ("demo", "x", "unresolved"),
        ("sft", "d", "dummy"), ("sft", "q", "admitted"), ("sft", "t-a", "admitted"), ("sft", "t-b", "admitted"),
        ("sft", "u", "admitted"), ("sft", "x", "rejected")]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rnd=st.randoms(use_true_random=False), batch=st.sampled_from([1, 3, 7, 500]))
def test_admission_is_independent_of_interleaving_and_batching(tmp_path_factory, monkeypatch, rnd, batch):
    execs, gov = _scenario()
    queues = [list(q) for q in execs] + [list(gov)]
    merged = []
    while any(queues):
        q = rnd.choice([q for q in queues if q])
        merged.append(q.pop(0))
    tmp = tmp_path_factory.mktemp("inter")
    reference = _run(tmp, [ev for seq in execs for ev in seq] + gov, "ref")
    monkeypatch.setattr(engine_mod, "BATCH", batch)
    assert _run(tmp, merged, "mixed") == reference


def test_end_to_end_draw_frequencies(tmp_path):
    """Across 240 executions with the same tree, the first draw picks a main/task leaf with
    probability proportional to its unmasked targets (1 vs 3): ~25 % / 75 %."""
    lines = []
    n = 240
    for i in range(n):
        ex = f"f{i:03d}"
        lines += [opened(ex), request(ex, "a", [1, 2], [3]), request(ex, "b", [1, 2, 9], [4, 5, 6]), closed(ex), scored(ex)]
    db = project(tmp_path, lines + [route(j_max=1)])
    counts = dict(db.execute("SELECT leaf_request_id, COUNT(*) FROM admitted_paths GROUP BY 1").fetchall())
    assert sum(counts.values()) == n
    sigma = (n * 0.25 * 0.75) ** 0.5
    assert abs(counts["a"] - n * 0.25) < 4 * sigma
    from ledger.algorithms.path_draws import draw_word

    # and exactly the deterministic rule: leaf a iff floor(u * 4) < 1 (cumulative counts a=1, b=3)
    expected_a = sum(1 for i in range(n) if (draw_word("sft", f"f{i:03d}", 0) * 4) >> 64 < 1)
    assert counts["a"] == expected_a


def test_real_split_map_and_permissions(tmp_path, monkeypatch):
    """Evidence.discover() with the splits and governance projections: the split map,
    quarantine (ambiguous lineage) and permissions decide permitted_use."""
    splits = pytest.importorskip("ledger.projections.splits")
    gov = pytest.importorskip("ledger.projections.governance")
    monkeypatch.setattr(engine_mod, "BATCH", 3)  # governance facts arrive in several batches
    reg = lambda task, **kw: {"type": "task_registered", "task_id": task, "source": "pool", **kw}  # noqa: E731
    lines = ([reg("t1"), reg("t2"), reg("t3", ambiguous_lineage=True)]
             + simple("e1", "t1") + [scored("e1")] + simple("e2", "t2") + [scored("e2")]
             + simple("e3", "t3") + [scored("e3")] + simple("e4", "t9") + [scored("e4")]
             + [route("sft"), route("dev-eval", use="evaluation", split="dev"),
                SIGNER.sign({"type": "permission", "subject": "source:pool", "use": "*", "action": "grant",
                             "authority": "legal", "occurred_at": STAMP}),
                SIGNER.sign({"type": "split_policy", "policy_id": "p1", "salt": "s", "occurred_at": STAMP,
                             "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}})])
    db = project(tmp_path, lines, Evidence.discover(), extra=[gov.GovernanceProjection(), splits.SplitsProjection()])
    assert adm(db, "e1")[:3] == ("admitted", None, "pass")
    assert adm(db, "e2")[:3] == ("admitted", None, "pass")
    assert adm(db, "e3")[:5] == ("unresolved", "permitted_use", "pending", "quarantine review",
                                 "task group t3 is quarantined")
    assert adm(db, "e4")[:4] == ("unresolved", "permitted_use", "unknown", "split map")  # task never registered
    assert adm(db, "e1", "dev-eval")[:5] == ("rejected", "permitted_use", "fail", None,
                                             "split train is not the route's split dev")
    # the review resolves the ambiguous lineage: e3 leaves quarantine
    link = {"type": "task_link_rejected", "task_a": "t3", "task_b": "t1", "occurred_at": STAMP}
    db2 = project(tmp_path, lines + [link], Evidence.discover(), name="resolved",
                  extra=[gov.GovernanceProjection(), splits.SplitsProjection()])
    assert adm(db2, "e3")[:3] == ("admitted", None, "pass")
    from ledger.corpus.export import trainer_records

    rec = next(r for r in trainer_records(db2, "sft") if r["execution_id"] == "e3")
    assert (rec["split"], rec["group_id"], rec["task_id"]) == ("train", "t3", "t3")


def _governed_scenario() -> tuple[list[list[dict]], list[dict]]:
    reg = lambda task, **kw: {"type": "task_registered", "task_id": task, "source": "pool", **kw}  # noqa: E731
    sign = lambda line: SIGNER.sign({**line, "occurred_at": STAMP})  # noqa: E731
    execs = [tree_execution("g1", "ta") + [scored("g1", 0.5)],
             simple("g2", "tb") + [scored("g2")],
             simple("g3", "tc") + [scored("g3")],
             simple("g4", "td") + [not_assessable("g4")]]
    gov = [reg("ta"), reg("tb"), reg("tc", ambiguous_lineage=True), reg("td"),
           route("sft", j_max=2),
           sign({"type": "permission", "subject": "source:pool", "use": "sft", "action": "grant", "authority": "legal"}),
           sign({"type": "split_policy", "policy_id": "p1", "salt": "s",
                 "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}}),
           sign({"type": "permission", "subject": "task:tb", "use": "sft", "action": "revoke", "authority": "legal"}),
           sign({"type": "withdrawal", "subject": "execution:g4", "reason": "consent", "authority": "legal"})]
    return execs, gov


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rnd=st.randoms(use_true_random=False), batch=st.sampled_from([1, 4, 500]))
def test_governed_admission_is_independent_of_interleaving(tmp_path_factory, monkeypatch, rnd, batch):
    """With the real splits and governance projections: any interleaving of the executions
    with the (totally ordered) governance sequence, any batch size, the same tables."""
    splits = pytest.importorskip("ledger.projections.splits")
    gov_mod = pytest.importorskip("ledger.projections.governance")
    execs, gov = _governed_scenario()
    queues = [list(q) for q in execs] + [list(gov)]
    merged = []
    while any(queues):
        q = rnd.choice([q for q in queues if q])
        merged.append(q.pop(0))
    stamp = lambda lines: [ln if "occurred_at" in ln else {**ln, "occurred_at": STAMP} for ln in lines]  # noqa: E731
    tmp = tmp_path_factory.mktemp("gov")

    def run(lines, name):
        db = project(tmp, stamp(lines), Evidence.discover(), name=name,
                     extra=[gov_mod.GovernanceProjection(), splits.SplitsProjection()])
        return db, canonical_dump(db)

    ref_db, reference = run(gov + [ev for seq in execs for ev in seq], "ref")
    assert [adm(ref_db, e)[:3] for e in ("g1", "g2", "g3", "g4")] == [
        ("admitted", None, "pass"), ("rejected", "permitted_use", "fail"),
        ("unresolved", "permitted_use", "pending"), ("rejected", "permitted_use", "fail")]
    monkeypatch.setattr(engine_mod, "BATCH", batch)
    assert run(merged, "mixed")[1] == reference
