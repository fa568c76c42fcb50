"""Cohort dispositions at a cutoff and the cost per emitted artifact (seed 002 §15.10.3,
table 15, napkin math 15.7), end to end through the ledger: events -> ingest -> every
projection (tree, splits, governance, assessment, admission) -> `ledger cohort report`."""

from __future__ import annotations

import json

import pytest

from ledger.algorithms.split_hash import assign_split
from ledger.cli import main
from ledger.log import open_log
from ledger.log.paths import store_paths
from ledger.producers.ingest import Ingestor
from ledger.reports.cohort import cohort_dispositions, cohort_report, format_cohort

from .helpers import Signer

STAMP = "2098-06-01T00:00:00Z"
CUTOFF = "2098-06-02T00:00:00Z"
LATE = "2098-06-03T00:00:00Z"
DEADLINE = "2099-01-01T00:00:00Z"
FRACTIONS = {"train": 0.8, "dev": 0.2, "final_test": 0.0}
SALT = "cohort-salt"
COHORT = "collection_run_r19"
PREDICATES = [{"name": "tests_pass", "family": "outcome"}, {"name": "clean_process", "family": "process"},
              {"name": "redundancy", "family": "process"}]
SIGNED = {"admission_policy", "permission", "withdrawal", "split_policy"}


def tasks_in(split: str, n: int, prefix: str) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        t = f"{prefix}-{i:04d}"
        if assign_split(t, FRACTIONS, SALT) == split:
            out.append(t)
        i += 1
    return out


def at(second: int, base: str = STAMP) -> str:
    return base.replace("00:00:00Z", f"{second // 3600:02d}:{second // 60 % 60:02d}:{second % 60:02d}Z")


class Scenario:
    """Table 15: 15 emitted, 470 assessed but not selected, 10 ineligible, 3 pending, 2 unknown."""

    def __init__(self) -> None:
        self.lines: list[dict] = []
        self.n = 0
        self.expected_reasons = {"emitted": {"admitted": 15},
                                 "assessed_not_selected": {"outcome": 300, "redundancy": 100, "process": 50, "target": 20},
                                 "ineligible": {"split": 4, "permission": 4, "transformation": 2},
                                 "pending": {"record": 2, "outcome": 1},
                                 "unknown": {"outcome": 1, "target": 1}}

    def attempt(self, task: str, *, verdicts=("pass", "pass", "pass"), harness=False, close=STAMP, reward=1.0,
                outcome="scored", assess=STAMP, verdict_at=STAMP, finalize=None) -> str:
        ex = f"a{self.n:03d}"
        t = at(self.n)
        self.n += 1
        req = {"type": "request", "execution_id": ex, "request_id": "r1", "input_ids": [1, 2, 3], "output_ids": [4, 5],
               "occurred_at": t}
        if harness:
            req["generator"] = "harness"
        else:
            req["output_logprobs"] = [-0.5, -0.5]
        self.lines += [{"type": "execution_opened", "execution_id": ex, "task_id": task, "deadline": DEADLINE,
                        "policy": "repair@7", "origin": "synthetic", "collection_run_id": COHORT, "occurred_at": t},
                       req,
                       {"type": "cost_recorded", "execution_id": ex, "amount": 0.6, "category": "generation",
                        "occurred_at": t}]
        if close is not None:
            self.lines.append({"type": "execution_closed", "execution_id": ex, "status": "completed",
                               "artifact_versions": ["v1"], "occurred_at": close})
        if assess is not None and close is not None:
            a = {"type": "assessment", "assessment_id": "grade", "execution_id": ex, "artifact_version": "v1",
                 "outcome": outcome, "evaluator": "repair_accept_v1", "occurred_at": assess}
            if outcome == "scored":
                a["reward"] = reward
            self.lines.append(a)
        if finalize is not None:
            self.lines.append({"type": "execution_finalized", "execution_id": ex, "occurred_at": finalize})
        for pred, v in zip([p["name"] for p in PREDICATES], verdicts):
            if v is None:
                break
            self.lines.append({"type": "predicate_evaluated", "execution_id": ex, "route": "repair_demos",
                               "predicate": pred, "verdict": v, "verifier": f"{pred}@1", "slot_seconds": 1.0,
                               "occurred_at": verdict_at})
            if v != "pass":
                break
        return ex

    def build(self) -> list[dict]:
        train = tasks_in("train", 490, "task")
        dev = tasks_in("dev", 4, "task")
        restricted = tasks_in("train", 6, "restricted")
        gov = [{"type": "task_registered", "task_id": t, "source": "pool", "fixture": f"fixture-{i % 40}",
                "occurred_at": STAMP} for i, t in enumerate(train + dev)]
        gov += [{"type": "task_registered", "task_id": t, "source": "vendor-x", "occurred_at": STAMP} for t in restricted]
        gov += [{"type": "split_policy", "policy_id": "p1", "fractions": FRACTIONS, "salt": SALT, "occurred_at": STAMP},
                {"type": "permission", "subject": "source:pool", "use": "sft", "action": "grant", "authority": "legal",
                 "occurred_at": STAMP},
                {"type": "admission_policy", "route": "repair_demos", "version": 1, "use": "sft", "split": "train",
                 "j_max": 1, "predicates": PREDICATES, "consumer": "repair-sft", "occurred_at": STAMP}]
        self.lines += gov
        it = iter(train)
        for _ in range(15):
            self.attempt(next(it))
        for _ in range(300):
            self.attempt(next(it), verdicts=("fail", None, None), reward=0.0)
        for _ in range(100):  # solved, but the selector already has this task's demonstration
            self.attempt(next(it), verdicts=("pass", "pass", "fail"))
        for _ in range(50):
            self.attempt(next(it), verdicts=("pass", "fail", None))
        for _ in range(20):  # no policy output to supervise
            self.attempt(next(it), harness=True)
        for t in dev:
            self.attempt(t)
        for t in restricted[:4]:
            self.attempt(t)
        for t in restricted[4:]:  # the raw trace may not be used; its redacted view failed revalidation
            parent = self.attempt(t)
            view = f"{parent}-redacted"
            self.lines += [{"type": "record_derived", "derived_execution_id": view, "parent_execution_id": parent,
                            "transformation": "redact@1", "occurred_at": STAMP},
                           {"type": "revalidated", "derived_execution_id": view, "verdict": "fail",
                            "evidence": {"leak": "token"}, "occurred_at": STAMP},
                           {"type": "permission", "subject": f"execution:{view}", "use": "sft", "action": "grant",
                            "authority": "legal", "occurred_at": STAMP}]
            self.lines += [{"type": "predicate_evaluated", "execution_id": view, "route": "repair_demos",
                            "predicate": p["name"], "verdict": "pass", "verifier": "v@1", "occurred_at": STAMP}
                           for p in PREDICATES]
        for _ in range(2):  # still running at the cutoff
            self.attempt(next(it), close=LATE, assess=LATE, verdict_at=LATE)
        self.attempt(next(it), verdict_at=LATE)  # the outcome verifier answers after the cutoff
        self.attempt(next(it), verdicts=("unknown", None, None))  # the verifier could not tell
        self.attempt(next(it), outcome="evaluator_error", finalize=STAMP)  # budget over without a valid reward
        # spent after the cutoff: not part of the cohort cost at T
        self.lines += [{"type": "cost_recorded", "execution_id": "a000", "amount": 50.0, "category": "review",
                        "occurred_at": LATE}]
        assert self.n == 500
        return self.lines


@pytest.fixture(scope="module")
def cohort_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("cohort")
    signer = Signer()
    paths = store_paths(str(root / "store"))
    assert main(["--store", paths.url, "init"]) == 0
    signer.trust.save(paths.trust)
    lines = [signer.sign(ln) if ln["type"] in SIGNED else ln for ln in Scenario().build()]
    events = root / "events.jsonl"
    events.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    assert main(["--store", paths.url, "ingest", str(events)]) == 0
    return paths


def test_napkin_15_7_table_15_through_the_ledger(cohort_store, capsys):
    capsys.readouterr()
    assert main(["--store", cohort_store.url, "cohort", "report", COHORT, "--cutoff", CUTOFF, "--json", "--attempts"]) == 0
    rep = json.loads(capsys.readouterr().out)
    counts = {d: v["attempts"] for d, v in rep["dispositions"].items()}
    assert counts == {"emitted": 15, "assessed_not_selected": 470, "ineligible": 10, "pending": 3, "unknown": 2}
    assert rep["attempts"] == 500 == sum(counts.values())
    assert {d: v["reasons"] for d, v in rep["dispositions"].items()} == Scenario().expected_reasons
    # every attempt exactly once
    ids = [a["execution_id"] for a in rep["attempt_dispositions"]]
    assert len(ids) == len(set(ids)) == 500
    assert rep["emission_yield"] == pytest.approx(0.03)
    assert rep["cost"]["total"] == pytest.approx(300.0)  # the $50 review dated after the cutoff is left out
    assert rep["cost"]["per_attempt"] == pytest.approx(0.60)
    assert rep["cost"]["per_emitted_artifact"] == pytest.approx(20.0)
    by_id = {a["execution_id"]: a for a in rep["attempt_dispositions"]}
    assert by_id["a493"]["record"] == "a493-redacted" and by_id["a493"]["reason"] == "transformation"
    assert "tests_pass" in by_id["a497"]["detail"] and by_id["a497"]["disposition"] == "pending"
    # the text table (seed table 15 layout)
    assert main(["--store", cohort_store.url, "cohort", "report", COHORT, "--cutoff", CUTOFF]) == 0
    text = capsys.readouterr().out
    assert "Selected and emitted" in text and "Total accounted" in text
    assert "emission yield: 15 / 500 = 3.00%" in text
    assert "cohort cost: $300.00; per attempt: $0.60" in text
    assert "cost per emitted artifact (eq. 5): $20.00" in text


def test_a_later_cutoff_sees_the_late_events(cohort_store):
    rep = cohort_report(cohort_store, COHORT, cutoff=LATE)
    counts = {d: v["attempts"] for d, v in rep["dispositions"].items()}
    # the two running attempts closed and passed, the late verdict passed: 18 emitted, nothing pending
    assert counts == {"emitted": 18, "assessed_not_selected": 470, "ineligible": 10, "pending": 0, "unknown": 2}
    assert rep["cost"]["total"] == pytest.approx(350.0)
    assert rep["cost"]["per_emitted_artifact"] == pytest.approx(350.0 / 18)
    # before anything happened: every attempt is missing, nothing is emitted, the loss is the cost (zero)
    early = cohort_report(cohort_store, COHORT, cutoff="2098-05-01T00:00:00Z")
    assert early["attempts"] == 0 and early["cost"]["per_emitted_artifact"] is None


def test_live_projection_equals_latest_cutoff_and_route_filter(cohort_store):
    live = cohort_report(cohort_store, COHORT)
    assert live["cutoff"] is None
    assert live["dispositions"] == cohort_report(cohort_store, COHORT, cutoff=LATE)["dispositions"]
    with pytest.raises(KeyError, match="not declared"):
        cohort_report(cohort_store, COHORT, routes=["nope"])
    assert main(["--store", cohort_store.url, "cohort", "report", COHORT, "--route", "nope"]) == 2
    assert main(["--store", cohort_store.url, "cohort", "report", COHORT, "--cutoff", "yesterday"]) == 2


def test_per_task_cap_moves_extra_emissions_to_redundancy(tmp_path):
    from ledger.projections.engine import ReplayEngine, connect
    from ledger.projections.registry import all_projections

    signer = Signer()
    lines = [{"type": "task_registered", "task_id": "t1", "source": "pool", "occurred_at": STAMP},
             {"type": "task_registered", "task_id": "t2", "source": "pool", "occurred_at": STAMP},
             signer.sign({"type": "split_policy", "policy_id": "p", "fractions": {"train": 1.0, "dev": 0.0,
                                                                                   "final_test": 0.0},
                          "salt": "s", "occurred_at": STAMP}),
             signer.sign({"type": "permission", "subject": "*", "use": "*", "action": "grant", "authority": "a",
                          "occurred_at": STAMP}),
             signer.sign({"type": "admission_policy", "route": "r", "version": 1, "use": "sft", "split": "train",
                          "j_max": 1, "occurred_at": STAMP})]
    for i, task in enumerate(["t1", "t1", "t1", "t2"]):
        ex = f"e{i}"
        lines += [{"type": "execution_opened", "execution_id": ex, "task_id": task, "deadline": DEADLINE, "policy": "p",
                   "collection_run_id": "c", "occurred_at": at(i)},
                  {"type": "request", "execution_id": ex, "request_id": "r", "input_ids": [1], "output_ids": [2],
                   "output_logprobs": [-1.0], "occurred_at": at(i)},
                  {"type": "execution_closed", "execution_id": ex, "status": "completed", "occurred_at": at(i)},
                  {"type": "assessment", "assessment_id": "a", "execution_id": ex, "artifact_version": "v1",
                   "outcome": "scored", "reward": 1.0, "evaluator": "g", "occurred_at": at(i)},
                  {"type": "cost_recorded", "execution_id": ex, "amount": 1.5, "occurred_at": at(i)}]
    log = open_log(str(tmp_path / "s"), create=True)
    Ingestor(log, signer.trust).ingest_lines(enumerate(lines, 1))
    db = connect(tmp_path / "p.db")
    ReplayEngine(log, db, all_projections(), trust=signer.trust).run()
    plain = cohort_dispositions(db, "c")
    assert plain["emitted"] == 4 and plain["cost"]["per_emitted_artifact"] == pytest.approx(1.5)
    capped = cohort_dispositions(db, "c", per_task_cap=1, include_attempts=True)
    assert capped["emitted"] == 2
    assert capped["dispositions"]["assessed_not_selected"]["reasons"] == {"redundancy": 2}
    assert [a["disposition"] for a in capped["attempt_dispositions"]] == [
        "emitted", "assessed_not_selected", "assessed_not_selected", "emitted"]  # earliest opened kept
    assert capped["cost"]["per_emitted_artifact"] == pytest.approx(3.0)
    assert "cost per emitted artifact (eq. 5): $3.00" in format_cohort({**capped, "cutoff": None})
    none = cohort_dispositions(db, "c", per_task_cap=0)
    assert none["emitted"] == 0 and none["cost"]["loss"] == pytest.approx(6.0)
    assert "is the loss" in format_cohort({**none, "cutoff": None})


def test_report_section_dispositions(cohort_store, tmp_path):
    from ledger.reports.report import write_report

    page = write_report(cohort_store, tmp_path / "rep")
    text = page.read_text()
    assert (tmp_path / "rep" / "cohort_dispositions.png").read_bytes()[:4] == b"\x89PNG"
    assert "Cohort dispositions and cost per emitted artifact" in text
    # live state (every event): 18 emitted, 470 not selected, 10 ineligible, 0 pending, 2 unknown, $350
    assert "<td>collection_run_r19</td><td>500</td><td>18</td><td>470</td><td>10</td><td>0</td><td>2</td>" in text


def _no_cost_db(tmp_path, *, cost: bool):
    """Two emitted attempts of cohort "c"; with ``cost`` each has a cost_recorded of 2.0."""
    from ledger.projections.engine import ReplayEngine, connect
    from ledger.projections.registry import all_projections

    signer = Signer()
    lines = [{"type": "task_registered", "task_id": t, "source": "pool", "occurred_at": STAMP} for t in ("t1", "t2")]
    lines += [signer.sign({"type": "split_policy", "policy_id": "p", "salt": "s", "occurred_at": STAMP,
                           "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}}),
              signer.sign({"type": "permission", "subject": "*", "use": "*", "action": "grant", "authority": "a",
                           "occurred_at": STAMP}),
              signer.sign({"type": "admission_policy", "route": "r", "version": 1, "use": "sft", "split": "train",
                           "j_max": 1, "occurred_at": STAMP})]
    for i, task in enumerate(["t1", "t2"]):
        ex = f"e{i}"
        lines += [{"type": "execution_opened", "execution_id": ex, "task_id": task, "deadline": DEADLINE, "policy": "p",
                   "collection_run_id": "c", "occurred_at": at(i)},
                  {"type": "request", "execution_id": ex, "request_id": "r", "input_ids": [1], "output_ids": [2],
                   "output_logprobs": [-1.0], "occurred_at": at(i)},
                  {"type": "execution_closed", "execution_id": ex, "status": "completed", "occurred_at": at(i)},
                  {"type": "assessment", "assessment_id": "a", "execution_id": ex, "artifact_version": "v1",
                   "outcome": "scored", "reward": 1.0, "evaluator": "g", "occurred_at": at(i)}]
        if cost:
            lines.append({"type": "cost_recorded", "execution_id": ex, "amount": 2.0, "occurred_at": at(i)})
    log = open_log(str(tmp_path / "s"), create=True)
    Ingestor(log, signer.trust).ingest_lines(enumerate(lines, 1))
    db = connect(tmp_path / "p.db")
    ReplayEngine(log, db, all_projections(), trust=signer.trust).run()
    log.close()
    return db


@pytest.mark.parametrize("cost", [False, True])
def test_no_cost_recorded_is_said_not_printed_as_zero(tmp_path, cost):
    """Without any cost_recorded event the text and the cohort bar say "no cost recorded", never
    "0.00 per artifact"; with costs they show the cost per emitted artifact."""
    from ledger.reports import report_economics
    from ledger.reports.report import _plt

    db = _no_cost_db(tmp_path, cost=cost)
    rep = cohort_dispositions(db, "c")
    assert rep["emitted"] == 2
    text = format_cohort({**rep, "cutoff": None})
    figs = []

    def keep(fig, out, name):
        figs.append(fig)
        return name

    plt = _plt()
    econ = {"cohorts": {"c": rep}, "pools": {}, "loop": None}
    assert report_economics._plot_dispositions(plt, econ, tmp_path, keep) == "cohort_dispositions.png"
    (ax,) = figs[0].axes
    bar_labels = [t.get_text() for t in ax.texts]
    plt.close(figs[0])
    if cost:
        assert "cohort cost: $4.00; per attempt: $2.00" in text
        assert "cost per emitted artifact (eq. 5): $2.00" in text and "no cost recorded" not in text
        assert bar_labels == ["2/2 emitted, 2.00 per artifact"]
    else:
        assert "cohort cost: no cost recorded; cost per emitted artifact: no cost recorded" in text
        assert "$" not in text and "is the loss" not in text
        assert bar_labels == ["2/2 emitted, no cost recorded"]


# ---------------------------------------------------------------- dispositions by family (issue 26, wrong result 5)
FAMILY_ROUTE = {"type": "admission_policy", "route": "demos", "version": 1, "use": "sft", "split": "train", "j_max": 1,
                "required_criteria": ["no_regressions"], "occurred_at": STAMP,
                "predicates": [{"name": "clean_process", "family": "process"}, {"name": "tests_pass", "family": "outcome"}]}


def _family_attempt(ex: str, i: int, *, task: str = "t1", reward: float = 1.0, criterion: str = "pass",
                    verdicts: tuple[str, str] = ("pass", "pass"), changed: list[str] | None = None) -> list[dict]:
    lines = [{"type": "execution_opened", "execution_id": ex, "task_id": task, "deadline": DEADLINE, "policy": "p",
              "collection_run_id": "c", "occurred_at": at(i)},
             {"type": "request", "execution_id": ex, "request_id": "r", "input_ids": [1], "output_ids": [2],
              "output_logprobs": [-1.0], "occurred_at": at(i)},
             {"type": "execution_closed", "execution_id": ex, "status": "completed", "occurred_at": at(i)},
             {"type": "assessment", "assessment_id": "a", "execution_id": ex, "artifact_version": "v1",
              "outcome": "scored", "reward": reward, "evaluator": "g", "occurred_at": at(i),
              "criteria": [{"name": "no_regressions", "verdict": criterion}]}]
    lines += [{"type": "predicate_evaluated", "execution_id": ex, "route": "demos", "predicate": p, "verdict": v,
               "verifier": f"{p}@1", "occurred_at": at(i)} for p, v in zip(("clean_process", "tests_pass"), verdicts)]
    if changed is not None:
        lines.append({"type": "artifact_diff", "execution_id": ex, "artifact_version": "v1", "changed_paths": changed,
                      "occurred_at": at(i)})
    return lines


def test_rejections_are_filed_under_the_family_of_the_failing_check(tmp_path, capsys):
    """SPEC §11.1 "Dispositions by family" (seed table 15): a min_reward, required_criteria or
    outcome-predicate rejection is ``outcome``; a process predicate or protected_paths is ``process``;
    a grader control is ineligible for the use."""
    signer = Signer()
    paths = store_paths(str(tmp_path / "store"))
    assert main(["--store", paths.url, "init"]) == 0
    signer.trust.save(paths.trust)
    lines = [{"type": "task_registered", "task_id": "t1", "source": "pool", "occurred_at": STAMP},
             {"type": "task_registered", "task_id": "guarded", "source": "pool", "protected_paths": ["tests/**"],
              "occurred_at": STAMP}]
    lines += [signer.sign(ln) for ln in (
        {"type": "split_policy", "policy_id": "p", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
         "salt": "s", "occurred_at": STAMP},
        {"type": "permission", "subject": "*", "use": "*", "action": "grant", "authority": "a", "occurred_at": STAMP},
        FAMILY_ROUTE)]
    lines += _family_attempt("ok", 0)
    lines += _family_attempt("low_reward", 1, reward=0.0)  # min_reward (default 1.0 on sft)
    lines += _family_attempt("criterion", 2, criterion="fail")  # required_criteria
    lines += _family_attempt("outcome_pred", 3, verdicts=("pass", "fail"))
    lines += _family_attempt("process_pred", 4, verdicts=("fail", "pass"))
    lines += _family_attempt("tampered", 5, task="guarded", changed=["tests/test_a.py"])  # protected_paths
    lines += _family_attempt("control", 6) + [{"type": "grader_control", "execution_id": "control", "evaluator": "g",
                                               "kind": "adequate", "expected_verdict": "pass", "occurred_at": at(6)}]
    events = tmp_path / "events.jsonl"
    events.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    assert main(["--store", paths.url, "ingest", str(events)]) == 0
    capsys.readouterr()
    assert main(["--store", paths.url, "cohort", "report", "c", "--json", "--attempts"]) == 0
    rep = json.loads(capsys.readouterr().out)
    got = {a["execution_id"]: (a["disposition"], a["reason"]) for a in rep["attempt_dispositions"]}
    assert got == {"ok": ("emitted", "admitted"),
                   "low_reward": ("assessed_not_selected", "outcome"),
                   "criterion": ("assessed_not_selected", "outcome"),
                   "outcome_pred": ("assessed_not_selected", "outcome"),
                   "process_pred": ("assessed_not_selected", "process"),
                   "tampered": ("assessed_not_selected", "process"),
                   "control": ("ineligible", "grader_control")}
    assert rep["dispositions"]["assessed_not_selected"]["reasons"] == {"outcome": 3, "process": 2}


def test_family_of_a_check():
    from ledger.algorithms.economics import family_of

    assert [family_of(p, {}) for p in ("outcome", "required_criteria", "calibrated_evaluators", "protected_paths",
                                        "per_task_cap", "grader_control", "capability_gap", None)] == [
        "outcome", "outcome", "outcome", "process", "redundancy", "permitted_use", "permitted_use", ""]
    assert family_of("tests_pass", {"tests_pass": "outcome"}) == "outcome"  # a declared predicate keeps its family
    assert family_of("unheard_of", {}) == ""
