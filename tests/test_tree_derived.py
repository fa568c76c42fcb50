"""Prefix trees of derived views and of sealed requests (SPEC §6.1 with §6.4).

Derived views (RecordDerived): a view gets its own tree, built from its parent's requests
(seq order) with the replaced tokens, under the view's id; its ``executions`` row copies
the parent's.  Covered: equality with the parent's tree (no replacement) and with a tree
recorded directly from the replaced requests, exact paths (property), byte-identical
rebuilds, convergence for any interleaving of the governance stream with the execution
partitions (property), refusal of events addressed to a view, views of views, the seed
redaction scenario admitted end to end, ``finalize --due`` leaving views out.

Sealed requests (crypto-shredding): with the key store they insert exactly as the plain
requests would; without one, or after the key is destroyed, they are refused with a clear
reason and a rebuild holds no node with the erased tokens; ``ledger manifest verify
--deep`` of a manifest published before an erasure names the members that can no longer be
re-derived, one published after it still verifies.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms.prefix_match import FLAG_CANDIDATE, FLAG_OUTPUT
from ledger.algorithms.tokens import pack_tokens
from ledger.log import open_log
from ledger.log.base import LogRecord
from ledger.log.sealing import KeyStore
from ledger.producers.ingest import Ingestor, ingest_sealed
from ledger.projections.engine import Applied, Rejected, ReplayEngine, canonical_dump, connect
from ledger.projections.governance import GovernanceProjection
from ledger.projections.tree import (
    TreeProjection,
    execution_row,
    load_tree,
    request_path,
    tree_json,
    tree_stats,
)

from .helpers import closed, numbered, opened, request, signed_store
from .test_tree import T0, decoded, executions, sha

TREE_TABLES = ("executions", "tree_nodes", "tree_requests", "tree_stats", "tool_payloads")
MARKER = [3141592653, 2718281828, 1618033988, 1414213562]  # distinctive tokens to hunt for


# ============================================================================ helpers
def tree_tables(db: sqlite3.Connection, *, without: tuple[str, ...] = ()) -> str:
    """The tree projection's tables, rows sorted, blobs as hex (executions ``without`` left out)."""
    out = []
    for t in TREE_TABLES:
        rows = [r for r in db.execute(f"SELECT * FROM {t}").fetchall() if r[0] not in without]
        out.append(t + ":\n" + "\n".join(sorted(
            "|".join(bytes(v).hex() if isinstance(v, (bytes, memoryview)) else repr(v) for v in r) for r in rows)))
    return "\n".join(out)


def derive(view: str, parent: str, replacements: dict | None = None, withheld=(), **kw) -> dict:
    line = {"type": "record_derived", "derived_execution_id": view, "parent_execution_id": parent,
            "transformation": "redact@1", **kw}
    if replacements:
        line["replacements"] = replacements
    if withheld:
        line["withheld_fields"] = list(withheld)
    return line


def drive(events: list[tuple[str, dict]], *, cuts: set[int] = frozenset(), keystore=None, cache_trees: int = 128):
    """Apply ``(stream, decoded event)`` pairs to a tree + governance projection like the
    engine does (per-stream offsets; a batch ends after every index in ``cuts``)."""
    db = connect(":memory:")
    projs = [TreeProjection(keystore=keystore, cache_trees=cache_trees), GovernanceProjection()]
    for p in projs:
        p.create(db)
    offsets: dict[str, int] = {}
    rejected = []
    db.execute("BEGIN IMMEDIATE")
    for i, (stream, ev) in enumerate(events):
        off = offsets.get(stream, 0)
        offsets[stream] = off + 1
        rec = LogRecord(stream, 0, off, ev.get("execution_id", ""), ev["event_id"], ev["event_type"], b"", b"")
        for p in projs:
            try:
                p.apply(db, Applied(ev, rec))
            except Rejected as exc:
                rejected.append((ev["event_id"], p.name, str(exc)))
        if i in cuts:
            for p in projs:
                p.finish(db)
            db.execute("COMMIT")
            db.execute("BEGIN IMMEDIATE")
    for p in projs:
        p.finish(db)
    db.execute("COMMIT")
    return db, rejected


def engine_for(tmp: Path, lines: list[dict], *, keystore=None, name: str = "s", sealed: bool = False):
    log = open_log(str(tmp / name), create=True)
    if sealed:
        ingest_sealed(Ingestor(log), numbered(lines), keystore)
    else:
        Ingestor(log).ingest_lines(numbered(lines))
    db = connect(tmp / f"{name}.db")
    eng = ReplayEngine(log, db, [TreeProjection(keystore=keystore), GovernanceProjection()])
    eng.run()
    return eng


def nodes_equal(a, b) -> None:
    """Two LoadedTrees hold the same nodes: parents, tokens, flags and log-probs (NaN-aware)."""
    assert [(n.parent, n.tokens.tolist(), n.flags.tolist(), n.origin_request_id) for n in a.nodes] == \
        [(n.parent, n.tokens.tolist(), n.flags.tolist(), n.origin_request_id) for n in b.nodes]
    for x, y in zip(a.nodes, b.nodes):
        np.testing.assert_array_equal(x.logprobs, y.logprobs)  # NaN == NaN here


def parent_lines(ex: str = "p") -> list[dict]:
    """Main agent with continuation, a sub-agent, a summary, a prefix reference, a hint, an evaluator."""
    return [opened(ex, "t1", collection_run_id="run-1", origin="production", metadata={"k": 1}),
            request(ex, "r1", [1, 2, 3], [4, 5], emitted_tool_call_ids=["c1"]),
            {"type": "tool_payload", "execution_id": ex, "call_id": "c1", "kind": "result", "payload": "secret"},
            {"type": "request", "execution_id": ex, "request_id": "r2", "output_ids": [7, 8], "output_logprobs": [-1.0, -2.0],
             "input_prefix": {"request_id": "r1", "length": 5, "sha256": sha([1, 2, 3, 4, 5])}, "input_suffix_ids": [6],
             "consumed_tool_call_ids": ["c1"]},
            request(ex, "r3", [1, 2, 3, 4, 5, 9], [10], agent_id="helper", agent_tier="sub"),
            request(ex, "ev", [1, 2, 3, 4, 5, 6, 7, 8], [20, 21], generator="evaluator", output_logprobs=None),
            request(ex, "s1", [1, 2, 3, 4, 5, 6, 7, 8, 11], [12, 13], turn_kind="summary", parent_request_id="r2"),
            request(ex, "r4", [1, 2, 3, 4, 5, 6, 7, 8, 14], [15, 16, 17]),
            closed(ex, versions=("w1", "w2"))]


# ============================================================================ exact cases
def test_a_view_without_replacements_has_its_parents_tree_under_its_own_id(tmp_path):
    eng = engine_for(tmp_path, parent_lines() + [derive("v", "p")])
    db = eng.db
    p, v = load_tree(db, "p"), load_tree(db, "v")
    nodes_equal(p, v)
    assert {r: x.node_id for r, x in p.requests.items()} == {r: x.node_id for r, x in v.requests.items()}
    assert [(x.agent_id, x.role_class, x.generator, x.reconstructed, x.parent_request_id, x.input_len, x.output_len,
             x.consumed_tool_call_ids, x.emitted_tool_call_ids, x.seq) for x in v.requests.values()] == \
        [(x.agent_id, x.role_class, x.generator, x.reconstructed, x.parent_request_id, x.input_len, x.output_len,
          x.consumed_tool_call_ids, x.emitted_tool_call_ids, x.seq) for x in p.requests.values()]
    assert tree_stats(db, "v") == tree_stats(db, "p")
    assert {**tree_json(db, "v"), "execution_id": "p"} == tree_json(db, "p")
    # the executions row is the parent's (task, deadline, policy, closure...) under the view's id
    assert {**execution_row(db, "v"), "execution_id": "p"} == execution_row(db, "p")
    # no tool payloads: the parent's may hold exactly what a transformation withholds
    assert db.execute("SELECT COUNT(*) FROM tool_payloads WHERE execution_id = 'v'").fetchone()[0] == 0


def test_a_views_tree_equals_a_tree_recorded_from_the_replaced_requests(tmp_path):
    reps = {"r1": {"input_ids": [1, 99, 3]},
            "r2": {"input_ids": [1, 99, 3, 4, 5, 6]},
            "r3": {"input_ids": [1, 99, 3, 4, 5, 9], "output_ids": [42, 43]},
            "s1": {"output_ids": [12]}}
    eng = engine_for(tmp_path, parent_lines() + [derive("v", "p", reps, withheld=["request:ev", "observation.path"])])
    # the same requests, recorded directly: replaced outputs are context (reconstructed, no log-probs)
    expected = [opened("x", "t1"),
                request("x", "r1", [1, 99, 3], [4, 5]),
                request("x", "r2", [1, 99, 3, 4, 5, 6], [7, 8], output_logprobs=[-1.0, -2.0]),
                request("x", "r3", [1, 99, 3, 4, 5, 9], [42, 43], agent_id="helper", agent_tier="sub",
                        reconstructed=True, output_logprobs=None),
                request("x", "s1", [1, 2, 3, 4, 5, 6, 7, 8, 11], [12], turn_kind="summary", parent_request_id="r2",
                        reconstructed=True, output_logprobs=None),
                request("x", "r4", [1, 2, 3, 4, 5, 6, 7, 8, 14], [15, 16, 17])]
    ref = engine_for(tmp_path, expected, name="ref")
    v, x = load_tree(eng.db, "v"), load_tree(ref.db, "x")
    nodes_equal(v, x)
    assert list(v.requests) == ["r1", "r2", "r3", "s1", "r4"]  # ev withheld
    assert {**tree_json(eng.db, "v"), "execution_id": "x"} == tree_json(ref.db, "x")
    assert [(r.reconstructed, r.input_len, r.output_len, r.seq) for r in v.requests.values()] == \
        [(r.reconstructed, r.input_len, r.output_len, r.seq) for r in x.requests.values()]
    for rid in v.requests:
        assert request_path(eng.db, "v", rid).tolist() == request_path(ref.db, "x", rid).tolist()
    # the parent is untouched
    assert request_path(eng.db, "p", "r3").tolist() == [1, 2, 3, 4, 5, 9, 10]


def test_views_of_views_parents_first_and_after_the_parent_changes(tmp_path):
    lines = [opened("p"), request("p", "r1", [1, 2], [3]),
             derive("v", "p", {"r1": {"output_ids": [30]}}), derive("w", "v", {"r1": {"input_ids": [10, 2]}})]
    eng = engine_for(tmp_path, lines)
    assert request_path(eng.db, "w", "r1").tolist() == [10, 2, 30]
    log = eng.log
    Ingestor(log).ingest_lines(numbered([request("p", "r2", [1, 2, 3, 4], [5]), closed("p")]))
    eng.run()
    for ex, r1 in (("p", [1, 2, 3]), ("v", [1, 2, 30]), ("w", [10, 2, 30])):
        assert request_path(eng.db, ex, "r1").tolist() == r1
        assert request_path(eng.db, ex, "r2").tolist() == [1, 2, 3, 4, 5]
        assert execution_row(eng.db, ex)["closed_status"] == "completed"
    before = canonical_dump(eng.db)
    eng.rebuild()
    eng.run()
    assert canonical_dump(eng.db) == before


def test_events_addressed_to_a_view_are_refused_with_a_clear_reason(tmp_path):
    """Ingest accepts them (a derived id counts as opened); the tree refuses every one."""
    eng = engine_for(tmp_path, [opened("p"), request("p", "r1", [1], [2]), derive("v", "p")])
    Ingestor(eng.log).ingest_lines(numbered([
        request("v", "r9", [1], [5]),
        {"type": "tool_payload", "execution_id": "v", "call_id": "c", "kind": "call", "payload": 1},
        closed("v"), {"type": "execution_finalized", "execution_id": "v"}]))
    eng.run()
    rows = eng.db.execute("SELECT event_type, reason FROM _rejected WHERE projection = 'tree' ORDER BY \"offset\"").fetchall()
    assert [r[0] for r in rows] == ["request", "tool_payload", "execution_closed", "execution_finalized"]
    assert rows[0][1] == ("request 'r9' addressed to derived view 'v' refused: a derived view is defined by its "
                          "record_derived transformation of its parent only")
    assert all("addressed to derived view 'v' refused" in r[1] for r in rows)
    assert list(load_tree(eng.db, "v").requests) == ["r1"] and execution_row(eng.db, "v")["closed_status"] is None


def test_a_view_of_an_unknown_parent_or_in_a_cycle_has_no_tree():
    ev = [("x", decoded(x)) for x in (opened("o"), request("o", "r1", [1], [2]))]
    gov = [("g", decoded(x)) for x in (derive("v", "nope"), derive("a", "o"), derive("o2", "a"))]
    db, _ = drive(ev + gov)
    assert execution_row(db, "v") is None
    with pytest.raises(KeyError):
        load_tree(db, "v")
    assert request_path(db, "o2", "r1").tolist() == [1, 2]  # a view of a view of o
    # a cycle (b <- c <- b) reaches no original execution
    db, _ = drive(ev + [("g", decoded(derive("b", "c"))), ("g", decoded(derive("c", "b")))])
    assert execution_row(db, "b") is None and execution_row(db, "c") is None


def test_finalize_due_leaves_derived_views_out(tmp_path):
    from ledger.producers.finalize import due_executions

    eng = engine_for(tmp_path, [opened("p", deadline="2001-01-01T00:00:00Z"), derive("v", "p")])
    assert execution_row(eng.db, "v")["deadline_us"] == execution_row(eng.db, "p")["deadline_us"]
    assert due_executions(eng.db, 2_000_000_000_000_000) == ["p"]


# ============================================================================ properties
@st.composite
def derivations(draw, lines: list[dict]):
    """Random replacements (input, output or both) and withheld requests for the requests of ``lines``."""
    rids = [x["request_id"] for x in lines if x["type"] == "request"]
    tok = st.lists(st.integers(0, 4), max_size=6)
    reps, withheld = {}, []
    for rid in rids:
        kind = draw(st.sampled_from(["keep", "keep", "input", "output", "both", "withhold"]))
        if kind == "withhold":
            withheld.append(f"request:{rid}")
        elif kind != "keep":
            reps[rid] = {}
            if kind in ("input", "both"):
                reps[rid]["input_ids"] = draw(tok)
            if kind in ("output", "both"):
                reps[rid]["output_ids"] = draw(tok)
    return reps, withheld


def expected_view(lines, paths, inputs, reps, withheld) -> dict[str, tuple[list[int], list[int], bool]]:
    """request id -> (input, output, output is a target candidate) of the view."""
    out = {}
    for x in lines:
        if x["type"] != "request" or f"request:{x['request_id']}" in withheld:
            continue
        rid = x["request_id"]
        inp, o = list(inputs[rid]), paths[rid][len(inputs[rid]):]
        r = reps.get(rid, {})
        cand = x.get("generator", "policy") == "policy" and not x.get("reconstructed")
        if "input_ids" in r:
            inp = r["input_ids"]
        if "output_ids" in r:
            o, cand = r["output_ids"], False
        out[rid] = (inp, o, cand)
    return out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), executions("p", 10))
def test_property_every_view_path_is_its_replaced_input_and_output(data, parent):
    lines, paths, inputs = parent
    reps, withheld = data.draw(derivations(lines))
    events = [("x", decoded(x)) for x in lines] + [("g", decoded(derive("v", "p", reps, withheld)))]
    db, rejected = drive(events)
    assert rejected == []
    want = expected_view(lines, paths, inputs, reps, withheld)
    t = load_tree(db, "v")
    assert list(t.requests) == list(want)  # the parent's seq order, withheld requests left out
    for rid, (inp, out, _cand) in want.items():
        assert t.path(rid).tolist() == inp + out
        assert request_path(db, "v", rid).tolist() == inp + out
    assert sum(int(np.count_nonzero(n.flags & FLAG_OUTPUT)) for n in t.nodes) == sum(len(o) for _, o, _ in want.values())
    assert sum(int(np.count_nonzero(n.flags & FLAG_CANDIDATE)) for n in t.nodes) == \
        sum(len(o) for _, o, c in want.values() if c)
    assert t.stats["expanded_tokens"] == sum(len(i) + len(o) for i, o, _ in want.values())
    assert t.stats["stored_tokens"] == sum(n.tokens.shape[0] for n in t.nodes)
    # one batch per event, a one-tree cache: the same tables
    again, _ = drive(events, cuts=set(range(len(events))), cache_trees=1)
    assert tree_tables(again) == tree_tables(db)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), executions("a", 7), executions("b", 5), st.randoms(use_true_random=False))
def test_property_any_interleaving_of_governance_and_executions_converges(data, a, b, rnd):
    """record_derived sits on the governance stream: before, between or after the parents'
    events, in any batch; a rogue producer's events for a view id interleave too."""
    (la, _, _), (lb, _, _) = a, b
    reps_a, held_a = data.draw(derivations(la))
    reps_w, held_w = data.draw(derivations(la))
    gov = [derive("av", "a", reps_a, held_a), derive("bv", "b"), derive("aw", "av", reps_w, held_w),
           derive("orphan", "nobody")]
    rogue = [opened("av"), request("av", "x1", [1], [2]),
             {"type": "tool_payload", "execution_id": "av", "call_id": "c", "kind": "call", "payload": 1}, closed("av")]
    streams = [[("a", decoded(x)) for x in la], [("b", decoded(x)) for x in lb],
               [("av", decoded(x)) for x in rogue], [("g", decoded(x)) for x in gov]]
    reference, _ = drive([e for s in streams for e in s])
    ref = tree_tables(reference)
    for _ in range(3):
        queues = [list(s) for s in streams]
        mixed = []
        while any(queues):
            mixed.append(rnd.choice([q for q in queues if q]).pop(0))
        cuts = {rnd.randrange(len(mixed)) for _ in range(rnd.randrange(6))}
        db, _ = drive(mixed, cuts=cuts, cache_trees=rnd.choice([1, 2, 128]))
        assert tree_tables(db) == ref
    # the rogue events never reach the view; the views follow their parents
    assert "x1" not in load_tree(reference, "av").requests
    assert execution_row(reference, "orphan") is None
    assert {**tree_json(reference, "bv"), "execution_id": "b"} == tree_json(reference, "b")


# ============================================================================ seed scenario, admitted
def test_seed_redaction_view_is_admitted_with_its_own_redacted_paths(tmp_path):
    from ledger.corpus.export import trainer_records
    from ledger.projections.registry import all_projections

    from .test_governance import R19_PATH, Store, _redact, r19_lines

    s = Store(tmp_path, all_projections())
    parent, view = "trace_r19_01", "trace_r19_01_redacted_v1"
    lines = r19_lines()
    s.ingest(lines)
    reqs = {l["request_id"]: l for l in lines if l["type"] == "request"}
    replacements = {rid: {"input_ids": _redact(r["input_ids"])} for rid, r in reqs.items()}
    replacements["e3"]["output_ids"] = _redact(reqs["e3"]["output_ids"])
    s.ingest([s.signer.sign({"type": "split_policy", "policy_id": "p1", "salt": "s",
                             "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}}),
              s.signer.sign({"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train",
                             "j_max": 8}),
              derive(view, parent, replacements, ["observation.private_path"], transformation="path_redaction@v1")])

    def adm(ex):
        return s.db.execute("SELECT state, predicate, verdict FROM admission WHERE route = 'sft' AND execution_id = ?",
                            (ex,)).fetchone()

    assert adm(parent) == ("admitted", None, "pass")
    assert adm(view) == ("unresolved", "target_suitability", "pending")  # pending until Revalidated(pass)
    t = load_tree(s.db, view)
    assert list(t.requests) == ["e1", "e2", "e3", "e4", "e5", "e6"]
    for n in t.nodes:
        toks = n.tokens.tolist()
        assert not any(toks[i:i + 3] == R19_PATH for i in range(len(toks)))
    s.ingest([{"type": "revalidated", "derived_execution_id": view, "verdict": "pass"}])
    assert adm(view) == ("admitted", None, "pass")
    recs = [r for r in trainer_records(s.db, "sft") if r["execution_id"] == view]
    assert recs and all(r["reward"] == 1.0 for r in recs)
    for r in recs:
        ids = r["input_ids"]
        assert not any(ids[i:i + 3] == R19_PATH for i in range(len(ids)))
        assert all(ids[i] != 777 for i, m in enumerate(r["target_mask"]) if m)  # a replaced output is never a target
    before = canonical_dump(s.db)
    s.engine.rebuild()
    s.engine.run()
    assert canonical_dump(s.db) == before


# ============================================================================ sealed requests
def sealed_lines() -> list[dict]:
    lines = [opened("e1"), request("e1", "r1", [1, 2, 3], MARKER + [7]),
             request("e1", "r2", [1, 2, 3] + MARKER + [7, 8], [9], parent_request_id="r1"),
             opened("e2"), request("e2", "r1", [1, 2, 3], [5, 6]), closed("e1"),
             derive("e1v", "e1", {"r2": {"output_ids": [10]}})]
    return [{**l, "occurred_at": T0} for l in lines]


def _blobs(db) -> bytes:
    return b"".join(bytes(r[0]) for r in db.execute("SELECT tokens FROM tree_nodes"))


def test_sealed_requests_insert_like_plain_ones_with_the_key_store(tmp_path):
    ks = KeyStore(tmp_path / "keys.db")
    sealed = engine_for(tmp_path, sealed_lines(), keystore=ks, sealed=True)
    plain = engine_for(tmp_path, sealed_lines(), name="plain")
    assert sealed.db.execute("SELECT COUNT(*) FROM _rejected").fetchone()[0] == 0
    assert tree_tables(sealed.db) == tree_tables(plain.db)
    assert request_path(sealed.db, "e1", "r2").tolist() == [1, 2, 3] + MARKER + [7, 8, 9]
    assert request_path(sealed.db, "e1v", "r2").tolist() == [1, 2, 3] + MARKER + [7, 8, 10]


def test_sealed_requests_without_a_key_store_are_refused(tmp_path):
    ks = KeyStore(tmp_path / "keys.db")
    eng = engine_for(tmp_path, sealed_lines(), keystore=ks, sealed=True)
    db = connect(tmp_path / "nokeys.db")
    ReplayEngine(eng.log, db, [TreeProjection(), GovernanceProjection()]).run()
    rows = db.execute("SELECT event_id, reason FROM _rejected WHERE projection = 'tree' ORDER BY \"offset\"").fetchall()
    assert rows == [(f"request/{e}/{r}", "sealed request: no key store configured")
                    for e, r in (("e1", "r1"), ("e1", "r2"), ("e2", "r1"))]
    assert tree_stats(db, "e1")["requests"] == 0 and tree_stats(db, "e1v")["requests"] == 0


def test_erasure_refuses_the_sealed_requests_and_a_rebuild_keeps_no_erased_token(tmp_path):
    ks = KeyStore(tmp_path / "keys.db")
    eng = engine_for(tmp_path, sealed_lines(), keystore=ks, sealed=True)
    assert pack_tokens(MARKER) in _blobs(eng.db)
    ks.destroy("execution:e1", "erasure request")
    eng.rebuild()
    eng.run()
    rows = eng.db.execute("SELECT event_id, reason FROM _rejected WHERE projection = 'tree' ORDER BY \"offset\"").fetchall()
    assert rows == [("request/e1/r1", "sealed payload erased"), ("request/e1/r2", "sealed payload erased")]
    for ex in ("e1", "e1v"):  # the view follows its parent: nothing erased is left in it either
        assert tree_stats(eng.db, ex)["requests"] == 0 and execution_row(eng.db, ex)["closed_status"] == "completed"
    assert request_path(eng.db, "e2", "r1").tolist() == [1, 2, 3, 5, 6]  # another subject's key: still readable
    assert pack_tokens(MARKER[:1]) not in _blobs(eng.db)
    dump = canonical_dump(eng.db)
    fresh = connect(tmp_path / "fresh.db")
    ReplayEngine(eng.log, fresh, [TreeProjection(keystore=ks, cache_trees=1), GovernanceProjection()]).run()
    assert canonical_dump(fresh) == dump


def test_a_ciphertext_that_does_not_open_is_refused_with_the_seal_error(tmp_path):
    ks = KeyStore(tmp_path / "keys.db")
    eng = engine_for(tmp_path, sealed_lines()[:2], keystore=ks, sealed=True)
    kid = ks.key_for("execution:e1").key_id
    wrong = KeyStore(tmp_path / "wrong.db")  # another store holding a different key under the same id
    wrong.db.execute("INSERT INTO data_keys VALUES (?,?,?)", ("execution:e1", kid, b"\x01" * 32))
    db = connect(tmp_path / "wrong-p.db")
    ReplayEngine(eng.log, db, [TreeProjection(keystore=wrong)]).run()
    (reason,) = db.execute("SELECT reason FROM _rejected").fetchone()
    assert reason == f"sealed payload of request 'r1' does not open under key {kid}"


def test_project_does_not_create_a_key_file_for_a_store_that_never_sealed(tmp_path, monkeypatch):
    from ledger.cli import main as cli

    store = tmp_path / "store"
    monkeypatch.setenv("LEDGER_STORE", str(store))
    assert cli(["init"]) == 0
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(l) for l in sealed_lines()[:3]) + "\n")
    assert cli(["ingest", "--no-seal", str(tmp_path / "d.jsonl")]) == 0  # plain ingest seals; opting out never sealed
    assert cli(["project"]) == 0
    assert not (store / "data-keys.db").exists()


# ============================================================================ deep verify across an erasure
def test_deep_verify_of_manifests_published_before_and_after_an_erasure(tmp_path):
    from ledger.corpus import publish as P
    from ledger.corpus.withdraw import withdraw

    signer, paths, key = signed_store(tmp_path, "k.pem")
    stamp = "2098-06-01T00:00:00Z"
    gov = [{"type": "task_registered", "task_id": t, "source": "acme"} for t in ("t1", "t2")]
    gov += [signer.sign({**l, "occurred_at": stamp}) for l in (
        {"type": "split_policy", "policy_id": "p1", "salt": "s", "fractions": {"train": 1.0, "dev": 0.0, "final_test": 0.0}},
        {"type": "permission", "subject": "*", "use": "sft", "action": "grant", "authority": "legal"},
        {"type": "admission_policy", "route": "sft", "version": 1, "use": "sft", "split": "train", "j_max": 2})]
    data = []
    for ex, t, tag in (("e1", "t1", 11), ("e2", "t2", 12)):
        data += [opened(ex, t, deadline="2099-01-01T00:00:00Z"), request(ex, "r1", [1, 2, 3], MARKER + [tag]),
                 request(ex, "r2", [1, 2, 3] + MARKER + [tag, 6], [7, 8]), closed(ex),
                 {"type": "assessment", "assessment_id": "a1", "execution_id": ex, "artifact_version": "v1",
                  "outcome": "scored", "reward": 1.0, "evaluator": "grader@1"}]
    with open_log(paths.url) as log:
        Ingestor(log, signer.trust).ingest_lines(numbered(gov))
        with KeyStore(paths.data_keys) as ks:
            ingest_sealed(Ingestor(log, signer.trust), numbered(data), ks)
    P.publish(paths, "sft", key=key, out=tmp_path / "m1.json")
    m1 = json.loads((tmp_path / "m1.json").read_text())
    assert {m["execution_id"] for m in m1["members"]} == {"e1", "e2"}
    assert P.verify_file(tmp_path / "m1.json", paths, deep=True).ok

    out = withdraw(paths, "execution:e1", reason="erasure request", key=key, erase=True)
    assert [d["subject"] for d in out["erase"]["destroyed"]] == ["execution:e1"]
    erased = pack_tokens(MARKER + [11])
    for f in (paths.db, Path(f"{paths.db}-wal")):  # the rebuild left no decrypted copy behind
        assert not f.exists() or erased not in f.read_bytes()
    P.publish(paths, "sft", key=key, out=tmp_path / "m2.json")
    m2 = json.loads((tmp_path / "m2.json").read_text())
    assert {m["execution_id"] for m in m2["members"]} == {"e2"}
    assert P.verify_file(tmp_path / "m2.json", paths, deep=True).ok  # after the erasure: still re-derivable

    rep = P.verify_file(tmp_path / "m1.json", paths, deep=True)  # before it: the erased members are named
    assert not rep.ok
    e1_members = sorted(m["member_id"] for m in m1["members"] if m["execution_id"] == "e1")
    assert rep.problems[0] == f"{len(e1_members)} member(s) cannot be re-derived from the log: the sealed token " \
                              f"payloads of their execution(s) e1 cannot be opened any more"
    assert rep.problems[1:1 + len(e1_members)] == [
        f"member {m}: not re-derivable: their data key was destroyed (crypto-shredded by `ledger withdraw --erase`)"
        for m in e1_members]
    assert rep.problems[-1].startswith("merkle root, counts and datasheet were not compared") and \
        rep.problems[-1].endswith("every other member matches the record rebuilt from the log")
    assert len(rep.problems) == len(e1_members) + 2
