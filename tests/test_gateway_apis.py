"""The capture gateway for any harness (SPEC §11.4): the official `anthropic` client's
`messages.create` and the official `openai` client's `responses.create` (streaming and not, tool
turns, `previous_response_id`, across a restart) through the gateway to the real tiny engine —
the log holds exactly what the engine read and wrote, one chain per linear conversation, 0 drift;
credentials are never recorded; errors come back in each API's own shape."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import openai
import pytest

from tests.gateway_helpers import ANSWER, READ_TOOL, TOOL_CALL, GatewayProcess, init_store, log_requests
from tests.test_gateway import _status

pytestmark = pytest.mark.timeout(180)

SECRET = "sk-ant-not-recorded-7f3a"
HEADERS = {"X-Ledger-Deadline": "2030-01-01T00:00:00Z"}
A_TOOL = {"name": "read", "description": "read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}}
R_TOOL = {"type": "function", "name": "read", "description": "read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}}


def _anthropic(url: str, ex: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"{url}/executions/{ex}", api_key=SECRET, max_retries=0, timeout=60,
                               default_headers={**HEADERS, "X-Ledger-Task-Id": f"task-{ex}"})


def _openai(url: str, ex: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/executions/{ex}/v1", api_key=SECRET, max_retries=0, timeout=60,
                         default_headers={**HEADERS, "X-Ledger-Task-Id": f"task-{ex}"})


def _exact_chain(store, engine, ex: str, n0: int, n: int) -> list[dict]:
    """The execution's requests equal the engine's last ``n`` calls, token for token, and form one chain."""
    reqs = log_requests(store, ex)
    calls = engine.history[n0:]
    assert len(reqs) == len(calls) == n
    for req, call in zip(reqs, calls):
        assert (req["input"], req["output"]) == (call["prompt"], call["tokens"])
    for prev, nxt in zip(reqs, reqs[1:]):
        assert nxt["input"][:len(prev["input"]) + len(prev["output"])] == prev["input"] + prev["output"]
        assert nxt["input_prefix"]["request_id"] == prev["request_id"]
    return reqs


def _no_secret(store) -> None:
    for f in store.rglob("*"):
        if f.is_file():
            assert SECRET.encode() not in f.read_bytes(), f


def _anthropic_create(client, stream: bool, **kw):
    if stream:
        with client.messages.stream(**kw) as s:
            return s.get_final_message()
    return client.messages.create(**kw)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_tool_loop_is_one_exact_chain(gateway, engine, stream):
    ex = f"ex-anthropic-{stream}"
    client = _anthropic(gateway.url, ex)
    n0 = len(engine.history)
    msgs = [{"role": "user", "content": "Fix the failing test in x.py."}]
    kw = {"model": "tiny", "max_tokens": 80, "system": "You are a coding agent.", "tools": [A_TOOL]}
    r1 = _anthropic_create(client, stream, messages=msgs, extra_body={"constraint": TOOL_CALL, "seed": 1}, **kw)
    assert r1.stop_reason == "tool_use" and r1.type == "message"
    kinds = [b.type for b in r1.content]
    assert kinds == ["thinking", "tool_use"]
    use = r1.content[1]
    assert use.name == "read" and use.input["n"] == 3
    # the harness sends the blocks back (input re-serialised: other key order) with a tool_result
    blocks = [b.model_dump(exclude_none=True) for b in r1.content]
    blocks[1]["input"] = dict(reversed(list(blocks[1]["input"].items())))
    msgs += [{"role": "assistant", "content": blocks},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "x = 1"}]}]
    r2 = _anthropic_create(client, stream, messages=msgs, extra_body={"constraint": ANSWER, "seed": 2}, **kw)
    assert r2.stop_reason == "end_turn" and r2.content[-1].type == "text"
    assert r2.content[-1].text.startswith("Done ")
    reqs = _exact_chain(gateway.store, engine, ex, n0, 2)
    assert reqs[0]["emitted_tool_call_ids"] == [use.id] and reqs[1]["consumed_tool_call_ids"] == [use.id]
    # the sampling parameters sent upstream are on the request (neutral samplers, the harness's seed)
    assert json.loads(reqs[0]["metadata"]) == {"sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": None,
                                                            "min_p": 0.0, "seed": 1}}
    payloads = {(p["call_id"], p["kind"]): p["payload"] for p in gateway.lines("tool_payload", ex)}
    assert payloads[(use.id, "result")] == "x = 1"
    assert _status(gateway)["gateway"]["drift"] == {"template": 0, "retokenization": 0, "edited_history": 0,
                                                    "other": 0}
    _no_secret(gateway.store)


def test_anthropic_stop_sequences_and_errors(gateway, engine):
    client = _anthropic(gateway.url, "ex-anthropic-stop")
    r = client.messages.create(model="tiny", max_tokens=80, messages=[{"role": "user", "content": "hi"}],
                               stop_sequences=["zz", " "], extra_body={"constraint": ANSWER, "seed": 3})
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", " ")
    assert [b.text for b in r.content if b.type == "text"] == ["Done"]
    with pytest.raises(anthropic.BadRequestError) as exc:  # an image block: not served, Anthropic error shape
        client.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "invalid_request_error"
    assert "user block must be text or tool_result" in exc.value.body["error"]["message"]
    for bad in (b"[1]", b'{"messages": [], "max_tokens": 4}', b'{"messages": [{"role": "user", "content": 3}]}',
                b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "system": [{"type": 1}]}',
                b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "prompt": [1, 2]}'):
        req = urllib.request.Request(gateway.url + "/executions/ex-anthropic-stop/v1/messages", data=bad,
                                     headers={"content-type": "application/json"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 400
        assert json.loads(e.value.read())["type"] == "error"


def _responses_create(client, stream: bool, **kw):
    if stream:
        with client.responses.stream(**kw) as s:
            return s.get_final_response()
    return client.responses.create(**kw)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_loop_with_previous_response_id_is_one_exact_chain(gateway, engine, stream):
    ex = f"ex-responses-{stream}"
    client = _openai(gateway.url, ex)
    n0 = len(engine.history)
    kw = {"model": "tiny", "instructions": "You are a coding agent.", "tools": [R_TOOL], "max_output_tokens": 80}
    r1 = _responses_create(client, stream, input="Fix x.py.", extra_body={"constraint": TOOL_CALL, "seed": 1}, **kw)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert [o.type for o in r1.output] == ["reasoning", "function_call"] and calls[0].name == "read"
    # turn 2: previous_response_id + the function_call_output
    r2 = _responses_create(client, stream, previous_response_id=r1.id,
                           input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "x = 1"}],
                           extra_body={"constraint": TOOL_CALL, "seed": 2}, **kw)
    c2 = [o for o in r2.output if o.type == "function_call"][0]
    assert r2.previous_response_id == r1.id
    # turn 3: the harness sends the whole conversation itself (the output items as it got them)
    items = [{"role": "user", "content": "Fix x.py."}, *[o.model_dump(exclude_none=True) for o in r1.output],
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "x = 1"},
             *[o.model_dump(exclude_none=True) for o in r2.output],
             {"type": "function_call_output", "call_id": c2.call_id, "output": "ok"}]
    r3 = _responses_create(client, stream, input=items, extra_body={"constraint": ANSWER, "seed": 3}, **kw)
    assert r3.status == "completed" and r3.output_text.startswith("Done ")
    reqs = _exact_chain(gateway.store, engine, ex, n0, 3)
    assert reqs[1]["consumed_tool_call_ids"] == [calls[0].call_id] and reqs[2]["consumed_tool_call_ids"] == [c2.call_id]
    assert [r.model_extra["ledger"]["match"] for r in (r1, r2, r3)] == ["first", "extends", "extends"]
    got = client.responses.retrieve(r2.id)
    assert got.id == r2.id and [o.to_dict() for o in got.output] == [
        {k: v for k, v in o.to_dict().items() if k != "parsed_arguments"} for o in r2.output]
    assert _status(gateway)["gateway"]["drift"]["edited_history"] == 0
    _no_secret(gateway.store)


def test_responses_errors(gateway):
    client = _openai(gateway.url, "ex-responses-err")
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert "previous response 'resp_nope' not found" in exc.value.body["message"]
    # a hosted tool is left out and named, never a refusal that ends the session (SPEC 12.1)
    r = client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}], max_output_tokens=8)
    assert r.status in ("completed", "incomplete")
    (line,) = gateway.lines(execution="ex-responses-err")
    assert json.loads(line["metadata"])["tools_dropped"] == ["web_search"] if isinstance(line["metadata"], str) \
        else line["metadata"]["tools_dropped"] == ["web_search"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input=[{"type": "item_reference", "id": "x"}])


def test_previous_response_id_survives_a_restart(tmp_path, engine):
    store = init_store(tmp_path / "store")
    ex = "ex-responses-restart"
    a = GatewayProcess(store, engine.url, no_auth=True)  # the SDK key is SECRET (never recorded): no credentials
    n0 = len(engine.history)
    kw = {"model": "tiny", "tools": [R_TOOL], "max_output_tokens": 80}
    r1 = _openai(a.url, ex).responses.create(input="Fix x.py.", extra_body={"constraint": TOOL_CALL, "seed": 1}, **kw)
    call = [o for o in r1.output if o.type == "function_call"][0]
    a.kill()
    b = GatewayProcess(store, engine.url, no_auth=True)
    try:
        client = _openai(b.url, ex)
        assert client.responses.retrieve(r1.id).output == r1.output
        r2 = client.responses.create(previous_response_id=r1.id, input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "x = 1"}],
            extra_body={"constraint": ANSWER, "seed": 2}, **kw)
        assert r2.model_extra["ledger"]["match"] == "extends"
        _exact_chain(store, engine, ex, n0, 2)
    finally:
        b.stop()


def test_chat_template_kwargs_on_the_qwen_path(gateway, engine):
    """enable_thinking=false renders the Qwen3 template's empty think block; other keys are a clear 400."""
    from ledger.producers import chatml

    client = gateway.client("ex-kwargs")
    msgs = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}, "seed": 1,
                                               "constraint": ANSWER})
    assert engine.history[-1]["prompt"] == chatml.render_prompt(msgs) + chatml.encode("<think>\n\n</think>\n\n")
    for bad, message in (({"reasoning_effort": "low"}, "'reasoning_effort' is not supported with a qwen_tokenizer"),
                         ({"enable_thinking": "no"}, "enable_thinking must be true or false")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                           extra_body={"chat_template_kwargs": bad})
        assert message in exc.value.body["message"] and exc.value.body["param"] == "chat_template_kwargs"


def test_anthropic_count_tokens_counts_what_the_engine_reads_and_records_nothing(gateway, engine):
    """`messages.count_tokens` (Anthropic's shape, {"input_tokens": N}) renders with the gateway's
    template and tokenizer -- restoration included, so a continuation counts the recorded thinking
    tokens the template would drop -- and opens or records nothing."""
    ex = "ex-count"
    client = _anthropic(gateway.url, ex)
    kw = {"model": "tiny", "system": "You are a coding agent.", "tools": [A_TOOL]}
    msgs = [{"role": "user", "content": "Fix the failing test in x.py."}]
    counted = client.messages.count_tokens(messages=msgs, **kw).input_tokens
    assert gateway.lines("execution_opened", ex) == [] and gateway.lines("request", ex) == []
    n0 = len(engine.history)
    r1 = client.messages.create(messages=msgs, max_tokens=80, extra_body={"constraint": ANSWER, "seed": 1}, **kw)
    assert counted == len(engine.history[n0]["prompt"]) == r1.usage.input_tokens
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r1.content]},
             {"role": "user", "content": "Now run it."}]
    counted = client.messages.count_tokens(messages=msgs, **kw).input_tokens
    client.messages.create(messages=msgs, max_tokens=80, extra_body={"constraint": ANSWER, "seed": 2}, **kw)
    assert counted == len(engine.history[n0 + 1]["prompt"])
    assert len(log_requests(gateway.store, ex)) == 2  # the counts recorded nothing
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.count_tokens(model="tiny", messages=[])
    assert exc.value.body["type"] == "error"


def test_sub_agents_without_headers_become_their_own_agents(gateway, engine):
    """No X-Ledger-Agent-Id: a conversation that opens like no recorded chain of the execution (a
    sub-agent the harness spawned) is recorded as a new agent sub-N, tier sub, with its own chain;
    continuations find their own agent; nothing counts as drift."""
    client = _openai(gateway.url, "ex-subagents")
    seed = iter(range(100, 200))

    def turn(msgs, tools=(READ_TOOL,)):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=60, tools=list(tools) or None,
                                           extra_body={"constraint": ANSWER, "seed": next(seed)})
        return msgs + [{"role": "assistant", "content": r.choices[0].message.content}]

    # a side call first (a session title: no tools) never takes main's place (SPEC 12.1)
    title = turn([{"role": "system", "content": "Write a title."}, {"role": "user", "content": "Fix x.py."}], ())
    main = turn([{"role": "system", "content": "You lead."}, {"role": "user", "content": "Fix x.py."}])
    sub = turn([{"role": "system", "content": "You search files."}, {"role": "user", "content": "Find x.py."}])
    sub = turn(sub + [{"role": "user", "content": "And y.py?"}])
    main = turn(main + [{"role": "user", "content": "Run the tests."}])
    turn([{"role": "system", "content": "You lead."}, {"role": "user", "content": "Review the fix."}])
    reqs = log_requests(gateway.store, "ex-subagents")
    assert title[0]["content"] == "Write a title."
    assert [(r["agent_id"], r["agent_tier"]) for r in reqs] == [("aux-1", "sub"), ("main", "main"), ("sub-1", "sub"),
                                                                ("sub-1", "sub"), ("main", "main"), ("sub-2", "sub")]
    reqs = reqs[1:]
    assert reqs[2]["input_prefix"]["request_id"] == reqs[1]["request_id"]
    assert reqs[3]["input_prefix"]["request_id"] == reqs[0]["request_id"]
    assert reqs[1]["parent_request_id"] is None and reqs[4]["parent_request_id"] is None
    assert _status(gateway)["gateway"]["drift"] == {"template": 0, "retokenization": 0, "edited_history": 0,
                                                    "other": 0}


# ------------------------------------------------------------------ tools of the two APIs mapped onto one shape
@pytest.mark.parametrize("tools, message", [
    ("x", "tools must be a list"),
    ([{"input_schema": {}}], "tools[0] must be a client tool with a name and an input_schema"),
])
def test_anthropic_tools_refused_name_the_tool(tools, message):
    from ledger.gateway.messages import anthropic_to_chat
    from ledger.gateway.shapes import ApiShapeError

    with pytest.raises(ApiShapeError) as e:
        anthropic_to_chat({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                           "tools": tools})
    assert str(e.value) == message and e.value.param == "tools"


@pytest.mark.parametrize("tools, message", [
    ({}, "tools must be a list"),
    ([{"type": "function", "name": 3}], "tools[0] must be a function tool with a name"),
    ([{"type": "namespace", "name": "ns"}], "tools[0]: a namespace tool needs a string name and a list of tools"),
])
def test_responses_tools_refused_name_the_tool(tools, message):
    from ledger.gateway.responses import responses_to_chat
    from ledger.gateway.shapes import ApiShapeError

    with pytest.raises(ApiShapeError) as e:
        responses_to_chat({"model": "tiny", "input": "hi", "tools": tools})
    assert str(e.value) == message and e.value.param == "tools"


def test_hosted_tools_are_left_out_and_named_never_refused():
    """SPEC 12.1: a hosted tool the engine cannot run (Codex's ``web_search``, Claude's server tools) is
    not rendered and is listed as ``tools_dropped``; a ``namespace`` tool's functions are flattened."""
    from ledger.gateway.messages import anthropic_to_chat
    from ledger.gateway.responses import responses_to_chat

    fn = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
    spawn = {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}
    r, _ = responses_to_chat({"model": "tiny", "input": "hi", "tools": [
        fn, {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [spawn]},
        {"type": "web_search", "external_web_access": False}, {"type": "image_generation"}]})
    assert [t["function"]["name"] for t in r["tools"]] == ["exec_command", "spawn_agent"]
    assert r["x_ledger_tools_dropped"] == ["web_search", "image_generation"]
    a = anthropic_to_chat({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                           "tools": [{"type": "web_search_20250305", "name": "web_search"},
                                     {"name": "Bash", "input_schema": {"type": "object"}}]})
    assert [t["function"]["name"] for t in a["tools"]] == ["Bash"]
    assert a["x_ledger_tools_dropped"] == ["web_search"]


def test_a_namespaced_call_comes_back_with_its_namespace():
    from ledger.gateway.responses import chat_to_responses

    resp = {"id": "chatcmpl-x", "created": 1, "model": "tiny", "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                                         "total_tokens": 2},
            "choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "spawn_agent", "arguments": "{}"}},
                {"id": "call_2", "type": "function", "function": {"name": "exec_command", "arguments": "{}"}}]}}]}
    tools = [{"type": "namespace", "name": "multi_agent_v1", "tools": [{"type": "function", "name": "spawn_agent"}]},
             {"type": "function", "name": "exec_command"}]
    out = chat_to_responses(resp, "resp_abc", tools=tools)["output"]
    assert [(o["name"], o.get("namespace")) for o in out] == [("spawn_agent", "multi_agent_v1"), ("exec_command", None)]


def test_tools_of_both_apis_become_the_same_function_tools():
    from ledger.gateway.messages import anthropic_to_chat
    from ledger.gateway.responses import responses_to_chat

    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    a = anthropic_to_chat({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                           "tools": [{"name": "read", "description": "Read a file", "input_schema": schema},
                                     {"type": "custom", "name": "ls"}]})
    r, _ = responses_to_chat({"model": "tiny", "input": "hi", "tools": [
        {"type": "function", "name": "read", "description": "Read a file", "parameters": schema},
        {"type": "function", "name": "ls"}]})
    assert a["tools"] == r["tools"] == [
        {"type": "function", "function": {"name": "read", "parameters": schema, "description": "Read a file"}},
        {"type": "function", "function": {"name": "ls", "parameters": {"type": "object", "properties": {}}}}]
