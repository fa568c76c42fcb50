"""JSON-lines ingestion: validation, atomicity, idempotency, references, signatures."""

from __future__ import annotations

import io
import json

import pytest

from ledger.algorithms.tokens import pack_tokens, tokens_sha256
from ledger.events.validate import ValidationError
from ledger.log import open_log
from ledger.producers.ingest import IngestError, Ingestor, read_json_lines

from .helpers import Signer, closed, numbered, opened, request


@pytest.fixture
def log(tmp_path):
    with open_log(str(tmp_path / "store"), create=True) as lg:
        yield lg


def ingest(log, lines, trust=None):
    return Ingestor(log, trust).ingest_lines(numbered(lines))


def test_append_duplicate_and_conflict(log):
    lines = [opened("e1"), request("e1", "r1", [1, 2], [3])]
    assert ingest(log, lines).appended == 2
    again = ingest(log, lines)
    assert (again.appended, again.duplicates, again.conflicts) == (0, 2, [])
    changed = [opened("e1"), request("e1", "r1", [1, 2], [4])]
    rep = ingest(log, changed)
    assert rep.appended == 0 and rep.duplicates == 0
    assert [c["event_id"] for c in rep.conflicts] == ["request/e1/r1"]
    assert rep.conflicts[0]["reason"] == "same event_id with different content"
    assert log.size() == 2
    assert [c["event_id"] for c in log.conflicts()] == ["request/e1/r1"]


def test_duplicate_returns_original_position(log):
    res1 = Ingestor(log).ingest_lines(numbered([opened("e1")])).result
    res2 = Ingestor(log).ingest_lines(numbered([opened("e1")])).result
    assert res1.appended == [("execution_opened/e1", "0")]
    assert res2.duplicates == [("execution_opened/e1", "0")]


def test_stamped_fields_are_not_compared_but_supplied_ones_are(log):
    ingest(log, [opened("e1")])
    assert ingest(log, [{**opened("e1"), "producer": "other"}]).duplicates == 1
    explicit = {**opened("e2"), "occurred_at": "2026-01-01T00:00:00Z"}
    ingest(log, [explicit])
    assert ingest(log, [explicit]).duplicates == 1
    assert len(ingest(log, [{**explicit, "occurred_at": "2026-01-02T00:00:00Z"}]).conflicts) == 1


@pytest.mark.parametrize("line,field,message", [
    ({"type": "request", "execution_id": "e1", "request_id": "r", "input_ids": [1, -1], "output_ids": [2], "output_logprobs": [-1]},
     "input_ids", "out of range"),
    ({"type": "request", "execution_id": "e1", "request_id": "r", "input_ids": [1], "output_ids": [2, 3], "output_logprobs": [-1]},
     "output_logprobs", "has 1 values but output_ids has 2 tokens"),
    ({"type": "request", "execution_id": "e1", "request_id": "r", "input_ids": [1], "output_ids": [2]},
     "output_logprobs", "required when generator is policy"),
    ({"type": "request", "execution_id": "e1", "request_id": "r", "input_ids": "abc", "output_ids": [2], "output_logprobs": [-1]},
     "input_ids", "JSON array"),
    ({"type": "request", "execution_id": "e1", "request_id": "r", "input_ids": [1, 2**32], "output_ids": [2], "output_logprobs": [-1]},
     "input_ids", "out of range"),
    ({"type": "wat"}, "type", "unknown event type"),
    ({"type": "execution_opened", "execution_id": "e2", "task_id": "t", "policy": "p"}, "deadline", "is required"),
    ({"type": "execution_opened", "execution_id": "e2", "task_id": "t", "policy": "p", "deadline": "tomorrow"}, "deadline", "RFC 3339"),
    ({"type": "execution_opened", "execution_id": 5, "task_id": "t", "policy": "p", "deadline": "2030-01-01T00:00:00Z"},
     "execution_id", "non-empty string"),
    ({"type": "execution_opened", "execution_id": "e2", "task_id": "t", "policy": "p", "deadline": "2030-01-01T00:00:00Z", "colour": 1},
     "colour", "unknown field"),
    ({"type": "assessment", "assessment_id": "a", "execution_id": "e1", "artifact_version": "v1", "outcome": "scored", "evaluator": "x"},
     "reward", "required when outcome is scored"),
])
def test_bad_lines_name_line_and_field_and_append_nothing(log, line, field, message):
    good = [opened("e1"), request("e1", "r0", [1], [2])]
    with pytest.raises(IngestError) as err:
        ingest(log, good + [line])
    assert f"line 3: field '{field}'" in str(err.value)
    assert message in str(err.value)
    assert log.size() == 0


def test_malformed_json_names_the_line(log):
    stream = io.StringIO(json.dumps(opened("e1")) + "\n{not json\n")
    with pytest.raises(IngestError, match="line 2: malformed JSON"):
        Ingestor(log).ingest_lines(read_json_lines(stream))
    assert log.size() == 0


def test_oversize_record_is_refused(log):
    from ledger.events import validate

    big = request("e1", "r", [1] * (validate.MAX_TOKENS_PER_LIST + 1), [2])
    with pytest.raises(IngestError, match="oversize record"):
        ingest(log, [opened("e1"), big])


def test_references_are_checked(log):
    with pytest.raises(IngestError, match="execution 'ex' was never opened"):
        ingest(log, [request("ex", "r", [1], [2])])
    ingest(log, [opened("e1"), request("e1", "r1", [1], [2]), closed("e1")])
    with pytest.raises(IngestError, match="execution 'e1' is closed"):
        ingest(log, [request("e1", "r2", [1, 2], [3])])
    # a retry of a request accepted before the close is still a duplicate
    assert ingest(log, [request("e1", "r1", [1], [2])]).duplicates == 1
    assert log.size() == 3


def prefix(rid, tokens):
    return {"request_id": rid, "length": len(tokens), "sha256": tokens_sha256(pack_tokens(tokens))}


def ref_request(rid, ref, suffix, out):
    line = request("e1", rid, [], out)
    del line["input_ids"]
    line["input_prefix"] = ref
    line["input_suffix_ids"] = suffix
    return line


def test_prefix_references_verify(log):
    ingest(log, [opened("e1"), request("e1", "r1", [1, 2, 3], [4, 5])])
    ok = ref_request("r2", prefix("r1", [1, 2, 3, 4]), [9], [10])
    assert ingest(log, [ok]).appended == 1
    # resolves through r2's own reference (chains across batches)
    assert ingest(log, [ref_request("r3", prefix("r2", [1, 2, 3, 4, 9, 10]), [], [11])]).appended == 1
    with pytest.raises(IngestError, match="unknown request 'nope'"):
        ingest(log, [ref_request("r4", prefix("nope", [1]), [], [1])])
    with pytest.raises(IngestError, match="prefix length 9 exceeds the 5 tokens"):
        ingest(log, [ref_request("r4", {**prefix("r1", [1]), "length": 9}, [], [1])])
    with pytest.raises(IngestError, match="does not match"):
        ingest(log, [ref_request("r4", {**prefix("r1", [1, 2]), "sha256": tokens_sha256(pack_tokens([1, 3]))}, [], [1])])
    assert log.size() == 4


def test_prefix_reference_inside_one_batch(log):
    lines = [opened("e1"), request("e1", "r1", [1, 2], [3]), ref_request("r2", prefix("r1", [1, 2, 3]), [4], [5])]
    assert ingest(log, lines).appended == 3


def test_governance_needs_a_trusted_signature(log):
    signer = Signer(("permission",))
    line = {"type": "permission", "subject": "source:acme", "use": "rl", "action": "grant", "authority": "legal"}
    with pytest.raises(IngestError, match="permission events must be signed"):
        ingest(log, [line], signer.trust)
    assert ingest(log, [signer.sign(line)], signer.trust).appended == 1
    forged = {**signer.sign(line), "use": "sft"}
    with pytest.raises(IngestError, match="does not verify"):
        ingest(log, [forged], signer.trust)
    other = Signer()
    with pytest.raises(IngestError, match="not in the trust file"):
        ingest(log, [other.sign({**line, "use": "sft"})], signer.trust)
    wd = {"type": "withdrawal", "subject": "source:acme", "reason": "r", "authority": "legal"}
    with pytest.raises(IngestError, match="not allowed to sign withdrawal"):
        ingest(log, [signer.sign(wd)], signer.trust)
    assert log.size() == 1


def test_validation_error_str():
    assert str(ValidationError("boom", line=3, field="x")) == "line 3: field 'x': boom"


def test_a_second_split_policy_must_name_the_one_it_supersedes(log):
    signer = Signer(("split_policy",))
    p1 = {"type": "split_policy", "policy_id": "p1", "fractions": {"train": 0.8, "dev": 0.1, "final_test": 0.1}, "salt": "s"}
    assert ingest(log, [signer.sign(p1)], signer.trust).appended == 1
    assert ingest(log, [signer.sign(p1)], signer.trust).duplicates == 1
    p2 = {**p1, "policy_id": "p2", "salt": "t"}
    with pytest.raises(IngestError, match=r"field 'supersedes': a split policy is already in force \(event split_policy/p1\)"):
        ingest(log, [signer.sign(p2)], signer.trust)
    with pytest.raises(IngestError, match="supersedes unknown split policy 'p0'"):
        ingest(log, [signer.sign({**p2, "supersedes": "p0"})], signer.trust)
    assert ingest(log, [signer.sign({**p2, "supersedes": "p1"})], signer.trust).appended == 1
    # two roots in one batch are refused too
    with pytest.raises(IngestError, match="already in force"):
        Ingestor(open_log(str(log.path) + "-b", create=True), signer.trust).ingest_lines(
            numbered([signer.sign(p1), signer.sign(p2)]))
