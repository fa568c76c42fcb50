"""Semantics 3 (SPEC §10, §11.1): the curation results issue 26's audit found wrong, each fixed for routes
declared from the third release on, each kept on a route of an earlier version (whose published
manifests must keep their meaning).

Routes declared here carry no ``semantics``: ingest stamps 3.  A route pinned to an earlier version is
ingested the way the release that wrote it did (the ``earlier_release`` fixture).
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.cli import main as cli
from ledger.events import semantics
from ledger.events.validate import ValidationError, validate_line
from ledger.projections.admission import family_representative
from ledger.projections.governance import GovernanceProjection
from tests.helpers import closed, interleave, request, table_dump, write_lines
from tests.test_admission import STAMP, adm, route, scored, tree_execution
from tests.test_admission import project as _project

NOW = 1_900_000_000_000_000


def project(tmp_path, lines, *, name: str = "s"):
    """Tree, assessment, governance (derived views) and admission projections over ``lines``."""
    return _project(tmp_path, lines, name=name, extra=(GovernanceProjection(),))


def r3(name: str = "sft", **kw) -> dict:
    return route(name, semantics=None, **kw)


def pinned(name: str, version: int, **kw) -> dict:
    return route(name, semantics=version, **kw)


def branch(ex: str, rid: str, reward: float, aid: str) -> dict:
    return scored(ex, reward, aid, branch_request_id=rid)


def rewards(db, ex: str, r: str) -> dict[str, float]:
    return dict(db.execute("SELECT leaf_request_id, reward FROM admitted_paths WHERE route = ? AND execution_id = ?",
                           (r, ex)).fetchall())


# ============================================================================ 2. the version is the ledger's stamp


def _route_line(**kw) -> dict:
    return {"type": "admission_policy", "route": "r", "version": 1, "use": "sft", "split": "train", "j_max": 2, **kw}


@pytest.mark.parametrize("declared", [1, 2, 4])
def test_a_route_line_declaring_a_semantics_version_is_refused(declared):
    with pytest.raises(ValidationError) as exc:
        validate_line(_route_line(semantics=declared), line=4, now_micros=NOW)
    assert exc.value.field == "semantics" and "line 4" in str(exc.value)
    assert "stamped by the ledger, not chosen by the producer" in str(exc.value)


def test_ingest_stamps_the_current_version_and_a_line_naming_it_is_accepted():
    assert semantics.CURRENT == 3
    ev = validate_line(_route_line(), now_micros=NOW)
    assert ev["semantics"] == 3 and "semantics" in ev["stamped"]
    assert validate_line(_route_line(semantics=3), now_micros=NOW)["semantics"] == 3


def test_cli_refuses_an_old_semantics_for_a_new_route_and_appends_nothing(tmp_path, monkeypatch, capsys):
    """Issue 26, wrong result 2: a new route declaring semantics 1 imitated a hard negative and signed
    final-test tasks.  Now: exit 2, the field named, nothing from the file on the log."""
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    assert cli(["init"]) == 0
    assert cli(["keys", "new", "--out", str(tmp_path / "gov.key")]) == 0
    raw = write_lines(tmp_path / "r.jsonl", [{**_route_line(), "route": "ok", "occurred_at": STAMP},
                                             {**_route_line(split="final_test", semantics=1), "occurred_at": STAMP}])
    capsys.readouterr()
    assert cli(["sign", "--key", str(tmp_path / "gov.key"), raw]) == 0
    (tmp_path / "r.signed.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", str(tmp_path / "r.signed.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "line 2: field 'semantics': is stamped by the ledger" in err and "Traceback" not in err
    assert cli(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["log"]["events"] == 0


@pytest.mark.usefixtures("earlier_release")
def test_routes_already_on_the_log_keep_their_stamps_on_replay(tmp_path):
    db = project(tmp_path, tree_execution("e") + [scored("e"), pinned("one", 1), pinned("two", 2), r3("three")])
    assert db.execute("SELECT route, semantics FROM routes ORDER BY route").fetchall() == [
        ("one", 1), ("three", 3), ("two", 2)]


# ============================================================================ 1. branch rewards on every route


def _branched(whole: float) -> list[dict]:
    """tree_execution: leaves r3 (below r1), s1 and r4 (below r2).  Branch r3 scored 1, branch r2 scored
    0, then a whole-execution score arrives."""
    return tree_execution("e") + [branch("e", "r3", 1.0, "b1"), branch("e", "r2", 0.0, "b2"), scored("e", whole, "w")]


@pytest.mark.usefixtures("earlier_release")
def test_a_later_whole_execution_score_never_replaces_a_branch_score(tmp_path):
    lines = _branched(0.5) + [r3("rl", use="rl"), pinned("rl2", 2, use="rl")]
    db = project(tmp_path, lines)
    assert rewards(db, "e", "rl") == {"r3": 1.0, "s1": 0.0, "r4": 0.0}
    assert rewards(db, "e", "rl2") == {"r3": 0.5, "s1": 0.5, "r4": 0.5}  # what semantics 2 reported (the bug)
    from ledger.corpus.export import trainer_records

    assert sorted((r["leaf_request_id"], r["reward"]) for r in trainer_records(db, "rl")) == [
        ("r3", 1.0), ("r4", 0.0), ("s1", 0.0)]


@pytest.mark.usefixtures("earlier_release")
def test_sft_min_reward_applies_per_path(tmp_path):
    """Whole-execution 1.0, branch r2 failed: the paths through r2 are not imitated (semantics 2 imitated them)."""
    db = project(tmp_path, _branched(1.0) + [r3("sft"), pinned("sft2", 2)])
    assert adm(db, "e", "sft")[:2] == ("admitted", None)
    assert rewards(db, "e", "sft") == {"r3": 1.0}
    assert rewards(db, "e", "sft2") == {"r3": 1.0, "s1": 1.0, "r4": 1.0}
    # every path below a failed branch and a failing whole score: nothing reaches the bar
    db = project(tmp_path, tree_execution("e") + [branch("e", "r1", 0.0, "b"), scored("e", 1.0, "w"), r3("sft")],
                 name="t")
    got = adm(db, "e", "sft")
    assert got[:3] == ("rejected", "outcome", "fail") and "no path reaches min_reward 1" in got[4]


# ============================================================================ 3. views inherit roles


def _hard_negative_view(view_selection: dict | None, replacements: dict | None = None, verified=()) -> list[dict]:
    lines = tree_execution("hn") + [scored("hn", 1.0),
                                    {"type": "target_selection", "execution_id": "hn", "selection_id": "neg",
                                     "policy": "labels@1", "behavioral_role": "hard_negative"},
                                    {"type": "record_derived", "derived_execution_id": "hn.v", "parent_execution_id": "hn",
                                     "transformation": "noop@1", "replacements": replacements or {}},
                                    {"type": "revalidated", "derived_execution_id": "hn.v", "verdict": "pass",
                                     "verified_request_ids": list(verified)}]
    if view_selection is not None:
        lines.append({"type": "target_selection", "execution_id": "hn.v", "selection_id": "relabel",
                      "policy": "labels@2", **view_selection})
    return lines


@pytest.mark.usefixtures("earlier_release")
def test_a_no_op_view_cannot_launder_a_hard_negative(tmp_path):
    """Issue 26, wrong result 3: a record_derived view with no replacements whose own selection says
    direct put the deficient output into an sft corpus (semantics 2 still does)."""
    db = project(tmp_path, _hard_negative_view({"behavioral_role": "direct"}) + [r3("sft"), pinned("sft2", 2)])
    got = adm(db, "hn.v", "sft")
    assert got[:3] == ("rejected", "target_suitability", "fail") and "hard negative (neg on hn)" in got[4]
    assert adm(db, "hn", "sft")[:2] == ("rejected", "target_suitability")
    assert adm(db, "hn.v", "sft2")[0] == "admitted"  # the second release's rule: the view's selection won


@pytest.mark.usefixtures("earlier_release")
def test_a_views_selection_reaches_only_what_it_replaced_and_revalidated(tmp_path):
    from ledger.projections.admission import inherited_selection

    base = tree_execution("p") + [scored("p", 1.0),
                                  {"type": "target_selection", "execution_id": "p", "selection_id": "s",
                                   "policy": "t@1", "behavioral_role": "direct", "selected_request_ids": ["r2", "r4"]}]
    view = {"type": "record_derived", "derived_execution_id": "p.v", "parent_execution_id": "p",
            "transformation": "redact@1", "replacements": {"r4": {"output_ids": [15, 16, 99]}}}
    own = {"type": "target_selection", "execution_id": "p.v", "selection_id": "mine", "policy": "t@2",
           "behavioral_role": "recovery", "context_only_request_ids": ["r2", "r4"], "selected_request_ids": ["r3"]}
    for verified, want in ((["r4"], {"r2": False, "r3": True, "r4": True}),
                           ([], {"r2": False, "r3": True, "r4": False})):
        reval = {"type": "revalidated", "derived_execution_id": "p.v", "verdict": "pass", "verified_request_ids": verified}
        db = project(tmp_path, base + [view, reval, own, r3("sft")], name=f"v{len(verified)}")
        sel = inherited_selection(db, "p.v")
        # r2, r3: the original's selection decides (r2 selected, r3 not); r4: the view's, once revalidated
        assert {rid: sel.is_context(rid) for rid in ("r2", "r3", "r4")} == want
        assert (sel.role, sel.selection_id, sel.made_on) == ("direct", "s", "p")  # the original's role stands


# ============================================================================ 7. one episode, one member


@pytest.mark.usefixtures("earlier_release")
def test_one_member_per_lineage_family(tmp_path):
    lines = tree_execution("raw") + [scored("raw", 1.0)]
    lines += [{"type": "record_derived", "derived_execution_id": v, "parent_execution_id": p, "transformation": "redact@1"}
              for v, p in (("raw.a", "raw"), ("raw.a.b", "raw.a"), ("raw.c", "raw"))]
    lines += [{"type": "revalidated", "derived_execution_id": v, "verdict": verdict}
              for v, verdict in (("raw.a", "pass"), ("raw.c", "pass"))]
    db = project(tmp_path, lines + [r3("sft"), pinned("sft2", 2)])
    states = dict(db.execute("SELECT execution_id, state || ':' || COALESCE(reason, '') FROM admission "
                             "WHERE route = 'sft'").fetchall())
    # raw.a.b is deeper but not revalidated (pending): raw.a wins (raw.a < raw.c at equal depth)
    assert states == {"raw": "rejected:superseded by raw.a", "raw.a": "admitted:admitted",
                      "raw.a.b": "unresolved:derived view awaiting Revalidated(pass)",
                      "raw.c": "rejected:superseded by raw.a"}
    assert {r[0] for r in db.execute("SELECT DISTINCT execution_id FROM admitted_paths WHERE route = 'sft'")} == {"raw.a"}
    assert {r[0] for r in db.execute("SELECT DISTINCT execution_id FROM admitted_paths WHERE route = 'sft2'")} == {
        "raw", "raw.a", "raw.c"}  # semantics 2 trained the episode three times
    # the deepest view passes later: it supersedes the rest
    db = project(tmp_path, lines + [{"type": "revalidated", "derived_execution_id": "raw.a.b", "verdict": "pass"},
                                    r3("sft")], name="t")
    assert db.execute("SELECT execution_id FROM admission WHERE route = 'sft' AND state = 'admitted'").fetchall() == [
        ("raw.a.b",)]
    from ledger.corpus.export import accounting

    assert accounting(db, "sft")["dispositions"]["redundancy"] == {
        "lineage_family: superseded by raw.a.b": 3}


_VERDICTS = st.sampled_from(["pass", "fail", None])


@st.composite
def families(draw):
    """A few lineage families: each a root and up to four views, each view of an earlier member."""
    out = []
    for f in range(draw(st.integers(1, 3))):
        root = f"f{f}"
        members = [root]
        views = []
        for i in range(draw(st.integers(0, 4))):
            parent = draw(st.sampled_from(members))
            v = f"{root}.v{i}"
            members.append(v)
            views.append((v, parent, draw(_VERDICTS)))
        out.append((root, views))
    return out


def _family_lines(fams) -> list[dict]:
    lines = []
    for root, views in fams:
        lines += tree_execution(root, task=f"task-{root}") + [scored(root, 1.0)]
        for v, parent, verdict in views:
            lines.append({"type": "record_derived", "derived_execution_id": v, "parent_execution_id": parent,
                          "transformation": "redact@1"})
            if verdict is not None:
                lines.append({"type": "revalidated", "derived_execution_id": v, "verdict": verdict})
    return lines + [r3("sft"), r3("rl", use="rl")]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(fams=families(), seed=st.integers(0, 2**32 - 1))
def test_one_member_per_family_converges_under_every_interleaving(tmp_path_factory, fams, seed):
    """Hypothesis: whatever the family shapes, revalidation verdicts and arrival order, each route emits at
    most one execution per family -- the deepest view whose revalidation passed, else the root -- and the
    admission tables are the same for every interleaving."""
    tmp = tmp_path_factory.mktemp("fam")
    lines = _family_lines(fams)
    db = project(tmp, lines, name="ref")
    for root, views in fams:
        members = {root} | {v for v, _p, _verdict in views}
        want = family_representative(db, root, members)
        depth = {root: 0}
        for v, p, _verdict in views:
            depth[v] = depth[p] + 1
        passed = [v for v, _p, verdict in views if verdict == "pass"]
        assert want == (min(passed, key=lambda v: (-depth[v], v)) if passed else root)
        for r in ("sft", "rl"):
            emitted = {x for (x,) in db.execute(
                f"SELECT execution_id FROM admission WHERE route = ? AND state IN ('admitted', 'dummy') AND "
                f"execution_id IN ({','.join('?' * len(members))})", (r, *sorted(members)))}
            assert emitted <= {want} and len(emitted) <= 1
    tables = ("admission", "admitted_paths")
    mixed = project(tmp, interleave(lines, random.Random(seed), stream=lambda line: line.get(
        "execution_id", line.get("derived_execution_id", "gov")).split(".")[0]), name="mix")
    assert table_dump(mixed, tables) == table_dump(db, tables)


# ============================================================================ hard-negative basis (SPEC 11.2)


def test_a_preference_pair_cites_the_hard_negative_basis_and_the_datasheet_counts_it(tmp_path):
    from ledger.projections.admission import current_routes, hard_negative_counts
    from tests.test_preference import hard_negative, pref, project as pref_project, records, rollout

    basis = {"signal": "regression test fails after the edit", "divergence_request_id": "r1",
             "note": "grader flaky on 2% of runs"}
    lines = (rollout("good", "ta", [4, 5], 1.0) + rollout("neg", "ta", [4, 6], 1.0) + [
        {**hard_negative("neg", "hn-basis"), "basis": basis}] + rollout("neg2", "ta", [4, 7], 1.0)
        + [hard_negative("neg2", "hn-plain")] + [pref(j_max=2)])
    db = pref_project(tmp_path, lines)
    crit = sorted(r["criterion"] for r in records(db))
    assert crit == ['hard_negative:hn-basis basis={"divergence_request_id":"r1","note":"grader flaky on 2% of runs",'
                    '"signal":"regression test fails after the edit"}', "hard_negative:hn-plain"]
    assert hard_negative_counts(db, current_routes(db)["pref"]) == {"with_basis": 1, "without_basis": 1}


def test_a_basis_without_a_signal_is_refused_naming_the_field():
    line = {"type": "target_selection", "execution_id": "e", "selection_id": "s", "policy": "p",
            "behavioral_role": "hard_negative", "basis": {"divergence_request_id": "r3"}}
    with pytest.raises(ValidationError) as exc:
        validate_line(line, line=9, now_micros=NOW)
    assert exc.value.field == "basis" and "basis.signal is required" in str(exc.value) and "line 9" in str(exc.value)
