"""The withdrawals page (``/withdrawals``): the withdrawals on the log and, for ``?subject=S``,
``ledger impact S --json`` with the publications before and after it."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from starlette.requests import Request

from ledger.corpus.publish import archive_path
from ledger.corpus.withdraw import check_subject
from ledger.events.catalog import key_of
from ledger.log import open_log
from ledger.log.paths import StorePaths
from ledger.projections.governance import impact
from ledger.projections.manifests import published_manifests
from ledger.view.lists import WITHDRAWAL_SORTS, withdrawals_page
from ledger.view.manifests import archived_document
from ledger.view.page import ROUTE_ROWS, ServeError, esc, ex_href, link, num, pager, q, sort_head, table
from ledger.view.page import has_table as _has, rows as _rows
from ledger.view.request import PAGING, Answer, Context, Page, list_args, params, twin_of


def withdrawals_doc(paths: StorePaths, db: sqlite3.Connection, subject: str | None, args) -> dict:
    """The withdrawals on the log (a sorted page, with dates and the executions each covers) and,
    for ``subject``, ``ledger impact SUBJECT --json`` plus the publications before and after it."""
    listed = withdrawals_page(db, args)
    ws = _rows(db, "SELECT * FROM withdrawals WHERE subject = ? ORDER BY occurred_at, event_id", (subject,)) \
        if subject is not None and _has(db, "withdrawals") else []
    out: dict = {**listed, "subject": subject, "impact": None, "publications": []}
    if subject is None:
        return out
    try:
        check_subject(subject)
    except ValueError as exc:
        raise ServeError(400, str(exc)) from None
    shas: dict[int, str | None] = {}  # the archives as read (and hashed) once by archived_document

    def load(row: dict) -> dict | None:
        doc, sha, _why = archived_document(paths, archive_path(paths, row["route"], row["version"]))
        shas[id(doc)] = sha
        return doc

    rep = impact(db, subject, load, lambda doc: shas[id(doc)])
    out["impact"] = rep
    at = _withdrawal_positions(paths, ws)
    touched = {(m["route"], m["version"]): len(m["members"]) for m in rep.get("manifests", [])}
    for row in (published_manifests(db) if _has(db, "manifests") else []):
        when = _before_or_after(row["log_position"], at)
        out["publications"].append({"route": row["route"], "version": row["version"], "size": row["size"],
                                    "subject_members": touched.get((row["route"], row["version"]), 0),
                                    "published": when})
    return out


def _withdrawal_positions(paths: StorePaths, withdrawals: list[dict]) -> dict[str, int]:
    """``{"stream:partition": offset}`` of the earliest of ``withdrawals`` on the log."""
    out: dict[str, int] = {}
    if not withdrawals:
        return out
    with open_log(paths.url) as log:
        for w in withdrawals:
            rec = log.lookup(key_of("withdrawal", subject=w["subject"], erase=bool(w["erase"])))
            if rec is not None:
                where = f"{rec.stream}:{rec.partition}"
                out[where] = min(out.get(where, rec.offset), rec.offset)
    return out


def _before_or_after(log_position: Any, withdrawn: dict[str, int]) -> str | None:
    """Was a manifest built at ``log_position`` (an int, or ``{"stream:partition": next offset}``)
    before or after the withdrawal at ``withdrawn``?  ``None``: not withdrawn, or not comparable."""
    if not withdrawn:
        return None
    if isinstance(log_position, str):
        try:
            log_position = json.loads(log_position)
        except ValueError:
            return None
    if isinstance(log_position, int) and len(withdrawn) == 1:
        return "after" if log_position > next(iter(withdrawn.values())) else "before"
    if isinstance(log_position, dict):
        for where, offset in withdrawn.items():
            if where in log_position:
                return "after" if int(log_position[where]) > offset else "before"
    return None


def html_withdrawals(doc: dict) -> str:
    parts = [f'<form method="get" action="/withdrawals"><label>subject <input name="subject" size="40" '
             f'value="{esc(doc["subject"] or "")}" placeholder="source:ID, task:ID, execution:ID or *"></label> '
             f'<button type="submit">impact</button></form>']
    query = {"subject": doc["subject"]} if doc["subject"] else {}
    head = sort_head("/withdrawals", doc, query, [("date", "date"), ("subject", "subject"), ("reason", None),
                                                 ("authority", None), ("executions covered", "executions"),
                                                 ("erased", "erased"), ("event", None)])
    parts.append("<h2>Withdrawals on the log</h2>" + pager("/withdrawals", doc, query) + table(head, [
        [esc(w["date"]), link(q("/withdrawals", subject=w["subject"]), w["subject"]), esc(w["reason"]), esc(w["authority"]),
         link(q("/executions", erased="yes"), f"{w['executions']:,}") if w["erase"] and w["executions"] else num(w["executions"]),
         '<td><span class="tag erased">erased</span></td>' if w["erase"] else "no", f"<code>{esc(w['event_id'])}</code>"]
        for w in doc["withdrawals"]], raw_head=True).replace("<table>", '<table id="withdrawals">', 1))
    rep = doc["impact"]
    if rep is not None:
        parts.append(f"<h2>Impact of {esc(rep['subject'])}</h2><p class='{'bad' if rep['withdrawn'] else ''}'>"
                     f"{'withdrawn' if rep['withdrawn'] else 'not withdrawn'}</p>")
        parts.append(table(["covers", "count", ""], [
            [esc(label), num(len(ids)), ", ".join(link(href(x), x) for x in ids[:40]) + (" …" if len(ids) > 40 else "")]
            for label, ids, href in (("tasks", rep["tasks"], lambda t: q("/executions", task=t)),
                                     ("executions", rep["executions"], ex_href),
                                     ("derived views", rep["derived_views"], ex_href))]
            + [["manifest members touched", num(rep["members"]), ""]]))
        parts.append("<h3>Publications before and after</h3>" + table(
            ["publication", "members", "members of the subject", "published"],
            [[link(q("/manifests/view", route=p["route"], version=p["version"]), f"{p['route']} v{p['version']}"),
              num(p["size"]), num(p["subject_members"]),
              esc({"before": "before the withdrawal", "after": "after the withdrawal"}.get(p["published"] or "", "-"))]
             for p in doc["publications"]]))
        for m in rep.get("manifests", []):
            shown = m["members"][:ROUTE_ROWS]
            rest = len(m["members"]) - len(shown)
            parts.append(f"<h3>{esc(m['route'])} v{m['version']}: {len(m['members']):,} members</h3>" + table(
                ["member", "execution"], [[esc(x["member_id"]), link(ex_href(x["execution_id"]), x["execution_id"])]
                                          for x in shown])
                + (f"<p>… {rest:,} more on " + link(q("/manifests/view", route=m["route"], version=m["version"]),
                                                    "the publication's member list") + "</p>" if rest > 0 else ""))
        for u in rep.get("unverifiable_manifests", []):
            parts.append(f"<p class='bad'>{esc(u['route'])} v{u['version']}: cannot list members: {esc(u['why'])}</p>")
    return "".join(parts)


def withdrawals(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("subject", *PAGING))
    doc = withdrawals_doc(ctx.paths, db, p["subject"], list_args(p, WITHDRAWAL_SORTS, "date"))
    return "Withdrawals", html_withdrawals(doc), doc, twin_of(request)


ROUTES = [Page("/withdrawals", withdrawals)]
