"""The gateway on a shared cluster (SPEC 12.3): credentials on by default, probes, metrics, limits, the access log.

Every test runs the real `ledger gateway` process (GatewayProcess) against the real tiny ONNX engine, and
talks to it with plain HTTP (urllib) or the official SDKs, as a harness or an operator would.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledger.cli import main as cli_main
from tests.gateway_helpers import ANSWER, GatewayProcess, init_store, log_requests

ROOT = Path(__file__).resolve().parents[1]
OPEN_BODY = {"task_id": "t-auth", "deadline": "2030-01-01T00:00:00Z"}


def _http(url: str, method: str = "GET", body: dict | bytes | None = None, token: str | None = None,
          header: str = "Authorization") -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers[header] = f"Bearer {token}" if header == "Authorization" else token
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, dict(r.headers), (json.loads(raw) if raw[:1] in (b"{", b"[") else {"text": raw.decode()})
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, dict(exc.headers), json.loads(raw) if raw[:1] == b"{" else {"text": raw.decode()}


def _open(gw: GatewayProcess, ex: str, token: str | None) -> tuple[int, dict]:
    status, _, body = _http(f"{gw.url}/executions/{ex}/ledger/open", "POST", OPEN_BODY, token)
    return status, body


def _chat(gw: GatewayProcess, ex: str, token: str | None, *, prefixed: bool = True, **headers) -> tuple[int, dict]:
    url = f"{gw.url}/executions/{ex}/v1/chat/completions" if prefixed else f"{gw.url}/v1/chat/completions"
    req = urllib.request.Request(url, data=json.dumps({
        "model": "tiny", "max_tokens": 24, "messages": [{"role": "user", "content": "hi"}],
        "constraint": ANSWER, "seed": 1}).encode(), headers={"Content-Type": "application/json", **headers},
        method="POST")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def authed(tmp_path, engine):
    gw = GatewayProcess(init_store(tmp_path / "store"), engine.url)
    yield gw
    if gw.proc.poll() is None:
        gw.stop()


def test_the_admin_token_file_is_private_and_open_returns_an_execution_token(authed):
    f = authed.store / "gateway.token"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert len(authed.token) >= 43  # 32 random bytes, URL-safe base64
    assert _open(authed, "ex-a", None)[0] == 401
    assert _open(authed, "ex-a", "wrong")[0] == 401
    status, body = _open(authed, "ex-a", authed.token)
    assert status == 200 and body["execution_id"] == "ex-a" and body["open"] is True
    assert len(body["token"]) >= 43 and body["token"] != authed.token  # >= 256 bits, not the admin's


def test_401_403_matrix_on_every_route_in_each_protocol_shape(authed):
    a = _open(authed, "ex-a", authed.token)[1]["token"]
    b = _open(authed, "ex-b", authed.token)[1]["token"]
    assert _chat(authed, "ex-a", a)[0] == 200
    status, body = _chat(authed, "ex-a", None)
    assert status == 401 and body["error"]["type"] == "authentication_error"  # OpenAI's shape
    status, body = _chat(authed, "ex-a", b)
    assert status == 403 and body["error"]["type"] == "permission_error" and "another execution" in body["error"]["message"]
    # the un-prefixed route with the execution header: the same rules
    assert _chat(authed, "ex-a", b, prefixed=False, **{"X-Ledger-Execution-Id": "ex-a"})[0] == 403
    assert _chat(authed, "ex-a", a, prefixed=False, **{"X-Ledger-Execution-Id": "ex-a"})[0] == 200
    routes = [("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
              ("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"), ("GET", "/v1/models")]
    for method, route in routes:
        url = f"{authed.url}/executions/ex-a{route}"
        body = {} if method == "POST" else None
        for token, want in ((None, 401), ("nope", 401), (b, 403)):
            status, _, doc = _http(url, method, body, token)
            assert status == want, (route, token, status, doc)
            if "/v1/messages" in route:
                assert doc["type"] == "error" and doc["error"]["type"] in ("authentication_error", "permission_error")
            else:
                assert doc["error"]["type"] in ("authentication_error", "permission_error")
    # x-api-key carries a token too (the Anthropic SDK's header)
    client = anthropic.Anthropic(base_url=f"{authed.url}/executions/ex-a", api_key=a, max_retries=0)
    r = client.messages.create(model="tiny", max_tokens=24, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"constraint": ANSWER, "seed": 2})
    assert [c.text for c in r.content if c.type == "text"][0].startswith("Done")
    with pytest.raises(anthropic.PermissionDeniedError):
        anthropic.Anthropic(base_url=f"{authed.url}/executions/ex-a", api_key=b, max_retries=0).messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    # close needs the admin token, never an execution's
    assert _http(f"{authed.url}/executions/ex-a/ledger/close", "POST", {"status": "error"}, a)[0] == 401
    assert _http(f"{authed.url}/executions/ex-a/ledger/close", "POST", {"status": "completed"}, authed.token)[0] == 200


def test_a_stored_response_is_served_only_under_its_execution(authed):
    a = _open(authed, "ex-a", authed.token)[1]["token"]
    b = _open(authed, "ex-b", authed.token)[1]["token"]
    client = openai.OpenAI(base_url=f"{authed.url}/executions/ex-a/v1", api_key=a, max_retries=0)
    r = client.responses.create(model="tiny", input="hi", max_output_tokens=24, extra_body={"constraint": ANSWER})
    assert client.responses.retrieve(r.id).id == r.id
    assert _http(f"{authed.url}/v1/responses/{r.id}", "GET", None, a)[0] == 404  # no execution prefix
    assert _http(f"{authed.url}/v1/responses/{r.id}", "GET", None, b)[0] == 404
    assert _http(f"{authed.url}/executions/ex-b/v1/responses/{r.id}", "GET", None, b)[0] == 404


def test_tokens_never_reach_the_store_or_the_gateway_output(authed):
    a = _open(authed, "ex-a", authed.token)[1]["token"]
    assert _chat(authed, "ex-a", a)[0] == 200
    authed.proc.terminate()
    out, err = authed.proc.communicate(timeout=30)
    assert a not in out + err and authed.token not in out + err
    for f in authed.store.rglob("*"):
        if f.is_file() and f.name != "gateway.token":
            data = f.read_bytes()
            assert a.encode() not in data and authed.token.encode() not in data, f


def test_probes_need_no_credential_and_metrics_need_the_admin_token(authed):
    assert _http(f"{authed.url}/healthz")[:1] == (200,)
    status, _, body = _http(f"{authed.url}/readyz")
    assert status == 200 and body == {"ready": True, "upstream": True, "log": True}
    a = _open(authed, "ex-m", authed.token)[1]["token"]
    assert _chat(authed, "ex-m", a)[0] == 200
    assert _chat(authed, "ex-m", None)[0] == 401
    assert _http(f"{authed.url}/metrics", token=a)[0] == 401
    status, headers, body = _http(f"{authed.url}/metrics", token=authed.token)
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(body["text"])}
    for name in ("ledger_gateway_requests", "ledger_gateway_request_seconds", "ledger_gateway_upstream_seconds",
                 "ledger_gateway_tokens", "ledger_gateway_open_executions", "ledger_gateway_commit_batch_size",
                 "ledger_gateway_refusals"):
        assert name in fams, name

    def value(fam: str, sample: str, **labels) -> float:
        return sum(s.value for s in fams[fam].samples if s.name == sample and all(s.labels.get(k) == v
                                                                                   for k, v in labels.items()))

    assert value("ledger_gateway_requests", "ledger_gateway_requests_total", api="chat", status="200") == 1
    assert value("ledger_gateway_requests", "ledger_gateway_requests_total", api="chat", status="401") == 1
    assert value("ledger_gateway_refusals", "ledger_gateway_refusals_total", reason="unauthenticated") >= 2
    recorded = log_requests(authed.store, "ex-m")
    assert value("ledger_gateway_tokens", "ledger_gateway_tokens_total", direction="out") == len(recorded[0]["output"])
    assert value("ledger_gateway_upstream_seconds", "ledger_gateway_upstream_seconds_count") == 1
    assert value("ledger_gateway_open_executions", "ledger_gateway_open_executions") == 1
    assert value("ledger_gateway_commit_batch_size", "ledger_gateway_commit_batch_size_count") >= 1


def test_readiness_follows_the_upstream(tmp_path):
    from workloads.tiny_engine import OrtEngine, serve

    srv = serve(OrtEngine(seed=0))
    gw = GatewayProcess(init_store(tmp_path / "store"), srv.url)
    try:
        assert _http(f"{gw.url}/readyz")[0] == 200
        port = int(srv.url.rsplit(":", 1)[1])
        srv.close()
        status, _, body = _http(f"{gw.url}/readyz")
        assert status == 503 and body["upstream"] is False
        assert _http(f"{gw.url}/healthz")[0] == 200  # alive, not ready
        srv = serve(OrtEngine(seed=0), port=port)
        assert _http(f"{gw.url}/readyz")[0] == 200
    finally:
        gw.stop()
        srv.close()


def test_no_auth_is_refused_off_loopback(tmp_path, capsys):
    store = init_store(tmp_path / "store")
    argv = ["--store", str(store), "gateway", "--upstream", "http://127.0.0.1:1", "--api", "vllm",
            "--tokenizer", "qwen3.6-27b", "--no-auth"]
    assert cli_main([*argv, "--listen", "0.0.0.0:8099"]) == 2
    assert "--no-auth is refused with --listen 0.0.0.0" in capsys.readouterr().err


def test_limits_and_the_access_log(tmp_path, engine):
    store = init_store(tmp_path / "store")
    log_file = tmp_path / "access.jsonl"
    gw = GatewayProcess(store, engine.url, extra=["--max-body-bytes", "4096", "--access-log", str(log_file)])
    try:
        a = _open(gw, "ex-l", gw.token)[1]["token"]
        big = json.dumps({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 8000}]})
        status, _, body = _http(f"{gw.url}/executions/ex-l/v1/chat/completions", "POST", big.encode(), a)
        assert status == 413 and "--max-body-bytes" in body["error"]["message"]
        assert log_requests(store, "ex-l") == []  # nothing recorded
        assert _chat(gw, "ex-l", a)[0] == 200
    finally:
        gw.stop()
    lines = [json.loads(x) for x in log_file.read_text().splitlines()]
    calls = [x for x in lines if x["path"].endswith("/chat/completions")]
    assert [x["status"] for x in calls] == [413, 200]
    ok = calls[1]
    assert ok["execution"] == "ex-l" and ok["api"] == "chat" and ok["tokens_out"] > 0 and ok["tokens_in"] > 0
    assert ok["upstream_ms"] > 0 and ok["gateway_ms"] >= 0
    text = log_file.read_text()
    assert a not in text and gw.token not in text and '"content"' not in text


def test_refusals_known_from_the_request_cost_no_engine_call_and_record_nothing(tmp_path, engine):
    gw = GatewayProcess(init_store(tmp_path / "store"), engine.url)
    try:
        a = _open(gw, "ex-r", gw.token)[1]["token"]
        n0 = len(engine.history)
        url = f"{gw.url}/executions/ex-r/v1/chat/completions"
        msgs = [{"role": "user", "content": "hi"}]
        for field, value, why in (("temperature", "NaN", "finite"), ("top_p", "Infinity", "finite"),
                                  ("top_k", "1e30", "integer"), ("top_p", "0", "(0, 1]"), ("temperature", "-1", ">= 0")):
            raw = ('{"model": "tiny", "max_tokens": 4, "messages": %s, "%s": %s}' % (json.dumps(msgs), field, value))
            status, _, body = _http(url, "POST", raw.encode(), a)
            assert status == 400 and why in body["error"]["message"] and body["error"]["param"] == field, (field, body)
        assert len(engine.history) == n0  # the engine never ran
        assert _chat(gw, "ex-r", a)[0] == 200
        assert _http(f"{gw.url}/executions/ex-r/ledger/close", "POST", {"status": "completed"}, gw.token)[0] == 200
        n1 = len(engine.history)
        status, body = _chat(gw, "ex-r", a)
        assert status == 409 and "is closed" in body["error"]["message"]
        assert len(engine.history) == n1
        assert len(log_requests(gw.store, "ex-r")) == 1
    finally:
        gw.stop()
