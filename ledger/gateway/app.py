"""`ledger gateway`'s HTTP app (SPEC §7.6, 11.4): :func:`make_app` builds it from a
:class:`~ledger.gateway.calls.Gateway` (the shared state and the protocol-neutral call path) and registers
each protocol module's routes, at ``/v1/...`` and under ``/executions/{id}/v1/...``:

* :mod:`ledger.gateway.chat` -- OpenAI Chat Completions,
* :mod:`ledger.gateway.responses` -- OpenAI Responses (its stored responses, ``previous_response_id``),
* :mod:`ledger.gateway.messages` -- Anthropic Messages,
* :mod:`ledger.gateway.ledger_routes` -- the ledger's own ``/executions/{id}/ledger/{open|close}``,

and ``GET /v1/models``.  Middlewares (say auth, metrics, an access log) join in :func:`make_app`'s
``middlewares``, the one place every route passes through.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from aiohttp import web

from ledger.gateway import chat, ledger_routes, messages, responses
from ledger.gateway.edge import guard, probe_routes
from ledger.gateway.calls import Gateway, GatewayError, assemble
from ledger.gateway.serve import event_loop, keep_heap, serve_in_background
from ledger.gateway.store import drift_counts, gateway_db_path

# Gateway, GatewayError, assemble, drift_counts, gateway_db_path, keep_heap, serve_in_background: re-exported for
# the CLI and embedding harnesses (their homes are calls, store and serve)
__all__ = ["Gateway", "GatewayError", "assemble", "drift_counts", "gateway_db_path", "keep_heap", "make_app",
           "run_gateway", "serve_in_background"]

MAX_BODY = 32 * 2**20
GATEWAY_THREADS = 256  # threads for a gateway's blocking steps (make_app's on_startup)
PREFIXES = ("", "/executions/{execution_id}")


def make_app(gw: Gateway, *, middlewares: Sequence[Any] = ()) -> web.Application:
    """The gateway's HTTP app: Chat Completions, Anthropic Messages and OpenAI Responses, each at
    ``/v1/...`` and under ``/executions/{id}/v1/...``, ``GET /v1/models`` and the ledger's routes;
    ``middlewares``: aiohttp middlewares every request passes through, outermost first."""
    app = web.Application(client_max_size=gw.max_body or MAX_BODY, middlewares=[guard(gw), *middlewares])
    probe_routes(app, gw)  # /healthz, /readyz, /metrics (SPEC 12.3)
    ledger_routes.register(app, gw)
    for prefix in PREFIXES:
        app.router.add_get(prefix + "/v1/models", _models(gw))
    chat.register(app, gw, PREFIXES)
    messages.register(app, gw, PREFIXES)
    responses.register(app, gw, PREFIXES)

    async def on_cleanup(_app: web.Application) -> None:
        await gw.close()

    app.on_startup.append(_on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def _models(gw: Gateway):
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": gw.model, "object": "model", "created": 0,
                                                               "owned_by": "ledger-gateway"}]})
    return models


async def _on_startup(_app: web.Application) -> None:
    # asyncio.to_thread's default pool has min(32, cores + 4) threads: 6 on 2 cores.  A call used to hold one
    # while it waited for its batch's fsync (now it waits on the loop, Gateway._durable), and still may while
    # the recorder's queue is full (back-pressure) or an execution loads after a restart: the threads mostly
    # wait, so the pool is sized for the sessions, not the cores
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(GATEWAY_THREADS, "ledger-gateway"))


def run_gateway(gw: Gateway, host: str, port: int) -> None:
    """Serve until interrupted (SIGINT/SIGTERM)."""
    web.run_app(make_app(gw), host=host, port=port, print=lambda *_: None, access_log=None, loop=event_loop())
