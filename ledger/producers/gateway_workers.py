"""`ledger gateway --workers N` (SPEC §11.4): one port, N gateway processes, calls routed by execution.

The front process owns the listening socket and does no HTTP: it accepts a connection, peeks
(``MSG_PEEK``, nothing consumed) at the request line -- and the headers when the path names no
execution -- to find the execution id (the ``/executions/{id}/...`` path, else the
``X-Ledger-Execution-Id`` header; ``GET /v1/responses/{id}``: the execution ``gateway.db`` files the
response under), and passes the connected socket itself to worker ``sha256(execution id) mod N``
over a Unix socket (``SCM_RIGHTS``). The worker serves that one request on it and closes it
(``Connection: close``), so every request of a connection is routed again: calls of one
execution always reach the same worker (trajectory-affine: its restoration state stays local)
whatever connection pool the harness shares between executions, and the front's cost per call is
an accept, a peek and a ``sendmsg`` -- no second HTTP hop. A request naming no execution goes to
worker 0.

Every worker is a whole gateway (``ledger gateway --worker-channel FD``) with its own recorder
appending to the one store: on the embedded log the writer lock is held for an append only and
each worker's calls that complete together go out as one append with one ``fdatasync`` (group
commit, :meth:`~ledger.producers.recorder.Recorder.wait_durable`); ``gateway.db`` is SQLite in
WAL mode with a busy timeout, safe under N writers. A worker that dies is started again; the
connections that arrive for it meanwhile wait in the front (up to ``HOLD`` seconds, then 503) and
are passed on once it is ready, so a restart costs the harness nothing but the calls that were in
flight on the dead worker: those lose their connection and the SDK retries them (same
``X-Ledger-Request-Id``). Because every acknowledged call was durable (events and restoration
state) before its answer, the new worker rebuilds the execution from ``gateway.db`` and the log,
answers a retry of a call the dead one recorded from the log, and records every other call once,
continuing the same chain.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

__all__ = ["serve_workers", "serve_worker", "worker_of", "worker_argv", "execution_of_head"]

HEAD_MAX = 64 * 1024  # bytes peeked for the request line and headers
HOLD = 120.0  # seconds a connection waits in the front for its worker to (re)start, then 503


def worker_of(execution_id: str | None, n: int) -> int:
    """The worker that serves ``execution_id`` (worker 0 for none)."""
    if not execution_id:
        return 0
    return int.from_bytes(hashlib.sha256(execution_id.encode("utf-8", "surrogatepass")).digest()[:8], "big") % n


def worker_argv(args: Any, channel_fd: int) -> list[str]:
    """The command line of one worker process (the front's own gateway options)."""
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
    return argv


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


def _refuse(conn: socket.socket, index: int) -> None:
    """Answer 503 on a connection the front could not pass on (its worker did not come back)."""
    body = (b'{"error": {"message": "gateway worker %d is not available; retry the call (same '
            b'X-Ledger-Request-Id)", "type": "worker_unavailable", "param": null, "code": 503}}' % index)
    try:
        conn.setblocking(True)
        conn.settimeout(1.0)
        conn.sendall(_UNAVAILABLE % (len(body), body))
    except OSError:
        pass
    conn.close()


class _Worker:
    """One worker process and the Unix channel its connections are passed over."""

    def __init__(self, index: int, args: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.index, self.args, self.loop = index, args, loop
        self.proc: subprocess.Popen | None = None
        self.chan: socket.socket | None = None
        self.ready = False
        self.pending: list[tuple[socket.socket, float]] = []  # connections waiting for it to be ready
        self.stopping = False

    def start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(worker_argv(self.args, child.fileno()), pass_fds=[child.fileno()],
                                         stdout=subprocess.DEVNULL)
        finally:
            child.close()
        parent.setblocking(False)
        self.chan, self.ready = parent, False
        self.loop.add_reader(parent, self._on_channel)

    def _on_channel(self) -> None:
        try:
            data = self.chan.recv(16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.ready = True
            self.flush()
            return
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

    def hand(self, conn: socket.socket) -> None:
        self.pending.append((conn, time.monotonic() + HOLD))
        if self.ready:
            self.flush()

    def flush(self) -> None:
        while self.pending and self.ready:
            conn, _ = self.pending[0]
            try:
                socket.send_fds(self.chan, [b"c"], [conn.fileno()])
            except BlockingIOError:  # the worker is behind: try again shortly
                self.loop.call_later(0.005, self.flush)
                return
            except OSError:  # the worker is going away: its channel's EOF restarts it
                self.ready = False
                return
            self.pending.pop(0)
            conn.close()  # the worker holds it now

    def expire(self, now: float) -> None:
        keep = []
        for conn, deadline in self.pending:
            if deadline < now:
                _refuse(conn, self.index)
            else:
                keep.append((conn, deadline))
        self.pending = keep


class _Front:
    """Accepts connections and passes each to the worker of the execution its request names."""

    def __init__(self, workers: list[_Worker], db_path: Path, loop: asyncio.AbstractEventLoop) -> None:
        self.workers, self.db_path, self.loop = workers, db_path, loop

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
    from ledger.producers.gateway import run_loop

    return run_loop(_serve(args, n, listener, db_path))


async def _serve(args: Any, n: int, listener: socket.socket, db_path: Path) -> int:
    loop = asyncio.get_running_loop()
    workers = [_Worker(i, args, loop) for i in range(n)]
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
def serve_worker(gw: Any, channel_fd: int) -> None:
    """Serve the gateway ``gw`` on the connections the front passes over ``channel_fd``, one request
    each (``Connection: close``: the next request is routed by the front again), until the front
    goes away or SIGTERM."""
    from aiohttp import web

    from ledger.producers.gateway import make_app, run_loop

    app = make_app(gw)

    async def one_request(_request, response) -> None:
        response.force_close()
        response.headers["Connection"] = "close"  # the hook runs after aiohttp wrote its own Connection header

    app.on_response_prepare.append(one_request)
    run_loop(_worker_main(app, socket.socket(fileno=channel_fd), web))


async def _worker_main(app: Any, chan: socket.socket, web: Any) -> None:
    loop = asyncio.get_running_loop()
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    stop = loop.create_future()
    chan.setblocking(False)

    def on_channel() -> None:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(chan, 16, 8)
        except BlockingIOError:
            return
        except OSError:
            msg, fds = b"", []
        for fd in fds:
            conn = socket.socket(fileno=fd)
            conn.setblocking(False)
            loop.create_task(loop.connect_accepted_socket(runner.server, sock=conn))
        if not msg and not fds and not stop.done():  # the front is gone
            stop.set_result(None)

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

