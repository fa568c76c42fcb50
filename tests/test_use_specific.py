"""Use-specific admission (SPEC §6.8) and semantics versions (SPEC §10).

Routes here are declared without ``semantics``, so ingest stamps the current version (2); the
SPEC §6.5 tests of tests/test_admission.py declare semantics 1, whose rules stay selectable.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.cli import main as cli
from ledger.events import semantics
from ledger.events.validate import ValidationError, validate_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections.admission import AdmissionProjection, cap_rank, current_routes
from ledger.projections.assessment import AssessmentProjection
from ledger.projections.engine import ReplayEngine, canonical_dump, connect
from ledger.projections.tree import TreeProjection
from tests.helpers import closed, interleave, request, table_dump, write_lines
pytestmark = pytest.mark.usefixtures("earlier_release")  # compares with routes of the first release (SPEC §10)

from tests.test_admission import (
    SIGNER,
    STAMP,
    adm,
    fake_evidence,
    opened,
    paths,
    project,
    route,
    scored,
    tree_execution,
    verdict,
)

ROOT = Path(__file__).resolve().parent
NOW = 1_900_000_000_000_000


def r2(name: str = "sft", **kw) -> dict:
    """A route under the current rules (semantics stamped at ingest)."""
    return route(name, semantics=None, **kw)


def selection(ex: str, sid: str = "s1", *, role: str | None = None, selected=(), context_only=()) -> dict:
    line = {"type": "target_selection", "execution_id": ex, "selection_id": sid, "policy": "targets@1",
            "selected_request_ids": list(selected), "context_only_request_ids": list(context_only)}
    if role is not None:
        line["behavioral_role"] = role
    return line


def project_each(tmp_path, base: list[dict], singles: list[dict], name: str = "s"):
    """Like :func:`tests.test_admission.project`, but each of ``singles`` is ingested on its own
    (a line that conflicts with an earlier one is refused alone, as a producer's retry would be)."""
    log = open_log(str(tmp_path / name), create=True)
    ing = Ingestor(log, SIGNER.trust, seal=None)
    ing.ingest_lines(enumerate(base, 1))
    for line in singles:
        ing.ingest_lines([(1, line)])
    db = connect(tmp_path / f"{name}.db")
    ReplayEngine(log, db, [TreeProjection(), AssessmentProjection(), AdmissionProjection(fake_evidence())],
                 trust=SIGNER.trust).run()
    return db


def target_tokens(db, ex: str, r: str = "sft") -> list[list[int]]:
    """Per drawn path: the token values at its target positions."""
    from ledger.projections.tree import load_tree

    t = load_tree(db, ex)
    out = []
    for _draw, leaf, _role, _n, _k, _reward, pos in paths(db, ex, r):
        nodes = t.path_nodes(t.requests[leaf].node_id)
        toks = np.concatenate([t.nodes[n].tokens for n in nodes])
        out.append(toks[pos].tolist())
    return out


# ============================================================================ declared rules, refused at ingest


def _route_line(**kw) -> dict:
    return {"type": "admission_policy", "route": "r", "version": 1, "use": "sft", "split": "train", "j_max": 2, **kw}


@pytest.mark.parametrize("fields, field, message", [
    ({"split": "final_test"}, "split", "must name split 'train', not 'final_test'"),
    ({"use": "rl", "split": "dev"}, "split", "must name split 'train', not 'dev'"),
    ({"use": "preference", "split": "reserve"}, "split", "must name split 'train'"),
    ({"predicates": [{"name": "tests", "family": "outcome", "repetitions": {"runs": 0}}]}, "predicates",
     "repetitions.runs must be an integer >= 1, got 0"),
    ({"predicates": [{"name": "tests", "family": "outcome", "repetitions": {"runs": 2, "aggregate": "k_of_n", "k": 3}}]},
     "predicates", "k = 3 exceeds runs = 2"),
    ({"predicates": [{"name": "tests", "family": "outcome", "repetitions": {"runs": 2, "aggregate": "most"}}]},
     "predicates", "aggregate must be 'all' or 'k_of_n'"),
    ({"predicates": [{"name": "tests", "family": "outcome", "repetitions": {"runs": 2, "tries": 1}}]},
     "predicates", "unknown key 'tries'"),
    ({"predicates": [{"name": "record_adequacy", "repetitions": {"runs": 2}}]}, "predicates",
     "computed by the ledger"),
    ({"required_criteria": ["tests pass"]}, "required_criteria", "'tests pass' is not a criterion name"),
    ({"required_criteria": ["tests", "tests"]}, "required_criteria", "'tests' is named twice"),
    ({"required_criteria": ["permitted_use"]}, "required_criteria", "ledger-computed predicate"),
    ({"required_criteria": "tests"}, "required_criteria", "expected a list"),
    ({"use": "rl", "min_reward": 0.5}, "min_reward", "min_reward applies to sft routes"),
    ({"use": "evaluation", "split": "final_test", "outcome_scope": "branch"}, "outcome_scope", "has none"),
    ({"per_task_cap": 0}, "per_task_cap", ""),
    ({"use": "publication"}, "use", "serves one learning use"),
])
def test_bad_route_declarations_are_refused_naming_the_field(fields, field, message):
    with pytest.raises(ValidationError) as exc:
        validate_line(_route_line(**fields), line=7, now_micros=NOW)
    assert exc.value.field == field
    assert message in str(exc.value) and "line 7" in str(exc.value)


def test_held_out_splits_are_for_evaluation_routes_and_old_rules_stay_declarable():
    for split in ("dev", "final_test", "reserve"):
        ev = validate_line(_route_line(use="evaluation", split=split), now_micros=NOW)
        assert ev["semantics"] == semantics.CURRENT == 3 and "semantics" in ev["stamped"]
    old = validate_line(_route_line(split="final_test", semantics=1), now_micros=NOW)  # as the first release took it
    assert old["semantics"] == 1 and "semantics" not in old["stamped"]


def test_cli_refuses_a_training_route_on_final_test_and_appends_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    assert cli(["init"]) == 0
    assert cli(["keys", "new", "--out", str(tmp_path / "gov.key")]) == 0
    raw = write_lines(tmp_path / "route.jsonl", [{**_route_line(split="final_test"), "occurred_at": STAMP}])
    capsys.readouterr()
    assert cli(["sign", "--key", str(tmp_path / "gov.key"), raw]) == 0
    (tmp_path / "signed.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", str(tmp_path / "signed.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "split" in err and "must name split 'train', not 'final_test'" in err
    assert "Traceback" not in err
    assert open_log(str(tmp_path / "store")).end_offsets() == {("log", 0): 0}


# ============================================================================ selections decide targets


@pytest.mark.parametrize("sel, want", [
    ({}, [[15, 16, 17, 7, 8, 4, 5], [12, 13], [10]]),  # no selection: every policy output
    ({"selected": ["r2"]}, [[7, 8]]),  # only r2's outputs (on the r4 path); the other leaves have none left
    ({"selected": ["r2", "r3"]}, [[7, 8], [10]]),
    ({"selected": ["r4"], "context_only": ["r4"]}, []),  # context-only wins over selected: nothing left
    ({"context_only": ["r1", "r2"]}, [[15, 16, 17], [12, 13], [10]]),
])
def test_target_selection_decides_targets(tmp_path, sel, want):
    lines = tree_execution("e1") + [scored("e1"), r2(j_max=8)]
    if sel:
        lines.append(selection("e1", **sel))
    db = project(tmp_path, lines)
    got = target_tokens(db, "e1")
    assert [sorted(x) for x in got] == [sorted(x) for x in want]
    if not want:
        assert adm(db, "e1")[:3] == ("rejected", "target_suitability", "fail")


def test_the_first_release_ignored_selected_request_ids(tmp_path):
    lines = tree_execution("e1") + [scored("e1"), route(j_max=8), selection("e1", selected=["r2"])]
    db = project(tmp_path, lines)
    assert sum(len(x) for x in target_tokens(db, "e1")) == 10  # semantics 1: all 10 policy tokens


# ============================================================================ hard negatives


ROUTE_CONFIGS = st.fixed_dictionaries({
    "j_max": st.integers(1, 8),
    "min_reward": st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0])),
    "role_priority": st.permutations(["main/task", "main/summary", "sub/task", "sub/summary"]),
    "outcome_scope": st.sampled_from([None, "execution", "branch"]),
    "required_criteria": st.sampled_from([None, ["tests"]]),
    "per_task_cap": st.one_of(st.none(), st.integers(1, 3)),
})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(cfg=ROUTE_CONFIGS, selected=st.sampled_from([(), ("r2",), ("r4", "r3"), ("r1", "r2", "r3", "r4", "s1")]),
       inherited=st.booleans(), reward=st.sampled_from([0.0, 1.0]))
def test_a_hard_negative_never_carries_an_sft_target(tmp_path_factory, cfg, selected, inherited, reward):
    tmp = tmp_path_factory.mktemp("hn")
    kw = {k: v for k, v in cfg.items() if v is not None}
    crit = [{"name": "tests", "verdict": "pass"}]
    lines = (tree_execution("hn") + [scored("hn", reward, criteria=crit),
                                     {"type": "assessment", "assessment_id": "b1", "execution_id": "hn",
                                      "artifact_version": "v1", "outcome": "scored", "reward": reward,
                                      "branch_request_id": "r2", "evaluator": "grader@1"}]
             + tree_execution("ok") + [scored("ok", 1.0, criteria=crit)])
    lines += [r2("sft", **kw), r2("rl", use="rl", **{k: v for k, v in kw.items() if k != "min_reward"})]
    hn_sel = selection("hn", role="hard_negative", selected=selected)
    if inherited:  # the label is made on the parent and reaches its derived view
        lines += [hn_sel, {"type": "record_derived", "derived_execution_id": "hn_view", "parent_execution_id": "hn",
                           "transformation": "noop@1"},
                  {"type": "revalidated", "derived_execution_id": "hn_view", "verdict": "pass"}]
    else:
        lines.append(hn_sel)
    db = project(tmp, lines)
    for ex in ("hn", "hn_view") if inherited else ("hn",):
        assert paths(db, ex, "sft") == []
        state, predicate, _v, _m, reason, *_ = adm(db, ex, "sft")
        assert state != "admitted"
        if state == "rejected" and predicate == "target_suitability":
            assert reason.startswith("hard negative") or reason == "no target after masking"
    assert db.execute("SELECT COUNT(*) FROM admitted_paths a JOIN target_selections s ON s.execution_id = a.execution_id "
                      "WHERE a.route = 'sft' AND s.behavioral_role = 'hard_negative'").fetchone()[0] == 0


def test_a_hard_negative_keeps_its_reward_on_rl_and_the_first_release_admitted_it_to_sft(tmp_path):
    lines = tree_execution("hn") + [scored("hn", 1.0), selection("hn", role="hard_negative"),
                                    r2("rl", use="rl"), r2("sft"), route("sft_v1")]
    db = project(tmp_path, lines)
    assert adm(db, "hn", "sft")[:2] == ("rejected", "target_suitability")
    assert adm(db, "hn", "sft")[4] == "hard negative (s1 on hn): no imitation targets on an sft route"
    assert adm(db, "hn", "rl")[0] == "admitted" and adm(db, "hn", "rl")[5] == 1.0 and adm(db, "hn", "rl")[6] == 10
    assert adm(db, "hn", "sft_v1")[0] == "admitted" and adm(db, "hn", "sft_v1")[6] == 10  # what issue 15 found


# ============================================================================ outcome conditions


def test_imitation_needs_a_passing_outcome_rl_keeps_every_valid_reward(tmp_path):
    lines = []
    for ex, reward in (("zero", 0.0), ("half", 0.5), ("full", 1.0)):
        lines += tree_execution(ex) + [scored(ex, reward)]
    lines += [r2("sft"), r2("sft_half", min_reward=0.5), r2("rl", use="rl")]
    db = project(tmp_path, lines)
    assert adm(db, "zero", "sft")[:5] == ("rejected", "outcome", "fail", None,
                                          "reward 0 below min_reward 1: imitation needs a passing outcome")
    assert adm(db, "half", "sft")[:3] == ("rejected", "outcome", "fail")
    assert adm(db, "full", "sft")[0] == "admitted"
    assert [adm(db, ex, "sft_half")[0] for ex in ("zero", "half", "full")] == ["rejected", "admitted", "admitted"]
    assert [(adm(db, ex, "rl")[0], adm(db, ex, "rl")[5]) for ex in ("zero", "half", "full")] == [
        ("admitted", 0.0), ("admitted", 0.5), ("admitted", 1.0)]


def test_not_assessable_dummies_stay_out_of_sft_and_in_rl(tmp_path):
    from tests.test_admission import not_assessable

    lines = tree_execution("d") + [not_assessable("d"), r2("sft"), r2("rl", use="rl")]
    db = project(tmp_path, lines)
    assert adm(db, "d", "sft")[:3] == ("rejected", "outcome", "fail")
    assert adm(db, "d", "rl")[0] == "dummy"


@pytest.mark.parametrize("verdicts, want", [
    ({"tests": "pass", "scope": "pass"}, ("admitted", None, "pass", None)),
    ({"tests": "pass", "scope": "fail"}, ("rejected", "required_criteria", "fail", None)),
    ({"tests": "pass", "scope": "pending"}, ("unresolved", "required_criteria", "pending", "criterion scope")),
    ({"tests": "unknown", "scope": "pass"}, ("unresolved", "required_criteria", "unknown", "criterion tests")),
    ({"tests": "pass"}, ("unresolved", "required_criteria", "pending", "criterion scope")),
])
def test_required_criteria_read_the_counting_assessment(tmp_path, verdicts, want):
    crit = [{"name": n, "verdict": v} for n, v in verdicts.items()]
    lines = tree_execution("e") + [scored("e", 1.0, criteria=crit), r2(required_criteria=["tests", "scope"]),
                                   route("v1", required_criteria=["tests", "scope"])]
    db = project(tmp_path, lines)
    assert adm(db, "e")[:4] == want
    assert adm(db, "e", "v1")[0] == "admitted"  # semantics 1 stored criteria and never read them


# ============================================================================ repeated verifiers


def _verdicts(ex, seq, route_name="sft", verifier="pytest@1"):
    """Verdict lines; attempts carry their own event ids (so a rerun of one attempt is a separate
    submission), plain verdicts derive theirs (a repeated identical verdict is a retry)."""
    return [verdict(ex, "tests", v, route_name=route_name, verifier=verifier,
                    **({} if a is None else {"attempt": a, "seed": f"seed-{a}", "event_id": f"{ex}-{route_name}-{i}"}))
            for i, (a, v) in enumerate(seq)]


def test_fail_fail_pass_from_one_verifier_is_never_admitted(tmp_path):
    seq = [(None, "fail"), (None, "fail"), (None, "pass")]
    lines = (tree_execution("e") + [scored("e")] + _verdicts("e", seq) + _verdicts("e", seq, "v1")
             + [r2(predicates=[{"name": "tests", "family": "outcome"}]),
                route("v1", predicates=[{"name": "tests", "family": "outcome"}])])
    db = project(tmp_path, lines)
    state, pred, v, missing, reason, *_ = adm(db, "e")
    assert (state, pred, v, missing) == ("unresolved", "tests", "unknown", "tests: consistent verdict from pytest@1")
    assert reason.startswith("inconsistent verdicts from pytest@1: fail, pass")  # the second fail was a retry
    assert adm(db, "e", "v1")[0] == "admitted"  # semantics 1: the latest verdict won


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(runs=st.integers(1, 3), seq=st.lists(st.tuples(st.integers(1, 4), st.sampled_from(["pass", "fail"])),
                                             min_size=0, max_size=7))
def test_no_order_of_reruns_admits_under_all(tmp_path_factory, runs, seq):
    """Reruns are more attempts (beyond ``runs``: ignored) or repeats of an attempt (the first
    verdict of an attempt stands); only n distinct passing attempts admit."""
    tmp = tmp_path_factory.mktemp("rep")
    rep = {"runs": runs, "aggregate": "all"}
    base = tree_execution("e") + [scored("e"), r2(predicates=[{"name": "tests", "family": "outcome", "repetitions": rep}])]
    db = project_each(tmp, base, _verdicts("e", seq))
    first: dict[int, str] = {}
    for a, v in seq:
        if a <= runs:
            first.setdefault(a, v)
    state = adm(db, "e")[0]
    if len(first) < runs:
        assert adm(db, "e")[:3] == ("unresolved", "tests", "pending")
    elif all(v == "pass" for v in first.values()):
        assert state == "admitted"
    else:
        assert adm(db, "e")[:3] == ("rejected", "tests", "fail")
    assert (state == "admitted") == (len(first) == runs and set(first.values()) == {"pass"})


@pytest.mark.parametrize("seq, want", [
    ([(1, "pass"), (2, "fail"), (3, "pass")], ("admitted", None)),
    ([(1, "pass"), (2, "fail"), (3, "fail")], ("rejected", "tests")),
    ([(1, "pass"), (2, "pass")], ("unresolved", "tests")),  # attempt 3 missing
    ([(1, "pass"), (2, "pass"), (3, "unknown")], ("admitted", None)),  # 2 of 3 suffice
    ([(1, "pass"), (2, "fail"), (3, "unknown")], ("unresolved", "tests")),  # could still reach 2
])
def test_k_of_n(tmp_path, seq, want):
    rep = {"runs": 3, "aggregate": "k_of_n", "k": 2}
    lines = tree_execution("e") + [scored("e")] + _verdicts("e", seq) + [
        r2(predicates=[{"name": "tests", "family": "outcome", "repetitions": rep}])]
    db = project(tmp_path, lines)
    assert adm(db, "e")[:2] == want


def test_a_second_verdict_for_one_attempt_is_a_conflict_at_ingest(tmp_path):
    log = open_log(str(tmp_path / "s"), create=True)
    ing = Ingestor(log, SIGNER.trust, seal=None)
    base = tree_execution("e")
    assert not ing.ingest_lines(enumerate(base, 1)).conflicts
    first = verdict("e", "tests", "fail", attempt=1)
    assert ing.ingest_lines([(1, first)]).appended == 1
    again = ing.ingest_lines([(1, verdict("e", "tests", "pass", attempt=1))])
    assert again.appended == 0 and len(again.conflicts) == 1
    assert "predicate_evaluated/e/sft/tests/v@1/attempt/1" in json.dumps(again.conflicts[0])
    assert ing.ingest_lines([(1, first)]).duplicates == 1  # the same verdict again is a retry


def test_cascade_plan_prints_the_false_pass_bound(tmp_path):
    from ledger.projections.admission import cascade_plan
    from ledger.algorithms.cascade_plan import format_plan

    rep = {"runs": 3, "aggregate": "all"}
    lines = []
    for i in range(4):
        seq = [(1, "pass"), (2, "pass"), (3, "pass" if i else "fail")]
        lines += tree_execution(f"e{i}") + [scored(f"e{i}")] + _verdicts(f"e{i}", seq)
    lines.append(r2(predicates=[{"name": "tests", "family": "outcome", "repetitions": rep}]))
    db = project(tmp_path, lines)
    plan = cascade_plan(db, "sft")
    text = format_plan(plan)
    p = 11 / 12  # 11 of the 12 recorded attempts passed
    assert (f"tests: 3 runs (all); per-attempt pass rate p = {p:.4g}: rerunning until a pass would accept with "
            f"false-pass bound {1 - (1 - p) ** 3:.3f} = 1-(1-p)^3; the declared aggregate accepts with {p ** 3:.3f}") in text
    pred = next(x for x in plan.predicates if x.name == "tests")
    assert pred.pass_rate == 3 / 4  # per execution, the aggregate verdict: e0 failed attempt 3


# ============================================================================ per-task caps


def test_per_task_cap_keeps_the_lowest_keyed_hashes_and_counts_redundancy(tmp_path):
    from ledger.corpus.export import accounting

    exs = [f"x{i}" for i in range(6)]
    lines = []
    for ex in exs:
        lines += tree_execution(ex, "t1") + [scored(ex)]
    lines += tree_execution("other", "t2") + [scored("other")]
    lines.append(r2(per_task_cap=2, seed="cap-seed"))
    db = project(tmp_path, lines)
    keep = sorted(exs, key=lambda e: cap_rank("cap-seed", e))[:2]
    got = {ex: adm(db, ex)[:2] for ex in exs}
    assert {ex for ex, s in got.items() if s[0] == "admitted"} == set(keep)
    assert all(s == ("rejected", "per_task_cap") for ex, s in got.items() if ex not in keep)
    dropped = next(ex for ex in exs if ex not in keep)
    assert adm(db, dropped)[4] == "redundancy: per_task_cap 2 reached for task t1"
    assert adm(db, "other")[0] == "admitted"
    acc = accounting(db, "sft")
    assert acc["dispositions"]["redundancy"] == {"per_task_cap: redundancy: per_task_cap 2 reached for task t1": 4}
    assert acc["dispositions"]["emitted"] == 3 and acc["attempts"] == 7


# ============================================================================ recovery segments


def branch_assessment(ex: str, rid: str, reward: float, aid: str = "b1") -> dict:
    return {"type": "assessment", "assessment_id": aid, "execution_id": ex, "artifact_version": "v1",
            "outcome": "scored", "reward": reward, "branch_request_id": rid, "evaluator": "grader@1"}


def test_branch_scoped_route_admits_the_recovery_segment_alone(tmp_path):
    from ledger.corpus.export import trainer_records

    lines = tree_execution("e") + [branch_assessment("e", "r2", 1.0), selection("e", role="recovery",
                                                                              selected=["r2", "r4"]),
                                   r2("seg", outcome_scope="branch"), r2("whole")]
    db = project(tmp_path, lines)
    assert adm(db, "e", "whole")[:4] == ("unresolved", "outcome", "pending", "execution-scoped assessment")
    assert adm(db, "e", "seg")[0] == "admitted"
    # the leaves below r2 are r4 and s1 (r3 branches off before r2); only selected requests are targets
    assert [sorted(x) for x in target_tokens(db, "e", "seg")] == [[7, 8, 15, 16, 17]]
    recs = list(trainer_records(db, "seg"))
    assert [(r["leaf_request_id"], r["outcome_scope"], r["task_outcome"], r["reward"]) for r in recs] == [
        ("r4", "branch", "unverified", 1.0)]
    # a whole-task reward, once recorded, is reported (and the execution-scoped route admits)
    db2 = project(tmp_path, lines + [scored("e", 0.0, aid="whole")], name="s2")
    assert [r["task_outcome"] for r in trainer_records(db2, "seg")] == [0.0]
    # semantics 3: the whole-task 0.0 does not replace the branch's 1.0, so the execution-scoped route
    # admits the paths through r2 alone (semantics 2 rejected the execution: 0.0 < min_reward 1.0)
    assert adm(db2, "e", "whole")[:2] == ("admitted", None)
    assert [(r["leaf_request_id"], r["reward"]) for r in trainer_records(db2, "whole")] == [("r4", 1.0)]
    plain = list(trainer_records(project(tmp_path, tree_execution("e") + [scored("e"), r2("whole")], name="s3"),
                                 "whole"))
    assert plain and all("outcome_scope" not in r and "task_outcome" not in r for r in plain)


# ============================================================================ evaluation routes


def test_evaluation_routes_read_held_out_splits_and_carry_no_targets(tmp_path):
    lines = tree_execution("e") + [scored("e"), r2("eval", use="evaluation", split="final_test")]
    db = project(tmp_path, lines, fake_evidence("final_test"))
    state, *_rest = adm(db, "e", "eval")
    assert state == "admitted" and adm(db, "e", "eval")[6] == 0
    assert [p[4] for p in paths(db, "e", "eval")] == [0, 0, 0] and all(p[6] == [] for p in paths(db, "e", "eval"))


# ============================================================================ convergence


def _mixed_lines() -> list[dict]:
    lines = []
    for i in range(5):
        ex = f"m{i}"
        lines += tree_execution(ex, f"t{i % 2}") + [scored(ex, [1.0, 0.0, 1.0, 1.0, 0.5][i],
                                                         criteria=[{"name": "tests", "verdict": "pass"}])]
    lines += [selection("m0", role="hard_negative"), selection("m2", selected=["r2"]),
              branch_assessment("m3", "r2", 1.0)]
    lines += _verdicts("m1", [(1, "pass"), (2, "pass")]) + _verdicts("m2", [(1, "pass"), (2, "fail"), (3, "pass")])
    lines += _verdicts("m3", [(None, "fail"), (None, "pass")], route_name="plain")
    rep = {"runs": 2, "aggregate": "all"}
    lines += [r2("sft", per_task_cap=2, predicates=[{"name": "tests", "family": "outcome", "repetitions": rep}]),
              r2("rl", use="rl", required_criteria=["tests"]), r2("seg", outcome_scope="branch"),
              r2("plain", predicates=[{"name": "tests", "family": "outcome"}])]
    return lines


def _admission_tables(db) -> str:
    return table_dump(db, ("admission", "admitted_paths", "route_telemetry"), "1, 2, 3")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False), batch=st.sampled_from([1, 3, 500]))
def test_use_specific_rules_converge_under_every_interleaving(tmp_path_factory, monkeypatch, rnd, batch):
    import ledger.projections.engine as engine_mod

    tmp = tmp_path_factory.mktemp("conv")
    lines = _mixed_lines()
    ref = _admission_tables(project(tmp, lines, name="ref"))
    # interleave the executions' event streams (each keeps its own order), governance anywhere
    mixed = interleave(lines, rnd)
    monkeypatch.setattr(engine_mod, "BATCH", batch)
    assert _admission_tables(project(tmp, mixed, name="mix")) == ref


# ============================================================================ semantics versions


def test_routes_remember_the_semantics_they_were_ingested_under(tmp_path):
    db = project(tmp_path, tree_execution("e") + [scored("e"), r2("new"), route("old")])
    routes = current_routes(db)
    assert (routes["new"].semantics, routes["old"].semantics) == (3, 1)
    assert db.execute("SELECT semantics FROM routes ORDER BY route").fetchall() == [(3,), (1,)]


def test_a_first_release_store_still_verifies_deep_and_audits(tmp_path, monkeypatch, capsys):
    """tests/fixtures/release1: a store written by the first release (commit 855cc22; see its
    run.sh) with ids holding '/' and '%', a hard negative on sft and a rerun-until-pass verdict."""
    src = ROOT / "fixtures" / "release1"
    shutil.copytree(src, tmp_path / "r1")
    monkeypatch.chdir(tmp_path / "r1")
    store = ["--store", "store"]
    assert cli(store + ["manifest", "verify", "m1.json", "--deep"]) == 0
    assert "manifest ok: sft_main v1 (deep" in capsys.readouterr().out
    assert cli(store + ["audit"]) == 0
    assert cli(store + ["project"]) == 0
    db = connect("store/projections.db")
    assert current_routes(db)["sft_main"].semantics == 1
    doc = json.loads(Path("m1.json").read_text())
    assert "semantics" not in doc
    assert {m["member_id"] for m in doc["members"]} >= {"sft_main/run/7/b", "sft_main/hn%1/b"}  # unescaped, as published
    # the old rules still apply to the old route: the hard negative kept its targets, the flaky run was admitted
    states = dict(db.execute("SELECT execution_id, state FROM admission WHERE route = 'sft_main'").fetchall())
    assert states == {"run/7": "admitted", "hn%1": "admitted", "zero": "admitted", "flaky": "admitted", "sel": "admitted"}
