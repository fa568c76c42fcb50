"""The splits page (``/splits``): ``ledger splits show``, the review queue, ``ledger similarity
candidates`` and, on request (``?check=yes``), ``ledger splits check``."""

from __future__ import annotations

import sqlite3

from starlette.requests import Request

from ledger.log.paths import StorePaths
from ledger.reports.splits_report import candidates, check, show, store_documents
from ledger.view.page import SPLIT_NAMES, ServeError, esc, link, num, pct, plain, q, table
from ledger.view.page import rows as _rows
from ledger.view.request import Answer, Context, Page, params, twin_of


def splits_doc(paths: StorePaths, db: sqlite3.Connection, status: str | None = None, run_check: bool = False) -> dict:
    """``ledger splits show`` and the review queue; with ``run_check`` also ``ledger splits check`` (an
    audit that rebuilds the split state and reads every published member: seconds on a large store,
    so the page runs it on request, ``?check=yes``)."""
    try:
        shown = show(db)
    except ValueError as exc:  # no splits tables
        return {"note": str(exc), "show": None, "check": None, "candidates": [], "leaks": []}
    return {"show": shown, "check": check(db, store_documents(paths, db)).to_json() if run_check else None,
            "candidates": candidates(db, status),
            "leaks": _rows(db, "SELECT * FROM split_leaks ORDER BY group_id, published_group")}


def html_splits(doc: dict) -> str:
    if doc.get("note"):
        return f"<p class='muted'>{esc(doc['note'])}</p>"
    sh, ck = doc["show"], doc["check"]
    pol = sh["policy"]
    parts = [f"<p>split policy: <b>{esc(pol['policy_id'] if pol else 'none in force')}</b>"
             + (" (" + esc(", ".join(f"{k} {pct(v)}" for k, v in sorted(pol["fractions"].items()))) + ")" if pol else "")
             + "".join(f"; {k} <b>{esc(pol[k])}</b>" for k in ("strata", "group_by") if pol and pol.get(k)) + "</p>"]
    if sh.get("strata"):  # quota allocations per stratum (SPEC 11.2)
        parts.append("<h2>Quota allocations per stratum</h2>" + table(
            ["stratum", *SPLIT_NAMES[:4]], [[esc(k), *(num(v[s]) for s in SPLIT_NAMES[:4])]
                                            for k, v in sh["strata"].items()]))
    parts.append("<h2>Groups per split</h2>" + table(
        ["split", "groups", "share", "tasks", "executions", "derived", "quarantined groups"],
        [[link(q("/executions", split=s), s), num(b["groups"]), num(b.get("group_fraction")), num(b["tasks"]),
          num(b["executions"]), num(b["derived"]), num(b["quarantined_groups"])] for s, b in sh["splits"].items()]))
    if ck is None:
        parts.append(f"<h2>Split check</h2><p id='split-check'>{link(q('/splits', check='yes'), 'run the split check')} "
                     "(<code>ledger splits check</code>: rebuilds the split state and reads every published member, "
                     "seconds on a large store)</p>")
    else:
        verdict = "ok: no group spans two splits" if ck["ok"] else f"{len(ck['offenders'])} offender(s)"
        parts.append(f"<h2>Split check</h2><p id='split-check' class='{'ok' if ck['ok'] else 'bad'}'>{esc(verdict)}</p>")
    if ck and ck["offenders"]:
        parts.append(table(["offender"], [[esc(plain(o))] for o in ck["offenders"]]).replace(
            "<table>", '<table id="offenders">', 1))
    parts.append("<h2>Similarity review queue</h2>" + table(
        ["task a", "task b", "estimated Jaccard", "status", "splits", "straddles"],
        [[esc(c["task_a"]), esc(c["task_b"]), num(c["estimated_jaccard"]), esc(c["status"]),
          esc(f"{c['split_a']}/{c['split_b']}"), esc("yes" if c["straddles"] else "no")] for c in doc["candidates"]]))
    parts.append("<h2>Leaks</h2>" + table(["group", "published group", "route", "version", "now in", "reason"],
                                          [[esc(x["group_id"]), esc(x["published_group"]), esc(x["route"]),
                                            num(x["version"]), esc(x["split"]), esc(x["reason"])] for x in doc["leaks"]]))
    return "".join(parts)


def splits(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("status", "check"))
    if p["status"] not in (None, "pending", "linked", "rejected"):
        raise ServeError(400, f"status must be pending, linked or rejected, got {p['status'][:40]!r}")
    if p["check"] not in (None, "yes"):
        raise ServeError(400, f"check must be yes, got {p['check'][:40]!r}")
    doc = splits_doc(ctx.paths, db, p["status"], p["check"] == "yes")
    return "Splits", html_splits(doc), doc, twin_of(request)


ROUTES = [Page("/splits", splits)]
