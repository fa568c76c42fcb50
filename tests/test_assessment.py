"""Assessment and scoring (SPEC §6.2): one test per rule, exact values."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections.assessment import AssessmentProjection, path_reward
from ledger.projections.engine import ReplayEngine, canonical_dump, connect
from tests.helpers import closed, request
from tests.helpers import opened as _opened

# Far in the future, so events stamped at ingest (wall clock) are always before it.
DEADLINE = "2099-01-01T00:00:00Z"
BEFORE = "2098-12-31T23:00:00Z"
AFTER = "2099-01-01T00:00:01Z"


def opened(ex: str, task: str = "t1", **kw) -> dict:
    return _opened(ex, task, **{"deadline": DEADLINE, **kw})


def assessment(ex: str, aid: str, outcome: str = "scored", reward: float | None = 1.0, version: str = "v1",
               at: str = BEFORE, **kw) -> dict:
    line = {"type": "assessment", "assessment_id": aid, "execution_id": ex, "artifact_version": version,
            "outcome": outcome, "evaluator": "grader@1", "occurred_at": at, **kw}
    if outcome == "scored":
        line["reward"] = reward
    return line


def finalized(ex: str, at: str = AFTER) -> dict:
    return {"type": "execution_finalized", "execution_id": ex, "occurred_at": at}


def project(tmp_path, lines, *, with_tree=False, name="s"):
    log = open_log(str(tmp_path / name), create=True)
    Ingestor(log).ingest_lines(enumerate(lines, 1))
    projections = []
    if with_tree:
        from ledger.projections.tree import TreeProjection

        projections.append(TreeProjection())
    projections.append(AssessmentProjection())
    db = connect(tmp_path / f"{name}.db")
    ReplayEngine(log, db, projections).run()
    return db


def score(db, ex):
    return db.execute("SELECT state, reward, reason, conflict FROM execution_scores WHERE execution_id = ?", (ex,)).fetchone()


def statuses(db, ex):
    return db.execute("SELECT assessment_id, status, conflict, agrees FROM assessments WHERE execution_id = ? ORDER BY seq",
                      (ex,)).fetchall()


def base(ex="e1", status="completed", versions=("v1",)):
    return [opened(ex), request(ex, "r1", [1, 2, 3], [4, 5]), closed(ex, status, versions)]


# ---------------------------------------------------------------------------- rules


def test_unclosed_and_unassessed_executions_are_pending(tmp_path):
    db = project(tmp_path, [opened("open"), request("open", "r1", [1], [2]),
                            opened("closed"), request("closed", "r1", [1], [2]), closed("closed"),
                            assessment("open", "a1")])
    assert score(db, "open") == ("pending", None, "awaiting closure", 0)
    assert statuses(db, "open") == [("a1", "unbound", 0, None)]
    assert score(db, "closed") == ("pending", None, "awaiting assessment", 0)


def test_assessment_before_closure_binds_at_closure(tmp_path):
    lines = [opened("e1"), request("e1", "r1", [1], [2]), assessment("e1", "a1", reward=0.5, version="v2"),
             closed("e1", versions=("v1", "v2"))]
    db = project(tmp_path, lines)
    assert score(db, "e1") == ("scored", 0.5, "scored by a1", 0)


def test_timed_out_execution_with_assessable_work_is_scored(tmp_path):
    db = project(tmp_path, base(status="timeout") + [assessment("e1", "a1", reward=0.75)])
    assert score(db, "e1") == ("scored", 0.75, "scored by a1", 0)


def test_evaluator_error_can_be_retried_against_the_same_artifact(tmp_path):
    lines = base() + [assessment("e1", "a1", outcome="evaluator_error")]
    db = project(tmp_path, lines)
    assert score(db, "e1") == ("pending", None, "evaluator error; awaiting a retry within the budget", 0)
    db2 = project(tmp_path, lines + [assessment("e1", "a2", reward=0.25)], name="retry")
    assert score(db2, "e1") == ("scored", 0.25, "scored by a2", 0)
    assert statuses(db2, "e1") == [("a1", "evaluator_error", 0, None), ("a2", "counts", 0, None)]


def test_no_valid_reward_by_finalization_is_excluded(tmp_path):
    db = project(tmp_path, base() + [assessment("e1", "a1", outcome="evaluator_error"), finalized("e1")])
    assert score(db, "e1") == ("excluded", None, "no valid reward by the deadline (1 evaluator error)", 0)


def test_any_event_stamped_after_the_deadline_ends_the_budget(tmp_path):
    late_cost = {"type": "cost_recorded", "execution_id": "e1", "amount": 1.5, "occurred_at": AFTER}
    db = project(tmp_path, base() + [late_cost])
    assert score(db, "e1") == ("excluded", None, "no valid reward by the deadline", 0)
    assert db.execute("SELECT amount FROM execution_costs").fetchall() == [(1.5,)]


def test_never_closed_within_the_budget_is_excluded(tmp_path):
    db = project(tmp_path, [opened("e1"), request("e1", "r1", [1], [2]), finalized("e1")])
    assert score(db, "e1") == ("excluded", None, "no valid reward by the deadline (never closed)", 0)


def test_valid_zero_reward_stays_trainable(tmp_path):
    db = project(tmp_path, base() + [assessment("e1", "a1", reward=0.0), finalized("e1")])
    assert score(db, "e1") == ("scored", 0.0, "scored by a1", 0)


def test_score_stamped_after_the_deadline_does_not_count(tmp_path):
    db = project(tmp_path, base() + [assessment("e1", "a1", reward=1.0, at=AFTER)])
    assert score(db, "e1") == ("excluded", None, "no valid reward by the deadline", 0)
    assert statuses(db, "e1") == [("a1", "late", 0, None)]


def test_backdated_score_logged_after_finalization_does_not_count(tmp_path):
    db = project(tmp_path, base() + [finalized("e1"), assessment("e1", "a1", reward=1.0, at=BEFORE)])
    assert score(db, "e1") == ("excluded", None, "no valid reward by the deadline", 0)
    assert statuses(db, "e1") == [("a1", "late", 0, None)]


def test_score_before_finalization_stays(tmp_path):
    db = project(tmp_path, base() + [assessment("e1", "a1", reward=0.5), finalized("e1"),
                                     assessment("e1", "a2", reward=0.9, at=AFTER)])
    assert score(db, "e1") == ("scored", 0.5, "scored by a1", 1)
    assert statuses(db, "e1") == [("a1", "counts", 0, None), ("a2", "conflict", 1, 0)]


def test_not_assessable_gets_a_zero_reward_dummy(tmp_path):
    db = project(tmp_path, base(status="error", versions=()) + [assessment("e1", "a1", outcome="not_assessable", version="none")])
    assert score(db, "e1") == ("dummy", 0.0, "not assessable (a1): zero-reward dummy", 0)


def test_later_decisive_assessment_never_overwrites_the_first(tmp_path):
    lines = base() + [assessment("e1", "a1", reward=1.0), assessment("e1", "a2", reward=0.0),
                      assessment("e1", "a3", outcome="not_assessable"), assessment("e1", "a4", reward=1.0)]
    db = project(tmp_path, lines)
    assert score(db, "e1") == ("scored", 1.0, "scored by a1", 1)
    assert statuses(db, "e1") == [("a1", "counts", 0, None), ("a2", "conflict", 1, 0),
                                  ("a3", "conflict", 1, 0), ("a4", "conflict", 1, 1)]
    # the first decisive can also be not_assessable
    db2 = project(tmp_path, base() + [assessment("e1", "b1", outcome="not_assessable"), assessment("e1", "b2", reward=1.0)],
                  name="na-first")
    assert score(db2, "e1") == ("dummy", 0.0, "not assessable (b1): zero-reward dummy", 1)


def test_only_the_committed_artifact_version_counts(tmp_path):
    lines = base(versions=("v1", "v2")) + [assessment("e1", "a1", reward=1.0, version="v1"),
                                           assessment("e1", "a2", reward=0.5, version="v2")]
    db = project(tmp_path, lines)
    assert score(db, "e1") == ("scored", 0.5, "scored by a2", 0)
    assert statuses(db, "e1") == [("a1", "stale_version", 0, None), ("a2", "counts", 0, None)]


def test_branch_scoped_rewards_apply_to_their_branch(tmp_path):
    lines = [opened("e1"), request("e1", "r1", [1, 2], [3]), request("e1", "b1", [1, 2, 3, 7], [8]),
             request("e1", "b2", [1, 2, 3, 9], [10]), closed("e1"),
             assessment("e1", "a1", reward=0.25, branch_request_id="b1"),
             assessment("e1", "a2", reward=0.75, branch_request_id="b1"),
             assessment("e1", "a3", outcome="not_assessable", branch_request_id="b2")]
    db = project(tmp_path, lines)
    assert score(db, "e1") == ("scored", None, "branch-scoped rewards only: b1", 0)
    assert db.execute("SELECT branch_request_id, state, reward, assessment_id, conflict FROM branch_scores ORDER BY 1").fetchall() == [
        ("b1", "scored", 0.25, "a1", 1), ("b2", "not_assessable", None, "a3", 0)]
    # with an execution-level reward too, the deepest branch on a path wins
    db2 = project(tmp_path, lines + [assessment("e1", "a4", reward=1.0)], name="both")
    assert score(db2, "e1") == ("scored", 1.0, "scored by a4", 0)
    from ledger.projections.assessment import branch_rewards

    br = branch_rewards(db2, "e1")
    assert br == {"b1": 0.25, "b2": None}
    assert path_reward(["r1", "b1"], 1.0, br) == (True, 0.25)
    assert path_reward(["r1", "b1", "x"], 1.0, br) == (True, 0.25)  # descends from b1
    assert path_reward(["r1", "b2"], 1.0, br) == (False, None)
    assert path_reward(["r1"], 1.0, br) == (True, 1.0)
    assert path_reward(["r1"], None, br) == (False, None)


def test_derived_view_waits_for_revalidation(tmp_path):
    lines = base() + [assessment("e1", "a1", reward=0.5),
                      {"type": "record_derived", "derived_execution_id": "e1r", "parent_execution_id": "e1",
                       "transformation": "redact@1"}]
    db = project(tmp_path, lines)
    assert score(db, "e1r") == ("pending", None, "derived view awaiting Revalidated(pass)", 0)
    reval = {"type": "revalidated", "derived_execution_id": "e1r", "verdict": "pass"}
    db2 = project(tmp_path, lines + [reval], name="pass")
    assert score(db2, "e1r") == ("scored", 0.5, "inherited from parent e1: scored by a1", 0)
    db3 = project(tmp_path, lines + [{**reval, "verdict": "fail"}], name="fail")
    assert score(db3, "e1r") == ("excluded", None, "derived view failed revalidation", 0)


def test_evaluator_critique_in_a_policy_input_stays_context(tmp_path):
    """A critique (generator = evaluator) that reappears in a later policy input is never a
    target: the tree's candidate masks flag only the policy's own outputs."""
    pytest.importorskip("ledger.projections.tree")
    from ledger.projections.tree import tree_view

    lines = [opened("e1"), request("e1", "p1", [1, 2], [3, 4]),
             request("e1", "c1", [1, 2, 3, 4, 50], [60, 61, 62], generator="evaluator"),
             request("e1", "p2", [1, 2, 3, 4, 60, 61, 62], [7, 8]), closed("e1"), assessment("e1", "a1")]
    db = project(tmp_path, lines, with_tree=True)
    view = tree_view(db, "e1", ())
    # flatten per request path: candidate flags along the root-to-leaf path of p2
    from ledger.algorithms.path_draws import path_nodes

    leaf = next(lf for lf in view.leaves if lf.request_id == "p2")
    flags = np.concatenate([view.candidate[n] for n in path_nodes(view.parent, leaf)]).tolist()
    assert flags == [0, 0, 1, 1, 0, 0, 0, 1, 1]
    critique = next(lf for lf in view.leaves if lf.request_id == "c1")
    cflags = np.concatenate([view.candidate[n] for n in path_nodes(view.parent, critique)]).tolist()
    assert cflags == [0, 0, 1, 1, 0, 0, 0, 0]
    assert score(db, "e1") == ("scored", 1.0, "scored by a1", 0)


# ---------------------------------------------------------------------------- convergence

_SCENARIOS = {
    "x1": base("x1") + [assessment("x1", "a1", outcome="evaluator_error"), assessment("x1", "a2", reward=0.5)],
    "x2": base("x2") + [assessment("x2", "a1", reward=1.0, at=AFTER)],
    "x3": base("x3") + [assessment("x3", "a1", outcome="not_assessable"), assessment("x3", "a2", reward=1.0)],
    "x4": [opened("x4"), request("x4", "r1", [1], [2]), finalized("x4")],
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.randoms(use_true_random=False))
def test_scores_are_independent_of_cross_execution_interleaving(tmp_path_factory, rnd):
    """Any interleaving of the per-execution sequences gives the same tables."""
    queues = [list(v) for v in _SCENARIOS.values()]
    merged = []
    while any(queues):
        q = rnd.choice([q for q in queues if q])
        merged.append(q.pop(0))
    tmp = tmp_path_factory.mktemp("inter")
    stamp = lambda lines: [ln if "occurred_at" in ln else {**ln, "occurred_at": BEFORE} for ln in lines]  # noqa: E731
    db = project(tmp, stamp(merged))
    ref = project(tmp, stamp(list(itertools.chain(*_SCENARIOS.values()))), name="ref")
    assert canonical_dump(db) == canonical_dump(ref)
    assert [score(db, x)[0] for x in ("x1", "x2", "x3", "x4")] == ["scored", "excluded", "dummy", "excluded"]
