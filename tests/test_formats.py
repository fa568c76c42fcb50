"""One logical schema per export format and packed records a manifest can check (SPEC 11.5).

Parquet and JSON lines load in Hugging Face ``datasets`` with identical ``Features`` (int64 ids and
masks, float64 log-probs and weights; lineage as a struct); packed Parquet keeps integer targets
with null parents; a semantics-3 packed record carries its members' rewards, digests, leaves and role
classes, the split, the behaviour log-probs in packed order and a role class per node, and
``member_records`` rebuilds exactly the path records whose digests the manifest publishes."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ledger.corpus.export import trainer_records, write_jsonl, write_parquet
from ledger.corpus.formats import schema_for
from ledger.corpus.packed import (
    PACKED_FIELDS,
    PackedDigestMismatch,
    PackedRecordError,
    member_records,
    packed_records,
    read_packed,
    write_packed_jsonl,
    write_packed_parquet,
)
from ledger.corpus.records import DigestMismatch, MemberSetMismatch
from tests.test_admission import not_assessable, project, route, scored, simple, tree_execution
from tests.test_export import EV, P

pytestmark = pytest.mark.usefixtures("earlier_release")  # routes declared under semantics 1 and 3 side by side


def build(tmp_path, semantics: int):
    """tests/test_export.py's store (a branching execution, a dummy, a rejected and a pending one)."""
    lines = (tree_execution("e1", "t1") + [scored("e1", 0.5)] + simple("dum", "t2") + [not_assessable("dum")]
             + [route("sft", j_max=8, use="rl", semantics=semantics)])  # rl: no min_reward under semantics 3
    return project(tmp_path, lines, EV, name=f"s{semantics}")


def _redigest(rec: dict) -> dict:
    from ledger.corpus.export import member_digest

    rec = {k: v for k, v in rec.items() if k != "digest"}
    rec["digest"] = member_digest(rec)
    return rec


def test_semantics3_packed_records_carry_what_rebuilds_the_path_records(tmp_path):
    db = build(tmp_path, 3)
    paths = {r["member_id"]: r for r in trainer_records(db, "sft", evidence=EV)}
    dummy, e1 = packed_records(db, "sft", evidence=EV)
    n = None
    assert e1["route"] == "sft" and e1["split"] == "train" and e1["task_id"] == "t1"
    assert e1["input_ids"] == [1, 2, 3, 4, 5, 6, 7, 8, 14, 15, 16, 17, 11, 12, 13, 9, 10]
    assert e1["behavior_logprobs"] == [n, n, n, P, P, n, P, P, n, P, P, P, n, P, P, n, P]  # packed order
    assert e1["role_class"] == ["main/task", "main/task", "main/task", "main/summary", "sub/task"]  # per node span
    assert [(m["member_id"], m["reward"], m["leaf_request_id"], m["role_class"]) for m in e1["members"]] == [
        ("sft/e1/r4", 0.5, "r4", "main/task"), ("sft/e1/s1", 0.5, "s1", "main/summary"), ("sft/e1/r3", 0.5, "r3", "sub/task")]
    assert all(m["lineage"] == paths[m["member_id"]]["lineage"] for m in e1["members"])
    # the path records rebuilt from the packed record are the path export's, digest for digest
    for rec in (dummy, e1):
        rebuilt = member_records(rec)
        assert rebuilt == [paths[m["member_id"]] for m in rec["members"]]
        assert [m["digest"] for m in rec["members"]] == [r["digest"] for r in rebuilt]
    assert dummy["members"][0]["reward"] == 0.0 and dummy["behavior_logprobs"] == [] == dummy["role_class"]


def test_semantics1_packed_records_keep_the_first_release_fields(tmp_path):
    """Packed records of an earlier route keep exactly SPEC §7.5's fields (their digests do not change)."""
    for rec in packed_records(build(tmp_path, 1), "sft", evidence=EV):
        assert set(rec) == set(PACKED_FIELDS)
        assert all(set(m) == {"member_id", "leaf_node_index"} for m in rec["members"])
        with pytest.raises(PackedRecordError, match="semantics 1-2 route carries no member records"):
            member_records(rec)


def test_packed_parquet_keeps_integer_targets_and_null_parents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    db = build(tmp_path, 3)
    recs = list(packed_records(db, "sft", evidence=EV))
    write_packed_parquet(recs, tmp_path / "p.parquet")
    write_packed_jsonl(recs, tmp_path / "p.jsonl")
    table = pq.read_table(tmp_path / "p.parquet")
    assert table.schema.field("targets").type == pa.list_(pa.struct([
        ("target_index", pa.int64()), ("predecessor_index", pa.int64()), ("weight", pa.float64())]))
    targets = table.column("targets").to_pylist()[1]
    assert targets[0] == {"target_index": 3, "predecessor_index": 2, "weight": 0.1}
    assert all(type(t["target_index"]) is int for t in targets)
    assert list(read_packed(tmp_path / "p.parquet")) == recs == list(read_packed(tmp_path / "p.jsonl"))


def test_a_tampered_packed_record_is_refused_against_its_manifest(tmp_path):
    """A token changed and the packed digest recomputed: the rebuilt member no longer hashes to the
    digest it carries; that digest replaced too: the manifest publishes another one."""
    db = build(tmp_path, 3)
    recs = list(packed_records(db, "sft", evidence=EV))
    manifest = {"route": "sft", "version": 1, "members": [{"member_id": r["member_id"], "digest": r["digest"]}
                                                         for r in trainer_records(db, "sft", evidence=EV)]}
    write_packed_jsonl(recs, tmp_path / "ok.jsonl")
    assert len(list(read_packed(tmp_path / "ok.jsonl", manifest=manifest))) == 2
    bad = json.loads(json.dumps(recs[1]))
    bad["input_ids"][-1] = 99  # r3's last token
    write_packed_jsonl([recs[0], _redigest(bad)], tmp_path / "bad.jsonl")
    assert len(list(read_packed(tmp_path / "bad.jsonl"))) == 2  # no manifest: the members are not rebuilt
    with pytest.raises(PackedDigestMismatch, match="execution e1: member sft/e1/r3's path record: digest"):
        list(read_packed(tmp_path / "bad.jsonl", verify_members=True))
    with pytest.raises(PackedDigestMismatch, match="member sft/e1/r3's path record"):
        list(read_packed(tmp_path / "bad.jsonl", manifest=manifest))
    r3 = next(r for r in member_records(bad) if r["member_id"] == "sft/e1/r3")
    bad["members"][2]["digest"] = _redigest(r3)["digest"]  # self-consistent now
    write_packed_jsonl([recs[0], _redigest(bad)], tmp_path / "bad.jsonl")
    assert len(list(read_packed(tmp_path / "bad.jsonl", verify_members=True))) == 2
    with pytest.raises(DigestMismatch, match="member sft/e1/r3 hashes to .*, manifest sft v1 publishes"):
        list(read_packed(tmp_path / "bad.jsonl", manifest=manifest))
    with pytest.raises(MemberSetMismatch, match=r"1 member\(s\) of manifest sft v1 missing from the records, first sft/e1/r9"):  # and a dropped member
        list(read_packed(tmp_path / "ok.jsonl", manifest={**manifest, "members": manifest["members"] + [
            {"member_id": "sft/e1/r9", "digest": "0" * 64}]}))
    # a semantics-3 record that lost a SPEC 11.5 field is malformed, not silently an older record
    lost = _redigest({k: v for k, v in recs[1].items() if k != "split"})
    write_packed_jsonl([lost], tmp_path / "lost.jsonl")
    with pytest.raises(PackedRecordError, match="has all of them"):
        list(read_packed(tmp_path / "lost.jsonl"))


# ---------------------------------------------------------------------- one logical schema, read by datasets


def _features(path, kind, **kw):
    datasets = pytest.importorskip("datasets")
    builder = "parquet" if path.suffix == ".parquet" else "json"
    ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=str(path.parent / "hf"), **kw)
    return ds.features, ds


@pytest.mark.parametrize("semantics", [1, 3])
def test_parquet_and_jsonl_load_in_datasets_with_identical_features(tmp_path, semantics):
    datasets = pytest.importorskip("datasets")
    from ledger.train.data import features

    db = build(tmp_path, semantics)
    recs = list(trainer_records(db, "sft", evidence=EV))
    write_parquet(recs, tmp_path / "r.parquet")
    write_jsonl(recs, tmp_path / "r.jsonl")
    from_parquet, ds = _features(tmp_path / "r.parquet", "path")
    want = features("path", semantics=semantics)
    assert from_parquet == want
    assert want["input_ids"] == datasets.List(datasets.Value("int64"))
    assert want["behavior_logprobs"] == datasets.List(datasets.Value("float64"))
    from_json, ds_json = _features(tmp_path / "r.jsonl", "path", features=want)
    assert from_json == want and ds_json.to_list() == ds.to_list()
    # inferred (no features given): the same types wherever a column holds a value (JSON cannot type an all-null one)
    inferred, _ = _features(tmp_path / "r.jsonl", "path")
    assert {k: v for k, v in inferred.items() if k != "lineage"} == {k: v for k, v in want.items() if k != "lineage"}
    for name in ("input_ids", "target_mask", "behavior_logprobs", "reward", "loss_weight", "execution_target_tokens"):
        assert inferred[name] == from_parquet[name], name
    if semantics >= 3:
        assert inferred["lineage"]["semantics"] == datasets.Value("int64") == want["lineage"]["semantics"]


def test_packed_parquet_loads_in_datasets_with_its_declared_features(tmp_path):
    pytest.importorskip("datasets")
    from ledger.train.data import features

    recs = list(packed_records(build(tmp_path, 3), "sft", evidence=EV))
    write_packed_parquet(recs, tmp_path / "p.parquet")
    got, ds = _features(tmp_path / "p.parquet", "packed")
    assert got == features("packed", semantics=3)
    assert ds[1]["targets"][0] == {"target_index": 3, "predecessor_index": 2, "weight": 0.1}
    assert schema_for("packed", recs[1]).field("members").type.value_type.get_field_index("digest") >= 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_any_token_or_logprob_edit_of_a_packed_record_is_refused_against_the_manifest(tmp_path, data):
    """Invariant (SPEC 11.5): a semantics-3 packed record whose tokens or behaviour log-probs differ from
    the published members' never reads against the manifest, even with its packed digest recomputed."""
    global _S3
    if _S3 is None:
        db = build(tmp_path, 3)
        _S3 = (list(packed_records(db, "sft", evidence=EV)),
               {"route": "sft", "version": 1, "members": [{"member_id": r["member_id"], "digest": r["digest"]}
                                                          for r in trainer_records(db, "sft", evidence=EV)]})
    recs, manifest = _S3
    bad = json.loads(json.dumps(recs[1]))
    field = data.draw(st.sampled_from(["input_ids", "behavior_logprobs"]))
    i = data.draw(st.integers(0, len(bad[field]) - 1))
    old = bad[field][i]
    new = data.draw(st.integers(0, 2**32 - 1) if field == "input_ids" else
                    st.one_of(st.none(), st.floats(-50.0, 0.0, width=32)).filter(lambda x: x is None or x < 0))
    assume(new != old or type(new) is not type(old))
    bad[field][i] = new
    path = tmp_path / f"t{data.draw(st.integers(0, 10**9))}.jsonl"
    write_packed_jsonl([recs[0], _redigest(bad)], path)
    with pytest.raises(DigestMismatch):
        list(read_packed(path, manifest=manifest))


_S3 = None
