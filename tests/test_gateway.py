"""The capture gateway end to end (SPEC §7.6): the official `openai` client drives a tool-calling
harness through `ledger gateway` in front of a real engine (ONNX Runtime running a tiny random
model with the Qwen3.6 vocabulary, served over vLLM's, SGLang's and llama.cpp's wire formats)."""

from __future__ import annotations

import json
import threading

import openai
import pytest

from ledger.cli import main as cli_main
from ledger.producers import chatml
from tests.gateway_helpers import ANSWER, READ_TOOL, SUMMARY, TOOL_CALL, RunningGateway, init_store, inputs_of

pytestmark = pytest.mark.timeout(120)


def _chat(client, messages, constraint, *, tools=(READ_TOOL,), seed=1, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, tools=list(tools) or openai.NOT_GIVEN,
                                          max_tokens=80, seed=seed, extra_body={"constraint": constraint}, **kw)


def _reserialised(msg) -> dict:
    """The assistant message as a harness sends it back: no reasoning, arguments re-serialised
    (other key order, other whitespace)."""
    calls = []
    for tc in msg.tool_calls or ():
        args = json.loads(tc.function.arguments)
        calls.append({"id": tc.id, "type": "function", "function": {
            "name": tc.function.name, "arguments": json.dumps(dict(reversed(list(args.items()))), indent=1)}})
    out = {"role": "assistant", "content": msg.content}
    if calls:
        out["tool_calls"] = calls
    return out


def _new_tokens(new_messages) -> list[int]:
    """Tokens of messages appended after a recorded output (which ends in <|im_end|>)."""
    return chatml.encode("\n") + chatml.render_prompt(new_messages)


def test_tool_loop_with_subagent_and_compaction_is_one_exact_chain(gateway, engine):
    ex = "ex-loop"
    main = gateway.client(ex)
    sub = gateway.client(ex, agent="searcher", tier="sub")
    summ = gateway.client(ex, kind="summary")
    n0 = len(engine.history)
    history = [{"role": "system", "content": "You are a coding agent."},
               {"role": "user", "content": "Fix the failing test in ledger/x.py."}]
    r1 = _chat(main, history, TOOL_CALL, seed=1)
    assert r1.choices[0].finish_reason == "tool_calls"
    call1 = r1.choices[0].message.tool_calls[0]
    assert call1.function.name == "read" and json.loads(call1.function.arguments)["n"] == 3
    assert r1.choices[0].message.reasoning_content  # the <think> block, returned apart
    history += [_reserialised(r1.choices[0].message), {"role": "tool", "tool_call_id": call1.id, "content": "x = 1"}]
    r2 = _chat(main, history, TOOL_CALL, seed=2)
    call2 = r2.choices[0].message.tool_calls[0]

    # a sub-agent answers the second tool call
    s1 = _chat(sub, [{"role": "system", "content": "You search."}, {"role": "user", "content": "find tests"}],
               ANSWER, tools=(), seed=3)
    assert s1.choices[0].finish_reason == "stop" and s1.choices[0].message.content.startswith("Done ")
    # a new user message: the Qwen3 template would now drop the earlier <think> blocks
    history += [_reserialised(r2.choices[0].message),
                {"role": "tool", "tool_call_id": call2.id, "content": s1.choices[0].message.content},
                {"role": "user", "content": "Also run the tests."}]
    r3 = _chat(main, history, TOOL_CALL, seed=4)
    call3 = r3.choices[0].message.tool_calls[0]
    history += [_reserialised(r3.choices[0].message), {"role": "tool", "tool_call_id": call3.id, "content": "1 passed"}]
    # compaction: a summary turn, then the history restarts from the summary
    c1 = _chat(summ, history + [{"role": "user", "content": "Summarise."}], SUMMARY, seed=5)
    restart = [history[0], {"role": "user", "content": "Fix the test. So far: " + c1.choices[0].message.content}]
    r4 = _chat(main, restart, TOOL_CALL, seed=6)
    call4 = r4.choices[0].message.tool_calls[0]
    r5 = _chat(main, restart + [_reserialised(r4.choices[0].message),
                                {"role": "tool", "tool_call_id": call4.id, "content": "ok"}], ANSWER, seed=7)

    reqs = gateway.lines(execution=ex)
    rids = [r["request_id"] for r in reqs]
    order = [r.ledger if hasattr(r, "ledger") else r.model_extra["ledger"] for r in (r1, r2, s1, r3, c1, r4, r5)]
    assert rids == [o["request_id"] for o in order]
    assert [o["match"] for o in order] == ["first", "extends", "first", "extends", "extends", "restart", "extends"]
    assert all(o["drift"] is None for o in order)
    assert all(r["reconstructed"] is False and r["generator"] == "policy" for r in reqs)
    # outputs, log-probs and inputs are exactly what the engine saw and produced
    calls = engine.history[n0:]
    inputs = inputs_of(reqs)
    assert len(calls) == 7
    for req, call in zip(reqs, calls):
        assert req["output_ids"] == call["tokens"]
        assert req["output_logprobs"] == pytest.approx(call["logprobs"], abs=0, rel=1e-6)
        assert inputs[req["request_id"]] == call["prompt"]
        assert gateway.path(ex, req["request_id"]) == call["prompt"] + call["tokens"]
    # one chain: each main call = previous input + output + the new messages' tokens, by prefix reference
    m = {r["request_id"]: r for r in reqs}
    expect = [(r1, r2, history[3:4]), (r2, r3, history[5:7]), (r3, c1, history[8:9] + [{"role": "user",
                                                                                          "content": "Summarise."}])]
    for prev, nxt, new in expect:
        p, n = prev.model_extra["ledger"]["request_id"], nxt.model_extra["ledger"]["request_id"]
        prev_path = inputs[p] + m[p]["output_ids"]
        assert inputs[n] == prev_path + _new_tokens(new)
        assert m[n]["input_prefix"]["request_id"] == p and m[n]["input_prefix"]["length"] == len(prev_path)
    p, n = r4.model_extra["ledger"]["request_id"], r5.model_extra["ledger"]["request_id"]
    assert inputs[n] == inputs[p] + m[p]["output_ids"] + _new_tokens(
        [{"role": "tool", "tool_call_id": call4.id, "content": "ok"}])
    # the earlier <think> blocks are still in r3's input (the template alone would have dropped them)
    think = chatml.THINK_ID
    assert inputs[r3.model_extra["ledger"]["request_id"]].count(chatml.END_THINK_ID) >= 2 or think in m[rids[0]]["output_ids"]
    assert chatml.render_prompt([{"role": "system", "content": "x"}, {"role": "user", "content": "y"},
                                 {"role": "assistant", "content": "a", "reasoning_content": "r"},
                                 {"role": "user", "content": "z"}]).count(chatml.END_THINK_ID) == 0
    # tool payloads: each call's exact text by id, each result once, consumed by the next call
    payloads = {(p["call_id"], p["kind"]): p["payload"] for p in gateway.lines("tool_payload", ex)}
    assert payloads[(call1.id, "call")]["text"] in chatml.decode(m[rids[0]]["output_ids"])
    assert payloads[(call1.id, "call")]["arguments"] == json.loads(call1.function.arguments)
    assert payloads[(call1.id, "result")] == "x = 1"
    assert m[rids[1]]["consumed_tool_call_ids"] == [call1.id] and m[rids[0]]["emitted_tool_call_ids"] == [call1.id]
    assert m[rids[3]]["consumed_tool_call_ids"] == [call2.id]
    assert m[rids[2]]["agent_id"] == "searcher" and m[rids[2]]["agent_tier"] == "sub"
    assert m[rids[4]]["turn_kind"] == "summary"
    # no drift counted; `ledger status --json` says so
    st = _status(gateway)
    assert st["gateway"]["drift"] == {"template": 0, "retokenization": 0, "edited_history": 0, "other": 0}
    assert st["gateway"]["calls"] == 7 and st["gateway"]["by_match"] == {"extends": 4, "first": 2, "restart": 1}


def _status(gateway) -> dict:
    import contextlib
    import io

    gateway.recorder.flush()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["--store", str(gateway.store), "status", "--json"]) == 0
    return json.loads(buf.getvalue())


def test_edited_history_branches_and_counts_as_edited_history(gateway, engine):
    ex = "ex-edit"
    c = gateway.client(ex)
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    r1 = _chat(c, history, TOOL_CALL, seed=11)
    t1 = r1.choices[0].message.tool_calls[0]
    history += [_reserialised(r1.choices[0].message), {"role": "tool", "tool_call_id": t1.id, "content": "original"}]
    r2 = _chat(c, history, TOOL_CALL, seed=12)
    edited = [dict(m) for m in history]
    edited[3] = {"role": "tool", "tool_call_id": t1.id, "content": "edited!"}
    r3 = _chat(c, edited + [_reserialised(r2.choices[0].message)], ANSWER, seed=13)
    led = r3.model_extra["ledger"]
    assert led["match"] == "diverged" and led["drift"] == "edited_history"
    assert led["parent_request_id"] == r2.model_extra["ledger"]["request_id"]
    reqs = gateway.lines(execution=ex)
    inputs = inputs_of(reqs)
    i2, i3 = inputs[reqs[1]["request_id"]], inputs[reqs[2]["request_id"]]
    # the new input branches exactly at the edited tool result: the shared prefix ends inside that turn
    shared = next(i for i, (a, b) in enumerate(zip(i2, i3)) if a != b)
    upto_result = len(inputs[reqs[0]["request_id"]]) + len(reqs[0]["output_ids"]) + len(
        chatml.encode("\n") + chatml.encode("<|im_start|>user\n<tool_response>\n"))
    assert shared == upto_result
    assert chatml.decode(i3[shared:]).startswith("edited!")
    # the edited result is not cached over the original
    results = [p for p in gateway.lines("tool_payload", ex) if p["kind"] == "result"]
    assert [(p["call_id"], p["payload"]) for p in results] == [(t1.id, "original")]
    st = _status(gateway)["gateway"]
    assert st["drift"]["edited_history"] == 1 and sum(st["drift"].values()) == 1


def test_changed_tools_are_template_drift(gateway):
    ex = "ex-tools"
    c = gateway.client(ex)
    history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    r1 = _chat(c, history, TOOL_CALL, seed=21)
    t1 = r1.choices[0].message.tool_calls[0]
    history += [_reserialised(r1.choices[0].message), {"role": "tool", "tool_call_id": t1.id, "content": "r"}]
    other = {"type": "function", "function": {"name": "write", "parameters": {"type": "object"}}}
    r2 = _chat(c, history, ANSWER, tools=(READ_TOOL, other), seed=22)
    assert r2.model_extra["ledger"]["match"] == "extends" and r2.model_extra["ledger"]["drift"] == "template"
    assert _status(gateway)["gateway"]["drift"]["template"] == 1


def test_concurrent_executions_never_mix(gateway, engine):
    errors: list[BaseException] = []

    def harness(k: int) -> None:
        try:
            ex = f"ex-par-{k}"
            c = gateway.client(ex)
            history = [{"role": "system", "content": f"agent {k}"}, {"role": "user", "content": f"task number {k}"}]
            for step in range(3):
                r = _chat(c, history, TOOL_CALL if step < 2 else ANSWER, seed=100 * k + step)
                history.append(_reserialised(r.choices[0].message))
                for tc in r.choices[0].message.tool_calls or ():
                    history.append({"role": "tool", "tool_call_id": tc.id, "content": f"result {k}.{step}"})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=harness, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors
    for k in range(4):
        reqs = gateway.lines(execution=f"ex-par-{k}")
        assert len(reqs) == 3
        inputs = inputs_of(reqs)
        for prev, nxt in zip(reqs, reqs[1:]):
            assert nxt["input_prefix"]["request_id"] == prev["request_id"]
            assert inputs[nxt["request_id"]][:len(inputs[prev["request_id"]])] == inputs[prev["request_id"]]
        text = chatml.decode(inputs[reqs[-1]["request_id"]])
        assert f"task number {k}" in text and f"result {k}.1" in text
        assert not any(f"task number {j}" in text or f"result {j}." in text for j in range(4) if j != k)
    assert sum(_status(gateway)["gateway"]["drift"].values()) == 0


def test_retry_with_same_request_id_is_idempotent(gateway, engine):
    c = gateway.client("ex-retry", **{"X-Ledger-Request-Id": "call-1"})
    msgs = [{"role": "user", "content": "hello"}]
    before = engine.calls
    a = _chat(c, msgs, ANSWER, tools=(), seed=5)
    b = _chat(c, msgs, ANSWER, tools=(), seed=5)
    assert engine.calls == before + 1
    assert a.model_dump() == b.model_dump()
    assert [r["request_id"] for r in gateway.lines(execution="ex-retry")] == ["call-1"]
    assert gateway.recorder.duplicates == 0


def test_streaming_models_and_bad_requests(gateway):
    c = gateway.client("ex-stream")
    chunks = list(_chat(c, [{"role": "user", "content": "go"}], TOOL_CALL, seed=9, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or ())]
    assert len(calls) == 1 and calls[0].function.name == "read"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == len(gateway.lines(execution="ex-stream")[0]["output_ids"])
    assert [m.id for m in openai.OpenAI(base_url=gateway.url + "/v1", api_key="x").models.list()] == ["tiny"]
    nohead = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="X-Ledger-Execution-Id"):
        nohead.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    unknown = openai.OpenAI(base_url=gateway.url + "/executions/nobody/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="X-Ledger-Task-Id"):
        unknown.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError, match="X-Ledger-Agent-Tier"):
        gateway.client("ex-stream", tier="boss").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}])
    assert len(gateway.lines(execution="ex-stream")) == 1


@pytest.mark.parametrize("api", ["sglang", "llamacpp"])
def test_sglang_and_llamacpp_wire_formats_record_the_same_chain(tmp_path, engine, api):
    gw = RunningGateway(init_store(tmp_path / "store"), engine.url, api)
    try:
        c = gw.client("ex-" + api)
        n0 = len(engine.history)
        history = [{"role": "user", "content": "task"}]
        r1 = _chat(c, history, TOOL_CALL, seed=31)
        t1 = r1.choices[0].message.tool_calls[0]
        history += [_reserialised(r1.choices[0].message), {"role": "tool", "tool_call_id": t1.id, "content": "r"}]
        _chat(c, history, ANSWER, seed=32)
        reqs = gw.lines(execution="ex-" + api)
        inputs = inputs_of(reqs)
        for req, call in zip(reqs, engine.history[n0:]):
            assert req["output_ids"] == call["tokens"] and inputs[req["request_id"]] == call["prompt"]
            assert req["output_logprobs"] == pytest.approx(call["logprobs"], rel=1e-6)
        assert inputs[reqs[1]["request_id"]] == inputs[reqs[0]["request_id"]] + reqs[0]["output_ids"] + _new_tokens(
            history[2:])  # the tool result
    finally:
        gw.close()
