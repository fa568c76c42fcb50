"""Readers terminate and validate (issue 27 item 10, SPEC §11.5, §11.7).

The attacks of the review, each on a real export of a published route: a tree export whose
nodes form a parent cycle (the reader looped until memory ran out), records edited against
their own rules with the digest recomputed (a mask shorter than the tokens, a NaN or negative
weight, a weight other than 1/L_i, targets outside the path, ...), and a 58-record file read
for a 57-member manifest (accepted).  Each is refused with a typed error: one ``except
ledger.DigestMismatch`` catches every digest and member-set failure, one ``except
ledger.RecordError`` every structural one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ledger
from ledger.cli import main as cli
from ledger.corpus import manifest as M
from ledger.corpus.export import member_digest, read_records, records_from_tree_doc
from ledger.corpus.packed import read_packed
from ledger.corpus.records import check_tree_doc, digest_with_lists
from ledger.events.signing import load_private_key, sign_line

from ..helpers import closed, opened, request

ROUTE = "rl-main"
EXECUTIONS = 56  # e00 has two leaves, the others one: 57 members


def _world(key) -> list[dict]:
    lines = [{"type": "task_registered", "task_id": "t1", "fixture": "fx@1", "family": "f", "source": "src"}]
    for i in range(EXECUTIONS):
        ex = f"e{i:02d}"
        lines += [opened(ex, "t1"), request(ex, "r1", [1, 2, 3], [4, 5]), request(ex, "r2", [1, 2, 3, 4, 5, 6], [7, 8])]
        if i == 0:  # a second branch from the same prompt: two leaves share the root
            lines.append(request(ex, "r3", [1, 2, 3], [9, 9, 9]))
        lines += [closed(ex), {"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
                               "outcome": "scored", "reward": 1.0, "evaluator": "grader@1"}]
    gov = [{"type": "split_policy", "policy_id": "sp1", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
            "salt": "s"},
           {"type": "permission", "subject": "source:src", "use": "rl", "action": "grant", "authority": "gov"},
           {"type": "admission_policy", "route": ROUTE, "version": 1, "use": "rl", "split": "train", "j_max": 4}]
    return lines + [sign_line(line, key) for line in gov]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A projected store, the route's manifest (57 members) and its export in every format."""
    root = tmp_path_factory.mktemp("readers")
    store = ["--store", str(root / "store")]
    assert cli([*store, "init"]) == 0
    assert cli([*store, "keys", "new", "--out", str(root / "gov.key")]) == 0
    world = root / "world.jsonl"
    world.write_text("".join(json.dumps(line) + "\n" for line in _world(load_private_key(root / "gov.key"))))
    assert cli([*store, "ingest", str(world)]) == 0
    assert cli([*store, "project"]) == 0
    assert cli([*store, "manifest", "publish", ROUTE, "--key", str(root / "gov.key"), "--out", str(root / "m.json")]) == 0
    for fmt, name in (("jsonl", "r.jsonl"), ("parquet", "r.parquet"), ("tree", "r.tree.jsonl"), ("packed", "p.jsonl"),
                      ("packed-parquet", "p.parquet")):
        assert cli([*store, "export", ROUTE, "--out", str(root / name), "--format", fmt]) == 0
    return root


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, docs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return path


def _redigest(rec: dict) -> dict:
    rec["digest"] = member_digest(rec)
    return rec


def test_the_untouched_export_reads_in_every_format_against_its_manifest(corpus):
    manifest = corpus / "m.json"
    doc = json.loads(manifest.read_text())
    assert len(doc["members"]) == 57
    want = sorted(m["member_id"] for m in doc["members"])
    for name in ("r.jsonl", "r.parquet", "r.tree.jsonl"):
        assert sorted(r["member_id"] for r in read_records(corpus / name, manifest=manifest)) == want
        assert len(list(read_records(corpus / name, manifest=doc))) == 57  # the document itself works too
    for name in ("p.jsonl", "p.parquet"):
        assert sorted(m["member_id"] for r in read_packed(corpus / name, manifest=manifest) for m in r["members"]) == want


# ------------------------------------------------------------------ the member set (58 records, 57 members)
def test_a_58_record_file_for_a_57_member_manifest_is_refused(corpus, tmp_path):
    recs = _lines(corpus / "r.jsonl")
    bad = _write(tmp_path / "58.jsonl", recs + [recs[17]])  # one record twice: 58 records
    with pytest.raises(ledger.MemberSetMismatch, match=f"member {recs[17]['member_id']} appears twice") as got:
        list(read_records(bad, manifest=corpus / "m.json"))
    assert got.value.kind == "duplicate" and isinstance(got.value, ledger.DigestMismatch)
    with pytest.raises(ledger.MemberSetMismatch, match="appears twice"):  # a duplicate needs no manifest
        list(read_records(bad))
    # the manifest module's own reader refuses it too (it took the 58 before)
    with pytest.raises(M.ManifestMemberSetMismatch, match="appears twice"):
        list(M.iter_verified_records(json.loads((corpus / "m.json").read_text()), recs + [recs[17]]))


def test_a_missing_member_is_named_at_the_end(corpus, tmp_path):
    recs = _lines(corpus / "r.jsonl")
    short = _write(tmp_path / "56.jsonl", recs[:20] + recs[21:])
    got = []
    with pytest.raises(ledger.MemberSetMismatch, match=f"1 member\\(s\\) of manifest {ROUTE} v1 missing .* "
                                                       f"first {recs[20]['member_id']}") as exc:
        got.extend(read_records(short, manifest=corpus / "m.json"))
    assert exc.value.kind == "missing" and len(got) == 56
    assert len(list(read_records(short))) == 56  # without a manifest a shard is a shard


def test_an_extra_member_or_another_digest_is_refused(corpus, tmp_path):
    recs = _lines(corpus / "r.jsonl")
    extra = _redigest(dict(recs[5], member_id=f"{ROUTE}/e99/r2", execution_id="e99"))
    with pytest.raises(ledger.MemberSetMismatch, match=f"member {ROUTE}/e99/r2 is not a member of manifest") as exc:
        list(read_records(_write(tmp_path / "x.jsonl", recs + [extra]), manifest=corpus / "m.json"))
    assert exc.value.kind == "extra"
    edited = _redigest(dict(recs[3], input_ids=[1, 2, 3, 4, 5, 6, 7, 9]))  # a token changed, digest recomputed
    with pytest.raises(ledger.DigestMismatch, match="publishes") as exc:
        list(read_records(_write(tmp_path / "y.jsonl", recs[:3] + [edited] + recs[4:]), manifest=corpus / "m.json"))
    assert not isinstance(exc.value, ledger.MemberSetMismatch)


def test_packed_members_against_the_manifest(corpus, tmp_path):
    recs = _lines(corpus / "p.jsonl")
    with pytest.raises(ledger.PackedRecordError, match="execution e03 has a second record"):
        list(read_packed(_write(tmp_path / "dup.jsonl", recs + [recs[3]]), manifest=corpus / "m.json"))
    with pytest.raises(ledger.MemberSetMismatch, match="missing"):
        list(read_packed(_write(tmp_path / "short.jsonl", recs[1:]), manifest=corpus / "m.json"))
    other = _redigest(dict(recs[4], execution_id="e99", members=[dict(recs[4]["members"][0], member_id=f"{ROUTE}/e99/r2")]))
    with pytest.raises(ledger.MemberSetMismatch, match="not a member"):
        list(read_packed(_write(tmp_path / "extra.jsonl", recs + [other]), manifest=corpus / "m.json"))
    moved = _redigest(dict(recs[4], execution_id="e99"))  # e04's member under another execution: a duplicate member
    with pytest.raises(ledger.MemberSetMismatch, match="appears twice"):
        list(read_packed(_write(tmp_path / "moved.jsonl", recs + [moved])))


# ------------------------------------------------------------------ structural edits, digest recomputed
def _set(key, value):
    return lambda r: r.__setitem__(key, value)


PATH_EDITS = {
    "a mask shorter than the tokens": (lambda r: r["target_mask"].pop(), "target_mask has 7 entries for 8 tokens"),
    "targets outside the path": (lambda r: r["target_mask"].append(1), "target_mask has 9 entries for 8 tokens"),
    "a NaN loss weight": (_set("loss_weight", float("nan")), "loss_weight nan is not 1/L_i"),
    "a negative loss weight": (_set("loss_weight", -0.5), "loss_weight -0.5 is not 1/L_i"),
    "a weight other than 1/L_i": (_set("loss_weight", 0.125), "loss_weight 0.125 is not 1/L_i"),
    "more targets than L_i": (_set("target_mask", [1] * 8), "8 targets exceed execution_target_tokens 4"),
    "a mask of twos": (lambda r: r["target_mask"].__setitem__(0, 2), "target_mask must be a list of 0/1 integers"),
    "a boolean in the mask": (lambda r: r["target_mask"].__setitem__(0, True), "target_mask must be a list of 0/1"),
    "behavior_logprobs one longer": (lambda r: r["behavior_logprobs"].append(None),
                                     "behavior_logprobs has 9 entries for 8 tokens"),
    "a positive log-prob": (lambda r: r["behavior_logprobs"].__setitem__(-1, 0.5), "holds a positive log-prob"),
    "a NaN log-prob": (lambda r: r["behavior_logprobs"].__setitem__(-1, float("nan")), "finite numbers or null"),
    "an infinite log-prob": (lambda r: r["behavior_logprobs"].__setitem__(-1, float("-inf")), "finite numbers or null"),
    "a log-prob beyond float32": (lambda r: r["behavior_logprobs"].__setitem__(-1, -1e39), "not finite as float32"),
    "a token id of 2^32": (lambda r: r["input_ids"].__setitem__(0, 2**32), "input_ids holds a token id >= 2\\^32"),
    "a negative token id": (lambda r: r["input_ids"].__setitem__(0, -1), "input_ids must be a list of non-negative"),
    "a string token": (lambda r: r["input_ids"].__setitem__(0, "1"), "input_ids must be a list of non-negative"),
    "nested token lists": (lambda r: r["input_ids"].__setitem__(0, [1]), "input_ids must be a list of non-negative"),
    "a string for a list": (_set("input_ids", "12345678"), "input_ids must be a list of non-negative"),
    "L_i a string": (_set("execution_target_tokens", "2"), "execution_target_tokens '2' is not a non-negative integer"),
    "a NaN reward": (_set("reward", float("nan")), "reward nan is not a finite number"),
    "a path marked dummy": (_set("dummy", True), "a dummy record has no tokens"),
    "an unknown role class": (_set("role_class", "teacher"), "role_class of"),
    "an unknown field": (_set("weights", [1]), "unexpected field 'weights'"),
    "a missing field": (lambda r: r.pop("reward"), "missing \\['reward'\\]"),
}


@pytest.mark.parametrize("edit", sorted(PATH_EDITS))
def test_a_path_record_against_its_own_rules_is_refused(corpus, tmp_path, edit):
    recs = _lines(corpus / "r.jsonl")
    i = next(i for i, r in enumerate(recs) if r["execution_id"] == "e05")
    how, message = PATH_EDITS[edit]
    how(recs[i])
    bad = _write(tmp_path / "bad.jsonl", recs[:i] + [_redigest(recs[i])] + recs[i + 1:])
    with pytest.raises(ledger.RecordError, match=f"bad.jsonl:{i + 1}: member {ROUTE}/e05/r2: .*{message}") as exc:
        list(read_records(bad))
    assert not isinstance(exc.value, ledger.DigestMismatch)


def test_the_records_of_one_execution_must_agree_on_l_i(corpus, tmp_path):
    recs = _lines(corpus / "r.jsonl")
    first, second = [i for i, r in enumerate(recs) if r["execution_id"] == "e00"]
    big_l = recs[first]["execution_target_tokens"]
    recs[second].update(execution_target_tokens=big_l + 1, loss_weight=1.0 / (big_l + 1))
    _redigest(recs[second])  # each record alone is self-consistent (weight = 1/its L_i)
    with pytest.raises(ledger.RecordError, match=f"execution e00: execution_target_tokens {big_l + 1} differs from "
                                                 f"{big_l}"):
        list(read_records(_write(tmp_path / "l.jsonl", recs)))


def test_given_the_manifest_the_targets_of_an_execution_sum_to_l_i(corpus, tmp_path):
    recs = _lines(corpus / "r.jsonl")
    i = next(i for i, r in enumerate(recs) if r["execution_id"] == "e07")
    recs[i].update(execution_target_tokens=5, loss_weight=1.0 / 5)  # 4 targets, L_i claimed 5
    _redigest(recs[i])
    bad = _write(tmp_path / "sum.jsonl", recs)
    assert len(list(read_records(bad))) == 57  # alone it cannot be told from a shard ...
    with pytest.raises(ledger.DigestMismatch):  # ... against the manifest its digest is not the published one
        list(read_records(bad, manifest=corpus / "m.json"))
    doc = json.loads((corpus / "m.json").read_text())
    for m in doc["members"]:  # a manifest re-issued over the edited records: the sum of targets gives it away
        if m["member_id"] == recs[i]["member_id"]:
            m["digest"] = recs[i]["digest"]
    with pytest.raises(ledger.RecordError, match="execution e07: its records hold 4 targets, L_i is 5"):
        list(read_records(bad, manifest=doc))


def test_a_parquet_record_against_its_rules_is_refused(corpus, tmp_path):
    from ledger.corpus.export import write_parquet

    recs = list(read_records(corpus / "r.parquet"))
    recs[2]["target_mask"] = recs[2]["target_mask"][:-1]  # a mask shorter than the tokens
    recs[2] = _redigest(recs[2])
    write_parquet(recs, tmp_path / "bad.parquet")
    with pytest.raises(ledger.RecordError, match="bad.parquet row 3: member .*: target_mask has 7 entries for 8 tokens"):
        list(read_records(tmp_path / "bad.parquet"))


# ------------------------------------------------------------------ tree exports
def _tree_doc(corpus: Path, ex: str) -> tuple[list[dict], int]:
    docs = _lines(corpus / "r.tree.jsonl")
    return docs, next(i for i, d in enumerate(docs) if d["execution_id"] == ex)


@pytest.mark.timeout(60)
def test_a_tree_whose_parents_form_a_cycle_ends_in_an_error(corpus, tmp_path):
    docs, i = _tree_doc(corpus, "e00")
    nodes = docs[i]["nodes"]
    assert len(nodes) == 4 and nodes[0]["parent"] is None
    nodes[0]["parent"] = nodes[1]["node_id"]  # the root's parent is its own child: every chain loops
    with pytest.raises(ledger.RecordError, match=f"cyclic.jsonl:{i + 1}: the parents of node 0 form a cycle"):
        list(read_records(_write(tmp_path / "cyclic.jsonl", docs)))
    nodes[0]["parent"] = nodes[0]["node_id"]  # a node its own parent
    with pytest.raises(ledger.RecordError, match="form a cycle"):
        list(read_records(_write(tmp_path / "self.jsonl", docs)))


TREE_EDITS = {
    "a parent not in the tree": (lambda d: d["nodes"][1].__setitem__("parent", 99), "has parent 99, which is not in"),
    "two nodes with one id": (lambda d: d["nodes"][2].__setitem__("node_id", d["nodes"][1]["node_id"]), "ids unique"),
    "a leaf on no node": (lambda d: d["leaves"][0].__setitem__("node_id", 99), "which is not in the tree"),
    "a target list one short": (lambda d: d["nodes"][1]["target"].pop(), "lists of one length"),
    "a weight off its target": (lambda d: d["nodes"][2]["weight"].reverse(), "weight is not loss_weight on its targets"),
    "a NaN weight": (lambda d: d["nodes"][1]["weight"].__setitem__(-1, float("nan")), "weight is not loss_weight"),
    "a nested target": (lambda d: d["nodes"][2]["target"].__setitem__(0, [0]), "node 2: target must be a list of 0/1"),
    "a target of 2": (lambda d: d["nodes"][3]["target"].__setitem__(0, 2), "node 3: target must be a list of 0/1"),
    "nodes not a list": (lambda d: d.__setitem__("nodes", {}), "nodes and leaves must be lists"),
    "an unknown field": (lambda d: d.__setitem__("extra", 1), "unexpected field 'extra'"),
}


@pytest.mark.parametrize("edit", sorted(TREE_EDITS))
def test_a_tree_line_against_its_own_rules_is_refused(corpus, tmp_path, edit):
    docs, i = _tree_doc(corpus, "e00")
    how, message = TREE_EDITS[edit]
    how(docs[i])
    with pytest.raises(ledger.RecordError, match=message):
        list(read_records(_write(tmp_path / "t.jsonl", docs)))


def test_a_tree_leaf_rebuilt_against_the_rules_is_refused(corpus, tmp_path):
    """A node's tokens changed and the leaf digests recomputed: the rebuilt records are checked
    as path records (here a token id beyond uint32)."""
    docs, i = _tree_doc(corpus, "e00")
    docs[i]["nodes"][0]["tokens"][0] = 2**32
    for leaf, rec in zip(sorted(docs[i]["leaves"], key=lambda lf: lf["member_id"]),
                         records_from_tree_doc(docs[i], verify=False)):
        leaf["digest"] = member_digest(rec)
    with pytest.raises(ledger.RecordError, match="input_ids holds a token id >= 2\\^32"):
        list(read_records(_write(tmp_path / "t.jsonl", docs)))


# ------------------------------------------------------------------ packed records
PACKED_EDITS = {
    "weights other than 1/L_i": (lambda r: [t.__setitem__(2, 0.5) for t in r["targets"]], "are not 1/L_i = 1/4"),
    "one weight changed": (lambda r: r["targets"][0].__setitem__(2, 0.125), "are not 1/L_i"),
    "a NaN weight": (lambda r: r["targets"][0].__setitem__(2, float("nan")), "target weight nan is not in"),
    "a target outside the sequence": (lambda r: r["targets"][-1].__setitem__(0, 10**6), "target index outside"),
    "a token id of 2^32": (lambda r: r["input_ids"].__setitem__(0, 2**32), "input_ids holds a token id >= 2\\^32"),
    "a string position": (lambda r: r["position_ids"].__setitem__(0, "0"), "position_ids must be a list of non-neg"),
}


@pytest.mark.parametrize("edit", sorted(PACKED_EDITS))
def test_a_packed_record_against_its_own_rules_is_refused(corpus, tmp_path, edit):
    recs = _lines(corpus / "p.jsonl")
    how, message = PACKED_EDITS[edit]
    how(recs[5])
    _redigest(recs[5])
    with pytest.raises(ledger.PackedRecordError, match=f"p.jsonl:6: execution e05: .*{message}") as exc:
        list(read_packed(_write(tmp_path / "p.jsonl", recs)))
    assert isinstance(exc.value, ledger.RecordError) and not isinstance(exc.value, ledger.DigestMismatch)


# ------------------------------------------------------------------ preference pairs
def _pair(**edit) -> dict:
    rec = {"member_id": "dpo/t1/0", "execution_ids": ["e1", "e2"], "task_id": "t1", "group_id": "t1", "split": "train",
           "route": "dpo", "prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6], "chosen_logprobs": [-0.5, None],
           "rejected_logprobs": [-0.25], "chosen_reward": 1.0, "rejected_reward": 0.0, "criterion": "reward",
           "lineage": {"semantics": 3}, "rejected_lineage": {"semantics": 3}}
    rec.update(edit)
    return _redigest(rec)


PAIR_EDITS = {
    "chosen log-probs one short": ({"chosen_logprobs": [-0.5]}, "chosen_logprobs has 1 entries for 2 tokens"),
    "rejected log-probs one long": ({"rejected_logprobs": [-0.25, None]}, "rejected_logprobs has 2 entries for 1"),
    "a positive log-prob": ({"chosen_logprobs": [0.5, None]}, "chosen_logprobs holds a positive log-prob"),
    "a string for the prompt": ({"prompt_ids": "123"}, "prompt_ids must be a list of non-negative integers"),
    "one execution": ({"execution_ids": ["e1"]}, "execution_ids must be \\[chosen, rejected\\]"),
    "not the longest common prefix": ({"rejected_ids": [4]}, "not the longest common prefix"),
    "a mask of another length": ({"chosen_mask": [1]}, "chosen_mask has 1 entries for 2 tokens"),
    "a NaN reward": ({"chosen_reward": float("nan")}, "chosen_reward is not a finite number"),
}


@pytest.mark.parametrize("edit", sorted(PAIR_EDITS))
def test_a_pair_record_against_its_own_rules_is_refused(tmp_path, edit):
    changes, message = PAIR_EDITS[edit]
    with pytest.raises(ledger.RecordError, match=f"bad.jsonl:1: member dpo/t1/0: .*{message}"):
        list(read_records(_write(tmp_path / "bad.jsonl", [_pair(**changes)])))


def test_a_good_pair_file_reads_and_a_duplicate_pair_does_not(tmp_path):
    good = [_pair(), _pair(member_id="dpo/t1/1", chosen_mask=[1, 0], rejected_mask=[1])]
    assert [r["member_id"] for r in read_records(_write(tmp_path / "ok.jsonl", good))] == ["dpo/t1/0", "dpo/t1/1"]
    with pytest.raises(ledger.MemberSetMismatch, match="dpo/t1/0 appears twice"):
        list(read_records(_write(tmp_path / "dup.jsonl", good + good[:1])))


# ------------------------------------------------------------------ one hierarchy, no traceback
def test_one_except_catches_each_kind():
    from ledger.corpus.export import DigestMismatch as ExportDigestMismatch

    assert ExportDigestMismatch is ledger.DigestMismatch
    for cls in (ledger.PackedDigestMismatch, ledger.MemberSetMismatch, M.ManifestDigestMismatch, M.ManifestMemberSetMismatch):
        assert issubclass(cls, ledger.DigestMismatch) and not issubclass(cls, ledger.RecordError)
    assert issubclass(ledger.PackedRecordError, ledger.RecordError)
    assert not issubclass(ledger.RecordError, ledger.DigestMismatch)
    for cls in (ledger.DigestMismatch, ledger.RecordError):
        assert issubclass(cls, ledger.ReadError) and issubclass(cls, ValueError)
    assert issubclass(M.ManifestDigestMismatch, M.ManifestError)  # what callers of the manifest module caught before


@pytest.mark.parametrize("data", [b"{not json\n", b"[1, 2]\n", b'"a string"\n', b"null\n", b"\xff\xfe\n"])
def test_lines_that_are_not_records_are_record_errors(tmp_path, data):
    (tmp_path / "x.jsonl").write_bytes(data)
    with pytest.raises(ledger.RecordError, match="x.jsonl:1: not"):
        list(read_records(tmp_path / "x.jsonl"))


@pytest.mark.parametrize("reader", [read_records, read_packed])
def test_a_file_that_only_starts_like_parquet_is_a_record_error(tmp_path, reader):
    (tmp_path / "x.parquet").write_bytes(b"PAR1" + b"\0" * 64)
    with pytest.raises(ledger.RecordError, match="x.parquet: not a readable Parquet file"):
        list(reader(tmp_path / "x.parquet"))


# ------------------------------------------------------------------ the command line: manifest verify --records
def test_manifest_verify_records_checks_an_export_against_the_manifest(corpus, tmp_path, capsys):
    store = ["--store", str(corpus / "store")]
    for name in ("r.jsonl", "r.parquet", "r.tree.jsonl", "p.jsonl", "p.parquet"):
        assert cli([*store, "manifest", "verify", str(corpus / "m.json"), "--records", str(corpus / name)]) == 0
        assert "exactly the members" in capsys.readouterr().out
    recs = _lines(corpus / "r.jsonl")
    bad = _write(tmp_path / "58.jsonl", recs + [recs[17]])
    assert cli([*store, "manifest", "verify", str(corpus / "m.json"), "--records", str(bad), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert not rep["ok"] and rep["problems"] == [f"records {bad}: {bad}:58: member {recs[17]['member_id']} appears "
                                                 f"twice (first at {bad}:18)"]
    docs, i = _tree_doc(corpus, "e00")
    docs[i]["nodes"][0]["parent"] = 1
    assert cli([*store, "manifest", "verify", str(corpus / "m.json"), "--records",
                str(_write(tmp_path / "c.jsonl", docs))]) == 1
    assert "form a cycle" in capsys.readouterr().out
    assert cli([*store, "manifest", "verify", str(corpus / "m.json"), "--records", str(tmp_path / "none.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err


# ------------------------------------------------------------------ properties
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                     max_leaves=12)


@given(st.dictionaries(st.text(max_size=8), _json, max_size=8), st.sets(st.sampled_from(["a", "b", "input_ids", ""])))
def test_the_digest_on_canonical_bytes_is_the_member_digest(rec, lists):
    assert digest_with_lists(rec, tuple(lists))[0] == member_digest(rec)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parents=st.lists(st.one_of(st.none(), st.integers(0, 4)), min_size=4, max_size=4))
@pytest.mark.timeout(120)
def test_any_parent_links_end_in_records_or_a_record_error(corpus, tmp_path, parents):
    """Whatever the parents of e00's four nodes (cycles, self-loops, dangling ids, two roots), the
    reader terminates: its records (digests recomputed) or a RecordError, nothing else."""
    docs, i = _tree_doc(corpus, "e00")
    for node, parent in zip(docs[i]["nodes"], parents):
        node["parent"] = parent
    try:
        check_tree_doc(docs[i], "x")
        for leaf, rec in zip(sorted(docs[i]["leaves"], key=lambda lf: lf["member_id"]),
                             records_from_tree_doc(docs[i], verify=False)):
            leaf["digest"] = member_digest(rec)  # an acyclic tree: the attacker recomputes the leaf digests
    except ledger.RecordError:
        pass
    try:
        assert len(list(read_records(_write(tmp_path / "h.jsonl", docs)))) == 57
    except ledger.RecordError:
        pass
