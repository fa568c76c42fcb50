"""Corpus manifests (SPEC §6.6, §7.2): digests, Merkle root, signatures, proofs, diffs,
tamper detection, and (when the store pieces exist) publish / verify --deep end to end."""

from __future__ import annotations

import copy
import hashlib
import json
import math

import pytest

from ledger.corpus.export import RECORD_FIELDS
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms import merkle
from ledger.corpus import manifest as M
from ledger.events.signing import Trust, new_private_key, public_bytes

from .helpers import Signer


# ------------------------------------------------------------------ fixtures
def record(ex: str, leaf: str | None, *, route: str = "sft", ids=None, mask=None, role: str = "main/task",
           split: str = "train", reward: float = 1.0, weight: float | None = None) -> dict:
    """A trainer record in the SPEC §7.3 shape (digest filled in)."""
    dummy = leaf is None
    ids = [] if dummy else (ids if ids is not None else [1, 2, 3, 4])
    mask = [] if dummy else (mask if mask is not None else [0, 0, 1, 1])
    rec = {
        "member_id": f"{route}/{ex}/{leaf if leaf else 'dummy'}", "execution_id": ex, "task_id": f"task-{ex}",
        "group_id": f"task-{ex}", "split": split, "route": route, "leaf_request_id": leaf,
        "role_class": None if dummy else role, "input_ids": ids, "target_mask": mask,
        "behavior_logprobs": [None if m == 0 else -0.25 for m in mask],
        "loss_weight": 0 if dummy else (weight if weight is not None else 1 / max(1, sum(mask))),
        "execution_target_tokens": 0 if dummy else sum(mask), "reward": 0 if dummy else reward, "dummy": dummy,
    }
    rec["digest"] = M.member_digest(rec)
    return rec


def corpus() -> list[dict]:
    return [
        record("e1", "r3", ids=[1, 2, 3, 4, 5, 6], mask=[0, 0, 0, 1, 1, 1]),
        record("e1", "r5", ids=[1, 2, 3, 9, 9], mask=[0, 0, 0, 1, 1], role="sub/task"),
        record("e2", "r1", ids=[7, 8, 9], mask=[0, 1, 1], role="main/summary", reward=0.0),
        record("e3", None),
        record("é4", "r2", ids=[5, 5], mask=[0, 1]),
    ]


def build(records=None, **kw) -> dict:
    args = dict(route="sft", version=1, route_version=1, log_position=42,
                datasheet={"declared_use": "sft", "consumer": "unit-test", "evaluation_claim": M.UNAVAILABLE})
    args.update(kw)
    return M.build_manifest(records if records is not None else corpus(), **args)


@pytest.fixture()
def signer() -> Signer:
    return Signer()


def signed(signer: Signer, records=None, **kw) -> dict:
    return M.sign_manifest(build(records, **kw), signer.key)


def _independent_root(digests: list[bytes]) -> bytes:
    """RFC 9162 MTH written from the RFC text, independent of ledger.algorithms.merkle."""
    if not digests:
        return hashlib.sha256(b"").digest()
    if len(digests) == 1:
        return hashlib.sha256(b"\x00" + digests[0]).digest()
    k = 1
    while k * 2 < len(digests):
        k *= 2
    return hashlib.sha256(b"\x01" + _independent_root(digests[:k]) + _independent_root(digests[k:])).digest()


# ------------------------------------------------------------------ build
def test_member_digest_is_the_spec_formula():
    rec = record("e1", "r1")
    body = {k: v for k, v in rec.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert rec["digest"] == hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_members_in_byte_order_and_root_is_rfc9162_over_digest_bytes():
    doc = build(list(reversed(corpus())))
    ids = [m["member_id"] for m in doc["members"]]
    assert ids == sorted(ids, key=lambda s: s.encode("utf-8"))
    digests = [bytes.fromhex(m["digest"]) for m in doc["members"]]
    assert doc["merkle"] == {**doc["merkle"], "algorithm": "rfc9162-sha256", "size": 5,
                             "root": _independent_root(digests).hex()}


def test_counts_and_mixture():
    doc = build()
    assert doc["counts"] == {"executions": 4, "members": 5, "dummies": 1,
                             # e1's two paths share [1, 2, 3]: 6 + 2 stored; e2: 3; é4: 2
                             "stored_tokens": 13, "processed_tokens": 16, "target_tokens": 8}
    mix = doc["mixture"]["by_role_class"]
    assert mix["main/task"]["stored_tokens"] == 8 and mix["sub/task"]["stored_tokens"] == 2
    assert mix["dummy"] == {**mix["dummy"], "records": 1, "stored_tokens": 0, "target_tokens": 0}
    assert sum(v["stored_tokens"] for v in mix.values()) == doc["counts"]["stored_tokens"]
    assert mix["main/task"]["shares"]["records"] == pytest.approx(2 / 5)
    assert doc["unavailable"] == ["evaluation_claim", "split_policy"]


def test_stored_tokens_attributed_to_the_highest_priority_class():
    paths = [("sub/summary", [1, 2, 3, 4]), ("main/task", [1, 2, 9])]
    assert M.stored_token_attribution(paths) == {"main/task": 3, "sub/summary": 2}
    assert M.stored_token_attribution(paths, priority=("sub/summary", "main/task")) == {"sub/summary": 4, "main/task": 1}


def test_kafka_log_position_is_a_dict_and_the_event_carries_its_sum():
    doc = build(log_position={"ledger.governance:0": 7, "ledger.executions:1": 3, "ledger.executions:0": 5})
    assert list(doc["log_position"]) == sorted(doc["log_position"])
    assert M.event_log_position(doc["log_position"]) == 15
    assert M.event_log_position(42) == 42


def test_a_record_whose_digest_lies_is_refused():
    recs = corpus()
    recs[0]["input_ids"][0] = 99
    with pytest.raises(M.ManifestDigestMismatch):
        build(recs)


# ------------------------------------------------------------------ sign / verify
def test_signed_manifest_verifies(signer):
    doc = signed(signer)
    assert doc["signature"]["algorithm"] == "ed25519"
    assert M.verify_manifest(doc, signer.trust) == []
    # the signature covers the canonical JSON of the document minus `signature`
    assert M.signing_body(doc) == json.dumps({k: v for k, v in doc.items() if k != "signature"}, sort_keys=True,
                                             separators=(",", ":"), ensure_ascii=False).encode()


def test_untrusted_or_unauthorised_key_fails(signer):
    doc = signed(signer)
    assert any("not in the trust file" in p for p in M.verify_manifest(doc, Trust()))
    other = Signer(may_sign=("withdrawal",))
    doc2 = M.sign_manifest(build(), other.key)
    assert any("not allowed to sign manifest_published" in p for p in M.verify_manifest(doc2, other.trust))


def _tampered(doc: dict, how: str) -> dict:
    bad = copy.deepcopy(doc)
    if how == "count":
        bad["counts"]["target_tokens"] += 1
    elif how == "root":
        bad["merkle"]["root"] = "00" * 32
    elif how == "signature":
        value = bytearray(__import__("base64").b64decode(bad["signature"]["value"]))
        value[0] ^= 1
        bad["signature"]["value"] = __import__("base64").b64encode(bytes(value)).decode()
    elif how == "member digest":
        bad["members"][1]["digest"] = hashlib.sha256(b"swapped").hexdigest()
    elif how == "member dropped":
        del bad["members"][2]
    elif how == "member order":
        bad["members"][0], bad["members"][1] = bad["members"][1], bad["members"][0]
    elif how == "size":
        bad["merkle"]["size"] += 1
    elif how == "route":
        bad["route"] = "rl"
    return bad


@pytest.mark.parametrize("how, symptom", [
    ("count", "counts.target_tokens is 9 but the members give 8"),
    ("root", "does not match the root recomputed"),
    ("signature", "does not verify"),
    ("member digest", "does not match the root recomputed"),
    ("member dropped", "merkle.size is 5 but the manifest lists 4 members"),
    ("member order", "out of byte order"),
    ("size", "merkle.size is 6"),
    ("route", "does not verify"),
])
def test_every_tamper_fails_with_a_clear_reason(signer, how, symptom):
    doc = signed(signer)
    problems = M.verify_manifest(_tampered(doc, how), signer.trust)
    assert problems, how
    assert any(symptom in p for p in problems), problems
    # every change to the signed document also breaks the signature
    assert any("signature" in p for p in problems)


def test_resigned_forgery_with_changed_token_passes_shallow_checks_only(signer):
    """A trusted-but-wrong publisher (or a broken pipeline holding the key) that changes one
    token or one weight and re-signs produces a manifest that verifies on its own; only the
    records (trainer reads) or --deep replay (integration tests below) expose it."""
    recs = corpus()
    forged = copy.deepcopy(recs)
    forged[0]["input_ids"][1] = 777
    forged[1]["loss_weight"] = 0.9
    for r in forged:
        r["digest"] = M.member_digest(r)
    doc = signed(signer, forged)
    assert M.verify_manifest(doc, signer.trust) == []
    with pytest.raises(M.ManifestDigestMismatch, match="hashes to"):
        list(M.iter_verified_records(doc, recs))


def test_trainer_reader_checks_each_digest(signer):
    doc = signed(signer)
    recs = corpus()
    assert len(list(M.iter_verified_records(doc, recs))) == 5
    bad = copy.deepcopy(recs)
    bad[2]["target_mask"][0] = 1
    with pytest.raises(M.ManifestDigestMismatch, match="sft/e2/r1"):
        list(M.iter_verified_records(doc, bad))
    with pytest.raises(M.ManifestDigestMismatch, match="missing"):
        list(M.iter_verified_records(doc, recs[:-1]))
    with pytest.raises(M.ManifestDigestMismatch, match="not a member"):
        list(M.iter_verified_records(doc, [record("zz", "r1")]))


# ------------------------------------------------------------------ proofs
def _records(n: int) -> list[dict]:
    return [record(f"e{i:03d}", "r1", ids=[i, i + 1], mask=[0, 1]) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 17])
def test_every_member_has_a_verifying_inclusion_proof(signer, n):
    doc = signed(signer, _records(n))
    for m in doc["members"]:
        proof = M.inclusion_proof(doc, m["member_id"])
        assert set(proof) >= {"leaf_index", "tree_size", "root", "leaf_hash", "proof"}
        assert proof["root"] == doc["merkle"]["root"] and proof["tree_size"] == n
        merkle.verify_inclusion(bytes.fromhex(proof["leaf_hash"]), proof["leaf_index"], proof["tree_size"],
                                [bytes.fromhex(h) for h in proof["proof"]], bytes.fromhex(proof["root"]))
        M.verify_proof(proof, root=doc["merkle"]["root"], digest=m["digest"])


def test_a_bent_proof_or_a_non_member_is_rejected(signer):
    doc = signed(signer, _records(6))
    proof = M.inclusion_proof(doc, "sft/e003/r1")
    bent = {**proof, "proof": [("ff" + h[2:]) if i == 0 else h for i, h in enumerate(proof["proof"])]}
    with pytest.raises(merkle.ProofError):
        M.verify_proof(bent)
    with pytest.raises(merkle.ProofError):
        M.verify_proof(proof, digest=doc["members"][0]["digest"])
    with pytest.raises(M.ManifestError, match="not a member"):
        M.inclusion_proof(doc, "sft/nope/r1")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=6), min_size=1, max_size=40, unique=True), st.data())
def test_proofs_verify_for_any_member_set(leaves, data):
    recs = [record(leaf.hex(), "r", ids=list(leaf), mask=[1] * len(leaf)) for leaf in leaves]
    doc = build(recs)
    member = data.draw(st.sampled_from(doc["members"]))
    proof = M.inclusion_proof(doc, member["member_id"])
    M.verify_proof(proof, root=doc["merkle"]["root"], digest=member["digest"])
    assert doc["merkle"]["root"] == _independent_root([bytes.fromhex(m["digest"]) for m in doc["members"]]).hex()


# ------------------------------------------------------------------ diff
def test_diff_reasons_from_documents_and_from_explain(signer):
    a = signed(signer)
    recs = corpus()
    recs = [r for r in recs if r["execution_id"] != "e2"]  # e2 leaves
    recs[0] = record("e1", "r3", ids=[1, 2, 3, 4, 5, 6], mask=[0, 0, 0, 1, 1, 1], reward=0.5)  # reward changed
    recs = [r for r in recs if r["execution_id"] != "é4"] + [record("é4", "r2", ids=[5, 5], mask=[0, 1], split="dev")]
    recs.append(record("e9", "r1"))
    b = signed(signer, recs, version=2)
    d = M.diff_manifests(a, b)
    removed = {x["member_id"]: x["reasons"] for x in d["removed"]}
    added = {x["member_id"]: x["reasons"] for x in d["added"]}
    assert removed == {"sft/e2/r1": ["no longer admitted"]}
    assert added == {"sft/e9/r1": ["newly admitted"]}
    changed = {x["member_id"]: x for x in d["changed"]}
    assert changed["sft/e1/r3"]["reasons"] == ["reward changed"]
    assert changed["sft/é4/r2"]["changed_fields"] == ["split"]
    assert d["summary"]["removed"] == 1 and d["summary"]["added"] == 1 and d["summary"]["changed"] == 2
    d2 = M.diff_manifests(a, b, explain=lambda side, e: ["withdrawn"] if side == "removed" else [])
    assert d2["removed"][0]["reasons"] == ["withdrawn"]
    assert d2["summary"]["by_reason"] == {"newly admitted": 1, "withdrawn": 1}


def test_diff_split_moved_for_removed_and_added_members(signer):
    a = signed(signer, [record("e1", "r1", split="train")])
    b = signed(signer, [record("e1", "r2", split="dev")], version=2)
    d = M.diff_manifests(a, b)
    assert d["removed"][0]["reasons"] == ["split moved"] and d["added"][0]["reasons"] == ["split moved"]


def test_key_id_binds_the_public_key():
    key = new_private_key()
    doc = M.sign_manifest(build(), key)
    assert doc["signature"]["key_id"] == hashlib.sha256(public_bytes(key)).digest()[:8].hex()


# ====================================================================== integration
# A real store: events -> projections -> trainer records -> manifest -> log, and back.
import base64  # noqa: E402

from ledger.corpus import publish as P  # noqa: E402
from ledger.log import open_log  # noqa: E402
from ledger.log.paths import store_paths  # noqa: E402
from ledger.producers.ingest import Ingestor  # noqa: E402

from .helpers import closed, request  # noqa: E402
from .helpers import opened as _opened  # noqa: E402

STAMP = "2098-06-01T00:00:00Z"
DEADLINE = "2099-01-01T00:00:00Z"


def _factory():
    """Every projection the manifest path needs, upstream first (independent of the registry's state)."""
    from ledger.projections.admission import AdmissionProjection, Evidence
    from ledger.projections.assessment import AssessmentProjection
    from ledger.projections.governance import GovernanceProjection, permitted, withdrawn
    from ledger.projections.manifests import ManifestsProjection
    from ledger.projections.tree import TreeProjection

    out = [TreeProjection(), AssessmentProjection(), GovernanceProjection()]
    try:
        from ledger.projections import splits as splits_mod

        splits_proj = [getattr(splits_mod, n)() for n in dir(splits_mod)
                       if n.endswith("Projection") and n != "Projection" and isinstance(getattr(splits_mod, n), type)]
        out += splits_proj
        evidence = Evidence.discover()
    except ImportError:
        evidence = Evidence(split=lambda db, ex: ("train", None, False), permitted=permitted, withdrawn=withdrawn)
    out += [AdmissionProjection(evidence), ManifestsProjection()]
    return out


def _execution(ex: str, task: str, *, dummy: bool = False, reward: float = 1.0) -> list[dict]:
    lines = [_opened(ex, task, deadline=DEADLINE, collection_run_id="run-7", origin="synthetic"),
             request(ex, "r1", [1, 2, 3], [4, 5]),
             request(ex, "r2", [1, 2, 3, 4, 5, 6], [7, 8]),
             request(ex, "r3", [1, 2, 3, 4, 5, 9], [10], agent_id="helper", agent_tier="sub"),
             request(ex, "s1", [1, 2, 3, 4, 5, 6, 7, 8, 11], [12, 13], turn_kind="summary"),
             closed(ex)]
    if dummy:
        lines.append({"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
                      "outcome": "not_assessable", "evaluator": "grader@1"})
    else:
        lines.append({"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
                      "outcome": "scored", "reward": reward, "evaluator": "grader@1"})
    return lines


class Store:
    """A store directory with a trusted key file, fed through the one ingest path."""

    def __init__(self, root, signer: Signer):
        self.root, self.signer = root, signer
        self.paths = store_paths(str(root / "store"))
        log = open_log(self.paths.url, create=True)
        log.close()
        signer.trust.save(self.paths.trust)
        from ledger.events.signing import write_private_key

        self.key = root / "publisher.pem"
        write_private_key(signer.key, self.key)

    def ingest(self, lines: list[dict]) -> None:
        signed_types = {"admission_policy", "permission", "withdrawal", "split_policy"}
        lines = [self.signer.sign({**l, "occurred_at": l.get("occurred_at", STAMP)}) if l["type"] in signed_types else l
                 for l in lines]
        with open_log(self.paths.url) as log:
            rep = Ingestor(log, self.signer.trust).ingest_lines(enumerate(lines, 1))
        assert not rep.conflicts

    def publish(self, out, **kw):
        return P.publish(self.paths, "sft", key=self.key, out=out, projections_factory=_factory, **kw)

    def verify(self, path, deep=False):
        return P.verify_file(path, self.paths, deep=deep, projections_factory=_factory)


def _base_lines() -> list[dict]:
    lines = [{"type": "task_registered", "task_id": f"t{i}", "source": "vendor-a" if i < 3 else "vendor-b"} for i in range(1, 5)]
    lines.append({"type": "split_policy", "policy_id": "p1", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
                  "salt": "s"})
    # an rl route (named "sft" for history): rl keeps zero-reward dummies, sft routes admit passing outcomes only
    lines.append({"type": "permission", "subject": "*", "use": "rl", "action": "grant", "authority": "legal"})
    lines.append({"type": "admission_policy", "route": "sft", "version": 1, "use": "rl", "split": "train", "j_max": 2,
                  "consumer": "policy-team", "evaluation_claim": "repair success on held-out groups"})
    for i, ex in enumerate(["e1", "e2", "e3"], 1):
        lines += _execution(ex, f"t{i}")
    lines += _execution("d1", "t4", dummy=True)
    return lines


@pytest.fixture()
def store(tmp_path):
    s = Store(tmp_path, Signer())
    s.ingest(_base_lines())
    return s


def test_publish_writes_signed_manifest_croissant_archive_and_event(store, tmp_path):
    pub = store.publish(tmp_path / "m1.json")
    doc = json.loads((tmp_path / "m1.json").read_text())
    assert pub.version == doc["version"] == 1 and doc["route"] == "sft" and doc["route_version"] == 1
    assert doc["counts"]["executions"] == 4 and doc["counts"]["dummies"] == 1
    assert doc["counts"]["members"] == 3 * 2 + 1  # j_max = 2 paths per execution plus the dummy
    assert doc["merkle"]["size"] == len(doc["members"])
    assert doc["log_position"] == pub.log_position and isinstance(doc["log_position"], int)
    assert doc["declared_use"] == "rl" and doc["consumer"] == "policy-team" and doc["semantics"] == 3
    assert doc["evaluation_claim"] == "repair success on held-out groups"
    assert {p["task_source"] for p in doc["source_pools"]} == {"vendor-a", "vendor-b"}
    assert all(p["collection_run_id"] == "run-7" for p in doc["source_pools"])
    mix = doc["mixture"]["by_role_class"]
    assert sum(v["stored_tokens"] for v in mix.values()) == doc["counts"]["stored_tokens"]
    assert sum(v["target_tokens"] for v in mix.values()) == doc["counts"]["target_tokens"]
    assert doc["counts"]["stored_tokens"] == doc["accounting"]["stored_tokens"]  # one meaning of stored tokens
    assert M.verify_manifest(doc, store.signer.trust) == []
    # members are exactly the exported trainer records
    from ledger.corpus.export import trainer_records
    from ledger.projections.engine import connect

    db = connect(store.paths.db)
    recs = list(trainer_records(db, "sft"))
    assert [m["digest"] for m in doc["members"]] == [r["digest"] for r in recs]
    assert len(list(M.iter_verified_records(doc, recs))) == len(recs)
    # the trainer's path (docs/manifests.md): export, read back with digest checks, check against the manifest
    from ledger.corpus.export import read_records, write_jsonl, write_parquet

    write_jsonl(trainer_records(db, "sft"), tmp_path / "recs.jsonl")
    write_parquet(trainer_records(db, "sft"), tmp_path / "recs.parquet")
    for f in ("recs.jsonl", "recs.parquet"):
        assert len(list(M.iter_verified_records(doc, read_records(tmp_path / f)))) == len(recs)
    # the publication is on the log and in the manifests projection; the archive copy is authenticated
    row = db.execute("SELECT route, version, root, size, log_position, manifest_sha256 FROM manifests").fetchall()
    assert row == [("sft", 1, doc["merkle"]["root"], doc["merkle"]["size"], doc["log_position"], M.document_sha256(doc))]
    assert P.archived_manifest(store.paths, db, "sft", 1) == doc
    cro = json.loads((tmp_path / "m1.croissant.json").read_text())
    assert cro["@type"] == "sc:Dataset" and cro["conformsTo"] == "http://mlcommons.org/croissant/1.0"
    assert cro["distribution"][0]["sha256"] == hashlib.sha256((tmp_path / "m1.json").read_bytes()).hexdigest()
    # nothing but the signature's public part leaves the key file
    assert "PRIVATE" not in (tmp_path / "m1.json").read_text()


def test_croissant_is_standard_and_dated_by_its_publication_event(store, tmp_path, caplog):
    """The Croissant file loads in mlcroissant with no error or warning (standard 1.0 @context,
    datePublished); datePublished is the ManifestPublished event's occurred_at, and the file is a
    pure function of the manifest and that event (same publication -> same bytes)."""
    import logging

    import mlcroissant as mlc

    from ledger.events.catalog import key_of
    from ledger.events.codec import default_codec
    from ledger.events.validate import format_micros

    pub = store.publish(tmp_path / "m1.json")
    text = (tmp_path / "m1.croissant.json").read_text()
    cro = json.loads(text)
    with open_log(store.paths.url) as log:
        ev = default_codec().decode(log.lookup(key_of("manifest_published", route="sft", version=1)).value)
    assert cro["datePublished"] == format_micros(ev["occurred_at"])
    assert ev["event_id"] == pub.event_id
    manifest_text = (tmp_path / "m1.json").read_text()
    again = P.croissant(json.loads(manifest_text), "m1.json", hashlib.sha256(manifest_text.encode()).hexdigest(),
                        cro["datePublished"])
    assert P._dump(again) == text
    assert cro["@context"] == P.CROISSANT_CONTEXT
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ds = mlc.Dataset(jsonld=str(tmp_path / "m1.croissant.json"))
    issues = ds.metadata.ctx.issues
    assert (sorted(issues.errors), sorted(issues.warnings)) == ([], [])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert ds.metadata.date_published.isoformat().replace("+00:00", "Z") == cro["datePublished"]
    assert [f.name for f in ds.metadata.record_sets[0].fields][:2] == ["member_id", "digest"]
    # SPEC 11.5: the records themselves, declared in the `records` record set, load from the route's JSON-lines
    # Parquet export put beside the manifest (m1.records.parquet), with the types of the logical schema
    from ledger.corpus.export import trainer_records, write_parquet
    from ledger.projections.engine import connect

    recs = list(trainer_records(connect(store.paths.db), "sft"))
    write_parquet(recs, tmp_path / P.records_file("m1.json"))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ds = mlc.Dataset(jsonld=str(tmp_path / "m1.croissant.json"))
        loaded = list(ds.records("records"))
    assert (sorted(ds.metadata.ctx.issues.errors), sorted(ds.metadata.ctx.issues.warnings)) == ([], [])
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    names = [f.name for f in ds.metadata.record_sets[1].fields]
    assert names == [n for n in RECORD_FIELDS]  # every §7.3 column (the lineage struct stays in the export)
    assert len(loaded) == len(recs) == 7
    for got, rec in zip(loaded, recs):
        assert got["records/member_id"].decode() == rec["member_id"] and got["records/digest"].decode() == rec["digest"]
        assert list(got["records/input_ids"]) == rec["input_ids"] and list(got["records/target_mask"]) == rec["target_mask"]
        assert [None if math.isnan(x) else x for x in got["records/behavior_logprobs"]] == rec["behavior_logprobs"]
        assert (got["records/loss_weight"], got["records/dummy"]) == (rec["loss_weight"], rec["dummy"])
    # the manifest itself is unchanged by the Croissant file: it still verifies, deep
    rep = store.verify(tmp_path / "m1.json", deep=True)
    assert rep.ok, rep.problems


def test_deep_verify_passes_and_export_digests_are_stable(store, tmp_path):
    store.publish(tmp_path / "m1.json")
    rep = store.verify(tmp_path / "m1.json", deep=True)
    assert rep.ok, rep.problems
    # later events do not disturb the deep check: it replays only up to log_position
    store.ingest(_execution("e9", "t1"))
    rep = store.verify(tmp_path / "m1.json", deep=True)
    assert rep.ok, rep.problems


def _resign(doc: dict, signer: Signer) -> dict:
    return M.sign_manifest(doc, signer.key)


def _write(path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def test_tampered_token_or_weight_resigned_fails_only_deep(store, tmp_path):
    """A forger holding the key changes one token (or one weight) in a record, recomputes that
    member's digest, the root and re-signs: the document is self-consistent; --deep rebuilds
    the records from the log and names the member."""
    from ledger.corpus.export import trainer_records
    from ledger.projections.engine import connect

    store.publish(tmp_path / "m1.json")
    doc = json.loads((tmp_path / "m1.json").read_text())
    recs = list(trainer_records(connect(store.paths.db), "sft"))
    for what in ("token", "weight"):
        forged_recs = copy.deepcopy(recs)
        victim = next(r for r in forged_recs if not r["dummy"])
        if what == "token":
            victim["input_ids"][0] += 1
        else:
            victim["loss_weight"] = victim["loss_weight"] * 2
        victim["digest"] = M.member_digest(victim)
        forged = M.build_manifest(forged_recs, route="sft", version=1, route_version=1, log_position=doc["log_position"],
                                  check_digests=True)
        bad = copy.deepcopy(doc)
        bad["members"], bad["merkle"] = forged["members"], forged["merkle"]
        bad = _resign(bad, store.signer)
        path = _write(tmp_path / f"forged-{what}.json", bad)
        assert store.verify(path).ok  # shallow: consistent and signed by a trusted key
        deep = store.verify(path, deep=True)
        assert not deep.ok
        assert any(victim["member_id"] in p and "not the digest of the record rebuilt from the log" in p
                   for p in deep.problems), deep.problems
        assert any("merkle.root" in p for p in deep.problems)
        assert any("manifest_sha256" in p for p in deep.problems)  # and it is not what the log recorded


@pytest.mark.parametrize("how, symptom", [
    ("count", "counts.target_tokens"),
    ("root", "merkle.root"),
    ("signature", "does not verify"),
])
def test_tampered_count_root_signature_fail_verify(store, tmp_path, how, symptom):
    store.publish(tmp_path / "m1.json")
    doc = json.loads((tmp_path / "m1.json").read_text())
    path = _write(tmp_path / "bad.json", _tampered(doc, how))
    rep = store.verify(path)
    assert not rep.ok and any(symptom in p for p in rep.problems), rep.problems
    deep = store.verify(path, deep=True)
    assert not deep.ok and any(symptom in p for p in deep.problems)


def test_manifest_not_on_the_log_fails_deep(store, tmp_path):
    store.publish(tmp_path / "m1.json")
    doc = json.loads((tmp_path / "m1.json").read_text())
    doc["version"] = 7
    path = _write(tmp_path / "v7.json", _resign(doc, store.signer))
    assert store.verify(path).ok
    deep = store.verify(path, deep=True)
    assert any("no ManifestPublished for sft v7" in p for p in deep.problems)


def test_versions_count_publications_and_diff_explains_withdrawal_and_revocation(store, tmp_path):
    store.publish(tmp_path / "m1.json")
    store.ingest([
        {"type": "withdrawal", "subject": "execution:e2", "reason": "provider request", "authority": "legal"},
        {"type": "permission", "subject": "execution:e3", "use": "rl", "action": "revoke", "authority": "legal"},
    ])
    pub2 = store.publish(tmp_path / "m2.json")
    assert pub2.version == 2
    d = P.diff_files(tmp_path / "m1.json", tmp_path / "m2.json", store.paths)
    reasons = {x["execution_id"]: x["reasons"] for x in d["removed"]}
    assert reasons["e2"] == ["withdrawn"] and reasons["e3"] == ["permission revoked"]
    assert d["added"] == [] and d["changed"] == []
    assert d["verification"] == {"a": [], "b": []}
    assert store.verify(tmp_path / "m1.json", deep=True).ok  # v1 still re-derives at its own position
    assert store.verify(tmp_path / "m2.json", deep=True).ok
    # the governance impact report finds v1's members of e2 through the authenticated archive
    from ledger.corpus.withdraw import impact_report

    rep = impact_report(store.paths, "execution:e2") if _registry_complete() else None
    if rep is not None:
        assert [(m["route"], m["version"]) for m in rep["manifests"]] == [("sft", 1)]


def _registry_complete() -> bool:
    from ledger.projections.registry import all_projections

    return {"admission", "manifests"} <= {p.name for p in all_projections()}


def test_prove_member_from_a_published_file(store, tmp_path):
    store.publish(tmp_path / "m1.json")
    doc = json.loads((tmp_path / "m1.json").read_text())
    for m in doc["members"]:
        proof = P.prove_file(tmp_path / "m1.json", m["member_id"])
        merkle.verify_inclusion(bytes.fromhex(proof["leaf_hash"]), proof["leaf_index"], proof["tree_size"],
                                [bytes.fromhex(h) for h in proof["proof"]], bytes.fromhex(doc["merkle"]["root"]))
    with pytest.raises(M.ManifestError):
        P.prove_file(tmp_path / "m1.json", "sft/none/r1")


def test_publication_refused_for_a_key_not_allowed_manifest_published(tmp_path):
    s = Store(tmp_path, Signer(may_sign=("admission_policy", "permission", "split_policy", "withdrawal")))
    s.ingest(_base_lines())
    from ledger.events.signing import SignatureError

    with pytest.raises(SignatureError, match="not allowed to sign manifest_published"):
        s.publish(tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()


def test_cli_manifest_commands(store, tmp_path, monkeypatch, capsys):
    from ledger.cli import main

    monkeypatch.setattr(P, "projections", _factory)
    base = ["--store", store.paths.url]
    assert main(base + ["manifest", "publish", "sft", "--key", str(store.key), "--out", str(tmp_path / "c1.json"),
                        "--consumer", "cli-test"]) == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "c1.json").read_text())
    assert doc["consumer"] == "cli-test"
    assert main(base + ["manifest", "verify", str(tmp_path / "c1.json"), "--deep"]) == 0
    bad = _write(tmp_path / "bad.json", _tampered(doc, "count"))
    assert main(base + ["manifest", "verify", bad]) == 1
    assert "counts.target_tokens" in capsys.readouterr().out
    member = doc["members"][2]["member_id"]
    assert main(base + ["manifest", "prove", str(tmp_path / "c1.json"), member]) == 0
    proof = json.loads(capsys.readouterr().out)
    assert set(proof) >= {"leaf_index", "tree_size", "root", "leaf_hash", "proof"}
    assert main(base + ["manifest", "prove", str(tmp_path / "c1.json"), "sft/nope/r1"]) == 1
    assert main(base + ["manifest", "verify", str(tmp_path / "missing.json")]) == 2
    assert main(base + ["manifest", "diff", str(tmp_path / "c1.json"), str(tmp_path / "c1.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 0)[0])["summary"]["removed"] == 0
    assert main(base + ["manifest", "publish", "nope", "--key", str(store.key), "--out", str(tmp_path / "x.json")]) == 2


def test_stored_tokens_from_whole_trees_fill_the_not_selected_row():
    trees = {"e1": 20, "e2": 3, "e3": 9, "é4": 2}
    counts, per_class = M.record_counts(corpus(), stored_tokens_of=trees.get)
    assert counts["stored_tokens"] == 20 + 3 + 2  # e3 is a dummy: its record holds no tokens
    assert per_class["dummy"]["stored_tokens"] == 0
    assert per_class[M.NOT_SELECTED]["stored_tokens"] == 20 - 8  # e1's tree beyond its two member paths
    doc = build(stored_tokens_of=trees.get)
    assert doc["counts"]["stored_tokens"] == 25 and M.verify_manifest(M.sign_manifest(doc, new_private_key()), None) == []


def test_publish_and_deep_verify_on_kafka(kafka_url, tmp_path, monkeypatch):
    """On Kafka the manifest's log_position is a dict of partition offsets; --deep replays to it."""
    monkeypatch.chdir(tmp_path)  # a Kafka store keeps its trust file and projection DB in the working directory
    signer = Signer()
    paths = store_paths(kafka_url)
    open_log(paths.url, create=True).close()
    signer.trust.save(paths.trust)
    from ledger.events.signing import write_private_key

    write_private_key(signer.key, tmp_path / "k.pem")
    store = Store.__new__(Store)
    store.root, store.signer, store.paths, store.key = tmp_path, signer, paths, tmp_path / "k.pem"
    store.ingest(_base_lines())
    pub = store.publish(tmp_path / "m.json")
    doc = json.loads((tmp_path / "m.json").read_text())
    assert isinstance(doc["log_position"], dict) and pub.log_position == doc["log_position"]
    assert all(":" in k for k in doc["log_position"]) and sum(doc["log_position"].values()) > 0
    assert doc["counts"]["members"] == 7
    store.ingest(_execution("e9", "t1"))
    rep = store.verify(tmp_path / "m.json", deep=True)
    assert rep.ok, rep.problems
    forged = copy.deepcopy(doc)
    forged["members"] = forged["members"][1:]
    forged["counts"]["members"] -= 1
    forged["counts"]["dummies"] -= 1
    forged["counts"]["executions"] -= 1
    forged["merkle"]["size"] -= 1
    forged["merkle"]["root"] = M.merkle_root_hex([m["digest"] for m in forged["members"]])
    bad = store.verify(_write(tmp_path / "f.json", _resign(forged, signer)), deep=True)
    assert any("missing from the manifest" in p for p in bad.problems), bad.problems
