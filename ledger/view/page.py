"""What every page of the web view shares: the HTTP error page, the read-only database and two read
helpers, the HTML building blocks (escaping, links, tables, a stored value as a person reads it) and the
chrome around them (the layout with its CSS, sortable column heads, the pager, filter selects).

The page modules of :mod:`ledger.view` build on these; nothing here imports them back.
"""

from __future__ import annotations

import dataclasses
import html
import math
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import quote, urlencode

from ledger.algorithms.errors import LedgerError
from ledger.events.validate import format_micros
from ledger.view.lists import DEFAULT_LIMIT

__all__ = ["CSS", "ROUTE_ROWS", "ROUTE_STATES", "SPLIT_NAMES", "ServeError", "esc", "ex_href", "has_table", "jsonable",
           "kv", "layout_page", "link", "micros_date", "num", "pager", "pct", "plain", "q", "read_only", "rows", "select",
           "sort_head", "table", "verdict_cell"]

ROUTE_STATES = ("admitted", "rejected", "unresolved", "dummy")
SPLIT_NAMES = ("train", "dev", "final_test", "reserve", "unassigned")
ROUTE_ROWS = 100  # rows a route page lists itself; the rest on the paged executions list


class ServeError(LedgerError):
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


@contextmanager
def read_only(path: str | Path) -> Iterator[sqlite3.Connection]:
    """The projection database opened read-only (a write raises ``attempt to write a readonly database``)."""
    p = Path(path)
    if not p.exists():
        raise ServeError(503, f"no projection database at {p} yet: run `ledger project` (or start the projector)")
    db = sqlite3.connect(p.resolve().as_uri() + "?mode=ro", uri=True, check_same_thread=False)
    try:
        db.execute("PRAGMA busy_timeout=5000")
        if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'executions'").fetchone() is None:
            raise ServeError(503, f"the projection database {p} has not been built (no executions table): "
                                  "run `ledger project` first")
        yield db
    finally:
        db.close()


def jsonable(obj: Any) -> Any:
    """``obj`` as JSON can hold it: dataclasses as mappings, bytes as hex, a non-finite float as ``None``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.hex()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1f2d3d; }
header { background: #1f2d3d; color: #fff; padding: 0.5em 1em; }
header a { color: #fff; margin-right: 1.2em; text-decoration: none; }
header .ro { float: right; opacity: 0.7; }
main { padding: 0.5em 1.2em 2em; }
table { border-collapse: collapse; margin: 0.4em 0 1em; }
th, td { border: 1px solid #d5dbe1; padding: 2px 7px; text-align: left; vertical-align: top; }
th { background: #f0f3f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font-family: ui-monospace, monospace; font-size: 12px; }
pre { background: #f6f8fa; padding: 0.6em; overflow: auto; }
.ok { color: #1b7f3b; font-weight: 600; } .bad { color: #b3261e; font-weight: 600; }
.muted { color: #6b7785; } .scroll { overflow: auto; border: 1px solid #d5dbe1; max-height: 70vh; }
form.filters label { margin-right: 0.8em; } .bar { background: #4a78a8; height: 0.9em; display: inline-block; }
a.sort { color: inherit; }
table.grid td.cell { text-align: center; min-width: 2.2em; padding: 0; } table.grid td.cell a { display: block; color: #1f2d3d;
  text-decoration: none; padding: 2px 4px; }
.cell.s-admitted.hi { background: #2e8b57; } .cell.s-admitted.hi a { color: #fff; } .cell.s-admitted.lo { background: #a8dcb9; }
.cell.s-dummy { background: #d7ecdf; } .cell.s-rejected { background: #e8c4c0; } .cell.s-unresolved { background: #f5dd9a; }
.cell.s-not-evaluated { background: #eef1f4; } .cell.erased { background: repeating-linear-gradient(45deg, #b3261e 0 3px,
  #f4d4d1 3px 6px); } table.grid td.cell.erased a { color: #fff; font-weight: 700; text-shadow: 0 0 2px #000; }
.legend .cell { display: inline-block; } .pager a { margin-right: 0.6em; }
.error { border-left: 4px solid #b3261e; padding: 0.4em 0.8em; background: #fdf0ef; }
.tag { display: inline-block; font: 600 11px system-ui, sans-serif; padding: 0 0.4em; border-radius: 3px; color: #fff; }
.tag.erased { background: #b3261e; } .tag.withdrawn { background: #8a5a00; }
"""


def sort_head(path: str, doc: dict, query: dict, columns: list[tuple[str, str | None]]) -> list[str]:
    """Header cells; a sortable column links to the list sorted by it (again: the other order)."""
    limit = doc.get("limit")
    keep = {**query, "limit": limit if limit not in (None, DEFAULT_LIMIT) else None}  # a re-sort starts at page 1
    out = []
    for label, key in columns:
        if key is None:
            out.append(esc(label))
            continue
        on = doc.get("sort") == key
        order = "desc" if on and doc.get("order") == "asc" else "asc"
        arrow = (" ▲" if doc.get("order") == "asc" else " ▼") if on else ""
        out.append(f'<a class="sort" href="{esc(q(path, **keep, sort=key, order=order))}">{esc(label)}{arrow}</a>')
    return out


def pager(path: str, doc: dict, query: dict) -> str:
    """``rows a–b of n · page k of m`` with first / previous / next / last links (query kept)."""
    n, page, pages, shown, limit = doc["matching"], doc["page"], doc["pages"], doc["shown"], doc["limit"]
    keep = {**query, "sort": doc.get("sort"), "order": doc.get("order"), "limit": limit}
    first = (page - 1) * limit + 1 if shown else 0
    links = [link(q(path, **keep, page=k), t) if 1 <= k <= pages and k != page else f'<span class="muted">{t}</span>'
             for k, t in ((1, "« first"), (page - 1, "‹ previous"), (page + 1, "next ›"), (pages, "last »"))]
    return (f'<p class="pager" id="pager">rows {first:,}–{first + shown - 1 if shown else 0:,} of <b id="matching">{n:,}</b>'
            f' · page <b id="page">{page:,}</b> of {pages:,} · ' + " ".join(links) + "</p>")


def layout_page(title: str, body: str, json_href: str | None) -> str:
    twin = f' · {link(json_href, "JSON")}' if json_href else ""
    nav = "".join(link(h, t) for h, t in (("/", "Status"), ("/executions", "Executions"), ("/tasks", "Tasks"),
                                           ("/routes", "Routes"),
                                           ("/splits", "Splits"), ("/manifests", "Manifests"),
                                           ("/withdrawals", "Withdrawals"), ("/runs", "Runs"), ("/graders", "Graders"),
                                           ("/campaigns", "Campaigns")))
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)} · ledger</title>'
            f'<link rel="icon" href="data:,"><meta name="viewport" content="width=device-width">'
            f'<style>{CSS}</style></head><body><header>{nav}<span class="ro">read-only view</span></header>'
            f'<main><h1>{esc(title)}</h1><p class="muted">{twin.lstrip(" ·")}</p>{body}</main></body></html>')


def verdict_cell(v: str | None) -> str:
    cls = "ok" if v and v.startswith("pass") else ("bad" if v in ("fail", "rejected") else "")
    return f'<td class="{cls}">{esc(v)}</td>'


def select(name: str, values: list[str], current: str | None, label: str | None = None) -> str:
    os_ = "".join(f'<option value="{esc(v)}"{" selected" if v == current else ""}>{esc(v or "any")}</option>'
                  for v in ["", *values])
    return f'<label>{esc(label or name)} <select name="{esc(name)}">{os_}</select></label>'


def pct(x: Any) -> str:
    return f"{100 * x:.0f} %" if isinstance(x, (int, float)) else "-"


def micros_date(us: Any) -> str | None:
    """Microseconds since the epoch as the log writes a time; ``None`` when ``us`` is not a number."""
    return format_micros(us) if isinstance(us, int) else None
