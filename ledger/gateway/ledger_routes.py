"""The ledger's own routes (SPEC 11.4, ``ledger run``): ``POST /executions/{id}/ledger/open`` opens an
execution (or loads it, if it is on the log already), ``.../ledger/close`` closes it, durable before the
answer; errors in the OpenAI shape."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from ledger.algorithms.identifiers import id_problem
from ledger.events.catalog import key_of
from ledger.gateway.body import utf8
from ledger.gateway.calls import Gateway, GatewayError, _Headers, _strings_utf8
from ledger.gateway.endpoint import error_response, read_json
from ledger.producers.recorder import RecorderError

__all__ = ["close_execution", "open_execution", "register"]


async def open_execution(gw: Gateway, execution_id: str, task_id: Any, deadline: Any) -> str | None:
    """Open ``execution_id`` (or load it, if it is on the log already); its new token when auth is on."""
    if not isinstance(task_id, str) or not isinstance(deadline, str):
        raise GatewayError(400, "opening an execution needs task_id and deadline (strings)")
    if (why := id_problem(execution_id)) is not None:
        raise GatewayError(400, f"execution id: {why}")
    fresh = execution_id not in gw._opened
    await gw.ensure_execution(_Headers(execution_id, "main", "main", "task", "", False, task_id, deadline))
    if fresh:
        gw.metrics.open_executions.inc()
    return await asyncio.to_thread(gw.auth.issue, execution_id) if gw.auth.enabled else None


async def close_execution(gw: Gateway, execution_id: str, status: Any) -> None:
    """Close ``execution_id`` with ``status`` (durable before the answer)."""
    if status not in ("completed", "error", "timeout", "cancelled"):
        raise GatewayError(400, "status must be completed, error, timeout or cancelled", param="status")
    if await asyncio.to_thread(gw.recorder.log.lookup, key_of("execution_opened", execution_id=execution_id)) \
            is None:
        raise GatewayError(404, f"unknown execution {execution_id!r}", "not_found_error")

    def close() -> None:
        gw.recorder.close_execution(execution_id, status)
        gw.recorder.flush()

    try:
        await asyncio.to_thread(close)
    except (ValueError, RecorderError) as exc:
        raise GatewayError(400, f"cannot close execution {execution_id!r}: {exc}") from None
    if execution_id in gw._opened and execution_id not in gw._closed_executions:
        gw.metrics.open_executions.dec()
    gw._closed_executions.add(execution_id)


def _control(gw: Gateway):
    async def control(request: web.Request) -> web.Response:
        ex, action = request.match_info["execution_id"], request.match_info["action"]
        try:
            body = await read_json(request)
            if not isinstance(body, dict) or not _strings_utf8(body) or not utf8(ex):
                raise GatewayError(400, "the request body must be a JSON object of UTF-8 text")
            token = None
            if action == "open":
                token = await open_execution(gw, ex, body.get("task_id"), body.get("deadline"))
            else:
                await close_execution(gw, ex, body.get("status"))
        except GatewayError as exc:
            return error_response(exc)
        answer: dict = {"execution_id": ex, action: True}
        if token is not None:
            answer["token"] = token  # SPEC 12.3: the execution's own credential, shown once, kept hashed
        if action == "open":
            await gw._probe_context()
            if gw.context_length is not None:  # `ledger run` hands it to a harness that asks (Claude Code)
                answer["context_length"] = gw.context_length
        return web.json_response(answer)
    return control


async def _probe(_request: web.Request) -> web.Response:
    """``HEAD /executions/{id}``: the base URL answers (Claude Code probes it before its first call)."""
    return web.Response(status=200)


def register(app: web.Application, gw: Gateway) -> None:
    """``POST /executions/{execution_id}/ledger/{open|close}``; ``HEAD /executions/{execution_id}``."""
    app.router.add_post("/executions/{execution_id}/ledger/{action:open|close}", _control(gw), name="control")
    app.router.add_route("HEAD", "/executions/{execution_id}", _probe)
    app.router.add_route("HEAD", "/executions/{execution_id}/", _probe)
