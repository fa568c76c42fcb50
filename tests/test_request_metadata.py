"""`request.metadata` (RequestRecorded.v3, issue 28 item 3c / SPEC 11.3): an optional JSON object —
the capture gateway records the sampling parameters it sent upstream there. Older request lines
(v1, v2) stay valid and decode with metadata null; a non-object is refused naming line and field
(exit 2, nothing appended)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger import open_log
from ledger.cli import main
from ledger.events.codec import default_codec
from ledger.events.validate import ValidationError, validate_line

from .helpers import opened, request

NOW = 1_900_000_000_000_000


def test_v1_and_v2_requests_decode_with_null_metadata_and_v3_round_trips():
    codec = default_codec()
    line = request("e1", "r1", [1, 2], [3], metadata={"sampling": {"temperature": 1.0, "top_k": None, "seed": 7}})
    ev = validate_line(line, now_micros=NOW)
    assert ev["metadata"] == '{"sampling":{"seed":7,"temperature":1.0,"top_k":null}}'
    latest = codec.schema_for("request")
    assert latest.version == 3
    assert codec.decode(codec.encode(ev))["metadata"] == ev["metadata"]
    for version in (1, 2):
        old = next(s for s in codec.by_fingerprint.values() if s.name == "RequestRecorded" and s.version == version)
        plain = validate_line(request("e1", "r1", [1, 2], [3]), now_micros=NOW)
        plain = {k: v for k, v in plain.items() if k != "metadata" and (version == 2 or k != "sealed")}
        assert codec.decode(codec.encode(plain, old))["metadata"] is None


@pytest.mark.parametrize("bad", [[1, 2], "temperature=1", 3, {"x": float("nan")}])
def test_a_non_object_metadata_is_refused_naming_line_and_field(tmp_path, capsys, bad):
    store = tmp_path / "s"
    assert main(["--store", str(store), "init"]) == 0
    path = tmp_path / "in.jsonl"
    lines = [opened("e1"), request("e1", "r1", [1, 2], [3], metadata=bad)]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    capsys.readouterr()
    assert main(["--store", str(store), "ingest", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "metadata" in err
    with open_log(str(store)) as log:
        assert log.size() == 0


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.none() | st.booleans() | st.integers() | st.text(max_size=8)
                       | st.floats(allow_nan=False, allow_infinity=False), max_size=5))
def test_any_json_object_round_trips_through_the_log_encoding(meta):
    codec = default_codec()
    ev = validate_line(request("e1", "r1", [1], [2], metadata=meta), now_micros=NOW)
    assert json.loads(codec.decode(codec.encode(ev))["metadata"]) == json.loads(json.dumps(meta))
    with pytest.raises(ValidationError):
        validate_line(request("e1", "r1", [1], [2], metadata=[meta]), now_micros=NOW)
