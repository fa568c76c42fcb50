"""Collection runs: the list (``/runs``) and one run's task x attempt grid (``/runs/ID``)."""

from __future__ import annotations

import sqlite3
from urllib.parse import quote

from starlette.requests import Request

from ledger.view.lists import RUN_SORTS, run_grid, runs_list
from ledger.view.page import ROUTE_STATES, ServeError, esc, ex_href, link, micros_date, num, pager, q, select, sort_head, table
from ledger.view.request import PAGING, Answer, Context, Page, list_args, params, twin_of


def _cell(c: dict) -> str:
    """A campaign-grid cell: colour by admission state and reward, a mark when erased."""
    st = c["state"] or "not evaluated"
    rw = c["reward"]
    tone = "" if st != "admitted" else (" hi" if isinstance(rw, (int, float)) and rw >= 1 else " lo")
    label = "✕" if c["erased"] else ("-" if rw is None else f"{rw:.2g}")
    title = (f"{c['execution_id']}: {st}" + (f" at {c['predicate']} ({c['reason']})" if c["predicate"] else "")
             + f", reward {'-' if rw is None else f'{rw:.3g}'}" + (", ERASED" if c["erased"] else
                                                                     ", withdrawn" if c["withdrawn"] else ""))
    return (f'<td class="cell s-{esc(st.replace(" ", "-"))}{tone}{" erased" if c["erased"] else ""}">'
            f'<a href="{esc(ex_href(c["execution_id"]))}" title="{esc(title)}">{esc(label)}</a></td>')


def html_run(doc: dict) -> str:
    rid = doc["collection_run_id"]
    pick = " ".join(link(q("/runs/" + quote(rid, safe=""), route=r), r) if r != doc["route"] else f"<b>{esc(r)}</b>"
                    for r in doc["routes"])
    legend = "".join(f'<span class="cell {c}">&nbsp;&nbsp;&nbsp;</span> {esc(t)} ' for c, t in (
        ("s-admitted hi", "admitted, reward ≥ 1"), ("s-admitted lo", "admitted, reward < 1"), ("s-dummy", "dummy"),
        ("s-rejected", "rejected"), ("s-unresolved", "unresolved"), ("s-not-evaluated", "not evaluated"),
        ("erased", "✕ erased")))
    f = doc["filters"]
    path = "/runs/" + quote(rid, safe="")
    form = (f'<form class="filters" method="get" action="{esc(path)}"><input type="hidden" name="route" '
            f'value="{esc(doc["route"] or "")}"><label>task contains <input name="task" value="{esc(f.get("task") or "")}" '
            f'size="14"></label>{select("state", list(ROUTE_STATES), f.get("state"), "an attempt")}'
            f'{select("erased", ["yes", "no"], f.get("erased"), "erased attempts")}<input type="hidden" name="sort" '
            f'value="{esc(doc["sort"])}"><input type="hidden" name="order" value="{esc(doc["order"])}">'
            f'<button type="submit">filter</button></form>')
    query = {k: v for k, v in f.items() if k != "limit" and v is not None}
    query["route"] = doc["route"]
    width = max((len(cells) for cells in doc["tasks"].values()), default=0)
    head = sort_head(path, doc, query, [("task", "task"), ("attempts", "attempts"), ("admitted", "admitted"),
                                        ("best reward", "reward"), ("erased", "erased")])[:1]
    head += [f"attempt {i + 1}" for i in range(width)]
    rows = [[link(q("/executions", task=t), t)] + [_cell(c) for c in cells] + ["<td></td>"] * (width - len(cells))
            for t, cells in doc["tasks"].items()]
    sorts = " ".join(sort_head(path, doc, query, [("attempts", "attempts"), ("admitted", "admitted"),
                                                  ("best reward", "reward"), ("erased attempts", "erased")]))
    return (f"<p>{doc['executions']:,} attempts over {doc['task_count']:,} tasks · admission on route: {pick or 'none'}</p>"
            f'<p class="legend" id="legend">{legend} · cell text: reward · hover: state, blocking check, reward</p>'
            + form + f'<p class="muted">sort tasks by: {sorts}</p>' + pager(path, doc, query)
            + table(head, rows, raw_head=True).replace("<table>", '<table id="grid" class="grid">', 1))


def html_runs(rows: list[dict]) -> str:
    return table(["collection run", "first opened", "attempts", "tasks", "admitted"], [
        [link("/runs/" + quote(r["collection_run_id"], safe=""), r["collection_run_id"]), esc(micros_date(r["first_opened_us"])),
         num(r["executions"]), num(r["tasks"]), num(r["admitted"])] for r in rows]).replace("<table>", '<table id="runs">', 1)


def runs_page(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    params(request, ())
    doc = runs_list(db)
    return "Collection runs", html_runs(doc), doc, twin_of(request)


def run_page(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("route", "task", "state", "erased", *PAGING))
    rid = request.path_params["run_id"]
    if p["state"] is not None and p["state"] not in ROUTE_STATES:
        raise ServeError(400, f"state must be one of {', '.join(ROUTE_STATES)}, got {p['state'][:40]!r}")
    if p["erased"] not in (None, "yes", "no"):
        raise ServeError(400, f"erased must be yes or no, got {p['erased'][:40]!r}")
    doc = run_grid(db, rid, p["route"], {k: p[k] for k in ("task", "state", "erased")},
                   list_args(p, RUN_SORTS, "task"))
    if not doc["executions"]:
        raise ServeError(404, f"no collection run {rid[:200]!r} (see /runs)")
    if p["route"] is not None and p["route"] not in doc["routes"]:
        raise ServeError(400, f"no route {p['route'][:80]!r} has admission rows (routes: {', '.join(doc['routes'])})")
    return f"Collection run {rid}", html_run(doc), doc, twin_of(request)


ROUTES = [Page("/runs", runs_page), Page("/runs/{run_id:path}", run_page)]
