"""OpenAI Responses (``POST /v1/responses``, ``GET /v1/responses/{id}``, SPEC §11.4), with its stored responses.

A request is mapped onto the chat-completion body the gateway records (``previous_response_id`` resolved to
the conversation it stands for, kept in ``gateway.db``'s ``responses`` table), answered by the
protocol-neutral call path (:mod:`ledger.gateway.calls`) and mapped back into a Responses object (or its
stream of events); errors in the OpenAI shape. An assistant turn sent back as ``message`` / ``reasoning`` /
``function_call`` items has the same message key as the chat message the gateway answered.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from typing import Any, Mapping, Sequence

from aiohttp import web

from ledger.gateway import store
from ledger.gateway.auth import request_token
from ledger.gateway.calls import Gateway, GatewayError, _Headers
from ledger.gateway.endpoint import error_document, error_response, handler, openai_error, sse
from ledger.gateway.shapes import ApiShapeError, function_tools, passthrough, positive_int, text_blocks
from ledger.gateway.upstream import UpstreamError

__all__ = ["StoredResponses", "chat_to_responses", "register", "response_id", "responses_events",
           "responses_messages_of", "responses_output_message", "responses_to_chat"]

_RESPONSES_KNOWN = frozenset({"model", "input", "instructions", "tools", "tool_choice", "previous_response_id",
                              "stream", "stream_options", "max_output_tokens", "temperature", "top_p", "store",
                              "metadata", "parallel_tool_calls", "reasoning", "text", "include", "truncation", "user",
                              "service_tier", "prompt_cache_key", "safety_identifier", "background", "top_logprobs",
                              "max_tool_calls", "prompt_cache_retention", "client_metadata", "context_management",
                              "conversation", "stream_id", "generate"})


def served_tools(tools: Any) -> tuple[list | None, dict[str, str], list[str]]:
    """(the function tools the engine can run, {tool name: its namespace}, the tools left out) of a Responses
    ``tools`` list (SPEC 12.1): a ``namespace`` tool's functions are flattened under their own names (a call
    of one comes back with its ``namespace``, as Codex routes it); hosted tools (``web_search``, ``file_search``,
    ...) the engine cannot run are left out and named in the request's ``tools_dropped`` metadata."""
    if tools is None:
        return None, {}, []
    if not isinstance(tools, list):
        raise ApiShapeError("tools must be a list", "tools")
    flat: list = []
    spaces: dict[str, str] = {}
    dropped: list[str] = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "namespace":
            inner = t.get("tools")
            if not isinstance(t.get("name"), str) or not isinstance(inner, list):
                raise ApiShapeError(f"tools[{i}]: a namespace tool needs a string name and a list of tools", "tools")
            for j, f in enumerate(inner):
                if isinstance(f, dict) and f.get("type") == "function":
                    flat.append(f)
                    spaces[str(f.get("name"))] = t["name"]
                elif isinstance(f, dict):
                    dropped.append(f"{t['name']}.{f.get('name') or f.get('type')}")
                else:
                    raise ApiShapeError(f"tools[{i}].tools[{j}] must be an object", "tools")
        elif kind == "function" or not isinstance(t, dict):
            flat.append(t)
        else:
            dropped.append(str(t.get("name") or kind))
    out = function_tools(flat, lambda t: t.get("type") == "function", "a function tool with a name", "parameters")
    return out, spaces, dropped


def _item_text(content: Any, where: str) -> str:
    return text_blocks(content, where, ("input_text", "output_text", "text"))


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
                            **passthrough(body, _RESPONSES_KNOWN)}
    n = positive_int(body, "max_output_tokens")
    if n is not None:
        chat["max_tokens"] = n
    for k in ("temperature", "top_p"):
        if body.get(k) is not None:
            chat[k] = body[k]
    tools, _spaces, dropped = served_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if dropped:
        chat["x_ledger_tools_dropped"] = dropped
    return chat, new


def _output_items(resp: Mapping[str, Any], rid: str, spaces: Mapping[str, str] = {}) -> list[dict]:
    msg = resp["choices"][0]["message"]
    items: list[dict] = []
    if msg.get("reasoning_content"):
        # encrypted_content: an opaque reference a stateless client (store: false) sends back; the gateway
        # restores the recorded tokens by message key, so it carries nothing the model reads
        items.append({"type": "reasoning", "id": f"rs_{rid}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": msg["reasoning_content"]}],
                      "encrypted_content": f"ledger:{rid}"})
    if msg.get("content"):
        items.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": msg["content"], "annotations": [], "logprobs": []}]})
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        item = {"type": "function_call", "id": f"fc_{rid}_{i}", "call_id": tc["id"],
                "name": tc["function"]["name"], "arguments": tc["function"]["arguments"], "status": "completed"}
        if tc["function"]["name"] in spaces:
            item["namespace"] = spaces[tc["function"]["name"]]
        items.append(item)
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
            "output": _output_items(resp, rid, served_tools(list(tools))[1]), "parallel_tool_calls": True, "tool_choice": "auto",
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


# ------------------------------------------------------------------ stored responses
def response_id(execution_id: str, request_id: str) -> str:
    """The Responses id of a call: derived from its ids, so a retried call gets the same one."""
    return "resp_" + hashlib.sha256(f"{execution_id}\x00{request_id}".encode()).hexdigest()[:40]


class StoredResponses:
    """What ``previous_response_id`` and ``GET /v1/responses/{id}`` resolve to: rows of ``gateway.db``
    (the gateway's connection and lock), the latest conversations cached."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._conversations: OrderedDict[str, tuple[str, list[dict]]] = OrderedDict()  # response id -> (ex, messages)

    def _row(self, response_id: str) -> tuple | None:
        with self.gw._db_lock:
            return store.response_row(self.gw.db, response_id)

    def conversation(self, response_id: str, execution_id: str) -> list[dict]:
        """The messages ``previous_response_id`` stands for: its chain's inputs and outputs, oldest first."""
        chain: list[list[dict]] = []
        rid: str | None = response_id
        while rid is not None and rid not in self._conversations:
            row = self._row(rid)
            if row is None or row[0] != execution_id:
                break
            chain.append(json.loads(row[3]))
            rid = row[2]
        if rid is not None and self._conversations.get(rid, ("",))[0] != execution_id:
            raise GatewayError(400, f"previous response {rid!r} not found in execution {execution_id!r}",
                               param="previous_response_id")
        messages = list(self._conversations[rid][1]) if rid is not None else []
        for part in reversed(chain):
            messages += part
        self._cache(response_id, execution_id, messages)
        return messages

    def _cache(self, response_id: str, execution_id: str, messages: list[dict]) -> None:
        self._conversations[response_id] = (execution_id, messages)
        self._conversations.move_to_end(response_id)
        while len(self._conversations) > 1024:
            self._conversations.popitem(last=False)

    def remember(self, response_id: str, h: _Headers, previous: str | None, earlier: list[dict],
                 messages: list[dict], meta: Mapping[str, Any]) -> None:
        """Keep what a later ``previous_response_id`` needs (committed before the response is sent)."""
        with self.gw._db_lock:
            store.insert_response(self.gw.db, response_id, h.execution_id, h.request_id, previous, messages, meta)
        self._cache(response_id, h.execution_id, earlier + messages)

    async def stored(self, response_id: str, path_execution: str | None) -> tuple[dict, dict]:
        """(the chat completion, the row's meta) of a response this gateway answered (404 otherwise)."""
        row = await asyncio.to_thread(self._row, response_id)
        if row is None or (path_execution is not None and row[0] != path_execution):
            raise GatewayError(404, f"response {response_id!r} not found", "not_found_error")
        h = _Headers(row[0], "main", "main", "task", row[1], True, None, None)
        await self.gw.ensure_execution(h)
        resp = self.gw.done.get((row[0], row[1]))
        if resp is None:
            raise GatewayError(404, f"response {response_id!r} is no longer on the log", "not_found_error")
        return resp, {**json.loads(row[4]), "previous": row[2]}


# ------------------------------------------------------------------ HTTP
def _adapter(stored: StoredResponses):
    async def adapt(gw: Gateway, h: _Headers, body: Any) -> tuple[dict, dict]:
        prev = body.get("previous_response_id") if isinstance(body, dict) else None
        if prev is not None and not isinstance(prev, str):
            raise ApiShapeError("previous_response_id must be a string", "previous_response_id")
        if prev is not None:
            await gw.ensure_execution(h)
        earlier = await asyncio.to_thread(stored.conversation, prev, h.execution_id) if prev else []
        chat, new = responses_to_chat(body, earlier)
        if body.get("generate") is False:  # a warm-up (Codex over WebSocket): kept for chaining, not recorded
            rid = response_id(h.execution_id, h.request_id)
            await asyncio.to_thread(stored.remember, rid, h, prev, earlier, new,
                                    {"instructions": body.get("instructions"), "tools": body.get("tools") or []})
            return body, _warm_up(body, rid)
        resp = await gw.chat(h, gw.parse_body(chat))
        rid = response_id(h.execution_id, h.request_id)
        meta = {"instructions": body.get("instructions"), "tools": body.get("tools") or []}
        await asyncio.to_thread(stored.remember, rid, h, prev, earlier, new + [responses_output_message(resp)], meta)
        return body, chat_to_responses(resp, rid, previous=prev, instructions=meta["instructions"],
                                       tools=meta["tools"])
    return adapt


def _warm_up(body: Mapping[str, Any], rid: str) -> dict:
    """The answer to ``generate: false``: a completed response with no output; the engine is not called and
    nothing is recorded on the log (the next call chains on it by ``previous_response_id``)."""
    empty = {"id": "chatcmpl-warmup", "created": int(time.time()), "model": body.get("model") or "",
             "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
             "choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": ""}}]}
    return chat_to_responses(empty, rid, tools=body.get("tools") or [])


def _stream_of(resp: dict) -> list[bytes]:
    return [sse(ev["type"], ev) for ev in responses_events(resp)]


def _get_response(gw: Gateway, stored: StoredResponses):
    async def get_response(request: web.Request) -> web.Response:
        if gw.auth.enabled and "execution_id" not in request.match_info and \
                not gw.auth.is_admin(request_token(request.headers)):  # SPEC 12.3: only under its own execution
            return error_response(GatewayError(404, "a stored response is served under its own execution: "
                                                    "GET /executions/{id}/v1/responses/{response_id}",
                                               "not_found_error"))
        try:
            resp, meta = await stored.stored(request.match_info["response_id"], request.match_info.get("execution_id"))
        except GatewayError as exc:
            return error_response(exc)
        return web.json_response(chat_to_responses(resp, request.match_info["response_id"], previous=meta["previous"],
                                                   instructions=meta.get("instructions"), tools=meta.get("tools", [])))
    return get_response


def _websocket(gw: Gateway, stored: StoredResponses):
    """The Responses WebSocket transport (``GET /v1/responses`` with ``Upgrade: websocket``; Codex tries it
    first): each ``response.create`` message is one call, answered by the events a stream would carry, one
    JSON text frame each; a refused one gets an ``error`` event and the socket stays open for the next."""
    adapt = _adapter(stored)

    async def websocket(request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=gw.max_body or 4 * 1024 * 1024)
        if not ws.can_prepare(request).ok:
            return error_response(GatewayError(400, "GET /v1/responses is the Responses WebSocket transport: "
                                                    "connect with Upgrade: websocket, or POST /v1/responses"))
        await ws.prepare(request)
        async for msg in ws:
            if msg.type != web.WSMsgType.TEXT:
                continue
            events = await _ws_turn(gw, adapt, request, msg.data)
            for event in events:
                await ws.send_json(event)
            if events[-1]["type"] == "error":  # closed after a refusal: a client never waits on a dead turn
                await ws.close(code=1008, message=events[-1]["error"]["message"][:120].encode())
                break
        return ws
    return websocket


async def _ws_turn(gw: Gateway, adapt: Any, request: web.Request, data: str) -> list[dict]:
    try:
        body = json.loads(data)
        if not isinstance(body, dict) or body.get("type") != "response.create":
            raise GatewayError(400, "a WebSocket message must be a JSON object of type response.create")
        body = {k: v for k, v in body.items() if k != "type"}
        body["stream"] = True
        h = gw.parse_headers(request.headers, request.match_info.get("execution_id"))
        _, resp = await adapt(gw, h, body)
    except ValueError:
        return [_ws_error(GatewayError(400, "a WebSocket message must be UTF-8 JSON"))]
    except (GatewayError, UpstreamError, ApiShapeError) as exc:
        return [_ws_error(exc)]
    return responses_events(resp)


def _ws_error(exc: Exception) -> dict:
    status, doc = error_document(exc)
    return {"type": "error", "status": status, "error": doc["error"]}


def register(app: web.Application, gw: Gateway, prefixes: tuple[str, ...]) -> None:
    """``POST {prefix}/v1/responses``, its WebSocket transport (``GET {prefix}/v1/responses``) and
    ``GET {prefix}/v1/responses/{response_id}`` for each of ``prefixes``."""
    stored = StoredResponses(gw)
    for prefix in prefixes:
        app.router.add_post(prefix + "/v1/responses", handler(gw, _adapter(stored), openai_error, _stream_of))
        app.router.add_get(prefix + "/v1/responses", _websocket(gw, stored))
        app.router.add_get(prefix + "/v1/responses/{response_id}", _get_response(gw, stored))
