"""Trainer export (SPEC §7.3), member digests (§6.6) and accounting (§6.7)."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

import ledger.corpus.export as export_mod
import ledger.corpus.path_records as path_records
from ledger.algorithms.loss import PathRecord, trainer_loss
from ledger.corpus.export import (
    DigestMismatch,
    accounting,
    export,
    member_digest,
    read_records,
    trainer_records,
    write_jsonl,
    write_parquet,
    write_tree,
)
from tests.test_admission import (
    SIGNER,
    STAMP,
    fake_evidence,
    not_assessable,
    project,
    route,
    scored,
    simple,
    tree_execution,
    verdict,
)

pytestmark = pytest.mark.usefixtures("earlier_release")  # routes of the first release's rules (SPEC §10)

EV = fake_evidence()
P = -0.5  # the helpers' behaviour log-prob of every policy output token


def build(tmp_path, extra=(), name="s"):
    lines = (tree_execution("e1", "t1") + [scored("e1", 0.5)]
             + simple("dum", "t2") + [not_assessable("dum")]
             + simple("rej", "t3") + [{"type": "execution_finalized", "execution_id": "rej"}]
             + simple("pend", "t4")
             + [route("sft", j_max=8)] + list(extra))
    return project(tmp_path, lines, EV, name=name)


def sha(rec: dict) -> str:
    body = {k: v for k, v in rec.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()


def test_trainer_records_exact(tmp_path):
    db = build(tmp_path)
    recs = list(trainer_records(db, "sft", evidence=EV))
    assert [r["member_id"] for r in recs] == ["sft/dum/dummy", "sft/e1/r3", "sft/e1/r4", "sft/e1/s1"]
    common = {"execution_id": "e1", "task_id": "t1", "group_id": "g-e1", "split": "train", "route": "sft",
              "loss_weight": 0.1, "execution_target_tokens": 10, "reward": 0.5, "dummy": False}
    n = None
    expected = [
        {"member_id": "sft/e1/r3", "leaf_request_id": "r3", "role_class": "sub/task",
         "input_ids": [1, 2, 3, 4, 5, 9, 10], "target_mask": [0, 0, 0, 0, 0, 0, 1],
         "behavior_logprobs": [n, n, n, P, P, n, P], **common},
        {"member_id": "sft/e1/r4", "leaf_request_id": "r4", "role_class": "main/task",
         "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 14, 15, 16, 17], "target_mask": [0, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1],
         "behavior_logprobs": [n, n, n, P, P, n, P, P, n, P, P, P], **common},
        {"member_id": "sft/e1/s1", "leaf_request_id": "s1", "role_class": "main/summary",
         "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13], "target_mask": [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1],
         "behavior_logprobs": [n, n, n, P, P, n, P, P, n, P, P], **common},
    ]
    for rec, exp in zip(recs[1:], expected):
        digest = rec.pop("digest")
        assert rec == exp
        assert digest == sha(exp) == member_digest(exp)
    assert set(recs[1]) | {"digest"} == set(export_mod.RECORD_FIELDS)


def test_dummy_record_exact(tmp_path):
    db = build(tmp_path)
    dummy = next(trainer_records(db, "sft", evidence=EV))
    assert dummy == {"member_id": "sft/dum/dummy", "execution_id": "dum", "task_id": "t2", "group_id": "g-dum",
                     "split": "train", "route": "sft", "leaf_request_id": None, "role_class": None, "input_ids": [],
                     "target_mask": [], "behavior_logprobs": [], "loss_weight": 0.0, "execution_target_tokens": 0,
                     "reward": 0.0, "dummy": True, "digest": sha(dummy)}


def test_members_in_byte_order(tmp_path):
    lines = []
    for ex in ("e1", "e1-x", "E2", "é"):
        lines += simple(ex) + [scored(ex)]
    db = project(tmp_path, lines + [route()], EV)
    ids = [r["member_id"] for r in trainer_records(db, "sft", evidence=EV)]
    assert ids == ["sft/E2/r1", "sft/e1-x/r1", "sft/e1/r1", "sft/é/r1"]
    assert ids == sorted(ids, key=lambda s: s.encode("utf-8"))


def test_three_formats_round_trip_and_check_digests(tmp_path):
    db = build(tmp_path)
    recs = list(trainer_records(db, "sft", evidence=EV))
    s1 = write_jsonl(iter(recs), tmp_path / "o.jsonl")
    s2 = write_parquet(iter(recs), tmp_path / "o.parquet", row_group_rows=1)
    s3 = write_tree(db, "sft", tmp_path / "o.tree.jsonl", evidence=EV)
    for f in ("o.jsonl", "o.parquet"):
        assert list(read_records(tmp_path / f)) == recs
    # the tree format is ordered by execution, then member id
    assert sorted(read_records(tmp_path / "o.tree.jsonl"), key=lambda r: r["member_id"].encode()) == recs
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(str(tmp_path / "o.parquet"))
    assert pf.metadata.num_row_groups == 4
    assert pf.schema_arrow.names == list(export_mod.RECORD_FIELDS)
    assert s1.to_json() == s2.to_json() == {
        "records": 4, "dummies": 1, "executions": 2, "processed_tokens": {"path": 30, "tree": 0}, "target_tokens": 10,
        "by_role_class": {"dummy": {"records": 1, "processed_tokens": 0, "target_tokens": 0},
                          "main/summary": {"records": 1, "processed_tokens": 11, "target_tokens": 2},
                          "main/task": {"records": 1, "processed_tokens": 12, "target_tokens": 7},
                          "sub/task": {"records": 1, "processed_tokens": 7, "target_tokens": 1}}}
    # the tree stores A(5) + B(3) + C(2) + D(3) + E(4) = 17 tokens once each
    assert s3.to_json()["processed_tokens"] == {"path": 30, "tree": 17}
    tree_lines = [json.loads(x) for x in (tmp_path / "o.tree.jsonl").read_text().splitlines()]
    e1 = tree_lines[1]
    assert [(n["node_id"], n["parent"], n["draw"], n["tokens"], n["target"]) for n in e1["nodes"]] == [
        (0, None, 0, [1, 2, 3, 4, 5], [0, 0, 0, 1, 1]), (1, 0, 0, [6, 7, 8], [0, 1, 1]),
        (2, 0, 2, [9, 10], [0, 1]), (3, 1, 1, [11, 12, 13], [0, 1, 1]), (4, 1, 0, [14, 15, 16, 17], [0, 1, 1, 1])]
    assert e1["nodes"][4]["weight"] == [0.0, 0.1, 0.1, 0.1]


@pytest.mark.parametrize("fmt", ["jsonl", "tree"])
def test_reader_names_the_tampered_member(tmp_path, fmt):
    db = build(tmp_path)
    out = tmp_path / f"o.{fmt}"
    export(db, "sft", out, fmt, evidence=EV)
    text = out.read_text()
    if fmt == "jsonl":
        text = text.replace('"input_ids":[1,2,3,4,5,6,7,8,11,12,13]', '"input_ids":[1,2,3,4,5,6,7,8,11,12,99]')
        member = "sft/e1/s1"
    else:
        text = text.replace('"tokens":[9,10]', '"tokens":[9,11]')
        member = "sft/e1/r3"
    out.write_text(text)
    with pytest.raises(DigestMismatch, match=member):
        list(read_records(out))


def test_parquet_reader_names_the_tampered_member(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    db = build(tmp_path)
    recs = list(trainer_records(db, "sft", evidence=EV))
    recs[2]["reward"] = 0.75  # content changed, digest kept
    pq.write_table(pa.Table.from_pylist(recs, schema=path_records.arrow_schema()), str(tmp_path / "bad.parquet"))
    with pytest.raises(DigestMismatch, match="sft/e1/r4"):
        list(read_records(tmp_path / "bad.parquet"))


def test_accounting_exact(tmp_path):
    db = build(tmp_path, extra=[{"type": "cost_recorded", "execution_id": "e1", "amount": 3.0, "category": "generation"},
                                {"type": "cost_recorded", "execution_id": "rej", "amount": 1.0, "category": "generation"}])
    acc = accounting(db, "sft")
    assert {k: acc[k] for k in ("records", "dummies", "executions", "stored_tokens", "tree_tokens", "target_tokens",
                                "processed_tokens")} == {
        "records": 4, "dummies": 1, "executions": 2, "stored_tokens": 17, "tree_tokens": 17, "target_tokens": 10,
        # naive per-request expansion: r1 5 + r2 8 + r3 7 + s1 11 + r4 12 = 43
        "processed_tokens": {"path": 30, "tree": 17, "naive": 43}}
    assert acc["by_role_class"] == {
        "main/task": {"records": 1, "stored_tokens": 12, "processed_tokens_path": 12, "processed_tokens_tree": 12,
                      "target_tokens": 7},
        "main/summary": {"records": 1, "stored_tokens": 3, "processed_tokens_path": 11, "processed_tokens_tree": 3,
                         "target_tokens": 2},
        "sub/task": {"records": 1, "stored_tokens": 2, "processed_tokens_path": 7, "processed_tokens_tree": 2,
                     "target_tokens": 1}}
    d = acc["dispositions"]
    assert d["emitted"] == 2
    assert d["assessed_not_selected"] == {"target_suitability: no valid reward by the deadline": 1}
    assert d["ineligible"] == {}
    assert d["pending"] == {"target_suitability: valid reward (assessment)": 1}
    assert d["unknown"] == {}
    assert acc["attempts"] == 4  # every execution exactly once
    assert acc["cost"] == {"cohort": 4.0, "emitted": 2, "per_emitted_artifact": 2.0}
    assert acc["cohorts"] == {"unknown": {"attempts": 4, "emitted": 2, "cost": 4.0, "per_emitted_artifact": 2.0}}


def test_accounting_with_a_cap_stores_only_the_admitted_subtree(tmp_path):
    db = build(tmp_path, extra=[route("one", j_max=1)])
    acc = accounting(db, "one")
    # one path (r4): A(5) + B(3) + E(4) = 12 stored of the tree's 17
    assert (acc["records"], acc["stored_tokens"], acc["tree_tokens"], acc["target_tokens"]) == (2, 12, 17, 7)
    assert acc["processed_tokens"] == {"path": 12, "tree": 12, "naive": 43}
    assert acc["by_role_class"] == {"main/task": {"records": 1, "stored_tokens": 12, "processed_tokens_path": 12,
                                                  "processed_tokens_tree": 12, "target_tokens": 7}}
    recs = list(trainer_records(db, "one", evidence=EV))
    assert [(r["member_id"], r["loss_weight"], r["execution_target_tokens"]) for r in recs] == [
        ("one/dum/dummy", 0.0, 0), ("one/e1/r4", 1 / 7, 7)]


def test_export_is_independent_of_log_position(tmp_path):
    """Same state, different log positions (another interleaving plus a manifest publication):
    same records, same digests."""
    db = build(tmp_path)
    a = [(r["member_id"], r["digest"]) for r in trainer_records(db, "sft", evidence=EV)]
    pub = SIGNER.sign({"type": "manifest_published", "route": "sft", "version": 1, "route_version": 1, "root": "0" * 64,
                       "size": 4, "log_position": 30, "manifest_sha256": "1" * 64, "occurred_at": STAMP})
    lines = ([route("sft", j_max=8)] + simple("pend", "t4") + simple("rej", "t3")
             + [{"type": "execution_finalized", "execution_id": "rej"}] + simple("dum", "t2") + [not_assessable("dum")]
             + tree_execution("e1", "t1") + [scored("e1", 0.5), pub])
    db2 = project(tmp_path, lines, EV, name="other")
    assert [(r["member_id"], r["digest"]) for r in trainer_records(db2, "sft", evidence=EV)] == a


def test_trainer_loss_matches_the_per_execution_normalisation(tmp_path):
    """Σ loss_weight·ℓ over exported targets / executions = mean over executions of the
    per-execution normalised loss; moving a target between paths that share it changes nothing."""
    db = build(tmp_path)
    recs = list(trainer_records(db, "sft", evidence=EV))

    def losses(rec):  # a per-token loss that depends on the tree position only
        return np.array([math.sin(t + 0.1 * i) ** 2 for i, t in enumerate(rec["input_ids"])])

    prs = [PathRecord(losses(r), np.array(r["target_mask"]), r["loss_weight"]) for r in recs]
    n_exec = len({r["execution_id"] for r in recs})
    e1 = [r for r in recs if r["execution_id"] == "e1"]
    targets = {(i, t) for r in e1 for i, (t, m) in enumerate(zip(r["input_ids"], r["target_mask"])) if m}
    expected = sum(math.sin(t + 0.1 * i) ** 2 for i, t in targets) / len(targets) / n_exec
    assert trainer_loss(prs, n_exec) == pytest.approx(expected, rel=1e-12)
    # reassign r4's targets at positions 3,4 (shared prefix) to s1's record
    moved = [PathRecord(p.token_losses, p.target_mask.copy(), p.loss_weight) for p in prs]
    r4, s1 = 2, 3
    moved[r4].target_mask[[3, 4]] = 0
    moved[s1].target_mask[[3, 4]] = 1
    assert trainer_loss(moved, n_exec) == pytest.approx(trainer_loss(prs, n_exec), rel=1e-12)


def test_records_stream_one_execution_at_a_time(tmp_path, monkeypatch):
    db = build(tmp_path)
    calls = []
    real = export_mod.exec_context
    monkeypatch.setattr(export_mod, "exec_context", lambda db, r, ex, ev, rdef: calls.append(ex) or real(db, r, ex, ev, rdef))
    it = trainer_records(db, "sft", evidence=EV)
    next(it)
    assert calls == ["dum"]
    list(it)
    assert calls == ["dum", "e1"]


def test_unresolved_and_rejected_executions_export_nothing(tmp_path):
    db = build(tmp_path, extra=[route("demo", predicates=[{"name": "tests", "family": "outcome"}]),
                                verdict("e1", "tests", "fail", route_name="demo")])
    assert list(trainer_records(db, "demo", evidence=EV)) == []
    assert accounting(db, "demo")["dispositions"]["assessed_not_selected"] == {"tests: fail by v@1": 1}


def test_cost_per_emitted_artifact_per_cohort(tmp_path):
    from tests.test_admission import opened

    lines = []
    for ex, run, ok in (("a1", "run-a", True), ("a2", "run-a", False), ("b1", "run-b", True)):
        lines += [opened(ex, f"t-{ex}", collection_run_id=run), *simple(ex, f"t-{ex}")[1:],
                  {"type": "cost_recorded", "execution_id": ex, "amount": 0.6, "category": "generation"}]
        lines += [scored(ex)] if ok else [{"type": "execution_finalized", "execution_id": ex}]
    db = project(tmp_path, lines + [route()], EV)
    acc = accounting(db, "sft")
    assert acc["cohorts"] == {"run-a": {"attempts": 2, "emitted": 1, "cost": 1.2, "per_emitted_artifact": 1.2},
                              "run-b": {"attempts": 1, "emitted": 1, "cost": 0.6, "per_emitted_artifact": 0.6}}
    assert acc["cost"]["per_emitted_artifact"] == pytest.approx(0.9)
