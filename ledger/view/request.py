"""What a page handler reads from a request and how the view answers it: the query parameters (each
checked, given once, an integer within SQLite's range), HTML or JSON, the address of the JSON twin, the
error pages, and the headers every response carries.

A page module lists its pages in ``ROUTES`` (:class:`Page`: a path, a handler, its methods); a
handler takes ``(ctx, request, db)`` and returns an :data:`Answer`, and :func:`ledger.view.app.make_app`
serves it under its path and under ``/api``.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple
from urllib.parse import urlencode

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from ledger.log.paths import StorePaths
from ledger.view.lists import ListError, page_args
from ledger.view.page import ServeError, esc, layout_page, link
from ledger.view.text import DecodeCache, Tokenizers

JSON_INDENT = 2
PAGING = ("sort", "order", "page", "limit")
SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                                               "form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
                    "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}
Answer = tuple[str, str, Any, str | None]  # (title, HTML body, the JSON document, the JSON twin's address or None)


@dataclass
class Context:
    """What a handler may use besides the request and the database, one per application: the store's
    paths, the ``--tokenizer`` mappings and the decoded-span cache (execution pages), and the log
    heads' Merkle frontiers kept between requests (the status page)."""

    paths: StorePaths
    tokenizers: Tokenizers
    decode_cache: DecodeCache = field(default_factory=DecodeCache)
    frontiers: dict = field(default_factory=dict)


class Page(NamedTuple):
    """One page of a page module's ``ROUTES``."""

    path: str
    handler: Callable[[Context, Request, sqlite3.Connection], Answer]
    methods: tuple[str, ...] = ("GET",)
    json_only: bool = False  # answers its JSON document whatever the format (the Croissant description)


MAX_INT_PARAM = 2**63 - 1  # SQLite's INTEGER: a larger number cannot name anything stored


def int_param(name: str, value: Any, minimum: int, maximum: int = MAX_INT_PARAM) -> int:
    """Query parameter ``name`` as an integer in ``minimum..maximum`` (400 otherwise)."""
    text = str(value)
    if not re.fullmatch(r"[+-]?[0-9]{1,19}", text.strip()):  # more digits than 2^63-1 has: never a stored number
        raise ServeError(400, f"query parameter {name!r} must be an integer between {minimum} and {maximum}, "
                              f"got {text[:40]!r}{'...' if len(text) > 40 else ''}")
    n = int(text, 10)
    if n < minimum or n > maximum:
        raise ServeError(400, f"query parameter {name!r} must be between {minimum} and {maximum}, got {n}")
    return n


def is_api(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


def is_json(request: Request) -> bool:
    """Does the request want the JSON twin (``?format=json`` or a path under ``/api``)?"""
    fmt = request.query_params.get("format")
    if fmt not in (None, "html", "json"):
        raise ServeError(400, f"format must be html or json, got {fmt[:40]!r}")
    return fmt == "json" or is_api(request.url.path)


def json_response(doc: Any, status: int = 200) -> Response:
    body = json.dumps(doc, indent=JSON_INDENT, sort_keys=True, default=str) + "\n"
    return Response(body, status_code=status, media_type="application/json", headers=SECURITY_HEADERS)


def params(request: Request, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, str | None]:
    """The page's query parameters (``""`` as ``None``); 400 for an unknown, repeated, missing or oversized one."""
    extra = sorted(set(request.query_params.keys()) - set(allowed) - {"format"})
    if extra:
        raise ServeError(400, f"unknown query parameter {extra[0]!r} (this page takes: "
                              f"{', '.join(allowed) or 'none'}; and format=html|json)")
    out: dict[str, str | None] = {}
    for k in allowed:
        vals = request.query_params.getlist(k)
        if len(vals) > 1:
            raise ServeError(400, f"query parameter {k!r} given {len(vals)} times")
        v = vals[0] if vals else None
        out[k] = None if v == "" else v
        if out[k] is not None and ("\x00" in out[k] or len(out[k]) > 4096):
            raise ServeError(400, f"query parameter {k!r} holds a NUL byte or is longer than 4096 characters")
    for k in required:
        if out.get(k) is None:
            raise ServeError(400, f"query parameter {k!r} is required")
    return out


def twin_of(request: Request) -> str:
    """The address of this page's JSON twin (the same query under ``/api``)."""
    qs = [(k, v) for k, v in request.query_params.multi_items() if k != "format"]
    path = request.url.path
    if not is_api(path):
        path = "/api" + (path if path != "/" else "")
    return path + ("?" + urlencode(qs) if qs else "")


def list_args(p: dict, sorts: dict, default: str):
    """The sort, order, page and limit of a list page (:func:`ledger.view.lists.page_args`; 400 when bad)."""
    try:
        return page_args(p, sorts, default, int_param)
    except ListError as exc:
        raise ServeError(400, str(exc)) from None


def error_response(request: Request, status: int, message: str) -> Response:
    """An error as a page, or as JSON ``{"error", "status"}`` where JSON was asked for."""
    try:
        want_json = request.query_params.get("format") == "json" or is_api(request.url.path)
    except Exception:  # noqa: BLE001 - a query string that cannot be parsed
        want_json = False
    if want_json:
        return json_response({"error": message, "status": status}, status)
    title = {400: "Bad request", 404: "Not found", 405: "Method not allowed", 503: "Not available"}.get(
        status, "Error")
    body = f'<p class="error" id="error">{esc(message)}</p><p>{link("/", "back to the status page")}</p>'
    return HTMLResponse(layout_page(f"{status} {title}", body, None), status_code=status, headers=SECURITY_HEADERS)


async def on_serve_error(request: Request, exc: ServeError) -> Response:
    return error_response(request, exc.status, exc.message)


async def on_http(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no page {request.url.path[:200]!r}",
               405: f"{request.method} is not allowed on {request.url.path[:200]!r}: this server is read-only"
               }.get(exc.status_code, str(exc.detail))
    return error_response(request, exc.status_code, message)


async def on_database(request: Request, exc: sqlite3.DatabaseError) -> Response:
    return error_response(request, 503, f"the projection database cannot be read ({exc}); run `ledger audit`")


async def on_other(request: Request, exc: Exception) -> Response:
    return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")


EXCEPTION_HANDLERS = {ServeError: on_serve_error, HTTPException: on_http, sqlite3.DatabaseError: on_database,
                      Exception: on_other}
