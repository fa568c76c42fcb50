"""`ledger gateway --workers N` (SPEC §11.4): one port, N gateway processes, calls routed by execution.

The front process listens on ``--listen`` and forwards each request, unchanged, to worker
``sha256(execution id) mod N`` over that worker's Unix socket (the execution id from the
``/executions/{id}/...`` path or the ``X-Ledger-Execution-Id`` header): calls of one execution
always reach the same worker, so its restoration state stays local (trajectory-affine). A
request naming no execution goes to worker 0; ``GET /v1/responses/{id}`` to the worker of the
execution ``gateway.db`` files the response under. Responses (event streams included) are
relayed as they arrive.

Every worker is a whole gateway (``ledger gateway --worker-socket PATH``) with its own recorder
appending to the one store: on the embedded log the writer lock is held for an append only and
each worker's calls that complete together go out as one append with one ``fdatasync`` (group
commit, :meth:`~ledger.producers.recorder.Recorder.wait_durable`); ``gateway.db`` is SQLite in
WAL mode with a busy timeout, safe under N writers. A worker that dies is started again; while
it is down its calls are answered 503 (the SDKs retry), and because every acknowledged call was
durable before its answer, the retried call (same ``X-Ledger-Request-Id``) is answered from the
log by the new process and recorded once.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["serve_workers", "worker_of", "worker_argv"]

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer",
        "proxy-connection"}


def worker_of(execution_id: str | None, n: int) -> int:
    """The worker that serves ``execution_id`` (worker 0 for none)."""
    if not execution_id:
        return 0
    return int.from_bytes(hashlib.sha256(execution_id.encode("utf-8", "surrogatepass")).digest()[:8], "big") % n


def worker_argv(args: Any, socket_path: str) -> list[str]:
    """The command line of one worker process (the front's own gateway options)."""
    argv = [sys.executable, "-m", "ledger.cli"]
    for flag, value in (("--store", args.store), ("--db", args.db), ("--trust", getattr(args, "trust", None))):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["gateway", "--upstream", args.upstream, "--api", args.api, "--tokenizer", args.tokenizer,
             "--timeout", str(args.timeout), "--max-tokens", str(args.max_tokens), "--worker-socket", socket_path]
    for flag, value in (("--chat-template", args.chat_template), ("--tool-parser", args.tool_parser),
                        ("--model", args.model)):
        if value is not None:
            argv += [flag, value]
    for t in args.stop_token or ():
        argv += ["--stop-token", str(t)]
    return argv


def _execution_of(request, db_path: Path) -> str | None:
    ex = request.match_info.get("execution_id") or request.headers.get("X-Ledger-Execution-Id")
    if ex:
        return ex
    parts = request.path.strip("/").split("/")
    if request.method == "GET" and parts[:2] == ["v1", "responses"] and len(parts) == 3 and db_path.exists():
        try:
            db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
            try:
                row = db.execute("SELECT execution_id FROM responses WHERE response_id = ?", (parts[2],)).fetchone()
            finally:
                db.close()
            return row[0] if row else None
        except sqlite3.Error:
            return None
    return None


class _Worker:
    def __init__(self, index: int, argv: list[str], socket_path: str) -> None:
        self.index, self.argv, self.socket = index, argv, socket_path
        self.proc: subprocess.Popen | None = None
        self.session: Any = None

    def start(self) -> None:
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL)

    def ready(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and os.path.exists(self.socket)


def serve_workers(args: Any, n: int, host: str, port: int, db_path: Path) -> int:
    """Run the front on ``host:port`` and ``n`` workers until interrupted (``db_path``: the gateway.db)."""
    from aiohttp import web

    tmp = tempfile.mkdtemp(prefix="ledger-gateway-")
    workers = [_Worker(i, worker_argv(args, os.path.join(tmp, f"w{i}.sock")), os.path.join(tmp, f"w{i}.sock"))
               for i in range(n)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 120
    while not all(w.ready() for w in workers):
        if any(w.proc.poll() is not None for w in workers) or time.monotonic() > deadline:
            for w in workers:
                w.proc.kill()
            print("ledger gateway: a worker did not start", file=sys.stderr)
            return 2
        time.sleep(0.05)

    async def forward(request: web.Request) -> web.StreamResponse:
        import aiohttp

        w = workers[worker_of(_execution_of(request, db_path), n)]
        if not w.ready():
            return _unavailable(request, w.index)
        if w.session is None:
            w.session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=w.socket),
                                              timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            async with w.session.request(request.method, "http://worker" + request.path_qs, headers=headers,
                                         data=await request.read()) as up:
                out = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                    if k.lower() not in _HOP})
                await out.prepare(request)
                async for chunk in up.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, ConnectionError):
            return _unavailable(request, w.index)

    async def supervise(_app) -> Any:
        async def loop() -> None:
            while True:
                await asyncio.sleep(0.2)
                for w in workers:
                    if w.proc.poll() is not None:  # died (say SIGKILL): start it again on the same socket
                        print(f"ledger gateway: worker {w.index} exited ({w.proc.returncode}); restarting",
                              file=sys.stderr, flush=True)
                        if w.session is not None:
                            await w.session.close()
                            w.session = None
                        w.start()
        task = asyncio.get_running_loop().create_task(loop())
        yield
        task.cancel()
        for w in workers:
            if w.session is not None:
                await w.session.close()

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_route("*", "/executions/{execution_id}/{tail:.*}", forward)
    app.router.add_route("*", "/{tail:.*}", forward)
    app.cleanup_ctx.append(supervise)
    print(f"ledger gateway: http://{host}:{port}/v1 -> {args.api} {args.upstream} ({n} workers)", flush=True)
    try:
        web.run_app(app, host=host, port=port, print=lambda *_: None, access_log=None)
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.terminate()
        for w in workers:
            try:
                w.proc.wait(10)
            except subprocess.TimeoutExpired:
                w.proc.kill()
    return 0


def _unavailable(request, index: int):
    from aiohttp import web

    msg = f"gateway worker {index} is restarting; retry the call (same X-Ledger-Request-Id)"
    if request.path.endswith("/v1/messages"):
        body = {"type": "error", "error": {"type": "overloaded_error", "message": msg}}
    else:
        body = {"error": {"message": msg, "type": "worker_unavailable", "param": None, "code": 503}}
    return web.json_response(body, status=503, headers={"Retry-After": "1"})
