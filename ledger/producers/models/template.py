"""A model's own chat template and tokenizer (SPEC §11.3): a Hugging Face tokenizer directory or
a GGUF file, rendered the way ``transformers``' ``apply_chat_template`` renders.

* **Jinja environment** as Hugging Face builds it (sandboxed, ``trim_blocks``, ``lstrip_blocks``,
  ``loopcontrols``, the ``{% generation %}`` tag, ``raise_exception``, ``strftime_now``,
  ``tojson`` with ``json.dumps`` defaults — ``", "`` / ``": "`` separators, no ASCII escaping —
  and reasoning aliased to ``reasoning_content`` / ``thinking``); the special-token strings
  (``bos_token``, ``eos_token``, ...) and the request's ``chat_template_kwargs`` are variables.
  The text is tokenized with special tokens parsed and none added (``add_special_tokens=False``).
* **Restoration by difference.** Each restored assistant message is rendered as a sentinel; the
  template's text around it is kept and the sentinel with the template's own end-of-turn token
  replaced by the recorded output tokens, after the generation prompt (found by rendering with
  and without ``add_generation_prompt``). Text runs are tokenized separately and cached, so a
  turn tokenizes only its new messages.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ledger.algorithms.chat_restore import content_text
from ledger.algorithms.errors import InputError
from ledger.algorithms.tool_parsers import detect_family
from ledger.producers.models.base import LLAMACPP_EOG, ChatFormat
from ledger.producers.models.gguf_vocab import load_gguf_vocab
from ledger.algorithms.tool_parsers import FAMILIES

__all__ = ["TemplateFormat", "compile_template"]

_SENTINEL = "\ue000ledger-restored-{}\ue001"


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_template(source: str):
    """The template compiled in Hugging Face's chat-template environment."""
    import jinja2  # optional extra [models]
    from jinja2.ext import Extension, loopcontrols  # optional extra [models]
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # optional extra [models]

    class Generation(Extension):  # {% generation %}...{% endgeneration %}: the body, as HF renders it untracked
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _arguments(value: Any) -> Any:
    """Tool-call arguments as the templates expect them: an object (vLLM and SGLang parse the
    JSON text the same way before rendering), the text itself if it is not a JSON object."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def template_message(m: Mapping[str, Any]) -> dict:
    """An OpenAI chat message as the chat templates read it."""
    out: dict[str, Any] = {k: v for k, v in m.items() if k in ("role", "name", "tool_call_id")}
    calls = m.get("tool_calls") or ()
    content = m.get("content")
    out["content"] = content_text(content)  # "" for null: templates test `'</think>' in content` and the like
    reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if isinstance(m.get(k), str)), None)
    if reasoning is not None:
        out.update(reasoning_content=reasoning, thinking=reasoning)
    if calls:
        out["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                              "function": {"name": (c.get("function") or {}).get("name", ""),
                                           "arguments": _arguments((c.get("function") or {}).get("arguments", {}))}}
                             for c in calls]
    return out


def _token_string(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class TemplateFormat(ChatFormat):
    def __init__(self, tokenizer: Any, template: str, *, name: str, special: Mapping[str, str],
                 eos_ids: Sequence[int], tool_parser: str | None = None, stop_tokens: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.template_source = template
        self.template = compile_template(template)
        self.name = name
        self.special = dict(special)  # bos_token, eos_token, ... as template variables
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.tool_parser = tool_parser or detect_family(template)
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = {t.content: i for i, t in added.items() if t.special}
        eot = set(eos_ids) | set(stop_tokens) | {self._special_ids[t] for t in LLAMACPP_EOG if t in self._special_ids}
        close = self._close_token()
        if close is not None:
            eot.add(close)
        self.end_of_turn = frozenset(eot)
        self._hidden = tuple(sorted(self._special_ids, key=len, reverse=True))
        self._encode_cached = lru_cache(maxsize=16384)(self._encode_uncached)
        self._encode_array = lru_cache(maxsize=16384)(self._encode_array_uncached)
        self._gen_prompts: dict[str, str] = {}

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_path(cls, path: Path, *, chat_template: str | None = None, tool_parser: str | None = None,
                  stop_tokens: Sequence[int] = ()) -> "TemplateFormat":
        if path.is_dir():
            tok, template, special, eos = _load_hf_dir(path)
        elif path.suffix.lower() == ".gguf":
            tok, template, special, eos = _load_gguf(path)
        else:
            raise InputError(f"{path} is neither a GGUF file nor a Hugging Face tokenizer directory")
        if chat_template is not None:
            template = Path(chat_template).read_text(encoding="utf-8")
        if not template:
            raise InputError(f"{path} has no chat template: give one with --chat-template FILE.jinja")
        if tool_parser is not None:

            if tool_parser not in FAMILIES:
                raise InputError(f"unknown --tool-parser {tool_parser!r} (known: {', '.join(FAMILIES)})")
        return cls(tok, template, name=str(path), special=special, eos_ids=eos, tool_parser=tool_parser,
                   stop_tokens=stop_tokens)

    # ------------------------------------------------------------------ tokens
    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def _encode_array_uncached(self, text: str) -> np.ndarray:
        arr = np.array(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.uint32)
        arr.setflags(write=False)
        return arr

    def encode(self, text: str) -> list[int]:
        return list(self._encode_cached(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def hidden_texts(self) -> Sequence[str]:
        return self._hidden

    def piece(self, i: int) -> str:
        return self.tokenizer.id_to_token(i) or ""

    # ------------------------------------------------------------------ rendering
    def render_text(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True, kwargs: Mapping[str, Any] | None = None) -> str:
        """The template's text, as ``apply_chat_template(..., tokenize=False)`` gives it."""
        return self._render([template_message(m) for m in messages], tools, add_generation_prompt, kwargs)

    def _render(self, msgs: list[dict], tools, add_generation_prompt: bool, kwargs) -> str:
        kw = dict(kwargs or {})
        documents = kw.pop("documents", None)
        return self.template.render(messages=msgs, tools=list(tools) if tools else None, documents=documents,
                                    add_generation_prompt=add_generation_prompt, **{**self.special, **kw})

    def generation_prompt(self, kwargs: Mapping[str, Any] | None = None) -> str:
        """What ``add_generation_prompt`` appends (rendered with and without it, the difference)."""
        key = json.dumps(kwargs or {}, sort_keys=True, default=str)
        if key not in self._gen_prompts:
            probe = [{"role": "user", "content": "ledger"}]
            try:
                with_gp, without = (self._render(probe, None, g, kwargs) for g in (True, False))
            except Exception:  # noqa: BLE001 - a template that refuses the probe: no known prompt
                with_gp = without = ""
            self._gen_prompts[key] = with_gp[len(without):] if with_gp.startswith(without) else ""
        return self._gen_prompts[key]

    def _close_token(self) -> int | None:
        """The special token the template closes an assistant turn with."""
        s = _SENTINEL.format(0)
        try:
            text = self._render([{"role": "user", "content": "ledger"}, {"role": "assistant", "content": s}],
                                None, False, None)
        except Exception:  # noqa: BLE001
            return None
        after = text.partition(s)[2].strip(" \n")
        for t, i in sorted(self._special_ids.items(), key=lambda x: -len(x[0])):
            if after.startswith(t):
                return i
        return None

    def call_id(self, digest: str) -> str:
        """A tool-call id the template accepts (Mistral's insist on 9 alphanumerics)."""
        return digest[:9] if self.tool_parser == "mistral" else f"call_{digest[:24]}"

    def _render_restored(self, messages, tools, restored, kwargs) -> str:
        """The template's text with each restored assistant message's content a sentinel: without its
        tool calls, or with them for a template that checks each tool result has its call."""
        import jinja2  # optional extra [models]

        plain = [({"role": "assistant", "content": _SENTINEL.format(i)} if i in restored else template_message(m))
                 for i, m in enumerate(messages)]
        try:
            return self._render(plain, tools, True, kwargs)
        except jinja2.TemplateError:
            kept = [({**template_message(m), "content": _SENTINEL.format(i)} if i in restored else template_message(m))
                    for i, m in enumerate(messages)]
            return self._render(kept, tools, True, kwargs)

    def assemble(self, messages, tools, restored, kwargs=None) -> list[int]:
        ids: list[int] = []
        for p in self._parts(messages, tools, restored, kwargs):
            ids.extend(self._encode_cached(p) if isinstance(p, str) else p)
        return ids

    def assemble_array(self, messages, tools, restored, kwargs=None) -> np.ndarray:
        parts = self._parts(messages, tools, restored, kwargs)
        return np.concatenate([self._encode_array(p) if isinstance(p, str) else np.asarray(p, dtype=np.uint32)
                               for p in parts] or [np.zeros(0, dtype=np.uint32)])

    def _parts(self, messages, tools, restored, kwargs) -> list:
        """The prompt as text runs (tokenized separately, cached) and restored output IDs, in order."""
        if not restored:
            return [self._render([template_message(m) for m in messages], tools, True, kwargs)]
        text = self._render_restored(messages, tools, restored, kwargs)
        lost = _lost_tool_results(messages, restored, text)
        if lost:  # results the template writes only with their calls (Gemma 4): render afresh, not lose them
            full = self._render([template_message(m) for m in messages], tools, True, kwargs)
            if any(r in full for r in lost):
                return [full]
        gen = self.generation_prompt(kwargs)
        parts: list = []
        pos = 0
        for i in sorted(restored):
            s = _SENTINEL.format(i)
            at = text.find(s, pos)
            if at < 0:  # the template dropped the message: nothing of it to restore
                continue
            head = text.rfind(gen, pos, at) if gen else -1
            parts.append(text[pos:head] + gen if head >= 0 else text[pos:at])
            out = restored[i]
            end = at + len(s)
            close = self._closing_text(text, end)
            parts.append(out)
            if close and (not len(out) or out[-1] not in self.end_of_turn):
                parts.append(close[-len(self._close_token_text(close)):])
            pos = end + len(close)
        parts.append(text[pos:])
        return parts

    def _close_token_text(self, close: str) -> str:
        return max((t for t, i in self._special_ids.items() if i in self.end_of_turn and close.endswith(t)), key=len)

    def _closing_text(self, text: str, at: int) -> str:
        """The template's text from ``at`` through the end-of-turn special token that closes the turn
        (the rendered tool calls included when the template kept them); "" if it writes none there."""
        ends = [(text.find(t, at), t) for t, i in self._special_ids.items() if i in self.end_of_turn]
        ends = [(k, t) for k, t in ends if k >= 0 and "\ue000" not in text[at:k]]
        if not ends:
            return ""
        k, t = min(ends, key=lambda x: (x[0], -len(x[1])))
        return text[at:k + len(t)]


def _lost_tool_results(messages, restored, text: str) -> list[str]:
    """The tool results after the first restored message that the text rendered with restored
    messages as sentinels does not hold (a template that writes each result inside the assistant
    message whose call it answers): restoring there would silently drop what the tool returned."""
    results = (content_text(m.get("content")).strip() for m in messages[min(restored) + 1:] if m.get("role") == "tool")
    return [r for r in results if r and r not in text]


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise InputError(f"{path} is not JSON: {exc}") from None
    return doc if isinstance(doc, dict) else {}


def _load_hf_dir(path: Path):
    from tokenizers import Tokenizer  # optional extra [models]

    if not (path / "tokenizer.json").exists():
        raise InputError(f"{path} has no tokenizer.json (a Hugging Face tokenizer directory has one)")
    try:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - the library's error names what is wrong
        raise InputError(f"{path / 'tokenizer.json'} does not load: {exc}") from None
    cfg = _read_json(path / "tokenizer_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    special = {k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token")
               if (s := _token_string(cfg.get(k))) is not None}
    eos: list[int] = []
    if "eos_token" in special and tok.token_to_id(special["eos_token"]) is not None:
        eos.append(tok.token_to_id(special["eos_token"]))
    for extra in ("generation_config.json", "config.json"):
        v = _read_json(path / extra).get("eos_token_id")
        eos.extend(x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int))
    return tok, template, special, eos


def _load_gguf(path: Path):

    v = load_gguf_vocab(path)
    special = {}
    if v.bos_id is not None:
        special["bos_token"] = v.tokens[v.bos_id]
    if v.eos_ids:
        special["eos_token"] = v.tokens[v.eos_ids[0]]
    return v.tokenizer, v.chat_template, special, v.eos_ids
