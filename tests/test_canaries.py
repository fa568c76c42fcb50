"""Canaries (SPEC 11.2; seed 002 §15.9.3): the declaration, the one-pass matcher, and the refusal
to sign a training manifest that contains one."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms.canaries import CanaryMatcher, naive_find, segment_matches
from ledger.corpus import publish as P
from ledger.events import semantics
from ledger.events.catalog import SIGNED_TYPES
from ledger.events.validate import ValidationError, validate_line
from ledger.log import open_log
from ledger.producers.ingest import IngestError, Ingestor
from tests.helpers import closed, opened, request, signed_store

STAMP = "2098-06-01T00:00:00Z"
NOW = 1_700_000_000_000_000


@pytest.fixture(autouse=True)
def _semantics_3(monkeypatch):
    """Routes declared here are stamped semantics 3 (the third release's; a no-op once CURRENT is 3)."""
    monkeypatch.setattr(semantics, "CURRENT", max(semantics.CURRENT, 3))


# ---------------------------------------------------------------------- the matcher
def test_matcher_finds_every_occurrence_in_one_pass():
    hay = np.array([5, 1, 2, 3, 1, 2, 1, 2, 3, 4, 9, 9, 9], dtype=np.uint32)
    m = CanaryMatcher([[1, 2, 3], [9, 9], [2], [7, 7, 7], [1, 2, 3, 4, 9, 9, 9, 9, 9]])
    starts, canaries = m.find(hay)
    assert list(zip(starts.tolist(), canaries.tolist())) == [(1, 0), (2, 2), (5, 2), (6, 0), (7, 2), (10, 1), (11, 1)]


def test_long_canaries_are_verified_beyond_the_hashed_window():
    base = list(range(100, 120))
    hay = np.array(base + [0] + base[:19] + [7], dtype=np.uint32)  # the second copy lacks the last token
    starts, canaries = CanaryMatcher([base]).find(hay)
    assert starts.tolist() == [0] and canaries.tolist() == [0]


def test_segment_matches_drop_copies_spanning_two_segments():
    m = CanaryMatcher([[1, 2, 3]])
    hay = np.array([9, 1, 2, 3, 1, 2, 3, 1, 2], dtype=np.uint32)
    seg, off, can = segment_matches(m, hay, [0, 5])  # segments [9 1 2 3 1] [2 3 1 2]
    assert list(zip(seg.tolist(), off.tolist(), can.tolist())) == [(0, 1, 0)]


def test_an_empty_canary_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        CanaryMatcher([[1], []])


tokens_st = st.lists(st.integers(0, 4), max_size=300)


@settings(max_examples=150, deadline=None)
@given(hay=tokens_st, patterns=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=12), min_size=1, max_size=12),
       chunk=st.sampled_from([1, 3, 16, 1 << 15]))
def test_one_pass_equals_one_scan_per_canary(hay, patterns, chunk):
    """Property: the one-pass matcher finds exactly what a sliding scan per canary finds, whatever the
    chunking of the window hashes."""
    ours = CanaryMatcher(patterns).find(np.array(hay, dtype=np.uint32), chunk=chunk)
    ref = naive_find(patterns, np.array(hay, dtype=np.uint32))
    assert ours[0].tolist() == ref[0].tolist() and ours[1].tolist() == ref[1].tolist()


# ---------------------------------------------------------------------- validation
def _line(**kw) -> dict:
    return {"type": "canary", "canary_id": "c1", "scope": ["final_test"], **kw}


@pytest.mark.parametrize("line, field, message", [
    (_line(), "token_ids", "give token_ids, or text with its tokenizer"),
    (_line(token_ids=[]), "token_ids", "at least one token"),
    (_line(token_ids=[1, 2], text="x"), "text", "exactly one of token_ids or text"),
    (_line(text="SECRET"), "tokenizer", "is required with text"),
    (_line(text="SECRET", tokenizer="gpt-4"), "tokenizer", "unknown tokenizer 'gpt-4'"),
    (_line(token_ids=[1], tokenizer="qwen3.6-27b"), "tokenizer", "has no text"),
    (_line(token_ids=[1], scope=["test"]), "scope", "'test' is not a split name"),
    (_line(token_ids=[1], scope="final_test"), "scope", "non-empty JSON array"),
    (_line(token_ids=[1], scope=[]), "scope", "non-empty JSON array"),
    (_line(token_ids=[1], scope=["dev", "dev"]), "scope", "'dev' is named twice"),
    (_line(token_ids=[1, 2**32]), "token_ids", "out of range"),
])
def test_invalid_canaries_name_line_and_field(line, field, message):
    with pytest.raises(ValidationError) as err:
        validate_line(line, line=7, now_micros=NOW)
    assert err.value.field == field and err.value.line == 7 and message in str(err.value)


def test_apache_avro_decodes_our_bytes_of_a_canary():
    pytest.importorskip("avro")
    from ledger.events.codec import default_codec
    from tests.interop.decode_so import AvroSingleObjectReader

    codec = default_codec()
    ev = validate_line(_line(token_ids=[7, 2**32 - 1], scope=["final_test", "dev"]), now_micros=NOW)
    data = codec.encode(ev)
    name, datum = AvroSingleObjectReader(Path(__file__).resolve().parents[1] / "schemas").decode(data)
    assert name == "CanaryDeclared.v1.avsc" and datum == codec.decode(data)
    assert datum["token_ids"] == np.array([7, 2**32 - 1], dtype="<u4").tobytes() and datum["text"] is None


def test_the_cli_refuses_an_unknown_tokenizer_with_exit_2_naming_the_field(tmp_path, capsys):
    from ledger.cli import main

    signer, paths, _key = signed_store(tmp_path)
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps(signer.sign(_line(text="SECRET-1", tokenizer="llama-3"))) + "\n")
    assert main(["--store", paths.url, "ingest", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 1" in err and "field 'tokenizer'" in err and "unknown tokenizer 'llama-3'" in err
    with open_log(paths.url) as log:
        assert log.size() == 0


def test_a_canary_must_be_signed(tmp_path):
    signer, paths, _key = signed_store(tmp_path)
    with open_log(paths.url) as log, pytest.raises(IngestError, match="field 'signature'"):
        Ingestor(log, signer.trust).ingest_lines([(1, _line(token_ids=[1, 2]))])


# ---------------------------------------------------------------------- stores
def _execution(ex: str, task: str, inp: list[int], out: list[int], reward: float = 1.0) -> list[dict]:
    return [opened(ex, task), request(ex, "r1", inp, out), closed(ex),
            {"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
             "outcome": "scored", "reward": reward, "evaluator": "grader@1"}]


def _governance(tasks, use: str = "sft", route: str = "sft", split: str = "train") -> list[dict]:
    lines = [{"type": "task_registered", "task_id": t, "source": "pool"} for t in tasks]
    return lines + [
        {"type": "split_policy", "policy_id": "p1", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0},
         "salt": "s"},
        {"type": "permission", "subject": "*", "use": use, "action": "grant", "authority": "legal"},
        {"type": "admission_policy", "route": route, "version": 1, "use": use, "split": split, "j_max": 1}]


def _canary(cid: str, ids: list[int], scope=("final_test",)) -> dict:
    return {"type": "canary", "canary_id": cid, "token_ids": ids, "scope": list(scope)}


class _Store:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.signer, self.paths, self.key = signed_store(root)

    def ingest(self, lines: list[dict]) -> None:
        lines = [self.signer.sign({**ln, "occurred_at": STAMP}) if ln["type"] in SIGNED_TYPES else ln for ln in lines]
        with open_log(self.paths.url) as log:
            assert not Ingestor(log, self.signer.trust).ingest_lines(enumerate(lines, 1)).conflicts

    def publish(self, name: str = "m.json", route: str = "sft"):
        return P.publish(self.paths, route, key=self.key, out=self.root / name)

    def verify(self, name: str = "m.json"):
        return P.verify_file(self.root / name, self.paths, deep=True)

    def published_events(self) -> int:
        with open_log(self.paths.url) as log:
            return sum(1 for r in log.read(("log", 0), 0, log.size()) if r.event_type == "manifest_published")


@pytest.fixture()
def store(tmp_path):
    s = _Store(tmp_path)
    s.ingest(_governance(["t1", "t2", "t3"]) + _execution("e1", "t1", [1, 2, 3], [4, 5])
             + _execution("e2", "t2", [1, 2, 3, 6], [901, 902, 903, 7]) + _execution("e3", "t3", [8], [9, 10]))
    return s


def test_publish_refuses_a_training_manifest_holding_a_canary(store):
    store.ingest([_canary("c-final", [902, 903, 7]), _canary("c-absent", [555, 556], scope=("dev", "train"))])
    with pytest.raises(P.CanaryEscaped) as err:
        store.publish()
    assert [e.to_json() for e in err.value.escapes] == [
        {"member_id": "sft/e2/r1", "canary_id": "c-final", "field": "input_ids", "position": 5}]
    assert "canary 'c-final' escaped into member sft/e2/r1 at input_ids[5]" in str(err.value)
    # nothing published, nothing half-written
    assert sorted(p.name for p in store.root.iterdir()) == ["publisher.pem", "store"]
    assert not (store.root / "store" / "manifests").exists()
    assert store.published_events() == 0


def test_the_cli_exits_1_naming_member_canary_and_position(store, capsys):
    from ledger.cli import main

    store.ingest([_canary("c-final", [902, 903, 7])])
    out = store.root / "m.json"
    assert main(["--store", store.paths.url, "manifest", "publish", "sft", "--key", str(store.key), "--out",
                 str(out)]) == 1
    assert "canary 'c-final' escaped into member sft/e2/r1 at input_ids[5]" in capsys.readouterr().err
    assert main(["--store", store.paths.url, "manifest", "publish", "sft", "--key", str(store.key), "--out",
                 str(out), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["escapes"] == [
        {"member_id": "sft/e2/r1", "canary_id": "c-final", "field": "input_ids", "position": 5}]
    assert not out.exists() and store.published_events() == 0


def test_a_clean_corpus_is_signed_and_its_datasheet_reports_the_scan(store):
    store.ingest([_canary("c-a", [902, 7, 7]), _canary("c-b", [555, 556], scope=("dev", "final_test"))])
    store.publish()
    doc = json.loads((store.root / "m.json").read_text())
    assert doc["semantics"] == 3
    assert {k: v for k, v in doc["canaries"].items() if k != "scan"} == {
        "planted": 2, "planted_by_scope": {"dev": 1, "final_test": 2}, "scanned": 2, "escaped": 0,
        "members_scanned": 3, "tokens_scanned": 5 + 8 + 3}
    assert store.verify().ok


def test_the_report_shows_declared_canaries_and_each_manifest_scan(store, tmp_path):
    from ledger.reports.report import write_report

    store.ingest([_canary("c-a", [902, 7, 7]),
                  {"type": "canary", "canary_id": "c-text", "text": "SECRET-canary-7f3a9", "tokenizer": "Qwen3.6",
                   "scope": ["dev"]}])
    store.publish()
    page = write_report(store.paths, tmp_path / "report").read_text()
    section = page[page.index("<h2 id='canaries'>"):]
    section = section.split("<h2", 2)[1]
    assert "<td>c-a</td><td>3</td><td>token_ids</td><td>final_test</td><td>log:0:" in section
    assert "<td>c-text</td><td>9</td><td>text (Qwen3.6)</td><td>dev</td>" in section
    assert "<td>sft</td><td>1</td><td>2</td><td>2</td><td>0</td><td>3</td><td>16</td>" in section
    assert "SECRET" not in page  # a canary's value never reaches the report


def test_a_canary_declared_after_publication_does_not_break_deep_verify(store):
    store.publish()
    doc = json.loads((store.root / "m.json").read_text())
    assert doc["canaries"]["planted"] == 0 and doc["canaries"]["tokens_scanned"] == 0
    store.ingest([_canary("c-late", [901, 902])])  # occurs in e2, declared after the publication
    rep = store.verify()
    assert rep.ok, rep.problems
    with pytest.raises(P.CanaryEscaped, match="canary 'c-late' escaped into member sft/e2/r1 at input_ids\\[4\\]"):
        store.publish("m2.json")  # the next version is scanned


def test_deep_verify_reports_a_canary_declared_before_the_log_position(store, monkeypatch):
    store.ingest([_canary("c-final", [902, 903, 7])])
    scanner = P._canary_scanner
    monkeypatch.setattr(P, "_canary_scanner", lambda db, r, pairs: None)  # a publisher without the scan
    store.publish()
    monkeypatch.setattr(P, "_canary_scanner", scanner)
    rep = store.verify()
    assert not rep.ok
    assert "canary 'c-final' escaped into member sft/e2/r1 at input_ids[5] (declared before this manifest's log " \
           "position)" in rep.problems
    assert "field 'canaries' differs from the manifest rebuilt from the log" in rep.problems


def test_text_canaries_are_tokenized_at_ingest_and_replay_accepts_the_signature(tmp_path):
    from ledger.events.codec import default_codec
    from ledger.producers.chatml import named_tokenizer
    from ledger.projections.canaries import declared
    from ledger.projections.engine import connect
    from ledger.projections.registry import open_engine

    text = "SECRET-canary-7f3a9"
    ids = named_tokenizer("qwen3.6-27b").encode(text)
    assert ids == [63104, 68797, 640, 12, 22, 69, 18, 64, 24]
    s = _Store(tmp_path)
    s.ingest(_governance(["t1", "t2"]) + _execution("e1", "t1", [1, 2], [3])
             + _execution("e2", "t2", [1, 2], [3] + ids + [4])
             + [{"type": "canary", "canary_id": "c-text", "text": text, "tokenizer": "qwen3.6-27b",
                 "scope": ["final_test"]}])
    with open_log(s.paths.url) as log:
        ev = next(default_codec().decode(r.value) for r in log.read(("log", 0), 0, log.size())
                  if r.event_type == "canary")
    assert ev["text"] == text and np.frombuffer(ev["token_ids"], "<u4").tolist() == ids
    assert "token_ids" in ev["stamped"] and "token_ids" not in json.loads(ev["signed_body"])
    with open_log(s.paths.url) as log:
        engine = open_engine(log, tmp_path / "replay.db", s.signer.trust)
        engine.run()
        assert engine.db.execute("SELECT reason FROM _rejected").fetchall() == []
        engine.db.close()
    db = connect(tmp_path / "replay.db")
    assert [(c["canary_id"], c["tokenizer"], c["scope"]) for c in declared(db)] == [
        ("c-text", "qwen3.6-27b", ["final_test"])]
    with pytest.raises(P.CanaryEscaped, match="canary 'c-text' escaped into member sft/e2/r1 at input_ids\\[3\\]"):
        s.publish()


def test_a_retried_text_canary_is_a_duplicate_and_another_value_under_its_id_a_conflict(tmp_path):
    s = _Store(tmp_path)
    line = s.signer.sign({"type": "canary", "canary_id": "c", "text": "SECRET-1", "tokenizer": "Qwen3.6",
                          "scope": ["dev"], "occurred_at": STAMP})
    other = s.signer.sign({**_canary("c", [5, 6]), "occurred_at": STAMP})
    with open_log(s.paths.url) as log:
        ingestor = Ingestor(log, s.signer.trust)
        assert ingestor.ingest_lines([(1, line)]).appended == 1
        again = ingestor.ingest_lines([(1, line)])
        assert (again.appended, again.duplicates, again.conflicts) == (0, 1, [])
        assert [c["natural_key"] for c in ingestor.ingest_lines([(1, other)]).conflicts] == ["canary/c"]


def test_a_text_canary_on_the_log_without_tokens_is_refused_by_the_projection(tmp_path):
    """A producer writing to the log directly (not through ingest) cannot declare an unscannable canary."""
    from ledger.events.codec import default_codec
    from ledger.events.signing import signing_body
    from ledger.producers.ingest import submission
    from ledger.projections.registry import open_engine

    s = _Store(tmp_path)
    line = s.signer.sign({"type": "canary", "canary_id": "c", "text": "SECRET", "tokenizer": "qwen3.6-27b",
                          "scope": ["dev"], "occurred_at": STAMP})
    ev = validate_line(line, now_micros=NOW)
    ev["signature"] = line["signature"]
    ev["signed_body"] = signing_body(line).decode()
    with open_log(s.paths.url) as log:
        log.append([submission(ev, default_codec())])
        engine = open_engine(log, tmp_path / "replay.db", s.signer.trust)
        engine.run()
        reasons = [r[0] for r in engine.db.execute("SELECT reason FROM _rejected")]
        engine.db.close()
    assert reasons == ["canary 'c' has no token_ids: a text canary is tokenized when `ledger ingest` accepts it, "
                       "and this one was written to the log another way"]


def test_evaluation_routes_are_not_scanned(tmp_path):
    s = _Store(tmp_path)
    s.ingest(_governance(["t1"], use="evaluation", route="ev", split="train")
             + _execution("e1", "t1", [1, 2], [901, 902]) + [_canary("c", [901, 902])])
    s.publish(route="ev")
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["declared_use"] == "evaluation" and "canaries" not in doc


def test_a_semantics_2_route_is_scanned_but_its_datasheet_is_unchanged(tmp_path, monkeypatch):
    s = _Store(tmp_path)
    monkeypatch.setattr(semantics, "CURRENT", 2)  # a route ingested by the second release
    s.ingest(_governance(["t1", "t2"]) + _execution("e1", "t1", [1, 2], [3]) + _execution("e2", "t2", [1], [4]))
    s.ingest([_canary("c", [2, 3])])
    with pytest.raises(P.CanaryEscaped, match="member sft/e1/r1 at input_ids\\[1\\]"):
        s.publish()
    s2 = _Store(tmp_path / "other")
    s2.ingest(_governance(["t1"]) + _execution("e1", "t1", [1, 2], [3]) + [_canary("c", [7, 7])])
    s2.publish()
    doc = json.loads((s2.root / "m.json").read_text())
    assert doc["semantics"] == 2 and "canaries" not in doc
    assert s2.verify().ok


# ---------------------------------------------------------------------- preference pairs
def _rollout(ex: str, task: str, out: list[int], reward: float) -> list[dict]:
    return [opened(ex, task), request(ex, "r1", [1, 2, 3, 4], out), closed(ex),
            {"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
             "outcome": "scored", "reward": reward, "evaluator": "grader@1",
             "criteria": [{"name": "tests", "verdict": "pass" if reward else "fail"}]}]


@pytest.mark.parametrize("canary, where", [
    ([4, 60], "prompt_ids[3]"),  # spans the prompt and the rejected continuation
    ([60, 61], "rejected_ids[0]"),
    ([2, 3], "prompt_ids[1]"),  # wholly in the prompt: reported once
    ([4, 50, 51], "prompt_ids[3]"),  # spans the prompt and the chosen continuation
])
def test_a_pair_is_scanned_as_prompt_chosen_and_prompt_rejected(tmp_path, canary, where):
    s = _Store(tmp_path)
    s.ingest(_governance(["t1"], use="preference", route="pref") + _rollout("e1", "t1", [50, 51], 1.0)
             + _rollout("e2", "t1", [60, 61, 62], 0.0) + [_canary("c", canary)])
    with pytest.raises(P.CanaryEscaped) as err:
        s.publish(route="pref")
    assert [f"{e.field}[{e.position}]" for e in err.value.escapes] == [where]
    assert err.value.escapes[0].member_id == "pref/e1/r1/e2/r1"


def test_a_clean_preference_corpus_counts_prompt_and_both_sides(tmp_path):
    s = _Store(tmp_path)
    s.ingest(_governance(["t1"], use="preference", route="pref") + _rollout("e1", "t1", [50, 51], 1.0)
             + _rollout("e2", "t1", [60, 61, 62], 0.0) + [_canary("c", [9, 9])])
    s.publish(route="pref")
    doc = json.loads((tmp_path / "m.json").read_text())
    assert (doc["canaries"]["members_scanned"], doc["canaries"]["tokens_scanned"]) == (1, 4 + 2 + 3)


# ---------------------------------------------------------------------- the invariant
@st.composite
def _corpora(draw):
    n = draw(st.integers(1, 4))
    alphabet = st.integers(1, 6)
    executions = [(draw(st.lists(alphabet, min_size=1, max_size=12)), draw(st.lists(alphabet, min_size=1, max_size=8)))
                  for _ in range(n)]
    canaries = draw(st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=3))
    plants = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, len(canaries) - 1), st.integers(0, 20)),
                           max_size=2))
    for ex, c, at in plants:  # plant a canary into an execution's input at a random position
        inp, out = executions[ex]
        at = min(at, len(inp))
        executions[ex] = (inp[:at] + canaries[c] + inp[at:], out)
    return executions, canaries


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(_corpora())
def test_no_signed_training_manifest_contains_a_declared_canary(corpus):
    """Property (issue 26): publishing either refuses, naming exactly the (member, canary, position)
    occurrences, or signs a manifest whose records hold no declared canary."""
    from ledger.corpus.export import trainer_records
    from ledger.projections.engine import connect

    executions, canaries = corpus
    expected = set()
    for i, (inp, out) in enumerate(executions):
        tokens = np.array(inp + out, dtype=np.uint32)
        for start, c in zip(*naive_find(canaries, tokens)):
            expected.add((f"sft/e{i}/r1", f"c{int(c)}", int(start)))
    with tempfile.TemporaryDirectory() as tmp:
        s = _Store(Path(tmp))
        lines = _governance([f"t{i}" for i in range(len(executions))])
        for i, (inp, out) in enumerate(executions):
            lines += _execution(f"e{i}", f"t{i}", inp, out)
        s.ingest(lines + [_canary(f"c{j}", c) for j, c in enumerate(canaries)])
        try:
            s.publish()
        except P.CanaryEscaped as exc:
            assert {(e.member_id, e.canary_id, e.position) for e in exc.escapes} == expected != set()
            assert exc.count == len(expected) and s.published_events() == 0
            assert not (Path(tmp) / "m.json").exists()
            return
        assert expected == set()
        doc = json.loads((Path(tmp) / "m.json").read_text())
        assert doc["canaries"]["escaped"] == 0 and doc["canaries"]["planted"] == len(canaries)
        db = connect(s.paths.db)
        try:
            for rec in trainer_records(db, "sft"):
                assert naive_find(canaries, np.array(rec["input_ids"], dtype=np.uint32))[0].size == 0
        finally:
            db.close()
