"""Schemas and the single-object codec (SPEC §4.1)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ledger.algorithms.tokens import pack_tokens, unpack_tokens
from ledger.events.catalog import EVENT_TYPES
from ledger.events.codec import MAGIC, Codec, CodecError, default_codec, event_digest
from ledger.events.validate import validate_line

from .helpers import opened, request


def test_every_event_type_has_a_schema_with_the_common_header():
    codec = default_codec()
    assert set(codec.latest) == set(EVENT_TYPES)
    for sv in codec.latest.values():
        raw = json.loads(sv.path.read_text())
        assert raw["namespace"] == "ledger.events"
        names = [f["name"] for f in raw["fields"]]
        assert names[:4] == ["event_id", "event_type", "occurred_at", "producer"]
        occurred = next(f for f in raw["fields"] if f["name"] == "occurred_at")
        assert occurred["type"] == {"type": "long", "logicalType": "timestamp-micros"}


def test_single_object_encoding_layout_and_crc64_fingerprint():
    codec = default_codec()
    ev = validate_line(request("e", "r", [1, 2, 3], [70000]), line=1, now_micros=1_700_000_000_000_000)
    data = codec.encode(ev)
    assert data[:2] == MAGIC == b"\xc3\x01"
    sv = codec.schema_for("request")
    assert data[2:10] == sv.fingerprint
    # CRC-64-AVRO of the Parsing Canonical Form in the Avro spec's byte order: fastavro's hex
    # string IS the little-endian wire bytes (reading it as an integer reversed them, issue 12)
    from fastavro.schema import fingerprint, to_parsing_canonical_form

    pcf = to_parsing_canonical_form(json.loads(sv.path.read_text()))
    assert sv.fingerprint == bytes.fromhex(fingerprint(pcf, "CRC-64-AVRO"))
    assert sv.legacy_fingerprint == sv.fingerprint[::-1] != sv.fingerprint
    assert not codec.is_legacy_order(data)
    back = codec.decode(data)
    assert back == {**ev, "sealed": None}  # RequestRecorded.v2 adds the optional `sealed` (crypto-shredding)
    assert unpack_tokens(back["output_ids"]).tolist() == [70000]
    # tokens are packed little-endian uint32, not Avro arrays
    assert pack_tokens([1, 2, 3]) in data


def test_old_schema_version_decodes_under_the_new_one():
    codec = default_codec()
    v1 = next(s for s in codec.by_fingerprint.values() if s.name == "CostRecorded" and s.version == 1)
    v2 = codec.schema_for("cost_recorded")
    assert v2.version == 2 and v1.fingerprint != v2.fingerprint
    old = {"event_id": "c1", "event_type": "cost_recorded", "occurred_at": 5, "producer": "p", "stamped": [],
           "execution_id": "e1", "amount": 2.5}
    data = codec.encode(old, v1)
    assert codec.writer_schema(data) is v1
    assert codec.decode(data) == {**old, "category": None, "currency": "USD"}


def test_unknown_fingerprint_and_garbage_are_clear_errors():
    codec = default_codec()
    data = bytearray(codec.encode(validate_line(opened("e1"), line=1, now_micros=0)))
    data[5] ^= 0xFF
    with pytest.raises(CodecError, match="unknown schema fingerprint"):
        codec.decode(bytes(data))
    with pytest.raises(CodecError, match="C3 01"):
        codec.decode(b"{}")


def test_codec_refuses_schema_files_with_bad_names(tmp_path):
    (tmp_path / "Oops.avsc").write_text("{}")
    with pytest.raises(CodecError, match="not <Name>.v<N>.avsc"):
        Codec(tmp_path)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=50), st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50))
def test_request_round_trip_is_exact(inp, out):
    codec = default_codec()
    ev = validate_line(request("e", "r", inp, out), line=1, now_micros=0)
    data = codec.encode(ev)
    back = codec.decode(data)
    assert unpack_tokens(back["input_ids"]).tolist() == inp
    assert unpack_tokens(back["output_ids"]).tolist() == out
    assert event_digest(data) == event_digest(codec.encode(back))


@given(st.text(min_size=1), st.text(), st.integers(-(2**62), 2**62), st.lists(st.sampled_from(["occurred_at", "producer", "event_id"])))
def test_header_length_matches_fastavro(event_id, producer, occurred, stamped):
    import io

    import fastavro

    from ledger.events.codec import header_length

    schema = fastavro.parse_schema({"type": "record", "name": "H", "fields": [
        {"name": "event_id", "type": "string"}, {"name": "event_type", "type": "string"},
        {"name": "occurred_at", "type": "long"}, {"name": "producer", "type": "string"},
        {"name": "stamped", "type": {"type": "array", "items": "string"}}]})
    ev = {"event_id": event_id, "event_type": "request", "occurred_at": occurred, "producer": producer, "stamped": stamped}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schema, ev)
    assert header_length(ev) == buf.tell()
