"""What every page of the web view shares: the HTTP error page, two read helpers and the HTML
building blocks (escaping, links, tables, a stored value as a person reads it).

The page modules of :mod:`ledger.view` build on these; nothing here imports them back.
"""

from __future__ import annotations

import html
import sqlite3
from typing import Any
from urllib.parse import quote, urlencode

__all__ = ["ServeError", "esc", "ex_href", "has_table", "kv", "link", "num", "plain", "q", "rows", "table"]


class ServeError(Exception):
    """An HTTP error page: 400 bad query, 404 unknown id, 405, 503 no database."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def has_table(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is not None


def rows(db: sqlite3.Connection, sql: str, args: tuple = ()) -> list[dict]:
    cur = db.execute(sql, args)
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur]


def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x))


def num(x: Any) -> str:
    if x is None:
        return '<td class="num muted">-</td>'
    if isinstance(x, float):
        return f'<td class="num">{x:,.4g}</td>'
    return f'<td class="num">{x:,}</td>' if isinstance(x, int) else f'<td class="num">{esc(x)}</td>'


def link(href: str, text: Any) -> str:
    return f'<a href="{esc(href)}">{esc(text)}</a>'


def ex_href(ex: str) -> str:
    return "/executions/" + quote(ex, safe="")


def q(path: str, **params: Any) -> str:
    return path + "?" + urlencode({k: v for k, v in params.items() if v is not None})


def table(head: list[str], rows: list[list[str]], *, raw_head: bool = False) -> str:
    """``rows`` hold ready ``<td>`` cells (or plain text, escaped); ``raw_head``: ``head`` is HTML."""
    if not rows:
        return '<p class="muted">none</p>'
    cells = "".join(f"<th>{h if raw_head else esc(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{cells}</tr>{body}</table>"


def plain(v: Any) -> str:
    """A stored value as a person reads it: lists joined, mappings as ``key value; ...``, numbers with
    thousands separators, booleans yes/no (never JSON syntax on an HTML page)."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(plain(x) for x in v) or "none"
    if isinstance(v, dict):
        return "; ".join(f"{k} {plain(x)}" for k, x in v.items()) or "none"
    return str(v)


def kv(d: dict) -> str:
    return table(["field", "value"], [[esc(k), esc(plain(v))] for k, v in d.items()])
