"""A tiny asyncio TCP proxy for fault tests: forwards a local port to the broker and can cut
every connection on demand (a broker "disconnect" as the client sees it)."""

from __future__ import annotations

import asyncio
import socket
import threading


class TcpProxy:
    """``TcpProxy(upstream_port)`` listens on ``self.port`` (127.0.0.1) and forwards to the upstream.

    ``cut()`` closes every open connection; ``lose_answers(s)`` drops the broker's answers for
    ``s`` seconds and then cuts (requests were served, acknowledgements lost: the client
    retries); ``down(True)`` makes new connections fail at once until ``down(False)``.
    """

    def __init__(self, upstream_port: int, port: int | None = None, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        self.port = port
        self.cuts = 0
        self.connections = 0
        self._down = False
        self._blackhole = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._down:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            downstream = dst is writer
            try:
                while True:
                    data = await src.read(65536)
                    if not data:
                        break
                    if downstream and self._blackhole:
                        continue  # the broker did the work; its answer is lost
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError, asyncio.CancelledError):
                pass
            finally:
                for w in (dst, writer, up_writer):
                    self._writers.discard(w)
                    try:
                        w.close()
                    except Exception:  # noqa: BLE001
                        pass

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        except asyncio.CancelledError:  # closing the proxy: end quietly
            pass

    def cut(self) -> None:
        """Close every connection now (both directions)."""
        def _cut() -> None:
            self.cuts += 1
            for w in list(self._writers):
                try:
                    w.transport.abort()
                except Exception:  # noqa: BLE001
                    pass
            self._writers.clear()
        self._loop.call_soon_threadsafe(_cut)

    def lose_answers(self, seconds: float) -> None:
        """Forward requests but drop every broker answer for ``seconds``, then cut every
        connection: the broker has appended what the client will send again."""
        import time

        self._blackhole = True
        time.sleep(seconds)
        self.cut()
        self._blackhole = False

    def down(self, flag: bool) -> None:
        self._down = flag
        if flag:
            self.cut()

    def close(self) -> None:
        async def _stop() -> None:
            self._server.close()
            for w in list(self._writers):
                try:
                    w.transport.abort()
                except Exception:  # noqa: BLE001
                    pass
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(_stop(), self._loop).result(5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
