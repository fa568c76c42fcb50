"""Crypto-shredding (SPEC §6.4 ``erase``): sealed token payloads under per-subject data keys.

Covers the key store, seal/unseal (deterministic, bound to its request), the schema
evolution (RequestRecorded v1 events decode under v2), sealed ingestion, and erase end to
end: `ledger withdraw --erase` destroys the keys, the log's digests, Merkle roots and audit
are unchanged, a full rebuild is deterministic, and no readable token remains anywhere in
the store.
"""

from __future__ import annotations

import json
import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms.tokens import pack_tokens, unpack_tokens
from ledger.cli import main as cli
from ledger.corpus.integrity import audit, tree_for
from ledger.events.codec import default_codec, event_digest
from ledger.events.signing import Trust
from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.log.paths import store_paths
from ledger.log.sealing import (
    KeyDestroyed,
    KeyStore,
    SealError,
    SubjectResolver,
    seal_request,
    unseal,
)
from ledger.producers.ingest import IngestError, Ingestor, ingest_sealed
from ledger.projections.engine import canonical_dump, connect
from ledger.projections.governance import erased, permitted, withdrawn

from .helpers import closed, numbered, opened, request

MARKER = [3141592653, 2718281828, 1618033988, 1414213562]  # distinctive tokens to hunt for in the store's bytes


def _req(ex="e1", rid="r1", inp=(1, 2, 3), out=(4, 5), **kw) -> dict:
    return validate_line(request(ex, rid, list(inp), list(out), **kw), line=1, now_micros=1_700_000_000_000_000)


# ============================================================================ key store
def test_keystore_creates_keeps_and_destroys_keys(tmp_path):
    path = tmp_path / "data-keys.db"
    ks = KeyStore(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    k1 = ks.key_for("execution:e1")
    assert ks.key_for("execution:e1") == k1 and len(k1.key) == 32
    assert ks.key_for("execution:e2").key_id != k1.key_id
    assert ks.key_by_id(k1.key_id) == k1.key and ks.subject_of(k1.key_id) == "execution:e1"
    assert "key=" not in repr(k1) and k1.key.hex() not in repr(k1)
    assert ks.destroy("execution:e1", "erased") == k1.key_id
    assert ks.destroy("execution:e1") is None  # idempotent
    assert ks.key_by_id(k1.key_id) is None and ks.destroyed("execution:e1")
    with pytest.raises(KeyDestroyed):
        ks.key_for("execution:e1")  # never silently re-keyed
    ks.close()
    # the destroyed key's bytes are gone from the file (secure_delete + VACUUM, no WAL)
    assert k1.key not in path.read_bytes()
    assert KeyStore(path).key_for("execution:e2").key_id  # reopens fine


def test_keystore_creates_a_batch_of_keys_in_one_commit(tmp_path):
    """Issue 29: a batch's new subjects get their keys in one (synced) transaction; existing keys
    are kept and destroyed subjects stay destroyed."""
    ks = KeyStore(tmp_path / "data-keys.db")
    old = ks.key_for("execution:old")
    ks.key_for("execution:gone")
    ks.destroy("execution:gone")
    commits = []
    ks.db.set_trace_callback(lambda sql: commits.append(sql) if sql.startswith("COMMIT") else None)
    ks.create_keys(["execution:a", "execution:old", "execution:gone", "execution:b", "execution:a"])
    ks.create_keys(["execution:a", "execution:b"])  # nothing missing: no transaction at all
    assert len(commits) == 1
    assert ks.subjects() == ["execution:a", "execution:b", "execution:old"]
    assert ks.key_for("execution:old") == old and ks.key_for("execution:a").key_id != ks.key_for("execution:b").key_id
    with pytest.raises(KeyDestroyed):
        ks.key_for("execution:gone")
    ks.close()


# ============================================================================ seal / unseal
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40), st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40))
def test_seal_unseal_round_trip_is_exact(tmp_path_factory, inp, out):
    ks = KeyStore(tmp_path_factory.mktemp("k") / "keys.db")
    ev = _req(inp=inp, out=out)
    sealed = seal_request(ev, ks, "execution:e1")
    assert sealed["output_ids"] == b"" and sealed["input_ids"] == b"" and sealed["output_logprobs"] is None
    assert pack_tokens(out) not in sealed["sealed"]["ciphertext"] or not out
    back = unseal(sealed, ks)
    assert back == {**ev, "sealed": None}
    # through the codec too: the log carries the ciphertext and the digest is stable
    codec = default_codec()
    data = codec.encode(sealed)
    assert unseal(codec.decode(data), ks) == {**ev, "sealed": None}
    assert event_digest(codec.encode(codec.decode(data))) == event_digest(data)


def test_sealing_is_deterministic_and_bound_to_its_request(tmp_path):
    ks = KeyStore(tmp_path / "keys.db")
    a = seal_request(_req(rid="r1"), ks, "execution:e1")
    assert seal_request(_req(rid="r1"), ks, "execution:e1") == a  # retries stay idempotent
    other = seal_request(_req(rid="r2"), ks, "execution:e1")
    assert other["sealed"]["nonce"] != a["sealed"]["nonce"]
    moved = dict(other, sealed=a["sealed"])  # ciphertext of r1 pasted onto r2
    with pytest.raises(SealError, match="does not open"):
        unseal(moved, ks)
    with pytest.raises(SealError, match="already sealed"):
        seal_request(a, ks, "execution:e1")
    with pytest.raises(SealError, match="only request events"):
        seal_request(validate_line(opened("e1"), line=1, now_micros=0), ks, "execution:e1")
    plain = _req(rid="r3")
    assert unseal(plain, ks) is plain  # never sealed: unchanged
    ks.destroy("execution:e1")
    assert unseal(a, ks) is None  # erased
    with pytest.raises(KeyDestroyed):
        seal_request(_req(rid="r4"), ks, "execution:e1")


def test_prefix_reference_stays_in_the_clear_and_suffix_is_sealed(tmp_path):
    from ledger.algorithms.tokens import tokens_sha256

    ks = KeyStore(tmp_path / "keys.db")
    ev = validate_line({"type": "request", "execution_id": "e1", "request_id": "r2",
                        "input_prefix": {"request_id": "r1", "length": 2, "sha256": tokens_sha256(pack_tokens([1, 2]))},
                        "input_suffix_ids": [9, 9], "output_ids": [7], "output_logprobs": [-0.1]}, line=1, now_micros=0)
    sealed = seal_request(ev, ks, "execution:e1")
    assert sealed["input_prefix"] == ev["input_prefix"] and sealed["input_ids"] is None
    assert sealed["input_suffix_ids"] == b""
    assert unseal(sealed, ks) == {**ev, "sealed": None}


def test_request_v1_events_still_decode_under_v2():
    codec = default_codec()
    v1 = next(s for s in codec.by_fingerprint.values() if s.name == "RequestRecorded" and s.version == 1)
    v2 = next(s for s in codec.by_fingerprint.values() if s.name == "RequestRecorded" and s.version == 2)
    assert codec.schema_for("request").version == 3 and v1.fingerprint != v2.fingerprint
    ev = _req(inp=[1, 2], out=[70000])
    data = codec.encode(ev, v1)
    assert codec.writer_schema(data) is v1
    assert codec.decode(data) == {**ev, "sealed": None, "metadata": None}
    raw = json.loads(v2.path.read_text())
    assert [f["name"] for f in raw["fields"]][:-1] == [f["name"] for f in json.loads(v1.path.read_text())["fields"]]
    assert raw["fields"][-1]["name"] == "sealed" and raw["fields"][-1]["default"] is None


# ============================================================================ sealed ingestion
def test_ingest_sealed_is_idempotent_and_verifies_references_into_sealed_requests(tmp_path):
    log = open_log(str(tmp_path / "s"), create=True)
    ks = KeyStore(tmp_path / "keys.db")
    lines = [{"type": "task_registered", "task_id": "t1", "source": "acme"}, opened("e1", "t1"),
             request("e1", "r1", [1, 2, 3], MARKER)]
    rep = ingest_sealed(Ingestor(log), numbered(lines), ks, level="source")
    assert rep.appended == 3
    assert ks.subjects() == ["source:acme"]
    again = ingest_sealed(Ingestor(log), numbered(lines), ks, level="source")
    assert again.appended == 0 and again.duplicates == 3 and not again.conflicts
    from ledger.algorithms.tokens import tokens_sha256

    def ref(rid, length, toks):
        return {"type": "request", "execution_id": "e1", "request_id": rid, "output_ids": [5], "output_logprobs": [-1.0],
                "input_prefix": {"request_id": "r1", "length": length, "sha256": tokens_sha256(pack_tokens(toks))}}
    # this ingestor has no key store that holds r1's key (the keys are in keys.db, not the store's data-keys.db)
    with pytest.raises(IngestError, match="sealed, and no key store"):
        Ingestor(log).ingest_lines(numbered([ref("r2", 3, [1, 2, 3])]))
    # with the key store the reference is verified against the unsealed tokens: a wrong hash is refused ...
    with pytest.raises(IngestError, match="does not match"):
        Ingestor(log, keystore=ks, seal="source").ingest_lines(numbered([ref("r2", 4, [1, 2, 3, 9])]))
    # ... a right one (reaching into the sealed output) is accepted, and sealed itself
    rep = Ingestor(log, keystore=ks, seal="source").ingest_lines(numbered([ref("r2", 5, [1, 2, 3] + MARKER[:2])]))
    assert rep.appended == 1
    ks.destroy("source:acme")
    with pytest.raises(IngestError, match="were erased"):
        Ingestor(log, keystore=ks).ingest_lines(numbered([ref("r3", 3, [1, 2, 3])]))
    with pytest.raises(SealError, match="never opened"):
        SubjectResolver("task", log)(_req(ex="nope"))
    assert MARKER[0].to_bytes(4, "little") + MARKER[1].to_bytes(4, "little") not in (tmp_path / "s" / "events.dat").read_bytes()


# ============================================================================ erase end to end
def _store_bytes(store) -> bytes:
    blobs = []
    for root, _dirs, files in os.walk(store):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                blobs.append(fh.read())
    return b"".join(blobs)


def _digests(log) -> list[bytes]:
    return [rec.digest for where in log.partitions() for rec in log.read(where)]


def test_erase_destroys_keys_log_still_verifies_and_no_token_is_readable(tmp_path, monkeypatch, capsys):
    store = tmp_path / "store"
    monkeypatch.setenv("LEDGER_STORE", str(store))
    assert cli(["init"]) == 0
    assert cli(["keys", "new", "--out", str(tmp_path / "gov.key")]) == 0
    from ledger.events.signing import load_private_key, sign_line

    key = load_private_key(tmp_path / "gov.key")
    acme = [{"type": "task_registered", "task_id": "ta", "source": "acme"},
            {"type": "task_registered", "task_id": "tb", "source": "beta"}]
    tag = {"a1": 11, "a2": 12, "b1": 21}  # makes every execution's payload distinct
    for ex, t in (("a1", "ta"), ("a2", "ta"), ("b1", "tb")):
        acme += [opened(ex, t), request(ex, "r1", [1, 2, 3], MARKER + [tag[ex]]),
                 request(ex, "r2", [1, 2, 3] + MARKER + [tag[ex], 6], [7, 8]), closed(ex)]
    acme.append({"type": "record_derived", "derived_execution_id": "a1v", "parent_execution_id": "a1",
                 "transformation": "drop-r2@1", "withheld_fields": ["request:r2"]})
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(l) for l in acme) + "\n")
    assert cli(["ingest", str(tmp_path / "data.jsonl")]) == 0  # the plain, default path seals
    grant = sign_line({"type": "permission", "subject": "*", "use": "sft", "action": "grant", "authority": "legal"}, key)
    (tmp_path / "gov.jsonl").write_text(json.dumps(grant) + "\n")
    assert cli(["ingest", str(tmp_path / "gov.jsonl")]) == 0
    assert cli(["project"]) == 0
    paths = store_paths(str(store))
    marker = pack_tokens(MARKER)
    assert marker not in (store / "events.dat").read_bytes()  # the log only ever held ciphertext
    with open_log(str(store)) as log, KeyStore(paths.data_keys) as ks:
        sealed = [default_codec().decode(r.value) for w in log.partitions() for r in log.read(w) if r.event_type == "request"]
        assert len(sealed) == 6 and all(ev["sealed"] is not None for ev in sealed)
        assert all(unpack_tokens(unseal(ev, ks)["output_ids"]).size for ev in sealed)  # readable before erasure
        digests_before = _digests(log)
        root_before = tree_for(log, log.partitions()[0]).root()
    capsys.readouterr()

    assert cli(["withdraw", "source:acme", "--reason", "data subject erasure request", "--key", str(tmp_path / "gov.key"),
                "--erase", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(d["subject"] for d in out["erase"]["destroyed"]) == ["execution:a1", "execution:a2"]
    assert out["erase"]["not_destroyed"] == [] and out["erase"]["projections_rebuilt"]
    assert out["impact"]["executions"] == ["a1", "a2"] and out["impact"]["derived_views"] == ["a1v"]

    with open_log(str(store)) as log, KeyStore(paths.data_keys) as ks:
        # digests and the Merkle root of what was there are unchanged; one withdrawal was appended
        after = _digests(log)
        assert after[:len(digests_before)] == digests_before and len(after) == len(digests_before) + 1
        assert tree_for(log, log.partitions()[0], len(digests_before)).root() == root_before
        assert audit(log, Trust.load(paths.trust)).ok
        for ev in (default_codec().decode(r.value) for w in log.partitions() for r in log.read(w)
                   if r.event_type == "request"):
            opened_ev = unseal(ev, ks)
            assert (opened_ev is None) == (ev["execution_id"] in ("a1", "a2"))  # erased vs. still readable
    assert cli(["audit"]) == 0
    capsys.readouterr()

    db = connect(paths.db)
    assert all(withdrawn(db, e) and erased(db, e) for e in ("a1", "a2", "a1v"))
    assert not withdrawn(db, "b1") and permitted(db, "b1", "sft")[0] == "pass"
    dump = canonical_dump(db)
    db.close()
    # a full replay after erasure is deterministic and cannot read the erased tokens
    assert cli(["project", "--rebuild"]) == 0
    db = connect(paths.db)
    assert canonical_dump(db) == dump
    db.close()
    erased_payloads = [pack_tokens(MARKER + [tag[ex]]) for ex in ("a1", "a2")]
    erased_payloads += [pack_tokens([1, 2, 3] + MARKER + [tag[ex], 6]) for ex in ("a1", "a2")]
    everything = _store_bytes(store)
    for p in erased_payloads:
        assert p not in everything
    capsys.readouterr()
    # erasing again is idempotent; nothing new to destroy
    assert cli(["withdraw", "source:acme", "--reason", "data subject erasure request", "--key", str(tmp_path / "gov.key"),
                "--erase", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["erase"]["destroyed"] == []


def test_erase_reports_keys_it_must_not_destroy(tmp_path):
    """A record sealed under its source's key, erased at execution level: the key would
    shred more than the withdrawal covers, so it is reported, not destroyed."""
    from ledger.corpus.withdraw import erase_keys
    from ledger.projections.engine import ReplayEngine
    from ledger.projections.governance import GovernanceProjection

    log = open_log(str(tmp_path / "s"), create=True)
    ks = KeyStore(tmp_path / "keys.db")
    ingest_sealed(Ingestor(log), numbered([{"type": "task_registered", "task_id": "t", "source": "acme"},
                                           opened("e1", "t"), request("e1", "r1", [1], [2]),
                                           opened("e2", "t"), request("e2", "r1", [1], [3])]), ks, level="source")
    eng = ReplayEngine(log, connect(tmp_path / "p.db"), [GovernanceProjection()])
    eng.run()
    res = erase_keys(eng.db, ks, "execution:e1")
    assert res["destroyed"] == []
    assert res["not_destroyed"][0]["subject"] == "source:acme" and res["not_destroyed"][0]["executions"] == ["e1"]
    res = erase_keys(eng.db, ks, "source:acme")
    assert [d["subject"] for d in res["destroyed"]] == ["source:acme"] and res["not_destroyed"] == []
