"""Token-in / token-out upstream clients of the capture gateway (SPEC §7.6).

Each API has a request builder and a response parser (pure functions over JSON documents,
tested against documents written from each server's documentation) and one async call:

* ``vllm``: ``POST /v1/completions`` with ``prompt`` a list of token IDs, ``logprobs: 1``,
  ``return_token_ids: true`` (vLLM >= 0.10.2; the output IDs come back as
  ``choices[0].token_ids``) — or, on an older server started with
  ``--return-tokens-as-token-ids``, as ``choices[0].logprobs.tokens`` in the ``token_id:N`` form.
* ``sglang``: ``POST /generate`` with ``input_ids``, ``sampling_params`` and
  ``return_logprob: true``; IDs in ``output_ids`` and/or ``meta_info.output_token_logprobs``
  (``[logprob, token_id, text]`` triples).
* ``llamacpp``: llama.cpp server's native ``POST /completion`` with ``prompt`` a list of token
  IDs, ``n_probs: 1``, ``return_tokens: true``; IDs in ``tokens`` and/or
  ``completion_probabilities[].id``, log-probs in ``completion_probabilities[].logprob``.

A response whose IDs and log-probs are missing, disagree, have different lengths, are out of
range or not finite is :class:`UpstreamError` ``malformed`` (HTTP 502): nothing is recorded.
A llama-server output with a character split across tokens is 502 ``upstream_missing_logprobs``
(llama.cpp gives those tokens no log-prob; see docs/gateway.md).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any, Sequence

import aiohttp

from ledger.algorithms.errors import StateError

__all__ = ["APIS", "Completion", "UpstreamError", "build_request", "parse_response", "call_upstream",
           "reserved_fields"]

APIS = ("vllm", "sglang", "llamacpp")
_PATHS = {"vllm": "/v1/completions", "sglang": "/generate", "llamacpp": "/completion"}
MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length
    # llama-server: the ids of a matched stop word it kept past the aligned part (their log-probs
    # dropped), and that stop word; the gateway ends the record before the word (ChatFormat.answer_end)
    stop_tail: tuple[int, ...] = ()
    stop_word: str | None = None


class UpstreamError(StateError):
    """The upstream call did not complete: ``status`` is what the harness gets."""

    def __init__(self, status: int, message: str, type_: str = "upstream_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_


def _malformed(msg: str) -> UpstreamError:
    return UpstreamError(502, f"malformed upstream response: {msg}", "upstream_malformed_response")


def build_request(api: str, prompt: Sequence[int], params: dict[str, Any], model: str | None = None) -> dict:
    """The upstream request body. ``params``: ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``seed``, ``stop`` (optional) and ``extra`` (fields passed through verbatim, never one
    of :func:`reserved_fields`). ``top_k`` None means "no top-k" in each server's own spelling."""
    extra = {k: v for k, v in (params.get("extra") or {}).items() if k not in reserved_fields()}
    common = {k: params[k] for k in ("temperature", "top_p", "min_p", "seed") if params.get(k) is not None}
    if "top_k" in params or "min_p" in params:  # the gateway's sampler settings (SPEC 11.3)
        common["top_k"] = params.get("top_k") if params.get("top_k") is not None else (0 if api == "llamacpp" else -1)
    if api == "vllm":
        body = {"prompt": list(prompt), "max_tokens": params.get("max_tokens"), "logprobs": 1,
                "return_token_ids": True, "skip_special_tokens": False, "stream": False, **common}
        if model:
            body["model"] = model
        if params.get("stop"):
            body["stop"] = params["stop"]
        body.update(extra)
        return {k: v for k, v in body.items() if v is not None}
    if api == "sglang":
        sp = {"max_new_tokens": params.get("max_tokens"), "skip_special_tokens": False,
              **{k: v for k, v in common.items() if k != "seed"}}
        if params.get("seed") is not None:
            sp["sampling_seed"] = params["seed"]
        if params.get("stop"):
            sp["stop"] = params["stop"]
        sp.update(extra)
        return {"input_ids": list(prompt), "sampling_params": {k: v for k, v in sp.items() if v is not None},
                "return_logprob": True, "stream": False}
    if api == "llamacpp":
        body = {"prompt": list(prompt), "n_predict": params.get("max_tokens"), "n_probs": 1, "return_tokens": True,
                "cache_prompt": True, "stream": False, **common}
        if params.get("stop"):
            body["stop"] = params["stop"]
        body.update(extra)
        return {k: v for k, v in body.items() if v is not None}
    raise ValueError(f"unknown upstream api {api!r} (expected one of {', '.join(APIS)})")


def reserved_fields() -> frozenset[str]:
    """Body fields the gateway sets (or that would change what the engine reads or returns):
    never taken from the harness (SPEC 11.3)."""
    return frozenset({"prompt", "echo", "return_token_ids", "logprobs", "n_probs", "return_tokens", "input_ids",
                      "return_logprob", "input_embeds", "text", "sampling_params", "prompt_token_ids", "token_ids",
                      "prompt_logprobs", "skip_special_tokens", "cache_prompt", "n_predict", "max_new_tokens",
                      "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "post_sampling_probs",
                      "include_stop_str_in_output", "detokenize", "id_slot", "multimodal_data", "image_data",
                      "sampling_seed", "stream"})


def _ids(values: Any, what: str) -> list[int]:
    if not isinstance(values, list):
        raise _malformed(f"{what} is not a list")
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKEN_ID:
            raise _malformed(f"{what} holds {v!r}, not a token ID")
    return list(values)


def _lps(values: Any, what: str) -> list[float]:
    if not isinstance(values, list):
        raise _malformed(f"{what} is not a list")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > 0:
            raise _malformed(f"{what} holds {v!r}, not a finite log-probability <= 0")
        out.append(float(v))
    return out


def _token_id_form(tokens: Any) -> list[int] | None:
    """vLLM's ``--return-tokens-as-token-ids`` strings ``token_id:N`` -> ints (None if not that form)."""
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) and t.startswith("token_id:")
                                                             for t in tokens):
        return None
    try:
        return [int(t[len("token_id:"):]) for t in tokens]
    except ValueError:
        return None


def _finish(reason: Any) -> str:
    return "length" if reason in ("length", "limit") else "stop"  # eos, word (a stop string), stop


def parse_response(api: str, doc: Any) -> Completion:
    """Output token IDs, their log-probs and the finish reason of an upstream response."""
    if not isinstance(doc, dict):
        raise _malformed("the body is not a JSON object")
    if api == "vllm":
        choices = doc.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise _malformed("no choices[0]")
        ch = choices[0]
        lp = ch.get("logprobs")
        if not isinstance(lp, dict):
            raise _malformed("choices[0].logprobs is missing (the server must accept logprobs)")
        logprobs = _lps(lp.get("token_logprobs"), "choices[0].logprobs.token_logprobs")
        tokens = None
        if ch.get("token_ids") is not None:
            tokens = _ids(ch["token_ids"], "choices[0].token_ids")
        form = _token_id_form(lp.get("tokens"))
        if form is not None:
            form = _ids(form, "choices[0].logprobs.tokens")
            if tokens is not None and tokens != form:
                raise _malformed("choices[0].token_ids and the token_id:N tokens disagree")
            tokens = form
        if tokens is None:
            raise _malformed("no output token IDs (choices[0].token_ids; start vLLM >= 0.10.2, or with "
                             "--return-tokens-as-token-ids)")
        finish = ch.get("finish_reason")
    elif api == "sglang":
        meta = doc.get("meta_info")
        if not isinstance(meta, dict):
            raise _malformed("no meta_info")
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list) or not all(isinstance(t, list) and len(t) >= 2 for t in triples):
            raise _malformed("meta_info.output_token_logprobs is not a list of [logprob, token_id, text]")
        logprobs = _lps([t[0] for t in triples], "meta_info.output_token_logprobs logprobs")
        from_lp = _ids([t[1] for t in triples], "meta_info.output_token_logprobs token IDs")
        tokens = from_lp
        if doc.get("output_ids") is not None:
            tokens = _ids(doc["output_ids"], "output_ids")
            if tokens != from_lp:
                raise _malformed("output_ids and meta_info.output_token_logprobs disagree")
        fr = meta.get("finish_reason")
        finish = fr.get("type") if isinstance(fr, dict) else fr
    elif api == "llamacpp":
        probs = doc.get("completion_probabilities")
        if not isinstance(probs, list) or not all(isinstance(p, dict) for p in probs):
            raise _malformed("completion_probabilities is missing (the request sets n_probs)")
        logprobs = _lps([p.get("logprob") for p in probs], "completion_probabilities[].logprob")
        from_p = _ids([p.get("id") for p in probs], "completion_probabilities[].id")
        tokens = from_p
        word = doc.get("stopping_word") if doc.get("stop_type") == "word" else None
        if doc.get("tokens"):
            tokens = _ids(doc["tokens"], "tokens")
            if isinstance(word, str) and len(tokens) > len(from_p) and tokens[:len(from_p)] == from_p:
                # llama-server keeps a matched stop word's ids but drops as many log-probs as the word
                # tokenizes to on its own: the aligned part, and the rest to find where the word starts
                tail, tokens = tuple(tokens[len(from_p):]), from_p
                if not tokens:
                    raise _malformed("no output tokens before the stop word")
                return Completion(tokens, logprobs, "stop", tail, word)
            if tokens != from_p and _subsequence(from_p, tokens):
                raise _split_characters(len(tokens) - len(from_p), len(tokens))
            if tokens != from_p:
                raise _malformed("tokens and completion_probabilities[].id disagree")
        finish = doc.get("stop_type")
    else:
        raise ValueError(f"unknown upstream api {api!r}")
    if len(tokens) != len(logprobs):
        raise _malformed(f"{len(tokens)} output token IDs but {len(logprobs)} log-probs")
    if not tokens:
        raise _malformed("no output tokens")
    return Completion(tokens, logprobs, _finish(finish))


def _split_characters(missing: int, total: int) -> UpstreamError:
    """llama-server adds a token's probabilities only once the text generated so far is whole UTF-8
    (tools/server/server-context.cpp, ``process_token``: no ``add_token`` while ``validate_utf8``
    finds the text incomplete): a token that ends inside a character (a byte piece of byte-level
    BPE) never gets a log-prob — in no request mode (``/completion`` or the OpenAI endpoints,
    streamed or not, pre- or post-sampling probabilities) — so the output has no exact record."""
    return UpstreamError(502, f"llama-server sent no log-prob for {missing} of {total} output tokens: llama.cpp's "
                              "server gives none to a token whose text ends inside a UTF-8 character (a character "
                              "split across byte tokens), in every request mode, so this output cannot be recorded "
                              "exactly; serve the model with vLLM or SGLang (--api vllm / --api sglang), which "
                              "return a log-prob for every token", "upstream_missing_logprobs")


def _subsequence(short: Sequence[int], long: Sequence[int]) -> bool:
    it = iter(long)
    return all(any(x == y for y in it) for x in short)


def _error_message(status: int, text: str) -> str:
    try:
        doc = json.loads(text)
    except ValueError:
        return text.strip()[:500] or f"HTTP {status}"
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(doc.get("message"), str):
            return doc["message"]
        if isinstance(doc.get("detail"), str):
            return doc["detail"]
    return text.strip()[:500]


_TOKEN_FIELD = {"vllm": "prompt", "sglang": "input_ids", "llamacpp": "prompt"}


def encode_body(api: str, body: dict, prompt_json: bytes | bytearray | None = None) -> bytes:
    """The request body as JSON bytes; ``prompt_json`` (the token IDs as the inside of a JSON array,
    already serialised) is spliced in as the token-ID prompt instead of serialising the list again."""
    if prompt_json is None:
        return json.dumps(body).encode()
    field = _TOKEN_FIELD[api]
    rest = json.dumps({k: v for k, v in body.items() if k != field}).encode()
    # one join: the prompt's text (any bytes-like, O(context)) is copied once
    return b"".join((b'{"', field.encode(), b'":[', prompt_json, b"]", b"," + rest[1:] if rest != b"{}" else b"}"))


async def call_upstream(session: Any, base_url: str, api: str, body: dict, timeout: float, *,
                        prompt_json: bytes | None = None) -> Completion:
    """POST ``body`` to the upstream; :class:`UpstreamError` unless it completed with a
    well-formed response (non-2xx: the upstream status and message; timeout: 504;
    unreachable: 502)."""
    url = base_url.rstrip("/") + _PATHS[api]
    data = encode_body(api, body, prompt_json)
    try:
        async with session.post(url, data=data, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise UpstreamError(resp.status, f"upstream {api} returned HTTP {resp.status}: "
                                                 f"{_error_message(resp.status, text)}")
            if resp.status != 200:
                raise _malformed(f"HTTP {resp.status}")
    except asyncio.TimeoutError:
        raise UpstreamError(504, f"upstream {api} did not answer within {timeout:g} s", "upstream_timeout") from None
    except aiohttp.ClientError as exc:
        raise UpstreamError(502, f"upstream {api} at {base_url} unreachable: {exc}", "upstream_unreachable") from None
    try:
        doc = json.loads(text)
    except ValueError:
        raise _malformed("the body is not JSON") from None
    return parse_response(api, doc)
