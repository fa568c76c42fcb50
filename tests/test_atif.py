"""ATIF import (SPEC §7.2 `import-atif`): the Harbor golden trajectories."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.producers.atif_import import atif_events, import_atif, load_trajectory
from ledger.producers.ingest import Ingestor
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.tree import (
    TreeProjection,
    load_tree,
    request_tool_payloads,
    tree_json,
    tree_view,
)

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "testdata" / "atif" / "harbor-golden"
SUMMARIZATION = GOLDEN / "hello-world-context-summarization.trajectory.json"
EXEC = "atif:NORMALIZED_SESSION_ID:hello-world-context-summarization.trajectory"


def captured(path: Path) -> dict[int, list[int]]:
    """step id -> prompt+completion IDs of a golden file."""
    out = {}
    for s in load_trajectory(path).steps:
        if s.metrics and s.metrics.prompt_token_ids:
            out[s.step_id] = s.metrics.prompt_token_ids + s.metrics.completion_token_ids
    return out


@pytest.fixture()
def imported(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    summary = import_atif(sorted(GOLDEN.glob("*.json")), Ingestor(log))
    db = connect(tmp_path / "p.db")
    stats = ReplayEngine(log, db, [TreeProjection()]).run()
    assert stats.rejected == 0 and stats.dead_letters == 0
    return log, db, summary


def test_summary_counts(imported):
    log, _, s = imported
    assert s["files"] == 8 and s["executions"] == 4  # sub-trajectories and continuations join their root
    assert s["requests"] == 24 and s["reconstructed"] == 11 and s["skipped"] == 0
    assert s["subagents"] == 3 and s["appended"] == log.size() and s["conflicting"] == 0
    # the linear-history variant names summarization files that are not in the golden set
    assert len(s["unresolved_refs"]) == 3 and all("linear-history" in r for r in s["unresolved_refs"])


def test_captured_token_ids_are_exact_and_subagents_share_the_prefix(imported):
    _, db, _ = imported
    t = load_tree(db, EXEC)
    main = captured(SUMMARIZATION)
    for step, ids in main.items():
        assert t.path(f"main/step-{step}").tolist() == ids
    subs = {"summary": "sub1", "questions": "sub2", "answers": "sub3"}
    for name, seg in subs.items():
        f = GOLDEN / f"hello-world-context-summarization.trajectory.summarization-1-{name}.json"
        for step, ids in captured(f).items():
            r = t.requests[f"{seg}/step-{step}"]
            assert r.agent_tier == "sub" and r.turn_kind == "summary" and r.parent_request_id == "main/step-4"
            assert t.path(r.request_id).tolist() == ids
    s = t.stats
    assert s["requests"] == 10 and s["stored_tokens"] < s["expanded_tokens"]
    # the summary sub-agent's context runs through the main agent's prompt nodes
    sub_path = t.path_nodes(t.requests["sub1/step-5"].node_id)
    main_path = t.path_nodes(t.requests["main/step-2"].node_id)
    shared = [a for a, b in zip(sub_path, main_path) if a == b]
    assert sum(t.nodes[n].tokens.shape[0] for n in shared) == 500  # its whole prompt is main context
    # policy outputs with captured IDs are targets; their log-probs are kept
    doc = tree_json(db, EXEC)
    assert sum(sum(n["target"]) for n in doc["nodes"]) == sum(r.output_len for r in t.requests.values())
    node = t.nodes[t.requests["main/step-2"].node_id]
    lp = load_trajectory(SUMMARIZATION).steps[1].metrics.logprobs
    assert np.allclose(node.logprobs[-len(lp):], np.asarray(lp, dtype=np.float32))
    roles = {lf.role_class for lf in tree_view(db, EXEC).leaves}
    assert roles == {"main/task", "sub/summary"}


def test_tool_calls_and_results_are_linked(imported):
    _, db, _ = imported
    p = request_tool_payloads(db, EXEC)
    assert [x["kind"] for x in p["main/step-2"]["emitted"]] == ["call", "result"]
    assert p["main/step-2"]["emitted"][0]["payload"]["function_name"] == "bash_command"
    assert p["main/step-3"]["consumed"][0]["call_id"] == "call_0_1"


def test_continuation_and_reconstruction_without_token_ids(imported):
    _, db, s = imported
    ex = "atif:NORMALIZED_SESSION_ID:hello-world-context-summarization-linear-history.trajectory"
    t = load_tree(db, ex)
    rids = list(t.requests)
    assert rids[:3] == ["main/step-2", "main/step-3", "main/step-4"]
    assert [r for r in rids if r.startswith("main.cont1/")] == [f"main.cont1/step-{i}" for i in (5, 6, 7, 8)]
    assert all(r.reconstructed and r.agent_id == "main" for r in t.requests.values())
    assert not any(sum(n["target"]) for n in tree_json(db, ex)["nodes"])  # reconstructed: never targets


def test_without_reconstruction_steps_without_ids_are_skipped(tmp_path):
    log = open_log(str(tmp_path / "store"), create=True)
    s = import_atif(sorted(GOLDEN.glob("*.json")), Ingestor(log), reconstruct="never")
    assert s["requests"] == 13 and s["reconstructed"] == 0 and s["skipped"] == 11


def test_reimport_is_idempotent(imported):
    log, _, _ = imported
    size = log.size()
    again = import_atif([SUMMARIZATION], Ingestor(log))
    assert again["appended"] == 0 and again["duplicates"] > 0 and log.size() == size


def test_atif_events_are_valid_json_lines_with_prefix_references():
    events = atif_events(SUMMARIZATION)
    json.dumps(events)
    for n, e in enumerate(events, 1):
        validate_line(e, line=n, now_micros=0)
    reqs = [e for e in events if e["type"] == "request"]
    assert reqs[1]["input_prefix"] == {**reqs[1]["input_prefix"], "request_id": "main/step-2", "length": 682}
    assert events[0]["type"] == "execution_opened" and events[-1]["type"] == "execution_closed"
