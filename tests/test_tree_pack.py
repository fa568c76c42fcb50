"""Tree-packed trainer format (SPEC §7.5): packing, the export, the reader, and the proof on a
numpy transformer that packed training equals path training (§7.3) with 1/L_i weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledger.algorithms import tree_pack
from ledger.algorithms.canonical import canonical_json
from ledger.cli import main
from ledger.corpus.export import DigestMismatch, accounting, member_digest, trainer_records
from ledger.corpus.packed import (
    PACKED_FIELDS,
    PackedDigestMismatch,
    PackedRecordError,
    packed_records,
    read_packed,
    unpack_record,
    write_packed_jsonl,
    write_packed_parquet,
)
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections.admission import AdmissionProjection
from ledger.projections.assessment import AssessmentProjection
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.tree import TreeProjection
from tests import reference_model as rm
from tests.test_admission import SIGNER, fake_evidence, route, scored
from tests.test_export import build

pytestmark = pytest.mark.usefixtures("earlier_release")  # routes of the first release's rules (SPEC §10)

EV = fake_evidence()
ROOT = Path(__file__).resolve().parents[1]
TRANSCRIPTS = ROOT.parent / "shared" / "testdata" / "transcripts" / "claude-code"

# --------------------------------------------------------------------------- random trees


@st.composite
def packings(draw):
    """A random prefix tree (segments may be empty), members (leaves in draw order, repeats
    allowed) and targets chosen the way admission does: a member's targets lie only on
    nodes no earlier member covers (§6.5 step 3 masks each drawn path)."""
    n = draw(st.integers(1, 12))
    parent = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]
    tokens = [np.array(draw(st.lists(st.integers(0, 2**32 - 1), max_size=4)), dtype=np.uint32) for _ in range(n)]
    leaves = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=6))
    covered: set[int] = set()
    targets = []
    for leaf in leaves:
        chain = []
        v = leaf
        while v >= 0:
            chain.append(v)
            v = parent[v]
        chain.reverse()
        free, off = [], 0
        for v in chain:
            if v not in covered:
                free += range(off, off + len(tokens[v]))
            off += len(tokens[v])
        covered.update(chain)
        pick = draw(st.lists(st.sampled_from(free), unique=True)) if free else []
        targets.append(np.array(sorted(pick), dtype=np.int64))
    return parent, tokens, leaves, targets


def _chain(parent, leaf):
    out = []
    while leaf >= 0:
        out.append(leaf)
        leaf = parent[leaf]
    return out[::-1]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(packings(), st.floats(1e-6, 1.0))
def test_pack_then_unpack_gives_back_every_path_record(case, weight):
    parent, tokens, leaves, targets = case
    p = tree_pack.pack(parent, tokens, leaves, targets, weight)
    paths = tree_pack.unpack(p)
    assert len(paths) == len(leaves)
    for leaf, tg, u in zip(leaves, targets, paths):
        chain = _chain(parent, leaf)
        ids = np.concatenate([tokens[v] for v in chain]).astype(np.uint32)
        mask = np.zeros(ids.shape[0], dtype=np.uint8)
        mask[tg] = 1
        assert u.input_ids.dtype == np.uint32 and u.input_ids.tolist() == ids.tolist()
        assert u.target_mask.tolist() == mask.tolist()
        assert u.weights.tolist() == (mask * weight).tolist()
        # each token's position on its own path; the predecessor of a target is the packed
        # index of the path position before it
        assert p.position_ids[u.indices].tolist() == list(range(ids.shape[0]))
        pred = dict(zip(p.targets[:, 0].tolist(), p.targets[:, 1].tolist()))
        for j in tg.tolist():
            assert pred[int(u.indices[j])] == (int(u.indices[j - 1]) if j else -1)
    # each admitted node once: the packed length is the distinct tokens of the covered nodes
    covered = {v for leaf in leaves for v in _chain(parent, leaf)}
    assert p.input_ids.shape[0] == sum(len(tokens[v]) for v in covered)
    # the arrays are exactly what the spans imply; the mask rule is "ancestor or self"
    pos, tin, tout = tree_pack.layout(p.node_spans, p.input_ids.shape[0])
    assert (pos.tolist(), tin.tolist(), tout.tolist()) == (p.position_ids.tolist(), p.tin.tolist(), p.tout.tolist())
    assert tree_pack.predecessors(p.node_spans, p.targets[:, 0]).tolist() == p.targets[:, 1].tolist()
    tree_pack.check(p.input_ids.shape[0], p.position_ids, p.node_spans, p.tin, p.tout, p.targets, p.member_spans)
    span_of = np.repeat(np.arange(p.node_spans.shape[0]), p.node_spans[:, 1] - p.node_spans[:, 0])
    anc = [set(tree_pack.path_spans(p.node_spans, s)) for s in range(p.node_spans.shape[0])]
    mask = tree_pack.attention_mask(p.tin, p.tout)
    expect = [[(span_of[k] in anc[span_of[q]]) and (span_of[k] != span_of[q] or k <= q) for k in range(len(span_of))]
              for q in range(len(span_of))]
    assert mask.tolist() == expect


def test_pack_exact_small_tree():
    # A=[1,2] -> B=[3] (member 0), A -> C=[] -> D=[4,5] (member 1): D's first token is
    # predicted by A's last token across the empty span C
    p = tree_pack.pack([-1, 0, 0, 2], [np.array(x, dtype=np.uint32) for x in ([1, 2], [3], [], [4, 5])],
                       [1, 3], [np.array([2]), np.array([2, 3])], 0.25)
    assert p.input_ids.tolist() == [1, 2, 3, 4, 5]
    assert p.position_ids.tolist() == [0, 1, 2, 2, 3]
    assert p.node_spans.tolist() == [[0, 2, -1], [2, 3, 0], [3, 3, 0], [3, 5, 2]]
    assert p.tout.tolist() == [5, 5, 3, 5, 5]
    assert p.targets.tolist() == [[2, 1], [3, 1], [4, 3]]
    assert p.weights.tolist() == [0.25] * 3 and p.member_spans.tolist() == [1, 3]


@pytest.mark.parametrize("args, message", [
    (([-1, 0], [[1], [2]], [1, 1], [[1], [1]]), "first covered by an earlier member"),
    (([-1, 0, 0], [[1], [2], [3]], [1, 2], [[0], [0]]), "first covered by an earlier member"),
    (([-1, 0], [[1], [2]], [1], [[2]]), "target position outside its path"),
    (([-1, 0], [[1], [2]], [1], [[-1]]), "target position outside its path"),
    (([-1, 5], [[1], [2]], [1], [[1]]), "parent index out of range"),
    (([1, 0], [[1], [2]], [1], [[1]]), "cycle"),
    (([-1, 0], [[1]], [0], [[0]]), "1 token segments for 2 nodes"),
    (([-1, 0], [[1], [2]], [2], [[0]]), "leaf node 2 out of range"),
    (([-1, 0], [[1], [2]], [1], []), "0 target sets for 1 members"),
])
def test_pack_refuses(args, message):
    parent, tokens, leaves, targets = args
    with pytest.raises(ValueError, match=message):
        tree_pack.pack(parent, [np.array(t, dtype=np.uint32) for t in tokens], leaves,
                       [np.array(t, dtype=np.int64) for t in targets], 0.5)


def _small():
    return tree_pack.pack([-1, 0, 0], [np.array(x, dtype=np.uint32) for x in ([1, 2], [3, 4], [5])], [1, 2],
                          [np.array([2, 3]), np.array([2])], 1 / 3)


@pytest.mark.parametrize("field, change, message", [
    ("tout", lambda a: a.__setitem__(0, 4), "tout do not match node_spans"),
    ("position_ids", lambda a: a.__setitem__(4, 3), "position_ids do not match node_spans"),
    ("targets", lambda a: a.__setitem__((2, 1), 3), "predecessor_index"),
    ("targets", lambda a: a.__setitem__((1, 0), 2), "strictly increasing"),
    ("node_spans", lambda a: a.__setitem__((2, 2), 1), "position_ids do not match"),  # a valid tree, another shape
    ("node_spans", lambda a: a.__setitem__((2, 2), 2), "not an open ancestor"),
    ("node_spans", lambda a: a.__setitem__((1, 0), 1), "do not tile"),
    ("member_spans", lambda a: a.__setitem__(1, 3), "leaf_node_index is not a span"),
])
def test_check_refuses_an_inconsistent_record(field, change, message):
    p = _small()
    arrays = {k: getattr(p, k).copy() for k in ("position_ids", "node_spans", "tin", "tout", "targets", "member_spans")}
    tree_pack.check(5, *arrays.values())
    change(arrays[field])
    with pytest.raises(ValueError, match=message):
        tree_pack.check(5, *arrays.values())


def test_check_refuses_a_target_on_no_members_path():
    p = _small()
    with pytest.raises(ValueError, match="on no member's path"):
        tree_pack.check(5, p.position_ids, p.node_spans, p.tin, p.tout, p.targets, p.member_spans[:1])


# --------------------------------------------------------------------------- the export


E1_PACKED = {
    "execution_id": "e1",
    # A(1-5) B(6-8) E(14-17) for r4 (draw 0), then D(11-13) for s1, C(9-10) for r3
    "input_ids": [1, 2, 3, 4, 5, 6, 7, 8, 14, 15, 16, 17, 11, 12, 13, 9, 10],
    "position_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 8, 9, 10, 5, 6],
    "node_spans": [[0, 5, None], [5, 8, 0], [8, 12, 1], [12, 15, 1], [15, 17, 0]],
    "tin": list(range(17)),
    "tout": [17] * 5 + [15] * 3 + [12] * 4 + [15] * 3 + [17] * 2,
    "targets": [[3, 2, 0.1], [4, 3, 0.1], [6, 5, 0.1], [7, 6, 0.1], [9, 8, 0.1], [10, 9, 0.1], [11, 10, 0.1],
                [13, 12, 0.1], [14, 13, 0.1], [16, 15, 0.1]],
    "members": [{"member_id": "sft/e1/r4", "leaf_node_index": 2}, {"member_id": "sft/e1/s1", "leaf_node_index": 3},
                {"member_id": "sft/e1/r3", "leaf_node_index": 4}],
}
DUMMY_PACKED = {"execution_id": "dum", "input_ids": [], "position_ids": [], "node_spans": [], "tin": [], "tout": [],
                "targets": [], "members": [{"member_id": "sft/dum/dummy", "leaf_node_index": None}]}


def test_packed_records_exact(tmp_path):
    db = build(tmp_path)
    recs = list(packed_records(db, "sft", evidence=EV))
    assert [r["execution_id"] for r in recs] == ["dum", "e1"]  # admitted and dummy; rejected/pending: none
    for rec, exp in zip(recs, [DUMMY_PACKED, E1_PACKED]):
        digest = rec.pop("digest")
        assert rec == exp
        assert digest == member_digest(exp)
        assert list(rec) + ["digest"] == list(PACKED_FIELDS)


def _path_view(db, route_name="sft"):
    """The path export, per execution: {member_id: (input_ids, target_mask, weights)}."""
    out: dict[str, dict] = {}
    for r in trainer_records(db, route_name, evidence=EV):
        out.setdefault(r["execution_id"], {})[r["member_id"]] = (
            r["input_ids"], r["target_mask"], [r["loss_weight"] * m for m in r["target_mask"]])
    return out


def assert_packed_equals_paths(db, route_name="sft") -> tuple[int, int]:
    """Every packed record unpacks to exactly the path export's records; returns (packed
    tokens, path tokens)."""
    paths = _path_view(db, route_name)
    packed_tokens = path_tokens = 0
    recs = list(packed_records(db, route_name, evidence=EV))
    assert {r["execution_id"] for r in recs} == set(paths)
    for rec in recs:
        got = {u["member_id"]: (u["input_ids"], u["target_mask"], u["weights"]) for u in unpack_record(rec)}
        assert got == paths[rec["execution_id"]]
        packed_tokens += len(rec["input_ids"])
        path_tokens += sum(len(v[0]) for v in got.values())
        if rec["targets"]:  # every weight is 1/L_i, L_i = the execution's admitted targets
            assert {w for _, _, w in rec["targets"]} == {1.0 / len(rec["targets"])}
    assert packed_tokens == accounting(db, route_name)["processed_tokens"]["tree"]
    return packed_tokens, path_tokens


def test_packed_equals_the_path_export(tmp_path):
    db = build(tmp_path, extra=[route("one", j_max=1)])
    assert assert_packed_equals_paths(db) == (17, 30)
    assert assert_packed_equals_paths(db, "one") == (12, 12)


def test_jsonl_and_parquet_round_trip_with_the_same_digests(tmp_path):
    import pyarrow.parquet as pq

    db = build(tmp_path)
    recs = list(packed_records(db, "sft", evidence=EV))
    s1 = write_packed_jsonl(iter(recs), tmp_path / "p.jsonl")
    s2 = write_packed_parquet(iter(recs), tmp_path / "p.parquet", row_group_rows=1)
    assert list(read_packed(tmp_path / "p.jsonl")) == recs
    assert list(read_packed(tmp_path / "p.parquet")) == recs
    assert (tmp_path / "p.jsonl").read_bytes() == b"".join(canonical_json(r) + b"\n" for r in recs)
    pf = pq.ParquetFile(str(tmp_path / "p.parquet"))
    assert pf.schema_arrow.names == list(PACKED_FIELDS) and pf.metadata.num_row_groups == 2
    assert (s1.records, s1.dummies, s1.tree_tokens, s1.target_tokens) == (2, 1, 17, 10)
    assert s1.to_json() == s2.to_json()


def test_cli_export_packed_and_packed_parquet(tmp_path, capsys):
    db = build(tmp_path)
    want = list(packed_records(db, "sft", evidence=EV))
    for fmt, name in (("packed", "o.jsonl"), ("packed-parquet", "o.parquet")):
        out = tmp_path / name
        assert main(["--store", str(tmp_path / "s"), "--db", str(tmp_path / "s.db"), "export", "sft", "--out", str(out),
                     "--format", fmt]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["format"] == fmt and summary["records"] == 2 and summary["target_tokens"] == 10
        assert summary["processed_tokens"]["packed"] == summary["processed_tokens"]["tree"] == 17
        assert summary["processed_tokens"]["path"] == 30
        assert list(read_packed(out)) == want
    # unknown route: one line, exit 2, nothing written
    assert main(["--store", str(tmp_path / "s"), "--db", str(tmp_path / "s.db"), "export", "nope", "--out",
                 str(tmp_path / "x.jsonl"), "--format", "packed"]) == 2
    assert "no route 'nope'" in capsys.readouterr().err and not (tmp_path / "x.jsonl").exists()


def test_reader_refuses_a_tampered_record(tmp_path):
    db = build(tmp_path)
    out = tmp_path / "p.jsonl"
    write_packed_jsonl(packed_records(db, "sft", evidence=EV), out)
    good = out.read_text()
    out.write_text(good.replace('"input_ids":[1,2,3,4,5,6,7,8,14', '"input_ids":[1,2,3,4,5,6,7,8,99'))
    with pytest.raises(PackedDigestMismatch, match="packed record of execution e1: digest .* does not match"):
        list(read_packed(out))
    out.write_text(good.replace("0.1]", "0.2]", 1))  # a weight changed
    with pytest.raises(DigestMismatch, match="execution e1"):
        list(read_packed(out))


def test_parquet_reader_refuses_a_tampered_record(tmp_path):
    db = build(tmp_path)
    recs = list(packed_records(db, "sft", evidence=EV))
    recs[1]["members"][0]["member_id"] = "sft/e1/other"  # content changed, digest kept
    write_packed_parquet(recs, tmp_path / "bad.parquet")
    with pytest.raises(PackedDigestMismatch, match="execution e1"):
        list(read_packed(tmp_path / "bad.parquet"))


def _redigest(rec):
    rec = {k: v for k, v in rec.items() if k != "digest"}
    rec["digest"] = member_digest(rec)
    return rec


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["tout"].__setitem__(0, 16), "execution e1: tout do not match node_spans"),
    (lambda r: r["targets"][0].__setitem__(1, 1), "execution e1: a target's predecessor_index"),
    (lambda r: r["members"].pop(), "execution e1: a target lies on no member's path"),
    (lambda r: r["members"][0].__setitem__("leaf_node_index", 9), "leaf_node_index is not a span"),
    (lambda r: r["targets"][0].__setitem__(2, float("inf")), "target weight inf is not in"),
    (lambda r: r["input_ids"].__setitem__(0, -1), "input_ids must be a list of non-negative integers"),
    (lambda r: r.pop("tin"), "not a packed record \\(missing \\['tin'\\]"),
])
def test_reader_refuses_an_inconsistent_record_even_with_a_matching_digest(tmp_path, edit, message):
    db = build(tmp_path)
    rec = list(packed_records(db, "sft", evidence=EV))[1]
    edit(rec)
    (tmp_path / "p.jsonl").write_text(json.dumps(_redigest(rec)) + "\n")
    with pytest.raises(PackedRecordError, match=message):
        list(read_packed(tmp_path / "p.jsonl"))


def test_reader_refuses_other_files(tmp_path):
    db = build(tmp_path)
    from ledger.corpus.export import write_jsonl, write_parquet

    write_jsonl(trainer_records(db, "sft", evidence=EV), tmp_path / "paths.jsonl")
    with pytest.raises(PackedRecordError, match="paths.jsonl:1: not a packed record"):
        list(read_packed(tmp_path / "paths.jsonl"))
    write_parquet(trainer_records(db, "sft", evidence=EV), tmp_path / "paths.parquet")
    with pytest.raises(PackedRecordError, match="not a packed Parquet export"):
        list(read_packed(tmp_path / "paths.parquet"))
    (tmp_path / "bad.jsonl").write_text('{"execution_id": \n')
    with pytest.raises(PackedRecordError, match="bad.jsonl:1: not JSON"):
        list(read_packed(tmp_path / "bad.jsonl"))


def test_public_api_exposes_the_reader():
    import ledger

    assert ledger.read_packed is read_packed


# --------------------------------------------------------------------------- realistic executions


def _project_sealed(tmp_path, lines, name):
    """Ingest as `ledger ingest` does (request tokens sealed), project, admit."""
    log = open_log(str(tmp_path / name), create=True)
    ing = Ingestor(log, SIGNER.trust)
    try:
        ing.ingest_lines(enumerate(lines, 1))
    finally:
        ing.close()
    db = connect(tmp_path / f"{name}.db")
    stats = ReplayEngine(log, db, [TreeProjection(), AssessmentProjection(), AdmissionProjection(EV)],
                         trust=SIGNER.trust).run()
    assert stats.rejected == 0 and stats.dead_letters == 0
    assert db.execute("SELECT COUNT(*) FROM tree_requests").fetchone()[0] > 0
    return db


def _synthetic_db(tmp_path):
    from workloads import synthetic

    events = list(synthetic.with_prefix_references(synthetic.generate(2, seed=5, turns=synthetic.MIN_TURNS)))
    return _project_sealed(tmp_path, [route("sft", j_max=8)] + events, "syn")


def _trainable(events):
    """A Claude Code session as if its calls had been sampled by the policy with log-probs
    (the transcripts are reconstructed, so as recorded they hold no targets), closed with an
    artifact and scored."""
    out, closed = [], None
    for e in events:
        if e["type"] == "request":
            e = dict(e, reconstructed=False, output_logprobs=[-0.25] * len(e["output_ids"]))
        elif e["type"] == "execution_closed":
            e = closed = dict(e, artifact_versions=["v1"])
        out.append(e)
    return out + [scored(events[0]["execution_id"], 1.0, occurred_at=closed["occurred_at"])]


def _claude_db(tmp_path, names, name="cc", j_max=8, max_input_tokens=None):
    """The sessions ``names`` projected; ``max_input_tokens`` keeps only the calls (and their descendants)
    whose input is at most that long, so a dense attention mask over a packed record stays small."""
    from workloads import claude_code

    lines = [route("sft", j_max=j_max)]
    for n in names:
        lines += _trainable(_bounded(claude_code.session_events(TRANSCRIPTS / n), max_input_tokens))
    return _project_sealed(tmp_path, lines, name)


def _bounded(events, max_input_tokens):
    if max_input_tokens is None:
        return list(events)
    dropped: set[str] = set()
    out = []
    for e in events:
        if e["type"] == "request" and (len(e["input_ids"]) > max_input_tokens or e.get("parent_request_id") in dropped):
            dropped.add(e["request_id"])
            continue
        out.append(e)
    return out


SMALL_SESSIONS = ("subagent.jsonl", "tool_heavy.jsonl")


def test_realistic_packed_equals_paths_and_shares_prefixes(tmp_path):
    db = _synthetic_db(tmp_path)
    assert [s for (s,) in db.execute("SELECT state FROM admission WHERE route = 'sft'")] == ["admitted", "admitted"]
    packed, paths = assert_packed_equals_paths(db)
    assert packed < paths
    db = _claude_db(tmp_path, SMALL_SESSIONS)
    assert [s for (s,) in db.execute("SELECT state FROM admission WHERE route = 'sft'")] == ["admitted", "admitted"]
    packed, paths = assert_packed_equals_paths(db)
    assert packed < paths


def test_claude_code_full_sessions_pack_exactly(tmp_path):
    """The three long sessions (compaction, sub-agents; ~10M expanded tokens each): packing
    is structurally exact and holds far fewer tokens than the paths."""
    big = sorted(p.name for p in TRANSCRIPTS.glob("*-*-*-*-*.jsonl"))
    assert len(big) == 3
    db = _claude_db(tmp_path, big, name="big")
    packed, paths = assert_packed_equals_paths(db)
    assert packed * 1.5 < paths
    for rec in packed_records(db, "sft", evidence=EV):
        from ledger.corpus.packed import check_record

        check_record(rec)


# --------------------------------------------------------------------------- reference model


def test_reference_model_backward_matches_finite_differences():
    p = _small()
    m = rm.Model.random(vocab=11, dim=4, max_pos=8, seed=3)
    rec = {"input_ids": p.input_ids.tolist(), "position_ids": p.position_ids.tolist(), "tin": p.tin.tolist(),
           "tout": p.tout.tolist(), "targets": [[i, j, 1 / 3] for i, j in p.targets.tolist()]}
    g = m.zeros()
    rm.packed_loss(m, rec, g)
    rng = np.random.default_rng(0)
    eps = 1e-6
    for name in rm.PARAMS:
        arr = getattr(m, name)
        for idx in [tuple(rng.integers(0, s) for s in arr.shape) for _ in range(6)] + [
                np.unravel_index(np.argmax(np.abs(g[name])), arr.shape)]:
            old = arr[idx]
            arr[idx] = old + eps
            up = rm.packed_loss(m, rec)
            arr[idx] = old - eps
            down = rm.packed_loss(m, rec)
            arr[idx] = old
            assert g[name][idx] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9), (name, idx)
    assert np.abs(g["Wq"]).max() > 0 and np.abs(g["P"]).max() > 0  # attention and positions matter


def assert_packed_training_equals_path_training(db, route_name="sft") -> dict:
    """Loss and every parameter gradient: the packed records vs the sum over path records."""
    recs = list(packed_records(db, route_name, evidence=EV))
    max_pos = 1 + max(max(r["position_ids"], default=0) for r in recs)
    m = rm.Model.random(max_pos=max_pos, seed=7)
    g_packed, g_path = m.zeros(), m.zeros()
    loss_packed = sum(rm.packed_loss(m, r, g_packed) for r in recs)
    loss_path = 0.0
    n_path_tokens = 0
    for r in trainer_records(db, route_name, evidence=EV):
        loss_path += rm.path_loss(m, r["input_ids"], r["target_mask"], r["loss_weight"], g_path)
        n_path_tokens += len(r["input_ids"])
    n_exec = len(recs)
    assert loss_packed > 0.5 * n_exec  # a real loss, not a vacuous zero
    assert loss_packed == pytest.approx(loss_path, rel=1e-10)
    for name in rm.PARAMS:
        assert np.abs(g_packed[name]).max() > 0, name
        np.testing.assert_allclose(g_packed[name], g_path[name], rtol=1e-8, atol=1e-12, err_msg=name)
    return {"packed_tokens": sum(len(r["input_ids"]) for r in recs), "path_tokens": n_path_tokens}


def test_packed_training_equals_path_training_on_the_fixture(tmp_path):
    db = build(tmp_path)
    assert assert_packed_training_equals_path_training(db) == {"packed_tokens": 17, "path_tokens": 30}
    # the proof is sensitive: a plain causal mask over the packed sequence, or sequence
    # positions instead of path positions, gives another loss
    recs = list(packed_records(db, "sft", evidence=EV))
    m = rm.Model.random(max_pos=32, seed=7)
    path = sum(rm.path_loss(m, r["input_ids"], r["target_mask"], r["loss_weight"])
               for r in trainer_records(db, "sft", evidence=EV))
    assert sum(rm.packed_loss(m, r) for r in recs) == pytest.approx(path, rel=1e-12)
    causal = [dict(r, tout=[len(r["input_ids"])] * len(r["input_ids"])) for r in recs]
    seq_pos = [dict(r, position_ids=list(range(len(r["input_ids"])))) for r in recs]
    for variant in (causal, seq_pos):
        assert abs(sum(rm.packed_loss(m, r) for r in variant) - path) > 1e-3


def test_packed_training_equals_path_training_on_the_workload(tmp_path):
    db = _synthetic_db(tmp_path)
    n = assert_packed_training_equals_path_training(db)
    assert n["packed_tokens"] < n["path_tokens"]
    # each execution has two samples of one prompt: their first output tokens are both
    # predicted by the shared parent's last token (a predecessor that is not target - 1)
    recs = list(packed_records(db, "sft", evidence=EV))
    for r in recs:
        jumps = [(t, p) for t, p, _ in r["targets"] if p != t - 1]
        assert len(jumps) == 1 and any(p == jumps[0][1] for t, p, _ in r["targets"] if (t, p) != jumps[0])
    m = rm.Model.random(max_pos=1 + max(max(r["position_ids"]) for r in recs), seed=7)
    naive = [dict(r, targets=[[t, t - 1, w] for t, _, w in r["targets"]]) for r in recs]
    right = sum(rm.packed_loss(m, r) for r in recs)
    assert abs(sum(rm.packed_loss(m, r) for r in naive) - right) > 1e-6


def test_packed_training_equals_path_training_on_claude_code_sessions_bounded(tmp_path):
    """The default run's variant: the tool-heavy session only (the full one below, with the sub-agent session,
    takes ~100 s on 2 cores: the reference model's attention is quadratic in the packed length)."""
    n = assert_packed_training_equals_path_training(_claude_db(tmp_path, ("tool_heavy.jsonl",)))
    assert n["packed_tokens"] == n["path_tokens"] == 1969  # one chain: nothing to share (the sharing is tested above)


@pytest.mark.slow
def test_packed_training_equals_path_training_on_claude_code_sessions(tmp_path):
    n = assert_packed_training_equals_path_training(_claude_db(tmp_path, SMALL_SESSIONS))
    assert n["packed_tokens"] < n["path_tokens"]
