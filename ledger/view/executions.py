"""The executions list, the tasks list, one execution (its prefix tree, decoded conversation with the
loss mask, admission trail per route, assessments, lineage, withdrawals and evidence) and ``/tree/ID``
(``ledger tree ID --json``)."""

from __future__ import annotations

import json
import re
import sqlite3
from urllib.parse import quote

import numpy as np
from starlette.requests import Request

from ledger.projections import governance
from ledger.projections.admission import current_routes, route_definition
from ledger.projections.assessment import execution_score
from ledger.projections.splits import execution_split
from ledger.projections.tree import execution_row, load_tree, request_tool_payloads, tree_json, tree_stats
from ledger.view import text as T
from ledger.view.evidence import execution_evidence, html_execution_evidence
from ledger.view.lists import EXECUTION_SORTS, TASK_SORTS, executions_page, tasks_page
from ledger.view.page import (ROUTE_STATES, SPLIT_NAMES, ServeError, esc, ex_href, jsonable, kv, link, num, pager, q,
                              select, sort_head, table, verdict_cell)
from ledger.view.page import has_table as _has, rows as _rows
from ledger.view.request import PAGING, Answer, Context, Page, list_args, params, twin_of
from ledger.view.text import TEXT_CSS, node_openers
from ledger.view.tree import TREE_CSS, legend_html, token_classes, tree_svg

_ROLE_CLASS = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")


def executions_doc(db: sqlite3.Connection, filters: dict, args) -> dict:
    """The executions list (derived views included): filtered, sorted and paged in SQL
    (:func:`ledger.view.lists.executions_page`)."""
    return executions_page(db, filters, args)


def predicate_trail(definition, row: dict) -> list[dict]:
    """The route's predicates in cascade order with what each said for this execution.

    Evaluation stops at the first non-pass (SPEC §6.5): predicates before it passed, the one
    it stopped at carries the verdict, reason and missing evidence, the rest were not evaluated.
    A route-level check that is not a declared predicate (``capability_gap``, a route's split or
    cap) comes first, carrying the verdict; the declared predicates are then not evaluated."""
    stop, state = row.get("predicate"), row["state"]
    names = [p.name for p in definition.predicates]
    trail = []
    reached = False
    if state != "admitted" and stop and stop not in names:  # a route-level check (capability_gap, split...) blocked it
        trail.append({"predicate": stop, "family": "route check", "depends_on": [], "verdict": row["verdict"],
                      "reason": row.get("reason"), "missing_evidence": row.get("missing_evidence")})
        reached = True
    for p in definition.predicates:
        item = {"predicate": p.name, "family": p.family, "depends_on": list(p.depends_on)}
        if state == "admitted":
            item.update(verdict="pass")
        elif stop is None and state != "dummy":
            item.update(verdict="unknown", reason="the admission row names no predicate")
        elif reached:
            item.update(verdict="not evaluated")
        elif p.name == stop:
            reached = True
            item.update(verdict=row["verdict"], reason=row.get("reason"), missing_evidence=row.get("missing_evidence"))
            if state == "dummy":
                item["verdict"] = "pass (zero-reward dummy)"
        else:
            item.update(verdict="pass")
        trail.append(item)
    return trail


def _admission_of(db: sqlite3.Connection, ex: str) -> list[dict]:
    if not _has(db, "admission"):
        return []
    out = []
    for row in _rows(db, "SELECT * FROM admission WHERE execution_id = ? ORDER BY route", (ex,)):
        try:
            definition = route_definition(db, row["route"], row["route_version"])
        except KeyError:
            definition = None
        paths = _rows(db, "SELECT draw_index, member_id, leaf_request_id, role_class, path_tokens, target_tokens, reward "
                          "FROM admitted_paths WHERE route = ? AND execution_id = ? ORDER BY draw_index", (row["route"], ex))
        verdicts = _rows(db, "SELECT seq, predicate, verdict, verifier, slot_seconds, evidence FROM predicate_verdicts "
                             "WHERE execution_id = ? AND route = ? ORDER BY seq", (ex, row["route"]))
        out.append({**row, "trail": predicate_trail(definition, row) if definition else [], "drawn_paths": paths,
                    "external_verdicts": verdicts})
    return out


def _targets_by_leaf(db: sqlite3.Connection, route: str, ex: str) -> dict:
    return {leaf: np.frombuffer(blob, dtype="<u4") for leaf, blob in db.execute(
        "SELECT leaf_request_id, targets FROM admitted_paths WHERE route = ? AND execution_id = ?", (route, ex))}


def _known_execution(db: sqlite3.Connection, ex: str) -> bool:
    for name, col in (("executions", "execution_id"), ("tree_stats", "execution_id"), ("lineage", "derived_execution_id"),
                      ("assessment_executions", "execution_id")):
        if _has(db, name) and db.execute(f"SELECT 1 FROM {name} WHERE {col} = ?", (ex,)).fetchone():
            return True
    return False


def execution_doc(db: sqlite3.Connection, ex: str) -> dict:
    """Everything the execution page shows; ``tree`` is the ``ledger tree --json`` document."""
    if not _known_execution(db, ex):
        raise ServeError(404, f"no execution {ex!r} in the projection database")
    try:
        stats = tree_stats(db, ex)
        tree = tree_json(db, ex)
    except KeyError:
        stats, tree = None, None
    score = execution_score(db, ex) if _has(db, "execution_scores") else None
    assessments = []
    if _has(db, "assessments"):
        for a in _rows(db, "SELECT * FROM assessments WHERE execution_id = ? ORDER BY seq", (ex,)):
            a["criteria"] = json.loads(a["criteria"]) if a.get("criteria") else []
            assessments.append(a)
    sp, group, quarantined = execution_split(db, ex)
    lineage = {"view_of": governance.lineage_of(db, ex), "chain": governance.lineage_chain(db, ex),
               "derived_views": governance.derived_views(db, ex, transitive=False),
               "all_derived_views": governance.derived_views(db, ex)} if _has(db, "lineage") else None
    withdrawn = governance.withdrawals_covering(db, ex) if _has(db, "withdrawn_executions") else []
    return {"execution_id": ex, "execution": execution_row(db, ex), "tree_stats": stats, "tree": tree,
            "evidence": execution_evidence(db, ex, lineage["chain"] if lineage else [ex]),
            "score": jsonable(score), "assessments": assessments, "split": {"split": sp, "group_id": group,
                                                                           "quarantined": bool(quarantined)},
            "lineage": lineage, "withdrawals": withdrawn, "admission": _admission_of(db, ex)}


def _execution_text(db: sqlite3.Connection, doc: dict, shown: str | None, leaf: str | None, tokenizers,
                    cache) -> tuple[str, str, dict]:
    """The execution page's tree (labelled, each bar linking to its text) and decoded conversation."""
    ex = doc["execution_id"]
    loaded = load_tree(db, ex)
    if leaf is not None and leaf not in loaded.requests:
        raise ServeError(400, f"execution {ex!r} has no request {leaf[:80]!r}")
    adm = next((a for a in doc["admission"] if a["route"] == shown), None)
    drawn = adm["drawn_paths"] if adm else []
    classes = token_classes(loaded, _targets_by_leaf(db, shown, ex) if shown else None)
    tools = request_tool_payloads(db, ex)
    openers = T.node_openers(loaded)
    leaf = leaf or T.default_leaf(loaded, drawn)

    def page(request_id: str | None, anchor: str = "#conversation") -> str:
        return q(ex_href(ex), route=shown, leaf=request_id) + anchor

    svg = tree_svg(loaded, classes, tools, href=lambda nid: page(openers.get(nid), f"#text-{nid}"))
    if leaf is None:
        return svg, '<p class="muted">no request recorded</p>', {"leaf": None}
    row = doc["execution"] or {}
    conv, summary = T.conversation_section(page, loaded, classes, leaf, tokenizers.resolve(row.get("tokenizer")), cache,
                                           tools, shown, adm, drawn)
    return svg, conv, summary


def html_executions(doc: dict, routes: list[str]) -> str:
    f = doc["filters"]
    form = (f'<form class="filters" method="get" action="/executions">'
            f'<label>task <input name="task" value="{esc(f["task"] or "")}" size="14"></label>'
            f'{select("split", list(SPLIT_NAMES), f["split"])}{select("route", routes, f["route"])}'
            f'{select("state", list(ROUTE_STATES), f["state"])}'
            f'{select("role_class", ["main/task", "main/summary", "sub/task", "sub/summary"], f["role_class"])}'
            f'{select("erased", ["yes", "no"], f["erased"])}'
            f'<input type="hidden" name="sort" value="{esc(doc["sort"])}"><input type="hidden" name="order" '
            f'value="{esc(doc["order"])}"><button type="submit">filter</button></form>')
    query = {k: v for k, v in f.items() if k != "limit" and v is not None}
    rows = []
    for e in doc["executions"]:
        adm = ", ".join(f"{r}: {s}" for r, s in e["admission"].items())
        mark = (' <span class="tag erased">erased</span>' if e["erased"] else
                ' <span class="tag withdrawn">withdrawn</span>' if e["withdrawn"] else "")
        rows.append([link(ex_href(e["execution_id"]), e["execution_id"]) + mark, esc(e["task_id"]), esc(e["split"]),
                     num(e["requests"]), num(e["nodes"]), num(e["stored_tokens"]), num(e["expanded_tokens"]),
                     esc(", ".join(e["role_classes"])), esc(e["score_state"]), num(e["reward"]), esc(adm),
                     esc(e["parent_execution_id"])])
    head = sort_head("/executions", doc, query, [
        ("execution", "execution"), ("task", "task"), ("split", "split"), ("requests", "requests"), ("nodes", "nodes"),
        ("stored", "stored"), ("expanded", "expanded"), ("role classes", None), ("score", None), ("reward", "reward"),
        ("admission", None), ("view of", None)])
    return (form + pager("/executions", doc, query) + table(head, rows, raw_head=True).replace(
        "<table>", '<table id="executions">', 1))


def html_tasks(doc: dict) -> str:
    f = doc["filters"]
    form = (f'<form class="filters" method="get" action="/tasks"><label>task contains <input name="task" '
            f'value="{esc(f.get("task") or "")}" size="14"></label><label>source <input name="source" '
            f'value="{esc(f.get("source") or "")}" size="14"></label>{select("split", list(SPLIT_NAMES), f.get("split"))}'
            f'<button type="submit">filter</button></form>')
    query = {k: v for k, v in f.items() if v is not None}
    head = sort_head("/tasks", doc, query, [("task", "task"), ("source", "source"), ("family", None), ("split", "split"),
                                           ("executions", "executions"), ("admitted", "admitted"), ("erased", "erased")])
    rows = [[link(q("/executions", task=t["task_id"]), t["task_id"]), esc(t["source"]), esc(t["family"]), esc(t["split"]),
             num(t["executions"]), num(t["admitted"]),
             f'<td class="num bad">{t["erased"]:,}</td>' if t["erased"] else num(t["erased"])] for t in doc["tasks"]]
    return form + pager("/tasks", doc, query) + table(head, rows, raw_head=True).replace("<table>", '<table id="tasks">', 1)


def html_execution(doc: dict, svg: str | None, shown_route: str | None, conversation: str | None = None) -> str:
    parts = [erased_banner(doc["withdrawals"])]
    st = doc["tree_stats"]
    if st:
        parts.append(f'<p id="tree-stats">requests <b data-k="requests">{st["requests"]:,}</b>, nodes '
                     f'<b data-k="nodes">{st["nodes"]:,}</b>, stored tokens <b data-k="stored_tokens">'
                     f'{st["stored_tokens"]:,}</b>, expanded tokens <b data-k="expanded_tokens">'
                     f'{st["expanded_tokens"]:,}</b>'
                     + (f', ratio {st["ratio"]:.3f}' if st["ratio"] is not None else "") + "</p>")
    row = doc["execution"] or {}
    parts.append(kv({"task": row.get("task_id"), "policy": row.get("policy"), "tokenizer": row.get("tokenizer"),
                     "closed": row.get("closed_status"), "collection run": row.get("collection_run_id"),
                     "split": doc["split"]["split"], "group": doc["split"]["group_id"],
                     "quarantined": "yes" if doc["split"]["quarantined"] else "no"}))
    parts.append("<h2>Prefix tree</h2>" + _tree_section(doc, svg, shown_route, conversation))
    parts.append("<h2>Admission per route</h2>" + _admission_section(doc["admission"]))
    parts.append("<h2>Assessments</h2>" + _assessments_section(doc["score"], doc["assessments"]))
    parts.append("<h2>Lineage</h2>" + _lineage_section(doc["lineage"], doc["withdrawals"]))
    parts.append(html_execution_evidence(doc.get("evidence")))
    return "".join(parts)


def _tree_section(doc: dict, svg: str | None, shown_route: str | None, conversation: str | None) -> str:
    """The execution's prefix tree coloured by the loss mask of ``shown_route``, then its conversation."""
    ex, st = doc["execution_id"], doc["tree_stats"]
    if svg is None:
        return '<p class="muted">no prefix tree (a derived view is materialised from its parent\'s tree)</p>'
    if st and not st["nodes"]:
        return ('<p class="bad" id="tree-erased">no tokens: this execution\'s content was erased</p>'
                if doc["withdrawals"] else '<p class="muted">no request recorded</p>')
    routes = [a["route"] for a in doc["admission"]]
    pick = " ".join(link(q(ex_href(ex), route=r), r) if r != shown_route else f"<b>{esc(r)}</b>" for r in routes)
    out = (f"<style>{TREE_CSS}{TEXT_CSS}</style>" + legend_html(shown_route)
           + (f"<p>loss mask of route: {pick}</p>" if routes else "")
           + f'<div class="scroll">{svg}</div><p class="muted">'
           + link("/tree/" + quote(ex, safe=""), "the tree alone") + " · "
           + link("/api/tree/" + quote(ex, safe=""), "tree JSON (ledger tree --json)") + "</p>")
    return out + (f'<h2 id="conversation">Conversation</h2>{conversation}' if conversation else "")


def _admission_section(admission: list[dict]) -> str:
    """Per route the predicate trail, the drawn paths and the external verdicts."""
    parts = []
    for a in admission:
        parts.append(f'<h3 id="route-{esc(a["route"])}">{esc(a["route"])} v{a["route_version"]}: '
                     f'<span class="{"ok" if a["state"] in ("admitted", "dummy") else "bad"}">{esc(a["state"])}</span>'
                     f'</h3>')
        parts.append(table(["#", "predicate", "family", "verdict", "reason", "missing evidence"],
                           [[num(i + 1), esc(t["predicate"]), esc(t["family"]), verdict_cell(t["verdict"]),
                             esc(t.get("reason")), esc(t.get("missing_evidence"))] for i, t in enumerate(a["trail"])]))
        if a["drawn_paths"]:
            parts.append(table(["draw", "member", "leaf request", "role class", "path tokens", "targets", "reward"],
                               [[num(p["draw_index"]), esc(p["member_id"]), esc(p["leaf_request_id"]),
                                 esc(p["role_class"]), num(p["path_tokens"]), num(p["target_tokens"]), num(p["reward"])]
                                for p in a["drawn_paths"]]))
        if a["external_verdicts"]:
            parts.append(table(["seq", "predicate", "verdict", "verifier", "slot s", "evidence"],
                               [[num(v["seq"]), esc(v["predicate"]), verdict_cell(v["verdict"]), esc(v["verifier"]),
                                 num(v["slot_seconds"]), esc(v["evidence"])] for v in a["external_verdicts"]]))
    if not admission:
        parts.append('<p class="muted">not evaluated on any route</p>')
    return "".join(parts)


def _assessments_section(sc: dict | None, assessments: list[dict]) -> str:
    """The counting state and reward, then every assessment with its criteria."""
    parts = []
    if sc:
        parts.append(f"<p>counting state <b>{esc(sc.get('state'))}</b>, reward <b>{esc(sc.get('reward'))}</b> "
                     f"({esc(sc.get('reason'))})</p>")
    for a in assessments:
        crit = "".join(f"<li>{esc(c.get('name'))}: <b>{esc(c.get('verdict', c.get('outcome')))}</b> "
                       f"<span class='muted'>{esc(c.get('evidence'))}</span></li>" if isinstance(c, dict)
                       else f"<li>{esc(c)}</li>" for c in a["criteria"])
        parts.append(f"<h3>{esc(a['assessment_id'])}</h3>"
                     + kv({k: a[k] for k in ("evaluator", "artifact_version", "branch_request_id", "outcome", "reward",
                                             "status", "conflict")})
                     + (f"<p>criteria:</p><ul>{crit}</ul>" if crit else ""))
    if not assessments:
        parts.append('<p class="muted">no assessment recorded</p>')
    return "".join(parts)


def _lineage_section(lin: dict | None, withdrawals: list[dict]) -> str:
    """Parent, chain and derived views, then the withdrawals covering the execution."""
    parts = []
    if lin:
        view = lin["view_of"]
        if view:
            parts.append(f"<p>derived view of {link(ex_href(view['parent_execution_id']), view['parent_execution_id'])} "
                         f"({esc(view['transformation'])}); chain: "
                         + " ← ".join(link(ex_href(c), c) for c in lin["chain"]) + "</p>")
        else:
            parts.append("<p>original execution (no parent)</p>")
        parts.append("<p>derived views: " + (", ".join(link(ex_href(d), d) for d in lin["all_derived_views"]) or "none")
                     + "</p>")
    if withdrawals:
        parts.append('<h2 id="withdrawals">Withdrawals covering it</h2>' + table(
            ["subject", "reason", "authority", "erased", "event"],
            [[link(q("/withdrawals", subject=w["subject"]), w["subject"]), esc(w["reason"]), esc(w["authority"]),
              esc("yes: tokens shredded" if w["erase"] else "no"), f"<code>{esc(w['event_id'])}</code>"]
             for w in withdrawals]).replace("<table>", '<table id="execution-withdrawals">', 1))
    return "".join(parts)


def erased_banner(withdrawals: list[dict]) -> str:
    """The mark every page puts on a withdrawn or erased execution."""
    if not withdrawals:
        return ""
    erased = any(w["erase"] for w in withdrawals)
    subjects = ", ".join(link(q("/withdrawals", subject=w["subject"]), w["subject"]) for w in withdrawals)
    what = "ERASED: its tokens were shredded" if erased else "WITHDRAWN"
    return f'<p class="error" id="erased-mark"><span class="tag {"erased" if erased else "withdrawn"}">{what}</span> by {subjects}</p>'


def executions(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("task", "split", "route", "state", "role_class", "erased", *PAGING))
    routes = sorted(current_routes(db)) if _has(db, "routes") else []
    if p["split"] is not None and p["split"] not in SPLIT_NAMES:
        raise ServeError(400, f"split must be one of {', '.join(SPLIT_NAMES)}, got {p['split'][:40]!r}")
    if p["state"] is not None and p["state"] not in ROUTE_STATES:
        raise ServeError(400, f"state must be one of {', '.join(ROUTE_STATES)}, got {p['state'][:40]!r}")
    if p["route"] is not None and p["route"] not in routes:
        raise ServeError(400, f"no route {p['route'][:80]!r} (declared: {', '.join(routes) or 'none'})")
    if p["role_class"] is not None and not _ROLE_CLASS.match(p["role_class"]):
        raise ServeError(400, f"role_class must look like main/task (agent tier / turn kind), got {p['role_class'][:40]!r}")
    if p["erased"] not in (None, "yes", "no"):
        raise ServeError(400, f"erased must be yes or no, got {p['erased'][:40]!r}")
    args = list_args(p, EXECUTION_SORTS, "execution")
    filters = {k: p[k] for k in ("task", "split", "route", "state", "role_class", "erased")}
    doc = executions_doc(db, filters, args)
    return "Executions", html_executions(doc, routes), doc, twin_of(request)


def tasks(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("task", "source", "split", *PAGING))
    if p["split"] is not None and p["split"] not in SPLIT_NAMES:
        raise ServeError(400, f"split must be one of {', '.join(SPLIT_NAMES)}, got {p['split'][:40]!r}")
    doc = tasks_page(db, {k: p[k] for k in ("task", "source", "split")}, list_args(p, TASK_SORTS, "task"))
    return "Tasks", html_tasks(doc), doc, twin_of(request)


def execution(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("route", "leaf"))
    ex = request.path_params["execution_id"]
    doc = execution_doc(db, ex)
    admitted = [a["route"] for a in doc["admission"] if a["state"] == "admitted"]
    shown = p["route"] or (admitted[0] if admitted else None)
    if p["route"] is not None and p["route"] not in {a["route"] for a in doc["admission"]}:
        raise ServeError(400, f"execution {ex!r} was not evaluated on route {p['route'][:80]!r}")
    doc["tree_coloured_by_route"] = shown
    svg = conv = None
    if doc["tree"] is not None:
        svg, conv, doc["conversation"] = _execution_text(db, doc, shown, p["leaf"], ctx.tokenizers, ctx.decode_cache)
    return f"Execution {ex}", html_execution(doc, svg, shown, conv), doc, twin_of(request)


def tree(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    params(request, ())
    ex = request.path_params["execution_id"]
    try:
        doc = tree_json(db, ex)
    except KeyError:
        raise ServeError(404, f"no prefix tree for execution {ex!r}") from None
    loaded = load_tree(db, ex)
    openers = node_openers(loaded)
    svg = tree_svg(loaded, token_classes(loaded), href=lambda nid: q(ex_href(ex), leaf=openers.get(nid)) + f"#text-{nid}")
    body = (f"<style>{TREE_CSS}</style><p>{link(ex_href(ex), 'the execution page')} · stored "
            f"{doc['stored_tokens']:,} / expanded {doc['expanded_tokens']:,} tokens</p>{legend_html(None)}"
            f'<div class="scroll">{svg}</div>')
    return f"Prefix tree of {ex}", body, doc, twin_of(request)


ROUTES = [Page("/executions", executions), Page("/tasks", tasks), Page("/executions/{execution_id:path}", execution),
          Page("/tree/{execution_id:path}", tree)]
