"""Seed 002's repair record end to end through the CLI (§15.6.2, §15.9, §15.10.1; SPEC §6.8).

collection_run_r19_01 runs pool_repair_01 and captures trace_r19_01: the refused edit e2, the
schema query e3, the corrected edit e4, the test summary e5 (harness) and the final summary
e6.  recovery_targets_v1 selects e3, e4 and e6 and keeps e2 and e5 as context.  A redaction
replaces a private fixture path, making trace_r19_01_redacted_v1, which is revalidated (the
redacted schema query e3 re-verified) and published to repair_demonstrations_v1.  The
published view must target the policy tokens of e3, e4 and e6 and nothing else.
"""

from __future__ import annotations

import json

import pytest

from ledger.cli import main as cli
from tests.helpers import write_lines
from tests.r19_trace import PLACEHOLDER, R19_PATH as PRIVATE, R19_REQUESTS as REQUESTS, redact

DEADLINE = "2099-01-01T00:00:00Z"
AT = "2098-06-01T00:00:00Z"
PARENT, VIEW = "trace_r19_01", "trace_r19_01_redacted_v1"
ROUTE = "repair_demonstrations_v1"
E3, E4, E6 = [50] + PRIVATE, [60, 61], [80, 81]


def record_lines(*, verified: list[str] | None) -> list[dict]:
    lines = [{"type": "task_registered", "task_id": "pool_repair_01", "source": "repo_acme", "fixture": "pool_fixture_v1"},
             {"type": "execution_opened", "execution_id": PARENT, "task_id": "pool_repair_01", "deadline": DEADLINE,
              "policy": "repair-agent@1", "collection_run_id": "collection_run_r19_01", "origin": "production"}]
    for rid, (inp, out, gen) in REQUESTS.items():
        line = {"type": "request", "execution_id": PARENT, "request_id": rid, "input_ids": inp, "output_ids": out,
                "generator": gen}
        if gen == "policy":
            line["output_logprobs"] = [-0.25] * len(out)
        lines.append(line)
    lines += [
        {"type": "execution_closed", "execution_id": PARENT, "status": "completed", "artifact_versions": ["ws_r19", "ws_r20"]},
        {"type": "assessment", "assessment_id": "repair_accept_v1", "execution_id": PARENT, "artifact_version": "ws_r20",
         "outcome": "scored", "reward": 1.0, "evaluator": "repair_accept@1",
         "criteria": [{"name": "regression", "verdict": "pass"}, {"name": "residual_duty", "verdict": "pass"}]},
        {"type": "target_selection", "execution_id": PARENT, "selection_id": "recovery_targets_v1",
         "policy": "recovery_targets_v1", "behavioral_role": "recovery", "context_only_request_ids": ["e2", "e5"],
         "selected_request_ids": ["e3", "e4", "e6"]},
        {"type": "record_derived", "derived_execution_id": VIEW, "parent_execution_id": PARENT,
         "transformation": "path_redaction@v1", "withheld_fields": ["observation.private_path"],
         "replacements": {rid: ({"input_ids": redact(inp), "output_ids": redact(out)} if rid == "e3"
                                else {"input_ids": redact(inp)}) for rid, (inp, out, _g) in REQUESTS.items()}},
    ]
    reval = {"type": "revalidated", "derived_execution_id": VIEW, "verdict": "pass",
             "evidence": {"review": "the schema lookup and corrected edit are still justified by the redacted context"}}
    if verified is not None:
        reval["verified_request_ids"] = verified
    lines.append(reval)
    return [{**line, "occurred_at": AT} for line in lines]


GOVERNANCE = [
    {"type": "split_policy", "policy_id": "p1", "salt": "s", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}},
    {"type": "permission", "subject": "source:repo_acme", "use": "sft", "action": "grant", "authority": "legal"},
    {"type": "admission_policy", "route": ROUTE, "version": 1, "use": "sft", "split": "train", "j_max": 4,
     "required_criteria": ["regression", "residual_duty"], "consumer": "repair-policy-team",
     "evaluation_claim": "recovery from harness refusals on held-out repair groups"},
]


def _store(tmp_path, monkeypatch, capsys, governance: list[dict]):
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    assert cli(["init"]) == 0
    assert cli(["keys", "new", "--out", "gov.key"]) == 0
    raw = write_lines(tmp_path / "gov.jsonl", [{**g, "occurred_at": AT} for g in governance])
    capsys.readouterr()
    assert cli(["sign", "--key", "gov.key", raw]) == 0
    (tmp_path / "gov.signed.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", "gov.signed.jsonl"]) == 0
    return tmp_path


@pytest.fixture
def store(tmp_path, monkeypatch, capsys):
    return _store(tmp_path, monkeypatch, capsys, GOVERNANCE)


@pytest.fixture
def store_v2(tmp_path, monkeypatch, capsys, earlier_release):
    """The route as the second release stamped it (semantics 2): its manifests keep their meaning."""
    return _store(tmp_path, monkeypatch, capsys,
                  [{**g, "semantics": 2} if g["type"] == "admission_policy" else g for g in GOVERNANCE])


def _targets(records: list[dict], ex: str) -> list[list[int]]:
    return [[t for t, m in zip(r["input_ids"], r["target_mask"]) if m] for r in records if r["execution_id"] == ex]


def _publish_and_read(tmp_path, capsys) -> tuple[dict, list[dict]]:
    assert cli(["project"]) == 0
    assert cli(["manifest", "publish", ROUTE, "--key", "gov.key", "--out", "m.json"]) == 0
    assert cli(["export", ROUTE, "--format", "jsonl", "--out", "records.jsonl"]) == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "m.json").read_text())
    recs = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    return doc, recs


def _check_view(recs: list[dict]) -> None:
    # one path per execution (one chain); the view's targets: the redacted schema query, the corrected
    # edit and the final summary; not the refused edit e2, not e1, not the harness's test summary e5
    assert _targets(recs, VIEW) == [[50] + PLACEHOLDER + E4 + E6]
    view = next(r for r in recs if r["execution_id"] == VIEW)
    assert not any(view["input_ids"][i:i + 3] == PRIVATE for i in range(len(view["input_ids"])))
    assert view["execution_target_tokens"] == 6 and view["loss_weight"] == pytest.approx(1 / 6)
    # e2's tokens stay in the sequence as conditioning context
    assert view["input_ids"][:12] == [10, 11, 777, 12, 20, 21, 30, 40, 41, 31, 50, 777]


def _check_selection_and_verify(doc: dict, capsys) -> None:
    assert doc["declared_use"] == "sft" and doc["consumer"] == "repair-policy-team"
    assert doc["selection"]["required_criteria"] == ["regression", "residual_duty"]
    assert doc["selection"]["min_reward"] == 1.0
    assert cli(["manifest", "verify", "m.json", "--deep"]) == 0
    assert "manifest ok" in capsys.readouterr().out
    assert cli(["splits", "check"]) == 0


def test_the_published_redacted_view_targets_e3_e4_e6_exactly(store, capsys):
    """Semantics 3: one episode, one member -- the revalidated view; the raw trace is redundancy."""
    write_lines(store / "record.jsonl", record_lines(verified=["e3"]))
    assert cli(["ingest", "record.jsonl"]) == 0
    doc, recs = _publish_and_read(store, capsys)
    _check_view(recs)
    assert _targets(recs, PARENT) == []  # the raw trace is not trained a second time
    assert {m["execution_id"] for m in doc["members"]} == {VIEW}
    assert doc["semantics"] == 3
    assert doc["accounting"]["dispositions"]["redundancy"] == {f"lineage_family: superseded by {VIEW}": 1}
    assert doc["accounting"]["by_behavioral_role"]["recovery"]["target_tokens"] == 6
    _check_selection_and_verify(doc, capsys)


def test_the_second_release_trained_the_episode_twice_and_its_manifest_keeps_that_meaning(store_v2, capsys):
    """What issue 26 found (wrong result 7), kept on a semantics-2 route: raw trace and redacted view
    are both members; the manifest still deep-verifies under this release."""
    write_lines(store_v2 / "record.jsonl", record_lines(verified=["e3"]))
    assert cli(["ingest", "record.jsonl"]) == 0
    doc, recs = _publish_and_read(store_v2, capsys)
    _check_view(recs)
    assert _targets(recs, PARENT) == [E3 + E4 + E6]
    assert {m["execution_id"] for m in doc["members"]} == {PARENT, VIEW}
    assert doc["semantics"] == 2
    assert doc["accounting"]["by_behavioral_role"]["recovery"]["target_tokens"] == 8 + 6
    _check_selection_and_verify(doc, capsys)


def test_a_replaced_output_stays_context_until_revalidation_names_it(store, capsys):
    write_lines(store / "record.jsonl", record_lines(verified=None))
    assert cli(["ingest", "record.jsonl"]) == 0
    _doc, recs = _publish_and_read(store, capsys)
    assert _targets(recs, VIEW) == [E4 + E6]  # the redacted e3 was not re-verified: context only
    assert _targets(recs, PARENT) == []  # superseded by its revalidated view


@pytest.mark.usefixtures("earlier_release")
def test_the_first_release_rules_targeted_the_refused_edit(tmp_path, monkeypatch, capsys):
    """What issue 15 found, kept reproducible: a semantics-1 route ignores selected_request_ids and
    the selection does not reach the view, so the published view targets e2."""
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    assert cli(["init"]) == 0
    assert cli(["keys", "new", "--out", "gov.key"]) == 0
    gov = [{**g, "occurred_at": AT, **({"semantics": 1} if g["type"] == "admission_policy" else {})} for g in GOVERNANCE]
    gov[-1].pop("required_criteria")
    raw = write_lines(tmp_path / "gov.jsonl", gov)
    capsys.readouterr()
    assert cli(["sign", "--key", "gov.key", raw]) == 0
    (tmp_path / "gov.signed.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", "gov.signed.jsonl"]) == 0
    write_lines(tmp_path / "record.jsonl", record_lines(verified=["e3"]))
    assert cli(["ingest", "record.jsonl"]) == 0
    doc, recs = _publish_and_read(tmp_path, capsys)
    assert "semantics" not in doc
    assert [40, 41] == _targets(recs, VIEW)[0][2:4]  # e2, the refused edit, is a target under the old rules
    assert cli(["manifest", "verify", "m.json", "--deep"]) == 0


@pytest.mark.usefixtures("earlier_release")
def test_a_first_release_training_route_on_final_test_fails_splits_check(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LEDGER_STORE", str(tmp_path / "store"))
    monkeypatch.chdir(tmp_path)
    assert cli(["init"]) == 0
    assert cli(["keys", "new", "--out", "gov.key"]) == 0
    gov = [{"type": "split_policy", "policy_id": "p1", "salt": "s", "fractions": {"train": 0.0, "dev": 0.0, "final_test": 1.0}},
           GOVERNANCE[1],
           {**GOVERNANCE[2], "split": "final_test", "semantics": 1}]
    gov[-1].pop("required_criteria")
    raw = write_lines(tmp_path / "gov.jsonl", [{**g, "occurred_at": AT} for g in gov])
    capsys.readouterr()
    assert cli(["sign", "--key", "gov.key", raw]) == 0
    (tmp_path / "gov.signed.jsonl").write_text(capsys.readouterr().out)
    assert cli(["ingest", "gov.signed.jsonl"]) == 0
    write_lines(tmp_path / "record.jsonl", record_lines(verified=["e3"]))
    assert cli(["ingest", "record.jsonl"]) == 0
    _publish_and_read(tmp_path, capsys)
    assert cli(["splits", "check"]) == 1
    out = capsys.readouterr().out
    assert f"training_manifest_outside_train: {ROUTE}/{PARENT}/e6: sft manifest {ROUTE} v1 holds execution {PARENT} " \
           "of the final_test split" in out


LINEAGE = {"collection_id": None, "collection_version": None, "collection_run_id": "collection_run_r19_01",
           "task_id": "pool_repair_01", "fixture": "pool_fixture_v1", "artifact_version": "ws_r20",
           "evaluator": "repair_accept@1",
           "transformations": [{"execution_id": VIEW, "transformation": "path_redaction@v1"},
                               {"execution_id": PARENT, "transformation": None}],
           "selection": {"selection_id": "recovery_targets_v1", "policy": "recovery_targets_v1",
                         "behavioral_role": "recovery"},
           "route_version": 1, "semantics": 3}


def test_every_semantics_3_member_carries_its_lineage_inside_its_digest(store, capsys):
    """Seed 002 §15.10.2 / Table 13 (SPEC 11.2): run, task and fixture, artifact version, evaluator,
    transformation chain (root last), selection, route and semantics versions -- in the record, so in
    the digest; the manifest entry and ``manifest prove`` show it; JSON lines, Parquet and tree exports
    all carry it with the same digest; a tampered lineage is caught."""
    from ledger.corpus.export import DigestMismatch, read_records

    write_lines(store / "record.jsonl", record_lines(verified=["e3"]))
    assert cli(["ingest", "record.jsonl"]) == 0
    doc, recs = _publish_and_read(store, capsys)
    (rec,) = recs
    assert rec["lineage"] == LINEAGE
    (entry,) = doc["members"]
    assert entry["lineage"] == LINEAGE and entry["digest"] == rec["digest"]
    assert cli(["manifest", "prove", "m.json", rec["member_id"]]) == 0
    assert json.loads(capsys.readouterr().out)["lineage"] == LINEAGE
    for fmt in ("parquet", "tree"):
        assert cli(["export", ROUTE, "--format", fmt, "--out", f"records.{fmt}"]) == 0
        assert list(read_records(store / f"records.{fmt}")) == recs
    tampered = {**rec, "lineage": {**LINEAGE, "fixture": "pool_fixture_v2"}}
    write_lines(store / "bad.jsonl", [tampered])
    with pytest.raises(DigestMismatch):
        list(read_records(store / "bad.jsonl"))


def test_second_release_members_carry_no_lineage(store_v2, capsys):
    write_lines(store_v2 / "record.jsonl", record_lines(verified=["e3"]))
    assert cli(["ingest", "record.jsonl"]) == 0
    doc, recs = _publish_and_read(store_v2, capsys)
    assert all("lineage" not in r for r in recs) and all("lineage" not in m for m in doc["members"])
