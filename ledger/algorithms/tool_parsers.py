"""Tool-call formats of the major open-model families (SPEC §11.3): a completion's text (special
tokens included, the end-of-turn token removed) -> reasoning, content and OpenAI tool calls.

Pure functions, no tokenizer. Each parser keeps every call's exact generated text
(``ToolCall.text``) and its arguments as compact JSON; text that does not parse as a call stays
in the content. :func:`detect_family` picks the family from a chat template's own syntax.

=============  ==============================================================================
family         output syntax
=============  ==============================================================================
hermes         ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5/3)
qwen3-xml      ``<tool_call><function=N><parameter=P>value</parameter></function></tool_call>``
               (Qwen3-Coder, Qwen 3.5)
llama3-json    ``{"name": N, "parameters": {...}}`` alone, optionally after ``<|python_tag|>``,
               several separated by ``;`` (Llama 3.1 / 3.2 / 3.3)
mistral        ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`` or
               ``[TOOL_CALLS]N[ARGS]{...}`` (Mistral Small 3.2, Devstral, Ministral)
deepseek-v3    ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
               (V3 / R1) or ``<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` (V3.1+)
harmony        ``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>commentary
               to=functions.N <|constrain|>json<|message|>{...}<|call|>`` (gpt-oss)
=============  ==============================================================================
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Sequence

from ledger.algorithms.chat_restore import ParsedOutput, ToolCall, parse_qwen_output

__all__ = ["FAMILIES", "detect_family", "parse_tool_output"]


def _call(name: Any, args: Any, text: str) -> ToolCall | None:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False), text)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _split_think(text: str) -> tuple[str, str]:
    if "</think>" not in text:
        return "", text
    head, _, rest = text.partition("</think>")
    return head.split("<think>", 1)[-1].strip("\n"), rest.lstrip("\n")


def _collect(text: str, pattern: re.Pattern, make: Callable[[re.Match], ToolCall | None],
             reasoning: str = "") -> ParsedOutput:
    """Calls at each match of ``pattern`` (kept as content when ``make`` refuses them)."""
    calls, kept, pos, bad = [], [], 0, 0
    for m in pattern.finditer(text):
        call = make(m)
        if call is None:
            bad += 1
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    return ParsedOutput(reasoning, "".join(kept).strip(), tuple(calls), bad)


# ------------------------------------------------------------------ qwen3-xml
_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _param_types(tools: Sequence[Mapping[str, Any]] | None, name: str) -> dict[str, Any]:
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, Mapping) else {}
        if isinstance(fn, Mapping) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, Mapping)}
    return {}


def _xml_value(raw: str, declared: Any) -> Any:
    if declared == "string":
        return raw
    value = _json(raw)
    return raw if value is None and raw != "null" else value


def parse_qwen3_xml(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    reasoning, text = _split_think(text)

    def make(m: re.Match) -> ToolCall | None:
        name = m.group(1).strip()
        types = _param_types(tools, name)
        args = {p.group(1).strip(): _xml_value(p.group(2), types.get(p.group(1).strip()))
                for p in _XML_PARAM.finditer(m.group(2))}
        return _call(name, args, m.group(0)[len("<tool_call>"):-len("</tool_call>")].strip("\n"))

    return _collect(text, _XML_CALL, make, reasoning)


# ------------------------------------------------------------------ llama3-json
def parse_llama3_json(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    """Llama 3.x: the whole output is the call(s) (JSON objects separated by ``;``), after an
    optional ``<|python_tag|>``; anything else is content."""
    reasoning, body = _split_think(text)
    stripped = body.strip()
    for end in ("<|eot_id|>", "<|eom_id|>"):
        stripped = stripped.removesuffix(end).rstrip()
    tagged = stripped.startswith("<|python_tag|>")
    if tagged:
        stripped = stripped[len("<|python_tag|>"):].strip()
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(stripped):
        try:
            obj, end = decoder.raw_decode(stripped, pos)
        except (ValueError, RecursionError):
            return ParsedOutput(reasoning, body.strip(), ())
        call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments", {})), stripped[pos:end]) \
            if isinstance(obj, dict) else None
        if call is None:
            return ParsedOutput(reasoning, body.strip(), ())
        calls.append(call)
        pos = end
        while pos < len(stripped) and stripped[pos] in "; \n\t":
            pos += 1
    return ParsedOutput(reasoning, "", tuple(calls)) if calls else ParsedOutput(reasoning, body.strip(), ())


# ------------------------------------------------------------------ mistral
_MISTRAL_ARGS = re.compile(r"\[TOOL_CALLS\]([^\[\]\s{]+)(?:\[CALL_ID\][^\[]*)?\[ARGS\]")


def parse_mistral(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    reasoning, text = _split_think(text)
    head, sep, rest = text.partition("[TOOL_CALLS]")
    if not sep:
        return ParsedOutput(reasoning, text.strip(), ())
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    if rest.lstrip().startswith("["):  # v3: a JSON list of {"name", "arguments"}
        try:
            items, _ = decoder.raw_decode(rest.lstrip())
        except (ValueError, RecursionError):
            return ParsedOutput(reasoning, text.strip(), (), 1)
        for it in items if isinstance(items, list) else ():
            call = _call(it.get("name"), it.get("arguments", {}), json.dumps(it, ensure_ascii=False)) \
                if isinstance(it, dict) else None
            if call is None:
                return ParsedOutput(reasoning, text.strip(), (), 1)
            calls.append(call)
        return ParsedOutput(reasoning, head.strip(), tuple(calls))
    pos = len(head)
    for m in _MISTRAL_ARGS.finditer(text, pos):  # v11+: [TOOL_CALLS]name[ARGS]{...}, repeated
        try:
            args, end = decoder.raw_decode(text, m.end())
        except (ValueError, RecursionError):
            return ParsedOutput(reasoning, text.strip(), (), 1)
        call = _call(m.group(1), args, text[m.start() + len("[TOOL_CALLS]"):end])
        if call is None:
            return ParsedOutput(reasoning, text.strip(), (), 1)
        calls.append(call)
    return ParsedOutput(reasoning, head.strip(), tuple(calls)) if calls else ParsedOutput(reasoning, text.strip(), (), 1)


# ------------------------------------------------------------------ deepseek-v3
_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```"
                      r"|([^<]+?)<｜tool▁sep｜>(.*?))<｜tool▁call▁end｜>", re.DOTALL)


def parse_deepseek_v3(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    reasoning, text = _split_think(text)
    head, sep, rest = text.partition("<｜tool▁calls▁begin｜>")
    if not sep:
        return ParsedOutput(reasoning, text.strip(), ())
    rest = rest.split("<｜tool▁calls▁end｜>", 1)[0]

    def make(m: re.Match) -> ToolCall | None:
        name = m.group(1) if m.group(1) is not None else m.group(3)
        args = m.group(2) if m.group(1) is not None else m.group(4)
        return _call(name.strip(), args, m.group(0))

    got = _collect(rest, _DS_CALL, make, reasoning)
    if not got.tool_calls:
        return ParsedOutput(reasoning, text.strip(), (), got.malformed or 1)
    return ParsedOutput(reasoning, head.strip(), got.tool_calls, got.malformed)


# ------------------------------------------------------------------ harmony (gpt-oss)
_HARMONY_MSG = re.compile(r"(?:<\|start\|>assistant)?([^<]*)<\|channel\|>(\w+)([^<]*)(?:<\|constrain\|>[^<]*)?<\|message\|>"
                          r"(.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|<\|start\|>|$)", re.DOTALL)


def parse_harmony(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    """gpt-oss's harmony messages: ``analysis`` is reasoning, ``final`` the content, a
    ``commentary`` message addressed ``to=functions.NAME`` a tool call."""
    reasoning, content, calls, bad = [], [], [], 0
    found = False
    for m in _HARMONY_MSG.finditer(text):
        found = True
        channel, header, body = m.group(2), m.group(1) + m.group(3), m.group(4)
        to = re.search(r"to=functions\.([^\s<]+)", header)
        if to:
            call = _call(to.group(1), body.strip(), m.group(0))
            if call is None:
                bad += 1
                content.append(body)
            else:
                calls.append(call)
        elif channel == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    if not found:
        return ParsedOutput("", text.strip(), ())
    return ParsedOutput("\n".join(reasoning).strip(), "".join(content).strip(), tuple(calls), bad)


def parse_hermes(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    return parse_qwen_output(text)


FAMILIES: dict[str, Callable[..., ParsedOutput]] = {
    "hermes": parse_hermes, "qwen3-xml": parse_qwen3_xml, "llama3-json": parse_llama3_json,
    "mistral": parse_mistral, "deepseek-v3": parse_deepseek_v3, "harmony": parse_harmony,
}


def parse_tool_output(family: str, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    """Reasoning, content and tool calls of ``text`` in ``family``'s syntax."""
    try:
        parser = FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown tool parser {family!r} (known: {', '.join(FAMILIES)})") from None
    return parser(text, tools)


def detect_family(template: str | None) -> str:
    """The tool-call family a chat template writes (``hermes`` when it names none)."""
    t = template or ""
    if "<|channel|>" in t and "<|call|>" in t:
        return "harmony"
    if "tool▁calls▁begin" in t or "tool▁call▁begin" in t:
        return "deepseek-v3"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3-xml"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ('"parameters": ' in t and "<|eot_id|>" in t):
        return "llama3-json"
    return "hermes"
