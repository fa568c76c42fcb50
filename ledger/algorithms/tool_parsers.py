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
gemma4         ``<|tool_call>call:N{key:<|"|>text<|"|>,n:2,obj:{k:true},xs:[1,2]}<tool_call|>``, reasoning
               in ``<|channel>thought\n...<channel|>`` (Gemma 4; its own argument syntax, read into JSON)
=============  ==============================================================================
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Sequence

from ledger.algorithms.chat_restore import ParsedOutput, ToolCall, parse_qwen_output
from ledger.algorithms.errors import InputError

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


# ------------------------------------------------------------------ gemma4
_GEMMA_CALL = re.compile(r"<\|tool_call>\s*call:([^{<\s]+)\s*(\{.*?\})\s*<tool_call\|>", re.DOTALL)
_GEMMA_THOUGHT = re.compile(r"<\|channel>thought\n?(.*?)(?:<channel\|>|$)", re.DOTALL)
_GEMMA_QUOTE = '<|"|>'
_GEMMA_SCALAR = re.compile(r"[^,}\]\s]+")
_GEMMA_WORDS = {"true": True, "false": False, "null": None, "None": None}


class _GemmaSyntax(InputError):
    pass


def _skip_space(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


def _gemma_value(s: str, i: int) -> tuple[Any, int]:
    """The value at ``s[i]`` in Gemma 4's argument syntax (the template's ``format_argument``):
    strings between ``<|"|>`` as written (no escapes), ``{key:value,...}`` with bare or quoted
    keys, ``[a,b]``, ``true``/``false``, numbers and ``None``/``null`` as Jinja prints them."""
    i = _skip_space(s, i)
    if s.startswith(_GEMMA_QUOTE, i):
        end = s.find(_GEMMA_QUOTE, i + len(_GEMMA_QUOTE))
        if end < 0:
            raise _GemmaSyntax("unterminated string")
        return s[i + len(_GEMMA_QUOTE):end], end + len(_GEMMA_QUOTE)
    if s.startswith("{", i):
        return _gemma_items(s, i + 1, "}", _gemma_pair, dict)
    if s.startswith("[", i):
        return _gemma_items(s, i + 1, "]", _gemma_value, list)
    m = _GEMMA_SCALAR.match(s, i)
    if m is None:
        raise _GemmaSyntax(f"no value at {i}")
    return _gemma_scalar(m.group(0)), m.end()


def _gemma_scalar(word: str) -> Any:
    if word in _GEMMA_WORDS:
        return _GEMMA_WORDS[word]
    for kind in (int, float):
        try:
            value = kind(word)
        except ValueError:
            continue
        if value == value and value not in (float("inf"), float("-inf")):
            return value
    raise _GemmaSyntax(f"not a value: {word!r}")


def _gemma_pair(s: str, i: int) -> tuple[tuple[str, Any], int]:
    i = _skip_space(s, i)
    if s.startswith(_GEMMA_QUOTE, i):
        key, i = _gemma_value(s, i)
    else:
        colon = s.find(":", i)
        if colon < 0:
            raise _GemmaSyntax("key without ':'")
        key, i = s[i:colon].strip(), colon
    i = _skip_space(s, i)
    if not key or not s.startswith(":", i):
        raise _GemmaSyntax(f"bad key at {i}")
    value, i = _gemma_value(s, i + 1)
    return (key, value), i


def _gemma_items(s: str, i: int, close: str, item: Callable, build: Callable) -> tuple[Any, int]:
    out = []
    while True:
        i = _skip_space(s, i)
        if s.startswith(close, i) and not out:
            return build(out), i + 1
        value, i = item(s, i)
        out.append(value)
        i = _skip_space(s, i)
        if s.startswith(close, i):
            return build(out), i + 1
        if not s.startswith(",", i):
            raise _GemmaSyntax(f"expected ',' or {close!r} at {i}")
        i += 1


def gemma4_arguments(text: str) -> dict[str, Any] | None:
    """``{key:value,...}`` in Gemma 4's syntax as a JSON-ready dict; None when it does not parse."""
    try:
        value, end = _gemma_value(text, 0)
    except (_GemmaSyntax, RecursionError):
        return None
    return value if isinstance(value, dict) and not text[end:].strip() else None


def parse_gemma4(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    """Gemma 4: ``<|channel>thought`` is reasoning; each ``<|tool_call>call:NAME{...}<tool_call|>``
    a call; the ``<|tool_response>`` the model stops on after its calls is not content."""
    reasoning = "\n".join(m.group(1).strip("\n") for m in _GEMMA_THOUGHT.finditer(text)).strip()
    text = _GEMMA_THOUGHT.sub("", text)
    for end in ("<|tool_response>", "<turn|>"):
        text = text.rstrip().removesuffix(end)

    def make(m: re.Match) -> ToolCall | None:
        args = gemma4_arguments(m.group(2))
        return _call(m.group(1), args, m.group(0)[len("<|tool_call>"):-len("<tool_call|>")]) if args is not None else None

    return _collect(text, _GEMMA_CALL, make, reasoning)


def parse_hermes(text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    return parse_qwen_output(text)


FAMILIES: dict[str, Callable[..., ParsedOutput]] = {
    "hermes": parse_hermes, "qwen3-xml": parse_qwen3_xml, "llama3-json": parse_llama3_json,
    "mistral": parse_mistral, "deepseek-v3": parse_deepseek_v3, "harmony": parse_harmony,
    "gemma4": parse_gemma4,
}


def parse_tool_output(family: str, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
    """Reasoning, content and tool calls of ``text`` in ``family``'s syntax."""
    try:
        parser = FAMILIES[family]
    except KeyError:
        raise InputError(f"unknown tool parser {family!r} (known: {', '.join(FAMILIES)})") from None
    return parser(text, tools)


def detect_family(template: str | None) -> str:
    """The tool-call family a chat template writes (``hermes`` when it names none)."""
    t = template or ""
    if "<|channel|>" in t and "<|call|>" in t:
        return "harmony"
    if "<|tool_call>" in t and "<tool_call|>" in t:
        return "gemma4"
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
