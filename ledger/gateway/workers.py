"""`ledger gateway --workers N` (SPEC §11.4): one port, N gateway processes, calls routed by execution.

The front process owns the listening socket and does no HTTP: it accepts a connection, peeks
(``MSG_PEEK``, nothing consumed) at the request line -- and the headers when the path names no
execution -- to find the execution id (the ``/executions/{id}/...`` path, else the
``X-Ledger-Execution-Id`` header; ``GET /v1/responses/{id}``: the execution ``gateway.db`` files the
response under), and passes the connected socket itself to worker ``sha256(execution id) mod N``
over a Unix socket (``SCM_RIGHTS``): no second HTTP hop. A request naming no execution goes to
worker 0.

The worker keeps the connection alive after answering, and reads each next request's head itself
(:class:`_Conn`, before aiohttp sees a byte of it): a request of one of its own executions is
passed to aiohttp on the same connection -- a harness whose connection serves one execution (an
SDK client per harness, as under ``ledger run``) pays one connect per execution, not one per call;
a request of another worker's execution (a harness sharing one connection pool between
executions) stops the reading, waits until every answer already due on the connection is
written, and the connection goes back to the front together with the bytes the worker read and
did not pass on (a memory file, ``memfd``, passed beside the socket), and on to the right worker,
which starts from those bytes: nothing lost or reordered, pipelined requests included. Calls of
one execution thus always reach the same worker (trajectory-affine: its restoration state stays
local). A request whose body is not delimited by ``Content-Length`` (chunked, an upgrade) is
answered and its connection closed. An idle connection is closed after ``KEEPALIVE`` seconds
(env ``LEDGER_GATEWAY_KEEPALIVE``).

Every worker is a whole gateway (``ledger gateway --worker-channel FD``) with its own recorder
appending to the one store: on the embedded log the writer lock is held for an append only and
each worker's calls that complete together go out as one append with one ``fdatasync`` (group
commit, :meth:`~ledger.producers.recorder.Recorder.wait_durable`); ``gateway.db`` is SQLite in
WAL mode with a busy timeout, safe under N writers. A worker that dies is started again; the
connections that arrive for it meanwhile wait in the front (up to ``HOLD`` seconds, then 503) and
are passed on once it is ready, so a restart costs the harness nothing but the calls that were in
flight on the dead worker: those lose their connection and the SDK retries them (same
``X-Ledger-Request-Id``); the idle connections it kept alive are closed, which a client's pool
sees when it next uses one (the SDKs retry on a new connection). Because every acknowledged call was durable (events and restoration
state) before its answer, the new worker rebuilds the execution from ``gateway.db`` and the log,
answers a retry of a call the dead one recorded from the log, and records every other call once,
continuing the same chain.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from ledger.gateway.app import make_app
from ledger.gateway.serve import run_loop

__all__ = ["serve_workers", "serve_worker", "worker_of", "worker_argv", "execution_of_head"]

HEAD_MAX = 64 * 1024  # bytes peeked for the request line and headers
HOLD = 120.0  # seconds a connection waits in the front for its worker to (re)start, then 503


def worker_of(execution_id: str | None, n: int) -> int:
    """The worker that serves ``execution_id`` (worker 0 for none)."""
    if not execution_id:
        return 0
    return int.from_bytes(hashlib.sha256(execution_id.encode("utf-8", "surrogatepass")).digest()[:8], "big") % n


def worker_argv(args: Any, channel_fd: int, index: int = 0) -> list[str]:
    """The command line of worker ``index`` (the front's own gateway options; an exclusive ``--writer NAME``
    becomes ``NAME/worker-K``, so a restarted worker fences what its killed predecessor left open on Kafka)."""
    argv = [sys.executable, "-m", "ledger.cli"]
    for flag, value in (("--store", args.store), ("--db", args.db), ("--trust", getattr(args, "trust", None))):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["gateway", "--upstream", args.upstream, "--api", args.api, "--tokenizer", args.tokenizer,
             "--timeout", str(args.timeout), "--max-tokens", str(args.max_tokens), "--worker-channel", str(channel_fd)]
    for flag, value in (("--chat-template", args.chat_template), ("--tool-parser", args.tool_parser),
                        ("--model", args.model)):
        if value is not None:
            argv += [flag, value]
    for t in args.stop_token or ():
        argv += ["--stop-token", str(t)]
    if getattr(args, "writer", None):
        argv += ["--writer", f"{args.writer}/worker-{index}"]
    argv += _operation_flags(args)
    return argv


def _operation_flags(args: Any) -> list[str]:
    """The front's credentials, limits and access log, for every worker to enforce alike (SPEC 12.3)."""
    out = []
    if getattr(args, "no_auth", False):
        out.append("--no-auth")
    elif getattr(args, "token_file", None):
        out += ["--token-file", str(Path(args.token_file).resolve())]
    for flag, name in (("--max-body-bytes", "max_body_bytes"),
                       ("--max-concurrent-per-execution", "max_concurrent_per_execution"),
                       ("--access-log", "access_log")):
        if getattr(args, name, None) is not None:
            out += [flag, str(getattr(args, name))]
    return out


def execution_of_head(head: bytes, db_path: Path | None = None) -> tuple[bool, str | None]:
    """``(decided, execution id)`` from the first bytes of an HTTP request: decided is False while
    more bytes are needed (the path names no execution and the headers are not complete)."""
    line_end = head.find(b"\r\n")
    if line_end < 0:
        return len(head) >= HEAD_MAX, None
    parts = head[:line_end].split(b" ")
    method, target = (parts[0], parts[1]) if len(parts) >= 2 else (b"", b"/")
    path = unquote(target.split(b"?", 1)[0].decode("latin-1"))
    segs = path.strip("/").split("/")
    if segs[0] == "executions" and len(segs) >= 2 and segs[1]:
        return True, segs[1]
    end = head.find(b"\r\n\r\n")
    if end < 0 and len(head) < HEAD_MAX:
        return False, None
    for line in head[line_end + 2:end if end >= 0 else len(head)].split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"x-ledger-execution-id" and value.strip():
            return True, value.strip().decode("utf-8", "replace")
    if method == b"GET" and segs[:2] == ["v1", "responses"] and len(segs) == 3 and db_path is not None:
        return True, _execution_of_response(db_path, segs[2])
    return True, None


def _execution_of_response(db_path: Path, response_id: str) -> str | None:
    if not db_path.exists():
        return None
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        try:
            row = db.execute("SELECT execution_id FROM responses WHERE response_id = ?", (response_id,)).fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return None
    return row[0] if row else None


_UNAVAILABLE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")


def _refuse(conn: socket.socket, carried: int | None, index: int) -> None:
    """Answer 503 on a connection the front could not pass on (its worker did not come back)."""
    if carried is not None:
        os.close(carried)
    body = (b'{"error": {"message": "gateway worker %d is not available; retry the call (same '
            b'X-Ledger-Request-Id)", "type": "worker_unavailable", "param": null, "code": 503}}' % index)
    try:
        conn.setblocking(True)
        conn.settimeout(1.0)
        conn.sendall(_UNAVAILABLE % (len(body), body))
    except OSError:
        pass
    conn.close()


def _messages(chan: socket.socket) -> Iterator[tuple[bytes, list[int]]]:
    """The messages waiting on a front/worker channel (non-blocking, at most 64 a call), each ``(bytes, file
    descriptors)``; ``(b"", [])`` last when the other end is gone."""
    for _ in range(64):
        try:
            msg, fds, _flags, _addr = socket.recv_fds(chan, 64, 2)
        except BlockingIOError:
            return
        except OSError:
            msg, fds = b"", []
        yield msg, fds
        if not msg and not fds:
            return


class _Worker:
    """One worker process and the Unix channel its connections are passed over."""

    def __init__(self, index: int, n: int, args: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.index, self.n, self.args, self.loop = index, n, args, loop
        self.proc: subprocess.Popen | None = None
        self.chan: socket.socket | None = None
        self.ready = False
        # connections waiting for it to be ready: (socket, memfd of the bytes it carries or None, deadline)
        self.pending: list[tuple[socket.socket, int | None, float]] = []
        self.stopping = False
        self.route: Any = None  # (worker index, socket, memfd): a connection a worker handed back

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent.send(b"i%d %d" % (self.index, self.n))  # which worker it is, of how many
        try:
            self.proc = subprocess.Popen(worker_argv(self.args, child.fileno(), self.index), pass_fds=[child.fileno()],
                                         stdout=subprocess.DEVNULL)
        finally:
            child.close()
        parent.setblocking(False)
        self.chan, self.ready = parent, False
        self.loop.add_reader(parent, self._on_channel)

    def _on_channel(self) -> None:
        for msg, fds in _messages(self.chan):
            if msg[:1] == b"h" and fds:  # a connection whose next request is another worker's
                self.route(int(msg[1:]), socket.socket(fileno=fds[0]), fds[1] if len(fds) > 1 else None)
            elif msg:
                self.ready = True
                self.flush()
            else:
                self._gone()
                return

    def _gone(self) -> None:
        self.loop.remove_reader(self.chan)  # the worker is gone (say SIGKILL): start it again
        self.chan.close()
        self.chan, self.ready = None, False
        if self.stopping:
            return
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:  # it closed the channel but did not exit: replace it
            self.proc.kill()
            code = self.proc.wait()
        print(f"ledger gateway: worker {self.index} exited ({code}); restarting", file=sys.stderr, flush=True)
        self.start()

    def hand(self, conn: socket.socket, carried: int | None = None) -> None:
        self.pending.append((conn, carried, time.monotonic() + HOLD))
        if self.ready:
            self.flush()

    def flush(self) -> None:
        while self.pending and self.ready:
            conn, carried, _ = self.pending[0]
            try:
                socket.send_fds(self.chan, [b"c"], [conn.fileno()] if carried is None else [conn.fileno(), carried])
            except BlockingIOError:  # the worker is behind: try again shortly
                self.loop.call_later(0.005, self.flush)
                return
            except OSError:  # the worker is going away: its channel's EOF restarts it
                self.ready = False
                return
            self.pending.pop(0)
            conn.close()  # the worker holds it now
            if carried is not None:
                os.close(carried)

    def expire(self, now: float) -> None:
        keep = []
        for conn, carried, deadline in self.pending:
            if deadline < now:
                _refuse(conn, carried, self.index)
            else:
                keep.append((conn, carried, deadline))
        self.pending = keep


class _Front:
    """Accepts connections and passes each to the worker of the execution its request names."""

    def __init__(self, workers: list[_Worker], db_path: Path, loop: asyncio.AbstractEventLoop) -> None:
        self.workers, self.db_path, self.loop = workers, db_path, loop
        for w in workers:
            w.route = self.route

    def route(self, index: int, conn: socket.socket, carried: int | None) -> None:
        """A worker handed back a kept-alive connection whose next request (in ``carried``) is worker ``index``'s."""
        self.workers[index % len(self.workers)].hand(conn, carried)

    def on_accept(self, listener: socket.socket) -> None:
        for _ in range(64):
            try:
                conn, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, say: the connection stays queued in the kernel
                return
            conn.setblocking(False)
            self.peek(conn, time.monotonic() + 30)

    def peek(self, conn: socket.socket, deadline: float) -> None:
        try:
            head = conn.recv(HEAD_MAX, socket.MSG_PEEK)
        except BlockingIOError:
            head = None
        except OSError:
            head = b""
        if head == b"":  # closed before a request
            conn.close()
            return
        decided, execution = execution_of_head(head, self.db_path) if head else (False, None)
        if decided or time.monotonic() > deadline:
            self.workers[worker_of(execution, len(self.workers))].hand(conn)
        elif head is None:  # nothing yet: wake when bytes arrive
            self.loop.add_reader(conn, self._readable, conn, deadline)
        else:  # part of the head: look again shortly (peeked bytes keep the socket readable)
            self.loop.call_later(0.002, self.peek, conn, deadline)

    def _readable(self, conn: socket.socket, deadline: float) -> None:
        self.loop.remove_reader(conn)
        self.peek(conn, deadline)


def serve_workers(args: Any, n: int, host: str, port: int, db_path: Path) -> int:
    """Run the front on ``host:port`` and ``n`` workers until interrupted (``db_path``: the gateway.db)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host.strip("[]"), port), family=family, backlog=1024)
    listener.setblocking(False)

    # every worker writes its metric values here; GET /metrics (any worker) sums them (prometheus-client)
    metrics_dir = tempfile.mkdtemp(prefix="ledger-gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        return run_loop(_serve(args, n, listener, db_path))
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _serve(args: Any, n: int, listener: socket.socket, db_path: Path) -> int:
    loop = asyncio.get_running_loop()
    workers = [_Worker(i, n, args, loop) for i in range(n)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 120
    while not all(w.ready for w in workers):
        if any(w.proc.poll() is not None for w in workers) or time.monotonic() > deadline:
            _stop_workers(workers)
            print("ledger gateway: a worker did not start", file=sys.stderr)
            return 2
        await asyncio.sleep(0.05)
    front = _Front(workers, db_path, loop)
    stop = loop.create_future()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    loop.add_reader(listener, front.on_accept, listener)
    host, port = listener.getsockname()[:2]
    print(f"ledger gateway: http://{host}:{port}/v1 -> {args.api} {args.upstream} ({n} workers)", flush=True)
    try:
        while not stop.done():
            await asyncio.wait([stop], timeout=1.0)
            now = time.monotonic()
            for w in workers:
                w.expire(now)
    finally:
        loop.remove_reader(listener)
        listener.close()
        _stop_workers(workers)
    return 0


def _stop_workers(workers: list[_Worker]) -> None:
    for w in workers:
        w.stopping = True
        if w.proc is not None and w.proc.poll() is None:
            w.proc.terminate()
    for w in workers:
        if w.proc is None:
            continue
        try:
            w.proc.wait(10)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


# ------------------------------------------------------------------ one worker
KEEPALIVE = 75.0  # seconds an idle kept-alive connection stays open (env LEDGER_GATEWAY_KEEPALIVE overrides)


def body_length(head: bytes) -> int | None:
    """The body length of a request whose whole head (through the blank line) is ``head``: its one
    Content-Length, 0 without one; None for a body not delimited that way (chunked, an upgrade, a
    doubtful header) -- such a connection is closed after its response instead of kept."""
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        name = name.strip().lower()
        if not sep or name not in (b"content-length", b"transfer-encoding", b"upgrade"):
            continue
        if name != b"content-length" or length is not None or not value.strip().isdigit():
            return None
        length = int(value.strip())
    return length or 0


def _memfd(data: bytes) -> int:
    """A memory file holding ``data`` (the bytes a connection carries along when it is handed on)."""
    fd = os.memfd_create("ledger-conn", os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    return fd


def _read_memfd(fd: int) -> bytes:
    try:
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


class _Node:
    """One worker's side of the routing: which worker it is, its channel to the front, and the
    connections it hands back (a duplicate of the socket and the bytes read from it) when the channel
    is full."""

    def __init__(self, index: int, n: int, db_path: Path | None) -> None:
        self.index, self.n, self.db_path = index, n, db_path
        self.loop: asyncio.AbstractEventLoop | None = None
        self.chan: socket.socket | None = None
        self.server: Any = None  # aiohttp's web.Server: calling it makes a connection's request handler
        self.outbox: list[tuple[int, int, int]] = []  # (socket fd, memfd of its bytes, worker)

    def protocol(self, prefix: bytes = b"") -> "_Conn":
        return _Conn(self, self.server(), prefix)

    def owner(self, head: bytes) -> int:
        return worker_of(execution_of_head(head, self.db_path)[1], self.n)

    def hand_back(self, fd: int, prefix: bytes, index: int) -> None:
        self.outbox.append((fd, _memfd(prefix), index))
        self.flush()

    def flush(self) -> None:
        while self.outbox:
            fd, mem, index = self.outbox[0]
            try:
                socket.send_fds(self.chan, [b"h%d" % index], [fd, mem])
            except BlockingIOError:  # the front is behind: try again shortly
                self.loop.call_later(0.005, self.flush)
                return
            except OSError:  # the front is gone: so is this worker, shortly
                pass
            self.outbox.pop(0)
            os.close(fd)
            os.close(mem)


class _Conn(asyncio.Protocol):
    """A client connection in a worker, kept alive between requests. Each request's head is read here
    (whole, before aiohttp sees a byte of it): a request of this worker's executions is passed to
    aiohttp's request handler, head and body as they arrive; a request of another worker's stops the
    reading, waits until every answer already due on the connection is written, and hands the
    connection to the front with the bytes read and not passed on, which passes both to that worker."""

    def __init__(self, node: _Node, handler: Any, prefix: bytes) -> None:
        self.node, self.h, self.t = node, handler, None
        self.buf = bytearray(prefix)  # bytes read and not passed on: the next request's head so far
        self.body = 0  # bytes of the current request's body still to pass on
        self.open = 0  # requests passed on whose answer is not written yet
        self.away: int | None = None  # the worker the connection is leaving for
        self.raw = False  # a body not delimited by Content-Length: pass everything, close after the answer

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        self.h.connection_made(transport)
        if self.buf:
            self._route()

    def data_received(self, data: bytes) -> None:
        if self.raw:
            self.h.data_received(data)
            return
        if self.body and not self.buf:  # the current request's body: straight through
            n = min(self.body, len(data))
            self.body -= n
            self.h.data_received(data[:n] if n < len(data) else data)
            if n == len(data):
                return
            data = data[n:]
        self.buf += data
        self._route()

    def _route(self) -> None:
        while self.buf and self.away is None and not self.raw and self.t is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) >= HEAD_MAX:  # not HTTP we route: aiohttp answers it and the connection ends
                    self._go_raw()
                return
            head = bytes(self.buf[:end + 4])
            index = self.node.owner(head)
            if index != self.node.index:
                self.away = index
                self.t.pause_reading()
                self.leave()
                return
            length = body_length(head)
            if length is None:
                self._go_raw()
                return
            self.open += 1
            take = min(len(self.buf), end + 4 + length)
            self.body = end + 4 + length - take
            chunk = bytes(self.buf[:take])
            del self.buf[:take]
            self.h.data_received(chunk)

    def _go_raw(self) -> None:
        self.raw, chunk = True, bytes(self.buf)
        self.buf.clear()
        self.h.data_received(chunk)

    def answered(self) -> None:
        """aiohttp wrote a request's whole answer."""
        self.open -= 1
        if self.away is not None and not self.open:
            self.leave()

    def leave(self) -> None:
        if self.t is None or self.t.is_closing() or self.open:
            return
        if self.t.get_write_buffer_size():  # an answer is still going out: the next owner must not overtake it
            self.node.loop.call_later(0.002, self.leave)
            return
        fd = os.dup(self.t.get_extra_info("socket").fileno())
        self.node.hand_back(fd, bytes(self.buf), self.away)
        self.buf.clear()
        self.t.close()  # the front (and then the other worker) holds the connection now

    def eof_received(self) -> bool | None:
        if self.away is not None:  # the next owner reads the end of the stream after the bytes carried along
            return True
        return self.h.eof_received()

    def pause_writing(self) -> None:
        self.h.pause_writing()

    def resume_writing(self) -> None:
        self.h.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.t = None
        self.h.connection_lost(exc)


def serve_worker(gw: Any, channel_fd: int) -> None:
    """Serve the gateway ``gw`` on the connections the front passes over ``channel_fd`` (keeping each
    alive while its requests are this worker's, handing it back when one is another's), until the
    front goes away or SIGTERM."""
    chan = socket.socket(fileno=channel_fd)
    index, n = (int(x) for x in chan.recv(64)[1:].split())  # the front wrote it before starting this process
    app = make_app(gw)
    app.on_response_prepare.append(_close_unrouted)
    run_loop(_worker_main(app, chan, _Node(index, n, gw.state_db), web))


async def _close_unrouted(request: Any, response: Any) -> None:
    conn = request.transport.get_protocol() if request.transport is not None else None
    if getattr(conn, "raw", False):  # its next request could be another worker's: not kept
        response.force_close()
        response.headers["Connection"] = "close"  # the hook runs after aiohttp wrote its own Connection header


def _answered_logger() -> tuple[type, Any]:
    """aiohttp's access-log hook, called once a request's whole answer is written: tells the connection."""
    class Answered(AbstractAccessLogger):
        @property
        def enabled(self) -> bool:
            return True

        def log(self, request: Any, response: Any, time: float) -> None:
            t = request.transport
            conn = t.get_protocol() if t is not None else None
            if isinstance(conn, _Conn):
                conn.answered()

    return Answered, logging.getLogger("ledger.gateway.worker")


async def _worker_main(app: Any, chan: socket.socket, node: _Node, web: Any) -> None:
    loop = asyncio.get_running_loop()
    log_class, logger = _answered_logger()
    runner = web.AppRunner(app, access_log_class=log_class, access_log=logger, handle_signals=False,
                           keepalive_timeout=float(os.environ.get("LEDGER_GATEWAY_KEEPALIVE", KEEPALIVE)))
    await runner.setup()
    node.loop, node.chan, node.server = loop, chan, runner.server
    stop = loop.create_future()
    chan.setblocking(False)

    def on_channel() -> None:
        for msg, fds in _messages(chan):
            if not msg and not fds:  # the front is gone
                if not stop.done():
                    stop.set_result(None)
                return
            conn = socket.socket(fileno=fds[0])
            conn.setblocking(False)
            prefix = _read_memfd(fds[1]) if len(fds) > 1 else b""
            loop.create_task(loop.connect_accepted_socket(lambda p=prefix: node.protocol(p), sock=conn))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    loop.add_reader(chan, on_channel)
    chan.send(b"R")  # ready: the front passes connections from now on
    try:
        await stop
    finally:
        loop.remove_reader(chan)
        chan.close()
        await runner.cleanup()
