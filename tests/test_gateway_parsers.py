"""Upstream wire formats and the gateway's pure pieces (SPEC §7.6).

The response documents are written from each server's documentation: vLLM's OpenAI
completions response (``return_token_ids`` -> ``choices[].token_ids``; the
``--return-tokens-as-token-ids`` ``token_id:N`` form of ``logprobs.tokens``), SGLang's native
``/generate`` response (``output_ids``, ``meta_info.output_token_logprobs`` as
``[logprob, token_id, text]``, ``finish_reason`` an object) and llama.cpp server's
``/completion`` response (``tokens``, ``completion_probabilities[].id/logprob``, ``stop_type``)."""

from __future__ import annotations

import re

import pytest

from ledger.algorithms.chat_restore import (
    CallView,
    assistant_key,
    canonical_arguments,
    classify_token_drift,
    match_history,
    message_key,
    parse_qwen_output,
    restore_plan,
)
from ledger.gateway.upstream import UpstreamError, build_request, parse_response

VLLM = {"id": "cmpl-9b1c", "object": "text_completion", "created": 1760000000, "model": "Qwen/Qwen3-8B",
        "choices": [{"index": 0, "text": "Hello!", "token_ids": [9707, 0, 151645], "finish_reason": "stop",
                     "stop_reason": None, "prompt_logprobs": None, "prompt_token_ids": [151644, 872, 198],
                     "logprobs": {"text_offset": [0, 5, 6], "token_logprobs": [-0.25, -1.5, -0.0078125],
                                  "tokens": ["Hello", "!", ""], "top_logprobs": [{"Hello": -0.25}, {"!": -1.5},
                                                                                   {"": -0.0078125}]}}],
        "usage": {"prompt_tokens": 3, "total_tokens": 6, "completion_tokens": 3}}
VLLM_TOKEN_ID_FORM = {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [
    {"index": 0, "text": "Hi", "finish_reason": "length",
     "logprobs": {"text_offset": [0, 1], "token_logprobs": [-2.0, -0.5], "tokens": ["token_id:13048", "token_id:0"],
                  "top_logprobs": [{"token_id:13048": -2.0}, {"token_id:0": -0.5}]}}]}
SGLANG = {"text": "Hello!", "output_ids": [9707, 0, 151645],
          "meta_info": {"id": "a1b2", "finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": 3,
                        "completion_tokens": 3, "cached_tokens": 0, "e2e_latency": 0.12,
                        "input_token_logprobs": [],
                        "output_token_logprobs": [[-0.25, 9707, None], [-1.5, 0, None], [-0.0078125, 151645, None]]}}
LLAMACPP = {"index": 0, "content": "Hello!", "tokens": [9707, 0, 151645], "id_slot": 0, "stop": True,
            "model": "qwen3.gguf", "tokens_predicted": 3, "tokens_evaluated": 3, "stop_type": "eos",
            "stopping_word": "", "tokens_cached": 2, "truncated": False,
            "completion_probabilities": [
                {"id": 9707, "token": "Hello", "bytes": [72, 101, 108, 108, 111], "logprob": -0.25,
                 "top_logprobs": [{"id": 9707, "token": "Hello", "bytes": [72, 101, 108, 108, 111], "logprob": -0.25}]},
                {"id": 0, "token": "!", "bytes": [33], "logprob": -1.5, "top_logprobs": []},
                {"id": 151645, "token": "", "bytes": [], "logprob": -0.0078125, "top_logprobs": []}]}


@pytest.mark.parametrize("api,doc", [("vllm", VLLM), ("sglang", SGLANG), ("llamacpp", LLAMACPP)])
def test_parsers_read_ids_logprobs_and_finish(api, doc):
    c = parse_response(api, doc)
    assert c.tokens == [9707, 0, 151645]
    assert c.logprobs == [-0.25, -1.5, -0.0078125]
    assert c.finish_reason == "stop"


def test_vllm_token_id_form_and_length():
    c = parse_response("vllm", VLLM_TOKEN_ID_FORM)
    assert (c.tokens, c.logprobs, c.finish_reason) == ([13048, 0], [-2.0, -0.5], "length")
    sg = {**SGLANG, "meta_info": {**SGLANG["meta_info"], "finish_reason": {"type": "length", "length": 3}}}
    assert parse_response("sglang", sg).finish_reason == "length"
    assert parse_response("llamacpp", {**LLAMACPP, "stop_type": "limit"}).finish_reason == "length"


def test_llamacpp_stop_word_keeps_the_aligned_part_and_the_ids_past_it():
    """llama-server with a matched stop word: 3 ids, log-probs for the first 2 only (the word is one
    token alone): the aligned part, the rest kept to find where the word starts, the word itself."""
    doc = {**LLAMACPP, "stop_type": "word", "stopping_word": "!", "content": "Hello",
           "completion_probabilities": LLAMACPP["completion_probabilities"][:2]}
    c = parse_response("llamacpp", doc)
    assert (c.tokens, c.logprobs, c.stop_tail, c.stop_word) == ([9707, 0], [-0.25, -1.5], (151645,), "!")
    assert parse_response("llamacpp", LLAMACPP).stop_tail == () and parse_response("llamacpp", LLAMACPP).stop_word is None
    with pytest.raises(UpstreamError, match="no output tokens before the stop word"):
        parse_response("llamacpp", {**doc, "completion_probabilities": []})



def test_llamacpp_tokens_without_logprobs_inside_a_character_are_named():
    """llama-server adds no probabilities for a token whose text ends inside a UTF-8 character
    (server-context.cpp: process_token skips add_token while the text is incomplete)."""
    doc = {**LLAMACPP, "tokens": [9707, 126, 0, 151645],
           "completion_probabilities": LLAMACPP["completion_probabilities"]}
    with pytest.raises(UpstreamError, match="no log-prob for 1 of 4 output tokens") as e:
        parse_response("llamacpp", doc)
    # the cause and the way out are named: no llama-server request mode gives those tokens a log-prob
    assert e.value.status == 502 and e.value.type == "upstream_missing_logprobs"
    assert "ends inside a UTF-8 character" in e.value.message and "--api vllm / --api sglang" in e.value.message


@pytest.mark.parametrize("api,doc,message", [
    ("vllm", {"choices": []}, "no choices[0]"),
    ("vllm", {"choices": [{"text": "x", "logprobs": {"token_logprobs": [-1.0], "tokens": ["x"]}}]},
     "no output token IDs"),
    ("vllm", {"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0, -1.0],
                                                             "tokens": ["token_id:1", "token_id:3"]}}]}, "disagree"),
    ("vllm", {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [0.5], "tokens": ["a"]}}]},
     "log-probability <= 0"),
    ("sglang", {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.0, 1, None], [-1.0, 5, None]]}},
     "disagree"),
    ("sglang", {"output_ids": [1]}, "no meta_info"),
    ("llamacpp", {"tokens": [1], "completion_probabilities": [{"id": 1, "logprob": None}]}, "log-probability"),
    ("llamacpp", {"content": "x"}, "completion_probabilities is missing"),
    ("llamacpp", {"tokens": [], "completion_probabilities": []}, "no output tokens"),
])
def test_malformed_documents_are_502(api, doc, message):
    with pytest.raises(UpstreamError, match=re.escape(message)) as info:
        parse_response(api, doc)
    assert info.value.status == 502


def test_request_bodies():
    p = {"max_tokens": 8, "temperature": 0.7, "top_p": None, "seed": 3, "stop": None, "extra": {"top_k": 20}}
    assert build_request("vllm", [1, 2], p, model="m") == {
        "prompt": [1, 2], "max_tokens": 8, "logprobs": 1, "return_token_ids": True, "skip_special_tokens": False,
        "stream": False, "temperature": 0.7, "seed": 3, "model": "m", "top_k": 20}
    assert build_request("sglang", [1, 2], p) == {
        "input_ids": [1, 2], "return_logprob": True, "stream": False,
        "sampling_params": {"max_new_tokens": 8, "skip_special_tokens": False, "temperature": 0.7,
                            "sampling_seed": 3, "top_k": 20}}
    assert build_request("llamacpp", [1, 2], p) == {
        "prompt": [1, 2], "n_predict": 8, "n_probs": 1, "return_tokens": True, "cache_prompt": True,
        "stream": False, "temperature": 0.7, "seed": 3, "top_k": 20}


def test_parse_qwen_output():
    text = ('<think>\nplan it\n</think>\n\nLet me look.\n<tool_call>\n{"name": "read", "arguments": '
            '{"path": "a.py", "n": 2}}\n</tool_call>\n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
            '<|im_end|>')
    p = parse_qwen_output(text)
    assert p.reasoning == "plan it" and p.content == "Let me look."
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("read", '{"path": "a.py", "n": 2}'), ("ls", "{}")]
    assert p.tool_calls[0].text == '{"name": "read", "arguments": {"path": "a.py", "n": 2}}'
    bad = parse_qwen_output("<tool_call>\n{not json}\n</tool_call>")
    assert bad.tool_calls == () and bad.malformed == 1 and bad.content == "<tool_call>\n{not json}\n</tool_call>"
    assert parse_qwen_output("plain").content == "plain"


def test_keys_ignore_reserialisation_not_values():
    a = {"role": "assistant", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a", "n": 2}'}}]}
    b = {"role": "assistant", "content": "x ", "reasoning_content": "dropped", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{\n "n": 2,\n "path": "a"}'}}]}
    c = {**b, "tool_calls": [{"id": "c1", "function": {"name": "read", "arguments": '{"n": 3, "path": "a"}'}}]}
    assert message_key(a) == message_key(b) != message_key(c)
    assert canonical_arguments('{"b": 1, "a": [1, 2]}') == '{"a":[1,2],"b":1}'


def test_match_history_kinds():
    sys_, user = ("system", "s"), ("user", "u")
    a1 = assistant_key("", [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}])
    t1 = ("tool", "c1", "r")
    r1 = CallView("r1", (sys_, user), a1)
    assert match_history([sys_, user], []).kind == "first"
    m = match_history([sys_, user, a1, t1], [r1])
    assert (m.kind, m.parent, m.matched) == ("extends", "r1", 3)
    assert match_history([sys_, user], [r1]).kind == "resample"
    a2 = assistant_key("done", [])
    r2 = CallView("r2", (sys_, user, a1, t1), a2)
    m = match_history([sys_, user, a1, ("tool", "c1", "EDITED"), a2], [r1, r2])
    assert (m.kind, m.parent, m.cause, m.diverged_at) == ("diverged", "r2", "edited_history", 3)
    assert match_history([("system", "other")], [r1, r2]).cause == "other"
    summary = CallView("s", (sys_, user, a1, t1, ("user", "summarise")), assistant_key("sum", []), "summary")
    assert match_history([sys_, ("user", "task + sum")], [r1, summary]).kind == "restart"
    assert restore_plan([sys_, user, a1, t1, a2], [r1, r2]) == {2: "r1", 4: "r2"}


def test_match_and_restore_pick_the_same_call_on_ties():
    """Two recorded outputs with one key (a regenerated answer): the restored output is the one
    on the matched parent's path, so the new input extends the parent's tokens."""
    sys_, user, ans, more = ("system", "s"), ("user", "u"), assistant_key("same text", []), ("user", "more")
    a = CallView("a", (sys_, user), ans)
    b = CallView("b", (sys_, user), ans)  # regenerate: same history, same key, other tokens
    hist = [sys_, user, ans, more]
    m = match_history(hist, [a, b])  # regenerate, then continue: the latest is the parent
    assert (m.kind, m.parent, m.matched) == ("extends", "b", 3)
    assert restore_plan(hist, [a, b], m.parent) == {2: "b"}
    # the follow-up f was recorded on a's tokens (its own plan restored a); b came after it
    t = assistant_key("", [{"id": "c9", "function": {"name": "f", "arguments": "{}"}}])
    f = CallView("f", (sys_, user, ans, more), t, restored={2: "a"})
    hist2 = [sys_, user, ans, more, t, ("tool", "c9", "ok")]
    m = match_history(hist2, [a, f, b])
    assert (m.kind, m.parent) == ("extends", "f")
    assert restore_plan(hist2, [a, f, b], m.parent) == {2: "a", 4: "f"}
    assert restore_plan(hist2, [a, f, b]) == {2: "b", 4: "f"}  # without a parent: the latest positional
    # a message the parent rendered afresh (nothing restored there): the latest positional output
    g = CallView("g", (sys_, user, ans, more), t)
    assert restore_plan(hist2, [g, b], "g") == {2: "b", 4: "g"}
    # outside what the parent recorded: the usual rule
    assert restore_plan([sys_, ("user", "other"), ans], [a, b], "a") == {2: "b"}


def test_classify_token_drift():
    assert classify_token_drift("abc", "abcdef") == "retokenization"
    assert classify_token_drift("abc", "abXdef") == "template"
