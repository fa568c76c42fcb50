"""A scripted token engine behind an independent tap, for running real harnesses (SPEC 12.2).

The tap is an HTTP server between the gateway and the tiny engine (``workloads.tiny_engine``):
for every ``POST /v1/completions`` it decodes the prompt's token IDs, asks a *script* what the
model should say next (a tool call, a final answer, a side-call answer), forwards the request
with that constraint to the engine, and keeps what went over the wire -- the prompt IDs it sent
and the output IDs and log-probs the engine answered.  That record is the tap's own (parsed
from the bytes on the wire), not the engine's ``history`` nor anything the gateway reports, so
a test compares the ledger's records against an independent witness.

The script works on the rendered text (Qwen3.6's template: tools in ``<tools>``, results in
``<tool_response>``), so it needs no knowledge of the harness's wire protocol: a prompt that
offers the tool the script drives is the agent loop; it answers with a call of that tool until
the prompt holds ``steps`` tool responses after the task's marker, then a final answer.  A prompt
without that tool (a session title, a summary, a quota probe) gets a short plain answer.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
from aiohttp import web

from ledger.gateway.serve import serve_in_background
from ledger.producers.chatml import decode

Segments = list[Any]


def tool_call(name: str, arguments: dict) -> Segments:
    """The constraint of one Qwen3.6 tool call (hermes form: JSON inside ``<tool_call>``)."""
    return ["<think>\n", {"word": [1, 6]}, "\n</think>\n\n<tool_call>\n"
            + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"]


def answer(text: str) -> Segments:
    return ["<think>\n", {"word": [1, 6]}, "\n</think>\n\n" + text]


@dataclass
class Script:
    """What the model says: ``steps`` calls of tool ``tool`` (``arguments(k)`` for the k-th), then
    ``final``; a prompt that does not offer ``tool`` is a side call and gets ``side``.  ``marker``
    is text of the task prompt: tool responses are counted after its last occurrence, so a
    resumed session (a new task in the same conversation) starts its steps again."""

    tool: str
    arguments: Callable[[int], dict]
    steps: int = 2
    final: str = "All done."
    side: str = "Listing files"
    marker: str = ""
    # a sub-agent's prompt holds this text; it makes ``sub_steps`` calls and answers ``sub_final``
    sub_marker: str | None = None
    sub_steps: int = 1
    sub_final: str = "Sub-task done."
    # an extra tool to call once, at step ``spawn_at`` of the main loop (a sub-agent launcher)
    spawn: tuple[str, dict] | None = None
    spawn_at: int = 0

    def decide(self, text: str) -> tuple[str, Segments]:
        if not re.search(r'"name":\s*"' + re.escape(self.tool) + '"', _tools_block(text)):
            return "side", answer(self.side)
        conv = text[text.rfind("</tools>"):] if "</tools>" in text else text
        if self.sub_marker is not None and self.sub_marker in _first_user_turn(conv):
            done = _responses_after(conv, self.sub_marker)
            if done < self.sub_steps:
                return "sub", tool_call(self.tool, self.arguments(100 + done))
            return "sub", answer(self.sub_final)
        done = _responses_after(conv, self.marker)
        if self.spawn is not None and done == self.spawn_at and self.spawn[0] not in conv[conv.rfind(self.marker):]:
            return "main", tool_call(*self.spawn)
        steps = self.steps + (1 if self.spawn is not None and done > self.spawn_at else 0)
        if done < steps:
            return "main", tool_call(self.tool, self.arguments(done))
        return "main", answer(self.final)


def _tools_block(text: str) -> str:
    a = text.find("<tools>\n")  # the block, not the prose before it ("within <tools></tools> XML tags")
    b = text.find("</tools>", a)
    return text[a:b] if a >= 0 and b > a else ""


def _first_user_turn(conv: str) -> str:
    a = conv.find("<|im_start|>user")
    if a < 0:
        return ""
    b = conv.find("<|im_end|>", a)
    return conv[a:b if b > 0 else None]


def _responses_after(conv: str, marker: str) -> int:
    start = conv.rfind(marker) if marker else 0
    return conv.count("<tool_response>", max(start, 0))


@dataclass
class TappedCall:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    kind: str  # main | sub | side (what the script decided)
    text: str = ""


@dataclass
class Tap:
    """``Tap(engine_url, script).start()``; ``url`` for the gateway's ``--upstream``; ``calls``."""

    engine_url: str
    script: Script
    calls: list[TappedCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    context_length: int = 65536  # what /v1/models reports as max_model_len (vLLM's field)

    def start(self) -> "Tap":
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self._lock = threading.Lock()
        self.url, self._stop = serve_in_background(app, "127.0.0.1", 0)
        return self

    def close(self) -> None:
        self._stop()

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                              "max_model_len": self.context_length}]})

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body.get("prompt")
        text = decode(prompt) if isinstance(prompt, list) else ""
        kind, segments = self.script.decide(text)
        body["constraint"] = segments
        async with aiohttp.ClientSession() as s:
            async with s.post(self.engine_url + "/v1/completions", json=body) as r:
                raw = await r.read()
                status = r.status
        if status == 200:
            doc = json.loads(raw)
            choice = doc["choices"][0]
            with self._lock:
                self.calls.append(TappedCall(list(prompt), list(choice["token_ids"]),
                                             list(choice["logprobs"]["token_logprobs"]), kind, choice["text"]))
        else:
            self.errors.append(raw.decode(errors="replace"))
        return web.Response(body=raw, status=status, content_type="application/json")

