"""OpenAI Chat Completions (``POST /v1/chat/completions``, SPEC §7.6): the gateway's own request shape.

A request is validated by :meth:`~ledger.gateway.calls.Gateway.parse_body` and answered by the
protocol-neutral call path (:mod:`ledger.gateway.calls`) as a chat completion, or as its stream of chunks;
errors in the OpenAI shape.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ledger.gateway.calls import Gateway, _Headers
from ledger.gateway.endpoint import handler, openai_error, sse

__all__ = ["register"]


def _sse_chunks(resp: dict) -> list[dict]:
    """The chat completion as OpenAI stream chunks (role, content, tool calls, finish, usage)."""
    base = {"id": resp["id"], "object": "chat.completion.chunk", "created": resp["created"], "model": resp["model"]}
    msg = resp["choices"][0]["message"]
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}]
    if msg.get("reasoning_content"):
        chunks.append({**base, "choices": [{"index": 0, "delta": {"reasoning_content": msg["reasoning_content"]},
                                            "finish_reason": None}]})
    if msg.get("content"):
        chunks.append({**base, "choices": [{"index": 0, "delta": {"content": msg["content"]}, "finish_reason": None}]})
    for i, tc in enumerate(msg.get("tool_calls") or ()):
        chunks.append({**base, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, **tc}]},
                                            "finish_reason": None}]})
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": resp["choices"][0]["finish_reason"]}],
                   "ledger": resp.get("ledger")})
    chunks.append({**base, "choices": [], "usage": resp["usage"]})
    return chunks


async def _adapt_chat(gw: Gateway, h: _Headers, body: Any) -> tuple[dict, dict]:
    body = gw.parse_body(body)
    return body, await gw.chat(h, body)



def _stream_of(resp: dict) -> list[bytes]:
    return [sse(None, c) for c in _sse_chunks(resp)] + [b"data: [DONE]\n\n"]


def register(app: web.Application, gw: Gateway, prefixes: tuple[str, ...]) -> None:
    """``POST {prefix}/v1/chat/completions`` for each of ``prefixes``."""
    for prefix in prefixes:
        app.router.add_post(prefix + "/v1/chat/completions", handler(gw, _adapt_chat, openai_error, _stream_of))
