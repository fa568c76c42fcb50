"""The capture gateway's protocol-neutral call path (SPEC §7.6): render, restore, call the engine, record.

The protocol modules (:mod:`~ledger.gateway.chat`, :mod:`~ledger.gateway.responses`,
:mod:`~ledger.gateway.messages`) map their requests onto the chat-completion body this module takes
(:meth:`Gateway.parse_body`) and map the chat completion it answers back into their own shapes.

A harness keeps its message interface (``POST /v1/chat/completions``, streaming or not,
tools / tool_calls; ``GET /v1/models``); the gateway renders the messages to token IDs,
calls a token-in / token-out inference server (:mod:`ledger.gateway.upstream`)
and records what the engine really saw and produced through the
:class:`~ledger.producers.recorder.Recorder` (prefix references, sealing, idempotent ids):

1. **Restoration before matching.** Every assistant message the gateway produced (same
   content and tool-call ids/parsed arguments, so re-serialised arguments still match) is
   replaced by the exact output tokens it recorded — its ``<think>`` block included even where
   the chat template would drop it; only the other messages are rendered with the Qwen chat
   template (:mod:`ledger.producers.chatml`). In a tool loop the input is therefore exactly
   the previous call's input + output + the new messages' tokens.
2. **Recording.** The completion becomes a ``request`` (parent = the call the history
   extends, so the Recorder writes a prefix reference to it; behaviour log-probs; the tool
   call ids it consumed and emitted), each tool call a ``tool_payload`` kind ``call`` (its exact
   text), each new tool message a ``tool_payload`` kind ``result``. They are durable (flushed)
   before the response is sent. Nothing is recorded for a call that did not complete.
3. **Drift accounting.** A history that does not extend (or repeat) a recorded call is a
   divergence (``edited_history``, or ``other`` when it shares no message); one that extends a
   call whose tokens the new input does not extend is ``template`` or ``retokenization``
   (:mod:`ledger.algorithms.chat_restore`). The new input is recorded as sent (the tree
   branches there) and the divergence is counted in the store's ``gateway.db``, which
   ``ledger status --json`` reports. A history restarted after a ``summary`` turn (a
   compaction) is not drift.

4. **Restart.** What restoration needs survives a restart: per call, the agent, turn kind, the
   SHA-256 digests of the message keys it was sent and of the message it returned, and the
   response's metadata (``created``, model, match, parent, drift) are committed to the
   ``state`` table of ``gateway.db`` just before the call's events are written (rows whose
   request never reached the log are dropped when the execution is next loaded). Everything
   else — output tokens, inputs, tool-call ids, finish reason, which tool results were already
   cached — is read back from the log itself, so a restarted gateway restores the same tokens,
   continues the same chain (prefix references included) and answers a retried
   ``X-Ledger-Request-Id`` with the identical response without calling the engine again. No
   message text is kept in ``gateway.db``, only digests. One gateway process per store.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import aiohttp
import numpy as np

from ledger.algorithms.errors import LedgerError
from ledger.algorithms.chat_restore import (
    CallView,
    HistoryMatch,
    assistant_key,
    classify_token_drift,
    content_text,
    match_history,
    message_key,
    restore_plan,
)
from ledger.algorithms.identifiers import id_problem
from ledger.algorithms.prefix_match import common_prefix
from ledger.events.catalog import key_of
from ledger.gateway import store
from ledger.gateway.auth import Auth
from ledger.gateway.metrics import AccessLog, GatewayMetrics, current_call
from ledger.gateway.body import all_utf8 as _all_utf8
from ledger.gateway.body import body_digest
from ledger.gateway.body import message_json as _message_json
from ledger.gateway.body import utf8 as _utf8
from ledger.gateway.upstream import APIS, Completion, UpstreamError, build_request, call_upstream, reserved_fields
from ledger.producers import chatml
from ledger.producers.models import ChatFormat, load_format
from ledger.producers.models.base import openai_message
from ledger.producers.recorder import Recorder, RecorderError

__all__ = ["Gateway", "GatewayError", "assemble"]

_ROLES = ("system", "user", "assistant", "tool")
# fields of an OpenAI chat request the gateway interprets (the rest is passed to the upstream verbatim)
_CHAT_FIELDS = {"model", "messages", "tools", "tool_choice", "stream", "stream_options", "max_tokens",
                "max_completion_tokens", "temperature", "top_p", "seed", "stop", "n", "user", "logprobs",
                "top_logprobs", "parallel_tool_calls", "metadata", "store", "frequency_penalty", "presence_penalty",
                "response_format", "logit_bias", "service_tier", "reasoning_effort", "modalities",
                "top_k", "min_p", "chat_template_kwargs", "x_ledger_tools_dropped"}
# neutral samplers (SPEC 11.3): unless the harness sets them, the recorded log-probs are those of the
# distribution sampled from (llama-server's defaults top_k 40, top_p 0.95, min_p 0.05, temperature 0.8 are not)
NEUTRAL_SAMPLERS = {"temperature": 1.0, "top_p": 1.0, "top_k": None, "min_p": 0.0}


class GatewayError(LedgerError):
    """A bad request: HTTP ``status`` with an OpenAI-format error."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param



# ------------------------------------------------------------------ rendering with restoration
def assemble(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
             restored: Mapping[int, Sequence[int]]) -> list[int]:
    """Input token IDs for ``messages``: the Qwen chat template (as :func:`chatml.render_prompt`),
    except that each assistant message at an index in ``restored`` is its recorded output
    tokens verbatim (``<|im_start|>assistant\\n`` + output [+ ``<|im_end|>``] + ``\\n``)."""
    enc = chatml._encode_turn
    parts = chatml.render_parts([openai_message(m) for m in messages], tools, restored=restored)
    ids: list[int] = []
    for p in parts:
        ids.extend(enc(p) if isinstance(p, str) else p)
    return ids


# ------------------------------------------------------------------ state
def _key_digest(key: tuple) -> tuple[str, str]:
    """A message key as the gateway keeps it (in memory and in gateway.db): ``(role, SHA-256 of
    the key)``, so matching compares digests and no message text is stored beside the (sealed) log.
    Cached per key: a growing history digests only its new messages."""
    try:
        return _cached_key_digest(key)
    except TypeError:  # an unhashable part: digested as it is
        return _key_digest_of(key)


def _key_digest_of(key: tuple) -> tuple[str, str]:
    return (key[0], hashlib.sha256(json.dumps(key, ensure_ascii=False, separators=(",", ":")).encode()).hexdigest())


_cached_key_digest = lru_cache(maxsize=8192)(_key_digest_of)


@dataclass
class _Call:
    request_id: str
    agent_id: str
    turn_kind: str
    keys: tuple  # digests of the message keys of the history it was sent
    assistant: tuple  # digest of the assistant message it returned
    input: np.ndarray  # uint32
    output: list[int]
    restored: dict[int, str] = field(default_factory=dict)  # the restore plan its input was built with
    # input + output IDs as JSON text, ``buf[:n]`` of ``(buf, n)`` (the agent's latest call only): the next call's
    # prompt text grows the same buffer in place (the calls of one agent are serialised by its lock)
    path_json: tuple[bytearray, int] | None = None

    def view(self) -> CallView:
        return CallView(self.request_id, self.keys, self.assistant, self.turn_kind, self.restored)


@dataclass
class _Execution:
    calls: dict[str, list[_Call]] = field(default_factory=dict)  # agent -> calls, oldest first
    by_id: dict[str, _Call] = field(default_factory=dict)
    results: dict[str, str] = field(default_factory=dict)  # tool call id -> cached result text
    emitted: set[str] = field(default_factory=set)


@dataclass
class _Headers:
    execution_id: str
    agent_id: str
    agent_tier: str
    turn_kind: str
    request_id: str
    explicit_id: bool
    task_id: str | None
    deadline: str | None
    explicit_agent: bool = True  # False: no X-Ledger-Agent-Id, the gateway places the call (_infer_agent)


def _header(headers: Mapping[str, str], name: str) -> str | None:
    v = headers.get(name)
    if v in (None, ""):
        return None
    if not _utf8(v) or not v.isprintable():
        raise GatewayError(400, f"header {name} is not printable UTF-8 text")
    return v


def _strings_utf8(value: Any) -> bool:
    if isinstance(value, str):
        return _utf8(value)
    if isinstance(value, dict):
        return all(_strings_utf8(k) and _strings_utf8(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_strings_utf8(v) for v in value)
    return True



@dataclass
class _Turn:
    """One call on its way through :meth:`Gateway._call` (render, answer, record, remember)."""
    h: _Headers
    keys: tuple
    match: HistoryMatch
    plan: dict[int, str]
    inline: bool
    prompt: np.ndarray
    parent: str | None
    drift: tuple | None
    pcall: _Call | None
    grows: bool
    prompt_json: bytearray
    n_json: int
    completion: Completion | None = None
    parsed: Any = None
    call_ids: list[str] = field(default_factory=list)
    new_results: list[tuple[str, str]] = field(default_factory=list)
    consumed: list[str] = field(default_factory=list)
    finish: str | None = None
    akey: tuple = ()
    meta: dict = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # hosted tools the adapter left out (SPEC 12.1)


class Gateway:
    """The gateway's logic, independent of the HTTP server (see :func:`make_app`)."""

    def __init__(self, recorder: Recorder, *, upstream: str, api: str, tokenizer_name: str,
                 state_db: Path, model: str | None = None, timeout: float = 600.0, default_max_tokens: int = 1024,
                 fmt: ChatFormat | None = None) -> None:
        if api not in APIS:
            raise ValueError(f"--api must be one of {', '.join(APIS)}, not {api!r}")
        self.recorder = recorder
        self.upstream = upstream
        self.api = api
        self.tokenizer_name = tokenizer_name
        self.fmt = fmt if fmt is not None else load_format(tokenizer_name)
        self.model = model or tokenizer_name
        self.timeout = timeout
        self.default_max_tokens = default_max_tokens  # a call without a limit when the context window is unknown
        self.context_length: int | None = None  # the model's window (--context-length, or read off the upstream)
        self._context_probed = False
        self.state_db = state_db
        self.db = store.connect(state_db)
        self._db_lock = threading.Lock()
        recorder.before_append = self._sync_state
        recorder.on_written = self._on_written
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: list[tuple[int, asyncio.Future]] = []  # (mark, future) awaiting the writer (loop thread)
        self.executions: dict[str, _Execution] = {}
        self.done: dict[tuple[str, str], dict] = {}  # (execution, request id) -> response
        self.inflight: dict[tuple[str, str], asyncio.Future] = {}
        self.bodies: dict[tuple[str, str], str] = {}  # (execution, request id) -> body digest
        self.locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._opened: set[str] = set()
        self._open_locks: dict[str, asyncio.Lock] = {}
        self.session: Any = None
        self.auth = Auth.off()  # `ledger gateway` sets the store's tokens (SPEC 12.3); the library default is open
        self.metrics = GatewayMetrics()
        self.access_log = AccessLog(None)
        self.max_concurrent_per_execution = 0  # 0: no limit (the CLI's default is 16)
        self.max_body: int | None = None  # request body limit in bytes (None: the app's MAX_BODY)
        self._running: dict[str, int] = {}  # execution -> calls in progress
        self._closed_executions: set[str] = set()  # closed here or found closed on the log when loaded

    def _sync_state(self) -> None:
        """Make the state rows committed so far durable against a power loss, once per log batch (called by the
        recorder's writer before it appends): a call's row is committed before its events are queued, so no
        request reaches the log without its restoration state.  The WAL holds them (``synchronous=NORMAL``
        leaves its fsync to checkpoints, which sync the database file themselves)."""
        try:
            fd = os.open(str(self.state_db) + "-wal", os.O_RDONLY)
        except FileNotFoundError:  # nothing written since the last checkpoint removed it
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _on_written(self, written: int) -> None:
        """The recorder's writer took a batch (writer thread): the loop resolves the calls it made durable."""
        if written:
            self.metrics.commit_batch.observe(written)
        loop = self._loop
        if loop is not None and self._waiters:
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is closed
                pass

    def _wake(self) -> None:
        waiting = []
        for mark, fut in self._waiters:
            if not self.recorder.written(mark):
                waiting.append((mark, fut))
            elif not fut.done():
                fut.set_result(None)
        self._waiters = waiting

    async def _durable(self, mark: int) -> None:
        """:meth:`Recorder.wait_durable` of ``mark`` without a thread blocked on it: the call waits on the loop
        until the writer took its events (group commit), then the errors seen so far are raised."""
        loop = self._loop = asyncio.get_running_loop()
        while not self.recorder.written(mark):
            fut = loop.create_future()
            self._waiters.append((mark, fut))  # before the check: a batch taken since is reported to _wake
            if self.recorder.written(mark):
                break
            await asyncio.wait([fut], timeout=1.0)  # the timeout: a writer that stopped reports nothing
        self.recorder.wait_durable(mark)  # taken: does not wait

    # ---------------------------------------------------------------- request parsing
    def parse_headers(self, headers: Mapping[str, str], path_execution: str | None) -> _Headers:
        ex = path_execution or _header(headers, "X-Ledger-Execution-Id")
        if not ex:
            raise GatewayError(400, "no execution: set header X-Ledger-Execution-Id or use /executions/{id}/v1/...")
        tier = _header(headers, "X-Ledger-Agent-Tier") or "main"
        if tier not in ("main", "sub"):
            raise GatewayError(400, f"X-Ledger-Agent-Tier must be main or sub, not {tier!r}")
        kind = _header(headers, "X-Ledger-Turn-Kind") or "task"
        if kind not in ("task", "summary"):
            raise GatewayError(400, f"X-Ledger-Turn-Kind must be task or summary, not {kind!r}")
        rid = _header(headers, "X-Ledger-Request-Id")
        agent = _header(headers, "X-Ledger-Agent-Id")
        for name in ("X-Ledger-Execution-Id", "X-Ledger-Request-Id", "X-Ledger-Agent-Id", "X-Ledger-Task-Id"):
            value = ex if name == "X-Ledger-Execution-Id" else _header(headers, name)
            if value is not None and (why := id_problem(value)) is not None:  # SPEC 11.7, before any upstream call
                raise GatewayError(400, f"{name}: {why}")
        return _Headers(ex, agent or "main", tier, kind, rid or f"gw-{uuid.uuid4().hex}", rid is not None,
                        _header(headers, "X-Ledger-Task-Id"), _header(headers, "X-Ledger-Deadline"), agent is not None)

    @staticmethod
    def parse_body(body: Any) -> dict:
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise GatewayError(400, "messages must be a non-empty list", param="messages")
        utf8 = _all_utf8(body)  # True: no string needs the walk below (which finds where, when one is not)
        for i, m in enumerate(msgs):
            if isinstance(m, dict) and m.get("role") == "developer":  # OpenAI's name for a system message
                m = msgs[i] = {**m, "role": "system"}
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise GatewayError(400, f"messages[{i}] must be an object with role one of {', '.join(_ROLES)}",
                                   param="messages")
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list)):
                raise GatewayError(400, f"messages[{i}].content must be a string or a list of parts", param="messages")
            if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
                raise GatewayError(400, f"messages[{i}] (tool) needs a string tool_call_id", param="messages")
            tcs = m.get("tool_calls")
            if tcs is not None and (not isinstance(tcs, list) or not all(
                    isinstance(t, dict) and isinstance(t.get("function"), dict) for t in tcs)):
                raise GatewayError(400, f"messages[{i}].tool_calls must be a list of {{id, function}}", param="messages")
            if not utf8 and not _strings_utf8(m):
                raise GatewayError(400, f"messages[{i}] holds a lone surrogate (not UTF-8 text)", param="messages")
        reserved = sorted(k for k in body if k not in _CHAT_FIELDS and k in reserved_fields())
        if reserved:
            raise GatewayError(400, f"field {reserved[0]!r} is set by the gateway on the upstream request and "
                                    "cannot come from the request body", param=reserved[0])
        if not utf8 and not _strings_utf8(body):
            raise GatewayError(400, "the request body holds a lone surrogate (not UTF-8 text)")
        kw = body.get("chat_template_kwargs")
        if kw is not None and not isinstance(kw, dict):
            raise GatewayError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise GatewayError(400, "tools must be a list", param="tools")
        dropped = body.get("x_ledger_tools_dropped")
        if dropped is not None and (not isinstance(dropped, list) or not all(isinstance(d, str) for d in dropped)):
            raise GatewayError(400, "x_ledger_tools_dropped must be a list of tool names", param="x_ledger_tools_dropped")
        if body.get("n") not in (None, 1):
            raise GatewayError(400, "n must be 1 (one recorded call per request)", param="n")
        for name in ("max_tokens", "max_completion_tokens", "seed"):
            v = body.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "seed" else 1)):
                raise GatewayError(400, f"{name} must be a positive integer", param=name)
        for name in ("temperature", "top_p", "top_k", "min_p"):
            v = body.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise GatewayError(400, f"{name} must be a number", param=name)
            if v is not None and (why := _sampler_problem(name, v)) is not None:  # before the engine runs
                raise GatewayError(400, f"{name} {why}", param=name)
        return body

    # ---------------------------------------------------------------- the call
    async def chat(self, h: _Headers, body: dict) -> dict:
        """One chat completion: returns the OpenAI response (recorded and durable)."""
        key = (h.execution_id, h.request_id)
        digest = body_digest(body)
        if key in self.done:
            return self._same_body(key, digest, self.done[key])
        if key in self.inflight:
            if self.bodies.get(key, digest) != digest:
                raise self._conflict(key)
            return await asyncio.shield(self.inflight[key])
        self.bodies[key] = digest
        fut = asyncio.get_running_loop().create_future()
        self.inflight[key] = fut
        try:
            resp = await self._chat(h, body)
        except BaseException as exc:
            self.bodies.pop(key, None)  # nothing recorded: the id is free for another body
            fut.set_exception(exc)
            fut.exception()  # retrieved: no "never retrieved" warning
            raise
        finally:
            self.inflight.pop(key, None)
        fut.set_result(resp)
        self.done[key] = resp
        return resp

    async def _chat(self, h: _Headers, body: dict) -> dict:
        await self.ensure_execution(h)  # after a restart: loads the execution's calls and their responses
        done = self.done.get((h.execution_id, h.request_id))
        if done is not None:
            return self._same_body((h.execution_id, h.request_id), body_digest(body), done)
        if h.execution_id in self._closed_executions:  # the client's error, known before the engine runs (SPEC 12.3)
            raise GatewayError(409, f"execution {h.execution_id!r} is closed: nothing more is recorded into it",
                               "conflict")
        if h.explicit_id:
            known = await asyncio.to_thread(self.recorder.log.lookup,
                                            key_of("request", execution_id=h.execution_id, request_id=h.request_id))
            if known is not None:
                raise GatewayError(409, f"request {h.request_id!r} of execution {h.execution_id!r} is already on the "
                                        "log but was not answered by this gateway (no state for it in gateway.db); "
                                        "retry under a new X-Ledger-Request-Id", "conflict")
        if not h.explicit_agent:
            h = self._infer_agent(h, body["messages"], tools=body.get("tools"))
        lock = self.locks.setdefault((h.execution_id, h.agent_id), asyncio.Lock())
        async with lock:
            return await self._call(h, body)

    def _infer_agent(self, h: _Headers, messages: Sequence[Mapping[str, Any]], reserve: bool = True,
                     tools: Any = None) -> _Headers:
        """The agent of a call without ``X-Ledger-Agent-Id`` (SPEC 11.4, sub-agents with headers optional):
        the agent whose chain shares the conversation's opening (its system messages and first other
        message); a conversation that opens like no recorded chain of the execution -- a sub-agent the
        harness spawned -- is a new agent ``sub-N`` (tier ``sub``), the first conversation ``main``.
        Several agents opening alike: the one the whole history matches best. ``reserve``: claim the new
        name at once (synchronously, so two new conversations arriving together get two names)."""
        state = self.executions.get(h.execution_id)
        if state is None or not any(state.calls.values()):
            return h if tools or state is None else self._new_agent(h, state, tools, reserve)
        n = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages)) + 1
        head = tuple(_key_digest(message_key(m)) for m in messages[:n])
        n = len(head)
        def opens(c: _Call) -> bool:  # O(opening), not O(history)
            return (c.keys[:n] if len(c.keys) >= n else c.keys + (c.assistant,))[:n] == head

        # an agent's chain shares its opening across its calls: its latest and first call stand for it
        cands = [a for a, calls in state.calls.items()
                 if calls and (calls[-1].turn_kind == "summary" or opens(calls[-1]) or opens(calls[0]))]
        if len(cands) > 1:
            keys = tuple(_key_digest(message_key(m)) for m in messages)
            rank = {"extends": 3, "resample": 3, "restart": 2, "diverged": 1}
            cands.sort(key=lambda a: (lambda m: (rank.get(m.kind, 0), m.matched))(
                match_history(keys, [c.view() for c in state.calls[a]])), reverse=True)
        if not cands:
            return self._new_agent(h, state, tools, reserve)
        agent = cands[0]
        return replace(h, agent_id=agent, agent_tier="main" if agent == "main" else "sub")

    @staticmethod
    def _new_agent(h: _Headers, state: _Execution, tools: Any, reserve: bool) -> _Headers:
        """The name of a conversation that opens like no recorded chain (SPEC 12.1): one that offers no
        tools is a side call beside the agent loop (a session title, a summary, a quota probe: ``aux-N``);
        the first one that offers tools is ``main`` (the loop working on the task), later ones ``sub-N``."""
        if tools and not state.calls.get("main"):
            agent = "main"
        else:
            prefix = "sub" if tools else "aux"
            agent = next(f"{prefix}-{k}" for k in itertools.count(1) if f"{prefix}-{k}" not in state.calls)
        if reserve:
            state.calls.setdefault(agent, [])
        return replace(h, agent_id=agent, agent_tier="main" if agent == "main" else "sub")

    def _restoration(self, state: _Execution, agent_id: str, keys: tuple) -> tuple:
        """``(the agent's calls, match, restore plan, {message index: output tokens})`` of a history."""
        calls = state.calls.get(agent_id, [])
        views = [c.view() for c in calls]
        match = match_history(keys, views)
        plan = restore_plan(keys, views, match.parent)  # the same call as the match on ties
        return calls, match, plan, {i: state.by_id[rid].output for i, rid in plan.items()}

    async def count_tokens(self, headers: Mapping[str, str], path_execution: str | None, body: dict) -> int:
        """The input tokens a chat ``body`` would be sent upstream as (restoration included when it names
        an execution on the log); nothing is recorded and no execution is opened."""
        ex = path_execution or _header(headers, "X-Ledger-Execution-Id")
        restored: dict[int, Sequence[int]] = {}
        if ex and id_problem(ex) is None and (ex in self._opened or await asyncio.to_thread(
                self.recorder.log.lookup, key_of("execution_opened", execution_id=ex)) is not None):
            h = _Headers(ex, _header(headers, "X-Ledger-Agent-Id") or "main", "main", "task", "", False, None, None,
                         _header(headers, "X-Ledger-Agent-Id") is not None)
            await self.ensure_execution(h)
            if not h.explicit_agent:
                h = self._infer_agent(h, body["messages"], reserve=False, tools=body.get("tools"))
            keys = tuple(_key_digest(message_key(m)) for m in body["messages"])
            restored = self._restoration(self.executions[ex], h.agent_id, keys)[3]
        try:
            ids = await asyncio.to_thread(self.fmt.assemble, body["messages"], body.get("tools"), restored,
                                          body.get("chat_template_kwargs"))
        except ValueError as exc:
            raise GatewayError(400, str(exc), param="chat_template_kwargs") from None
        return len(ids)

    def _same_body(self, key: tuple[str, str], digest: str, resp: dict) -> dict:
        known = self.bodies.get(key)
        if known is not None and known != digest:
            raise self._conflict(key)
        return resp

    @staticmethod
    def _conflict(key: tuple[str, str]) -> GatewayError:
        return GatewayError(409, f"X-Ledger-Request-Id {key[1]!r} of execution {key[0]!r} was already used with "
                                 "another request body; retry under a new request id", "conflict")

    async def ensure_execution(self, h: _Headers) -> None:
        ex = h.execution_id
        if ex in self._opened:
            return
        async with self._open_locks.setdefault(ex, asyncio.Lock()):
            if ex not in self._opened:
                await self._open_execution(h)

    async def _open_execution(self, h: _Headers) -> None:
        ex = h.execution_id
        rec = await asyncio.to_thread(self.recorder.log.lookup, key_of("execution_opened", execution_id=ex))
        if rec is None:
            if not (h.task_id and h.deadline):
                raise GatewayError(400, f"unknown execution {ex!r}: open it with headers X-Ledger-Task-Id and "
                                        "X-Ledger-Deadline (RFC 3339)")
            try:
                self.recorder.open_execution(ex, task_id=h.task_id, deadline=h.deadline, policy=self.model,
                                             tokenizer=self.tokenizer_name, origin="production")
                # its own events only (flush would wait for an empty queue, which a loaded gateway rarely has)
                await self._durable(self.recorder.mark())
            except (ValueError, TypeError, RecorderError) as exc:
                raise GatewayError(400, f"cannot open execution {ex!r}: {exc}") from None
            state = _Execution()
        else:
            state = await asyncio.to_thread(self._load_state, ex)
            closed = key_of("execution_closed", execution_id=ex)
            if await asyncio.to_thread(self.recorder.log.lookup, closed) is not None:
                self._closed_executions.add(ex)
        self.executions[ex] = state
        self._opened.add(ex)

    def _load_state(self, ex: str) -> _Execution:
        """The restoration state of an execution this gateway (or an earlier run of it) recorded:
        gateway.db rows, in recording order, with their tokens and ids read from the log."""
        with self._db_lock:
            rows = store.state_rows(self.db, ex)
        state = _Execution()
        stale: list[str] = []
        for rid, agent, kind, keys, assistant, meta in rows:
            rec = self.recorder.log.lookup(key_of("request", execution_id=ex, request_id=rid))
            if rec is None:  # its state was committed but the request never reached the log
                stale.append(rid)
                continue
            try:
                ev = self.recorder.ingestor.opened_request(self.recorder.ingestor.codec.decode(rec.value))
                path = self.recorder.ingestor.request_path(ex, rid)
            except ValueError:  # tokens erased (withdraw --erase) or not openable here: nothing to restore
                continue
            n_out = len(ev["output_ids"]) // 4
            ids = np.frombuffer(path, dtype="<u4")
            inp, out = ids[:len(ids) - n_out], ids[len(ids) - n_out:].tolist()
            m = json.loads(meta)
            if m.get("body"):
                self.bodies[(ex, rid)] = m["body"]
            call = _Call(rid, agent, kind, tuple(tuple(k) for k in json.loads(keys)), tuple(json.loads(assistant)),
                         inp, out, {int(i): r for i, r in (m.get("restored") or {}).items()})
            state.calls.setdefault(agent, []).append(call)
            state.by_id[rid] = call
            state.results.update(dict.fromkeys(ev["consumed_tool_call_ids"], ""))
            state.emitted.update(ev["emitted_tool_call_ids"])
            self.done[(ex, rid)] = self._response(ex, rid, agent, m, inp, out, ev["emitted_tool_call_ids"],
                                                  ev.get("finish_reason"), _event_logprobs(ev))
        if stale:
            with self._db_lock:
                store.drop_calls(self.db, ex, stale)
        # prefix references continue from the recorded paths (the recorder of a new process has none)
        self.recorder.resume(ex, [(c.request_id, c.agent_id, c.input, c.output) for c in state.by_id.values()])
        return state

    def _params(self, body: dict, prompt_len: int | None = None) -> dict:
        extra = {k: v for k, v in body.items() if k not in _CHAT_FIELDS}
        stop = body.get("stop")
        samplers = {k: (body[k] if body.get(k) is not None else v) for k, v in NEUTRAL_SAMPLERS.items()}
        return {"max_tokens": body.get("max_completion_tokens") or body.get("max_tokens") or self._remaining(prompt_len),
                **samplers, "seed": body.get("seed"), "stop": [stop] if isinstance(stop, str) else stop,
                "extra": extra}

    def _remaining(self, prompt_len: int | None) -> int:
        """The output limit of a call that sets none: the rest of the model's context window, as vLLM does
        (SPEC 12.1); ``--max-tokens`` where the window is not known."""
        if self.context_length is None or prompt_len is None:
            return self.default_max_tokens
        if prompt_len >= self.context_length:
            raise GatewayError(400, f"the prompt is {prompt_len} tokens, which fills the model's context window of "
                                    f"{self.context_length} tokens: nothing is left for an answer", param="messages")
        return self.context_length - prompt_len

    async def _probe_context(self) -> None:
        """The model's context window, read once off the upstream (vLLM ``/v1/models`` ``max_model_len``,
        llama-server ``/props`` ``n_ctx``, SGLang ``/get_model_info`` ``max_context_length``)."""
        if self._context_probed or self.context_length is not None:
            return
        self._context_probed = True
        path, keys = {"vllm": ("/v1/models", ("data", 0, "max_model_len")),
                      "llamacpp": ("/props", ("default_generation_settings", "n_ctx")),
                      "sglang": ("/get_model_info", ("max_context_length",))}[self.api]
        if self.session is None:
            self.session = aiohttp.ClientSession()
        try:
            async with self.session.get(self.upstream.rstrip("/") + path, timeout=aiohttp.ClientTimeout(total=5)) as r:
                value: Any = await r.json(content_type=None) if r.status == 200 else None
            for k in keys:
                value = value[k] if isinstance(value, (dict, list)) else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            self.context_length = value

    async def _call(self, h: _Headers, body: dict) -> dict:
        """Render with restoration, call the upstream, record durably, answer (the protocol-neutral steps)."""
        state = self.executions[h.execution_id]
        t = await self._render(h, body, state)
        completion = await self._upstream(t.prompt, body, t.prompt_json)  # UpstreamError: nothing recorded
        self._answer(t, body, completion)
        try:
            await self._record(t)
        except (RecorderError, ValueError, TypeError) as exc:  # the upstream's answer cannot be recorded
            raise GatewayError(502, f"the ledger refused the upstream answer (nothing recorded): {exc}",
                               "ledger_refused") from None
        self._remember(t, state)
        return self._response(h.execution_id, h.request_id, h.agent_id, t.meta, t.prompt, completion.tokens,
                              t.call_ids, t.finish, completion.logprobs)

    async def _render(self, h: _Headers, body: dict, state: _Execution) -> _Turn:
        """The call's input tokens (restored outputs verbatim), its parent and drift, its prompt's JSON text."""
        messages = body["messages"]
        keys = tuple(_key_digest(message_key(m)) for m in messages)
        calls, match, plan, restored = self._restoration(state, h.agent_id, keys)
        inline = _small_turn(messages, plan)  # a few new messages after restored output: no thread hop
        try:
            args = (messages, body.get("tools"), restored, body.get("chat_template_kwargs"))
            prompt = self.fmt.assemble_array(*args) if inline else await asyncio.to_thread(self.fmt.assemble_array,
                                                                                            *args)
        except ValueError as exc:  # a template variable the format refuses, or a message it cannot render
            late = _late_system(messages)
            if late is not None:  # in the words the harnesses fall back on (SPEC 12.1; Claude Code's check)
                raise GatewayError(400, f"Unexpected role 'system' at messages[{late}]: this model's chat template "
                                        f"renders a system message only first, so role system is not supported "
                                        f"later in the conversation (the input message role must be user or "
                                        f"assistant there; the template said: {exc})", param="messages") from None
            raise GatewayError(400, str(exc), param="chat_template_kwargs") from None

        parent, drift = self._drift(match, calls, state, prompt)
        pcall = state.by_id.get(parent) if parent else None
        # the prompt grows the parent's path (for "extends" without drift, _drift compared the IDs already)
        grows = pcall is not None and len(prompt) > len(pcall.input) + len(pcall.output) and (
            (match.kind == "extends" and drift is None) or _extends(prompt, pcall))
        prompt_json = self._prompt_json(pcall if grows else None, prompt)
        return _Turn(h, keys, match, plan, inline, prompt, parent, drift, pcall, grows, prompt_json, len(prompt_json))

    def _answer(self, t: _Turn, body: dict, completion: Completion) -> None:
        """What the upstream's completion means: tool calls and their ids, new tool results, finish, metadata."""
        h = t.h
        t.completion = completion
        t.parsed = parsed = self.fmt.parse_output(completion.tokens, body.get("tools"))
        t.call_ids = [self._call_id(h, i) for i in range(len(parsed.tool_calls))]
        tool_calls = [{"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                      for cid, c in zip(t.call_ids, parsed.tool_calls)]
        # tool results not seen before: cached under their call id and consumed by this call
        state = self.executions[h.execution_id]
        for m in body["messages"]:
            if m["role"] == "tool" and m["tool_call_id"] not in state.results \
                    and all(m["tool_call_id"] != c for c, _ in t.new_results):
                t.new_results.append((m["tool_call_id"], content_text(m.get("content"))))
        t.consumed = [cid for cid, _ in t.new_results]
        t.dropped = list(body.get("x_ledger_tools_dropped") or ())
        params = self._params(body)
        t.finish = "tool_calls" if tool_calls else completion.finish_reason
        t.akey = _key_digest(assistant_key(parsed.content, tool_calls))
        t.meta = {"created": int(time.time()), "model": body.get("model") or self.model, "match": t.match.kind,
                  "parent": t.parent, "drift": t.drift[0] if t.drift else None,
                  "restored": {str(i): rid for i, rid in t.plan.items()},
                  "body": self.bodies.get((h.execution_id, h.request_id)) or body_digest(body),
                  "sampling": {k: params.get(k) for k in ("temperature", "top_p", "top_k", "min_p", "seed")},
                  "logprobs": bool(body.get("logprobs")), "stop": params.get("stop")}

    async def _record(self, t: _Turn) -> None:
        """The state row and the events queued, then durable before the response goes out."""
        # on the loop for a small turn (a SQLite commit that does not sync, validation of the new tokens) when the
        # queue has room, else in one thread hop
        small = t.inline and self.recorder.has_room(1 + len(t.new_results) + len(t.call_ids))
        mark = self._record_now(t) if small else await asyncio.to_thread(self._record_now, t)
        # durable before the response goes out: this call's events, appended with those of the calls that
        # complete together (group commit: one append, one fdatasync); waited for on the loop, no thread held
        try:
            await self._durable(mark)
        except (RecorderError, ValueError, TypeError) as exc:
            await asyncio.to_thread(self._failed, t, exc)
        if os.environ.get("LEDGER_GATEWAY_FAULT") == "exit-after-append":  # tests: die between append and answer
            os._exit(17)

    def _record_now(self, t: _Turn) -> int:
        h = t.h
        row = (h.execution_id, h.request_id, h.agent_id, h.turn_kind, json.dumps(t.keys), json.dumps(t.akey),
               json.dumps(t.meta))
        with self._db_lock:  # committed first: a request on the log always has its restoration state
            store.write_call(self.db, row, t.match.kind, t.drift, t.parent)
        try:
            self._write_events(t)
        except BaseException as exc:
            self._failed(t, exc)
        return self.recorder.mark()

    def _failed(self, t: _Turn, exc: BaseException) -> None:
        # an error of another call can surface here (the recorder reports errors to whoever waits
        # next): if this call's request reached the log, it is recorded and its state stays
        self.recorder.wait_written(self.recorder.mark())  # the writer took whatever was queued (this call's too)
        if self.recorder.log.lookup(key_of("request", execution_id=t.h.execution_id,
                                           request_id=t.h.request_id)) is None:
            with self._db_lock:  # the call did not complete: its state goes
                store.drop_calls(self.db, t.h.execution_id, [t.h.request_id])
            raise exc

    def _write_events(self, t: _Turn) -> None:
        h, c = t.h, t.completion
        for cid, content in t.new_results:
            self.recorder.cache_tool_payload(h.execution_id, cid, "result", content)
        self.recorder.record_request(
            h.execution_id, h.request_id, t.prompt, c.tokens, c.logprobs, h.agent_id,
            agent_tier=h.agent_tier, turn_kind=h.turn_kind, generator="policy", parent_request_id=t.parent,
            consumed_tool_call_ids=t.consumed, emitted_tool_call_ids=t.call_ids, model=self.model,
            finish_reason=t.finish, metadata={"sampling": t.meta["sampling"],
                                              **({"tools_dropped": t.dropped} if t.dropped else {})})
        for cid, tc in zip(t.call_ids, t.parsed.tool_calls):
            self.recorder.cache_tool_payload(h.execution_id, cid, "call",
                                             {"name": tc.name, "arguments": json.loads(tc.arguments), "text": tc.text})

    def _remember(self, t: _Turn, state: _Execution) -> None:
        """The recorded call joins the execution's restoration state (its path's JSON text kept for the next)."""
        h, prompt, prompt_json = t.h, t.prompt, t.prompt_json
        for cid, content in t.new_results:
            state.results.setdefault(cid, content)
        state.emitted.update(t.call_ids)
        call = _Call(h.request_id, h.agent_id, h.turn_kind, t.keys, t.akey, prompt, t.completion.tokens, dict(t.plan))
        if t.grows:
            _share_inputs(state.calls.get(t.pcall.agent_id, ()), t.pcall, prompt)
        del prompt_json[t.n_json:]
        prompt_json += b"," + _ids_json(t.completion.tokens)
        call.path_json = (prompt_json, len(prompt_json))
        for earlier in state.calls.get(h.agent_id, ())[-1:]:
            earlier.path_json = None  # kept for the agent's latest call only (the usual parent)
        state.calls.setdefault(h.agent_id, []).append(call)
        state.by_id[h.request_id] = call

    def _call_id(self, h: _Headers, i: int) -> str:
        digest = hashlib.sha256(f"{h.execution_id}\x00{h.request_id}\x00{i}".encode()).hexdigest()
        return self.fmt.call_id(digest)

    def _drift(self, match: HistoryMatch, calls: list[_Call], state: _Execution, prompt: np.ndarray):
        """(parent request id, (cause, at_message, at_token) of a divergence or None)."""
        if match.kind == "diverged":
            return match.parent, (match.cause, match.diverged_at, common_prefix(_path(state.by_id[match.parent]), prompt))
        if match.kind in ("extends", "resample"):
            parent = state.by_id[match.parent]
            if not (_extends(prompt, parent) if match.kind == "extends" else _starts_with(prompt, parent.input)):
                # the tokens may still extend an earlier call of the agent exactly (say the harness went back
                # to the tools of an earlier call): that call is the parent, nothing drifted (issue 28, 3e)
                earlier = calls[:next(i for i, c in enumerate(calls) if c.request_id == match.parent)]
                other = max((c for c in earlier if _extends(prompt, c)),
                            key=lambda c: len(c.input) + len(c.output), default=None)
                if other is not None:
                    return other.request_id, None
                expected = _path(parent) if match.kind == "extends" else parent.input
                at = common_prefix(expected, prompt)
                cause = classify_token_drift(self.fmt.decode(expected.tolist()), self.fmt.decode(prompt.tolist()))
                return match.parent, (cause, None, at)
        return match.parent, None

    @staticmethod
    def _prompt_json(parent: _Call | None, prompt: np.ndarray) -> bytearray:
        """The prompt's token IDs as JSON text (without brackets), O(new tokens) when it grows ``parent``'s path
        (checked by the caller): the parent's text is extended in place (serialising 80k IDs anew, or copying their
        text, costs O(context) every turn)."""
        if parent is not None and parent.path_json is not None:
            buf, size = parent.path_json
            del buf[size:]  # what a call from it that did not complete appended
            buf += b"," + _ids_json(prompt[len(parent.input) + len(parent.output):])
            return buf
        return bytearray(_ids_json(prompt))

    async def _upstream(self, prompt: np.ndarray, body: dict, prompt_json: bytes | None = None) -> Completion:
        if self.session is None:
            self.session = aiohttp.ClientSession()
        # the prompt's JSON is spliced in by call_upstream: no Python list of the IDs is made
        if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
            await self._probe_context()
        params = self._params(body, int(prompt.shape[0]))
        req = build_request(self.api, () if prompt_json is not None else prompt.tolist(), params, model=None)
        started = time.perf_counter()
        try:
            c = await call_upstream(self.session, self.upstream, self.api, req, self.timeout, prompt_json=prompt_json)
        finally:
            if (stats := current_call()) is not None:
                stats.upstream_s += time.perf_counter() - started
        if (stats := current_call()) is not None:
            stats.tokens_in += int(prompt.shape[0])
            stats.tokens_out += len(c.tokens)
        if not self.fmt.valid_ids([*c.tokens, *c.stop_tail]):
            bad = next(t for t in [*c.tokens, *c.stop_tail] if not 0 <= t < self.fmt.vocab_size)
            raise UpstreamError(502, f"malformed upstream response: output token ID {bad} is outside the vocabulary "
                                     f"(0..{self.fmt.vocab_size - 1})", "upstream_malformed_response")
        if c.stop_word is None:
            return c
        # the record ends where the harness's answer ends: before the stop word, which may have been
        # sampled as more tokens than it tokenizes to alone (llama-server then keeps a piece of it)
        n = await asyncio.to_thread(self.fmt.answer_end, c.tokens, c.stop_tail, c.stop_word)
        if n == 0:
            raise UpstreamError(502, "malformed upstream response: no output tokens before the stop word "
                                     f"{c.stop_word!r}", "upstream_malformed_response")
        return Completion(c.tokens[:n], c.logprobs[:n], c.finish_reason)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None
        self.db.close()

    def _response(self, execution_id: str, request_id: str, agent_id: str, meta: Mapping[str, Any],
                  prompt: Sequence[int], output: Sequence[int], call_ids: Sequence[str], finish: str | None,
                  logprobs: Sequence[float] | None = None) -> dict:
        parsed = self.fmt.parse_output(list(output))
        resp = _response(execution_id, request_id, agent_id, meta, prompt, output, call_ids, finish, parsed)
        if meta.get("logprobs") and logprobs is not None:  # a harness that asked for log-probs gets them
            resp["choices"][0]["logprobs"] = {"content": [
                {"token": self.fmt.decode([t]), "logprob": lp, "bytes": list(self.fmt.decode([t]).encode()),
                 "top_logprobs": []} for t, lp in zip(output, logprobs)]}
        return resp


INLINE_TEXT = 65536  # characters of new messages up to which a turn's thread work runs on the event loop


def _late_system(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """The index of the first system message after a non-system one (a mid-conversation system message)."""
    seen_other = False
    for i, m in enumerate(messages):
        if m.get("role") != "system":
            seen_other = True
        elif seen_other:
            return i
    return None


def _sampler_problem(name: str, v: int | float) -> str | None:
    """Why a sampling parameter cannot go to an engine (None: it can): non-finite values are not JSON
    for another server, and an out-of-range one would be the engine's 400 after the execution opened."""
    if not math.isfinite(v):
        return f"must be a finite number, not {v!r}"
    if name == "temperature" and v < 0:
        return f"must be >= 0, not {v!r}"
    if name == "top_p" and not 0 < v <= 1:
        return f"must be in (0, 1], not {v!r}"
    if name == "min_p" and not 0 <= v <= 1:
        return f"must be in [0, 1], not {v!r}"
    if name == "top_k" and (v != int(v) or not -1 <= v <= 2**31 - 1):
        return f"must be an integer from -1 (off) to 2147483647, not {v!r}"
    return None


def _small_turn(messages: Sequence[dict], plan: Mapping[int, str]) -> bool:
    """Whether a call's blocking work is small enough for the event loop (no thread hop: two wake-ups of other
    threads saved, each a fair share of a turn's CPU on a virtual machine): its history restores an earlier
    output (the text before it was rendered, and cached, by earlier calls) and the messages after that restored
    output hold at most :data:`INLINE_TEXT` characters (their canonical JSON, cached for the body digest).  A
    first call, or one with much new text (tokenizing it takes milliseconds), keeps its thread hop."""
    if not plan:
        return False
    total = 0
    for m in messages[max(plan) + 1:]:
        total += len(_message_json(m))
        if total > INLINE_TEXT:
            return False
    return True


def _share_inputs(calls: Sequence[_Call], parent: _Call, prompt: np.ndarray) -> None:
    """``prompt`` grows ``parent``'s path: when the parent holds its input's own array, it and every call whose input
    is a prefix view of that array take their inputs as prefix views of ``prompt`` (equal IDs), so that array is
    freed.  An agent's growing history is then kept once, not once per call (each call kept O(context) new memory,
    faulted in page by page, every turn)."""
    old = parent.input
    if old.base is not None:
        return
    for c in calls:
        if c.input is old or c.input.base is old:
            c.input = prompt[:len(c.input)]


def _path(call: _Call) -> np.ndarray:
    """A recorded call's input + output IDs (uint32)."""
    return np.concatenate((call.input, np.asarray(call.output, dtype=np.uint32)))


def _extends(ids: np.ndarray, call: _Call) -> bool:
    """``ids`` starts with the call's input + output (compared in place, no copy of the path)."""
    k, out = len(call.input), call.output
    return len(ids) >= k + len(out) and np.array_equal(ids[:k], call.input) and ids[k:k + len(out)].tolist() == list(out)


def _starts_with(ids: np.ndarray, prefix: np.ndarray) -> bool:
    return len(ids) >= len(prefix) and np.array_equal(ids[:len(prefix)], prefix)


def _ids_json(ids: Sequence[int] | np.ndarray) -> bytes:
    """Token IDs as the inside of a JSON array (``str`` of each ID, comma-separated): IDs below 2**18 (any
    vocabulary the gateway serves) are gathered from a table of their texts, 8 NUL-padded bytes each, with numpy
    (no Python str per ID); others through the JSON encoder."""
    arr = np.asarray(ids, dtype=np.int64) if not isinstance(ids, np.ndarray) else ids
    if not len(arr):
        return b""
    if arr.min() < 0 or arr.max() >= _ID_TEXTS_SIZE:
        return json.dumps([int(x) for x in arr], separators=(",", ":"))[1:-1].encode()
    return _id_texts()[arr].tobytes().replace(b"\0", b"")[:-1]


_ID_TEXTS_SIZE = 2**18


@lru_cache(maxsize=1)
def _id_texts() -> np.ndarray:
    """``str(i) + ","`` NUL-padded to 8 bytes for every ID below 2**18, as one uint64 per ID."""
    table = b"".join(f"{i},".encode().ljust(8, b"\0") for i in range(_ID_TEXTS_SIZE))
    return np.frombuffer(table, dtype=np.uint64)


def _event_logprobs(ev: Mapping[str, Any]) -> list[float] | None:
    raw = ev.get("output_logprobs")
    if isinstance(raw, (bytes, bytearray)):
        return np.frombuffer(raw, dtype="<f4").astype(float).tolist()
    return list(raw) if isinstance(raw, list) else None


def _stop_cut(text: str, stops: Sequence[str] | None) -> tuple[str, str | None]:
    """Content ends where a stop string starts (OpenAI semantics: the stop string is not returned);
    also the stop string that matched (None if none)."""
    found = [(i, s) for s in stops or () if s for i in (text.find(s),) if i >= 0]
    if not found:
        return text, None
    cut, stop = min(found)
    return text[:cut], stop


def _response(execution_id: str, request_id: str, agent_id: str, meta: Mapping[str, Any], prompt: Sequence[int],
              output: Sequence[int], call_ids: Sequence[str], finish: str | None, parsed) -> dict:
    """The OpenAI chat completion of a recorded call: from its output tokens, tool-call ids and
    ``meta`` (created, model, match, parent, drift) alone, so a restarted gateway answers a
    retried call identically."""
    tool_calls = [{"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for cid, c in zip(call_ids, parsed.tool_calls)]
    content, stop = _stop_cut(parsed.content, meta.get("stop"))
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if tool_calls else ""),
                               "tool_calls": tool_calls or None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    ledger = {"execution_id": execution_id, "request_id": request_id, "agent_id": agent_id,
              "match": meta["match"], "parent_request_id": meta["parent"], "drift": meta["drift"]}
    if stop is not None:
        ledger["stop_sequence"] = stop
    return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": meta["created"],
            "model": meta["model"],
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output),
                      "total_tokens": len(prompt) + len(output)},
            "ledger": ledger}
