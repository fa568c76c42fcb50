"""Pure pieces of the capture gateway (SPEC §7.6): tool-call parsing, message keys,
restoration of recorded calls, history matching and drift classification.

No I/O, no tokenizer: token work is done by the caller (``ledger.gateway.app``),
which passes token lists and decoded text in.

* :func:`parse_qwen_output` splits a Qwen completion text into reasoning, content and
  ``<tool_call>`` JSON calls (each with its exact generated text).
* :func:`message_key` is what two messages must share to be "the same message": role,
  content, tool-call ids with their names and *parsed* arguments (so a harness that
  re-serialises arguments — key order, whitespace — still matches), ``tool_call_id``.
  Reasoning is not part of the key (harnesses drop it; the chat template drops it too).
* :func:`match_history` compares an incoming history with an agent's recorded calls and
  says whether it extends one (the normal tool loop), repeats one (a resample), restarts
  after a compaction, or diverges (drift), and which recorded call is its parent.
* :func:`restore_plan` picks, for each assistant message, the recorded call whose exact
  output tokens replace it (on the matched parent's path first, so both agree on ties).
* :func:`classify_token_drift` names the cause when messages extend a recorded call but the
  tokens do not (``retokenization``: same text, other IDs; ``template``: other text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

__all__ = ["DRIFT_CAUSES", "ParsedOutput", "ToolCall", "CallView", "HistoryMatch", "parse_qwen_output",
           "canonical_arguments", "message_key", "assistant_key", "match_history", "restore_plan",
           "classify_token_drift", "content_text"]

DRIFT_CAUSES = ("template", "retokenization", "edited_history", "other")

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments as JSON text (the generated value, re-serialised compactly by json.dumps)
    text: str  # the exact generated text between <tool_call> and </tool_call>


@dataclass(frozen=True)
class ParsedOutput:
    reasoning: str
    content: str
    tool_calls: tuple[ToolCall, ...]
    malformed: int = 0  # <tool_call> blocks whose JSON did not parse (left in the content)


def parse_qwen_output(text: str) -> ParsedOutput:
    """Reasoning, content and tool calls of a Qwen completion text (special tokens included,
    a trailing ``<|im_end|>`` / ``<|endoftext|>`` ignored). A block whose JSON is not an object
    with a string ``name`` and an object ``arguments`` stays in the content, as text."""
    for stop in ("<|im_end|>", "<|endoftext|>"):
        if text.endswith(stop):
            text = text[: -len(stop)]
    reasoning = ""
    if "</think>" in text:
        head, _, text = text.partition("</think>")
        reasoning = head.split("<think>", 1)[-1].strip("\n")
        text = text.lstrip("\n")
    calls: list[ToolCall] = []
    malformed = 0
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL.finditer(text):
        body = m.group(1)
        call = _parse_call(body)
        if call is None:
            malformed += 1
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip("\n") if calls else text.strip("\n")
    return ParsedOutput(reasoning, content.strip(), tuple(calls), malformed)


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), body.strip("\n"))


def canonical_arguments(arguments: Any) -> str:
    """Arguments (a JSON string or an object) in one canonical text: sorted keys, no spaces.
    Unparseable text is kept as it is (it then matches only itself)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return "\x00" + arguments
    return json.dumps(arguments, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a content-part list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return str(content)


def _tool_call_key(call: Mapping[str, Any]) -> tuple:
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    return (str(call.get("id", "")), str(fn.get("name", "")), canonical_arguments(fn.get("arguments", {})))


def assistant_key(content: str, tool_calls: Sequence[Mapping[str, Any]]) -> tuple:
    """The key of an assistant message with this content and these (OpenAI-shaped) tool calls."""
    return ("assistant", content_text(content).strip(), tuple(_tool_call_key(c) for c in tool_calls))


def message_key(message: Mapping[str, Any]) -> tuple:
    """What makes two messages the same (see the module doc)."""
    role = message.get("role")
    if role == "assistant":
        return assistant_key(message.get("content"), message.get("tool_calls") or ())
    if role == "tool":
        return ("tool", str(message.get("tool_call_id", "")), content_text(message.get("content")))
    return (str(role), content_text(message.get("content")))


@dataclass(frozen=True)
class CallView:
    """What matching needs of one recorded call of an agent."""
    request_id: str
    keys: tuple  # message keys of the history it was sent
    assistant: tuple  # assistant_key of the message it returned
    turn_kind: str = "task"
    restored: Mapping[int, str] = field(default_factory=dict)  # the restore_plan its own input was built with


@dataclass
class HistoryMatch:
    kind: str  # first | extends | resample | restart | diverged
    parent: str | None  # the recorded call whose path the new input should extend (or share a prefix with)
    matched: int  # messages of the new history that the parent's history (+ its output) covers
    cause: str | None = None  # for "diverged": edited_history | other
    diverged_at: int | None = None  # first message index that differs (for "diverged")
    restored: dict[int, str] = field(default_factory=dict)


def _lcp(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def match_history(keys: Sequence[tuple], calls: Sequence[CallView]) -> HistoryMatch:
    """Place an incoming history (its message keys) among an agent's recorded ``calls``
    (oldest first).

    ``extends``: it starts with some call's history + that call's output (the longest such
    call is the parent; of equally long ones the latest, as for ``resample``) and no other call
    recorded more of it. ``resample``: it equals some
    call's history. ``restart``: it extends none and the agent's latest call was a ``summary``
    turn (a compaction). ``diverged``: it shares ``matched`` messages with the closest call
    and then differs (also when it extends an earlier call but differs from a later one inside
    what that one recorded) — ``edited_history`` when it shares at least one message,
    ``other`` when it shares none.
    """
    keys = tuple(keys)
    if not calls:
        return HistoryMatch("first", None, 0)
    best: tuple[int, CallView] | None = None
    for c in calls:
        full = c.keys + (c.assistant,)
        if len(keys) >= len(full) and keys[:len(full)] == full and (best is None or len(full) >= best[0]):
            best = (len(full), c)
    for c in reversed(calls):
        if keys == c.keys:
            return HistoryMatch("resample", c.request_id, len(keys))
    closest = max(reversed(calls), key=lambda c: _lcp(keys, c.keys + (c.assistant,)))
    n = _lcp(keys, closest.keys + (closest.assistant,))
    if best is not None:
        edited = [c for c in calls if best[0] <= _lcp(keys, c.keys + (c.assistant,)) < min(len(keys), len(c.keys) + 1)]
        if not edited:
            return HistoryMatch("extends", best[1].request_id, best[0])
        closest = max(reversed(edited), key=lambda c: _lcp(keys, c.keys + (c.assistant,)))
        n = _lcp(keys, closest.keys + (closest.assistant,))
    # it extends no call, or a later call recorded more of this history than the extension
    # covers and the history now differs from it there (an edit of what was recorded)
    if best is None and calls[-1].turn_kind == "summary":
        return HistoryMatch("restart", closest.request_id, n)
    return HistoryMatch("diverged", closest.request_id, n, "edited_history" if n > 0 else "other", n)


def restore_plan(keys: Sequence[tuple], calls: Sequence[CallView], parent: str | None = None) -> dict[int, str]:
    """``{message index: request_id}`` for every assistant message that equals the output of a
    recorded call (by key: content, tool-call ids and parsed arguments).

    Inside what the ``parent`` call (``match_history``'s parent) recorded, a message is restored
    from the call on the parent's path: the call the parent's own input restored there
    (``CallView.restored``), or the parent itself for its output — so two recorded outputs with
    the same key (a regenerated answer) never mix the parent's tokens with another call's.
    Elsewhere a call whose history equals the messages before it wins; otherwise the latest
    call with that output."""
    by_output: dict[tuple, list[CallView]] = {}
    for c in calls:
        by_output.setdefault(c.assistant, []).append(c)
    plan: dict[int, str] = {}
    keys = tuple(keys)
    p = next((c for c in reversed(calls) if c.request_id == parent), None) if parent is not None else None
    on_path = _lcp(keys, p.keys + (p.assistant,)) if p is not None else 0
    for i, k in enumerate(keys):
        if not k or k[0] != "assistant":
            continue
        cands = by_output.get(k)
        if not cands:
            continue
        if i < on_path:
            rid = p.request_id if i == len(p.keys) else p.restored.get(i)
            if rid is not None and any(c.request_id == rid for c in cands):
                plan[i] = rid
                continue
        positional = [c for c in cands if c.keys == keys[:i]]
        plan[i] = (positional or cands)[-1].request_id
    return plan


def classify_token_drift(expected_text: str, new_text: str) -> str:
    """Cause of a token divergence under messages that extend the recorded call: the same
    text tokenized differently is ``retokenization``; different text is ``template``."""
    return "retokenization" if new_text.startswith(expected_text) else "template"
