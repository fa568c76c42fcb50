"""Real CPU inference engines for the gateway's end-to-end tests and benchmark.

A tiny, randomly initialised causal language model whose vocabulary is the Qwen3.6
tokenizer's (248,077 token IDs, ``<|im_end|>`` ends a turn), so the token IDs it reads and
writes are the ones the gateway renders. Two engines run it:

* **ONNX Runtime** (:class:`OrtEngine`, always available: ``onnxruntime`` installs as a
  wheel in seconds). :func:`onnx_model` builds the model (embedding, one attention layer,
  a feed-forward block, layer norm, tied output head) with the ``onnx`` package; the runtime
  computes the logits of every step.
* **llama.cpp** (:class:`LlamaCppEngine`, optional: ``llama-cpp-python`` builds from its
  sdist, which takes longer than the test budget on 2 cores, so the tests that need it skip
  when it is not installed). :func:`write_gguf` writes a llama-architecture GGUF (with the
  ``gguf`` package) with the same vocabulary.

Sampling is real: temperature sampling from the model's distribution with a seeded
generator, optionally restricted by a *constraint* — a list of literal strings and
``{"word": [min, max]}`` slots (lowercase letters) — the way constrained decoders (Outlines,
llama.cpp grammars) mask logits; a random model needs one to emit a well-formed
``<tool_call>``. Log-probs are the model's own (log-softmax of the raw logits) for each
sampled token.

:func:`serve` exposes an engine over the three wire formats the gateway speaks: vLLM's
``POST /v1/completions`` (token-ID ``prompt``, ``logprobs``, ``return_token_ids``),
SGLang's ``POST /generate`` (``input_ids``, ``return_logprob``) and llama.cpp server's
``POST /completion`` (``n_probs``, ``return_tokens``). Not shipped in the wheel.
"""

from __future__ import annotations

import asyncio
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from ledger.producers.chatml import tokenizer
from ledger.producers.chatml import decode, encode
from ledger.producers.models.gguf_vocab import _bytes_to_unicode as table
import gguf
from aiohttp import web
from ledger.producers.models import load_format

IM_END_ID, ENDOFTEXT_ID = 248046, 248044
# llama.cpp's end-of-generation set for this vocabulary: <|im_end|>, <|endoftext|>, <|fim_pad|>,
# <|repo_name|>, <|file_sep|> (llama-server ended a random model's outputs on all of them, issue 28 3b)
EOG_IDS = frozenset({IM_END_ID, ENDOFTEXT_ID, 248063, 248064, 248065})
N_EMBD, N_FF = 32, 64
MODEL_NAME = "tiny-random-qwen-vocab"


# ------------------------------------------------------------------ vocabulary
@lru_cache(maxsize=1)
def vocab() -> tuple[int, list[str | None]]:
    """(vocabulary size, text of each token ID; None for a byte piece that is not UTF-8 alone)."""

    tok = tokenizer()
    ranks: dict[bytes, int] = tok._mergeable_ranks
    specials: dict[str, int] = tok._special_tokens
    n = max(max(ranks.values()), max(specials.values())) + 1
    texts: list[str | None] = [None] * n
    for b, i in ranks.items():
        try:
            texts[i] = b.decode("utf-8")
        except UnicodeDecodeError:
            pass
    for s, i in specials.items():
        texts[i] = s
    return n, texts


class Vocabulary:
    """The model's vocabulary: size, text of each ID, the end-of-turn ID a constrained completion ends
    with, the end-of-generation set and the model's own tokenizer (``encode``: text -> IDs, as
    llama.cpp's ``common_tokenize`` without special tokens) — the Qwen3.6 one by default;
    :meth:`from_model` for any other."""

    def __init__(self, n: int, texts: list[str | None], eot: int, eog: frozenset[int], banned: int | None,
                 encode: Callable[[str], list[int]], decode: Callable[[Sequence[int]], str]) -> None:
        self.n, self.texts, self.eot, self.eog, self.banned = n, texts, eot, eog, banned
        self.encode, self.decode = encode, decode
        self.tables = _text_tables(texts)

    @staticmethod
    def from_model(spec: str, chat_template: str | None = None) -> "Vocabulary":
        """The vocabulary of a GGUF file or tokenizer directory, as the gateway loads it (``load_format``):
        token texts decoded one by one, the template's turn-closing token as end of turn."""

        fmt = load_format(spec, chat_template=chat_template)
        texts: list[str | None] = []
        for i in range(fmt.vocab_size):
            t = fmt.decode([i])
            texts.append(None if "\ufffd" in t else t)
        closing = [i for i in fmt.end_of_turn if texts[i] in ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")]
        return Vocabulary(fmt.vocab_size, texts, min(closing or fmt.end_of_turn), frozenset(fmt.end_of_turn), None,
                          fmt.encode, fmt.decode)


@lru_cache(maxsize=1)
def qwen_vocabulary() -> Vocabulary:

    n, texts = vocab()
    return Vocabulary(n, texts, IM_END_ID, EOG_IDS, ENDOFTEXT_ID, encode, decode)


@lru_cache(maxsize=1)
def _tables() -> tuple[dict[str, list[int]], dict[int, np.ndarray]]:
    return qwen_vocabulary().tables


def _text_tables(texts: Sequence[str | None]) -> tuple[dict[str, list[int]], dict[int, np.ndarray]]:
    """text -> token IDs (texts up to 32 chars), and lowercase-word token IDs by length."""
    by_text: dict[str, list[int]] = {}
    words: dict[int, list[int]] = {}
    for i, t in enumerate(texts):
        if not t or len(t) > 32:
            continue
        by_text.setdefault(t, []).append(i)
        if t.isascii() and t.isalpha() and t.islower():
            words.setdefault(len(t), []).append(i)
    return by_text, {k: np.array(v, dtype=np.int64) for k, v in words.items()}


def weights(seed: int = 0, n_vocab: int | None = None) -> dict[str, np.ndarray]:
    """The model's random weights (the same for a given seed and vocabulary size)."""
    n_vocab = n_vocab or vocab()[0]
    rng = np.random.default_rng(seed)
    w = {"embed": rng.standard_normal((n_vocab, N_EMBD)).astype(np.float32)}
    for name, shape in (("wq", (N_EMBD, N_EMBD)), ("wk", (N_EMBD, N_EMBD)), ("wv", (N_EMBD, N_EMBD)),
                        ("wo", (N_EMBD, N_EMBD)), ("w1", (N_EMBD, N_FF)), ("w2", (N_FF, N_EMBD))):
        w[name] = (rng.standard_normal(shape) * 0.3).astype(np.float32)
    return w


# ------------------------------------------------------------------ constrained sampling
class Constraint:
    """Where a constrained completion is: literals must be produced exactly (by any tokens
    that spell them, special tokens included), word slots take 1..max lowercase letters."""

    def __init__(self, segments: Sequence[Any], vocabulary: Vocabulary | None = None) -> None:
        self.vocab = vocabulary or qwen_vocabulary()
        segs: list[tuple] = []
        for s in segments:
            if isinstance(s, str):
                if s:
                    segs.append(("lit", s))
            elif isinstance(s, dict) and isinstance(s.get("word"), list) and len(s["word"]) == 2:
                lo, hi = int(s["word"][0]), int(s["word"][1])
                if not 1 <= lo <= hi:
                    raise ValueError("a word slot needs 1 <= min <= max")
                segs.append(("word", lo, hi))
            else:
                raise ValueError(f"bad constraint segment {s!r}")
        self.segs = segs
        self.i = 0  # current segment
        self.pos = 0  # characters of it produced

    @property
    def done(self) -> bool:
        return self.i >= len(self.segs)

    def _literal_tokens(self, text: str) -> list[int]:
        by_text, _ = self.vocab.tables
        out: list[int] = []
        for k in range(1, min(len(text), 32) + 1):
            out.extend(by_text.get(text[:k], ()))
        return out

    def allowed(self) -> np.ndarray:
        eot = self.vocab.eot
        if self.done:
            return np.array([eot], dtype=np.int64)
        seg = self.segs[self.i]
        if seg[0] == "lit":
            return np.array(self._literal_tokens(seg[1][self.pos:]), dtype=np.int64)
        _, words = self.vocab.tables
        room = seg[2] - self.pos
        parts = [words[k] for k in range(1, room + 1) if k in words]
        if self.pos >= seg[1]:
            nxt = self.segs[self.i + 1] if self.i + 1 < len(self.segs) else None
            parts.append(np.array(self._literal_tokens(nxt[1]) if nxt and nxt[0] == "lit" else [eot],
                                  dtype=np.int64))
        return np.unique(np.concatenate(parts)) if parts else np.array([eot], dtype=np.int64)

    def advance(self, text: str) -> None:
        while text and not self.done:
            seg = self.segs[self.i]
            if seg[0] == "lit":
                rest = seg[1][self.pos:]
                k = min(len(rest), len(text))
                self.pos += k
                text = text[k:]
                if self.pos >= len(seg[1]):
                    self.i, self.pos = self.i + 1, 0
            else:
                n = 0
                while n < len(text) and text[n].isalpha() and self.pos + n < seg[2]:
                    n += 1
                self.pos += n
                text = text[n:]
                if text or self.pos >= seg[2]:
                    self.i, self.pos = self.i + 1, 0


def _log_normalizer(logits: np.ndarray) -> float:
    """log(sum(exp(logits))), stable."""
    m = float(logits.max())
    return m + float(np.log(np.exp(logits - m, dtype=np.float32).sum(dtype=np.float64)))


class _Engine:
    """Sampling over a forward function ``logits(ids) -> float32[V]``; calls are serialised."""

    name = "engine"

    def __init__(self, vocabulary: Vocabulary | None = None) -> None:
        self.lock = threading.Lock()
        self.vocab = vocabulary or qwen_vocabulary()
        self.n_vocab, self.texts = self.vocab.n, self.vocab.texts

    def logits(self, ids: list[int]) -> np.ndarray:  # pragma: no cover - engines override
        raise NotImplementedError

    def complete(self, prompt: Sequence[int], *, max_tokens: int = 64, temperature: float = 1.0, seed: int = 0,
                 constraint: Sequence[Any] | None = None, stop: Sequence[str] = ()) -> dict[str, Any]:
        """``{"tokens", "logprobs", "finish_reason"}``: ``stop`` when it sampled ``<|im_end|>``
        (included), ``length`` when it ran out of ``max_tokens``."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.n_vocab for t in prompt):
            raise ValueError(f"prompt token IDs must be integers in 0..{self.n_vocab - 1}")
        state = Constraint(constraint, self.vocab) if constraint is not None else None
        rng = np.random.default_rng(seed)
        ids = list(prompt)
        out: list[int] = []
        lps: list[float] = []
        finish = "length"
        text = ""
        self.stopping_word = ""
        with self.lock:
            for _ in range(max_tokens):
                logits = self.logits(ids)
                norm = _log_normalizer(logits)
                if state is not None:
                    cand = state.allowed()
                else:
                    cand = np.arange(self.n_vocab)
                    cand = cand[cand != self.vocab.banned]
                z = logits[cand].astype(np.float64) / max(temperature, 1e-6)
                p = np.exp(z - z.max())
                tok = int(cand[rng.choice(len(cand), p=p / p.sum())])
                out.append(tok)
                lps.append(float(logits[tok]) - norm)
                ids.append(tok)
                if tok in self.vocab.eog:
                    finish = "stop"
                    break
                text += self.texts[tok] or ""
                word = next((w for w in stop if w and w in text), None)
                if word is not None:  # a stop string: generation ends on the token that completed it
                    finish, self.stopping_word = "stop", word
                    break
                if state is not None:
                    state.advance(self.texts[tok] or "")
            self.last = {"prompt": list(prompt), "tokens": out, "logprobs": lps}
        return {"tokens": out, "logprobs": lps, "finish_reason": finish}

    def piece(self, tok: int) -> str:
        return self.texts[tok] or ""


# ------------------------------------------------------------------ ONNX Runtime engine
def onnx_model(w: dict[str, np.ndarray]):
    """The model as an ONNX graph: ``ids`` (int64 [T]), ``embed`` / ``embed_t`` (the embedding and
    its transpose, tied output head) -> ``logits`` (float32 [V]) of the next token."""
    from onnx import TensorProto, helper, numpy_helper  # optional extra [models]

    # the two vocabulary-sized matrices are inputs (fed without a copy), the rest initializers
    inits = [numpy_helper.from_array(w[k], k) for k in ("wq", "wk", "wv", "wo", "w1", "w2")]
    inits += [numpy_helper.from_array(np.ones(N_EMBD, np.float32), "ln_s"),
              numpy_helper.from_array(np.zeros(N_EMBD, np.float32), "ln_b"),
              numpy_helper.from_array(np.array([-1], np.int64), "last"),
              numpy_helper.from_array(np.array(1 / np.sqrt(N_EMBD), np.float32), "scale")]
    n = helper.make_node
    nodes = [
        n("Gather", ["embed", "ids"], ["h"]),                     # [T, d]
        n("Gather", ["h", "last"], ["hl"], axis=0),               # [1, d]
        n("MatMul", ["hl", "wq"], ["q"]),
        n("MatMul", ["h", "wk"], ["k"]),
        n("MatMul", ["h", "wv"], ["v"]),
        n("Transpose", ["k"], ["kt"], perm=[1, 0]),
        n("MatMul", ["q", "kt"], ["s0"]),
        n("Mul", ["s0", "scale"], ["s"]),
        n("Softmax", ["s"], ["a"], axis=-1),
        n("MatMul", ["a", "v"], ["c"]),
        n("MatMul", ["c", "wo"], ["o"]),
        n("Add", ["hl", "o"], ["h2"]),
        n("MatMul", ["h2", "w1"], ["f0"]),
        n("Relu", ["f0"], ["f1"]),
        n("MatMul", ["f1", "w2"], ["f2"]),
        n("Add", ["h2", "f2"], ["h3"]),
        n("LayerNormalization", ["h3", "ln_s", "ln_b"], ["hn"], axis=-1),
        n("MatMul", ["hn", "embed_t"], ["l2"]),                   # tied output head: [1, V]
        n("Flatten", ["l2"], ["l1"], axis=0),
        n("Squeeze", ["l1"], ["logits"], ),
    ]
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["T"]),
                               helper.make_tensor_value_info("embed", TensorProto.FLOAT, ["V", N_EMBD]),
                               helper.make_tensor_value_info("embed_t", TensorProto.FLOAT, [N_EMBD, "V"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["V"])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


class OrtEngine(_Engine):
    name = "onnxruntime"

    def __init__(self, seed: int = 0, vocabulary: Vocabulary | None = None) -> None:
        import onnxruntime as ort  # optional extra [models]

        super().__init__(vocabulary)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.log_severity_level = 3
        w = weights(seed, self.n_vocab)
        self.session = ort.InferenceSession(onnx_model(w).SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.feeds = {"embed": w["embed"], "embed_t": np.ascontiguousarray(w["embed"].T)}

    def logits(self, ids: list[int]) -> np.ndarray:
        return self.session.run(["logits"], {"ids": np.asarray(ids, dtype=np.int64), **self.feeds})[0]


# ------------------------------------------------------------------ llama.cpp engine (optional)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the form GGUF BPE vocabularies use): the gateway's own."""

    return table()


def write_gguf(path: str | Path, seed: int = 0, n_layer: int = 1, n_head: int = 2) -> Path:
    """A llama-architecture GGUF with the Qwen3.6 vocabulary (byte-level BPE pieces, special
    tokens as control tokens, ``<|im_end|>`` = EOS) and random weights (about 16 MB)."""


    tok = tokenizer()
    ranks: dict[bytes, int] = tok._mergeable_ranks
    n_vocab, _ = vocab()
    b2u = _bytes_to_unicode()
    pieces = [f"[UNUSED_{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for b, i in ranks.items():
        pieces[i] = "".join(b2u[c] for c in b)
        types[i] = gguf.TokenType.NORMAL
    for s, i in tok._special_tokens.items():
        pieces[i] = s
        types[i] = gguf.TokenType.CONTROL
    # merges only tokenize text, which the gateway never asks for (prompts are token IDs)
    merges = [f"{b2u[b[0]]} {b2u[b[1]]}" for b in ranks if len(b) == 2]
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(MODEL_NAME)
    w.add_context_length(8192)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_rope_dimension_count(N_EMBD // n_head)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(pieces)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(ENDOFTEXT_ID)
    w.add_eos_token_id(IM_END_ID)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(seed)
    w.add_tensor("token_embd.weight", weights(seed)["embed"].astype(np.float16))
    for layer in range(n_layer):
        p = f"blk.{layer}."
        for name, shape in (("attn_q", (N_EMBD, N_EMBD)), ("attn_k", (N_EMBD, N_EMBD)), ("attn_v", (N_EMBD, N_EMBD)),
                            ("attn_output", (N_EMBD, N_EMBD)), ("ffn_gate", (N_FF, N_EMBD)), ("ffn_up", (N_FF, N_EMBD)),
                            ("ffn_down", (N_EMBD, N_FF))):
            w.add_tensor(p + name + ".weight", (rng.standard_normal(shape) * 0.3).astype(np.float32))
        w.add_tensor(p + "attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppEngine(_Engine):
    """llama.cpp (``llama-cpp-python``) computes the logits of each step from its KV cache."""

    name = "llama.cpp"

    def __init__(self, gguf_path: str | Path) -> None:
        from llama_cpp import Llama  # optional extra [models]

        super().__init__()
        # a small n_batch: llama-cpp-python keeps an n_batch x n_vocab score buffer
        self.llm = Llama(model_path=str(gguf_path), n_ctx=8192, n_batch=16, n_threads=1, logits_all=False,
                         verbose=False)
        self._evaluated: list[int] = []

    def logits(self, ids: list[int]) -> np.ndarray:
        n = 0  # reuse the KV cache of the common prefix (a new prompt resets it)
        while n < len(self._evaluated) and n < len(ids) - 1 and self._evaluated[n] == ids[n]:
            n += 1
        if n < len(self._evaluated):
            self.llm.n_tokens = n
            self._evaluated = self._evaluated[:n]
        import llama_cpp  # optional extra [models]

        self.llm.eval(ids[n:])
        self._evaluated = list(ids)
        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)  # the last evaluated position's logits
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float32)


# ------------------------------------------------------------------ wire formats
def vllm_document(engine: _Engine, body: dict) -> dict:
    """vLLM ``/v1/completions`` response (``return_token_ids``, ``logprobs``)."""
    prompt = body.get("prompt")
    out = engine.complete(prompt if isinstance(prompt, list) else [], max_tokens=int(body.get("max_tokens") or 16),
                          temperature=float(body.get("temperature", 1.0)), seed=int(body.get("seed") or 0),
                          constraint=body.get("constraint"))
    toks, lps = out["tokens"], out["logprobs"]
    text = "".join(engine.piece(t) for t in toks if t not in engine.vocab.eog)
    logprobs = None
    if body.get("logprobs") is not None:
        logprobs = {"text_offset": [], "token_logprobs": lps,
                    "tokens": [f"token_id:{t}" if body.get("_tokens_as_ids") else engine.piece(t) for t in toks],
                    "top_logprobs": [{engine.piece(t): lp} for t, lp in zip(toks, lps)]}
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": out["finish_reason"],
              "stop_reason": None, "prompt_logprobs": None}
    if body.get("return_token_ids"):
        choice["token_ids"] = toks
        choice["prompt_token_ids"] = list(prompt)
    return {"id": f"cmpl-{time.time_ns():x}", "object": "text_completion", "created": int(time.time()),
            "model": body.get("model") or MODEL_NAME, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(toks),
                      "total_tokens": len(prompt) + len(toks)}}


def sglang_document(engine: _Engine, body: dict) -> dict:
    """SGLang ``/generate`` response (``return_logprob``)."""
    sp = body.get("sampling_params") or {}
    prompt = body.get("input_ids")
    out = engine.complete(prompt if isinstance(prompt, list) else [], max_tokens=int(sp.get("max_new_tokens") or 128),
                          temperature=float(sp.get("temperature", 1.0)), seed=int(sp.get("sampling_seed") or 0),
                          constraint=sp.get("constraint"))
    toks, lps = out["tokens"], out["logprobs"]
    meta = {"id": f"{time.time_ns():x}", "prompt_tokens": len(prompt), "completion_tokens": len(toks),
            "cached_tokens": 0,
            "finish_reason": ({"type": "stop", "matched": toks[-1]} if out["finish_reason"] == "stop"
                              else {"type": "length", "length": len(toks)})}
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(toks, lps)]
        meta["input_token_logprobs"] = []
    return {"text": "".join(engine.piece(t) for t in toks if t not in engine.vocab.eog), "output_ids": toks,
            "meta_info": meta}


def llamacpp_document(engine: _Engine, body: dict) -> dict:
    """llama.cpp server's native ``/completion`` response (``n_probs``, ``return_tokens``)."""
    prompt = body.get("prompt")
    out = engine.complete(prompt if isinstance(prompt, list) else [], max_tokens=int(body.get("n_predict") or 128),
                          temperature=float(body.get("temperature", 0.8)), seed=int(body.get("seed") or 0),
                          constraint=body.get("constraint"), stop=body.get("stop") or ())
    toks, lps = out["tokens"], out["logprobs"]
    probs = _completion_probabilities(engine.vocab, toks, lps)
    word = engine.stopping_word
    content = "".join(engine.piece(t) for t in toks if t not in engine.vocab.eog)
    if word:
        # as llama-server does (issue 28, 3a): the ids keep the stop word's tokens, the probabilities
        # drop as many entries as the stop word tokenizes to on its own with the served model's
        # tokenizer (server-context.cpp: common_tokenize(ctx, stopping_word, false)), the content
        # ends before it
        probs = probs[:len(probs) - min(len(probs), len(engine.vocab.encode(word)))]
        content = content[:content.find(word)]
    return {"index": 0, "content": content,
            "tokens": toks if body.get("return_tokens") else [], "id_slot": 0, "stop": True, "model": MODEL_NAME,
            "stop_type": "word" if word else ("eos" if out["finish_reason"] == "stop" else "limit"),
            "stopping_word": word,
            "tokens_cached": 0, "tokens_evaluated": len(prompt), "truncated": False,
            "completion_probabilities": probs if int(body.get("n_probs") or 0) > 0 else []}


def _completion_probabilities(vocab: Vocabulary, toks: Sequence[int], lps: Sequence[float]) -> list[dict]:
    """llama-server's ``completion_probabilities``: a token's entry is added only once the text is whole
    UTF-8 (server-context.cpp ``process_token``), so a byte piece that ends inside a character gets
    none, and the entry of the token that completes the character carries the whole character's text
    and bytes (seen with SmolLM2 for "Grüße 日本 👍 ok": 16 ids, 13 entries, the one of the byte
    ``A5`` reading "日", bytes [230, 151, 165]); a special token's text is empty."""
    probs, start = [], 0
    for k, (t, lp) in enumerate(zip(toks, lps)):
        if _ends_inside_a_character(vocab, toks, k):
            continue
        text = "" if t in vocab.eog else (vocab.decode(list(toks[start:k + 1])) if start < k else vocab.texts[t] or "")
        probs.append({"id": t, "token": text, "bytes": list(text.encode()), "logprob": lp, "top_logprobs": []})
        start = k + 1
    return probs


def _ends_inside_a_character(vocab: Vocabulary, toks: Sequence[int], k: int) -> bool:
    """Whether the text of ``toks[:k + 1]`` ends inside a UTF-8 character (only a token that is no
    whole UTF-8 text alone can leave it so)."""
    return vocab.texts[toks[k]] is None and vocab.decode(list(toks[:k + 1])).endswith("\ufffd")


class Server:
    """A running :func:`serve`: ``url``, ``engine``, ``calls`` (completed requests), ``close()``."""

    def __init__(self, url: str, stop, counter: list[int], history: list[dict], engine: _Engine) -> None:
        self.url = url
        self.engine = engine
        self._stop = stop
        self._counter = counter
        self.history = history  # per completed call: {"prompt", "tokens", "logprobs"} as the engine saw and made them

    @property
    def calls(self) -> int:
        return self._counter[0]

    def close(self) -> None:
        self._stop()


def serve(engine: _Engine, host: str = "127.0.0.1", port: int = 0, *, tokens_as_ids: bool = False) -> Server:
    """Serve ``engine`` on a background thread over the vLLM, SGLang and llama.cpp wire formats
    (``tokens_as_ids``: vLLM's ``--return-tokens-as-token-ids``); returns once listening."""

    from ledger.gateway.app import serve_in_background  # cold path: the gateway (web server) loads only for the commands that serve it

    counter = [0]
    history: list[dict] = []

    def route(build):
        async def handler(request: web.Request) -> web.Response:
            try:
                body = await request.json()
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                body["_tokens_as_ids"] = tokens_as_ids
                doc = await asyncio.get_running_loop().run_in_executor(None, build, engine, body)
                engine.last["body"] = body
            except (ValueError, TypeError) as exc:
                return web.json_response({"object": "error", "message": str(exc), "type": "BadRequestError",
                                          "code": 400}, status=400)
            counter[0] += 1
            history.append(engine.last)
            return web.json_response(doc)
        return handler

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_post("/v1/completions", route(vllm_document))
    app.router.add_post("/generate", route(sglang_document))
    app.router.add_post("/completion", route(llamacpp_document))
    app.router.add_get("/health", health)
    url, stop = serve_in_background(app, host, port)
    return Server(url, stop, counter, history, engine)
