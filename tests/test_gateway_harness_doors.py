"""What real harnesses send, served (SPEC 12.1): the refusal Claude Code falls back on, compressed
bodies, the Responses WebSocket transport with warm-ups, the remaining context as the default
output limit, Claude Code's HEAD probe, and what `ledger run` hands each harness."""

from __future__ import annotations

import asyncio
import gzip
import json
import urllib.error
import urllib.request

import aiohttp
import anthropic
import pytest

from ledger.gateway.run import harness_command, harness_env
from ledger.producers.models.base import QwenFormat
from tests.gateway_helpers import ANSWER, RunningGateway, init_store, log_requests

try:  # what aiohttp decodes zstd bodies with (docs/dependencies.md)
    from compression.zstd import compress as zstd_compress  # Python 3.14
except ImportError:
    from backports.zstd import compress as zstd_compress

pytestmark = pytest.mark.timeout(180)
HEADERS = {"X-Ledger-Deadline": "2030-01-01T00:00:00Z"}


class _FirstOnlySystem(QwenFormat):
    """Qwen3.6 ids with Qwen3.5's template rule: a system message only first (its raise_exception)."""

    def assemble_array(self, messages, tools, restored, kwargs=None):
        if any(m.get("role") == "system" for m in messages[1:]):
            raise ValueError("System message must be at the beginning.")
        return super().assemble_array(messages, tools, restored, kwargs)


def _post(url: str, body: bytes, headers: dict, method: str = "POST") -> tuple[int, dict | str | None]:
    req = urllib.request.Request(url, data=body if method == "POST" else None, method=method,
                                 headers={"Content-Type": "application/json", **HEADERS, **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode(errors="replace")


# ------------------------------------------------------------------ a mid-conversation system message
def test_a_later_system_message_is_rendered_where_the_template_renders_it(gateway, engine):
    """Claude Code's ``{"role": "system"}`` inside ``messages``: the Qwen3 template renders it in place."""
    client = anthropic.Anthropic(base_url=f"{gateway.url}/executions/ex-midsys", api_key="x", max_retries=0,
                                 default_headers={**HEADERS, "X-Ledger-Task-Id": "t"})
    n0 = len(engine.history)
    client.messages.create(model="tiny", max_tokens=40, extra_body={"constraint": ANSWER}, messages=[
        {"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"}])
    from ledger.producers.chatml import decode

    assert "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\ngo" in decode(engine.history[n0]["prompt"])


def test_a_template_that_refuses_it_is_answered_in_claude_codes_fallback_words(tmp_path, engine):
    gw = RunningGateway(init_store(tmp_path / "store"), engine.url, "vllm", fmt=_FirstOnlySystem())
    try:
        status, doc = _post(f"{gw.url}/executions/ex-refuse/v1/messages", json.dumps({
            "model": "tiny", "max_tokens": 8, "messages": [
                {"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."}]}).encode(),
            {"X-Ledger-Task-Id": "t"})
        assert status == 400 and doc["type"] == "error"
        msg = doc["error"]["message"]
        # the conditions Claude Code 2.1.332 checks before it retries with the system text folded in
        assert "Unexpected role" in msg and "input message role" in msg
        assert "not supported" in msg and "role system" in msg
        assert "System message must be at the beginning." in msg
        assert gw.lines(execution="ex-refuse") == []
    finally:
        gw.close()


# ------------------------------------------------------------------ compressed request bodies
@pytest.mark.parametrize("coding", ["zstd", "gzip"])
def test_compressed_bodies_are_accepted(gateway, engine, coding):
    body = json.dumps({"model": "tiny", "max_tokens": 8, "constraint": ANSWER,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    packed = zstd_compress(body) if coding == "zstd" else gzip.compress(body)
    status, doc = _post(f"{gateway.url}/executions/ex-{coding}/v1/chat/completions", packed,
                        {"Content-Encoding": coding, "X-Ledger-Task-Id": "t"})
    assert status == 200, doc
    assert len(log_requests(gateway.store, f"ex-{coding}")) == 1


def test_bad_compressed_bodies_are_refused_and_nothing_is_recorded(tmp_path, engine):
    gw = RunningGateway(init_store(tmp_path / "store"), engine.url, "vllm")
    gw.gw.max_body = 1 << 20
    try:
        url = f"{gw.url}/executions/ex-bomb/v1/chat/completions"
        bomb = zstd_compress(b" " * (64 << 20))  # 64 MiB of spaces in a few KiB
        status, _ = _post(url, bomb, {"Content-Encoding": "zstd", "X-Ledger-Task-Id": "t"})
        assert status == 413
        status, _ = _post(url, b"not zstd at all", {"Content-Encoding": "zstd", "X-Ledger-Task-Id": "t"})
        assert status == 400
        assert gw.lines(execution="ex-bomb") == []
    finally:
        gw.close()


# ------------------------------------------------------------------ probes, output limit
def test_head_of_the_execution_base_url_answers(gateway):
    status, _ = _post(f"{gateway.url}/executions/ex-head", b"", {}, method="HEAD")
    assert status == 200


def test_a_call_without_a_limit_gets_the_rest_of_the_context(gateway, engine):
    gateway.gw.context_length = 4096
    client_body = {"model": "tiny", "constraint": ANSWER, "messages": [{"role": "user", "content": "hi"}]}
    n0 = len(engine.history)
    status, doc = _post(f"{gateway.url}/executions/ex-ctx/v1/chat/completions", json.dumps(client_body).encode(),
                        {"X-Ledger-Task-Id": "t"})
    assert status == 200, doc
    sent = engine.history[n0]
    assert sent["body"]["max_tokens"] == 4096 - len(sent["prompt"])
    gateway.gw.context_length = 5
    status, doc = _post(f"{gateway.url}/executions/ex-ctx/v1/chat/completions", json.dumps(client_body).encode(),
                        {"X-Ledger-Task-Id": "t"})
    assert status == 400 and "fills the model's context window of 5 tokens" in doc["error"]["message"]


# ------------------------------------------------------------------ the Responses WebSocket transport
def test_responses_over_websocket_with_a_warm_up(gateway, engine):
    """Codex's transport: a ``generate: false`` warm-up (nothing recorded, the engine not called), then
    a call chained on it by ``previous_response_id`` with only the new input; a refusal is an ``error``
    event and the socket closes."""
    url = f"{gateway.url}/executions/ex-ws/v1/responses"
    tools = [{"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}},
             {"type": "web_search"}]

    async def session():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(url, headers={**HEADERS, "X-Ledger-Task-Id": "t"}) as ws:
                await ws.send_json({"type": "response.create", "model": "tiny", "generate": False, "tools": tools,
                                    "input": [{"type": "message", "role": "developer", "content": "Be brief."}]})
                warm = [await ws.receive_json() for _ in range(3)]
                await ws.send_json({"type": "response.create", "model": "tiny", "tools": tools,
                                    "previous_response_id": warm[-1]["response"]["id"], "max_output_tokens": 40,
                                    "constraint": ANSWER, "input": "hi"})
                events = []
                while not events or events[-1]["type"] not in ("response.completed", "response.incomplete"):
                    events.append(await ws.receive_json())
                await ws.send_json({"type": "nonsense"})
                error = await ws.receive_json()
                closed = await ws.receive()
                return warm, events, error, closed

    n0 = len(engine.history)
    warm, events, error, closed = asyncio.run(session())
    assert [e["type"] for e in warm] == ["response.created", "response.in_progress", "response.completed"]
    assert warm[-1]["response"]["output"] == []
    assert len(engine.history) == n0 + 1  # the warm-up never reached the engine
    from ledger.producers.chatml import decode

    prompt = decode(engine.history[n0]["prompt"])
    assert "<|im_start|>system\nBe brief." in prompt and "<|im_start|>user\nhi" in prompt  # chained on the warm-up
    (req,) = log_requests(gateway.store, "ex-ws")
    assert req["agent_id"] == "main"
    assert error["type"] == "error" and error["status"] == 400 and "response.create" in error["error"]["message"]
    assert closed.type == aiohttp.WSMsgType.CLOSE


# ------------------------------------------------------------------ what `ledger run` hands a harness
def test_ledger_run_sets_up_codex_and_claude_code():
    url = "http://127.0.0.1:9"
    assert harness_command(["/x/bin/codex", "exec", "hi"], url, "E") == [
        "/x/bin/codex", "-c", "openai_base_url=http://127.0.0.1:9/executions/E/v1", "exec", "hi"]
    mine = ["codex", "-c", "openai_base_url=http://elsewhere/v1", "exec"]
    assert harness_command(mine, url, "E") == mine
    assert harness_command(["claude", "-p", "x"], url, "E") == ["claude", "-p", "x"]
    env = harness_env(url, "E", base={"OPENAI_API_KEY": "sk-real", "CODEX_API_KEY": "real"}, token="tok",
                      context_length=32768)
    assert {env[k] for k in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "CODEX_API_KEY")} == {"tok"}
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert harness_env(url, "E", base={"CLAUDE_CODE_MAX_CONTEXT_TOKENS": "8000"},
                       context_length=32768)["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8000"
