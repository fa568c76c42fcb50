"""The Anthropic Messages and OpenAI Responses APIs of the capture gateway (SPEC §11.4).

Both are translations onto the one capture path of :mod:`ledger.gateway.app`: a request is
mapped to the chat-completion body the gateway records (system / user / assistant / tool
messages, function tools, stop strings, samplers; fields the adapter does not know pass through
to the upstream as before, reserved ones refused), the gateway renders, restores, calls the
engine, records durably and answers a chat completion, which is mapped back into the API's own
response (or its stream of events). Restoration therefore works for every model format
(:mod:`ledger.producers.models`): an assistant turn sent back as Anthropic ``text`` /
``thinking`` / ``tool_use`` blocks or as Responses ``message`` / ``reasoning`` /
``function_call`` items has the same message key as the chat message the gateway answered.

Pure functions over JSON documents; the HTTP handlers live in the gateway's ``make_app``.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

__all__ = ["ApiShapeError", "anthropic_to_chat", "chat_to_anthropic", "anthropic_events", "anthropic_error",
           "responses_to_chat", "chat_to_responses", "responses_events", "responses_messages_of",
           "responses_output_message"]


class ApiShapeError(ValueError):
    """A request the adapter cannot map (HTTP 400 naming ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _text_blocks(value: Any, what: str, kinds: Sequence[str] = ("text",)) -> str:
    """A string, or the text of a list of text blocks (``kinds``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiShapeError(f"{what} must be a string or a list of text blocks", what)
    out = []
    for i, b in enumerate(value):
        if not isinstance(b, dict) or b.get("type") not in kinds or not isinstance(b.get("text"), str):
            raise ApiShapeError(f"{what}[{i}] must be a block of type {' or '.join(kinds)} with a string text", what)
        out.append(b["text"])
    return "\n".join(out)


def _passthrough(body: Mapping[str, Any], known: frozenset[str]) -> dict:
    """Fields the adapter does not interpret: passed on (the gateway refuses reserved ones)."""
    return {k: v for k, v in body.items() if k not in known}


def _positive_int(body: Mapping[str, Any], name: str, required: bool = False) -> int | None:
    v = body.get(name)
    if v is None and not required:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ApiShapeError(f"{name} must be a positive integer", name)
    return v


# ------------------------------------------------------------------ Anthropic Messages
_ANTHROPIC_KNOWN = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
                              "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking", "service_tier",
                              "container", "context_management", "mcp_servers"})
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                     429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    """An error in the Anthropic API's shape."""
    return {"type": "error", "error": {"type": _ANTHROPIC_ERRORS.get(status, "api_error"), "message": message}}


def _function_tools(tools: Any, accepts: Any, what: str, schema: str) -> list[dict] | None:
    """Another API's client tools as Chat Completions function tools (None when absent): each a dict with a
    string ``name`` that ``accepts``, else refused naming ``what`` it must be; ``schema``: its parameters' key."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ApiShapeError("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not accepts(t):
            raise ApiShapeError(f"tools[{i}] must be {what}", "tools")
        fn = {"name": t["name"], "parameters": t.get(schema) or {"type": "object", "properties": {}}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _anthropic_tools(tools: Any) -> list[dict] | None:
    return _function_tools(tools, lambda t: t.get("type") in (None, "custom"),
                           "a client tool with a name and an input_schema (server tools are not served by the gateway)",
                           "input_schema")


def _anthropic_user(content: Any, i: int) -> list[dict]:
    """A user message: its tool_result blocks become tool messages, its text blocks a user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise ApiShapeError(f"messages[{i}].content must be a string or a list of blocks", "messages")
    out: list[dict] = []
    text: list[str] = []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_result" and isinstance(b.get("tool_use_id"), str):
            if text:
                out.append({"role": "user", "content": "\n".join(text)})
                text = []
            body = b.get("content", "")
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                        "content": _text_blocks(body, f"messages[{i}].content[{j}].content")})
        else:
            raise ApiShapeError(f"messages[{i}].content[{j}]: a user block must be text or tool_result "
                                f"(not {kind!r})", "messages")
    if text or not out:
        out.append({"role": "user", "content": "\n".join(text)})
    return out


def _anthropic_assistant(content: Any, i: int) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise ApiShapeError(f"messages[{i}].content must be a string or a list of blocks", "messages")
    text, thinking, calls = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and isinstance(b.get("id"), str) and isinstance(b.get("name"), str) \
                and isinstance(b.get("input", {}), dict):
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}),
                                                                                   ensure_ascii=False)}})
        else:
            raise ApiShapeError(f"messages[{i}].content[{j}]: an assistant block must be text, thinking or "
                                f"tool_use with its fields (not {kind!r})", "messages")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def anthropic_to_chat(body: Any) -> dict:
    """The chat-completion body of an Anthropic ``POST /v1/messages`` body."""
    if not isinstance(body, dict):
        raise ApiShapeError("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiShapeError("messages must be a non-empty list", "messages")
    out: list[dict] = []
    if body.get("system") not in (None, "", []):
        out.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out.extend(_anthropic_user(m.get("content"), i))
        elif role == "assistant":
            out.append(_anthropic_assistant(m.get("content"), i))
        else:
            raise ApiShapeError(f"messages[{i}] must be an object with role user or assistant", "messages")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise ApiShapeError("stop_sequences must be a list of strings", "stop_sequences")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": out,
                            "max_tokens": _positive_int(body, "max_tokens", required=True),
                            **_passthrough(body, _ANTHROPIC_KNOWN)}
    for k in ("temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            chat[k] = body[k]
    tools = _anthropic_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if stops:
        chat["stop"] = stops
    return chat


def _tool_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def chat_to_anthropic(resp: Mapping[str, Any]) -> dict:
    """The Anthropic message of a recorded chat completion."""
    msg = resp["choices"][0]["message"]
    blocks: list[dict] = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for tc in msg.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                       "input": _tool_input(tc["function"]["arguments"])})
    finish = resp["choices"][0]["finish_reason"]
    stop_seq = (resp.get("ledger") or {}).get("stop_sequence")
    reason = {"tool_calls": "tool_use", "length": "max_tokens"}.get(finish) or (
        "stop_sequence" if stop_seq else "end_turn")
    return {"id": "msg_" + resp["id"].removeprefix("chatcmpl-"), "type": "message", "role": "assistant",
            "model": resp["model"], "content": blocks, "stop_reason": reason,
            "stop_sequence": stop_seq if reason == "stop_sequence" else None,
            "usage": {"input_tokens": resp["usage"]["prompt_tokens"], "output_tokens": resp["usage"]["completion_tokens"],
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            "ledger": resp.get("ledger")}


def anthropic_events(message: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """The Anthropic stream of a message: message_start, content_block_* per block, message_delta, message_stop."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**message["usage"], "output_tokens": 0}}
    start.pop("ledger", None)
    events: list[tuple[str, dict]] = [("message_start", {"type": "message_start", "message": start})]
    for i, b in enumerate(message["content"]):
        if b["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": b["text"]}
        elif b["type"] == "thinking":
            first, delta = {"type": "thinking", "thinking": "", "signature": ""}, \
                {"type": "thinking_delta", "thinking": b["thinking"]}
        else:
            first = {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}
        events += [("content_block_start", {"type": "content_block_start", "index": i, "content_block": first}),
                   ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
                   ("content_block_stop", {"type": "content_block_stop", "index": i})]
    events += [("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": message["stop_reason"],
                                            "stop_sequence": message["stop_sequence"]},
                                  "usage": {"output_tokens": message["usage"]["output_tokens"]},
                                  "ledger": message.get("ledger")}),
               ("message_stop", {"type": "message_stop"})]
    return events


# ------------------------------------------------------------------ OpenAI Responses
_RESPONSES_KNOWN = frozenset({"model", "input", "instructions", "tools", "tool_choice", "previous_response_id",
                              "stream", "stream_options", "max_output_tokens", "temperature", "top_p", "store",
                              "metadata", "parallel_tool_calls", "reasoning", "text", "include", "truncation", "user",
                              "service_tier", "prompt_cache_key", "safety_identifier", "background", "top_logprobs",
                              "max_tool_calls", "prompt_cache_retention"})


def _responses_tools(tools: Any) -> list[dict] | None:
    return _function_tools(tools, lambda t: t.get("type") == "function",
                           "a function tool with a name (hosted tools are not served by the gateway)", "parameters")


def _item_text(content: Any, where: str) -> str:
    return _text_blocks(content, where, ("input_text", "output_text", "text"))


def responses_messages_of(items: Any) -> list[dict]:
    """Chat messages of Responses input items (a string is one user message). Function calls
    join the assistant message before them; reasoning items are dropped (the recorded output
    tokens, restored by message key, hold the reasoning)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiShapeError("input must be a string or a list of items", "input")
    out: list[dict] = []
    for i, it in enumerate(items):
        kind = it.get("type", "message") if isinstance(it, dict) else None
        where = f"input[{i}]"
        if kind == "message" and it.get("role") in ("user", "system", "developer", "assistant"):
            role = "system" if it["role"] == "developer" else it["role"]
            out.append({"role": role, "content": _item_text(it.get("content", ""), where + ".content")})
        elif kind == "function_call" and all(isinstance(it.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": it["call_id"], "type": "function", "function": {"name": it["name"],
                                                                           "arguments": it["arguments"]}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output" and isinstance(it.get("call_id"), str):
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": _item_text(it.get("output", ""), where + ".output")})
        elif kind == "reasoning":
            continue
        else:
            raise ApiShapeError(f"{where}: an input item must be a message, function_call, function_call_output or "
                                f"reasoning item with its fields (not {kind!r})", "input")
    return out


def responses_to_chat(body: Any, earlier: Sequence[Mapping[str, Any]] = ()) -> tuple[dict, list[dict]]:
    """(the chat-completion body, the new messages) of a Responses ``POST /v1/responses`` body;
    ``earlier`` is the conversation of its ``previous_response_id`` (its output included)."""
    if not isinstance(body, dict):
        raise ApiShapeError("the request body must be a JSON object")
    new = responses_messages_of(body.get("input", []))
    if not new and not earlier:
        raise ApiShapeError("input must not be empty", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiShapeError("instructions must be a string", "instructions")
    history = [dict(m) for m in earlier if m.get("role") != "system" or instructions is None]
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + new
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages,
                            **_passthrough(body, _RESPONSES_KNOWN)}
    n = _positive_int(body, "max_output_tokens")
    if n is not None:
        chat["max_tokens"] = n
    for k in ("temperature", "top_p"):
        if body.get(k) is not None:
            chat[k] = body[k]
    tools = _responses_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    return chat, new


def _output_items(resp: Mapping[str, Any], rid: str) -> list[dict]:
    msg = resp["choices"][0]["message"]
    items: list[dict] = []
    if msg.get("reasoning_content"):
        items.append({"type": "reasoning", "id": f"rs_{rid}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}]})
    if msg.get("content"):
        items.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": msg["content"], "annotations": [], "logprobs": []}]})
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        items.append({"type": "function_call", "id": f"fc_{rid}_{i}", "call_id": tc["id"],
                      "name": tc["function"]["name"], "arguments": tc["function"]["arguments"], "status": "completed"})
    return items


def chat_to_responses(resp: Mapping[str, Any], response_id: str, *, previous: str | None = None,
                      instructions: str | None = None, tools: Sequence[Mapping[str, Any]] = ()) -> dict:
    """The Responses object of a recorded chat completion."""
    rid = response_id.removeprefix("resp_")
    finish = resp["choices"][0]["finish_reason"]
    usage = resp["usage"]
    return {"id": response_id, "object": "response", "created_at": resp["created"], "model": resp["model"],
            "status": "incomplete" if finish == "length" else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "error": None, "instructions": instructions, "previous_response_id": previous,
            "output": _output_items(resp, rid), "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": list(tools), "temperature": None, "top_p": None, "metadata": {}, "store": True,
            "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]},
            "ledger": resp.get("ledger")}


def responses_output_message(resp: Mapping[str, Any]) -> dict:
    """The assistant message of a chat completion as the conversation of its response keeps it."""
    msg = resp["choices"][0]["message"]
    out: dict[str, Any] = {"role": "assistant", "content": msg.get("content") or ""}
    if msg.get("tool_calls"):
        out["tool_calls"] = [{"id": tc["id"], "type": "function", "function": dict(tc["function"])}
                             for tc in msg["tool_calls"]]
    return out


def _item_events(i: int, item: Mapping[str, Any]) -> list[dict]:
    """Events of one output item: added, its content (text or arguments) streamed, done."""
    evs: list[dict] = []
    if item["type"] == "message":
        part = item["content"][0]
        evs += [{"type": "response.output_item.added", "output_index": i,
                 "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": i, "content_index": 0,
                 "part": {**part, "text": ""}},
                {"type": "response.output_text.delta", "item_id": item["id"], "output_index": i, "content_index": 0,
                 "delta": part["text"], "logprobs": []},
                {"type": "response.output_text.done", "item_id": item["id"], "output_index": i, "content_index": 0,
                 "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", "item_id": item["id"], "output_index": i, "content_index": 0,
                 "part": part}]
    elif item["type"] == "function_call":
        evs += [{"type": "response.output_item.added", "output_index": i,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": i,
                 "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": i,
                 "name": item["name"], "arguments": item["arguments"]}]
    else:
        evs.append({"type": "response.output_item.added", "output_index": i, "item": item})
    evs.append({"type": "response.output_item.done", "output_index": i, "item": item})
    return evs


def responses_events(response: Mapping[str, Any]) -> list[dict]:
    """The Responses stream of a response: created, in_progress, each item's events, completed."""
    pending = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    pending.pop("ledger", None)
    evs = [{"type": "response.created", "response": pending}, {"type": "response.in_progress", "response": pending}]
    for i, item in enumerate(response["output"]):
        evs += _item_events(i, item)
    final = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    evs.append({"type": final, "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(evs)]

