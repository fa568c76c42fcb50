"""`ledger gateway --workers N` keeps connections alive (SPEC §11.4): a worker answers every request
of its own executions on the connection it holds, and hands the connection back -- with the bytes it
read and did not pass on -- when the next request is another worker's; pipelined and partly sent
requests keep their order, idle connections close after the keep-alive timeout, and a worker killed
while holding idle connections costs the harness a retry, nothing else."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledger.cli import main as cli_main
from ledger.gateway.workers import _Conn, _Node, body_length, worker_of
from tests.gateway_helpers import GatewayProcess, init_store, log_requests
from tests.test_gateway_workers import MockEngine, _client, _turn

pytestmark = pytest.mark.timeout(240)
REPLY_TEXT = "All done here."
HEADERS = {"X-Ledger-Task-Id": "t", "X-Ledger-Deadline": "2030-01-01T00:00:00Z", "Content-Type": "application/json"}


@pytest.fixture
def engine():
    eng = MockEngine(latency=0.05)
    yield eng
    eng.close()


@pytest.fixture
def two_workers(tmp_path, engine):
    gw = GatewayProcess(init_store(tmp_path / "store"), engine.url, workers=2, no_auth=True)
    yield gw
    gw.stop()


def _on(worker: int, tag: str) -> str:
    """An execution id served by ``worker`` of 2."""
    return next(f"{tag}-{i}" for i in range(100) if worker_of(f"{tag}-{i}", 2) == worker)


def _messages(ex: str, turn: int) -> list[dict]:
    """The conversation of ``ex`` at ``turn`` (the engine always answers REPLY_TEXT)."""
    msgs = [{"role": "user", "content": f"task {ex}"}]
    for t in range(turn):
        msgs += [{"role": "assistant", "content": REPLY_TEXT}, {"role": "user", "content": f"next {t}"}]
    return msgs


def _body(ex: str, turn: int) -> bytes:
    return json.dumps({"model": "tiny", "messages": _messages(ex, turn), "max_tokens": 16}).encode()


def _request(ex: str, turn: int) -> bytes:
    body = _body(ex, turn)
    head = "".join(f"{k}: {v}\r\n" for k, v in {**HEADERS, "X-Ledger-Request-Id": f"{ex}-t{turn}"}.items())
    return (f"POST /executions/{ex}/v1/chat/completions HTTP/1.1\r\nHost: gw\r\n{head}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _response(f) -> tuple[int, dict, dict]:
    """One HTTP response from the socket file ``f``: status, headers (lower-case names), JSON body."""
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, json.loads(f.read(int(headers["content-length"])))


def _chain_of(store, ex: str, turns: int) -> None:
    reqs = log_requests(store, ex)[:turns]  # (a Responses call may follow)
    assert [r["request_id"] for r in reqs] == [f"{ex}-t{t}" for t in range(turns)]
    for prev, nxt in zip(reqs, reqs[1:]):
        assert nxt["input_prefix"]["request_id"] == prev["request_id"]


def test_body_length_from_the_head():
    assert body_length(b"POST / HTTP/1.1\r\nContent-Length: 12\r\n\r\n") == 12
    assert body_length(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n") == 0
    assert body_length(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n") is None
    assert body_length(b"POST / HTTP/1.1\r\nContent-Length: 1\r\ncontent-length: 1\r\n\r\n") is None
    assert body_length(b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n") is None


class _Handler:
    """aiohttp's request handler as far as :class:`_Conn` sees it: records the bytes passed on."""

    def __init__(self) -> None:
        self.got = bytearray()

    def connection_made(self, t) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self.got += data

    def connection_lost(self, exc) -> None:
        pass


class _Transport:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.closed, self.paused = sock, False, False

    def pause_reading(self) -> None:
        self.paused = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str):
        return self.sock

    def close(self) -> None:
        self.closed = True


def _raw(ex: str | None, body: bytes, in_header: bool) -> bytes:
    if ex is None:
        return b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
    path, extra = ("/v1/chat/completions", f"X-Ledger-Execution-Id: {ex}\r\n") if in_header else \
        (f"/executions/{ex}/v1/chat/completions", "")
    return f"POST {path} HTTP/1.1\r\nHost: gw\r\n{extra}Content-Length: {len(body)}\r\n\r\n".encode() + body


_REQUESTS = st.lists(st.tuples(st.sampled_from([None, "ex-0", "ex-1", "ex-2", "ex-3", "ex-4"]),
                               st.binary(max_size=300), st.booleans()), min_size=1, max_size=6)


@settings(max_examples=200, deadline=None)
@given(_REQUESTS, st.lists(st.integers(1, 400), min_size=1, max_size=30))
def test_a_kept_connection_loses_and_reorders_no_byte(requests, cuts):
    """Pipelined requests arriving in any pieces: worker 0's connection passes its own requests' bytes on, in
    order, up to the first request of another worker, then hands the connection on to that worker with every
    byte read and not passed on -- passed + handed on + not yet read is the stream, byte for byte."""
    stream = b"".join(_raw(*r) for r in requests)
    owners = [worker_of(ex, 2) for ex, _, _ in requests]
    mine = owners.index(1) if 1 in owners else len(requests)
    node, handler, handed = _Node(0, 2, None), _Handler(), []
    node.server = lambda: handler
    node.hand_back = lambda fd, prefix, index: handed.append((os.close(fd), prefix, index))
    a, b = socket.socketpair()
    with a, b:
        t = _Transport(a)
        conn = _Conn(node, handler, b"")
        conn.connection_made(t)
        fed, pieces = 0, [*cuts, len(stream)]
        while fed < len(stream) and not t.closed:
            step = pieces[0] if len(pieces) == 1 else pieces.pop(0)
            conn.data_received(stream[fed:fed + step])
            fed += step
            while conn.open > (1 if conn.body else 0):  # aiohttp answers each whole request at once
                conn.answered()
    assert bytes(handler.got) == b"".join(_raw(*r) for r in requests[:mine])
    if mine == len(requests):
        assert handed == [] and not t.closed
    else:
        assert [(i, t.closed) for _, _, i in handed] == [(1, True)]
        assert bytes(handler.got) + handed[0][1] + stream[fed:] == stream


def test_same_execution_requests_reuse_one_connection(two_workers):
    """Every turn of one execution is answered on the connection of the first: no `Connection: close`,
    the socket http.client opened stays the one it sends on."""
    for worker in (0, 1):
        ex = _on(worker, f"same{worker}")
        conn = http.client.HTTPConnection(two_workers.url.removeprefix("http://"), timeout=30)
        first = None
        for turn in range(4):
            conn.request("POST", f"/executions/{ex}/v1/chat/completions", body=_body(ex, turn),
                         headers={**HEADERS, "X-Ledger-Request-Id": f"{ex}-t{turn}"})
            r = conn.getresponse()
            assert r.status == 200 and r.getheader("Connection", "").lower() != "close"
            assert json.loads(r.read())["choices"][0]["message"]["content"] == REPLY_TEXT
            first = first or conn.sock
            assert conn.sock is first  # never reconnected
        conn.close()
        _chain_of(two_workers.store, ex, 4)


def test_foreign_requests_on_a_kept_connection_go_to_their_worker(two_workers):
    """One connection shared by executions of both workers (a harness's pool): each request is answered
    in order by its execution's worker and recorded in that execution's chain; a request naming no
    execution and `GET /v1/responses/{id}` are answered too."""
    a, b = _on(0, "fa"), _on(1, "fb")
    with socket.create_connection(("127.0.0.1", int(two_workers.url.rsplit(":", 1)[1]))) as s:
        f = s.makefile("rb")
        for turn in range(3):
            for ex in (a, b):
                s.sendall(_request(ex, turn))
                status, headers, doc = _response(f)
                assert status == 200 and doc["ledger"]["request_id"] == f"{ex}-t{turn}"
                assert headers.get("connection", "").lower() != "close"
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")  # no execution: worker 0
        assert _response(f)[0] == 200
        body = json.dumps({"model": "tiny", "input": "hi", "max_output_tokens": 16}).encode()
        s.sendall(f"POST /executions/{b}/v1/responses HTTP/1.1\r\nHost: gw\r\nX-Ledger-Task-Id: t\r\n"
                  f"X-Ledger-Deadline: 2030-01-01T00:00:00Z\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        status, _, doc = _response(f)
        assert status == 200
        s.sendall(_request(a, 3))  # back on worker 0, then the response by id: routed by gateway.db to worker 1
        assert _response(f)[2]["ledger"]["request_id"] == f"{a}-t3"
        s.sendall(f"GET /v1/responses/{doc['id']} HTTP/1.1\r\nHost: gw\r\n\r\n".encode())
        status, _, got = _response(f)
        assert status == 200 and got["id"] == doc["id"]
    _chain_of(two_workers.store, a, 4)
    _chain_of(two_workers.store, b, 3)


def test_pipelined_and_partly_sent_requests_keep_their_order(two_workers):
    """Requests of both workers sent back to back in one write, then the same split into small pieces:
    every answer comes back in request order, each from its execution's worker, none lost."""
    port = int(two_workers.url.rsplit(":", 1)[1])
    a, b = _on(0, "pa"), _on(1, "pb")
    order = [(a, 0), (b, 0), (b, 1), (a, 1), (b, 2), (a, 2)]
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"".join(_request(ex, t) for ex, t in order[:3]))
        f = s.makefile("rb")
        assert [_response(f)[2]["ledger"]["request_id"] for _ in range(3)] == [f"{ex}-t{t}" for ex, t in order[:3]]
        stream = b"".join(_request(ex, t) for ex, t in order[3:])
        for i in range(0, len(stream), 97):  # heads cut anywhere, a body across several reads
            s.sendall(stream[i:i + 97])
            time.sleep(0.002)
        assert [_response(f)[2]["ledger"]["request_id"] for _ in range(3)] == [f"{ex}-t{t}" for ex, t in order[3:]]
    _chain_of(two_workers.store, a, 3)
    _chain_of(two_workers.store, b, 3)


def test_an_idle_kept_connection_closes_after_the_keepalive_timeout(tmp_path, engine):
    gw = GatewayProcess(init_store(tmp_path / "store"), engine.url, workers=2, no_auth=True, env={"LEDGER_GATEWAY_KEEPALIVE": "1"})
    try:
        with socket.create_connection(("127.0.0.1", int(gw.url.rsplit(":", 1)[1]))) as s:
            ex = _on(1, "idle")
            s.sendall(_request(ex, 0))
            f = s.makefile("rb")
            assert _response(f)[0] == 200
            s.settimeout(30)
            assert f.read(1) == b""  # the worker closed it (about a second later)
    finally:
        gw.stop()


def test_sigkill_of_a_worker_holding_idle_connections(tmp_path, engine, capsys):
    """Both workers hold kept-alive idle connections; one is SIGKILLed: its clients see the connection
    closed and retry on a new one (the restarted worker), every chain continues, the audit is clean."""
    import psutil

    store = init_store(tmp_path / "store")
    gw = GatewayProcess(store, engine.url, workers=2, no_auth=True)
    exs = [_on(w, f"k{i}") for i in range(4) for w in (0, 1)]
    clients = {ex: _client(gw.url, ex, retries=8) for ex in exs}
    convs = {ex: [{"role": "user", "content": f"task {ex}"}] for ex in exs}
    try:
        for turn in range(3):
            if turn == 2:
                psutil.Process(gw.proc.pid).children()[1].kill()  # worker 1, idle connections open
                time.sleep(0.2)
            for ex in exs:
                r = _turn(clients[ex], convs[ex], f"{ex}-t{turn}")
                convs[ex] += [{"role": "assistant", "content": r.choices[0].message.content},
                              {"role": "user", "content": f"next {turn}"}]
    finally:
        gw.stop()
    for ex in exs:
        _chain_of(store, ex, 3)
    capsys.readouterr()
    assert cli_main(["--store", str(store), "audit"]) == 0


def test_a_request_with_a_chunked_body_is_answered_and_not_kept(two_workers):
    """A body not delimited by Content-Length cannot be routed past: answered, then the connection closes."""
    ex = _on(1, "chunk")
    body = _body(ex, 0)
    with socket.create_connection(("127.0.0.1", int(two_workers.url.rsplit(":", 1)[1]))) as s:
        s.sendall(f"POST /executions/{ex}/v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Ledger-Task-Id: t\r\n"
                  "X-Ledger-Deadline: 2030-01-01T00:00:00Z\r\nContent-Type: application/json\r\n"
                  f"Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        f = s.makefile("rb")
        status, headers, doc = _response(f)
        assert status == 200 and headers["connection"].lower() == "close"
        assert f.read(1) == b""


def test_a_connection_handed_to_a_restarting_worker_waits_for_it(two_workers):
    """Worker 1 is SIGKILLed and being started again; the next request on a connection worker 0 holds is worker
    1's: the front holds the connection (with the bytes worker 0 read) until worker 1 is ready, which answers it
    and continues the chain. (A connection passed to a worker in the instant it dies is lost with it, like a call
    in flight: the client sees the connection closed and retries.)"""
    import psutil

    a, b = _on(0, "ha"), _on(1, "hb")
    with socket.create_connection(("127.0.0.1", int(two_workers.url.rsplit(":", 1)[1]))) as s:
        f = s.makefile("rb")
        for ex in (b, a):
            s.sendall(_request(ex, 0))
            assert _response(f)[0] == 200
        front = psutil.Process(two_workers.proc.pid)
        old = front.children()
        old[1].kill()
        while {p.pid for p in front.children()} <= {p.pid for p in old}:  # the front saw it die and started another
            time.sleep(0.01)
        s.sendall(_request(b, 1))  # on worker 0's connection: handed back while worker 1 is still starting
        status, _, doc = _response(f)
        assert status == 200 and doc["ledger"]["request_id"] == f"{b}-t1"
    _chain_of(two_workers.store, b, 2)


def test_a_streamed_answer_then_another_workers_request_on_the_same_connection(two_workers):
    """A streamed (chunked) answer ends where aiohttp's write_eof ends it; the next request, another worker's,
    follows on the same connection."""
    a, b = _on(1, "sa"), _on(0, "sb")
    conn = http.client.HTTPConnection(two_workers.url.removeprefix("http://"), timeout=30)
    body = json.loads(_body(a, 0))
    conn.request("POST", f"/executions/{a}/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={**HEADERS, "X-Ledger-Request-Id": f"{a}-t0"})
    r = conn.getresponse()
    events = r.read().decode()
    first = conn.sock
    assert r.status == 200 and "data: [DONE]" in events and REPLY_TEXT.split()[0] in events
    conn.request("POST", f"/executions/{b}/v1/chat/completions", body=_body(b, 0),
                 headers={**HEADERS, "X-Ledger-Request-Id": f"{b}-t0"})
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["ledger"]["request_id"] == f"{b}-t0" and conn.sock is first
    conn.close()
    _chain_of(two_workers.store, a, 1)
    _chain_of(two_workers.store, b, 1)
