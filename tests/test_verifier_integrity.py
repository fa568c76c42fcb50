"""Verifier integrity (SPEC §6.10): protected paths (seed 002 §15.5.2 Listing 1) and grader
calibration against adequate / inadequate controls (seed 002 §15.3.2)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms.path_globs import OUTSIDE, matches, normalize_path, violations
from ledger.cli import main as cli
from ledger.events.validate import ValidationError, validate_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections.admission import AdmissionProjection
from ledger.projections.assessment import AssessmentProjection
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.tree import TreeProjection
from ledger.projections.verifier import VerifierProjection, graders, protected_paths_verdict
from tests.helpers import closed, interleave, request, table_dump, write_lines
from tests.test_admission import SIGNER, adm, fake_evidence, opened, route, scored
from tests.test_use_specific import r2

NOW = 1_900_000_000_000_000
PROTECTED = ["tests/**", ".github/workflows/*", "pyproject.toml"]


def task(task_id: str, protected=None, allowed=None) -> dict:
    line = {"type": "task_registered", "task_id": task_id}
    if protected is not None:
        line["protected_paths"] = protected
    if allowed is not None:
        line["allowed_paths"] = allowed
    return line


def diff(ex: str, paths: list[str], version: str = "v1", **kw) -> dict:
    return {"type": "artifact_diff", "execution_id": ex, "artifact_version": version, "base_commit": "abc123",
            "changed_paths": paths, **kw}


def control(ex: str, evaluator: str, kind: str) -> dict:
    return {"type": "grader_control", "execution_id": ex, "evaluator": evaluator, "kind": kind,
            "expected_verdict": "pass" if kind == "adequate" else "fail"}


def run(ex: str, task_id: str = "repair") -> list[dict]:
    return [opened(ex, task_id), request(ex, "r1", [1, 2], [3, 4]), closed(ex)]


def outcome_pass(ex: str, route_name: str = "sft") -> dict:
    return {"type": "predicate_evaluated", "execution_id": ex, "route": route_name, "predicate": "tests",
            "verdict": "pass", "verifier": "pytest@1"}


def project(tmp_path, lines, name: str = "s", log=None):
    """JSON lines -> ingest (the producers API, as `ledger ingest`) -> replay with the verifier projection."""
    log = log or open_log(str(tmp_path / name), create=True)
    Ingestor(log, SIGNER.trust, seal=None).ingest_lines(enumerate(lines, 1))
    db = connect(tmp_path / f"{name}.db")
    ReplayEngine(log, db, [TreeProjection(), AssessmentProjection(), VerifierProjection(),
                           AdmissionProjection(fake_evidence())], trust=SIGNER.trust).run()
    return db, log


# ============================================================================ glob semantics


@pytest.mark.parametrize("glob, path, want", [
    ("tests/**", "tests/test_x.py", True), ("tests/**", "tests/unit/deep/test_y.py", True), ("tests/**", "tests", True),
    ("tests/**", "src/tests/test_x.py", False), ("tests/**", "tests_helpers.py", False),
    (".github/workflows/*", ".github/workflows/ci.yml", True), (".github/workflows/*", ".github/workflows/sub/ci.yml", False),
    (".github/workflows/*", ".github/ci.yml", False),
    ("pyproject.toml", "pyproject.toml", True), ("pyproject.toml", "pkg/pyproject.toml", False),
    ("**/pyproject.toml", "pkg/pyproject.toml", True), ("**/pyproject.toml", "pyproject.toml", True),
    ("tests/regression/test_*.py", "tests/regression/test_missed_wakeup.py", True),
    ("tests/regression/test_*.py", "tests/regression/deep/test_a.py", False), ("a/**/b", "a/b", True),
    ("a/**/b", "a/x/y/b", True), ("*.py", "src/a.py", False), ("t?st[!x]", "test1", True), ("[ab]", "c", False),
    ("tests/", "tests/a.py", True), ("a[b", "a[b", True), ("**", "any/thing", True),
])
def test_glob_semantics(glob, path, want):
    assert matches(path, glob) is want


def test_paths_are_normalised_and_escaping_paths_always_violate():
    assert normalize_path("src/../tests/test_x.py") == "tests/test_x.py"
    assert normalize_path("./a//b/") == "a/b" and normalize_path("../etc/passwd") is None
    policies = [(PROTECTED, ["tests/regression/test_*.py"])]
    assert violations(["src/pool.py", "src/../tests/test_pool.py", "tests/regression/test_a.py", "../x"], policies) == [
        ("../x", OUTSIDE), ("tests/test_pool.py", "tests/**")]
    # every registration of a task is enforced: the second one's allowance does not lift the first's protection
    assert violations(["tests/a.py"], [(["tests/**"], []), (["docs/**"], ["tests/**"])]) == [("tests/a.py", "tests/**")]
    assert violations(["tests/a.py"], [([], ["x"])]) == []  # nothing protected


# ============================================================================ validation


@pytest.mark.parametrize("line, field, message", [
    (diff("e", ["ok", ""]), "changed_paths", "[1] must be a non-empty string"),
    (diff("e", ["a\x00b"]), "changed_paths", "[0] contains a NUL character"),
    (diff("e", "tests/x.py"), "changed_paths", "expected a JSON array of paths"),
    ({k: v for k, v in diff("e", ["a"]).items() if k != "changed_paths"}, "changed_paths", "is required"),
    ({k: v for k, v in diff("e", ["a"]).items() if k != "artifact_version"}, "artifact_version", "is required"),
    (diff("e", ["a"], diff=7), "diff", "expected the unified diff as a string"),
    (diff("e", ["a"], base_commit=""), "base_commit", "non-empty string"),
    (task("t", protected=[""]), "protected_paths", "[0] must be a non-empty string"),
    (task("t", protected="tests/**"), "protected_paths", "expected a JSON array"),
    (task("t", allowed=[3]), "allowed_paths", "[0] must be a non-empty string"),
    (task("t", allowed=["x\x00"]), "allowed_paths", "NUL"),
    ({**control("e", "g@1", "adequate"), "kind": "good"}, "kind", "expected one of adequate, inadequate"),
    ({**control("e", "g@1", "adequate"), "expected_verdict": "maybe"}, "expected_verdict", "expected one of pass, fail"),
    ({**control("e", "g@1", "adequate"), "expected_verdict": "fail"}, "expected_verdict",
     "an adequate control is expected to pass, not 'fail'"),
    ({**control("e", "g@1", "inadequate"), "expected_verdict": "pass"}, "expected_verdict",
     "an inadequate control is expected to fail"),
    ({k: v for k, v in control("e", "g@1", "adequate").items() if k != "evaluator"}, "evaluator", "is required"),
    ({"type": "admission_policy", "route": "r", "version": 1, "use": "sft", "split": "train", "j_max": 1,
      "predicates": [{"name": "protected_paths", "family": "outcome"}]}, "predicates",
     "'protected_paths' is computed by the ledger (family process)"),
    ({"type": "admission_policy", "route": "r", "version": 1, "use": "sft", "split": "train", "j_max": 1,
      "predicates": [{"name": "protected_paths", "repetitions": {"runs": 2}}]}, "predicates",
     "protected_paths is computed by the ledger"),
])
def test_bad_lines_are_refused_naming_the_field(line, field, message):
    with pytest.raises(ValidationError) as exc:
        validate_line(line, line=3, now_micros=NOW)
    assert exc.value.field == field and exc.value.line == 3
    assert message in str(exc.value)


def test_good_lines_and_natural_keys():
    d = validate_line(diff("run/1", ["tests/x.py"], diff="--- a\n+++ b\n"), now_micros=NOW)
    assert d["event_id"] == "artifact_diff/run%2F1/v1" and d["changed_paths"] == ["tests/x.py"]
    c = validate_line(control("e1", "repair_accept_v1@1", "inadequate"), now_micros=NOW)
    assert c["event_id"] == "grader_control/e1/repair_accept_v1@1" and c["expected_verdict"] == "fail"
    t = validate_line(task("t1"), now_micros=NOW)  # older lines stay valid
    assert (t["protected_paths"], t["allowed_paths"]) == ([], [])
    r = validate_line({"type": "admission_policy", "route": "r", "version": 1, "use": "sft", "split": "train",
                       "j_max": 1, "predicates": ["protected_paths"]}, now_micros=NOW)
    assert json.loads(r["predicates"]) == [{"name": "protected_paths", "family": "process", "depends_on": []}]


def test_an_artifact_diff_for_an_unknown_execution_is_refused_and_nothing_appended(tmp_path):
    from ledger.producers.ingest import IngestError

    log = open_log(str(tmp_path / "s"), create=True)
    with pytest.raises(IngestError) as exc:
        Ingestor(log, SIGNER.trust, seal=None).ingest_lines(enumerate([task("repair"), diff("ghost", ["a.py"])], 1))
    assert "line 2" in str(exc.value) and "'ghost' was never opened" in str(exc.value)
    assert log.end_offsets() == {("log", 0): 0}


# ============================================================================ protected paths (Listing 1)


def _listing1() -> list[dict]:
    lines = [task("repair", PROTECTED, ["tests/regression/test_*.py"]), task("docs")]
    # the tampered reproducer: the missed-wakeup assertion replaced by `assert True`; the tests "pass"
    lines += run("tampered") + [diff("tampered", ["src/pool.py", "tests/test_pool.py"]), scored("tampered", 1.0),
                                outcome_pass("tampered")]
    # a real fix that adds a new regression test (allowed by the task's patch-admission policy)
    lines += run("fixed") + [diff("fixed", ["src/pool.py", "tests/regression/test_missed_wakeup.py"]),
                             scored("fixed", 1.0), outcome_pass("fixed")]
    lines += run("ci") + [diff("ci", [".github/workflows/ci.yml"]), scored("ci", 1.0), outcome_pass("ci")]
    lines += run("nodiff") + [scored("nodiff", 1.0), outcome_pass("nodiff")]
    lines += run("doc", "docs") + [scored("doc", 1.0), outcome_pass("doc")]
    lines += [r2("sft", predicates=[{"name": "tests", "family": "outcome"}]),
              route("old", predicates=[{"name": "tests", "family": "outcome"}]),
              r2("named", predicates=["protected_paths"])]
    lines += [outcome_pass(ex, "old") for ex in ("tampered", "fixed", "ci", "nodiff", "doc")]
    return lines


@pytest.mark.usefixtures("earlier_release")
def test_listing_1_tampered_test_is_rejected_whatever_the_tests_say(tmp_path):
    db, _ = project(tmp_path, _listing1())
    assert adm(db, "tampered") == (
        "rejected", "protected_paths", "fail", None,
        "artifact v1 changes protected path tests/test_pool.py (protected by tests/**), not allowed by the task",
        1.0, 0, 0)
    assert adm(db, "fixed") == ("admitted", None, "pass", None, "admitted", 1.0, 2, 1)
    assert adm(db, "ci")[:3] == ("rejected", "protected_paths", "fail")
    assert "ci.yml (protected by .github/workflows/*)" in adm(db, "ci")[4]
    assert adm(db, "nodiff")[:5] == ("unresolved", "protected_paths", "pending", "artifact_diff v1",
                                     "no artifact_diff for v1")
    # a task without protected paths is untouched on routes that do not name the predicate ...
    assert adm(db, "doc")[:2] == ("admitted", None)
    # ... and unknown (never a pass) on a route that names it
    assert adm(db, "doc", "named")[:5] == ("unresolved", "protected_paths", "unknown", "protected_paths of task docs",
                                           "task docs declares no protected_paths")
    assert adm(db, "tampered", "named")[:2] == ("rejected", "protected_paths")
    # the first release's rules are unchanged on a semantics-1 route: the tampered run is admitted there
    assert {ex: adm(db, ex, "old")[0] for ex in ("tampered", "fixed", "ci", "nodiff", "doc")} == dict.fromkeys(
        ("tampered", "fixed", "ci", "nodiff", "doc"), "admitted")
    tel = db.execute("SELECT rejected, unresolved, rejected_by FROM route_telemetry WHERE route = 'sft'").fetchone()
    assert tel == (2, 1, json.dumps({"protected_paths": 2}))


def test_the_checked_version_is_the_one_the_counting_assessment_assessed(tmp_path):
    lines = [task("repair", PROTECTED)] + [opened("e", "repair"), request("e", "r1", [1], [2]),
                                           closed("e", versions=("v1", "v2")),
                                           diff("e", ["tests/test_a.py"], "v1"), diff("e", ["src/a.py"], "v2"),
                                           scored("e", 1.0, artifact_version="v2"), r2()]
    db, _ = project(tmp_path, lines)
    assert adm(db, "e")[:2] == ("admitted", None)  # v2 (committed and assessed) is clean; v1 is not checked
    lines2 = lines[:-2] + [r2()]  # no counting assessment: the committed (last closed) version is checked
    db2, _ = project(tmp_path, lines2, name="t")
    assert adm(db2, "e")[:3] == ("unresolved", "target_suitability", "pending")  # passed protected_paths (v2 clean)
    # a second, different diff of one version is a conflict (natural key (execution, artifact_version)): refused
    log = open_log(str(tmp_path / "u"), create=True)
    report = Ingestor(log, SIGNER.trust, seal=None).ingest_lines(enumerate(
        run("e") + [diff("e", ["src/a.py"]), diff("e", ["tests/test_a.py"], event_id="second-diff")], 1))
    assert report.appended == 0 and [c["natural_key"] for c in report.conflicts] == ["artifact_diff/e/v1"]


@pytest.mark.usefixtures("earlier_release")
def test_derived_views_inherit_the_parents_verdict(tmp_path):
    lines = _listing1() + [{"type": "record_derived", "derived_execution_id": "tampered.redacted",
                            "parent_execution_id": "tampered", "transformation": "redact@1"},
                           {"type": "revalidated", "derived_execution_id": "tampered.redacted", "verdict": "pass"},
                           {"type": "record_derived", "derived_execution_id": "fixed.redacted",
                            "parent_execution_id": "fixed", "transformation": "redact@1"},
                           {"type": "revalidated", "derived_execution_id": "fixed.redacted", "verdict": "pass"}]
    db, _ = project(tmp_path, lines)
    got = adm(db, "tampered.redacted", "named")
    assert got[:3] == ("rejected", "protected_paths", "fail")
    assert got[4].startswith("parent tampered: artifact v1 changes protected path tests/test_pool.py")
    assert protected_paths_verdict(db, "fixed.redacted") == ("pass", "", None)
    assert adm(db, "fixed.redacted", "named")[1] != "protected_paths"


def test_late_policy_and_late_diff_re_evaluate_the_tasks_executions(tmp_path):
    base = run("tampered") + [diff("tampered", ["tests/test_pool.py"]), scored("tampered", 1.0)] + \
        run("fixed") + [scored("fixed", 1.0)] + [r2()]
    db, log = project(tmp_path, base)
    assert adm(db, "tampered")[:2] == ("admitted", None) and adm(db, "fixed")[:2] == ("admitted", None)
    db, _ = project(tmp_path, [task("repair", PROTECTED)], log=log)  # the policy arrives: both re-evaluated
    assert adm(db, "tampered")[:3] == ("rejected", "protected_paths", "fail")
    assert adm(db, "fixed")[:4] == ("unresolved", "protected_paths", "pending", "artifact_diff v1")
    db, _ = project(tmp_path, [diff("fixed", ["src/pool.py"])], log=log)
    assert adm(db, "fixed")[:2] == ("admitted", None)
    assert db.execute("SELECT paths FROM admission WHERE route = 'sft' AND execution_id = 'fixed'").fetchone() == (1,)


# ============================================================================ grader calibration (seed 002 §15.3.2)

REPAIR, REPAIR_OLD = "repair_accept_v1@2", "repair_accept_v1@1"
REPORT = "report_comparison_v1.rubric@1"


def graded(ex: str, evaluator: str, reward: float | None, aid: str = "a1", task_id: str = "repair") -> list[dict]:
    if reward is None:
        a = {"type": "assessment", "assessment_id": aid, "execution_id": ex, "artifact_version": "v1",
             "outcome": "not_assessable", "evaluator": evaluator}
    else:
        a = scored(ex, reward, aid, evaluator=evaluator)
    return run(ex, task_id) + [a]


def _calibration_lines() -> list[dict]:
    lines = []
    # connection-pool repair: the reference patch (adequate) and the missed-wakeup bug kept (inadequate)
    lines += graded("ref_patch", REPAIR, 1.0) + [control("ref_patch", REPAIR, "adequate")]
    lines += graded("missed_wakeup", REPAIR, 0.0) + [control("missed_wakeup", REPAIR, "inadequate")]
    # the previous harness version accepts the missed-wakeup control: a false acceptance
    lines += [scored("ref_patch", 1.0, "old1", evaluator=REPAIR_OLD), scored("missed_wakeup", 1.0, "old1", evaluator=REPAIR_OLD),
              control("ref_patch", REPAIR_OLD, "adequate"), control("missed_wakeup", REPAIR_OLD, "inadequate")]
    # read-only report_comparison_v1: one adequate control (grounded abstention), three inadequate ones
    lines += graded("grounded", REPORT, 1.0, task_id="report") + [control("grounded", REPORT, "adequate")]
    lines += graded("swapped", REPORT, 0.0, task_id="report") + [control("swapped", REPORT, "inadequate")]
    lines += graded("invented", REPORT, 1.0, task_id="report") + [control("invented", REPORT, "inadequate")]
    lines += graded("empty", REPORT, None, task_id="report") + [control("empty", REPORT, "inadequate")]
    # candidates graded by each evaluator
    lines += graded("cand", REPAIR, 1.0) + graded("cand_old", REPAIR_OLD, 1.0) + \
        graded("cand_report", REPORT, 1.0, task_id="report")
    lines += [r2("cal", calibrated_evaluators=True), r2("plain"), r2("eval", use="evaluation")]
    return lines


def test_calibrated_routes_count_only_calibrated_evaluators(tmp_path):
    db, _ = project(tmp_path, _calibration_lines())
    assert adm(db, "cand", "cal") == ("admitted", None, "pass", None, "admitted", 1.0, 2, 1)
    assert adm(db, "cand_old", "cal")[:5] == (
        "unresolved", "calibrated_evaluators", "unknown", f"calibration of {REPAIR_OLD}",
        f"evaluator {REPAIR_OLD} not calibrated: misclassified controls missed_wakeup")
    assert adm(db, "cand_report", "cal")[4] == (f"evaluator {REPORT} not calibrated: misclassified controls invented")
    # without the option nothing changes for candidates
    assert [adm(db, ex, "plain")[0] for ex in ("cand", "cand_old", "cand_report")] == ["admitted"] * 3
    # controls are never admitted, on any route of the current rules
    for ex in ("ref_patch", "missed_wakeup", "grounded", "invented"):
        for r in ("cal", "plain", "eval"):
            state, pred, verdict, _m, reason = adm(db, ex, r)[:5]
            assert (state, pred, verdict) == ("rejected", "grader_control", "fail"), (ex, r)
    assert adm(db, "ref_patch", "plain")[4] == (f"calibration control: adequate control for {REPAIR_OLD}; "
                                                "controls are never admitted")


def test_graders_report_exact_rates(tmp_path):
    db, _ = project(tmp_path, _calibration_lines())
    by = {g["evaluator"]: g for g in graders(db)}
    assert sorted(by) == sorted([REPORT, REPAIR_OLD, REPAIR])
    assert by[REPAIR] == {
        "evaluator": REPAIR, "calibrated": True, "why_not": "", "misclassified": [], "not_assessed": [], "conflicting": [],
        "controls": [{"execution_id": "missed_wakeup", "kind": "inadequate", "expected": "fail", "observed": "fail"},
                     {"execution_id": "ref_patch", "kind": "adequate", "expected": "pass", "observed": "pass"}],
        "false_acceptance": {"inadequate_passed": 0, "inadequate_assessed": 1, "rate": 0.0},
        "false_rejection": {"adequate_failed": 0, "adequate_assessed": 1, "rate": 0.0}}
    assert (by[REPAIR_OLD]["calibrated"], by[REPAIR_OLD]["misclassified"]) == (False, ["missed_wakeup"])
    assert by[REPAIR_OLD]["false_acceptance"]["rate"] == 1.0 and by[REPAIR_OLD]["false_rejection"]["rate"] == 0.0
    rep = by[REPORT]
    assert [(c["execution_id"], c["observed"]) for c in rep["controls"]] == [
        ("empty", "fail"), ("grounded", "pass"), ("invented", "pass"), ("swapped", "fail")]  # not_assessable is a fail
    assert rep["false_acceptance"] == {"inadequate_passed": 1, "inadequate_assessed": 3, "rate": 1 / 3}
    assert rep["false_rejection"] == {"adequate_failed": 0, "adequate_assessed": 1, "rate": 0.0}
    assert rep["misclassified"] == ["invented"] and rep["calibrated"] is False


def test_missing_kind_and_unassessed_controls_keep_an_evaluator_uncalibrated(tmp_path):
    g = "only_adequate@1"
    lines = graded("ok", g, 1.0) + [control("ok", g, "adequate")] + graded("cand", g, 1.0)
    lines += [r2("cal", calibrated_evaluators=True)]
    db, log = project(tmp_path, lines)
    assert adm(db, "cand", "cal")[4] == f"evaluator {g} not calibrated: no inadequate control"
    # an inadequate control is declared but not yet assessed
    db, _ = project(tmp_path, run("bug") + [control("bug", g, "inadequate")], log=log)
    assert adm(db, "cand", "cal")[4] == f"evaluator {g} not calibrated: controls not yet assessed bug"
    assert graders(db)[0]["false_acceptance"] == {"inadequate_passed": 0, "inadequate_assessed": 0, "rate": None}
    # its first decisive assessment fails it as expected: the evaluator is calibrated and the candidate admitted
    db, _ = project(tmp_path, [scored("bug", 0.0, "b1", evaluator=g), scored("bug", 1.0, "b2", evaluator=g)], log=log)
    assert adm(db, "cand", "cal")[:2] == ("admitted", None)
    assert graders(db)[0]["controls"][0]["observed"] == "fail"  # the first decisive one, not the later 1.0


def test_ledger_graders_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    assert cli(["init"]) == 0
    lines = graded("ref_patch", REPAIR, 1.0) + [control("ref_patch", REPAIR, "adequate")] + \
        graded("missed_wakeup", REPAIR, 1.0) + [control("missed_wakeup", REPAIR, "inadequate")]
    assert cli(["ingest", "--no-seal", write_lines(tmp_path / "e.jsonl", lines)]) == 0
    capsys.readouterr()
    assert cli(["graders", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(g["evaluator"], g["calibrated"], g["false_acceptance"]["rate"], g["false_rejection"]["rate"])
            for g in out] == [(REPAIR, False, 1.0, 0.0)]
    assert cli(["graders"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[:2] == [
        f"{REPAIR}: NOT calibrated (misclassified controls missed_wakeup)",
        "  false acceptance 1.000 (1/1), false rejection 0.000 (0/1)"]
    assert "  missed_wakeup: inadequate, expected fail, observed pass  MISCLASSIFIED" in text
    bad = write_lines(tmp_path / "bad.jsonl", [{**control("ref_patch", REPAIR, "adequate"), "kind": "good"}])
    assert cli(["ingest", bad]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "kind" in err and "Traceback" not in err


# ============================================================================ convergence


def _mixed() -> list[dict]:
    return [line for line in _listing1() if line.get("route") != "old" and line.get("type") != "admission_policy"] + \
        _calibration_lines() + [r2("sft", predicates=[{"name": "tests", "family": "outcome"}]),
                                r2("named", predicates=["protected_paths"])]


def _tables(db) -> str:
    return table_dump(db, ("admission", "admitted_paths", "route_telemetry", "artifact_diffs", "grader_controls",
                           "task_path_policies"), "1, 2, 3")


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False), batch=st.sampled_from([1, 4, 500]))
def test_verdicts_converge_under_every_interleaving(tmp_path_factory, monkeypatch, rnd, batch):
    import ledger.projections.engine as engine_mod

    tmp = tmp_path_factory.mktemp("conv")
    lines = _mixed()
    ref = _tables(project(tmp, lines, name="ref")[0])
    assert "protected_paths" in ref and "calibrated_evaluators" in ref and "grader_control" in ref
    mixed = interleave(lines, rnd)
    monkeypatch.setattr(engine_mod, "BATCH", batch)
    assert _tables(project(tmp, mixed, name="mix")[0]) == ref


def test_html_report_has_the_graders_section(tmp_path):
    from ledger.reports.report import build_report

    db, _ = project(tmp_path, _calibration_lines())
    page = build_report(db, tmp_path / "report").read_text()
    section = page[page.index("<h2 id='evidence'>"):]
    assert "No data" not in section.split("<h2", 2)[1]
    assert f"<td>{REPAIR_OLD}</td><td>2</td><td>False</td><td>1</td><td>0</td><td>missed_wakeup</td>" in section
    assert f"<td>{REPORT}</td><td>4</td><td>False</td><td>0.3333</td><td>0</td><td>invented</td>" in section
    empty = build_report(project(tmp_path / "e", [])[0], tmp_path / "report-e").read_text()
    assert "No data: no grader controls and no collection campaigns on the log." in empty


# ============================================================================ empty diffs (issue 26, wrong result 6)


def test_a_read_only_success_with_an_empty_diff_is_admitted_through_the_cli(tmp_path, capsys):
    """SPEC §11.1 "Empty diffs": ``changed_paths: []`` is a valid diff (nothing changed), ingest
    accepts it and ``protected_paths`` passes on it, so a read-only success on a task with
    protected paths is admitted on an sft route instead of staying pending forever."""
    from tests.helpers import signed_store

    signer, paths, _key = signed_store(tmp_path)
    lines = [{**task("repair", PROTECTED), "source": "pool"}]
    lines += run("readonly") + [diff("readonly", []), scored("readonly", 1.0), outcome_pass("readonly")]
    lines += run("nodiff") + [scored("nodiff", 1.0), outcome_pass("nodiff")]
    lines += [signer.sign(line) for line in (
        {"type": "split_policy", "policy_id": "p1", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
         "salt": "s"},
        {"type": "permission", "subject": "source:pool", "use": "sft", "action": "grant", "authority": "legal"},
        r2("sft", predicates=[{"name": "tests", "family": "outcome"}]))]
    assert cli(["--store", paths.url, "ingest", "--no-seal", write_lines(tmp_path / "e.jsonl", lines)]) == 0
    assert cli(["--store", paths.url, "project"]) == 0
    capsys.readouterr()
    assert cli(["--store", paths.url, "admission", "show", "sft", "--json"]) == 0
    rows = {r["execution_id"]: r for r in json.loads(capsys.readouterr().out)["executions"]}
    assert (rows["readonly"]["state"], rows["readonly"]["predicate"], rows["readonly"]["paths"]) == ("admitted", None, 1)
    assert (rows["nodiff"]["state"], rows["nodiff"]["predicate"], rows["nodiff"]["verdict"]) == (
        "unresolved", "protected_paths", "pending")  # no diff at all is still pending, never a pass
    d = validate_line(diff("e", []), now_micros=NOW)
    assert d["changed_paths"] == [] and d["event_id"] == "artifact_diff/e/v1"
    assert violations([], [(PROTECTED, [])]) == []
    # the web view shows the empty diff as such, and the check that passed on it
    from ledger.view.evidence import execution_evidence, html_execution_evidence

    db = connect(paths.db)
    ev = execution_evidence(db, "readonly", ["readonly"])
    assert ev["protected_paths"] == {"verdict": "pass", "reason": "", "missing_evidence": None}
    assert ev["artifact_diffs"][0]["changed_paths"] == []
    assert "<td>(none: a read-only run)</td>" in html_execution_evidence(ev)
