"""The gateway in front of llama.cpp itself (``llama-cpp-python``, optional: it builds from its
sdist, ~14 min on 2 cores, so this module skips when it is not installed; install it with
``pip install -e '.[llamacpp]'``). The tiny random model is a GGUF written with the ``gguf``
package using the Qwen3.6 vocabulary; llama.cpp computes every step's logits."""

from __future__ import annotations

import pytest

from tests.gateway_helpers import ANSWER, READ_TOOL, TOOL_CALL, RunningGateway, init_store, inputs_of

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional extra [llamacpp])")

pytestmark = pytest.mark.timeout(180)


def test_llama_cpp_engine_tool_loop(tmp_path):
    from ledger.producers import chatml
    from workloads.tiny_engine import LlamaCppEngine, serve, write_gguf

    srv = serve(LlamaCppEngine(write_gguf(tmp_path / "tiny.gguf")))
    gw = RunningGateway(init_store(tmp_path / "store"), srv.url, "llamacpp")
    try:
        c = gw.client("ex-llama")
        history = [{"role": "user", "content": "task"}]
        r1 = c.chat.completions.create(model="tiny", messages=history, tools=[READ_TOOL], max_tokens=80, seed=1,
                                       extra_body={"constraint": TOOL_CALL})
        t1 = r1.choices[0].message.tool_calls[0]
        history += [{"role": "assistant", "content": r1.choices[0].message.content, "tool_calls": [
            {"id": t1.id, "type": "function", "function": {"name": "read", "arguments": t1.function.arguments}}]},
            {"role": "tool", "tool_call_id": t1.id, "content": "r"}]
        c.chat.completions.create(model="tiny", messages=history, tools=[READ_TOOL], max_tokens=80, seed=2,
                                  extra_body={"constraint": ANSWER})
        reqs = gw.lines(execution="ex-llama")
        inputs = inputs_of(reqs)
        for req, call in zip(reqs, srv.history):
            assert req["output_ids"] == call["tokens"] and inputs[req["request_id"]] == call["prompt"]
            assert req["output_logprobs"] == pytest.approx(call["logprobs"], rel=1e-6)
        assert inputs[reqs[1]["request_id"]] == (inputs[reqs[0]["request_id"]] + reqs[0]["output_ids"]
                                                + chatml.encode("\n") + chatml.render_prompt(history[2:]))
    finally:
        gw.close()
        srv.close()
