"""Tests for the ChatML renderer, the synthetic workload and the Claude Code converter."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.producers import chatml
from workloads import claude_code
from workloads import synthetic as workload

ROOT = Path(__file__).resolve().parents[1]
TRANSCRIPTS = ROOT.parent / "shared" / "testdata" / "transcripts" / "claude-code"
VOCAB = chatml.tokenizer()._tokenizer.n_vocab  # noqa: SLF001 - the package exposes no size

# SPEC §7.1: required fields per event type, and enumerated values.
REQUIRED = {
    "execution_opened": {"execution_id", "task_id", "deadline", "policy"},
    "request": {"execution_id", "request_id", "output_ids"},
    "tool_payload": {"execution_id", "call_id", "kind", "payload"},
    "execution_closed": {"execution_id", "status"},
    "assessment": {"assessment_id", "execution_id", "artifact_version", "outcome",
                   "evaluator"},
    "task_registered": {"task_id"},
}
OPTIONAL = {
    "execution_opened": {"tokenizer", "origin", "collection_run_id", "metadata"},
    "request": {"input_ids", "input_prefix", "input_suffix_ids", "output_logprobs",
                "agent_id", "agent_tier", "turn_kind", "generator", "parent_request_id",
                "consumed_tool_call_ids", "emitted_tool_call_ids", "reconstructed", "model",
                "finish_reason"},
    "tool_payload": set(),
    "execution_closed": {"artifact_versions"},
    "assessment": {"reward", "branch_request_id", "criteria"},
    "task_registered": {"fixture", "family", "source", "derived_from", "ambiguous_lineage",
                        "features"},
}
COMMON = {"type", "event_id", "occurred_at", "producer"}
ENUMS = {
    ("request", "agent_tier"): {"main", "sub"},
    ("request", "turn_kind"): {"task", "summary"},
    ("request", "generator"): {"policy", "evaluator", "harness", "human"},
    ("tool_payload", "kind"): {"call", "result"},
    ("execution_closed", "status"): {"completed", "timeout", "error", "cancelled"},
    ("assessment", "outcome"): {"scored", "evaluator_error", "not_assessable"},
    ("execution_opened", "origin"): {"synthetic", "human", "production"},
}


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _tokens_ok(tokens: Any) -> bool:
    """A JSON integer array of in-vocabulary token IDs (checked with numpy: no token loop)."""
    if not isinstance(tokens, list):
        return False
    array = np.asarray(tokens)
    return array.size == 0 or (array.dtype.kind == "i" and array.ndim == 1
                               and 0 <= array.min() and array.max() < VOCAB)


def check_events(events: list[dict[str, Any]]) -> None:
    """Assert SPEC §7.1 shapes and the cross-event references a ledger validates."""
    opened: dict[str, dict[str, Any]] = {}
    closed: set[str] = set()
    results: set[str] = set()
    requests: set[tuple[str, str]] = set()
    for line, event in enumerate(events):
        kind = event["type"]
        where = f"line {line} ({kind})"
        assert REQUIRED[kind] <= event.keys(), f"{where}: missing {REQUIRED[kind] - event.keys()}"
        extra = event.keys() - REQUIRED[kind] - OPTIONAL[kind] - COMMON
        assert not extra, f"{where}: unknown fields {extra}"
        for (etype, name), allowed in ENUMS.items():
            if etype == kind and name in event:
                assert event[name] in allowed, f"{where}: {name}={event[name]!r}"
        # Everything but the token lists (checked by _tokens_ok) must be JSON-serialisable.
        json.dumps({k: v for k, v in event.items() if not k.endswith("_ids")})
        if "occurred_at" in event:
            _time(event["occurred_at"])
        execution = event.get("execution_id")
        if kind == "execution_opened":
            opened[execution] = event
            assert _time(event["deadline"]) > _time(event["occurred_at"])
            continue
        if kind == "task_registered":
            continue
        assert execution in opened, f"{where}: execution not opened"
        if kind == "request":
            assert execution not in closed, f"{where}: request after closure"
            assert ("input_ids" in event) != ("input_prefix" in event), where
            assert _tokens_ok(event.get("input_ids", event.get("input_suffix_ids"))), where
            assert _tokens_ok(event["output_ids"]) and event["output_ids"], where
            assert event["output_ids"][-1] == chatml.IM_END_ID, f"{where}: no <|im_end|>"
            if event.get("generator", "policy") == "policy" and not event.get("reconstructed"):
                logprobs = event["output_logprobs"]
                assert len(logprobs) == len(event["output_ids"]), where
                assert all(isinstance(x, float) and -30 < x < 0 for x in logprobs), where
            missing = set(event.get("consumed_tool_call_ids", ())) - results
            assert not missing, f"{where}: consumes uncached results {missing}"
            key = (execution, event["request_id"])
            assert key not in requests, f"{where}: duplicate request id"
            if "parent_request_id" in event:
                assert (execution, event["parent_request_id"]) in requests, where
            requests.add(key)
        elif kind == "tool_payload" and event["kind"] == "result":
            results.add(event["call_id"])
        elif kind == "execution_closed":
            closed.add(execution)
        elif kind == "assessment":
            assert execution in closed
            assert event["outcome"] != "scored" or isinstance(event["reward"], float)
            assert _time(event["occurred_at"]) <= _time(opened[execution]["deadline"])


def _requests(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event for event in events if event["type"] == "request"]


# --------------------------------------------------------------------------------------
# ChatML renderer
# --------------------------------------------------------------------------------------

TOOLS = workload.MAIN_TOOLS[:2]
HISTORY = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in `parse`."},
    {"role": "assistant", "reasoning_content": "Read it first.", "content": "",
     "tool_calls": [{"name": "read_file", "arguments": {"path": "a.py"}}]},
    {"role": "tool", "content": "def parse(): ..."},
    {"role": "tool", "content": "second result"},
    {"role": "assistant", "reasoning_content": "Found it.", "content": "Fixed.",
     "tool_calls": [{"name": "bash", "arguments": {"command": "pytest -q"}}]},
    {"role": "tool", "content": "3 passed"},
]


def test_special_tokens_and_template_text() -> None:
    assert chatml.encode("<|im_start|><|im_end|><think></think>") == [
        chatml.IM_START_ID, chatml.IM_END_ID, chatml.THINK_ID, chatml.END_THINK_ID]
    text = chatml.render_text(HISTORY, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert ("<|im_start|>user\n<tool_response>\ndef parse(): ...\n</tool_response>\n"
            "<tool_response>\nsecond result\n</tool_response><|im_end|>\n") in text
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>' in text
    assert chatml.output_text(HISTORY[5]) == (
        "<think>\nFound it.\n</think>\n\nFixed.\n<tool_call>\n"
        '{"name": "bash", "arguments": {"command": "pytest -q"}}\n</tool_call><|im_end|>')


def test_turn_cache_equals_whole_string_encoding() -> None:
    for cut in range(2, len(HISTORY) + 1):
        messages = HISTORY[:cut]
        assert chatml.render_prompt(messages, TOOLS) == chatml.encode(
            chatml.render_text(messages, TOOLS))


def test_think_kept_in_tool_loop_and_dropped_after_new_query() -> None:
    loop = chatml.render_text(HISTORY, TOOLS)
    assert loop.count("<think>") == 2  # both turns are after the last user query
    # Inside the loop the captured call (input + output) is a prefix of the next input.
    first_call = chatml.render_prompt(HISTORY[:2], TOOLS) + chatml.render_output(HISTORY[2])
    assert chatml.render_prompt(HISTORY[:4], TOOLS)[: len(first_call)] == first_call
    followed = HISTORY + [{"role": "user", "content": "Also add a test."}]
    assert "<think>" not in chatml.render_text(followed, TOOLS)


# --------------------------------------------------------------------------------------
# Synthetic workload
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def execution() -> list[dict[str, Any]]:
    return workload.generate_execution("exec-a", "task-a", seed=3, turns=30)


def test_deterministic() -> None:
    a = workload.generate_execution("e", "t", seed=11, turns=20)
    b = workload.generate_execution("e", "t", seed=11, turns=20)
    c = workload.generate_execution("e", "t", seed=12, turns=20)
    assert a == b
    assert a != c
    assert list(workload.generate(3, seed=5, turns=14)) == list(
        workload.generate(3, seed=5, turns=14))


def test_shapes_match_spec(execution: list[dict[str, Any]]) -> None:
    check_events(execution)
    kinds = Counter(event["type"] for event in execution)
    assert kinds["execution_opened"] == kinds["execution_closed"] == kinds["assessment"] == 1
    assert sum(1 for e in _requests(execution) if e["agent_id"] == "main") == 30
    opened = execution[0]
    assert opened["tokenizer"] == "Qwen3.6" and opened["origin"] == "synthetic"


def test_execution_has_every_feature(execution: list[dict[str, Any]]) -> None:
    requests = _requests(execution)
    subs = [r for r in requests if r["agent_tier"] == "sub"]
    assert subs and {r["agent_id"] for r in subs} != {"main"}
    main_prompt = chatml.decode(requests[0]["input_ids"])
    sub_prompt = chatml.decode(subs[0]["input_ids"])
    assert "sub-agent" in sub_prompt and "sub-agent" not in main_prompt.split("# Tools")[0]
    summaries = [r for r in requests if r["turn_kind"] == "summary"]
    assert len(summaries) == 1
    after = requests[requests.index(summaries[0]) + 1]
    assert "<summary>" in chatml.decode(after["input_ids"])
    assert len(after["input_ids"]) < len(summaries[0]["input_ids"]) / 2
    pairs = [(a, b) for a, b in zip(requests, requests[1:]) if a["input_ids"] == b["input_ids"]]
    assert len(pairs) == 1
    assert pairs[0][1]["parent_request_id"] == pairs[0][0]["parent_request_id"]
    payloads = [e for e in execution if e["type"] == "tool_payload"]
    assert {p["kind"] for p in payloads} == {"call", "result"}
    names = Counter(p["payload"]["name"] for p in payloads if p["kind"] == "call")
    assert {"grep", "read_file", "bash", "edit_file", "delegate"} <= names.keys()
    every_output = [chatml.decode(r["output_ids"]) for r in requests]
    assert all(text.startswith("<think>\n") for text in every_output)


def test_identical_samples_occur_across_executions() -> None:
    identical = distinct = 0
    for seed in range(12):
        requests = _requests(workload.generate_execution("e", f"t{seed}", seed=seed, turns=14))
        for a, b in zip(requests, requests[1:]):
            if a["input_ids"] == b["input_ids"]:
                same = a["output_ids"] == b["output_ids"]
                identical += same
                distinct += not same
                assert (a["output_logprobs"] == b["output_logprobs"]) == same
                assert a["emitted_tool_call_ids"] != b["emitted_tool_call_ids"]
    assert identical and distinct


def test_prefix_continuity_report(execution: list[dict[str, Any]]) -> None:
    """Consecutive main-agent calls extend each other except where the template says not.

    Inside a tool loop the next input starts with the previous input + output. It diverges
    inside the previous input only after a new user message (think blocks dropped), at the
    compaction call (its prompt is a new user message) and after compaction (new history),
    and at offset 0 for the two samples drawn from one prefix.
    """
    rows = [r for r in workload.prefix_continuity(execution) if r["agent_id"] == "main"]
    where = Counter(r["where"] for r in rows)
    diverging = [(r["next"], r["where"], r["offset"], r["turn_kind"]) for r in rows
                 if r["where"] != "extends"]
    print(f"\nmain-agent pairs: {dict(where)}; divergences: {diverging}")
    assert where["extends"] >= 0.8 * len(rows)
    assert where["output"] == 1  # the sampled pair, at offset 0
    assert [r["offset"] for r in rows if r["where"] == "output"] == [0]
    inside = [r for r in rows if r["where"] == "input"]
    assert len(inside) == 3  # follow-up query, compaction call, first call after compaction
    for row in inside:
        assert row["common"] / row["prev_input"] > 0.1
    assert all(r["where"] == "extends" for r in workload.prefix_continuity(execution)
               if r["agent_id"] != "main")


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31), turns=st.integers(workload.MIN_TURNS, 40))
def test_any_seed_gives_a_valid_execution(seed: int, turns: int) -> None:
    events = workload.generate_execution(f"e{seed}", f"t{seed % 7}", seed=seed, turns=turns)
    check_events(events)
    assert sum(1 for e in _requests(events) if e["agent_id"] == "main") == turns
    results = [e["payload"]["content"] for e in events
               if e["type"] == "tool_payload" and e["kind"] == "result"]
    assert not [r for r in results if r.startswith("Error")], "a simulated tool call failed"


def test_turns_below_minimum_rejected() -> None:
    with pytest.raises(ValueError):
        workload.generate_execution("e", "t", seed=1, turns=workload.MIN_TURNS - 1)


def test_prefix_references_resolve(execution: list[dict[str, Any]]) -> None:
    full: dict[str, list[int]] = {}
    referenced = 0
    for original, event in zip(execution, workload.with_prefix_references(execution)):
        if event["type"] != "request":
            assert event is original
            continue
        if "input_prefix" in event:
            ref = event["input_prefix"]
            prefix = full[ref["request_id"]][: ref["length"]]
            assert workload.tokens_sha256(prefix) == ref["sha256"]
            assert prefix + event["input_suffix_ids"] == original["input_ids"]
            referenced += 1
        full[event["request_id"]] = original["input_ids"] + original["output_ids"]
    assert referenced >= len(full) - 2  # only the first main and sub-agent calls are whole


def test_example_file(tmp_path: Path) -> None:
    path = tmp_path / "demo.jsonl"
    stats = workload.write_example(path)
    data = path.read_bytes()
    assert stats["bytes"] == len(data) < 1_500_000
    events = [json.loads(line) for line in data.splitlines()]
    check_events(events)
    tasks = {e["task_id"] for e in events if e["type"] == "task_registered"}
    assert tasks == {e["task_id"] for e in events if e["type"] == "execution_opened"}
    committed = ROOT / "examples" / "demo.jsonl"
    assert hashlib.sha256(committed.read_bytes()).digest() == hashlib.sha256(data).digest(), (
        "examples/demo.jsonl is stale: regenerate with "
        "python -c 'from workloads.synthetic import write_example; "
        "write_example(\"examples/demo.jsonl\")'")


# --------------------------------------------------------------------------------------
# Claude Code sessions
# --------------------------------------------------------------------------------------

SESSIONS = claude_code.list_sessions(TRANSCRIPTS)


def test_all_sessions_listed() -> None:
    assert [p.name for p in SESSIONS] == sorted(p.name for p in TRANSCRIPTS.glob("*.jsonl"))
    assert len(SESSIONS) == 5


def _transcript_calls(path: Path) -> int:
    """Distinct model calls (message ids) in a transcript file."""
    with path.open() as handle:
        lines = [json.loads(line) for line in handle]
    return len({line["message"]["id"] for line in lines if line["type"] == "assistant"})


@pytest.mark.parametrize("session", SESSIONS, ids=lambda p: p.stem[:8])
def test_claude_code_session(session: Path) -> None:
    events = claude_code.session_events(session)
    check_events(events)
    assert events[0]["origin"] == "production" and events[0]["tokenizer"] == "Qwen3.6"
    requests = _requests(events)
    assert all(r["reconstructed"] and r["generator"] == "policy" for r in requests)
    assert all("output_logprobs" not in r for r in requests)
    stamps = [_time(e["occurred_at"]) for e in events]
    assert stamps == sorted(stamps)
    folder = session.with_suffix("") / "subagents"
    sub_files = [p for p in folder.glob("agent-*.jsonl") if "acompact" not in p.name]
    compactions = list(folder.glob("agent-acompact-*.jsonl"))
    main = [r for r in requests if r["agent_id"] == "main" and r["turn_kind"] == "task"]
    assert len(main) == _transcript_calls(session)
    subs = Counter(r["agent_id"] for r in requests if r["agent_tier"] == "sub")
    for path in sub_files:  # progress echoes are not counted on top of the files
        assert subs[path.stem] == _transcript_calls(path)
    if not sub_files and any("agent_progress" in line for line in session.open()):
        assert len(subs) == 1  # rebuilt from the progress echoes
    summaries = [r for r in requests if r["turn_kind"] == "summary"]
    assert len(summaries) == len(compactions)
    for summary in summaries:
        after = requests[requests.index(summary) + 1:]
        nxt = next(r for r in after if r["agent_id"] == "main")
        assert "This session is being continued" in chatml.decode(nxt["input_ids"])
        assert len(nxt["input_ids"]) < len(summary["input_ids"]) / 4
    rows = [r for r in workload.prefix_continuity(events) if r["agent_id"] == "main"]
    where = Counter("extends" if r["where"] == "extends" else r["offset"] if r["offset"] == -1
                    else r["where"] for r in rows)
    print(f"\n{session.stem[:8]}: {len(main)} main calls, {dict(subs)} sub-agent calls, "
          f"{len(summaries)} compaction; continuity {dict(where)}")
    assert where["extends"] >= 0.8 * len(rows)
