"""SPEC §6.10 evidence: fault injection, production feedback, capability-gap probes (seed 002
§15.2.2 Figure 1 and napkin math 15.1, §15.6.3 Table 9, §15.7.3 Table 11)."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms.capability_gap import Probe, ladder_verdict, latest_per_rung
from ledger.algorithms.feedback import feedback_verdict
from ledger.events.codec import default_codec
from ledger.events.validate import ValidationError, validate_line
from ledger.log import open_log
from ledger.producers.ingest import IngestError, Ingestor
from ledger.projections.admission import AdmissionProjection
from ledger.projections.assessment import AssessmentProjection
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.evidence import EvidenceProjection
from ledger.projections.tree import TreeProjection
from tests.helpers import closed, interleave, request, signed_store, table_dump
from tests.test_admission import SIGNER, STAMP, adm, fake_evidence, opened, route, scored

NOW = 1_900_000_000_000_000


def r2(name: str = "sft", **kw) -> dict:
    return route(name, semantics=None, **kw)


def probe(task: str, pid: str, rung: str, result: str, at: str = "2098-01-01T00:00:00Z", **kw) -> dict:
    return {"type": "counterfactual_probe", "task_id": task, "probe_id": pid, "rung": rung, "result": result,
            "occurred_at": at, **kw}


def feedback(ex: str, signal: str, *, value=None, consent="consent/42", at: str = "2098-01-01T00:00:00Z", **kw) -> dict:
    line = {"type": "production_feedback", "execution_id": ex, "signal": signal, "occurred_at": at, **kw}
    if value is not None:
        line["value"] = value
    if consent is not None:
        line["consent_ref"] = consent
    return line


def fault(ex: str, iid: str, condition: str, call: str | None = None, **kw) -> dict:
    line = {"type": "fault_injected", "execution_id": ex, "injection_id": iid, "version": "faults@1",
            "condition": condition, **kw}
    if call is not None:
        line["target_call_id"] = call
    return line


def simple(ex: str, task: str = "t1", reward: float = 1.0) -> list[dict]:
    return [opened(ex, task), request(ex, "r1", [1, 2], [3, 4]), closed(ex), scored(ex, reward)]


def project(tmp_path, lines, *, name="s", evidence=None, db_name=None):
    log = open_log(str(tmp_path / name), create=True)
    Ingestor(log, SIGNER.trust, seal=None).ingest_lines(enumerate(lines, 1))
    db = connect(tmp_path / f"{db_name or name}.db")
    ReplayEngine(log, db, [TreeProjection(), AssessmentProjection(), EvidenceProjection(),
                           AdmissionProjection(fake_evidence() if evidence is None else evidence)],
                 trust=SIGNER.trust).run()
    return db, log


def states(db, r: str) -> dict:
    return {ex: (st_, pred) for ex, st_, pred in db.execute(
        "SELECT execution_id, state, predicate FROM admission WHERE route = ? ORDER BY 1", (r,))}


# ============================================================================ validation and schemas

FAULT = {"type": "fault_injected", "execution_id": "e", "injection_id": "i1", "version": "faults@1", "condition": "lost_ack"}
FEEDBACK = {"type": "production_feedback", "execution_id": "e", "signal": "accepted"}
PROBE = {"type": "counterfactual_probe", "task_id": "t", "probe_id": "p1", "rung": "context", "result": "failure_persists"}
ROUTE = {"type": "admission_policy", "route": "r", "version": 1, "use": "sft", "split": "train", "j_max": 2}


@pytest.mark.parametrize("base, change, field, message", [
    (FAULT, {"condition": "Lost-Ack"}, "condition", "custom name matching [a-z][a-z0-9_]*"),
    (FAULT, {"condition": 3}, "condition", "expected one of malformed_rejected"),
    (FAULT, {"version": None}, "version", "is required"),
    (FAULT, {"injection_id": ""}, "injection_id", "non-empty string"),
    (FAULT, {"condition": "disk_full"}, "expected_response", "required for the custom condition 'disk_full'"),
    (FAULT, {"target_call_id": 5}, "target_call_id", "non-empty string"),
    (FAULT, {"simulated_state": float("nan")}, "simulated_state", "not a finite number"),
    (FAULT, {"severity": "high"}, "severity", "unknown field"),
    (FEEDBACK, {"signal": "liked"}, "signal", "expected one of accepted, edited"),
    (FEEDBACK, {"signal": "rating"}, "value", "required when signal is rating"),
    (FEEDBACK, {"signal": "rating", "value": 4}, "value", "normalised to [0, 1], got 4"),
    (FEEDBACK, {"value": "good"}, "value", "expected a finite number"),
    (FEEDBACK, {"consent_ref": ""}, "consent_ref", "non-empty string"),
    (FEEDBACK, {"execution_id": None}, "execution_id", "is required"),
    (PROBE, {"rung": "weights"}, "rung", "expected one of context, interface, runtime"),
    (PROBE, {"result": "fixed"}, "result", "expected one of failure_persists, failure_resolved"),
    (PROBE, {"probe_id": None}, "probe_id", "is required"),
    (PROBE, {"task_id": 7}, "task_id", "non-empty string"),
    (ROUTE, {"predicates": [{"name": "feedback", "family": "process"}]}, "predicates",
     "'feedback' is computed by the ledger (family outcome)"),
    (ROUTE, {"required_criteria": ["feedback"]}, "required_criteria", "ledger-computed predicate"),
])
def test_bad_evidence_lines_are_refused_naming_the_field(base, change, field, message):
    line = {k: v for k, v in {**base, **change}.items() if v is not None}
    with pytest.raises(ValidationError) as exc:
        validate_line(line, line=3, now_micros=NOW)
    assert exc.value.field == field
    assert message in str(exc.value) and "line 3" in str(exc.value)


def test_new_types_round_trip_their_v1_schemas_with_their_natural_keys():
    codec = default_codec()
    cases = [
        ({**FAULT, "target_call_id": "c1", "simulated_state": {"committed": True}}, "FaultInjected", "fault_injected/e/i1"),
        ({**FAULT, "condition": "disk_full", "expected_response": "free space, then retry"}, "FaultInjected", None),
        ({**FEEDBACK, "consent_ref": "grant/1", "evidence": {"ticket": 9}}, "ProductionFeedbackRecorded",
         "production_feedback/e/accepted"),
        ({**PROBE, "evidence": {"prompt": "added fact"}}, "CounterfactualProbeRecorded", "counterfactual_probe/t/p1"),
    ]
    for line, record, key in cases:
        ev = validate_line(line, now_micros=NOW)
        assert codec.schema_for(ev["event_type"]).name == record and codec.schema_for(ev["event_type"]).version == 1
        back = codec.decode(codec.encode(ev))
        assert {k: back[k] for k in ev if k != "stamped"} == {k: ev[k] for k in ev if k != "stamped"}
        if key is not None:
            assert ev["event_id"] == key
    r1 = validate_line({**FEEDBACK, "signal": "rating", "value": 0.9}, now_micros=NOW)["event_id"]
    r2_ = validate_line({**FEEDBACK, "signal": "rating", "value": 0.3}, now_micros=NOW)["event_id"]
    assert r1 != r2_ and r1.startswith("production_feedback/e/rating/")
    assert validate_line({**FEEDBACK, "signal": "rating", "value": 0.9}, now_micros=NOW + 5)["event_id"] == r1  # a retry


def test_feedback_and_faults_for_an_unopened_execution_are_refused_at_ingest(tmp_path):
    log = open_log(str(tmp_path / "s"), create=True)
    ing = Ingestor(log, SIGNER.trust, seal=None)
    for line in (FAULT, FEEDBACK):
        with pytest.raises(IngestError) as exc:
            ing.ingest_lines([(1, line)])
        assert "field 'execution_id'" in str(exc.value) and "never opened" in str(exc.value)
    assert log.end_offsets() in ({}, {("log", 0): 0})


# ============================================================================ pure rules


def test_ladder_walks_the_rungs_in_order_and_the_latest_probe_of_a_rung_decides():
    P = Probe
    assert ladder_verdict([]) == ladder_verdict([]) and ladder_verdict([]).verdict == "pending"
    assert ladder_verdict([]).rung == "context"
    v = ladder_verdict([P("a", "context", "failure_persists", 1), P("b", "runtime", "failure_persists", 1)])
    assert (v.verdict, v.rung) == ("pending", "interface")
    v = ladder_verdict([P("a", "context", "failure_resolved", 1)])  # resolved at the first rung: no higher probe needed
    assert (v.verdict, v.rung) == ("fail", "context") and "probe a" in v.reason
    all3 = [P("a", "context", "failure_persists", 1), P("b", "interface", "failure_persists", 1),
            P("c", "runtime", "failure_persists", 1)]
    assert ladder_verdict(all3).verdict == "pass"
    # a later probe at a rung supersedes the earlier one, by (occurred_at, probe_id), never by arrival order
    later = P("d", "interface", "failure_resolved", 2)
    assert ladder_verdict(all3 + [later]).verdict == ladder_verdict([later] + all3[::-1]).verdict == "fail"
    assert latest_per_rung([P("z", "runtime", "failure_resolved", 5), P("y", "runtime", "failure_persists", 5)])[
        "runtime"].probe_id == "z"


def test_feedback_rules_of_table_11():
    f = feedback_verdict
    assert f([])[0] == "pending"
    assert f([(1, "e1", "accepted", None, None)]) == ("pending", "no consented production feedback",
                                                      "production_feedback with consent_ref")
    assert f([(1, "e1", "accepted", None, "c")])[0] == "pass"
    assert f([(1, "e1", "rating", 0.8, "c")])[0] == "pass"
    assert f([(1, "e1", "rating", 0.79, "c")])[0] == "fail"
    assert f([(1, "e1", "abandoned", None, "c")])[0] == "fail"
    assert f([(1, "e1", "corrected_mid_task", None, "c")])[0] == "fail"
    assert f([(1, "e1", "edited", None, "c")])[::2] == ("unknown", "check of the edited output")
    # the latest (occurred_at, event_id) decides whatever the order given
    sig = [(2, "b", "accepted", None, "c"), (1, "a", "abandoned", None, "c")]
    assert f(sig)[0] == f(sig[::-1])[0] == "pass"


# ============================================================================ capability gap through the log


def _gap_lines():
    lines = []
    for ex, task in (("e1", "tA"), ("e2", "tA"), ("e3", "tB"), ("e4", "tC"), ("e5", "tD")):
        lines += simple(ex, task, 0.5)
    lines += [probe("tA", "pa1", "context", "failure_persists"), probe("tA", "pa2", "interface", "failure_persists"),
              probe("tA", "pa3", "runtime", "failure_persists"),
              probe("tB", "pb1", "context", "failure_persists"), probe("tB", "pb2", "interface", "failure_resolved"),
              probe("tC", "pc1", "context", "failure_persists"), probe("tC", "pc2", "interface", "failure_persists")]
    lines += [r2("gap", use="rl", capability_gap=True), r2("plain", use="rl"),
              route("old", use="rl", capability_gap=True)]  # semantics 1: the first release's rules, option ignored
    return lines


@pytest.mark.usefixtures("earlier_release")
def test_capability_gap_admits_only_failures_that_persist_at_every_rung(tmp_path):
    db, _ = project(tmp_path, _gap_lines())
    assert states(db, "gap") == {"e1": ("admitted", None), "e2": ("admitted", None), "e3": ("rejected", "capability_gap"),
                                 "e4": ("unresolved", "capability_gap"), "e5": ("unresolved", "capability_gap")}
    assert adm(db, "e3", "gap")[4] == ("task tB: failure resolved by the interface probe pb2: repair the interface below "
                                       "the weights, do not train on it")
    assert adm(db, "e4", "gap")[2:4] == ("pending", "counterfactual_probe at rung runtime")
    assert adm(db, "e5", "gap")[2:4] == ("pending", "counterfactual_probe at rung context")
    # routes without the option, and a first-release route with it, are unchanged
    assert {s for s, _ in states(db, "plain").values()} == {"admitted"}
    assert {s for s, _ in states(db, "old").values()} == {"admitted"}
    tel = db.execute("SELECT admitted, rejected, unresolved, rejected_by FROM route_telemetry WHERE route = 'gap'").fetchone()
    assert tel == (2, 1, 2, '{"capability_gap": 1}')


@pytest.mark.usefixtures("earlier_release")
def test_a_probe_ingested_later_re_evaluates_the_tasks_executions(tmp_path):
    log = open_log(str(tmp_path / "s"), create=True)
    ing = Ingestor(log, SIGNER.trust, seal=None)
    ing.ingest_lines(enumerate(_gap_lines(), 1))
    db = connect(tmp_path / "s.db")

    def run():
        ReplayEngine(log, db, [TreeProjection(), AssessmentProjection(), EvidenceProjection(),
                               AdmissionProjection(fake_evidence())], trust=SIGNER.trust).run()

    run()
    assert states(db, "gap")["e4"] == ("unresolved", "capability_gap")
    ing.ingest_lines([(1, probe("tC", "pc3", "runtime", "failure_persists"))])
    run()
    assert states(db, "gap")["e4"] == ("admitted", None)
    # a later context probe that resolves tA's failure rejects both of its executions
    ing.ingest_lines([(1, probe("tA", "pa4", "context", "failure_resolved", at="2098-02-01T00:00:00Z"))])
    run()
    assert states(db, "gap")["e1"] == states(db, "gap")["e2"] == ("rejected", "capability_gap")


# ============================================================================ feedback through the log


@pytest.mark.usefixtures("earlier_release")
def test_feedback_predicate_decides_outcome_from_the_latest_consented_signal(tmp_path):
    lines = []
    for ex in ("acc", "hi", "lo", "abandon", "edit", "none", "noconsent", "late"):
        lines += simple(ex, "t1", 1.0)
    lines += [feedback("acc", "accepted"), feedback("hi", "rating", value=0.9), feedback("lo", "rating", value=0.5),
              feedback("abandon", "abandoned"), feedback("edit", "edited"), feedback("noconsent", "accepted", consent=None),
              feedback("late", "accepted", at="2098-03-01T00:00:00Z"),
              feedback("late", "corrected_mid_task", at="2098-01-01T00:00:00Z")]  # the later signal wins, not log order
    lines += [r2("fb", predicates=["feedback"]), route("old", predicates=[{"name": "feedback", "family": "outcome"}])]
    db, _ = project(tmp_path, lines)
    assert states(db, "fb") == {"abandon": ("rejected", "feedback"), "acc": ("admitted", None), "edit": ("unresolved", "feedback"),
                                "hi": ("admitted", None), "late": ("admitted", None), "lo": ("rejected", "feedback"),
                                "none": ("unresolved", "feedback"), "noconsent": ("unresolved", "feedback")}
    assert adm(db, "lo", "fb")[4] == "latest feedback: rating 0.5 below 0.8 (production_feedback/lo/rating/" + \
        adm(db, "lo", "fb")[4].split("/rating/")[1]
    assert adm(db, "none", "fb")[2:4] == ("pending", "production_feedback with consent_ref")
    assert adm(db, "edit", "fb")[2:4] == ("unknown", "check of the edited output")
    # a first-release route keeps reading external verdicts for a predicate named feedback
    assert {s for s, _ in states(db, "old").values()} == {"unresolved"}



def _gov(signer, tasks, *routes, grant: str | None = "sft"):
    gov = [{"type": "task_registered", "task_id": t, "source": "pool"} for t in tasks]
    gov += [{"type": "split_policy", "policy_id": "p1", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
             "salt": "s"}]
    if grant:
        gov.append({"type": "permission", "subject": "*", "use": grant, "action": "grant", "authority": "legal"})
    gov += list(routes)
    return [signer.sign({**g, "occurred_at": STAMP}) if g["type"] != "task_registered" else g for g in gov]


def test_feedback_never_admits_without_a_permission_grant(tmp_path):
    from ledger.corpus import publish as Pub

    signer, paths, key = signed_store(tmp_path)
    fb_route = {"type": "admission_policy", "route": "fb", "version": 1, "use": "sft", "split": "train", "j_max": 2,
                "predicates": ["feedback"]}
    lines = _gov(signer, ["t1"], fb_route, grant=None) + simple("e1", "t1") + [feedback("e1", "accepted")]
    with open_log(paths.url) as log:
        Ingestor(log, signer.trust).ingest_lines(enumerate(lines, 1))
    Pub.publish(paths, "fb", key=key, out=tmp_path / "m1.json")
    doc = json.loads((tmp_path / "m1.json").read_text())
    assert doc["members"] == [] and doc["counts"]["executions"] == 0
    db = connect(paths.db)
    assert adm(db, "e1", "fb")[:2] in (("unresolved", "permitted_use"), ("rejected", "permitted_use"))
    # the grant, not the feedback, lets it in
    grant = signer.sign({"type": "permission", "subject": "*", "use": "sft", "action": "grant", "authority": "legal",
                         "occurred_at": STAMP})
    with open_log(paths.url) as log:
        Ingestor(log, signer.trust).ingest_lines([(1, grant)])
    Pub.publish(paths, "fb", key=key, out=tmp_path / "m2.json")
    doc = json.loads((tmp_path / "m2.json").read_text())
    assert [m["member_id"] for m in doc["members"]] == ["fb/e1/r1"]


# ============================================================================ fault injection: accounting and datasheet


def _tool_execution(ex: str, task: str, calls: dict[str, dict], reward: float = 1.0, sub: tuple[str, ...] = ()) -> list[dict]:
    """One request per tool call, each consuming the previous call's result (a sub-agent request for the calls in ``sub``)."""
    lines = [opened(ex, task)]
    inp = [1, 2]
    ids = list(calls)
    for i, call in enumerate(ids):
        kw = {"emitted_tool_call_ids": [call]}
        if i:
            kw["consumed_tool_call_ids"] = [ids[i - 1]]
        if i and ids[i - 1] in sub:
            kw.update(agent_id="helper", agent_tier="sub")
        lines.append(request(ex, f"r{i}", list(inp), [10 + i], **kw))
        inp += [10 + i, 50 + i]
        lines.append({"type": "tool_payload", "execution_id": ex, "call_id": call, "kind": "result", "payload": calls[call]})
    kw = {"consumed_tool_call_ids": [ids[-1]]}
    if ids[-1] in sub:
        kw.update(agent_id="helper", agent_tier="sub")
    lines.append(request(ex, f"r{len(ids)}", list(inp), [99], **kw))
    return lines + [closed(ex), scored(ex, reward)]


def test_accounting_separates_injected_from_natural_disruptions_and_the_datasheet_reports_coverage(tmp_path):
    from ledger.corpus import publish as Pub
    from ledger.corpus.export import accounting

    signer, paths, key = signed_store(tmp_path)
    rt = {"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train", "j_max": 1}
    err = {"is_error": True, "message": "connection reset"}
    ok = {"rows": [1]}
    lines = _gov(signer, ["t1", "t2"], rt)
    # f1: lost_ack injected on c1 (its error result is the injection, not natural); c2 errors naturally, consumed by a sub agent
    lines += _tool_execution("f1", "t1", {"c1": err, "c2": {"error": "timeout"}, "c3": ok}, sub=("c2",))
    lines += [fault("f1", "i1", "lost_ack", "c1", simulated_state={"committed": True})]
    # f2: partial_result on c1 and a custom condition with no target call; rejected (reward 0 on sft)
    lines += _tool_execution("f2", "t2", {"c1": {"items": [], "truncated": True}}, reward=0.0)
    lines += [fault("f2", "i1", "partial_result", "c1"),
              fault("f2", "i2", "disk_full", expected_response="report the full disk and stop")]
    lines += _tool_execution("n1", "t2", {"c1": {"error": None}, "c2": ok})  # "error": null is not an error
    with open_log(paths.url) as log:
        rep = Ingestor(log, signer.trust).ingest_lines(enumerate(lines, 1))
    assert not rep.conflicts
    pub = Pub.publish(paths, "sft", key=key, out=tmp_path / "m1.json")
    doc = json.loads((tmp_path / "m1.json").read_text())
    db = connect(paths.db)
    assert states(db, "sft") == {"f1": ("admitted", None), "f2": ("rejected", "outcome"), "n1": ("admitted", None)}
    acc = accounting(db, "sft")
    assert acc["disruptions"] == {"injected": 1, "natural": 1,
                                  "by_role_class": {"main/task": {"injected": 1, "natural": 0},
                                                    "sub/task": {"injected": 0, "natural": 1}}}
    fi = doc["fault_injection"]
    assert fi["disruptions"] == acc["disruptions"]
    f1_targets = adm(db, "f1", "sft")[6]
    assert f1_targets > 0
    assert fi["coverage"] == {
        "malformed_rejected": {"attempts": 0, "admitted_executions": 0, "admitted_target_tokens": 0,
                               "expected_responses": ["inspect the schema and correct the represented error"],
                               "causal_distinction": "no operation was dispatched"},
        "partial_result": {"attempts": 1, "admitted_executions": 0, "admitted_target_tokens": 0,
                           "expected_responses": ["request a valid continuation or report insufficient evidence"],
                           "causal_distinction": "missing content is distinguished from an empty complete result"},
        "lost_ack": {"attempts": 1, "admitted_executions": 1, "admitted_target_tokens": f1_targets,
                     "expected_responses": ["reconcile the identified operation before a dependent retry "
                                            "(reconcile before retry)"],
                     "causal_distinction": "the endpoint may have acted despite the missing reply"},
        "capability_unavailable": {"attempts": 0, "admitted_executions": 0, "admitted_target_tokens": 0,
                                   "expected_responses": ["stop or hand off with accurate scope and owned residual duties"],
                                   "causal_distinction": "the original goal may be unreachable within the grant"},
        "disk_full": {"attempts": 1, "admitted_executions": 0, "admitted_target_tokens": 0,
                      "expected_responses": ["report the full disk and stop"]},
    }
    assert "capability_gap" not in doc
    assert pub.version == 1
    deep = Pub.verify_file(tmp_path / "m1.json", paths, deep=True)
    assert deep.ok, deep.problems


def test_without_faults_or_probes_the_datasheet_is_as_before(tmp_path):
    from ledger.corpus import publish as Pub

    signer, paths, key = signed_store(tmp_path)
    rt = {"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train", "j_max": 1}
    with open_log(paths.url) as log:
        Ingestor(log, signer.trust).ingest_lines(enumerate(_gov(signer, ["t1"], rt) + simple("e1"), 1))
    Pub.publish(paths, "sft", key=key, out=tmp_path / "m1.json")
    doc = json.loads((tmp_path / "m1.json").read_text())
    assert "fault_injection" not in doc and "capability_gap" not in doc
    assert len(doc["members"]) == 1


def test_capability_gap_manifest_lists_the_probe_evidence_per_task(tmp_path):
    from ledger.corpus import publish as Pub

    signer, paths, key = signed_store(tmp_path)
    rt = {"type": "admission_policy", "route": "gap", "version": 1, "use": "rl", "split": "train", "j_max": 1,
          "capability_gap": True}
    lines = _gov(signer, ["tA", "tB"], rt, grant="rl") + simple("e1", "tA", 0.5) + simple("e2", "tB", 0.5)
    lines += [probe("tA", "old", "context", "failure_resolved", at="2097-01-01T00:00:00Z"),
              probe("tA", "p1", "context", "failure_persists", evidence={"injected_fact": "API version"}),
              probe("tA", "p2", "interface", "failure_persists"), probe("tA", "p3", "runtime", "failure_persists"),
              probe("tB", "q1", "context", "failure_resolved")]
    with open_log(paths.url) as log:
        Ingestor(log, signer.trust).ingest_lines(enumerate(lines, 1))
    Pub.publish(paths, "gap", key=key, out=tmp_path / "m1.json")
    doc = json.loads((tmp_path / "m1.json").read_text())
    assert [m["member_id"] for m in doc["members"]] == ["gap/e1/r1"]
    assert doc["capability_gap"]["probes_by_task"] == {"tA": [
        {"rung": "context", "probe_id": "p1", "result": "failure_persists", "evidence": {"injected_fact": "API version"}},
        {"rung": "interface", "probe_id": "p2", "result": "failure_persists", "evidence": None},
        {"rung": "runtime", "probe_id": "p3", "result": "failure_persists", "evidence": None}]}
    assert Pub.verify_file(tmp_path / "m1.json", paths, deep=True).ok


# ============================================================================ convergence under reordering


def _mixed_lines():
    lines = []
    for i, task in enumerate(("tA", "tA", "tB", "tC")):
        ex = f"m{i}"
        lines += _tool_execution(ex, task, {"c1": {"is_error": True}, "c2": {"ok": 1}}, reward=0.5)
        lines += [fault(ex, "i1", ["lost_ack", "partial_result"][i % 2], "c1")]
        lines += [feedback(ex, ["accepted", "abandoned", "rating", "edited"][i], value=0.9 if i == 2 else None,
                           at=f"2098-01-0{i + 1}T00:00:00Z")]
    lines += [feedback("m1", "accepted", at="2098-05-01T00:00:00Z")]
    lines += [probe("tA", "a1", "context", "failure_persists"), probe("tA", "a2", "interface", "failure_persists"),
              probe("tA", "a3", "runtime", "failure_persists"), probe("tB", "b1", "context", "failure_persists"),
              probe("tB", "b2", "context", "failure_resolved", at="2098-06-01T00:00:00Z"),
              probe("tC", "c1", "context", "failure_persists")]
    lines += [r2("gap", use="rl", capability_gap=True), r2("fb", use="rl", predicates=["feedback"])]
    return lines


def _tables(db) -> str:
    return table_dump(db, ("admission", "admitted_paths", "route_telemetry", "fault_injections", "counterfactual_probes",
                           "production_feedback"))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False), batch=st.sampled_from([1, 3, 500]))
def test_evidence_converges_under_every_interleaving(tmp_path_factory, monkeypatch, rnd, batch):
    import ledger.projections.engine as engine_mod

    tmp = tmp_path_factory.mktemp("conv")
    lines = _mixed_lines()
    ref_db, _ = project(tmp, lines, name="ref")
    ref = _tables(ref_db)
    assert "'gap', 'm0'" in ref and "admitted" in ref
    # each execution keeps its own order; every probe and route is a stream of its own (any order)
    mixed = interleave(lines, rnd, lambda line: line.get("execution_id") or line.get("probe_id") or line["route"])
    monkeypatch.setattr(engine_mod, "BATCH", batch)
    db, _ = project(tmp, mixed, name="mix")
    assert _tables(db) == ref


# ============================================================================ napkin math 15.1


def test_napkin_math_15_1_only_the_300_residual_failures_reach_the_corpus(tmp_path):
    """3,000 failing executions (300 tasks x 10); probes attribute 70% to the tool schema (interface
    resolves), 20% to sandbox timeouts (runtime resolves); 10% persist at every rung."""
    from ledger.corpus.export import accounting

    t0 = time.monotonic()
    lines: list[dict] = []
    for k in range(300):
        task = f"task{k:03d}"
        for j in range(10):
            ex = f"{task}-x{j}"
            lines += [opened(ex, task), request(ex, "r1", [1, 2], [3]), closed(ex), scored(ex, 0.25)]
        lines.append(probe(task, "ctx", "context", "failure_persists"))
        lines.append(probe(task, "ifc", "interface", "failure_resolved" if k < 210 else "failure_persists"))
        if k >= 210:
            lines.append(probe(task, "rt", "runtime", "failure_resolved" if k < 270 else "failure_persists"))
    lines.append(r2("residual", use="rl", capability_gap=True))
    db, _ = project(tmp_path, lines)
    tel = db.execute("SELECT evaluated, admitted, rejected, unresolved, rejected_by FROM route_telemetry "
                     "WHERE route = 'residual'").fetchone()
    assert tel == (3000, 300, 2700, 0, '{"capability_gap": 2700}')
    acc = accounting(db, "residual")
    assert acc["dispositions"]["emitted"] == 300 and acc["executions"] == 300 and acc["records"] == 300
    by_reason = acc["dispositions"]["ineligible"]  # semantics 3 files capability_gap by family (SPEC 11.1)
    assert sum(v for k, v in by_reason.items() if "interface probe ifc" in k) == 2100
    assert sum(v for k, v in by_reason.items() if "runtime probe rt" in k) == 600
    assert {ex.split("-")[0] for ex, s in states(db, "residual").items() if s[0] == "admitted"} == \
        {f"task{k:03d}" for k in range(270, 300)}
    assert time.monotonic() - t0 < 60


# ============================================================================ the README example through the CLI


def test_readme_example_through_the_cli(tmp_path, monkeypatch, capsys):
    from pathlib import Path

    from ledger.cli import main as cli
    from tests.helpers import write_lines

    ex = Path(__file__).resolve().parent.parent / "examples"
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    assert cli(["init"]) == 0 and cli(["keys", "new", "--out", "gov.key"]) == 0
    capsys.readouterr()
    assert cli(["sign", "--key", "gov.key", str(ex / "evidence-gov.jsonl")]) == 0
    Path("gov.signed.jsonl").write_text(capsys.readouterr().out)
    bad = write_lines(tmp_path / "bad.jsonl", [{**PROBE, "rung": "weights"}])
    assert cli(["ingest", bad]) == 2
    err = capsys.readouterr().err
    assert "line 1: field 'rung': expected one of context, interface, runtime" in err and "Traceback" not in err
    assert cli(["ingest", str(ex / "evidence-events.jsonl")]) == 0 and cli(["ingest", "gov.signed.jsonl"]) == 0
    assert cli(["project"]) == 0
    capsys.readouterr()
    assert cli(["admission", "show", "residual_rl"]) == 0
    out = capsys.readouterr().out
    assert "g1  admitted" in out and "s1  rejected  [capability_gap]  task schema-1: failure resolved by the interface " \
                                      "probe q2" in out
    assert cli(["admission", "show", "feedback_rl"]) == 0
    assert "s1  rejected  [feedback]  latest feedback: abandoned" in capsys.readouterr().out
    assert cli(["manifest", "publish", "residual_rl", "--key", "gov.key", "--out", "r.v1.json"]) == 0
    assert cli(["manifest", "verify", "r.v1.json", "--deep"]) == 0
    doc = json.loads(Path("r.v1.json").read_text())
    assert [m["member_id"] for m in doc["members"]] == ["residual_rl/g1/r2"]
    assert doc["fault_injection"]["disruptions"] == {"injected": 1, "natural": 0,
                                                     "by_role_class": {"main/task": {"injected": 1, "natural": 0}}}
    assert doc["fault_injection"]["coverage"]["lost_ack"]["admitted_target_tokens"] == 3
    assert [p["probe_id"] for p in doc["capability_gap"]["probes_by_task"]["gap-1"]] == ["p1", "p2", "p3"]
