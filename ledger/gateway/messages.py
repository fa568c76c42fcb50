"""Anthropic Messages (``POST /v1/messages``, ``/v1/messages/count_tokens``, SPEC §11.4).

A request is mapped onto the chat-completion body the gateway records (system / user / assistant / tool
messages, function tools, stop strings, samplers; fields the mapping does not know pass through to the
upstream, reserved ones refused), answered by the protocol-neutral call path (:mod:`ledger.gateway.calls`)
and mapped back into an Anthropic message (or its stream of events); errors in the Anthropic shape.
An assistant turn sent back as ``text`` / ``thinking`` / ``tool_use`` blocks has the same message key as the
chat message the gateway answered, so restoration works for every model format.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from aiohttp import web

from ledger.gateway.calls import Gateway, GatewayError, _Headers
from ledger.gateway.endpoint import error_response, handler, read_json, sse
from ledger.gateway.shapes import ApiShapeError, function_tools, passthrough, positive_int, text_blocks

__all__ = ["anthropic_error", "anthropic_events", "anthropic_to_chat", "chat_to_anthropic", "register"]

_ANTHROPIC_KNOWN = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
                              "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking", "service_tier",
                              "container", "context_management", "mcp_servers"})
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                     429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    """An error in the Anthropic API's shape."""
    return {"type": "error", "error": {"type": _ANTHROPIC_ERRORS.get(status, "api_error"), "message": message}}


def _anthropic_tools(tools: Any) -> tuple[list[dict] | None, list[str]]:
    """(the client tools as function tools, the server tools left out: ``web_search_*``, ``code_execution_*``,
    ... which the engine cannot run; named in the request's ``tools_dropped`` metadata, SPEC 12.1)."""
    if not isinstance(tools, list):
        return function_tools(tools, lambda t: True, "", "input_schema"), []
    client = [t for t in tools if not isinstance(t, dict) or t.get("type") in (None, "custom")]
    dropped = [str(t.get("name") or t.get("type")) for t in tools
               if isinstance(t, dict) and t.get("type") not in (None, "custom")]
    return function_tools(client, lambda t: True, "a client tool with a name and an input_schema",
                          "input_schema"), dropped


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
                        "content": text_blocks(body, f"messages[{i}].content[{j}].content")})
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
        out.append({"role": "system", "content": text_blocks(body["system"], "system")})
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out.extend(_anthropic_user(m.get("content"), i))
        elif role == "assistant":
            out.append(_anthropic_assistant(m.get("content"), i))
        elif role == "system":  # a mid-conversation system message (Claude Code's beta; SPEC 12.1)
            out.append({"role": "system", "content": text_blocks(m.get("content", ""), f"messages[{i}].content")})
        else:
            raise ApiShapeError(f"messages[{i}] must be an object with role user, assistant or system", "messages")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)):
        raise ApiShapeError("stop_sequences must be a list of strings", "stop_sequences")
    chat: dict[str, Any] = {"model": body.get("model"), "messages": out,
                            "max_tokens": positive_int(body, "max_tokens", required=True),
                            **passthrough(body, _ANTHROPIC_KNOWN)}
    for k in ("temperature", "top_p", "top_k"):
        if body.get(k) is not None:
            chat[k] = body[k]
    tools, dropped = _anthropic_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if dropped:
        chat["x_ledger_tools_dropped"] = dropped
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


def _error_shape(status: int, message: str, _type: str, _param: str | None = None) -> dict:
    return anthropic_error(status, message)


async def _adapt_messages(gw: Gateway, h: _Headers, body: Any) -> tuple[dict, dict]:
    chat = gw.parse_body(anthropic_to_chat(body))
    return body, chat_to_anthropic(await gw.chat(h, chat))


def _stream_of(resp: dict) -> list[bytes]:
    return [sse(name, ev) for name, ev in anthropic_events(resp)]


def _count_tokens(gw: Gateway):
    async def count_tokens(request: web.Request) -> web.Response:  # Anthropic's /v1/messages/count_tokens
        try:
            body = await read_json(request)
            if isinstance(body, dict) and "max_tokens" not in body:  # not part of a count request
                body = {**body, "max_tokens": 1}
            n = await gw.count_tokens(request.headers, request.match_info.get("execution_id"),
                                      gw.parse_body(anthropic_to_chat(body)))
        except (GatewayError, ApiShapeError) as exc:
            return error_response(exc, _error_shape)
        return web.json_response({"input_tokens": n})
    return count_tokens


def register(app: web.Application, gw: Gateway, prefixes: tuple[str, ...]) -> None:
    """``POST {prefix}/v1/messages`` and ``{prefix}/v1/messages/count_tokens`` for each of ``prefixes``."""
    for prefix in prefixes:
        app.router.add_post(prefix + "/v1/messages", handler(gw, _adapt_messages, _error_shape, _stream_of))
        app.router.add_post(prefix + "/v1/messages/count_tokens", _count_tokens(gw))
