"""The gateway's HTTP edge (SPEC 12.3): every request passes :func:`guard` (credentials, per-execution
concurrency, metrics, the access log) before its handler, and the probes and ``/metrics`` live here.

- ``GET /healthz``: 200 while the process serves (no credential, says nothing else).
- ``GET /readyz``: 200 when the upstream answers and the log takes appends, else 503 (no credential).
- ``GET /metrics``: the Prometheus text exposition (admin token).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import aiohttp
from aiohttp import web

from ledger.gateway.messages import anthropic_error
from ledger.gateway.auth import request_token
from ledger.gateway.metrics import CONTENT_TYPE_LATEST, refusal_reason

__all__ = ["api_of_path", "error_response", "guard", "probe_routes"]

_OPEN = ("/healthz", "/readyz")
_ADMIN_ROUTES = {"control", "metrics", "policy"}


def api_of_path(path: str) -> str:
    """The API label of a path (metrics, access log); its error shape is Anthropic's for ``messages``, else OpenAI's."""
    if "/v1/messages" in path:
        return "messages"
    if "/v1/responses" in path:
        return "responses"
    if "/ledger/" in path or path == "/metrics":
        return "ledger"  # the control endpoints: OpenAI's error shape, their own metric label
    return "chat"


def error_response(api: str, status: int, message: str, type_: str, headers: dict | None = None) -> web.Response:
    if api == "messages":
        body = anthropic_error(status, message)
    else:
        body = {"error": {"message": message, "type": type_, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)


def _auth_type(status: int) -> str:
    return {401: "authentication_error", 403: "permission_error"}[status]


def _execution_of(request: web.Request, gw: Any) -> str | None:
    return request.match_info.get("execution_id") or request.headers.get("X-Ledger-Execution-Id") or None


def guard(gw: Any) -> Callable:
    """The middleware: refuse what the credentials do not allow, limit concurrent calls per execution,
    count and log every request."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
        if request.path in _OPEN:
            return await handler(request)
        api = api_of_path(request.path)
        stats, token = gw.metrics.begin()
        stats.execution = _execution_of(request, gw)
        status = 500
        try:
            resp = await _guarded(gw, request, handler, api, stats)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            if status >= 400 and stats.refusal is None:
                stats.refusal = refusal_reason(status, None)
            gw.metrics.end(token, stats, api, status)
            gw.access_log.write(stats, api, status, request.method, request.path)

    return middleware


async def _guarded(gw: Any, request: web.Request, handler: Callable, api: str, stats: Any) -> web.StreamResponse:
    name = request.match_info.route.name
    denied = gw.auth.check(request_token(request.headers), stats.execution, admin_only=name in _ADMIN_ROUTES)
    if denied is not None:
        stats.refusal = refusal_reason(denied.status, None)
        headers = {"WWW-Authenticate": "Bearer"} if denied.status == 401 else None
        return error_response(api, denied.status, denied.message, _auth_type(denied.status), headers)
    ex, limit = stats.execution, gw.max_concurrent_per_execution
    if not ex or not limit or request.method != "POST" or name in _ADMIN_ROUTES:
        return await handler(request)
    if gw._running.get(ex, 0) >= limit:
        stats.refusal = "too_many_concurrent"
        return error_response(api, 429, f"execution {ex!r} already has {limit} calls in progress "
                                        "(--max-concurrent-per-execution); retry when one has answered",
                              "rate_limit_error", {"Retry-After": "1"})
    gw._running[ex] = gw._running.get(ex, 0) + 1
    try:
        return await handler(request)
    finally:
        gw._running[ex] -= 1
        if not gw._running[ex]:
            del gw._running[ex]


async def _upstream_answers(gw: Any) -> bool:
    """Any HTTP answer of the upstream (its ``/health``, or a 404 from a server without one) counts."""
    if gw.session is None:
        gw.session = aiohttp.ClientSession()
    try:
        async with gw.session.get(gw.upstream.rstrip("/") + "/health",
                                  timeout=aiohttp.ClientTimeout(total=2.0)) as r:
            return r.status < 500
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False


def probe_routes(app: web.Application, gw: Any) -> None:
    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_request: web.Request) -> web.Response:
        upstream = await _upstream_answers(gw)
        log = not gw.recorder.errors_pending()
        ok = upstream and log
        return web.json_response({"ready": ok, "upstream": upstream, "log": log}, status=200 if ok else 503)

    async def metrics(_request: web.Request) -> web.Response:
        body = await asyncio.to_thread(gw.metrics.exposition)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics, name="metrics")
