"""Identifiers are opaque (SPEC §4.3, §9; issue 13 item 5).

Natural keys escape their components (``%``, ``/``, NUL and control characters become
``%XX``), so execution ``col/b`` request ``c`` and execution ``col`` request ``b/c`` are two
events with two keys; every id without those characters keeps the key it always had (old
logs stay valid).  Ids that become file names (the manifest archive folder of a route) are
percent-encoded, ``..`` escaped, long names cut with a hash suffix: nothing leaves the store.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.algorithms.identifiers import MAX_FILE_NAME, file_name, join_key, key_component, split_key
from ledger.algorithms.tokens import pack_tokens, tokens_sha256
from ledger.cli import main as cli
from ledger.corpus.publish import ARCHIVE_NAME_MAX
from ledger.events.catalog import EVENT_TYPES, key_of, natural_key
from ledger.events.signing import load_private_key, sign_line
from ledger.log import open_log
from ledger.projections.admission import member_id

from ..helpers import closed, opened, request, write_lines




def _lookup(store: Path, key: str):
    with open_log(str(store)) as log:
        return log.lookup(key)


def _index_keys(store: Path) -> list[str]:
    import sqlite3

    db = sqlite3.connect(store / "index.db")
    try:
        return [r[0] for r in db.execute("SELECT natural_key FROM events ORDER BY position")]
    finally:
        db.close()


# ------------------------------------------------------------------ the collision pair
def test_collision_pair_is_two_events_with_two_keys(store, tmp_path, capsys):
    lines = [opened("col/b"), opened("col"), request("col/b", "c", [1, 2], [3]), request("col", "b/c", [5, 6], [7])]
    capsys.readouterr()
    assert cli(["ingest", write_lines(tmp_path / "pair.jsonl", lines)]) == 0
    assert capsys.readouterr().out.startswith("appended 4, duplicate 0, conflicting 0")
    a = key_of("request", execution_id="col/b", request_id="c")
    b = key_of("request", execution_id="col", request_id="b/c")
    assert (a, b) == ("request/col%2Fb/c", "request/col/b%2Fc")
    assert _index_keys(store) == ["execution_opened/col%2Fb", "execution_opened/col", a, b]
    ra, rb = _lookup(store, a), _lookup(store, b)
    assert (ra.event_id, rb.event_id, ra.offset, rb.offset) == (a, b, 2, 3)
    assert _lookup(store, "request/col/b/c") is None  # the old, ambiguous key names neither
    # a retry of the whole file: both are duplicates of themselves, no conflict between them
    capsys.readouterr()
    assert cli(["ingest", str(tmp_path / "pair.jsonl")]) == 0
    assert capsys.readouterr().out.startswith("appended 0, duplicate 4, conflicting 0")


@pytest.mark.parametrize("same_batch", [True, False], ids=["same-batch", "from-the-log"])
def test_prefix_reference_resolves_within_its_own_execution(store, tmp_path, capsys, same_batch):
    """Execution ``col`` references its request ``b/c``; execution ``col/b`` has a request ``c``
    with other tokens.  The reference must be checked against ``col``'s ``b/c`` only."""
    base = [opened("col"), opened("col/b"), request("col", "b/c", [1, 2, 3], [4]),
            request("col/b", "c", [9, 9, 9], [9])]
    def ref(ex, rid, toks):
        line = request(ex, rid, [], [8], input_prefix={"request_id": "b/c", "length": 4,
                                                        "sha256": tokens_sha256(pack_tokens(toks))}, input_suffix_ids=[5])
        del line["input_ids"]
        return line

    good = ref("col", "next", [1, 2, 3, 4])
    wrong = ref("col", "next", [9, 9, 9, 9])  # the tokens of col/b's c: must not verify
    if not same_batch:
        assert cli(["ingest", write_lines(tmp_path / "base.jsonl", base)]) == 0
        base = []
    capsys.readouterr()
    assert cli(["ingest", write_lines(tmp_path / "wrong.jsonl", base + [wrong])]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ledger: refused (nothing appended): line {len(base) + 1}: field 'input_prefix': sha256 of the first 4 "
        "tokens of request 'b/c' does not match")
    assert cli(["ingest", write_lines(tmp_path / "good.jsonl", base + [good])]) == 0
    assert _lookup(store, "request/col/next") is not None
    # from col/b the same reference names a request col/b does not have
    capsys.readouterr()
    assert cli(["ingest", write_lines(tmp_path / "other.jsonl", [ref("col/b", "next", [1, 2, 3, 4])])]) == 2
    assert capsys.readouterr().err.strip() == (
        "ledger: refused (nothing appended): line 1: field 'input_prefix': prefix reference to unknown request "
        "'b/c' of execution 'col/b'")


# ------------------------------------------------------------------ awkward ids end to end
EXECUTIONS = ["col/b", "col", "..", "../../etc", "nul\x00id", "100%", "%2F", "ü/日本", "x" * 300]
ROUTES = ["..", "a/b", "r" * 300, "p%\x00é", "plain-route"]


def _world(key) -> list[dict]:
    lines = [{"type": "task_registered", "task_id": "t/..", "fixture": "fx@1", "family": "f", "source": "s/rc"}]
    for ex in EXECUTIONS:
        lines += [opened(ex, "t/.."), request(ex, "r/1", [1, 2, 3], [4, 5]), request(ex, "..", [1, 2, 3, 4, 5, 6], [7, 8]),
                  {"type": "tool_payload", "execution_id": ex, "call_id": "c/1", "kind": "call", "payload": {"a": 1}},
                  {"type": "tool_payload", "execution_id": ex, "call_id": "c", "kind": "call", "payload": {"a": 2}},
                  closed(ex),
                  {"type": "assessment", "assessment_id": "a/1", "execution_id": ex, "artifact_version": "v1",
                   "outcome": "scored", "reward": 1.0, "evaluator": "grader@1"}]
    gov = [{"type": "split_policy", "policy_id": "sp/1", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
            "salt": "s"},
           {"type": "permission", "subject": "source:s/rc", "use": "rl", "action": "grant", "authority": "gov"}]
    gov += [{"type": "admission_policy", "route": r, "version": 1, "use": "rl", "split": "train", "j_max": 4}
            for r in ROUTES]
    return lines + [sign_line(l, key) for l in gov]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_awkward_ids_ingest_project_export_publish_inside_the_store(store, tmp_path, capsys):
    key = load_private_key(tmp_path / "gov.key")
    world = _world(key)
    assert cli(["ingest", write_lines(tmp_path / "world.jsonl", world)]) == 0
    assert cli(["project"]) == 0
    capsys.readouterr()
    outside_before = {p.name for p in tmp_path.iterdir()}
    for i, route in enumerate(ROUTES):
        assert cli(["export", route, "--out", str(tmp_path / f"e{i}.jsonl")]) == 0
        records = [json.loads(l) for l in (tmp_path / f"e{i}.jsonl").read_text().splitlines()]
        assert sorted(r["execution_id"] for r in records) == sorted(EXECUTIONS)  # one leaf (r/1 -> ..) each
        assert {r["leaf_request_id"] for r in records} == {".."}
        assert sorted(r["member_id"] for r in records) == sorted(member_id(route, ex, "..") for ex in EXECUTIONS)
        assert len({r["member_id"] for r in records}) == len(EXECUTIONS)
        assert cli(["manifest", "publish", route, "--key", str(tmp_path / "gov.key"),
                    "--out", str(tmp_path / f"m{i}.json")]) == 0
    capsys.readouterr()
    assert cli(["manifest", "verify", "--deep", str(tmp_path / "m1.json")]) == 0
    # every archive sits one folder below <store>/manifests, named by the escaping rule
    archives = sorted(p.relative_to(store / "manifests").as_posix() for p in (store / "manifests").rglob("*")
                      if p.is_file())
    assert archives == sorted(f"{file_name(r, ARCHIVE_NAME_MAX)}/v1.json" for r in ROUTES)
    assert sorted(file_name(r, ARCHIVE_NAME_MAX) for r in ROUTES) == sorted(
        ["%2E%2E", "a%2Fb", "r" * 221 + "%~" + __import__("hashlib").sha256(b"r" * 300).hexdigest()[:32],
         "p%25%00%C3%A9", "plain-route"])
    assert all(len(a.split("/")[0]) <= ARCHIVE_NAME_MAX for a in archives)
    # nothing was written outside the store but the named outputs, and no temporary is left
    made = {p.name for p in tmp_path.iterdir()} - outside_before
    assert made == {f"{s}{i}{x}" for i in range(len(ROUTES)) for s, x in (("e", ".jsonl"), ("m", ".json"),
                                                                           ("m", ".croissant.json"))}
    assert not [f for f in _files(tmp_path) if f.endswith(".tmp")]
    assert not (tmp_path / "v1.json").exists() and not (store / "v1.json").exists()
    # tool payloads c/1 and c of one execution are two events
    assert _lookup(store, key_of("tool_payload", execution_id="col", call_id="c/1", kind="call")).offset != \
        _lookup(store, key_of("tool_payload", execution_id="col", call_id="c", kind="call")).offset


def test_failed_publish_of_a_long_route_leaves_no_temporary(store, tmp_path, capsys):
    """The archive folder cannot be made (a file is in the way): exit 2, one line, nothing
    written beside --out, no .tmp anywhere, nothing appended."""
    key = load_private_key(tmp_path / "gov.key")
    route = "q" * 300
    assert cli(["ingest", write_lines(tmp_path / "w.jsonl", [sign_line(
        {"type": "split_policy", "policy_id": "sp", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
         "salt": "s"}, key), sign_line({"type": "admission_policy", "route": route, "version": 1, "use": "rl",
                                        "split": "train", "j_max": 4}, key)])]) == 0
    (store / "manifests").mkdir()
    (store / "manifests" / file_name(route, ARCHIVE_NAME_MAX)).write_text("in the way")
    with open_log(str(store)) as log:
        size = log.size()
    capsys.readouterr()
    code = cli(["manifest", "publish", route, "--key", str(tmp_path / "gov.key"), "--out", str(tmp_path / "m.json")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "m.croissant.json").exists()
    assert not [f for f in _files(tmp_path) if f.endswith(".tmp")]
    with open_log(str(store)) as log:
        assert log.size() == size


# ------------------------------------------------------------------ old keys stay valid
def _old_key(ev: dict) -> str:
    """The catalog's rule before escaping (components joined with '/' as they were)."""
    t = ev["event_type"]
    if t == "withdrawal":
        return f"withdrawal/{ev['subject']}" + ("/erase" if ev.get("erase") else "")
    if t in ("task_linked", "task_link_rejected"):
        return "/".join([t, *sorted((ev["task_a"], ev["task_b"]))])
    return None  # the generic types are checked field by field below


# (event type, fields, the key the release before this change produced for them)
OLD_KEYS = [
    ("execution_opened", {"execution_id": "e1"}, "execution_opened/e1"),
    ("request", {"execution_id": "e1", "request_id": "r1"}, "request/e1/r1"),
    ("request", {"execution_id": "exéc 日本", "request_id": "r.1-x"}, "request/exéc 日本/r.1-x"),
    ("tool_payload", {"execution_id": "e1", "call_id": "call_1", "kind": "result"}, "tool_payload/e1/call_1/result"),
    ("execution_closed", {"execution_id": "e1"}, "execution_closed/e1"),
    ("assessment", {"execution_id": "e1", "assessment_id": "a1"}, "assessment/e1/a1"),
    ("execution_finalized", {"execution_id": "e1"}, "execution_finalized/e1"),
    ("target_selection", {"execution_id": "e1", "selection_id": "s1"}, "target_selection/e1/s1"),
    ("predicate_evaluated", {"execution_id": "e1", "route": "rl", "predicate": "p", "verifier": "v@1",
                             "verdict": "pass"}, "predicate_evaluated/e1/rl/p/v@1/pass"),
    ("task_registered", {"task_id": "t1"}, "task_registered/t1"),
    ("task_linked", {"task_a": "tb", "task_b": "ta"}, "task_linked/ta/tb"),
    ("split_policy", {"policy_id": "sp1"}, "split_policy/sp1"),
    ("split_reclassified", {"task_id": "t1"}, "split_reclassified/t1"),
    ("record_derived", {"derived_execution_id": "d1"}, "record_derived/d1"),
    ("withdrawal", {"subject": "source:s1", "erase": True}, "withdrawal/source:s1/erase"),
    ("withdrawal", {"subject": "task:t1", "erase": False}, "withdrawal/task:t1"),
    ("admission_policy", {"route": "rl-main", "version": 3}, "admission_policy/rl-main/3"),
    ("manifest_published", {"route": "rl-main", "version": 2}, "manifest_published/rl-main/2"),
    ("credit_reserved", {"pool": "pool1", "execution_id": "e1"}, "credit_reserved/pool1/e1"),
]


@pytest.mark.parametrize("etype,fields,old", OLD_KEYS, ids=[f"{t}-{i}" for i, (t, _, _) in enumerate(OLD_KEYS)])
def test_plain_ids_keep_their_old_keys_byte_for_byte(etype, fields, old):
    assert natural_key({"event_type": etype, **fields}).encode("utf-8") == old.encode("utf-8")


def test_content_keyed_types_keep_their_old_keys():
    """cost_recorded / permission: named fields + 16 hex of the content, as before."""
    import hashlib

    from ledger.events.catalog import HEADER_FIELDS

    def old(prefix, ev, *fields):
        content = sorted((k, v) for k, v in ev.items() if k not in HEADER_FIELDS and not isinstance(v, bytes))
        return "/".join([prefix, *(str(ev[f]) for f in fields), hashlib.sha256(repr(content).encode()).hexdigest()[:16]])

    cost = {"event_type": "cost_recorded", "execution_id": "e1", "amount": 1.5, "category": "generation",
            "currency": "USD"}
    perm = {"event_type": "permission", "subject": "source:s1", "use": "rl", "action": "grant", "authority": "gov"}
    assert natural_key(cost) == old("cost_recorded", cost, "execution_id")
    assert natural_key(perm) == old("permission", perm, "subject", "use", "action")
    assert natural_key(perm).startswith("permission/source:s1/rl/grant/")


_PLAIN = st.text(st.characters(blacklist_characters="%/", blacklist_categories=("Cc", "Cs")), min_size=1, max_size=20)


@settings(max_examples=300, deadline=None)
@given(ex=_PLAIN, rid=_PLAIN, call=_PLAIN, task_a=_PLAIN, task_b=_PLAIN, subject=_PLAIN, erase=st.booleans())
def test_property_ids_without_special_characters_keep_the_old_rule(ex, rid, call, task_a, task_b, subject, erase):
    assert natural_key({"event_type": "request", "execution_id": ex, "request_id": rid}) == f"request/{ex}/{rid}"
    assert natural_key({"event_type": "tool_payload", "execution_id": ex, "call_id": call, "kind": "call"}) == \
        f"tool_payload/{ex}/{call}/call"
    for ev in ({"event_type": "task_linked", "task_a": task_a, "task_b": task_b},
               {"event_type": "withdrawal", "subject": subject, "erase": erase}):
        assert natural_key(ev) == _old_key(ev)
    assert member_id("rl", ex, rid) == f"rl/{ex}/{rid}"


def test_a_store_ingested_with_plain_ids_keeps_its_keys(store, tmp_path, capsys):
    """The keys in the index are the pre-escaping strings, lookups by them work, and a retry of
    the same file is all duplicates (an old log's events keep their identity)."""
    lines = [opened("e1"), request("e1", "r1", [1, 2], [3]), request("e1", "r2", [1, 2, 3, 4], [5]), closed("e1")]
    assert cli(["ingest", write_lines(tmp_path / "old.jsonl", lines)]) == 0
    assert _index_keys(store) == ["execution_opened/e1", "request/e1/r1", "request/e1/r2", "execution_closed/e1"]
    assert _lookup(store, "request/e1/r2").event_id == "request/e1/r2"
    capsys.readouterr()
    assert cli(["ingest", str(tmp_path / "old.jsonl")]) == 0
    assert capsys.readouterr().out.startswith("appended 0, duplicate 4, conflicting 0")


# ------------------------------------------------------------------ properties of the escaping
_ANY = st.text(max_size=40)


@settings(max_examples=500, deadline=None)
@given(a=st.tuples(_ANY, _ANY), b=st.tuples(_ANY, _ANY))
def test_property_distinct_execution_request_pairs_never_share_a_key(a, b):
    ka = natural_key({"event_type": "request", "execution_id": a[0], "request_id": a[1]})
    kb = natural_key({"event_type": "request", "execution_id": b[0], "request_id": b[1]})
    assert (ka == kb) == (a == b)
    assert split_key(ka) == ["request", *a]


@settings(max_examples=300, deadline=None)
@given(a=st.text(alphabet="/%ab\x00.", max_size=8), b=st.text(alphabet="/%ab\x00.", max_size=8),
       c=st.text(alphabet="/%ab\x00.", max_size=8))
def test_property_small_alphabet_collisions(a, b, c):
    """Dense alphabet of the dangerous characters: (a/b, c) vs (a, b/c) style pairs."""
    keys = {join_key("request", a + "/" + b, c), join_key("request", a, b + "/" + c)}
    assert len(keys) == 2
    assert _KEYS_OK(join_key("request", a, b))


def _KEYS_OK(key: str) -> bool:
    return "\x00" not in key and key.count("/") == 2


@settings(max_examples=500, deadline=None)
@given(a=st.text(max_size=300), b=st.text(max_size=300))
def test_property_file_names_are_safe_and_distinct(a, b):
    for cap in (MAX_FILE_NAME, ARCHIVE_NAME_MAX, 40):
        for s in (a, b):
            name = file_name(s, cap)
            assert name not in ("", ".", "..") and "/" not in name and "\x00" not in name
            assert len(name.encode("utf-8")) <= cap
            assert name.isascii()
        assert (file_name(a, cap) == file_name(b, cap)) == (a == b)


@settings(max_examples=300, deadline=None)
@given(s=st.text(max_size=120))
def test_property_file_names_are_unchanged_for_existing_archives(s):
    """Every archive folder name that worked before (urllib quote, safe='', at most 255 bytes) is
    kept, except '.', '..' (which escaped the folder) and '' (never a valid route)."""
    old = urllib.parse.quote(s, safe="")
    if old not in ("", ".", "..") and len(old) <= ARCHIVE_NAME_MAX:
        assert file_name(s, ARCHIVE_NAME_MAX) == old


def test_key_component_examples():
    assert [key_component(x) for x in ("r1", "a/b", "50%", "nul\x00", "tab\t", "ü", "..", 7)] == \
        ["r1", "a%2Fb", "50%25", "nul%00", "tab%09", "ü", "..", "7"]
    assert [file_name(x) for x in (".", "..", "", "a b", "rl-main")] == ["%2E", "%2E%2E", "%", "a%20b", "rl-main"]
