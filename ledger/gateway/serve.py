"""Running a gateway process: its event loop (:func:`event_loop`, :func:`run_loop`), its heap
(:func:`keep_heap`), and an aiohttp app served on a thread of its own (:func:`serve_in_background`)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from typing import Any

from aiohttp import web

__all__ = ["event_loop", "keep_heap", "run_loop", "serve_in_background"]


def event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop for a gateway process: asyncio's, or uvloop's with ``LEDGER_GATEWAY_LOOP=uvloop`` when it
    can be imported (measured no cheaper per turn on the 2-core machine, benchmarks/RESULTS.md "Gateway CPU per
    turn, third round": kept as an opt-in for benchmarks on other machines)."""
    if os.environ.get("LEDGER_GATEWAY_LOOP", "").lower() == "uvloop":
        try:
            import uvloop  # optional, an opt-in for benchmarks (not a dependency)
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_loop(coro) -> Any:
    """``asyncio.run(coro)`` on :func:`event_loop`'s loop."""
    with asyncio.Runner(loop_factory=event_loop) as runner:
        return runner.run(coro)


HEAP_KEPT = 64 * 2**20  # bytes of freed heap a gateway process keeps mapped (keep_heap)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_heap() -> bool:
    """Let a gateway process reuse the pages of its large buffers (glibc; ``LEDGER_GATEWAY_MALLOC=default`` leaves
    malloc as it is).  Each turn's O(context) buffers (the request's bytes and text, its parsed strings, the prompt's
    array, the upstream body) are a little larger than the last turn's, so under glibc's adaptive thresholds each
    came from a fresh mmap, faulted in page by page and unmapped when freed (at 80k tokens of context some 150 page
    faults a turn, a quarter of the gateway's kernel time per turn).  Served from the heap instead (up to 32 MiB a
    buffer), with up to :data:`HEAP_KEPT` bytes of freed heap kept mapped, they reuse pages already there.  True when
    set."""
    if os.environ.get("LEDGER_GATEWAY_MALLOC", "").lower() == "default":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt (not glibc): its allocator as it is
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)) and bool(mallopt(_M_TRIM_THRESHOLD, HEAP_KEPT))


def serve_in_background(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0):
    """Serve an aiohttp ``app`` (say ``make_app(gw)``, to embed the gateway in a harness process) on
    its own thread and event loop; ``port=0`` picks a free port.  Returns ``(url, stop)``; ``stop()``
    shuts the server down and joins the thread."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        loop = event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(app, access_log=None)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
        except OSError as exc:  # the address is taken or not ours: reported to the caller
            box["error"] = exc
            ready.set()
            return
        box["port"], box["loop"] = site._server.sockets[0].getsockname()[1], loop
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(timeout):
        raise RuntimeError(f"the server on {host}:{port} did not start within {timeout:g} s")
    if "error" in box:
        raise box["error"]

    def stop() -> None:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        thread.join(10)

    return f"http://{host}:{box['port']}", stop
