"""Avro single-object encoding against implementations we did not write (SPEC §4.1, issue 12).

* the SPEC vector and an independent CRC-64-AVRO (the Avro spec's reference algorithm)
  against fastavro and Apache Avro's Python package for every schema file;
* the committed Apache Avro Java fixtures (tests/interop/README.md) decode with our codec
  to exactly their datum, and our encoder reproduces Java's bytes exactly;
* our bytes of realistic events (examples/demo.jsonl through the ingest path; hypothesis
  requests) decode with Apache Avro Python (tests/interop/decode_so.py) to what we decode;
* an OLD log (fingerprints in the pre-fix reversed order) still decodes, re-ingests as
  duplicates, projects without dead letters, audits, publishes and deep-verifies, and its
  digests and Merkle root do not change.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger import open_log
from ledger.events.codec import MAGIC, Codec, CodecError, _crc64_fingerprint, default_codec
from ledger.events.validate import validate_line
from ledger.producers.ingest import Ingestor, read_json_lines

from .helpers import Signer, request

avro = pytest.importorskip("avro", reason="PyPI `avro` (Apache Avro for Python) is in the test extra")
import avro.schema  # noqa: E402

from .interop.decode_so import AvroSingleObjectReader, DecodeError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "interop" / "fixtures"
SPEC_NULL = bytes.fromhex("8a8f25cce724dd63")  # SPEC §4.1: 0x63DD24E7CC258F8A little-endian


# --- an independent CRC-64-AVRO: the reference algorithm of the Avro specification ---------
_EMPTY = 0xC15D213AA4D7A795


def _table() -> list[int]:
    out = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_EMPTY & -(fp & 1))
        out.append(fp)
    return out


_TABLE = _table()


def crc64_avro(data: bytes) -> int:
    fp = _EMPTY
    for b in data:
        fp = (fp >> 8) ^ _TABLE[(fp ^ b) & 0xFF]
    return fp


def _strip_logical(s):
    if isinstance(s, dict):
        return {k: _strip_logical(v) for k, v in s.items() if k != "logicalType"}
    if isinstance(s, list):
        return [_strip_logical(v) for v in s]
    return s


def test_spec_vector_null():
    assert crc64_avro(b'"null"') == 0x63DD24E7CC258F8A
    assert crc64_avro(b'"null"').to_bytes(8, "little") == SPEC_NULL
    assert _crc64_fingerprint("null") == SPEC_NULL
    assert avro.schema.parse('"null"').fingerprint("CRC-64-AVRO") == SPEC_NULL
    assert (FIXTURES / "null.avro-so").read_bytes() == MAGIC + SPEC_NULL  # Apache Avro Java's bytes


def test_every_schema_fingerprint_agrees_across_three_implementations():
    from fastavro.schema import to_parsing_canonical_form

    codec = default_codec()
    files = sorted((ROOT / "schemas").glob("*.avsc"))
    assert len(codec.by_fingerprint) == len(files) == len(codec.by_legacy_fingerprint) >= 25
    for sv in codec.by_fingerprint.values():
        raw = json.loads(sv.path.read_text())
        pcf = to_parsing_canonical_form(raw)
        apache = avro.schema.parse(json.dumps(_strip_logical(raw)))  # see tests/interop/README.md "Surprises"
        assert apache.canonical_form == pcf, sv.path.name
        assert sv.fingerprint == crc64_avro(pcf.encode()).to_bytes(8, "little") == apache.fingerprint("CRC-64-AVRO"), \
            sv.path.name
        assert sv.legacy_fingerprint == sv.fingerprint[::-1]


def _fixtures() -> list[dict]:
    return [json.loads(p.read_text()) | {"_name": p.stem} for p in sorted(FIXTURES.glob("*.json"))
            if json.loads(p.read_text())["schema"].endswith(".avsc")]


def _datum(fx: dict) -> dict:
    """The fixture's datum with its hex `bytes` fields back to bytes (what our codec returns)."""
    return {k: (bytes.fromhex(v) if k in fx["bytes_fields"] and v is not None else v) for k, v in fx["datum"].items()}


def test_there_are_java_fixtures():
    assert {fx["_name"] for fx in _fixtures()} == {"cost_recorded_v1", "execution_opened", "request",
                                                   "request_prefix", "tool_payload"}


@pytest.mark.parametrize("fx", _fixtures(), ids=lambda fx: fx["_name"])
def test_apache_avro_java_fixture_decodes_exactly_and_our_encoder_reproduces_its_bytes(fx):
    from fastavro.schema import to_parsing_canonical_form

    codec = default_codec()
    data = (FIXTURES / f"{fx['_name']}.avro-so").read_bytes()
    assert data.hex() == fx["encoded"] and len(data) == fx["length"]
    sv = codec.writer_schema(data)
    assert sv.path.name == fx["schema"] and data[2:10].hex() == fx["fingerprint"] == sv.fingerprint.hex()
    assert not codec.is_legacy_order(data)
    assert to_parsing_canonical_form(json.loads(sv.path.read_text())) == fx["parsing_canonical_form"]
    want = _datum(fx)
    expected = dict(want)
    if fx["_name"] == "cost_recorded_v1":  # written with v1: the v2 reader adds the defaults
        expected |= {"category": None, "currency": "USD"}
    if fx["_name"] == "execution_opened":  # written with v1: the v3 reader adds collection_id (SPEC 6.10), policy_version (11.6)
        expected |= {"collection_id": None, "policy_version": None}
    if fx["_name"] in ("request", "request_prefix"):  # written with v2: the v3 reader adds metadata (SPEC 11.3)
        expected |= {"metadata": None}
    assert codec.decode(data) == expected
    # byte-for-byte what Apache Avro Java's BinaryMessageEncoder wrote
    assert codec.encode(want, sv) == data
    # the same message in the legacy (reversed) order decodes to the same datum
    legacy = data[:2] + data[2:10][::-1] + data[10:]
    assert codec.is_legacy_order(legacy) and codec.writer_schema(legacy) is sv
    assert codec.decode(legacy) == expected
    assert Codec(legacy_fingerprint_order=True).encode(want, sv) == legacy


@pytest.mark.parametrize("fx", _fixtures(), ids=lambda fx: fx["_name"])
def test_the_independent_decoder_reads_the_java_fixtures(fx):
    name, datum = AvroSingleObjectReader(ROOT / "schemas", reader="writer").decode(
        (FIXTURES / f"{fx['_name']}.avro-so").read_bytes())
    assert name == fx["schema"] and datum == _datum(fx)


def _ingest_demo(url: str, codec: Codec | None = None):
    with open((ROOT / "examples" / "demo.jsonl")) as f, open_log(url, create=True) as log:
        rep = Ingestor(log, codec=codec, seal=None).ingest_lines(read_json_lines(f))
        assert rep.appended == 436 and not rep.conflicts
        return [r for w in log.partitions() for r in log.read(w)]


def test_apache_avro_python_decodes_our_bytes_of_the_demo_events(tmp_path):
    codec = default_codec()
    records = _ingest_demo(str(tmp_path / "store"))
    reader = AvroSingleObjectReader(ROOT / "schemas")
    types = set()
    for rec in records:
        assert rec.value[:2] == MAGIC and not codec.is_legacy_order(rec.value)
        name, datum = reader.decode(rec.value)
        ours = codec.decode(rec.value)
        assert name == codec.writer_schema(rec.value).path.name
        assert datum == ours, rec.event_id
        types.add(ours["event_type"])
    assert types == {"tool_payload", "request", "execution_opened", "execution_closed", "assessment", "task_registered"}


def test_the_independent_decoder_refuses_legacy_order_naming_the_reversal():
    """Why the fix matters: Apache Avro cannot read the old order; our codec still can."""
    codec = default_codec()
    ev = validate_line(request("e", "r", [1, 2], [3]), line=1, now_micros=1_700_000_000_000_000)
    legacy = Codec(legacy_fingerprint_order=True).encode(ev)
    with pytest.raises(DecodeError, match="REVERSED bytes"):
        AvroSingleObjectReader(ROOT / "schemas").decode(legacy)
    assert codec.decode(legacy) == codec.decode(codec.encode(ev))


# Timestamps come from RFC 3339 text or the clock, so they stop before year 10000; Apache Avro's
# timestamp-micros decoder (Python datetime) cannot represent later instants either.
_YEAR_10000_MICROS = 253_402_300_800_000_000


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inp=st.lists(st.integers(0, 2**32 - 1), max_size=40), out=st.lists(st.integers(0, 2**32 - 1), min_size=1,
                                                                          max_size=40),
       model=st.text(max_size=20), at=st.integers(0, _YEAR_10000_MICROS - 1))
def test_our_request_bytes_decode_identically_with_apache_avro(inp, out, model, at):
    codec = default_codec()
    ev = validate_line(request("e", "r", inp, out, model=model or None), line=1, now_micros=at)
    data = codec.encode(ev)
    name, datum = _READER.decode(data)
    assert name == codec.schema_for("request").path.name
    assert datum == codec.decode(data)


_READER = AvroSingleObjectReader(ROOT / "schemas")


# --- an old log: every event written with the reversed fingerprint --------------------------

def _legacy_store(tmp_path):
    from .test_manifest import Store, _base_lines

    store = Store(tmp_path, Signer())
    legacy = Codec(legacy_fingerprint_order=True)
    lines = [store.signer.sign({**line, "occurred_at": "2098-06-01T00:00:00Z"})
             if line["type"] in {"admission_policy", "permission", "withdrawal", "split_policy"} else line
             for line in _base_lines()]
    with open_log(store.paths.url) as log:
        rep = Ingestor(log, store.signer.trust, codec=legacy).ingest_lines(enumerate(lines, 1))
        assert rep.appended == len(lines) and not rep.conflicts
    return store, lines


def test_an_old_order_log_decodes_dedups_projects_audits_and_deep_verifies(tmp_path):
    from ledger.corpus import integrity
    from ledger.corpus.integrity import audit

    codec = default_codec()
    store, lines = _legacy_store(tmp_path)
    with open_log(store.paths.url) as log:
        recs = list(log.read((log.partitions()[0])))
        assert recs and all(codec.is_legacy_order(r.value) for r in recs)
        assert [codec.decode(r.value)["event_id"] for r in recs] == [r.event_id for r in recs]
        digests = [r.digest for r in recs]
        root = integrity.tree_for(log, log.partitions()[0]).root()
        # re-ingesting the same lines with today's (standard-order) codec: every line a duplicate
        rep = Ingestor(log, store.signer.trust).ingest_lines(enumerate(lines, 1))
        assert (rep.appended, rep.duplicates, rep.conflicts) == (0, len(lines), [])
        assert log.conflicts() == []
        assert audit(log, store.signer.trust).to_json() == {"ok": True, "events": len(lines),
                                                             "first_bad_position": None, "problems": []}
    # publish projects everything; nothing may land in dead letters or be rejected
    pub = store.publish(tmp_path / "m1.json")
    assert pub.version == 1
    from ledger.projections.engine import connect

    db = connect(store.paths.db)
    assert db.execute("SELECT count(*) FROM _dead_letter").fetchone()[0] == 0
    assert db.execute("SELECT count(*) FROM _rejected").fetchone()[0] == 0
    rep = store.verify(tmp_path / "m1.json", deep=True)
    assert rep.ok, rep.problems
    with open_log(store.paths.url) as log:
        after = list(log.read(log.partitions()[0]))
        # the old events' bytes and digests are untouched; only the new manifest event is standard order
        assert [r.digest for r in after[:len(recs)]] == digests
        assert integrity.tree_for(log, log.partitions()[0], len(recs)).root() == root
        assert [codec.is_legacy_order(r.value) for r in after[len(recs):]] == [False]
        assert audit(log, store.signer.trust).ok


def test_old_and_new_order_logs_project_to_the_same_state(tmp_path):
    from ledger.projections.engine import ReplayEngine, canonical_dump, connect

    from .test_manifest import _factory

    dumps = []
    for order in ("legacy", "standard"):
        url = str(tmp_path / order / "store")
        _ingest_demo(url, Codec(legacy_fingerprint_order=order == "legacy"))
        db = connect(tmp_path / order / "p.db")
        with open_log(url) as log:
            ReplayEngine(log, db, _factory()).run()
        assert db.execute("SELECT count(*) FROM _dead_letter").fetchone()[0] == 0
        dumps.append(canonical_dump(db))
    assert dumps[0] == dumps[1] and "exec-" in dumps[0] and len(dumps[0]) > 10_000


def test_a_fingerprint_in_neither_order_is_still_refused():
    codec = default_codec()
    data = bytearray(codec.encode(validate_line(request("e", "r", [1], [2]), line=1, now_micros=0)))
    data[2] ^= 0x01
    with pytest.raises(CodecError, match="unknown schema fingerprint"):
        codec.decode(bytes(data))


@pytest.mark.kafka
def test_old_order_events_on_kafka_dedup_and_project(kafka_url):
    from ledger.projections.engine import ReplayEngine, connect

    from .test_manifest import _factory

    codec = default_codec()
    with open((ROOT / "examples" / "demo.jsonl")) as f:
        lines = list(read_json_lines(f))[:60]
    with open_log(kafka_url, create=True) as log:
        rep = Ingestor(log, codec=Codec(legacy_fingerprint_order=True), seal=None).ingest_lines(lines)
        assert rep.appended == 60 and not rep.conflicts
        rep = Ingestor(log, seal=None).ingest_lines(lines)
        assert (rep.appended, rep.duplicates, rep.conflicts) == (0, 60, [])
        recs = [r for w in log.partitions() for r in log.read(w)]
        assert len(recs) == 60 and all(codec.is_legacy_order(r.value) for r in recs)
        db = connect(":memory:")
        ReplayEngine(log, db, _factory()).run()
        assert db.execute("SELECT count(*) FROM _dead_letter").fetchone()[0] == 0


def test_apache_avro_python_decodes_our_bytes_of_the_spec_6_10_evidence_events():
    """Every event type new in this release (SPEC §6.10; README examples, with the grader-control and
    artifact-diff lines of the protected-paths / calibration sections) as our codec encodes it, read by
    Apache Avro with the writer schema: the same datum."""
    import json

    codec = default_codec()
    reader = AvroSingleObjectReader(ROOT / "schemas")
    lines = []
    for name in ("collections-events", "collections-gov", "evidence-events", "evidence-gov"):
        lines += [json.loads(x) for x in (ROOT / "examples" / f"{name}.jsonl").read_text().splitlines() if x.strip()]
    lines += [{"type": "artifact_diff", "execution_id": "run-1", "artifact_version": "v1", "base_commit": "abc123",
               "changed_paths": ["src/pool.py", "tests/regression/test_wakeup.py"], "diff": "--- a\n+++ b\n"},
              {"type": "grader_control", "execution_id": "run-2", "evaluator": "repair_accept@2", "kind": "inadequate",
               "expected_verdict": "fail"},
              {"type": "task_registered", "task_id": "t-prot", "protected_paths": ["tests/**"],
               "allowed_paths": ["tests/regression/test_*.py"]},
              {"type": "checkpoint_trained", "checkpoint_id": "ckpt-7", "manifests": [{"route": "repair_sft", "version": 1}],
               "evaluation_claims": ["repair pass@1 on final_test"]}]
    types = set()
    for i, obj in enumerate(lines):
        ev = validate_line(obj, line=i + 1, now_micros=1_700_000_000_000_000)
        data = codec.encode(ev)
        name, datum = reader.decode(data)
        assert name == codec.writer_schema(data).path.name
        assert datum == codec.decode(data), obj
        types.add(ev["event_type"])
    assert {"collection_manifest", "checkpoint_trained", "artifact_diff", "grader_control", "fault_injected",
            "production_feedback", "counterfactual_probe", "execution_opened", "task_registered"} <= types
