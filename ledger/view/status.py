"""The status page (``/``): ``ledger status --json`` as its JSON twin."""

from __future__ import annotations

import sqlite3
from urllib.parse import quote

from starlette.requests import Request

from ledger.log import open_log
from ledger.log.paths import StorePaths
from ledger.reports.status import status
from ledger.view.page import esc, kv, link, num, plain, table
from ledger.view.request import Answer, Context, Page, params, twin_of


def status_doc(paths: StorePaths, db: sqlite3.Connection, frontiers: dict | None = None) -> dict:
    """``ledger status --json``, reading ``db``; ``frontiers``: the log heads' Merkle frontiers the
    server keeps between requests (only the events appended since are hashed)."""
    with open_log(paths.url) as log:
        return status(log, paths, db=db, frontiers=frontiers)


def html_status(doc: dict) -> str:
    log = doc["log"]
    parts = [f"<p class='bad'>problem: {esc(p)}</p>" for p in doc.get("problems", ())]
    parts.append(f"<h2>Log</h2>{kv({'url': log['url'], 'events': log['events'], 'conflicts': log['conflicts']})}")
    parts.append(table(["partition", "size", "root"], [[esc(k), num(v["size"]), f"<code>{esc(v['root'])}</code>"]
                                                       for k, v in log["head"].items()]))
    proj = doc.get("projections", {})
    parts.append(f"<h2>Projections</h2><p>behind the log: <b>{esc(plain(proj.get('behind')))}</b> events</p>")
    if "trees" in doc:
        parts.append("<h2>Trees</h2>" + kv(doc["trees"]))
    if "scores" in doc:
        parts.append("<h2>Scores</h2>" + kv(doc["scores"]))
    if doc.get("routes"):
        parts.append("<h2>Routes</h2>" + table(
            ["route", "evaluated", "admitted", "dummy", "rejected", "unresolved"],
            [[link("/routes/" + quote(r, safe=""), r), num(t["evaluated"]), num(t["admitted"]), num(t["dummy"]),
              num(t["rejected"]), num(t["unresolved"])] for r, t in doc["routes"].items()]))
    if proj.get("tables"):
        parts.append("<details><summary>tables</summary>" + kv(proj["tables"]) + "</details>")
    return "".join(parts)


def home(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    params(request, ())
    doc = status_doc(ctx.paths, db, ctx.frontiers)
    return "Store status", html_status(doc), doc, twin_of(request)


ROUTES = [Page("/", home)]
