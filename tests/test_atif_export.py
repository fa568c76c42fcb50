"""ATIF export (SPEC §7.7 `ledger export-atif`): round trips through `import-atif` rebuild the same tree."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from atif import Trajectory

from ledger.cli import main as cli
from ledger.corpus.atif_export import build_atif, tree_shape
from ledger.events.codec import default_codec
from ledger.log import open_log
from ledger.log.paths import store_paths
from ledger.producers.atif_import import load_trajectory
from ledger.projections.engine import connect
from ledger.projections.tree import load_tree, tree_json

from .helpers import closed, opened, request

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.jsonl"
GOLDEN = ROOT.parent / "shared" / "testdata" / "atif" / "harbor-golden"
SUMMARIZATION = GOLDEN / "hello-world-context-summarization.trajectory.json"


def run(*argv: str) -> int:
    return cli(list(argv))


def make_store(path: Path, *, ingest: Path | None = None, atif: list[Path] = (), project: bool = True) -> str:
    s = str(path)
    assert run("--store", s, "init") == 0
    if ingest is not None:
        assert run("--store", s, "ingest", str(ingest)) == 0
    if atif:
        assert run("--store", s, "import-atif", *map(str, atif)) == 0
    if project:
        assert run("--store", s, "project") == 0
    return s


def db_of(store: str):
    return connect(store_paths(store).db)


def write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def export_and_reimport(store: str, execution_id: str, out_dir: Path, fresh: Path) -> tuple[str, dict, list[Path]]:
    """export-atif into out_dir/t.json, import every written file into a fresh store; the new execution id."""
    out_dir.mkdir()
    assert run("--store", store, "export-atif", execution_id, "--out", str(out_dir / "t.json")) == 0
    files = sorted(out_dir.iterdir())
    s2 = make_store(fresh, atif=files)
    with db_of(s2) as db:
        ids = [r[0] for r in db.execute("SELECT execution_id FROM executions")]
    assert ids == [f"atif:{execution_id}"]  # one execution, named after the original
    return s2, {p.name: json.loads(p.read_text()) for p in files}, files


def assert_same_tree(store_a: str, ex_a: str, store_b: str, ex_b: str, order: list[str]) -> None:
    """Same node segments (tokens, flags, log-probs), same branching, same requests per node;
    and request by request (in import order) the same path, split points and provenance."""
    with db_of(store_a) as a, db_of(store_b) as b:
        ta, tb = load_tree(a, ex_a), load_tree(b, ex_b)
        ja, jb = tree_json(a, ex_a), tree_json(b, ex_b)
    assert tree_shape(ta) == tree_shape(tb)
    assert ta.stats == tb.stats
    assert sorted((n["tokens"], n["target"]) for n in ja["nodes"]) == sorted((n["tokens"], n["target"]) for n in jb["nodes"])
    assert len(ja["requests"]) == len(jb["requests"]) == len(order)
    assert sorted(order) == sorted(ta.requests)
    for old, new in zip(order, tb.requests):  # reimported requests are recorded in the export's import order
        ra, rb = ta.requests[old], tb.requests[new]
        assert ta.path(old).tobytes() == tb.path(new).tobytes()
        assert [ta.nodes[n].tokens.shape[0] for n in ta.path_nodes(ra.node_id)] == \
               [tb.nodes[n].tokens.shape[0] for n in tb.path_nodes(rb.node_id)]
        assert np.array_equal(ta.nodes[ra.node_id].logprobs, tb.nodes[rb.node_id].logprobs, equal_nan=True)
        assert (ra.agent_tier, ra.turn_kind, ra.generator, ra.reconstructed, ra.input_len, ra.output_len) == \
               (rb.agent_tier, rb.turn_kind, rb.generator, rb.reconstructed, rb.input_len, rb.output_len)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    return err[0]


# ============================================================================ demo (sealed ingest)
@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> str:
    return make_store(tmp_path_factory.mktemp("demo") / "store", ingest=DEMO)


def test_demo_round_trip_rebuilds_the_same_tree(demo, tmp_path):
    with open_log(demo) as log:  # the default ingest sealed the tokens: the export reads the projection's opened copy
        reqs = [default_codec().decode(r.value) for w in log.partitions() for r in log.read(w) if r.event_type == "request"]
    assert len(reqs) == 152 and all(ev["sealed"] is not None and ev["output_ids"] == b"" for ev in reqs)
    s2, docs, files = export_and_reimport(demo, "exec-7-0000", tmp_path / "out", tmp_path / "fresh")
    assert [p.name for p in files] == ["t.cont-1.json", "t.cont-2.json", "t.cont-3.json", "t.cont-4.json", "t.json"]
    for doc in docs.values():
        Trajectory.model_validate(doc)
    root = docs["t.json"]
    assert root["continued_trajectory_ref"] == "t.cont-1.json" and docs["t.cont-3.json"]["continued_trajectory_ref"] == "t.cont-4.json"
    assert "continued_trajectory_ref" not in docs["t.cont-4.json"]
    assert root["extra"]["task_id"] == "task-7-0000" and root["extra"]["ledger"]["layout"] == "continuations"
    # branch 1: r001..r014 with the sub-agent embedded and referenced from r007's step; then the
    # re-rendered history (r015..r018), the second sample (r019, r020), the summary turn, the compacted restart
    steps = [s["extra"]["ledger"]["request_id"] for s in root["steps"]]
    assert steps == [f"r{i:03d}" for i in range(1, 15) if i not in (8, 9, 10)]
    assert [[s["extra"]["ledger"]["request_id"] for s in docs[f"t.cont-{n}.json"]["steps"]] for n in (1, 2, 3, 4)] == \
           [["r015", "r016", "r017", "r018"], ["r019", "r020"], ["r021"], ["r022", "r023", "r024", "r025"]]
    (sub,) = root["subagent_trajectories"]
    assert sub["agent"]["name"] == "explore-47292e" and [s["extra"]["ledger"]["request_id"] for s in sub["steps"]] == \
           ["r008", "r009", "r010"]
    assert root["steps"][6]["observation"]["results"][-1]["subagent_trajectory_ref"][0]["trajectory_id"] == sub["trajectory_id"]
    call = root["steps"][0]["tool_calls"][0]
    assert call == {"tool_call_id": "call_6a0d0d2cfad879af", "function_name": "grep", "arguments": {"pattern": "chunk_slugs"}}
    assert root["steps"][0]["observation"]["results"][0]["content"].startswith("src/ledgerline/slugify.py:50:def chunk_slugs")
    order = [f"r{i:03d}" for i in range(1, 26)]  # import order = recording order here
    with db_of(demo) as db:
        assert build_atif(db, "exec-7-0000", root_name="t.json").import_order == order
    assert_same_tree(demo, "exec-7-0000", s2, "atif:exec-7-0000", order)
    with db_of(s2) as db:
        t = load_tree(db, "atif:exec-7-0000")
        assert t.stats["requests"] == 25 and t.stats["nodes"] == 30 and t.stats["stored_tokens"] == 13637
        assert [r.turn_kind for r in t.requests.values()].count("summary") == 1
        assert db.execute("SELECT task_id, closed_status FROM executions").fetchone() == ("task-7-0000", "timeout")


def test_demo_stdout_is_one_document_with_branches_inline(demo, tmp_path, capsys):
    capsys.readouterr()
    assert run("--store", demo, "export-atif", "exec-7-0001", "--out", "-") == 0
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    Trajectory.model_validate(doc)
    assert json.loads(cap.err)["layout"] == "inline" and "continued_trajectory_ref" not in doc
    assert len(doc["steps"]) == 22 and len(doc["subagent_trajectories"]) == 1  # 22 main calls, the sub-agent's 3 embedded
    path = tmp_path / "one.json"
    path.write_text(cap.out)
    s2 = make_store(tmp_path / "fresh", atif=[path])
    with db_of(demo) as db:
        order = build_atif(db, "exec-7-0001", root_name=None).import_order
    assert_same_tree(demo, "exec-7-0001", s2, "atif:exec-7-0001", order)


# ============================================================================ Harbor golden trajectories
@pytest.fixture(scope="module")
def harbor(tmp_path_factory) -> str:
    return make_store(tmp_path_factory.mktemp("harbor") / "store", atif=sorted(GOLDEN.glob("*.json")))


@pytest.mark.parametrize("name, branches, documents", [
    ("hello-world-context-summarization", {"main": 7, "sub1:terminus-2-summarization-summary": 1,
                                           "sub2:terminus-2-summarization-questions": 1,
                                           "sub3:terminus-2-summarization-answers": 1}, 7),
    ("hello-world-context-summarization-linear-history", {"main": 2}, 2),  # reconstructed IDs: never targets
    ("hello-world-invalid-json", {"main": 2}, 2),
    ("hello-world-timeout", {"main": 3}, 3),
])
def test_harbor_executions_round_trip(harbor, tmp_path, name, branches, documents):
    ex = f"atif:NORMALIZED_SESSION_ID:{name}.trajectory"
    with db_of(harbor) as db:
        res = build_atif(db, ex, root_name="t.json")
    assert res.summary["branches"] == branches and res.summary["documents"] == documents
    s2, docs, _ = export_and_reimport(harbor, ex, tmp_path / "out", tmp_path / "fresh")
    assert len(docs) == documents
    assert_same_tree(harbor, ex, s2, f"atif:{ex}", res.import_order)


def test_exported_steps_carry_the_captured_ids_and_logprobs(harbor):
    with db_of(harbor) as db:
        res = build_atif(db, "atif:NORMALIZED_SESSION_ID:hello-world-context-summarization.trajectory", root_name="t.json")
    golden = load_trajectory(SUMMARIZATION).steps
    docs = dict(res.documents)
    # the fake server's sequential IDs: no call's context holds the previous output, so every
    # main call is a branch of its own (root, cont-1, cont-2, ...)
    firsts = [docs[None]] + [docs[f"t.cont-{n}.json"] for n in range(1, 7)]
    assert [len(d["steps"]) for d in firsts] == [1] * 7
    captured = [s for s in golden if s.metrics and s.metrics.prompt_token_ids]
    assert len(captured) == 7
    for doc, g in zip(firsts, captured):
        (step,) = doc["steps"]
        assert step["metrics"]["prompt_token_ids"] == g.metrics.prompt_token_ids
        assert step["metrics"]["completion_token_ids"] == g.metrics.completion_token_ids
        assert step["metrics"]["logprobs"] == [float(np.float32(x)) for x in g.metrics.logprobs]
        assert step["extra"]["ledger"]["request_id"] == f"main/step-{g.step_id}"
    # the three summarization sub-agents hang off step 4's observation (branch 3)
    host = docs["t.cont-2.json"]
    refs = [r["subagent_trajectory_ref"][0]["trajectory_id"] for r in host["steps"][0]["observation"]["results"]
            if "subagent_trajectory_ref" in r]
    assert len(refs) == 3 and [t["trajectory_id"] for t in host["subagent_trajectories"]] == refs
    summary = load_trajectory(GOLDEN / "hello-world-context-summarization.trajectory.summarization-1-summary.json")
    sub = host["subagent_trajectories"][0]["steps"][0]
    g = next(s for s in summary.steps if s.metrics and s.metrics.prompt_token_ids)
    assert sub["metrics"]["prompt_token_ids"] == g.metrics.prompt_token_ids
    assert sub["extra"]["ledger"]["turn_kind"] == "summary" and sub["extra"]["ledger"]["agent_tier"] == "sub"


# ============================================================================ provenance, tools, placement
def test_non_policy_reconstructed_and_early_subagent_survive_the_round_trip(tmp_path):
    a = list(range(1, 21))
    lines = [opened("e1"),
             request("e1", "s1", a[:10], [900, 901], agent_id="helper", agent_tier="sub"),  # before any main call
             request("e1", "r1", a, [100, 101], emitted_tool_call_ids=["c1"]),
             {"type": "tool_payload", "execution_id": "e1", "call_id": "c1", "kind": "call",
              "payload": {"name": "grep", "arguments": {"q": "x"}}},
             {"type": "tool_payload", "execution_id": "e1", "call_id": "c1", "kind": "result",
              "payload": {"content": "found", "is_error": False}},
             request("e1", "r2", a + [100, 101, 30, 31], [200, 201, 202], generator="harness",
                     consumed_tool_call_ids=["c1"]),
             request("e1", "r3", a + [100, 101, 30, 31], [210], turn_kind="summary", reconstructed=True),
             closed("e1")]
    del lines[5]["output_logprobs"], lines[6]["output_logprobs"]
    store = make_store(tmp_path / "s", ingest=write_lines(tmp_path / "e.jsonl", lines))
    s2, docs, _ = export_and_reimport(store, "e1", tmp_path / "out", tmp_path / "fresh")
    root = docs["t.json"]
    assert sorted(docs) == ["t.cont-1.json", "t.json"]  # r3 samples r2's context afresh: a second branch
    first = root["steps"][0]
    assert first["llm_call_count"] == 0 and "metrics" not in first
    assert first["observation"]["results"][0]["subagent_trajectory_ref"][0]["trajectory_id"] == "e1/sub1"
    r1 = root["steps"][1]
    assert r1["tool_calls"] == [{"tool_call_id": "c1", "function_name": "grep", "arguments": {"q": "x"}}]
    assert r1["observation"]["results"] == [{"source_call_id": "c1", "content": "found", "extra": {"is_error": False}}]
    assert "logprobs" not in root["steps"][2]["metrics"] and root["steps"][2]["extra"]["ledger"]["generator"] == "harness"
    assert_same_tree(store, "e1", s2, "atif:e1", ["s1", "r1", "r2", "r3"])
    with db_of(s2) as db:
        t = load_tree(db, "atif:e1")
        assert [(r.generator, r.reconstructed, r.turn_kind, r.agent_tier) for r in t.requests.values()] == [
            ("policy", False, "task", "sub"), ("policy", False, "task", "main"), ("harness", False, "task", "main"),
            ("policy", True, "summary", "main")]
        assert sum(sum(n["target"]) for n in tree_json(db, "atif:e1")["nodes"]) == 4  # only s1's and r1's outputs
        payloads = db.execute("SELECT call_id, kind FROM tool_payloads ORDER BY kind").fetchall()
        assert payloads == [("c1", "call"), ("c1", "result")]


# ============================================================================ refusals: exit 2, one line, nothing written
def test_unknown_execution_and_unprojected_store(demo, tmp_path, capsys):
    out = tmp_path / "x.json"
    capsys.readouterr()
    assert run("--store", demo, "export-atif", "nope", "--out", str(out)) == 2
    assert "no prefix tree for execution 'nope'" in one_error_line(capsys) and not out.exists()
    bare = make_store(tmp_path / "bare", ingest=DEMO, project=False)
    capsys.readouterr()
    assert run("--store", bare, "export-atif", "exec-7-0000", "--out", str(out)) == 2
    assert "has not been built" in one_error_line(capsys) and not out.exists()


def test_erased_execution_is_refused(tmp_path, capsys):
    lines = [opened("e1"), request("e1", "r1", [1, 2, 3], [4, 5]), closed("e1"),
             opened("e2"), request("e2", "r1", [1, 2, 3], [6, 7]), closed("e2")]
    store = make_store(tmp_path / "s", ingest=write_lines(tmp_path / "e.jsonl", lines))
    assert run("--store", store, "export-atif", "e1", "--out", str(tmp_path / "before.json")) == 0
    assert run("--store", store, "keys", "new", "--out", str(tmp_path / "gov.key")) == 0
    assert run("--store", store, "withdraw", "execution:e1", "--reason", "erasure request", "--key",
               str(tmp_path / "gov.key"), "--erase") == 0
    capsys.readouterr()
    out = tmp_path / "after.json"
    assert run("--store", store, "export-atif", "e1", "--out", str(out)) == 2
    msg = one_error_line(capsys)
    assert "execution 'e1' were erased" in msg and not out.exists()
    assert run("--store", store, "export-atif", "e2", "--out", str(out)) == 0 and out.exists()  # e2 is untouched


def test_unwritable_out_writes_nothing(demo, tmp_path, capsys):
    capsys.readouterr()
    assert run("--store", demo, "export-atif", "exec-7-0000", "--out", str(tmp_path / "missing" / "t.json")) == 2
    assert "does not exist" in one_error_line(capsys)
    assert run("--store", demo, "export-atif", "exec-7-0000", "--out", str(tmp_path)) == 2
    assert "is a directory" in one_error_line(capsys)
    # a continuation that cannot be written: the root is not written either, no temporary is left
    out = tmp_path / "o"
    out.mkdir()
    (out / "t.cont-2.json").mkdir()
    assert run("--store", demo, "export-atif", "exec-7-0000", "--out", str(out / "t.json")) == 2
    assert "t.cont-2.json" in one_error_line(capsys)
    assert sorted(p.name for p in out.iterdir()) == ["t.cont-2.json"]
    if os.geteuid() != 0:  # root ignores directory permissions
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            assert run("--store", demo, "export-atif", "exec-7-0000", "--out", str(ro / "t.json")) == 2
            assert "cannot write" in one_error_line(capsys) and list(ro.iterdir()) == []
        finally:
            ro.chmod(0o700)


def test_interleaving_no_layout_can_rebuild_is_refused(tmp_path, capsys):
    a = list(range(1, 21))
    x, b, s, c, y, d = [100, 101], [30, 31], [200, 201], [40], [300, 301], [50]
    lines = [opened("e1"),
             request("e1", "r1", a, x),
             request("e1", "s1", a + x + b, s, agent_id="helper", agent_tier="sub"),
             request("e1", "r2", a + x + b + s + c, y),  # the main agent reads the sub-agent's output ...
             request("e1", "s2", a + x + b + s + c + y + d, [400], agent_id="helper", agent_tier="sub"),  # ... and back
             closed("e1")]
    store = make_store(tmp_path / "s", ingest=write_lines(tmp_path / "e.jsonl", lines))
    capsys.readouterr()
    out = tmp_path / "t.json"
    assert run("--store", store, "export-atif", "e1", "--out", str(out)) == 2
    assert "no ATIF layout makes import-atif rebuild the same tree" in one_error_line(capsys) and not out.exists()
