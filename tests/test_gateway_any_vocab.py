"""End to end with a non-Qwen vocabulary (issue 28): the tiny engine built on the Llama-3 BPE
vocabulary of a GGUF from ../shared/testdata/tokenizers, the gateway loading the same GGUF with
Meta's Llama 3.1 chat template (llama3-json tool calls), the official `openai` client running a
multi-turn tool loop, and the Anthropic and Responses APIs on the same path: the log holds exactly
what the engine read and wrote, one chain, 0 drift."""

from __future__ import annotations

import io
import json
from pathlib import Path

import anthropic
import pytest

from ledger import open_log
from ledger.gateway.app import make_app
from ledger.gateway.calls import Gateway
from ledger.gateway.serve import serve_in_background
from ledger.gateway.store import drift_counts, gateway_db_path
from ledger.producers.models import load_format
from ledger.producers.recorder import Recorder
from tests.gateway_helpers import init_store, log_requests

pytestmark = pytest.mark.timeout(240)
SHARED = Path(__file__).resolve().parents[2] / "shared" / "testdata"
GGUF = SHARED / "tokenizers" / "ggml-vocab-llama-bpe.gguf"
TEMPLATE = SHARED / "chat-templates" / "meta-llama-Llama-3.1-8B-Instruct.jinja"
CALL = ['{"name": "read", "parameters": {"path": "', {"word": [1, 8]}, '", "n": 3}}']
ANSWER = ["Done ", {"word": [1, 6]}]
TOOL = {"type": "function", "function": {"name": "read", "description": "read a file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}}}

if not (GGUF.exists() and TEMPLATE.exists()):
    pytest.skip("the shared test vocabularies are not here", allow_module_level=True)


@pytest.fixture(scope="module")
def llama_engine():
    from workloads.tiny_engine import OrtEngine, Vocabulary, serve

    vocab = Vocabulary.from_model(str(GGUF), str(TEMPLATE))
    srv = serve(OrtEngine(seed=0, vocabulary=vocab))
    yield srv, vocab
    srv.close()


def test_llama3_vocabulary_tool_loop_is_one_exact_chain(tmp_path, llama_engine):
    import openai

    srv, vocab = llama_engine
    store = init_store(tmp_path / "store")
    fmt = load_format(str(GGUF), chat_template=str(TEMPLATE))
    assert fmt.tool_parser == "llama3-json" and vocab.texts[vocab.eot] == "<|eot_id|>"
    log = open_log(str(store))
    rec = Recorder(log, producer="ledger-gateway", tee=io.StringIO())
    gw = Gateway(rec, upstream=srv.url, api="vllm", tokenizer_name=str(GGUF), state_db=gateway_db_path(store),
                 model="tiny-llama", fmt=fmt)
    url, stop = serve_in_background(make_app(gw))
    ex = "ex-llama"
    headers = {"X-Ledger-Task-Id": "t", "X-Ledger-Deadline": "2030-01-01T00:00:00Z"}
    try:
        client = openai.OpenAI(base_url=f"{url}/executions/{ex}/v1", api_key="x", max_retries=0,
                               default_headers=headers)
        n0 = len(srv.history)
        msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix x.py."}]
        for turn in range(2):
            r = client.chat.completions.create(model="tiny-llama", messages=msgs, tools=[TOOL], max_tokens=60,
                                               extra_body={"constraint": CALL, "seed": turn + 1})
            call = r.choices[0].message.tool_calls[0]
            assert r.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments)["n"] == 3
            args = json.loads(call.function.arguments)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "read", "arguments": json.dumps(
                    dict(reversed(list(args.items()))))}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": f"line {turn}"}]
        last = client.chat.completions.create(model="tiny-llama", messages=msgs, tools=[TOOL], max_tokens=60,
                                              extra_body={"constraint": ANSWER, "seed": 9})
        assert last.choices[0].message.content.startswith("Done ") and "<|" not in last.choices[0].message.content
        # the Anthropic Messages API on the same model format
        a = anthropic.Anthropic(base_url=f"{url}/executions/ex-llama-a", api_key="x", max_retries=0,
                                default_headers=headers)
        m = a.messages.create(model="tiny-llama", max_tokens=60, messages=[{"role": "user", "content": "hi"}],
                              tools=[{"name": "read", "input_schema": TOOL["function"]["parameters"]}],
                              extra_body={"constraint": CALL, "seed": 3})
        assert m.stop_reason == "tool_use" and m.content[-1].input["n"] == 3
    finally:
        stop()
        rec.close()
        log.close()
    reqs = log_requests(store, ex)
    calls = srv.history[n0:n0 + 3]
    assert [(r["input"], r["output"]) for r in reqs] == [(c["prompt"], c["tokens"]) for c in calls]
    for prev, nxt in zip(reqs, reqs[1:]):
        assert nxt["input"][:len(prev["input"]) + len(prev["output"])] == prev["input"] + prev["output"]
        assert nxt["input_prefix"]["request_id"] == prev["request_id"]
    assert all(r["output"][-1] == vocab.eot for r in reqs)
    assert drift_counts(gateway_db_path(store))["drift"] == {"template": 0, "retokenization": 0,
                                                             "edited_history": 0, "other": 0}


def test_llamacpp_stop_word_is_counted_with_the_served_models_tokenizer(tmp_path, llama_engine):
    """llama-server drops as many log-probs as the stop word tokenizes to *with the served model's
    tokenizer* (server-context.cpp: ``common_tokenize(ctx, stopping_word, false)``): "Schluss" is 3
    Llama-3 tokens, 2 Qwen3.6 ones. Sampled as 5 tokens (" S", "ch", "lu", "s", "s"), llama-server
    keeps log-probs for " S" and "ch": the gateway records the aligned part that ends before the
    word ("Gut."), and the harness gets no piece of the stop word."""
    from ledger.producers import chatml
    from tests.gateway_helpers import RunningGateway
    from workloads.tiny_engine import llamacpp_document

    srv, vocab = llama_engine
    fmt = load_format(str(GGUF), chat_template=str(TEMPLATE))
    word, constraint = "Schluss", ["Gut. Schluss ", {"word": [2, 4]}]
    assert (len(fmt.encode(word)), len(chatml.encode(word))) == (3, 2)
    gw = RunningGateway(init_store(tmp_path / "store"), srv.url, "llamacpp", fmt=fmt)
    try:
        r = gw.client("ex-stop").chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Antworte."}], max_tokens=40, seed=3, stop=[word],
            extra_body={"constraint": constraint})
        req = gw.lines(execution="ex-stop")[0]
    finally:
        gw.close()
    seen = srv.history[-1]
    assert [fmt.decode([t]) for t in seen["tokens"]] == ["G", "u", "t", ".", " S", "ch", "lu", "s", "s"]
    engine_doc = llamacpp_document(srv.engine, {**seen["body"], "_tokens_as_ids": False})
    assert (engine_doc["stop_type"], engine_doc["stopping_word"]) == ("word", word)
    assert [p["id"] for p in engine_doc["completion_probabilities"]] == seen["tokens"][:6]
    assert req["output_ids"] == seen["tokens"][:4]
    assert req["output_logprobs"] == pytest.approx(seen["logprobs"][:4])
    assert r.choices[0].message.content == "Gut." and r.choices[0].finish_reason == "stop"
