"""Prefix-tree projection (SPEC §6.1, §7.2 ``tree``): exact behaviour and properties."""

from __future__ import annotations

import hashlib
import json
import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms.path_draws import select_paths, validate_tree
from ledger.algorithms.prefix_match import (
    FLAG_CANDIDATE,
    FLAG_OUTPUT,
    Tree,
    common_prefix,
)
from ledger.events.codec import default_codec
from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.log.base import LogRecord
from ledger.producers.ingest import IngestError, Ingestor, submission
from ledger.projections.engine import Applied, Rejected, ReplayEngine, canonical_dump, connect
from ledger.projections.tree import (
    TreeProjection,
    execution_row,
    load_tree,
    request_path,
    request_tool_payloads,
    tree_json,
    tree_stats,
    tree_text,
    tree_view,
)

from .helpers import closed, numbered, opened, request

ROOT = Path(__file__).resolve().parents[1]
TRANSCRIPTS = ROOT.parent / "shared" / "testdata" / "transcripts" / "claude-code"
T0 = "2025-01-01T00:00:00Z"

# --------------------------------------------------------------------------- helpers


def build(tmp_path: Path, lines: list[dict], **proj_kw):
    log = open_log(str(tmp_path / "store"), create=True)
    Ingestor(log).ingest_lines(numbered(lines))
    db = connect(tmp_path / "proj.db")
    ReplayEngine(log, db, [TreeProjection(**proj_kw)]).run()
    return log, db


def sha(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()


def node_of(t, request_id):
    return t.nodes[t.requests[request_id].node_id]


def segments(t) -> list[tuple[int | None, list[int]]]:
    return [(n.parent, n.tokens.tolist()) for n in t.nodes]


_CODEC = default_codec()


def decoded(line: dict, n: int = 0) -> dict:
    """A JSON line as the engine hands it to projections (validated, encoded, decoded)."""
    ev = validate_line({"occurred_at": T0, **line}, line=n, now_micros=0, producer="test")
    return _CODEC.decode(_CODEC.encode(ev))


def drive(events: list[dict], *, batch: int = 1000, cache_trees: int = 128, db=None, proj=None):
    """Apply decoded events to a TreeProjection like the engine does (batches + finish)."""
    db = db or connect(":memory:")
    proj = proj or TreeProjection(cache_trees=cache_trees)
    proj.create(db)
    rejected = []
    for i in range(0, len(events), batch):
        db.execute("BEGIN IMMEDIATE")
        for j, ev in enumerate(events[i:i + batch], i):
            rec = LogRecord("log", 0, j, ev.get("execution_id", ""), ev["event_id"], ev["event_type"], b"", b"")
            try:
                proj.apply(db, Applied(ev, rec))
            except Rejected as exc:
                rejected.append((ev["event_id"], str(exc)))
        proj.finish(db)
        db.execute("COMMIT")
    return db, rejected


def tree_dump(db) -> str:
    return canonical_dump(db)


# --------------------------------------------------------------------------- exact cases


def test_radix_split_keeps_every_tokens_attributes(tmp_path):
    lp1 = [-0.5, -0.25, -0.125]
    _, db = build(tmp_path, [
        opened("e"),
        request("e", "r1", [1, 2, 3], [4, 5, 6], output_logprobs=lp1),
        request("e", "r2", [1, 2, 3, 4, 5, 9], [7], output_logprobs=[-1.0]),
    ])
    t = load_tree(db, "e")
    assert segments(t) == [(None, [1, 2, 3, 4, 5]), (0, [6]), (0, [9, 7])]
    head, tail, new = t.nodes
    assert head.flags.tolist() == [0, 0, 0, 3, 3] and tail.flags.tolist() == [3] and new.flags.tolist() == [0, 3]
    assert np.isnan(head.logprobs[:3]).all() and head.logprobs[3:].tolist() == lp1[:2]
    assert tail.logprobs.tolist() == lp1[2:] and np.isnan(new.logprobs[0]) and new.logprobs[1] == -1.0
    assert head.origin_request_id == tail.origin_request_id == "r1"
    assert t.requests["r1"].node_id == 1 and t.requests["r2"].node_id == 2
    assert request_path(db, "e", "r1").tolist() == [1, 2, 3, 4, 5, 6]
    assert request_path(db, "e", "r2").tolist() == [1, 2, 3, 4, 5, 9, 7]
    assert tree_stats(db, "e") == {"requests": 2, "nodes": 3, "stored_tokens": 8, "expanded_tokens": 13,
                                   "ratio": 8 / 13}


def test_split_inside_the_input_part_and_stored_node_ids(tmp_path):
    _, db = build(tmp_path, [opened("e"), request("e", "r1", [1, 2, 3, 4], [5]), request("e", "r2", [1, 2, 9], [6])])
    # stored ids: the split node keeps its id and the tail; the head is new (id 1), then r2 (id 2)
    rows = db.execute("SELECT node_id, parent, origin_request_id FROM tree_nodes ORDER BY node_id").fetchall()
    assert rows == [(0, 1, "r1"), (1, None, "r1"), (2, 1, "r2")]
    assert segments(load_tree(db, "e")) == [(None, [1, 2]), (0, [3, 4, 5]), (0, [9, 6])]


def test_identical_outputs_stay_separate_nodes(tmp_path):
    _, db = build(tmp_path, [opened("e"), request("e", "r1", [1, 2], [3, 4]), request("e", "r2", [1, 2], [3, 4])])
    t = load_tree(db, "e")
    assert segments(t) == [(None, [1, 2]), (0, [3, 4]), (0, [3, 4])]
    assert node_of(t, "r1").node_id != node_of(t, "r2").node_id
    assert t.stats["stored_tokens"] == 6 and t.stats["expanded_tokens"] == 8
    assert [lf.request_id for lf in tree_view(db, "e").leaves] == ["r1", "r2"]


def test_tie_goes_to_parent_hint_else_earliest_node(tmp_path):
    _, db = build(tmp_path, [
        opened("e"),
        request("e", "a", [1], [2, 3]),
        request("e", "b", [1], [2, 3]),  # identical sample: sibling of a's output
        request("e", "c", [1, 2, 3, 7], [8]),  # no hint: earliest (a)
        request("e", "d", [1, 2, 3, 9], [8], parent_request_id="b"),  # hint: b
        request("e", "x", [1, 2, 3, 5], [8], parent_request_id="nobody"),  # unknown hint: earliest
    ])
    t = load_tree(db, "e")
    assert node_of(t, "c").parent == node_of(t, "a").node_id
    assert node_of(t, "d").parent == node_of(t, "b").node_id
    assert node_of(t, "x").parent == node_of(t, "a").node_id


def test_hint_never_overrides_a_longer_match(tmp_path):
    _, db = build(tmp_path, [
        opened("e"),
        request("e", "a", [1], [2, 3]),
        request("e", "b", [1], [2, 3]),
        request("e", "c", [1, 2, 3, 4], [5]),  # under a
        request("e", "d", [1, 2, 3, 4, 5, 6], [7], parent_request_id="b"),  # longer match via a/c wins
    ])
    t = load_tree(db, "e")
    assert node_of(t, "c").parent == node_of(t, "a").node_id
    assert node_of(t, "d").parent == node_of(t, "c").node_id
    assert request_path(db, "e", "d").tolist() == [1, 2, 3, 4, 5, 6, 7]


def test_no_match_attaches_to_the_root(tmp_path):
    _, db = build(tmp_path, [opened("e"), request("e", "r1", [1, 2], [3]), request("e", "r2", [5, 6], [7]),
                             request("e", "r3", [], [9])])
    t = load_tree(db, "e")
    assert [n.parent for n in t.nodes] == [None, None, None]
    assert tree_json(db, "e")["nodes"][1] == {"node_id": 1, "parent": None, "tokens": [5, 6, 7], "target": [0, 0, 1]}


def test_input_ending_inside_a_node_and_empty_requests(tmp_path):
    _, db = build(tmp_path, [
        opened("e"),
        request("e", "r1", [1, 2, 3], [4]),
        request("e", "r2", [1, 2], [], output_logprobs=[]),  # input ends inside r1's node, empty output
        request("e", "r3", [1, 2, 3, 4], [], output_logprobs=[]),  # ends exactly at r1's end
    ])
    t = load_tree(db, "e")
    for rid, path in (("r1", [1, 2, 3, 4]), ("r2", [1, 2]), ("r3", [1, 2, 3, 4])):
        assert request_path(db, "e", rid).tolist() == path
    assert t.stats["stored_tokens"] == 4
    view = tree_view(db, "e")
    validate_tree(view)
    assert sorted(lf.request_id for lf in view.leaves) == ["r2", "r3"]


def test_compaction_branches_at_the_divergence(tmp_path):
    system, h1, h2, summary = [1, 1, 1], [2, 2], [3, 3], [7, 7]
    _, db = build(tmp_path, [
        opened("e"),
        request("e", "t1", system + h1, [10, 11]),
        request("e", "t2", system + h1 + [10, 11] + h2, [12]),
        request("e", "s", system + h1 + [10, 11] + h2 + [12] + [4], [20, 21], turn_kind="summary"),
        request("e", "t3", system + summary, [30]),  # context starts over: branches after the system prompt
    ])
    t = load_tree(db, "e")
    assert segments(t)[0] == (None, system)
    t3 = node_of(t, "t3")
    assert t3.parent == 0 and t3.tokens.tolist() == summary + [30]
    assert request_path(db, "e", "s").tolist() == system + h1 + [10, 11] + h2 + [12, 4, 20, 21]  # old context kept
    leaves = {lf.request_id: lf.role_class for lf in tree_view(db, "e").leaves}
    assert leaves == {"s": "main/summary", "t3": "main/task"}


def test_provenance_only_policy_outputs_are_candidates(tmp_path):
    _, db = build(tmp_path, [
        opened("e"),
        request("e", "p", [1], [2, 2]),
        request("e", "ev", [1, 2, 2, 5], [3, 3], generator="evaluator", output_logprobs=None),
        request("e", "h", [1, 2, 2, 5, 3, 3], [4], generator="harness", output_logprobs=None),
        request("e", "hu", [9], [4], generator="human", output_logprobs=None),
        request("e", "rc", [1, 2, 2, 5, 3, 3, 4], [6, 6], reconstructed=True, output_logprobs=None),
        request("e", "p2", [1, 2, 2, 5, 3, 3, 4, 6, 6, 8], [7]),
    ])
    t = load_tree(db, "e")
    out_by_origin: dict[str, list[int]] = {}
    for n in t.nodes:
        out_by_origin.setdefault(n.origin_request_id, []).extend(n.flags.tolist())
    assert out_by_origin["p"] == [0, 3, 3]
    assert out_by_origin["ev"] == [0, 1, 1]
    assert out_by_origin["h"] == [1]
    assert out_by_origin["hu"] == [0, 1]
    assert out_by_origin["rc"] == [1, 1]
    assert out_by_origin["p2"] == [0, 3]
    # the evaluator critique that later sits in a policy input stays context
    doc = tree_json(db, "e")
    assert sum(sum(n["target"]) for n in doc["nodes"]) == 3
    # a TargetSelection's context-only request: its outputs become context in the view
    view = tree_view(db, "e", context_only_request_ids=["p2"])
    assert sum(int(c.sum()) for c in view.candidate) == 2


def test_tree_json_contract_and_text(tmp_path):
    _, db = build(tmp_path, [opened("e"), request("e", "r1", [1, 2, 3], [4, 5]), request("e", "r2", [1, 2, 3, 4, 9], [7])])
    doc = tree_json(db, "e")
    assert set(doc) == {"execution_id", "nodes", "requests", "stored_tokens", "expanded_tokens"}
    assert doc["execution_id"] == "e" and doc["requests"] == {"r1": 1, "r2": 2}
    for n in doc["nodes"]:
        assert set(n) == {"node_id", "parent", "tokens", "target"} and len(n["tokens"]) == len(n["target"])
        assert n["parent"] is None or n["parent"] < n["node_id"]
    json.dumps(doc)
    text = tree_text(db, "e")
    assert "r1" in text and "r2" in text and "stored 7 / expanded 11" in text
    with pytest.raises(KeyError):
        tree_json(db, "missing")


def test_tool_payloads_are_associated_with_requests(tmp_path):
    _, db = build(tmp_path, [
        opened("e"),
        request("e", "r1", [1], [2], emitted_tool_call_ids=["c1", "c2"]),
        {"type": "tool_payload", "execution_id": "e", "call_id": "c1", "kind": "call", "payload": {"cmd": "ls"}},
        {"type": "tool_payload", "execution_id": "e", "call_id": "c1", "kind": "result", "payload": "a\nb"},
        request("e", "r2", [1, 2, 3], [4], consumed_tool_call_ids=["c1", "c2"]),
    ])
    p = request_tool_payloads(db, "e")
    assert [x["kind"] for x in p["r1"]["emitted"]] == ["call", "result", None]
    assert p["r2"]["consumed"][0] == {"call_id": "c1", "kind": "call", "payload": {"cmd": "ls"}}
    assert p["r2"]["consumed"][-1] == {"call_id": "c2", "kind": None, "payload": None}  # a capture gap shows


def test_executions_table_and_closure(tmp_path):
    _, db = build(tmp_path, [opened("e", occurred_at=T0, metadata={"k": 1}), request("e", "r1", [1], [2]),
                             closed("e", versions=("v1", "v2")), {"type": "execution_finalized", "execution_id": "e"}])
    row = execution_row(db, "e")
    assert row["closed_status"] == "completed" and row["artifact_versions"] == ["v1", "v2"] and row["finalized"] == 1
    assert row["opened_at_us"] == 1735689600000000 and row["metadata"] == '{"k":1}'


def test_refused_events_are_listed_not_dropped():
    events = [decoded(x, i) for i, x in enumerate([
        opened("e"), request("e", "r1", [1, 2], [3]),
        request("nope", "r1", [1], [2]),  # unknown execution
        {**request("e", "r1", [9], [9]), "event_id": "dup"},  # duplicate request id
        {"type": "request", "execution_id": "e", "request_id": "bad-ref", "output_ids": [1], "output_logprobs": [-1.0],
         "input_prefix": {"request_id": "r1", "length": 2, "sha256": "0" * 64}},
        {"type": "request", "execution_id": "e", "request_id": "long-ref", "output_ids": [1], "output_logprobs": [-1.0],
         "input_prefix": {"request_id": "r1", "length": 4, "sha256": sha([1, 2, 3, 0])}},
        {"type": "request", "execution_id": "e", "request_id": "no-ref", "output_ids": [1], "output_logprobs": [-1.0],
         "input_prefix": {"request_id": "zz", "length": 1, "sha256": sha([1])}},
        {"type": "request", "execution_id": "e", "request_id": "good-ref", "output_ids": [1], "output_logprobs": [-1.0],
         "input_prefix": {"request_id": "r1", "length": 3, "sha256": sha([1, 2, 3])}, "input_suffix_ids": [5]},
        closed("e"),
        request("e", "late", [1], [2]),  # after closure
        {**closed("e"), "event_id": "close-again"},
        {"type": "tool_payload", "execution_id": "nope", "call_id": "c", "kind": "call", "payload": 1},
    ])]
    db, rejected = drive(events)
    reasons = dict(rejected)
    assert "unknown execution 'nope'" in reasons["request/nope/r1"]
    assert "duplicate request id 'r1'" in reasons["dup"]
    assert "does not match" in reasons["request/e/bad-ref"]
    assert "exceeds the 3 tokens" in reasons["request/e/long-ref"]
    assert "unknown request 'zz'" in reasons["request/e/no-ref"]
    assert "is closed" in reasons["request/e/late"]
    assert "already closed" in reasons["close-again"]
    assert len(rejected) == 8
    assert request_path(db, "e", "good-ref").tolist() == [1, 2, 3, 5, 1]


def test_refused_events_reach_the_engines_rejected_table(tmp_path):
    """A rogue producer writing to the log directly (bypassing ingest checks)."""
    log = open_log(str(tmp_path / "store"), create=True)
    Ingestor(log).ingest_lines(numbered([opened("e"), request("e", "r1", [1, 2], [3]), closed("e")]))
    bad = [validate_line(x, now_micros=0) for x in (
        request("e", "late", [1], [2]),
        {"type": "request", "execution_id": "e", "request_id": "r9", "output_ids": [1], "output_logprobs": [-1.0],
         "input_prefix": {"request_id": "r1", "length": 1, "sha256": sha([2])}})]
    log.append([submission(ev) for ev in bad])
    db = connect(tmp_path / "p.db")
    stats = ReplayEngine(log, db, [TreeProjection()]).run()
    assert stats.rejected == 2
    rows = db.execute("SELECT event_id, projection, reason FROM _rejected ORDER BY \"offset\"").fetchall()
    assert [r[0] for r in rows] == ["request/e/late", "request/e/r9"] and {r[1] for r in rows} == {"tree"}
    assert tree_stats(db, "e")["requests"] == 1


@pytest.mark.parametrize("ref, message", [
    ({"request_id": "zz", "length": 1, "sha256": "0" * 64}, "unknown request 'zz'"),
    ({"request_id": "r1", "length": 9, "sha256": "0" * 64}, "exceeds the 3 tokens"),
    ({"request_id": "r1", "length": 2, "sha256": "0" * 64}, "does not match"),
])
def test_ingest_refuses_bad_prefix_references(tmp_path, ref, message):
    log = open_log(str(tmp_path / "store"), create=True)
    ing = Ingestor(log)
    ing.ingest_lines(numbered([opened("e"), request("e", "r1", [1, 2], [3])]))
    size = log.size()
    line = {"type": "request", "execution_id": "e", "request_id": "r2", "input_prefix": ref,
            "input_suffix_ids": [4], "output_ids": [5], "output_logprobs": [-0.1]}
    with pytest.raises(IngestError) as err:
        ing.ingest_lines(numbered([request("e", "ok", [7], [8]), line]))
    assert message in str(err.value) and "line 2" in str(err.value)
    assert log.size() == size  # nothing appended, not even the valid line


def test_ingest_prefix_reference_to_an_empty_request_in_the_same_batch(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    Ingestor(log).ingest_lines(numbered([
        opened("e"), request("e", "r0", [], []),
        {"type": "request", "execution_id": "e", "request_id": "r1", "output_ids": [1], "output_logprobs": [-1.0],
         "input_prefix": {"request_id": "r0", "length": 0, "sha256": sha([])}}]))
    assert log.size() == 3


def test_tree_view_feeds_path_selection(tmp_path):
    _, db = build(tmp_path, [
        opened("e"),
        request("e", "m1", [1, 2], [3, 4]),
        request("e", "m2", [1, 2, 3, 4, 5], [6]),
        request("e", "s1", [1, 2, 9], [7, 7], agent_id="sub", agent_tier="sub"),
        request("e", "m3", [1, 2, 3, 4, 5], [8]),
    ])
    view = tree_view(db, "e")
    validate_tree(view)
    assert {lf.request_id: lf.role_class for lf in view.leaves} == {"m2": "main/task", "s1": "sub/task", "m3": "main/task"}
    draws = select_paths(view, j_max=8, seed="s", execution_id="e")
    assert sum(d.n_targets for d in draws) == sum(int(c.sum()) for c in view.candidate) == 6


def test_lru_eviction_and_batches_do_not_change_the_result():
    rng = random.Random(5)
    lines = []
    for e in range(4):
        lines.append(opened(f"e{e}", occurred_at=T0))
    for i in range(40):
        e = rng.randrange(4)
        base = list(range(e, e + 6))
        lines.append(request(f"e{e}", f"r{i}", base + [rng.randrange(3) for _ in range(rng.randrange(4))],
                             [rng.randrange(3) for _ in range(3)]))
    events = [decoded(x, i) for i, x in enumerate(lines)]
    ref, _ = drive(events)
    for batch, cache in ((1, 1), (3, 2), (7, 1), (1000, 1)):
        db, _ = drive(events, batch=batch, cache_trees=cache)
        assert tree_dump(db) == tree_dump(ref)


def test_reset_after_rollback_reloads_from_sqlite():
    events = [decoded(x, i) for i, x in enumerate([opened("e"), request("e", "r1", [1, 2, 3], [4])])]
    db = connect(":memory:")
    proj = TreeProjection()
    drive(events, db=db, proj=proj)
    # a batch that is rolled back: in-memory changes must be forgotten
    db.execute("BEGIN IMMEDIATE")
    rec = LogRecord("log", 0, 9, "e", "x", "request", b"", b"")
    proj.apply(db, Applied(decoded(request("e", "r2", [1, 2, 9], [5])), rec))
    db.execute("ROLLBACK")
    proj.reset()
    drive([decoded(request("e", "r2", [1, 2, 3, 4, 6], [7]))], db=db, proj=proj)
    t = load_tree(db, "e")
    assert segments(t) == [(None, [1, 2, 3, 4]), (0, [6, 7])]


# --------------------------------------------------------------------------- properties


@st.composite
def executions(draw, execution_id: str = "e", max_requests: int = 12):
    """Random executions: continuation, drift, branching, compaction, sub-agents, identical
    samples, evaluator critiques, reconstructed calls — over a tiny vocabulary so that
    accidental matches and ties are common.  Returns JSON lines and the expected paths."""
    vocab = draw(st.integers(2, 5))
    tok = st.integers(0, vocab - 1)
    seq = lambda lo, hi: st.lists(tok, min_size=lo, max_size=hi)  # noqa: E731
    system = draw(seq(0, 5))
    lines = [opened(execution_id, occurred_at=T0)]
    paths: dict[str, list[int]] = {}
    last: dict[str, str] = {}
    inputs: dict[str, list[int]] = {}
    for i in range(draw(st.integers(1, max_requests))):
        rid = f"r{i}"
        agent = draw(st.sampled_from(["main", "main", "main", "sub1", "sub2"]))
        prev = last.get(agent)
        move = draw(st.sampled_from(["continue", "drift", "branch", "compact", "sample", "fresh"]))
        kw: dict = {}
        if move == "continue" and prev:
            inp = paths[prev] + draw(seq(0, 4))
        elif move == "drift" and prev:  # diverge a little before the previous output's end
            cut = max(0, len(paths[prev]) - draw(st.integers(1, 3)))
            inp = paths[prev][:cut] + draw(seq(1, 4))
        elif move == "branch" and paths:
            src = paths[draw(st.sampled_from(sorted(paths)))]
            inp = src[: draw(st.integers(0, len(src)))] + draw(seq(0, 3))
        elif move == "sample" and paths:
            src = draw(st.sampled_from(sorted(paths)))
            inp = list(inputs[src])
            if draw(st.booleans()):
                out = paths[src][len(inputs[src]):]
                kw["identical"] = out
        elif move == "compact":
            inp = system + draw(seq(1, 4))
        else:
            inp = system + draw(seq(0, 6))
        out = kw.pop("identical", None)
        if out is None:
            out = draw(seq(0, 5))
        generator = draw(st.sampled_from(["policy", "policy", "policy", "evaluator", "harness", "human"]))
        reconstructed = generator == "policy" and draw(st.integers(0, 5)) == 0
        line = request(execution_id, rid, inp, out, agent_id=agent,
                       agent_tier="main" if agent == "main" else "sub",
                       turn_kind="summary" if move == "compact" else "task", generator=generator,
                       reconstructed=reconstructed, occurred_at=T0,
                       output_logprobs=[-float(draw(st.integers(0, 8))) / 4 for _ in out])
        if paths and draw(st.integers(0, 3)) == 0:
            line["parent_request_id"] = draw(st.sampled_from(sorted(paths)))
        if paths and draw(st.booleans()):  # a prefix reference to some earlier request
            ref = draw(st.sampled_from(sorted(paths)))
            n = common_prefix(np.asarray(paths[ref], dtype=np.uint32), np.asarray(inp, dtype=np.uint32))
            length = draw(st.integers(0, n))
            del line["input_ids"]
            line["input_prefix"] = {"request_id": ref, "length": length, "sha256": sha(paths[ref][:length])}
            line["input_suffix_ids"] = inp[length:]
        lines.append(line)
        paths[rid], inputs[rid], last[agent] = inp + out, inp, rid
    if draw(st.booleans()):
        lines.append(closed(execution_id))
    return lines, paths, inputs


def check_tree(db, execution_id: str, lines: list[dict], paths: dict, inputs: dict) -> None:
    t = load_tree(db, execution_id)
    reqs = [x for x in lines if x["type"] == "request"]
    # every request's root-to-node path is its input+output, exactly
    for rid, path in paths.items():
        assert t.path(rid).tolist() == path
        assert request_path(db, execution_id, rid).tolist() == path
    # parents before children; stored = sum of segments <= expanded
    for n in t.nodes:
        assert n.parent is None or n.parent < n.node_id
    stored = sum(n.tokens.shape[0] for n in t.nodes)
    expanded = sum(len(p) for p in paths.values())
    assert t.stats["stored_tokens"] == stored <= expanded == t.stats["expanded_tokens"]
    # outputs are never shared: each output token exists once; candidates = policy, not reconstructed
    assert sum(int(np.count_nonzero(n.flags & FLAG_OUTPUT)) for n in t.nodes) == sum(len(x["output_ids"]) for x in reqs)
    cand = sum(len(x["output_ids"]) for x in reqs if x.get("generator", "policy") == "policy" and not x.get("reconstructed"))
    assert sum(int(np.count_nonzero(n.flags & FLAG_CANDIDATE)) for n in t.nodes) == cand
    # the longest existing path that is a prefix of the input was reused
    seen: dict[str, list[int]] = {}
    for x in reqs:
        rid = x["request_id"]
        best = max((common_prefix(np.asarray(p, dtype=np.uint32), np.asarray(inputs[rid], dtype=np.uint32))
                    for p in seen.values()), default=0)
        own = [n for n in t.path_nodes(t.requests[rid].node_id) if t.nodes[n].origin_request_id == rid]
        start = sum(t.nodes[n].tokens.shape[0] for n in t.path_nodes(own[0])[:-1])
        assert start == best, (rid, start, best)
        # behaviour log-probs on the output tail
        lp = np.concatenate([t.nodes[n].logprobs for n in own])[-len(x["output_ids"]):] if x["output_ids"] else []
        assert np.allclose(lp, np.asarray(x["output_logprobs"], dtype=np.float32))
        seen[rid] = paths[rid]
    validate_tree(tree_view(db, execution_id))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(executions(), st.integers(1, 6))
def test_property_paths_exact_and_longest_match(data, batch):
    lines, paths, inputs = data
    db, rejected = drive([decoded(x, i) for i, x in enumerate(lines)], batch=batch)
    assert rejected == []
    check_tree(db, "e", lines, paths, inputs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(executions())
def test_property_rebuild_is_byte_identical(data):
    lines, paths, inputs = data
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        log, db = build(tmp, lines)
        check_tree(db, "e", lines, paths, inputs)
        before = canonical_dump(db)
        engine = ReplayEngine(log, db, [TreeProjection()])
        engine.rebuild()
        engine.run()
        assert canonical_dump(db) == before
        fresh = connect(tmp / "fresh.db")
        ReplayEngine(log, fresh, [TreeProjection(cache_trees=1)]).run()
        assert canonical_dump(fresh) == before
        log.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(executions("a", 8), executions("b", 8), executions("c", 8), st.randoms(use_true_random=False),
       st.integers(1, 5), st.integers(1, 3))
def test_property_interleavings_converge(a, b, c, rnd, batch, cache):
    streams = [[decoded(x) for x in lines] for lines, _, _ in (a, b, c)]
    sequential, _ = drive([ev for s in streams for ev in s])
    # a random interleaving that keeps each execution's own order
    queues = [list(s) for s in streams]
    mixed = []
    while any(queues):
        q = rnd.choice([q for q in queues if q])
        mixed.append(q.pop(0))
    db, _ = drive(mixed, batch=batch, cache_trees=cache)
    assert tree_dump(db) == tree_dump(sequential)
    for ex, (lines, paths, inputs) in zip("abc", (a, b, c)):
        check_tree(db, ex, lines, paths, inputs)


def test_prefix_match_tree_round_trips_through_rows():
    tree = Tree()
    rng = np.random.default_rng(3)
    paths = {}
    for i in range(60):
        if paths and rng.random() < 0.8:
            src = paths[f"r{rng.integers(len(paths))}"]
            inp = np.concatenate((src[: rng.integers(len(src) + 1)], rng.integers(0, 3, rng.integers(0, 4))))
        else:
            inp = rng.integers(0, 3, rng.integers(0, 6))
        out = rng.integers(0, 3, rng.integers(0, 4))
        tree.insert(f"r{i}", i, inp.astype(np.uint32), out.astype(np.uint32), None, 3)
        paths[f"r{i}"] = np.concatenate((inp, out)).astype(np.uint32)
    rows = [(n.id, None if n.parent is None else n.parent.id, n.origin, n.tokens.tobytes(), n.flags.tobytes(),
             n.logprobs.tobytes()) for n in tree.nodes]
    again = Tree.from_rows(rows, [(rid, node.id, tree.request_order[rid]) for rid, node in tree.requests.items()])
    for rid, p in paths.items():
        assert tree.path(rid).tolist() == p.tolist() == again.path(rid).tolist()
    probe = np.array([0, 1, 2, 0, 1], dtype=np.uint32)
    assert tree.match(probe)[0] == again.match(probe)[0]


# --------------------------------------------------------------------------- real sessions


def test_claude_code_sessions_reconstruct_exactly(tmp_path):
    """Real Claude Code sessions (workloads.claude_code): every call's path is exact."""
    from workloads import claude_code

    sessions = claude_code.list_sessions(TRANSCRIPTS)
    assert sessions, f"no transcripts under {TRANSCRIPTS}"
    log = open_log(str(tmp_path / "store"), create=True)
    ing = Ingestor(log)
    expected = {}
    for s in sessions:
        events = claude_code.session_events(s)
        ing.ingest_lines(numbered(events))
        expected[events[0]["execution_id"]] = {e["request_id"]: e for e in events if e["type"] == "request"}
    db = connect(tmp_path / "p.db")
    stats = ReplayEngine(log, db, [TreeProjection()]).run()
    assert stats.rejected == 0 and stats.dead_letters == 0
    report = {}
    for ex, reqs in expected.items():
        t = load_tree(db, ex)
        for rid, e in reqs.items():
            assert t.path(rid).tolist() == e["input_ids"] + e["output_ids"], (ex, rid)
        st_ = t.stats
        assert st_["requests"] == len(reqs) and st_["stored_tokens"] <= st_["expanded_tokens"]
        assert not any(int(np.count_nonzero(n.flags & FLAG_CANDIDATE)) for n in t.nodes)  # reconstructed: no targets
        validate_tree(tree_view(db, ex))
        report[ex] = (st_["requests"], st_["nodes"], st_["stored_tokens"], st_["expanded_tokens"])
    print("\nClaude Code sessions (requests, nodes, stored, expanded):")
    for ex, r in report.items():
        print(f"  {ex}: {r[0]} requests, {r[1]} nodes, stored {r[2]:,} / expanded {r[3]:,} = {r[2] / r[3]:.3f}")
