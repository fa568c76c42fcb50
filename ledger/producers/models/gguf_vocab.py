"""A GGUF file's tokenizer as a Hugging Face ``tokenizers.Tokenizer`` (SPEC §11.3).

llama.cpp keeps the tokenizer in the GGUF metadata (``tokenizer.ggml.*``): the token list, their
types, BPE merges or SentencePiece scores, the special-token ids and, often, the chat template.
:func:`load_gguf_vocab` reads it (its own reader of the metadata section, see `_Reader`) and rebuilds the
tokenizer llama.cpp runs, in the Rust ``tokenizers`` library:

* ``gpt2`` (byte-level BPE): the pre-tokenizer regex of ``tokenizer.ggml.pre`` (as in
  llama.cpp's ``llm_tokenizer_bpe``), GPT-2 byte mapping, the file's merges; ``ignore_merges``
  for the Llama-3 family, as llama.cpp does.
* ``llama`` (SentencePiece): spaces as ``▁`` with a space prefix before each text run,
  merges by piece score (llama.cpp merges the pair whose joined piece scores highest),
  ``<0xXX>`` byte fallback.
* ``gemma4``: character-level BPE over ``▁``-escaped text, split at newlines, byte fallback.

Control and user-defined tokens are added tokens (always split out of text, as the rendered
chat template writes them). llama.cpp's golden vectors (``tests/test_model_vocab.py``) decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import struct
from pathlib import Path
from typing import Any
import mmap
import numpy as np

from ledger.algorithms.errors import InputError

__all__ = ["GGUFVocab", "load_gguf_vocab", "read_gguf_metadata", "BPE_PRE_REGEX"]

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's llm_tokenizer_bpe regexes by tokenizer.ggml.pre (each a list applied in turn)
BPE_PRE_REGEX: dict[str, list[str]] = {
    "llama3": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen35": [_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"],
    "smollm": [r"\p{N}", _GPT2],  # starcoder / refact / smollm: single digits, then GPT-2
    "gpt2": [_GPT2],
}
_PRE_ALIASES = {"llama-bpe": "llama3", "llama-v3": "llama3", "llama3": "llama3", "dbrx": "llama3", "smaug-bpe": "llama3",
                "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "qwen35": "qwen35", "smollm": "smollm",
                "starcoder": "smollm", "refact": "smollm", "gpt-2": "gpt2", "gpt2": "gpt2", "default": "gpt2"}
_IGNORE_MERGES = {"llama3"}
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class GGUFVocab:
    tokenizer: Any  # tokenizers.Tokenizer
    model: str  # tokenizer.ggml.model
    pre: str | None
    tokens: list[str]
    bos_id: int | None
    eos_ids: list[int]
    chat_template: str | None
    add_bos: bool
    special: dict[str, int] = field(default_factory=dict)  # control / user-defined token text -> id

    def token_text(self, i: int) -> str:
        return self.tokens[i]


# GGUF value types (gguf spec): scalar struct formats, 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}


class _Reader:
    """The key/value section of a GGUF file (v2/v3), read once: strings and arrays of numbers in bulk.
    (``gguf.GGUFReader`` builds one numpy view per array element: seconds for a 128k-token vocabulary.)"""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = self.data[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int):
        if vtype == 8:
            return self.string()
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype != 9:
            raise InputError(f"unknown GGUF value type {vtype}")
        etype, n = self.take("<I"), self.take("<Q")
        if etype in _NUMPY:

            arr = np.frombuffer(self.data, dtype=_NUMPY[etype], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.astype(bool).tolist() if etype == 7 else arr.tolist()
        return [self.value(etype) for _ in range(n)]

    def metadata(self) -> dict[str, Any]:
        if self.data[:4] != b"GGUF":
            raise InputError("no GGUF magic")
        self.pos = 4
        version = self.take("<I")
        if version not in (2, 3):
            raise InputError(f"GGUF version {version} is not supported")
        self.take("<Q")  # tensor count
        out = {}
        for _ in range(self.take("<Q")):
            key = self.string()
            out[key] = self.value(self.take("<I"))
        return out


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of a GGUF file (ValueError if it is not one)."""

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        try:
            return _Reader(mm).metadata()
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError, MemoryError) as exc:
            raise InputError(f"truncated or corrupt GGUF metadata: {exc}") from None


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        a, _, b = m.partition(" ")
        out.append((a, b))
    return out


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece merges: every split of a piece into two pieces, ranked by the joined piece's
    score (highest first), as llama.cpp's SPM tokenizer picks the best-scoring bigram."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED, UNKNOWN)}
    found = []
    for piece, i in vocab.items():
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in vocab and b in vocab:
                found.append((-scores[i], i, vocab[a], vocab[b], a, b))
    found.sort()
    return [(a, b) for *_, a, b in found]


def _build(model: str, pre: str | None, tokens: list[str], types: list[int], merges: list[str] | None,
           scores: list[float] | None, add_space_prefix: bool, unk: int | None):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers  # optional extra [models]

    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if model == "gpt2":
        kind = _PRE_ALIASES.get(pre or "default")
        if kind is None:
            raise InputError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {', '.join(sorted(_PRE_ALIASES))})")
        tok = Tokenizer(models.BPE(vocab, _split_merges(merges or []), ignore_merges=kind in _IGNORE_MERGES))
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in BPE_PRE_REGEX[kind]]
        tok.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                      use_regex=False)])
        tok.decoder = decoders.ByteLevel()
    elif model in ("llama", "gemma4"):
        unk_token = tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None
        if model == "llama":
            bpe = models.BPE(vocab, _spm_merges(tokens, scores or [0.0] * len(tokens), types), unk_token=unk_token,
                             fuse_unk=True, byte_fallback=True)
        else:
            bpe = models.BPE(vocab, _split_merges(merges or []), unk_token=unk_token, fuse_unk=True, byte_fallback=True)
        tok = Tokenizer(bpe)
        norms = [normalizers.Replace(" ", "▁")]
        if add_space_prefix:
            norms.insert(0, normalizers.Prepend("▁"))
        tok.normalizer = normalizers.Sequence(norms)
        if model == "gemma4":
            tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
        dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space_prefix:
            dec.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(dec)
    else:
        raise InputError(f"GGUF tokenizer model {model!r} is not supported (gpt2, llama, gemma4)")
    added = [AddedToken(t, special=ty == CONTROL, normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)
    return tok


def load_gguf_vocab(path: str | Path) -> GGUFVocab:
    """The tokenizer, special ids and chat template of a GGUF file (ValueError if unreadable)."""
    try:
        meta = read_gguf_metadata(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path} is not a readable GGUF file: {exc}") from None
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not model or not tokens:
        raise InputError(f"{path} holds no tokenizer (tokenizer.ggml.model / tokens)")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    pre = meta.get("tokenizer.ggml.pre")
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", model == "llama"))
    tok = _build(model, pre, tokens, types, meta.get("tokenizer.ggml.merges"),
                 meta.get("tokenizer.ggml.scores"), add_space_prefix,
                 meta.get("tokenizer.ggml.unknown_token_id"))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    eos_ids = [i for i in (eos, eot) if isinstance(i, int)]
    special = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (CONTROL, USER_DEFINED)}
    return GGUFVocab(tok, model, pre, tokens, meta.get("tokenizer.ggml.bos_token_id"), eos_ids,
                     meta.get("tokenizer.chat_template"),
                     bool(meta.get("tokenizer.ggml.add_bos_token", False)), special)
