"""Collection manifests and model checkpoints (SPEC 6.10; seed 002 15.2.3, 15.3.1 Table 2, 15.4.2).

The README example (examples/collections-*.jsonl) goes through the CLI; the rules are then checked
one by one on small logs projected with the real projections (``projections.registry``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.cli import main as cli
from ledger.events.validate import ValidationError, validate_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections.engine import ReplayEngine, canonical_dump, connect
from ledger.projections.registry import all_projections
from tests.helpers import Signer, interleave, table_dump, write_lines

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOW = 1_900_000_000_000_000
T0, T1, T2, T3 = "2030-01-01T00:00:00Z", "2030-01-02T00:00:00Z", "2030-01-03T00:00:00Z", "2030-01-04T00:00:00Z"
SIGNER = Signer()

# seed 002 Table 2 / 15.2.3's four elements: capability, artifact (use + consumer), admission evidence
# (required capture + routes), held-out evaluation claim
MANIFEST = {"type": "collection_manifest", "collection_id": "pool-repair", "version": 1, "use": "sft",
            "consumer": "sft-trainer@3", "capability": "interpret failed checks and choose a justified next action",
            "sources": ["repo-pool"], "permitted_use": {"inspect": True, "export": "sft only"},
            "task_relations": {"task": "pool_repair_01", "fixture": "pool_fixture_v1"},
            "configuration": {"sampler": "temp=0.7", "prompt_version": "repair-prompt@2", "tool_versions": {"pytest": "8.2"},
                              "variation": "seeded fixture only", "attempt_selection": "every attempt kept"},
            "required_capture": ["main/task", "sub/task", "tool_results"], "routes": ["repair_sft"],
            "evaluation_claim": "held-out pool repairs: pass@1 improves on repair_accept_v1"}


def _sign(line: dict, at: str = T0) -> dict:
    return SIGNER.sign({"occurred_at": at, **line})


def route(name: str, version: int = 1, at: str = T0, **kw) -> dict:
    return _sign({"type": "admission_policy", "route": name, "version": version, "use": "sft", "split": "train",
                  "j_max": 4, **kw}, at)


def execution(ex: str, campaign: str | None, *, task: str = "t1", sub: bool = True, at: str = T1,
              reconstructed: bool = False, result: bool = True) -> list[dict]:
    o = {"type": "execution_opened", "execution_id": ex, "task_id": task, "deadline": "2031-01-01T00:00:00Z",
         "policy": "qwen@1", "occurred_at": at}
    if campaign:
        o["collection_id"] = campaign
    req = lambda rid, inp, out, **kw: {"type": "request", "execution_id": ex, "request_id": rid, "input_ids": inp,  # noqa: E731
                                       "output_ids": out, "output_logprobs": [-0.5] * len(out), "occurred_at": at, **kw}
    lines = [o, req("r1", [1, 2, 3], [4, 5], emitted_tool_call_ids=["c1"]),
             req("r2", [1, 2, 3, 4, 5, 6], [7, 8], consumed_tool_call_ids=["c1"])]
    if reconstructed:
        lines[2] = {k: v for k, v in lines[2].items() if k != "output_logprobs"} | {"reconstructed": True}
    if result:
        lines.append({"type": "tool_payload", "execution_id": ex, "call_id": "c1", "kind": "result", "payload": "ok",
                      "occurred_at": at})
    if sub:
        lines.append(req("s1", [1, 2, 3, 4, 5, 9], [10], agent_id="helper", agent_tier="sub"))
    return lines + [{"type": "execution_closed", "execution_id": ex, "status": "completed", "artifact_versions": ["v1"],
                     "occurred_at": at},
                    {"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
                     "outcome": "scored", "reward": 1.0, "evaluator": "grader@1", "occurred_at": at}]


def governance(*extra: dict) -> list[dict]:
    return [{"type": "task_registered", "task_id": "t1", "source": "pool", "occurred_at": T0},
            _sign({"type": "split_policy", "policy_id": "p1", "salt": "s",
                   "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}}),
            _sign({"type": "permission", "subject": "source:pool", "use": "sft", "action": "grant", "authority": "legal"}),
            *extra]


def project(tmp_path, lines, name="s"):
    log = open_log(str(tmp_path / name), create=True)
    rep = Ingestor(log, SIGNER.trust, seal=None).ingest_lines(enumerate(lines, 1))
    db = connect(tmp_path / f"{name}.db")
    ReplayEngine(log, db, all_projections(), trust=SIGNER.trust).run()
    return db, rep


def adm(db, ex, r="repair_sft"):
    return db.execute("SELECT state, predicate, verdict, missing_evidence, reason FROM admission WHERE route = ? AND "
                      "execution_id = ?", (r, ex)).fetchone()


# ============================================================================ the README example, through the CLI


def test_readme_example_through_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    assert cli(["init"]) == 0 and cli(["keys", "new", "--out", "gov.key"]) == 0
    capsys.readouterr()
    assert cli(["sign", "--key", "gov.key", str(EXAMPLES / "collections-gov.jsonl")]) == 0
    Path("gov.signed.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", str(EXAMPLES / "collections-events.jsonl")]) == 0 and cli(["ingest", "gov.signed.jsonl"]) == 0
    assert cli(["project"]) == 0
    capsys.readouterr()
    assert cli(["admission", "show", "repair_sft", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    got = {r["execution_id"]: (r["state"], r["predicate"], r["reason"]) for r in doc["executions"]}
    assert got == {
        "run-1": ("admitted", None, "admitted"),
        "run-2": ("rejected", "record_adequacy",
                  "required capture of collection_manifest pool-repair v1 missing: role class sub/task"),
        "run-3": ("rejected", "record_adequacy",
                  "execution run-3 belongs to no collection campaign; route repair_sft admits collection pool-repair only"),
        "run-4": ("rejected", "record_adequacy", "execution run-4 belongs to collection other-campaign; route repair_sft "
                                                 "admits collection pool-repair only")}
    assert doc["collection"]["manifest"]["capability"] == "interpret failed checks and choose a justified next action"
    assert (doc["collection"]["executions"], doc["collection"]["declared_after_sampling"]) == (2, False)
    # a route without collection_id keeps today's result; a campaign without a manifest is pending
    assert cli(["admission", "show", "open_sft", "--json"]) == 0
    assert {r["state"] for r in json.loads(capsys.readouterr().out)["executions"]} == {"admitted"}
    assert cli(["admission", "show", "ghost_sft", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["executions"]
    assert {(r["state"], r["missing_evidence"]) for r in rows} == {("unresolved", "collection_manifest ghost")}

    # version 2 of the manifest, declared after sampling began: flagged, and its capture rules now apply
    late = {k: v for k, v in MANIFEST.items() if k not in ("configuration",)}
    late.update(version=2, required_capture=["main/task", "tool_results"], occurred_at=T3)
    write_lines(tmp_path / "late.jsonl", [late])
    assert cli(["sign", "--key", "gov.key", "late.jsonl"]) == 0
    Path("late.signed.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", "late.signed.jsonl"]) == 0 and cli(["project"]) == 0
    capsys.readouterr()
    assert cli(["admission", "show", "repair_sft"]) == 0
    out = capsys.readouterr().out
    assert "run-2  admitted" in out and "declared_after_sampling: true" in out
    assert "declared after sampling: collection_manifest pool-repair v2 at 2030-01-04T00:00:00Z (first execution " \
           "2030-01-02T00:00:00Z)" in out
    assert cli(["status", "--json"]) == 0
    st_ = json.loads(capsys.readouterr().out)["collections"]["pool-repair"]
    assert st_ == {"manifest_versions": [1, 2], "executions": 2, "first_execution_at": "2030-01-02T00:00:00Z",
                   "declared_after_sampling": True,
                   "late_declarations": [{"declaration": "collection_manifest", "collection_id": "pool-repair",
                                          "version": 2, "occurred_at": "2030-01-04T00:00:00Z"}]}
    assert cli(["manifest", "publish", "repair_sft", "--key", "gov.key", "--out", "m1.json"]) == 0
    assert cli(["manifest", "verify", "m1.json", "--deep"]) == 0
    m = json.loads(Path("m1.json").read_text())
    assert (m["collection"]["declared_after_sampling"], m["collection"]["manifest_versions"]) == (True, [1, 2])
    assert [d["version"] for d in m["collection"]["late_declarations"]] == [2]
    assert sorted(x["member_id"] for x in m["members"]) == ["repair_sft/run-1/r2", "repair_sft/run-1/s1",
                                                            "repair_sft/run-2/r2"]

    # a checkpoint trained on repair_sft v1: `ledger impact` names it with its claims
    ck = {"type": "checkpoint_trained", "checkpoint_id": "ckpt-7", "manifests": [{"route": "repair_sft", "version": 1}],
          "evaluation_claims": ["held-out pool repairs: pass@1"]}
    write_lines(tmp_path / "ck.jsonl", [ck])
    capsys.readouterr()
    assert cli(["sign", "--key", "gov.key", "ck.jsonl"]) == 0
    Path("ck.signed.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", "ck.signed.jsonl"]) == 0
    capsys.readouterr()
    assert cli(["impact", "source:repo-pool", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [(x["route"], x["version"], x["checkpoints"]) for x in rep["manifests"]] == [
        ("repair_sft", 1, [{"checkpoint_id": "ckpt-7", "evaluation_claims": ["held-out pool repairs: pass@1"]}])]
    assert cli(["impact", "source:repo-pool"]) == 0
    assert "checkpoint ckpt-7 trained on it (evaluation claims: held-out pool repairs: pass@1)" in capsys.readouterr().out


# ============================================================================ validation


@pytest.mark.parametrize("fields, field, message", [
    ({"required_capture": ["main/task", "screenshots"]}, "required_capture", "unknown required capture 'screenshots'"),
    ({"required_capture": ["logprobs", "logprobs"]}, "required_capture", "'logprobs' is named twice"),
    ({"version": 0}, "version", "must be >= 1, got 0"),
    ({"version": "1"}, "version", "expected an integer"),
    ({"capability": None}, "capability", "is required"),
    ({"evaluation_claim": None}, "evaluation_claim", "is required"),
    ({"use": "publication"}, "use", "expected one of sft, preference, rl, evaluation"),
    ({"configuration": {"sampler": "x", "seed": 3}}, "configuration", "unknown key 'seed'"),
    ({"configuration": ["sampler"]}, "configuration", "expected an object"),
    ({"configuration": {"tool_versions": {"pytest": 8}}}, "configuration", "tool_versions must be an object"),
    ({"configuration": {"prompt_version": ""}}, "configuration", "prompt_version must be a non-empty string"),
    ({"routes": [1]}, "routes", "expected a list of non-empty strings"),
    ({"colour": "red"}, "colour", "unknown field"),
])
def test_bad_collection_manifests_are_refused_naming_the_field(fields, field, message):
    line = {k: v for k, v in {**MANIFEST, **fields}.items() if v is not None}
    with pytest.raises(ValidationError) as exc:
        validate_line(line, line=3, now_micros=NOW)
    assert exc.value.field == field and message in str(exc.value) and str(exc.value).startswith("line 3")


@pytest.mark.parametrize("fields, field, message", [
    ({"manifests": []}, "manifests", "expected a non-empty list"),
    ({"manifests": [{"route": "r"}]}, "manifests", "manifests[0] needs exactly route and version"),
    ({"manifests": [{"route": "r", "version": 0}]}, "manifests", "manifests[0]: must be >= 1"),
    ({"checkpoint_id": ""}, "checkpoint_id", "expected a non-empty string"),
    ({"evaluation_claims": "x" * 0}, "evaluation_claims", "expected a list"),
])
def test_bad_checkpoint_lines_are_refused_naming_the_field(fields, field, message):
    line = {"type": "checkpoint_trained", "checkpoint_id": "ck", "manifests": [{"route": "r", "version": 1}], **fields}
    with pytest.raises(ValidationError) as exc:
        validate_line(line, line=1, now_micros=NOW)
    assert exc.value.field == field and message in str(exc.value)


def test_execution_opened_collection_id_is_optional_and_checked():
    base = {"type": "execution_opened", "execution_id": "e", "task_id": "t", "deadline": T0, "policy": "p"}
    assert validate_line(base, now_micros=NOW)["collection_id"] is None
    assert validate_line({**base, "collection_id": "c"}, now_micros=NOW)["collection_id"] == "c"
    with pytest.raises(ValidationError) as exc:
        validate_line({**base, "collection_id": ""}, now_micros=NOW)
    assert exc.value.field == "collection_id"


def test_cli_refuses_bad_and_unsigned_lines_appending_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    assert cli(["init"]) == 0
    capsys.readouterr()
    bad = write_lines(tmp_path / "bad.jsonl", [{**MANIFEST, "required_capture": ["screenshots"]}])
    assert cli(["ingest", bad]) == 2
    err = capsys.readouterr().err
    assert "line 1: field 'required_capture': unknown required capture 'screenshots'" in err and "Traceback" not in err
    unsigned = write_lines(tmp_path / "u.jsonl", [MANIFEST])
    assert cli(["ingest", unsigned]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert cli(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["log"]["events"] == 0


# ============================================================================ rules


def test_required_capture_names_what_is_missing(tmp_path):
    m = _sign({**MANIFEST, "required_capture": ["main/task", "main/summary", "tool_results", "logprobs"]})
    lines = governance(m, route("repair_sft", collection_id="pool-repair")) + \
        execution("full", "pool-repair") + execution("noresult", "pool-repair", result=False) + \
        execution("recon", "pool-repair", reconstructed=True)
    db, _ = project(tmp_path, lines)
    base = "required capture of collection_manifest pool-repair v1 missing: role class main/summary"
    assert adm(db, "full") == ("rejected", "record_adequacy", "fail", None, base)
    assert adm(db, "noresult")[4] == base + "; result of tool call c1"
    assert adm(db, "recon")[4] == base + "; log-probs of request r2"


@pytest.mark.usefixtures("earlier_release")
def test_a_first_release_route_ignores_collection_id(tmp_path):
    lines = governance(_sign(MANIFEST), route("old", collection_id="pool-repair", semantics=1)) + execution("x", None)
    db, _ = project(tmp_path, lines)
    assert adm(db, "x", "old")[:3] == ("admitted", None, "pass")


def test_late_route_version_is_flagged_by_occurred_at(tmp_path):
    from ledger.projections.collections import campaign_summary

    lines = governance(_sign(MANIFEST), route("repair_sft", collection_id="pool-repair", at=T0),
                       route("repair_sft", 2, at=T2, collection_id="pool-repair", j_max=2),
                       route("other", at=T2)) + execution("a", "pool-repair", at=T1)
    db, _ = project(tmp_path, lines)
    s = campaign_summary(db, "pool-repair", route="repair_sft")
    assert s["late_declarations"] == [{"declaration": "admission_policy", "route": "repair_sft", "version": 2,
                                       "occurred_at": "2030-01-03T00:00:00Z"}]
    # a declaration at the very instant of the first execution is not after it
    db2, _ = project(tmp_path, governance(_sign(MANIFEST, T1), route("repair_sft", collection_id="pool-repair"))
                     + execution("a", "pool-repair", at=T1), name="same")
    assert campaign_summary(db2, "pool-repair")["declared_after_sampling"] is False


def test_leak_report_names_checkpoints_and_claims(tmp_path, monkeypatch, capsys):
    from tests.test_splits_projection import FR, SALT, find_task

    tr, ft = find_task("train", "tr"), find_task("final_test", "ft")
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    assert cli(["init"]) == 0 and cli(["keys", "new", "--out", "gov.key"]) == 0
    tasks = [{"type": "task_registered", "task_id": tr, "source": "pool"}, {"type": "task_registered", "task_id": ft}]
    gov = [{"type": "split_policy", "policy_id": "p1", "salt": SALT, "fractions": FR},
           {"type": "permission", "subject": "source:pool", "use": "sft", "action": "grant", "authority": "legal"},
           {k: v for k, v in MANIFEST.items()},
           {"type": "admission_policy", "route": "repair_sft", "version": 1, "use": "sft", "split": "train", "j_max": 4,
            "collection_id": "pool-repair"}]
    for name, lines in (("gov", gov), ("ev", tasks + execution("e1", "pool-repair", task=tr, at=T2))):
        write_lines(tmp_path / f"{name}.jsonl", lines)
    capsys.readouterr()
    assert cli(["sign", "--key", "gov.key", "gov.jsonl"]) == 0
    Path("gov.s.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", "gov.s.jsonl"]) == 0 and cli(["ingest", "ev.jsonl"]) == 0
    assert cli(["manifest", "publish", "repair_sft", "--key", "gov.key", "--out", "m.json"]) == 0
    write_lines(tmp_path / "ck.jsonl", [{"type": "checkpoint_trained", "checkpoint_id": "ckpt-1",
                                         "manifests": [{"route": "repair_sft", "version": 1}],
                                         "evaluation_claims": ["pool pass@1", "regression suite"]}])
    capsys.readouterr()
    assert cli(["sign", "--key", "gov.key", "ck.jsonl"]) == 0
    Path("ck.s.jsonl").write_text(capsys.readouterr().out)
    write_lines(tmp_path / "link.jsonl", [{"type": "task_linked", "task_a": ft, "task_b": tr, "relation": "vendored"}])
    assert cli(["ingest", "ck.s.jsonl"]) == 0 and cli(["ingest", "link.jsonl"]) == 0
    capsys.readouterr()
    assert cli(["splits", "check", "--json"]) == 1
    offenders = json.loads(capsys.readouterr().out)["offenders"]
    leaks = [o for o in offenders if o["kind"] in ("possible_leak", "published_leak")]
    assert {o["kind"] for o in leaks} == {"possible_leak", "published_leak"}
    for o in leaks:
        assert (o["checkpoints"], o["evaluation_claims"]) == (["ckpt-1"], ["pool pass@1", "regression suite"])
        assert o["detail"].endswith("; checkpoints trained on repair_sft v1: ckpt-1 (retire; re-run evaluation claims: "
                                    "pool pass@1, regression suite)")
    assert cli(["splits", "check"]) == 1
    assert "checkpoints trained on repair_sft v1: ckpt-1" in capsys.readouterr().out


# ============================================================================ convergence


def _scenario() -> list[dict]:
    m2 = {**MANIFEST, "version": 2, "required_capture": ["main/task", "logprobs"]}
    gov = governance(_sign(MANIFEST), route("repair_sft", collection_id="pool-repair"), _sign(m2, T3),
                     route("ghost", collection_id="ghost"),
                     _sign({"type": "checkpoint_trained", "checkpoint_id": "ck", "manifests": [{"route": "repair_sft",
                                                                                                "version": 1}]}))
    return gov + execution("a", "pool-repair") + execution("b", "pool-repair", sub=False, reconstructed=True) + \
        execution("c", None) + execution("d", "other", at=T2)


def _tables(db) -> str:
    return table_dump(db, ("admission", "collection_manifests", "collection_executions", "collection_requests",
                           "collection_routes", "checkpoint_manifests"))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rnd=st.randoms(use_true_random=False), batch=st.sampled_from([1, 3, 500]))
def test_collections_converge_under_every_interleaving(tmp_path_factory, monkeypatch, rnd, batch):
    import ledger.projections.engine as engine_mod
    from ledger.projections.collections import summaries

    tmp = tmp_path_factory.mktemp("conv")
    lines = _scenario()
    ref_db, _ = project(tmp, lines, name="ref")
    ref = _tables(ref_db)
    assert [adm(ref_db, e)[0] for e in "abcd"] == ["admitted", "rejected", "rejected", "rejected"]
    assert adm(ref_db, "b")[4] == "required capture of collection_manifest pool-repair v2 missing: log-probs of request r2"
    mixed = interleave(lines, rnd)
    monkeypatch.setattr(engine_mod, "BATCH", batch)
    db, _ = project(tmp, mixed, name="mix")
    assert _tables(db) == ref
    assert summaries(db) == summaries(ref_db) and summaries(db)["pool-repair"]["declared_after_sampling"] is True
