"""`ledger gateway --workers N` and group commit (SPEC §11.4): calls of one execution reach one
worker; the events of calls that complete together are one append with one fdatasync, each call
still durable before its answer; a process killed between the append and the answer, or a worker
SIGKILLed mid-call, loses no acknowledged call and records none twice once the harness retries."""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from ledger import open_log
from ledger.cli import main as cli_main
from ledger.producers import chatml
from ledger.gateway.app import make_app
from ledger.gateway.calls import Gateway
from ledger.gateway.serve import serve_in_background
from ledger.gateway.store import gateway_db_path
from ledger.gateway.workers import execution_of_head, worker_of
from ledger.producers.recorder import Recorder
from tests.gateway_helpers import ADMIN_TOKENS, GatewayProcess, init_store, log_requests

pytestmark = pytest.mark.timeout(240)
REPLY = chatml.encode("All done here.") + [chatml.IM_END_ID]


class MockEngine:
    """A zero-CPU upstream (vLLM token-ID format): sleeps ``latency`` s, answers REPLY; counts calls."""

    def __init__(self, latency: float = 0.3) -> None:
        from aiohttp import web

        self.calls = 0
        doc = {"choices": [{"index": 0, "token_ids": REPLY, "finish_reason": "stop",
                            "logprobs": {"token_logprobs": [-0.25] * len(REPLY), "tokens": []}}]}

        async def handle(request):
            await request.read()
            await asyncio.sleep(latency)
            self.calls += 1
            return web.json_response(doc)

        app = web.Application(client_max_size=2**26)
        app.router.add_post("/v1/completions", handle)
        self.url, self.close = serve_in_background(app)


@pytest.fixture
def mock_engine():
    eng = MockEngine()
    yield eng
    eng.close()


def _client(url: str, ex: str, retries: int = 0, http_client=None) -> openai.OpenAI:
    """An SDK client of execution ``ex`` (its own connection pool, or the shared ``http_client``)."""
    return openai.OpenAI(base_url=f"{url}/executions/{ex}/v1", api_key=ADMIN_TOKENS.get(url, "x"), max_retries=retries,
                         timeout=60,
                         http_client=http_client, default_headers={"X-Ledger-Task-Id": "t", "X-Ledger-Deadline": "2030-01-01T00:00:00Z"})


def _turn(client, msgs, rid: str):
    return client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16,
                                          extra_headers={"X-Ledger-Request-Id": rid})


def test_worker_of_is_stable_and_spreads():
    assert [worker_of(f"ex-{i}", 2) for i in range(6)] == [worker_of(f"ex-{i}", 2) for i in range(6)]
    counts = [sum(worker_of(f"ex-{i}", 4) == w for i in range(400)) for w in range(4)]
    assert min(counts) > 60 and worker_of(None, 3) == 0


def test_the_front_routes_by_the_peeked_request_head():
    """The front reads no HTTP: the execution comes from the request line's path, else (once the
    head is complete) the X-Ledger-Execution-Id header; a head still arriving is not decided yet."""
    assert execution_of_head(b"POST /executions/ex-1/v1/chat/completions HTTP/1.1\r\nHost: x") == (True, "ex-1")
    assert execution_of_head(b"POST /executions/ex%20%C3%A9/v1/messages HTTP/1.1\r\n") == (True, "ex \u00e9")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-ledger-execution-id:  ex-2 \r\n"
    assert execution_of_head(head) == (False, None)  # the headers are not complete yet
    assert execution_of_head(head + b"\r\n{") == (True, "ex-2")
    assert execution_of_head(b"GET /v1/models HTTP/1.1\r\n\r\n") == (True, None)  # worker 0
    assert execution_of_head(b"POST /executions/ex-3/v1/chat/completi") == (False, None)  # no full line yet


def test_lookups_from_many_threads_read_their_own_bytes(tmp_path):
    """The root cause of a restarted worker losing prefix references: the gateway looks events up
    from several threads at once (restoring many executions after a restart, the recorder's retry
    checks), and a seek + read on the log's one file object could return another event's bytes, so
    a recorded call was skipped as unreadable. Positional reads cannot mix."""
    import sys

    from ledger.events.catalog import key_of

    store = init_store(tmp_path / "store")
    log = open_log(str(store))
    rec = Recorder(log, seal=None)
    for i in range(40):
        rec.open_execution(f"e{i}", task_id="t", deadline="2030-01-01T00:00:00Z", policy="p")
        rec.record_request(f"e{i}", "r", list(range(i * 3000 + 10)), [1, 2], [-0.1, -0.1])
    rec.close()
    want = {i: log.lookup(key_of("request", execution_id=f"e{i}", request_id="r")).value for i in range(40)}
    wrong: list[int] = []

    def reader(k: int) -> None:
        for n in range(300):
            i = (k * 7 + n) % 40
            if log.lookup(key_of("request", execution_id=f"e{i}", request_id="r")).value != want[i]:
                wrong.append(i)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
        log.close()
    assert wrong == []


def test_group_commit_one_fdatasync_for_calls_completing_together(tmp_path, mock_engine, monkeypatch):
    import ledger.log.embedded as embedded

    store = init_store(tmp_path / "store")
    log = open_log(str(store))
    rec = Recorder(log, producer="ledger-gateway", tee=io.StringIO())
    gw = Gateway(rec, upstream=mock_engine.url, api="vllm", tokenizer_name="qwen3.6-27b",
                 state_db=gateway_db_path(store), model="tiny")
    url, stop = serve_in_background(make_app(gw))
    try:
        for i in range(32):  # the executions exist before the measured calls
            _turn(_client(url, f"ex-g{i}"), [{"role": "user", "content": "warm up"}], f"warm-{i}")
        syncs = []
        real = embedded.os.fdatasync
        monkeypatch.setattr(embedded.os, "fdatasync", lambda fd: (syncs.append(fd), real(fd))[1])
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda i: _turn(_client(url, f"ex-g{i}"), [
                {"role": "user", "content": f"go {i}"}], f"r-{i}"), range(32)))
        assert all(a.choices[0].message.content == "All done here." for a in answers)
        assert 1 <= len(syncs) < 32  # the 32 calls completed within the same ~ms: a few appends, not 32
    finally:
        stop()
        rec.close()
        log.close()
    for i in range(32):
        assert [r["request_id"] for r in log_requests(store, f"ex-g{i}")] == [f"warm-{i}", f"r-{i}"]


def test_killed_between_append_and_answer_retry_is_answered_from_the_log(tmp_path, mock_engine):
    store = init_store(tmp_path / "store")
    a = GatewayProcess(store, mock_engine.url, env={"LEDGER_GATEWAY_FAULT": "exit-after-append"})
    msgs = [{"role": "user", "content": "hello"}]
    with pytest.raises(openai.APIConnectionError):
        _turn(_client(a.url, "ex-crash"), msgs, "c1")
    assert a.proc.wait(10) == 17
    assert [r["request_id"] for r in log_requests(store, "ex-crash")] == ["c1"]  # durable, never answered
    calls = mock_engine.calls
    b = GatewayProcess(store, mock_engine.url)
    try:
        r = _turn(_client(b.url, "ex-crash"), msgs, "c1")  # the harness's retry
        assert r.choices[0].message.content == "All done here." and mock_engine.calls == calls
        assert [r["request_id"] for r in log_requests(store, "ex-crash")] == ["c1"]  # recorded once
    finally:
        b.stop()


@pytest.mark.parametrize("shared_pool", [False, True], ids=["own-pools", "shared-pool"])
def test_two_workers_sigkill_one_mid_call_loses_nothing(tmp_path, mock_engine, capsys, shared_pool):
    """Each session its own SDK client (connections kept alive on its worker), or all sessions one
    connection pool (connections handed between the workers as executions alternate on them)."""
    import httpx2
    import psutil

    store = init_store(tmp_path / "store")
    gw = GatewayProcess(store, mock_engine.url, workers=2)
    shared = httpx2.Client(limits=httpx2.Limits(max_connections=100), timeout=60) if shared_pool else None
    sessions, turns = 64, 3
    acked: dict[str, list[str]] = {}
    lock = threading.Lock()

    def session(i: int) -> None:
        ex, client = f"ex-w{i}", _client(gw.url, f"ex-w{i}", retries=8, http_client=shared)
        msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": f"task {i}"}]
        for t in range(turns):
            r = _turn(client, msgs, f"{ex}-t{t}")
            with lock:
                acked.setdefault(ex, []).append(r.model_extra["ledger"]["request_id"])
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"next {t}"}]

    try:
        workers = psutil.Process(gw.proc.pid).children()
        assert len(workers) == 2
        with ThreadPoolExecutor(sessions) as pool:
            futs = [pool.submit(session, i) for i in range(sessions)]
            time.sleep(0.8)  # calls are in flight (the engine takes 0.3 s)
            workers[1].kill()
            for f in futs:
                f.result()
    finally:
        gw.stop()
        if shared is not None:
            shared.close()
    assert sum(len(v) for v in acked.values()) == sessions * turns
    for i in range(sessions):
        ex = f"ex-w{i}"
        reqs = log_requests(store, ex)
        assert [r["request_id"] for r in reqs] == [f"{ex}-t{t}" for t in range(turns)] == acked[ex]
        for prev, nxt in zip(reqs, reqs[1:]):  # one chain
            assert nxt["input"][:len(prev["input"]) + len(prev["output"])] == prev["input"] + prev["output"]
            assert nxt["input_prefix"]["request_id"] == prev["request_id"]
    capsys.readouterr()
    assert cli_main(["--store", str(store), "audit"]) == 0
