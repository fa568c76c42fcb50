"""Admission routes: the list (``/routes``) and one route (``/routes/NAME``: its funnel, unresolved
queue, cascade plan, accounting by role class, admission rows and evidence)."""

from __future__ import annotations

import json
import sqlite3
from urllib.parse import quote

from starlette.requests import Request

from ledger.algorithms.cascade_plan import format_plan
from ledger.corpus.export import accounting
from ledger.projections.admission import cascade_plan, current_routes
from ledger.reports.status_extras import extras
from ledger.view.evidence import html_route_evidence, route_evidence
from ledger.view.page import ROUTE_ROWS, ServeError, esc, ex_href, jsonable, kv, link, num, pct, plain, q, table, verdict_cell
from ledger.view.page import has_table as _has, rows as _rows
from ledger.view.request import Answer, Context, Page, params, twin_of


def routes_doc(db: sqlite3.Connection) -> dict:
    ex = extras(db)
    return {"routes": {name: jsonable(r) for name, r in current_routes(db).items()} if _has(db, "routes") else {},
            "telemetry": ex.get("routes", {}), "accounting": ex.get("accounting", {})}


def route_doc(db: sqlite3.Connection, route: str) -> dict:
    routes = current_routes(db) if _has(db, "routes") else {}
    if route not in routes:
        raise ServeError(404, f"no route {route!r} (declared: {', '.join(sorted(routes)) or 'none'})")
    tel = _rows(db, "SELECT * FROM route_telemetry WHERE route = ?", (route,))
    for t in tel:
        t["rejected_by"], t["unresolved_by"] = json.loads(t["rejected_by"]), json.loads(t["unresolved_by"])
    try:
        plan = cascade_plan(db, route)
        plan_doc, plan_text = jsonable(plan), format_plan(plan)
    except (KeyError, ValueError) as exc:
        plan_doc, plan_text = None, f"no cascade plan: {str(exc).strip(chr(39))}"
    rows, unresolved = _route_rows(db, route), _route_rows(db, route, "unresolved")
    listed = sorted({r["execution_id"] for r in rows["rows"] + unresolved["rows"]})
    return {"route": jsonable(routes[route]), "telemetry": tel[0] if tel else None,
            "funnel": _funnel(tel[0]) if tel else [], "accounting": accounting(db, route),
            "cascade_plan": plan_doc, "cascade_plan_text": plan_text,
            "unresolved": unresolved["rows"], "unresolved_count": unresolved["count"],
            "admission": rows["rows"], "admission_count": rows["count"],
            "listed": f"the first {ROUTE_ROWS} rows by execution id; every row: {q('/api/executions', route=route)}",
            "erased_executions": sorted(r[0] for r in db.execute(
                "SELECT DISTINCT execution_id FROM withdrawn_executions WHERE erase = 1 AND execution_id IN "
                "(SELECT value FROM json_each(?))", (json.dumps(listed),))) if _has(db, "withdrawn_executions") else [],
            **route_evidence(db, routes[route])}


def _route_rows(db: sqlite3.Connection, route: str, state: str | None = None) -> dict:
    """The first ``ROUTE_ROWS`` admission rows of ``route`` (in ``state``) by execution id, and how many there are."""
    where = "route = ?" + (" AND state = ?" if state else "")
    args = (route, state) if state else (route,)
    return {"rows": _rows(db, "SELECT execution_id, state, predicate, verdict, missing_evidence, reason, reward, target_tokens, "
                              f"paths FROM admission WHERE {where} ORDER BY execution_id LIMIT {ROUTE_ROWS}", args),
            "count": db.execute(f"SELECT COUNT(*) FROM admission WHERE {where}", args).fetchone()[0]}


def _funnel(t: dict) -> list[list]:
    return [["evaluated", t["evaluated"]], ["admitted", t["admitted"]], ["dummy", t["dummy"]],
            ["rejected", t["rejected"]], ["unresolved", t["unresolved"]]]


def html_routes(doc: dict) -> str:
    rows = []
    for name, r in doc["routes"].items():
        t = doc["telemetry"].get(name, {})
        rows.append([link("/routes/" + quote(name, safe=""), name), num(r["version"]), esc(r["use"]), esc(r["split"]),
                     num(r["j_max"]), num(t.get("evaluated")), num(t.get("admitted")), num(t.get("dummy")),
                     num(t.get("rejected")), num(t.get("unresolved"))])
    return table(["route", "version", "use", "split", "J_max", "evaluated", "admitted", "dummy", "rejected",
                  "unresolved"], rows)


def cascade_plan_html(plan: dict | None, text: str) -> str:
    """The cascade plan (``ledger admission plan``) as tables: predicates, then declared vs chosen order."""
    if not isinstance(plan, dict):
        return f'<p class="muted">{esc(text)}</p>'
    preds = table(["predicate", "family", "pass rate", "slot seconds", "depends on"], [
        [esc(p.get("name")), esc(p.get("family")), f'<td class="num">{pct(p.get("pass_rate"))}</td>',
         num(p.get("slot_seconds")), esc(", ".join(p.get("depends_on") or []) or "-")] for p in plan.get("predicates") or []])
    orders = table(["order", "predicates (reach)", "route yield", "seconds / attempted", "seconds / admitted"], [
        [esc(k), esc(" → ".join(f"{n} ({pct(r)})" for n, r in zip(o.get("order") or [], o.get("reach") or []))),
         f'<td class="num">{pct(o.get("route_yield"))}</td>', num(o.get("seconds_per_attempted")),
         num(o.get("seconds_per_admitted"))] for k in ("declared", "chosen") if isinstance(o := plan.get(k), dict)])
    saving = (f'<p>method {esc(plan.get("method"))} · saving {esc(plan.get("saving_seconds_per_attempted"))} s per '
              f'attempted execution ({pct(plan.get("saving_fraction"))})</p>')
    return preds + orders + saving


def html_route(doc: dict) -> str:
    r = doc["route"]
    parts = [kv({k: r[k] for k in ("name", "version", "use", "split", "j_max", "role_priority", "consumer",
                                   "evaluation_claim")})]
    parts.append("<h2>Admission funnel</h2>")
    top = max((n for _, n in doc["funnel"]), default=0) or 1
    parts.append(table(["stage", "executions", ""], [[esc(k), num(n), f'<span class="bar" style="width:{200 * n / top:.0f}px">'
                                                      f"</span>"] for k, n in doc["funnel"]]))
    t = doc["telemetry"] or {}
    for key in ("rejected_by", "unresolved_by"):
        if t.get(key):
            parts.append(f"<p>{esc(key.replace('_', ' '))}: " + ", ".join(f"{esc(k)} {esc(plain(v))}" for k, v in t[key].items())
                         + "</p>")
    erased = set(doc.get("erased_executions") or ())
    name = doc["route"]["name"]

    def ex_cell(ex: str) -> str:
        return link(ex_href(ex), ex) + (' <span class="tag erased">erased</span>' if ex in erased else "")

    def more(count: int, **filters: str) -> str:
        extra = count - ROUTE_ROWS
        return (f'<p>… {extra:,} more: {link(q("/executions", route=name, **filters), "the paged executions list")}</p>'
                if extra > 0 else "")

    parts.append(f"<h2>Unresolved queue ({doc['unresolved_count']:,})</h2>")
    parts.append(table(["execution", "predicate", "verdict", "missing evidence", "reason"],
                       [[ex_cell(u["execution_id"]), esc(u["predicate"]), esc(u["verdict"]),
                         esc(u["missing_evidence"]), esc(u["reason"])] for u in doc["unresolved"][:ROUTE_ROWS]])
                 + more(doc["unresolved_count"], state="unresolved"))
    parts.append("<h2>Cascade plan</h2>" + cascade_plan_html(doc["cascade_plan"], doc["cascade_plan_text"]))
    acc = doc["accounting"]
    parts.append("<h2>Accounting by role class</h2>")
    parts.append(table(["role class", "records", "stored tokens", "processed (path)", "processed (tree)", "target tokens"],
                       [[esc(k), num(v.get("records")), num(v.get("stored_tokens")), num(v.get("processed_tokens_path")),
                         num(v.get("processed_tokens_tree")), num(v.get("target_tokens"))]
                        for k, v in (acc.get("by_role_class") or {}).items()]))
    disp = acc.get("dispositions") or {}
    if disp:
        parts.append("<h3>Dispositions</h3>" + table(["disposition", "count"], [
            [esc(k if not isinstance(v, dict) else f"{k}: {kk}"), num(vv)]
            for k, v in disp.items() for kk, vv in (v.items() if isinstance(v, dict) else [(None, v)])]))
    parts.append(f"<h2>Every execution ({doc['admission_count']:,})</h2>")
    parts.append(table(["execution", "state", "stopped at", "verdict", "reason", "targets", "paths"],
                       [[ex_cell(a["execution_id"]), esc(a["state"]), esc(a["predicate"]),
                         verdict_cell(a["verdict"]), esc(a["reason"]), num(a["target_tokens"]), num(a["paths"])]
                        for a in doc["admission"][:ROUTE_ROWS]]) + more(doc["admission_count"]))
    parts.append(html_route_evidence(doc))
    return "".join(parts)


def routes(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    params(request, ())
    doc = routes_doc(db)
    return "Routes", html_routes(doc), doc, twin_of(request)


def route(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    params(request, ())
    doc = route_doc(db, request.path_params["route"])
    return f"Route {doc['route']['name']}", html_route(doc), doc, twin_of(request)


ROUTES = [Page("/routes", routes), Page("/routes/{route:path}", route)]
