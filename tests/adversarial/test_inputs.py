"""Inputs that used to be accepted, refused cleanly (issue 27 items 8, 9, 11 and 12, SPEC 11.7).

* A JSON object naming one key twice (``{"execution_id": "a", "execution_id": "b"}``; the last one
  silently won) is refused at ingest naming line and key, exit 2 and nothing appended; the
  capture gateway answers such a body with HTTP 400 in the OpenAI error shape, ``import-atif``
  names the file and the key.  The check is exact at any depth and under any whitespace
  (hypothesis property against a reference parse that sees every pair).
* A string where a list is required (``changed_paths: "a.py"``) is refused naming the field, in
  every list-typed field of every event type (the list is read off the validator's table, so a
  field added later is covered); the recorder SDK no longer turns ``"call_1"`` into characters.
* An identifier is at most 1,024 bytes once escaped: a 1 MB id is refused in every id field,
  by the gateway's headers, by ``import-atif`` and by the CLI arguments naming ids.
* A damaged ``gateway.db`` is reported by ``ledger status`` (exit 1), which still prints the rest.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms.canonical import DuplicateKeyError, loads_unique
from ledger.algorithms.identifiers import MAX_ID_BYTES, id_bytes, id_problem
from ledger.cli import main as cli
from ledger.events import validate as V
from ledger.events.validate import FIELDS, ValidationError, validate_line
from ledger.log import open_log

from ..helpers import DEADLINE, closed, opened, request

GOLDEN = Path(__file__).resolve().parents[3] / "shared" / "testdata" / "atif" / "harbor-golden"
MB = 1 << 20


def _size(store: Path) -> int:
    with open_log(str(store)) as log:
        return log.size()


def _err_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert len(err) < 1000  # a 1 MB input is never echoed back
    return err.strip()


# ------------------------------------------------------------------ duplicate keys (item 8)
_OPEN = '{"type": "execution_opened", "execution_id": "e1", "task_id": "t1", "deadline": "%s", "policy": "p"}' % DEADLINE


@pytest.mark.parametrize("dup,key", [
    ('{"type": "execution_opened", "execution_id": "e2", "execution_id": "e3", "task_id": "t1", '
     f'"deadline": "{DEADLINE}", "policy": "p"}}', "execution_id"),
    ('{"type":"tool_payload","execution_id":"e1","call_id":"c1","kind":"call","payload":{"cmd":"ls","cmd":"rm -rf /"}}',
     "cmd"),
    ('{"type" : "cost_recorded", "execution_id"\t: "e1", "amount"  \t: 1, "amount" :2}', "amount"),
    ('{"type": "execution_closed", "execution_id": "e1", "status": "completed", "status": "error"}', "status"),
])
def test_a_duplicate_key_is_refused_naming_line_and_key(store, tmp_path, capsys, dup, key):
    f = tmp_path / "dup.jsonl"
    f.write_text(_OPEN + "\n" + dup + "\n")
    capsys.readouterr()
    assert cli(["ingest", str(f)]) == 2
    assert _err_line(capsys) == (f"ledger: refused (nothing appended): line 2: duplicate key {key!r} in a JSON "
                                 "object (each key may appear once)")
    assert _size(store) == 0
    f.write_text(_OPEN + "\n")  # the same file without the duplicate is fine
    assert cli(["ingest", str(f)]) == 0 and _size(store) == 1


# JSON values whose objects may repeat keys: a tree of (pairs) so both parses can be checked
_keys = st.sampled_from(["a", "b", "type", "x y", 'q"uote', "é", "\\"])
_ws = st.sampled_from(["", " ", "\t", "\n", "  \r\n"])
_scalars = st.one_of(st.integers(-5, 5), st.sampled_from(['"s"', '"a\\": 1"', '"{"', "true", "null", "1.5"]))


def _render(tree, draw) -> str:
    if isinstance(tree, list):
        return "[" + ",".join(_render(v, draw) for v in tree) + "]"
    if isinstance(tree, tuple):
        return "{" + ",".join(f"{draw(_ws)}{json.dumps(k)}{draw(_ws)}:{draw(_ws)}{_render(v, draw)}"
                              for k, v in tree[0]) + "}"
    return str(tree)


def _has_duplicate(tree) -> bool:
    if isinstance(tree, list):
        return any(map(_has_duplicate, tree))
    if isinstance(tree, tuple):
        keys = [k for k, _v in tree[0]]
        return len(set(keys)) != len(keys) or any(_has_duplicate(v) for _k, v in tree[0])
    return False


_trees = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(st.tuples(_keys, inner), max_size=4).map(lambda p: (p,))), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(tree=st.lists(st.tuples(_keys, _trees), min_size=1, max_size=5).map(lambda p: (p,)), data=st.data())
def test_loads_unique_refuses_exactly_the_texts_with_a_repeated_key(tree, data):
    """Property: at any depth and under any whitespace, the fast path (a C-speed count of key
    ends) never lets a duplicate through, and a text without one decodes as ``json.loads`` does."""
    text = _render(tree, data.draw)
    if _has_duplicate(tree):
        with pytest.raises(DuplicateKeyError):
            loads_unique(text)
    else:
        assert loads_unique(text) == json.loads(text)


def test_the_gateway_refuses_a_body_with_a_duplicate_key(tmp_path):
    from tests.gateway_helpers import RunningGateway, init_store

    gw = RunningGateway(init_store(tmp_path / "store"), "http://127.0.0.1:9", "vllm", timeout=2)
    try:
        body = (b'{"model": "tiny", "messages": [{"role": "user", "content": "go", "content": "rm -rf /"}], '
                b'"max_tokens": 4}')
        status, doc = _post(gw.url + "/v1/chat/completions", body, {"X-Ledger-Execution-Id": "ex-dup"})
        assert status == 400
        assert doc == {"error": {"message": "the request body is refused: duplicate key 'content' in a JSON object "
                                            "(each key may appear once)", "type": "invalid_request_error",
                                 "param": None, "code": 400}}
        # a 1 MB (or just 1,025-byte) execution id in a header: 400 before any upstream call
        status, doc = _post(gw.url + "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "go"}]}',
                            {"X-Ledger-Execution-Id": "x" * (MAX_ID_BYTES + 1)})
        assert status == 400 and doc["error"]["message"].startswith("X-Ledger-Execution-Id: identifier too long")
        assert gw.lines("execution_opened") == [] and gw.lines("request") == []
    finally:
        gw.close()


def _post(url: str, body: bytes, headers: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _golden(tmp_path: Path, edit) -> Path:
    src = GOLDEN / "hello-world-timeout.trajectory.json"
    out = tmp_path / src.name
    out.write_text(edit(src.read_text()))
    return out


def test_import_atif_refuses_a_duplicate_key_naming_file_and_key(store, tmp_path, capsys):
    f = _golden(tmp_path, lambda t: t.replace('"session_id": ', '"session_id": "other", "session_id": ', 1))
    capsys.readouterr()
    assert cli(["import-atif", str(f)]) == 2
    assert _err_line(capsys) == (f"ledger: error: {f.name}: duplicate key 'session_id' in a JSON object (each key "
                                 "may appear once)")
    assert _size(store) == 0


def test_import_atif_refuses_a_1mb_session_id(store, tmp_path, capsys):
    f = _golden(tmp_path, lambda t: re.sub(r'"session_id": "[^"]*"', f'"session_id": "{"s" * MB}"', t, count=1))
    capsys.readouterr()
    assert cli(["import-atif", str(f)]) == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]  # then one line per refused event, each as short
    assert first.startswith(f"ledger: refused (nothing appended): {f.name}: line 1: field 'execution_id': "
                            "identifier too long: 1,048,612 bytes escaped (UTF-8), the limit is 1,024")
    assert len(err) < 5000 and "Traceback" not in err
    assert _size(store) == 0


# ------------------------------------------------------------------ list fields refuse strings (item 11)
_BASE = {
    "collection_manifest": {"collection_id": "c", "version": 1, "use": "rl", "capability": "x", "evaluation_claim": "e"},
    "artifact_diff": {"execution_id": "e", "artifact_version": "v", "changed_paths": ["a.py"]},
    "checkpoint_trained": {"checkpoint_id": "k", "manifests": [{"route": "r", "version": 1}]},
    "task_registered": {"task_id": "t"},
    "request": {"execution_id": "e", "request_id": "r", "input_ids": [1], "output_ids": [2], "output_logprobs": [-1.0]},
    "execution_closed": {"execution_id": "e", "status": "completed"},
    "target_selection": {"execution_id": "e", "selection_id": "s", "policy": "p"},
    "record_derived": {"derived_execution_id": "d", "parent_execution_id": "p", "transformation": "t"},
    "revalidated": {"derived_execution_id": "d", "verdict": "pass"},
    "admission_policy": {"route": "r", "version": 1, "use": "rl", "split": "train", "j_max": 1},
    "assessment": {"assessment_id": "a", "execution_id": "e", "artifact_version": "v", "outcome": "scored",
                   "reward": 1.0, "evaluator": "g"},
    "canary": {"canary_id": "c", "token_ids": [1, 2], "scope": ["train"]},
    "batch_consumed": {"consumer": "c", "route": "r", "step": 0, "members": [{"member_id": "r/e/l", "digest": "0" * 64}]},
}
_LIST_CONVERTERS = {V._str_list, V._id_list, V._path_list, V._criteria, V._role_priority, V._criterion_names,
                    V._predicates}


def _list_fields() -> list[tuple[str, str]]:
    """Every (type, field) of the validator's table taking a JSON array: list converters, list
    defaults, and the lambdas wrapping list converters (required_capture, manifests, scope, members)."""
    out = []
    for etype, specs in FIELDS.items():
        for name, conv, _req, default in specs:
            if conv in _LIST_CONVERTERS or isinstance(default, list) or name in ("required_capture", "manifests",
                                                                                 "scope", "members"):
                out.append((etype, name))
    return out


def test_the_list_fields_are_the_ones_the_spec_names():
    fields = set(_list_fields())
    assert {("artifact_diff", "changed_paths"), ("task_registered", "protected_paths"),
            ("task_registered", "allowed_paths"), ("collection_manifest", "sources"), ("collection_manifest", "routes"),
            ("collection_manifest", "required_capture"), ("checkpoint_trained", "manifests"),
            ("checkpoint_trained", "evaluation_claims"), ("request", "consumed_tool_call_ids"),
            ("execution_closed", "artifact_versions"), ("canary", "scope"), ("batch_consumed", "members"),
            ("checkpoint_trained", "consumer_steps")} <= fields
    assert len(fields) == 23
    assert {t for t, _f in fields} <= set(_BASE)


@pytest.mark.parametrize("etype,field", _list_fields())
@pytest.mark.parametrize("value", ["a.py", "main/task", {"a": 1}, 7])
def test_a_string_where_a_list_is_required_is_refused_naming_the_field(etype, field, value):
    line = {"type": etype, **_BASE[etype], field: value}
    with pytest.raises(ValidationError) as exc:
        validate_line(line, line=3, now_micros=0)
    assert exc.value.field == field and exc.value.line == 3
    assert "list" in exc.value.message or "array" in exc.value.message


def test_changed_paths_string_is_refused_at_ingest(store, tmp_path, capsys):
    f = tmp_path / "diff.jsonl"
    f.write_text(json.dumps(opened("e1")) + "\n" + json.dumps(
        {"type": "artifact_diff", "execution_id": "e1", "artifact_version": "v1", "changed_paths": "a.py"}) + "\n")
    capsys.readouterr()
    assert cli(["ingest", str(f)]) == 2
    assert _err_line(capsys) == ("ledger: refused (nothing appended): line 2: field 'changed_paths': expected a JSON "
                                 "array of paths, got 'a.py'")
    assert _size(store) == 0


def test_a_body_already_on_the_log_keeps_the_earlier_reading():
    """A governance body signed under an earlier release (a string then read as a one-element list,
    an id of any length) still verifies on replay: ``on_log`` re-checks it under those rules."""
    line = {"type": "collection_manifest", **_BASE["collection_manifest"], "sources": "vendor-a",
            "routes": ["r" * 2000]}
    with pytest.raises(ValidationError):
        validate_line(line, now_micros=0)
    ev = validate_line(line, now_micros=0, on_log=True)
    assert ev["sources"] == ["vendor-a"] and ev["routes"] == ["r" * 2000]
    with pytest.raises(ValidationError):  # and the leniency ends with the call
        validate_line(line, now_micros=0)


def test_the_recorder_refuses_a_string_for_a_list(store):
    from ledger.producers.recorder import Recorder

    with open_log(str(store)) as log, Recorder(log) as rec:
        rec.open_execution("e1", "t1", DEADLINE, "p")
        with pytest.raises(ValidationError) as exc:
            rec.record_request("e1", "r1", [1, 2], [3], [-0.5], consumed_tool_call_ids="call_1")
        assert exc.value.field == "consumed_tool_call_ids" and "got the string 'call_1'" in str(exc.value)
        with pytest.raises(ValidationError):
            rec.close_execution("e1", artifact_versions="v1")
    with open_log(str(store)) as log:
        assert log.size() == 1  # the opened execution only


# ------------------------------------------------------------------ identifiers at most 1,024 bytes (item 12)
_ID_CONVERTERS = {V._id, V._id_list, V._subject}


def _id_fields() -> list[tuple[str, str]]:
    return [(t, name) for t, specs in FIELDS.items() for name, conv, _r, _d in specs if conv in _ID_CONVERTERS]


_MORE = {
    "execution_opened": {"execution_id": "e", "task_id": "t", "deadline": DEADLINE, "policy": "p"},
    "tool_payload": {"execution_id": "e", "call_id": "c", "kind": "call", "payload": {}},
    "execution_finalized": {"execution_id": "e"},
    "predicate_evaluated": {"execution_id": "e", "route": "r", "predicate": "p", "verdict": "pass", "verifier": "v"},
    "cost_recorded": {"execution_id": "e", "amount": 1},
    "task_linked": {"task_a": "a", "task_b": "b", "relation": "fork"},
    "task_link_rejected": {"task_a": "a", "task_b": "b"},
    "split_policy": {"policy_id": "p", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}, "salt": "s"},
    "split_reclassified": {"task_id": "t", "reason": "r"},
    "permission": {"subject": "task:t", "use": "rl", "action": "grant", "authority": "a"},
    "withdrawal": {"subject": "task:t", "reason": "r", "authority": "a"},
    "manifest_published": {"route": "r", "version": 1, "route_version": 1, "root": "00", "size": 0, "log_position": 0,
                           "manifest_sha256": "00"},
    "credit_reserved": {"execution_id": "e", "pool": "p", "bytes": 1},
    "credit_released": {"execution_id": "e", "pool": "p", "reason": "disposition"},
    "credit_pool_declared": {"pool": "p", "capacity_bytes": 10, "record_ceiling_bytes": 1, "hard_limit": 1},
    "fault_injected": {"execution_id": "e", "injection_id": "i", "version": "1", "condition": "lost_ack"},
    "production_feedback": {"execution_id": "e", "signal": "accepted"},
    "counterfactual_probe": {"task_id": "t", "probe_id": "p", "rung": "context", "result": "failure_persists"},
    "grader_control": {"execution_id": "e", "evaluator": "g", "kind": "adequate", "expected_verdict": "pass"},
}


def _minimal(etype: str) -> dict:
    return {**_MORE, **_BASE}[etype]


def test_every_event_type_has_a_valid_minimal_line():
    for etype in FIELDS:
        assert validate_line({"type": etype, **_minimal(etype)}, now_micros=0)["event_type"] == etype


def test_every_id_field_of_the_spec_is_bounded():
    fields = set(_id_fields())
    for t, f in [("execution_opened", "execution_id"), ("request", "request_id"), ("execution_opened", "task_id"),
                 ("admission_policy", "route"), ("target_selection", "selection_id"), ("tool_payload", "call_id"),
                 ("permission", "subject"), ("request", "consumed_tool_call_ids"), ("canary", "canary_id"),
                 ("predicate_evaluated", "verifier"), ("checkpoint_trained", "checkpoint_id")]:
        assert (t, f) in fields, (t, f)
    assert len(fields) >= 70


@pytest.mark.parametrize("etype,field", _id_fields())
def test_a_1mb_id_is_refused_in_every_id_field(etype, field):
    conv = dict((n, c) for n, c, _r, _d in FIELDS[etype])[field]
    big = "x" * MB if conv is not V._subject else "task:" + "x" * MB
    line = {"type": etype, **_minimal(etype), field: [big] if conv is V._id_list else big}
    with pytest.raises(ValidationError) as exc:
        validate_line(line, line=1, now_micros=0)
    assert exc.value.field == field and "identifier too long" in exc.value.message
    assert len(str(exc.value)) < 300


@pytest.mark.parametrize("member_id,ok", [("m" * MB, False), ("m" * (3 * MAX_ID_BYTES + 3), False),
                                          ("m" * (3 * MAX_ID_BYTES + 2), True), ("é" * 1538, False),
                                          ("é" * 1537, True), ("r/e/" + "x" * 1000, True)])
def test_a_member_id_in_batch_consumed_is_bounded_like_three_joined_ids(member_id, ok):
    """``batch_consumed.members[].member_id`` is ``route/execution/leaf``: at most three identifiers
    (1,024 bytes each once escaped) and two slashes, 3,074 bytes of UTF-8; the error never echoes it."""
    line = {"type": "batch_consumed", **_BASE["batch_consumed"], "members": [
        {"member_id": "r/e/first", "digest": "0" * 64}, {"member_id": member_id, "digest": "1" * 64}]}
    if ok:
        assert validate_line(line, now_micros=0)["members"][1]["member_id"] == member_id
        return
    with pytest.raises(ValidationError) as exc:
        validate_line(line, line=4, now_micros=0)
    assert exc.value.field == "members" and exc.value.line == 4
    assert exc.value.message.startswith("members[1]: identifier too long: a member id of ")
    assert "the limit is 3,074" in exc.value.message and len(str(exc.value)) < 300


def test_a_member_listed_twice_is_refused_without_echoing_a_long_id():
    big = "m" * 3000
    line = {"type": "batch_consumed", **_BASE["batch_consumed"], "members": [
        {"member_id": big, "digest": "0" * 64}, {"member_id": big, "digest": "1" * 64}]}
    with pytest.raises(ValidationError) as exc:
        validate_line(line, now_micros=0)
    assert exc.value.field == "members" and "listed twice" in exc.value.message and len(str(exc.value)) < 300


@pytest.mark.parametrize("value,ok", [("x" * 1024, True), ("x" * 1025, False), ("/" * 341, True), ("/" * 342, False),
                                      ("é" * 512, True), ("é" * 513, False), ("\x85" * 170, True),
                                      ("\x85" * 171, False), ("日" * 341, True), ("日" * 342, False)])
def test_the_limit_counts_escaped_utf8_bytes(value, ok):
    """``/`` escapes to ``%2F`` (3 bytes), U+0085 to ``%C2%85`` (6), é is 2 UTF-8 bytes, 日 3."""
    assert (id_bytes(value) <= MAX_ID_BYTES) is ok and (id_problem(value) is None) is ok
    line = {"type": "execution_opened", **_minimal("execution_opened"), "execution_id": value}
    if ok:
        assert validate_line(line, now_micros=0)["execution_id"] == value
    else:
        with pytest.raises(ValidationError, match="identifier too long"):
            validate_line(line, now_micros=0)


@given(st.text(max_size=400))
def test_the_fast_accept_never_lets_a_long_id_through(value):
    assert (id_problem(value) is None) == (id_bytes(value) <= MAX_ID_BYTES)


def test_a_1mb_id_is_refused_at_ingest_with_a_short_message(store, tmp_path, capsys):
    f = tmp_path / "big.jsonl"
    f.write_text(json.dumps(opened("e1")) + "\n" + json.dumps(request("x" * MB, "r1", [1], [2])) + "\n")
    capsys.readouterr()
    assert cli(["ingest", str(f)]) == 2
    assert _err_line(capsys) == ("ledger: refused (nothing appended): line 2: field 'execution_id': identifier too "
                                 "long: 1,048,576 bytes escaped (UTF-8), the limit is 1,024")
    assert _size(store) == 0


@pytest.mark.parametrize("argv", [["tree", "{id}"], ["export", "{id}", "--out", "x.jsonl"], ["impact", "task:{id}"],
                                  ["admission", "show", "{id}"], ["export-atif", "{id}", "--out", "-"],
                                  ["cohort", "report", "{id}"]])
def test_cli_arguments_naming_ids_refuse_a_long_one(store, capsys, argv):
    big = "y" * (MAX_ID_BYTES + 1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli([a.replace("{id}", big) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert re.search(r"identifier too long: 1,0[23]\d bytes escaped \(UTF-8\), the limit is 1,024\n$", err)
    assert big not in err


# ------------------------------------------------------------------ a damaged gateway.db (item 9)
@pytest.mark.parametrize("damage", ["garbage", "truncated", "header"])
def test_status_reports_a_damaged_gateway_db_and_prints_the_rest(store, tmp_path, capsys, damage):
    from ledger.gateway.store import connect as _connect, gateway_db_path

    assert cli(["ingest", str(_lines(tmp_path))]) == 0
    path = gateway_db_path(store)
    db = _connect(path)
    db.executemany("INSERT INTO calls VALUES (?, ?, 'extends')", [(f"e{i}", f"r{i}") for i in range(2000)])
    db.commit()
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    capsys.readouterr()
    assert cli(["status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gateway"]["calls"] == 2000
    raw = path.read_bytes()
    path.write_bytes({"garbage": b"\x07not a database\x00" * 64, "truncated": raw[:1500],
                      "header": b"SQLite format 2\x00" + raw[16:]}[damage])
    assert cli(["status", "--json"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["log"]["events"] == 2 and "projections" in doc  # everything else is still there
    assert doc["gateway"] == {"error": doc["problems"][0]}
    assert doc["problems"][0].startswith(f"the capture gateway's database {path} cannot be read")
    assert captured.err.strip() == f"ledger: problem: {doc['problems'][0]}"
    assert cli(["status"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("log: ") and "\ngateway: {\"error\": " in out and "\nproblems: " in out


def _lines(tmp_path: Path) -> Path:
    f = tmp_path / "two.jsonl"
    f.write_text(json.dumps(opened("e1")) + "\n" + json.dumps(closed("e1")) + "\n")
    return f
