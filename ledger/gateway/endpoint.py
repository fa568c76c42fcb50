"""The HTTP plumbing the protocol modules share: reading a JSON body, an error in a protocol's shape, the
handler of one protocol's call endpoint (headers, adapter, JSON or a stream of server-sent events)."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

from ledger.algorithms.canonical import DuplicateKeyError, loads_unique
from ledger.gateway.calls import Gateway, GatewayError, _Headers
from ledger.gateway.shapes import ApiShapeError
from ledger.gateway.upstream import UpstreamError

__all__ = ["error_document", "error_response", "handler", "openai_error", "read_json", "sse"]

# (status, message, type, param) -> the error document of a protocol
ErrorShape = Callable[[int, str, str, "str | None"], dict]
# (gateway, headers, request body) -> (the body as sent, the protocol's answer)
Adapter = Callable[[Gateway, _Headers, Any], Awaitable[tuple[dict, dict]]]


def openai_error(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def error_document(exc: Exception, shape: ErrorShape = openai_error) -> tuple[int, dict]:
    """(HTTP status, the protocol's error document) of a refused request (``exc.status``, else 400)."""
    status = getattr(exc, "status", 400)
    return status, shape(status, getattr(exc, "message", str(exc)), getattr(exc, "type", "invalid_request_error"),
                         getattr(exc, "param", None))


def error_response(exc: Exception, shape: ErrorShape = openai_error) -> web.Response:
    """A refused request as its protocol's error document."""
    status, body = error_document(exc, shape)
    return web.json_response(body, status=status)


async def read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:  # decompressed size too: aiohttp undoes Content-Encoding
        raise GatewayError(413, f"the request body is larger than the gateway's limit ({exc.text}; "
                                "--max-body-bytes); nothing was recorded", "request_too_large") from None
    except (ContentEncodingError, RequestPayloadError):  # zstd, gzip, deflate (br with brotli) are decoded
        raise GatewayError(400, f"the request body cannot be decoded as its Content-Encoding "
                                f"{request.headers.get('Content-Encoding')!r} says") from None
    try:
        return loads_unique(raw.decode("utf-8"))
    except DuplicateKeyError as exc:  # SPEC 11.7: never "the last one wins"
        raise GatewayError(400, f"the request body is refused: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise GatewayError(400, "the request body is not valid UTF-8 JSON") from None


def sse(event: str | None, data: Any) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


def handler(gw: Gateway, adapt: Adapter, shape: ErrorShape, stream_of: Callable[[dict], list[bytes]]):
    """The aiohttp handler of a protocol's call endpoint: ``adapt`` maps, calls and answers; ``stream_of`` is
    the answer as the protocol's stream (when the body asks for ``stream``); refusals in ``shape``."""
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            h = gw.parse_headers(request.headers, request.match_info.get("execution_id"))
            body, resp = await adapt(gw, h, await read_json(request))
        except (GatewayError, UpstreamError, ApiShapeError) as exc:
            return error_response(exc, shape)
        headers = {"X-Ledger-Request-Id": h.request_id}
        if not body.get("stream"):
            return web.json_response(resp, headers=headers)
        out = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                      "Cache-Control": "no-cache", **headers})
        await out.prepare(request)
        for chunk in stream_of(resp):
            await out.write(chunk)
        await out.write_eof()
        return out
    return handle
