"""Gateway error paths against a hand-written failing upstream (timeouts, 5xx, malformed
responses): the harness gets an OpenAI-format error with the upstream's status, and nothing is
recorded for a call that did not complete."""

from __future__ import annotations

import asyncio

import openai
import pytest

from ledger.events.catalog import key_of
from ledger.gateway.serve import serve_in_background
from tests.gateway_helpers import RunningGateway, init_store

pytestmark = pytest.mark.timeout(60)

_GOOD = {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "token_ids": [547, 248046],
                      "logprobs": {"token_logprobs": [-0.5, -0.1], "tokens": ["ok", ""], "top_logprobs": None,
                                   "text_offset": [0, 2]}}]}
_MODES = {
    "5xx": (500, {"object": "error", "message": "engine overloaded", "type": "InternalServerError", "code": 500}),
    "429": (429, {"error": {"message": "too many requests", "type": "rate_limit"}}),
    "nologprobs": (200, {"choices": [{"index": 0, "text": "x", "finish_reason": "stop", "token_ids": [87]}]}),
    "mismatch": (200, {"choices": [{"index": 0, "text": "x", "finish_reason": "stop", "token_ids": [87, 88],
                                    "logprobs": {"token_logprobs": [-1.0], "tokens": ["x"]}}]}),
    "nan": (200, {"choices": [{"index": 0, "text": "x", "finish_reason": "stop", "token_ids": [87],
                               "logprobs": {"token_logprobs": ["NaN"], "tokens": ["x"]}}]}),
    "badid": (200, {"choices": [{"index": 0, "text": "x", "finish_reason": "stop", "token_ids": [-3],
                                 "logprobs": {"token_logprobs": [-1.0], "tokens": ["x"]}}]}),
    "good": (200, _GOOD),
}


@pytest.fixture(scope="module")
def fake():
    from aiohttp import web

    state = {"mode": "good"}

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        mode = state["mode"]
        if mode == "slow":
            await asyncio.sleep(3)
        if mode == "notjson":
            return web.Response(text="<html>bad gateway</html>", status=200)
        status, doc = _MODES.get(mode, _MODES["good"])
        return web.json_response(doc, status=status)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    url, stop = serve_in_background(app, timeout=10)
    yield state, url
    stop()


@pytest.fixture
def gateway(tmp_path, fake):
    gw = RunningGateway(init_store(tmp_path / "store"), fake[1], "vllm", timeout=0.5)
    yield gw
    gw.close()


_HISTORY = [{"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_x", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_x", "content": "a result"}]


@pytest.mark.parametrize("mode,status,message", [
    ("5xx", 500, "engine overloaded"),
    ("429", 429, "too many requests"),
    ("slow", 504, "did not answer within 0.5 s"),
    ("notjson", 502, "malformed upstream response: the body is not JSON"),
    ("nologprobs", 502, "choices[0].logprobs is missing"),
    ("mismatch", 502, "2 output token IDs but 1 log-probs"),
    ("nan", 502, "not a finite log-probability"),
    ("badid", 502, "not a token ID"),
])
def test_upstream_failure_is_an_openai_error_and_records_nothing(gateway, fake, mode, status, message):
    fake[0]["mode"] = mode
    c = gateway.client("ex-err", **{"X-Ledger-Request-Id": "r-" + mode})
    with pytest.raises(openai.APIStatusError) as info:
        c.chat.completions.create(model="tiny", messages=_HISTORY, max_tokens=4)
    assert info.value.status_code == status
    assert message in info.value.message
    body = info.value.body
    assert isinstance(body, dict) and message in body["message"] and body["code"] == status
    assert gateway.lines("request") == [] and gateway.lines("tool_payload") == []
    assert gateway.log.lookup(key_of("request", execution_id="ex-err", request_id="r-" + mode)) is None
    # the same request id succeeds once the upstream recovers, and records once
    fake[0]["mode"] = "good"
    ok = c.chat.completions.create(model="tiny", messages=_HISTORY, max_tokens=4)
    assert ok.choices[0].message.content == "ok"
    assert [r["request_id"] for r in gateway.lines("request")] == ["r-" + mode]
    assert [(p["call_id"], p["kind"]) for p in gateway.lines("tool_payload")] == [("call_x", "result")]


def test_unreachable_upstream_is_502(tmp_path):
    gw = RunningGateway(init_store(tmp_path / "store"), "http://127.0.0.1:9", "vllm", timeout=2)
    try:
        with pytest.raises(openai.APIStatusError) as info:
            gw.client("ex-down").chat.completions.create(model="tiny", messages=_HISTORY[:1], max_tokens=4)
        assert info.value.status_code == 502 and "unreachable" in info.value.message
        assert gw.lines("request") == []
    finally:
        gw.close()


def test_invalid_json_body_is_400(gateway):
    import urllib.error
    import urllib.request

    req = urllib.request.Request(gateway.url + "/v1/chat/completions", data=b"{not json", method="POST",
                                 headers={"X-Ledger-Execution-Id": "ex-err", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400
    assert b"not valid UTF-8 JSON" in info.value.read()
