"""Published manifests: the list, one publication (datasheet, members, "k of n withdrawn since"), its
Croissant description, ``ledger manifest verify --deep`` (``POST /manifests/verify``), ``prove`` and
``diff``."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any
from urllib.parse import quote

from starlette.requests import Request

from ledger.corpus.archive_cache import document, summary
from ledger.corpus.manifest import ManifestError
from ledger.corpus.publish import PublishError, archive_path, croissant, diff_files, prove_document, verify_file
from ledger.log.paths import StorePaths
from ledger.projections.manifests import manifest_row, published_manifests
from ledger.view.page import ServeError, esc, ex_href, kv, link, micros_date, num, pager, pct, plain, q, table
from ledger.view.page import has_table as _has
from ledger.view.request import Answer, Context, Page, int_param, params, twin_of


def manifests_doc(paths: StorePaths, db: sqlite3.Connection) -> dict:
    """Every publication with its date and how many of its members were withdrawn since."""
    out = []
    for m in (published_manifests(db) if _has(db, "manifests") else []):
        ids = summary(archive_path(paths, m["route"], m["version"]), paths.archive_cache).execution_ids
        out.append({**m, "published_at": micros_date(m.get("published_at_us")),
                    "withdrawn_since": withdrawn_of(db, ids)["count"] if ids is not None else None})
    return {"manifests": out}


def archived_document(paths: StorePaths, path: Path) -> tuple[Any, str | None, str | None]:
    """``(document, document_sha256, problem)`` of an archived manifest as its bytes are now
    (:mod:`ledger.corpus.archive_cache` parses and hashes each version once); callers must not
    change the document."""
    doc, found = document(path, paths.archive_cache)
    return doc, found.document_sha256, found.problem


def _publication(paths: StorePaths, db: sqlite3.Connection, route: str, version: str | int) -> tuple[dict, Path]:
    v = int_param("version", version, 1)
    row = manifest_row(db, route, v) if _has(db, "manifests") else None
    if row is None:
        raise ServeError(404, f"no publication of route {route!r} version {v} is recorded")
    return row, Path(archive_path(paths, route, v))


def manifest_doc(paths: StorePaths, db: sqlite3.Connection, route: str, version: str) -> dict:
    row, path = _publication(paths, db, route, version)
    doc, sha, why = archived_document(paths, path)
    if why is None and sha != row["manifest_sha256"]:
        why = "the archived document does not match the manifest_sha256 on the log"
    return {"publication": {**row, "published_at": micros_date(row.get("published_at_us"))}, "archive": str(path),
            "authenticated": why is None, "problem": why, "manifest": doc,
            "withdrawn_since": withdrawn_members(db, doc.get("members") if isinstance(doc, dict) else None)}


def _position(p: Any) -> Any:
    """A log position as stored (an offset, or JSON ``{"stream:partition": offset}``) as a value."""
    if isinstance(p, str):
        try:
            return json.loads(p)
        except ValueError:
            return p
    return p


def withdrawn_members(db: sqlite3.Connection, members: Any) -> dict:
    """Members of a publication whose execution a withdrawal covers now: ``{"count", "of",
    "executions": {execution_id: {"erased", "subjects"}}}`` (a withdrawal after publishing never
    changes the manifest; it tells a trainer what to drop)."""
    members = [m for m in members if isinstance(m, dict)] if isinstance(members, list) else []
    return withdrawn_of(db, [str(m.get("execution_id")) for m in members])


def withdrawn_of(db: sqlite3.Connection, member_executions: list[str]) -> dict:
    """:func:`withdrawn_members` of the members' execution ids (one per member, in order)."""
    out: dict = {"count": 0, "of": len(member_executions), "executions": {}, "subjects": []}
    if not _has(db, "withdrawn_executions") or not member_executions:
        return out
    ids = sorted(set(member_executions))
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        for ex, subject, erase in db.execute(f"SELECT execution_id, subject, erase FROM withdrawn_executions WHERE "
                                             f"execution_id IN ({','.join('?' * len(chunk))})", chunk):
            e = out["executions"].setdefault(ex, {"erased": False, "subjects": []})
            e["erased"] = e["erased"] or bool(erase)
            if subject not in e["subjects"]:
                e["subjects"].append(subject)
    out["count"] = sum(1 for x in member_executions if x in out["executions"])
    out["subjects"] = sorted({s for e in out["executions"].values() for s in e["subjects"]})
    return out


def croissant_doc(paths: StorePaths, db: sqlite3.Connection, route: str, version: str) -> dict:
    """The Croissant 1.0 description of an archived publication (as ``ledger manifest publish`` writes it)."""
    row, path = _publication(paths, db, route, version)
    found = summary(path, paths.archive_cache)  # the document without its members is all it describes
    if found.problem is not None:
        raise ServeError(404, f"the archived manifest {route} v{row['version']} cannot be read: {found.problem}")
    return croissant(found.head, f"v{row['version']}.json", found.file_sha256, micros_date(row.get("published_at_us")))


def verify_doc(paths: StorePaths, db: sqlite3.Connection, route: str, version: str) -> dict:
    """``ledger manifest verify ARCHIVE --deep --json`` of an archived publication."""
    _row, path = _publication(paths, db, route, version)
    try:
        return verify_file(path, paths, deep=True).to_json()
    except PublishError as exc:
        raise ServeError(400, str(exc)) from None


def prove_doc(paths: StorePaths, db: sqlite3.Connection, route: str, version: str, member: str) -> dict:
    """``ledger manifest prove ARCHIVE MEMBER_ID``."""
    _row, path = _publication(paths, db, route, version)
    doc, _sha, why = archived_document(paths, path)
    if why is not None:
        raise ServeError(400, why)
    try:
        return prove_document(doc, member)
    except ManifestError as exc:
        raise ServeError(404, str(exc)) from None


def diff_doc(paths: StorePaths, db: sqlite3.Connection, route: str, a: str, b: str) -> dict:
    """``ledger manifest diff A B --json`` of two archived publications."""
    _ra, pa = _publication(paths, db, route, a)
    _rb, pb = _publication(paths, db, route, b)
    try:
        return diff_files(pa, pb, paths)
    except PublishError as exc:
        raise ServeError(400, str(exc)) from None


def _withdrawn_cell(m: dict) -> str:
    k = m.get("withdrawn_since")
    if k is None:
        return '<td class="muted">archive unreadable</td>'
    if not k:
        return '<td class="num">0</td>'
    href = q("/manifests/view", route=m["route"], version=m["version"], withdrawn="yes")
    return f'<td class="num bad"><a href="{esc(href)}">{k:,} of {m["size"]:,}</a></td>'


def html_manifests(doc: dict) -> str:
    rows = []
    by_route: dict[str, list[int]] = {}
    for m in doc["manifests"]:
        by_route.setdefault(m["route"], []).append(m["version"])
        rows.append([link(q("/manifests/view", route=m["route"], version=m["version"]), f"{m['route']} v{m['version']}"),
                     esc(m["published_at"]), num(m["route_version"]), num(m["size"]), _withdrawn_cell(m),
                     f"<code>{esc(m['root'][:16])}…</code>", esc(plain(_position(m["log_position"]))), esc(m.get("key_id"))])
    parts = [table(["publication", "published", "route version", "members", "withdrawn since", "root", "log position",
                    "key"], rows).replace("<table>", '<table id="manifests">', 1)]
    for route, versions in by_route.items():
        if len(versions) > 1:
            opts = "".join(f"<option>{v}</option>" for v in versions)
            parts.append(f'<form method="get" action="/manifests/diff">diff {esc(route)} '
                         f'<input type="hidden" name="route" value="{esc(route)}">'
                         f'<select name="a">{opts}</select> → <select name="b">'
                         + "".join(f"<option{' selected' if v == versions[-1] else ''}>{v}</option>" for v in versions)
                         + '</select> <button type="submit">diff</button></form>')
    return "".join(parts)


def datasheet_html(m: dict) -> str:
    """The manifest's datasheet fields as a person reads them (no raw JSON)."""
    sp = m.get("split_policy") if isinstance(m.get("split_policy"), dict) else {}
    sel = m.get("selection") if isinstance(m.get("selection"), dict) else {}
    fr = sp.get("fractions") if isinstance(sp.get("fractions"), dict) else {}
    rows = {"declared use": m.get("declared_use"), "consumer": m.get("consumer"),
            "evaluation claim": m.get("evaluation_claim"), "route split": m.get("route_split"),
            "semantics": m.get("semantics"), "split policy": f"{sp.get('policy_id') or '-'} ("
            + ", ".join(f"{k} {pct(v)}" for k, v in sorted(fr.items())) + ")",
            "role priority": " > ".join(map(str, m.get("role_priority") or [])),
            "selection": f"J_max {sel.get('j_max')}, seed {sel.get('seed')}, predicates "
            + ", ".join(str(p.get("name")) for p in sel.get("predicates") or [] if isinstance(p, dict)),
            "unavailable": ", ".join(map(str, m.get("unavailable") or [])) or "none"}
    counts = m.get("counts") if isinstance(m.get("counts"), dict) else {}
    pools = [p for p in m.get("source_pools") or [] if isinstance(p, dict)]
    by_role = (m.get("mixture") or {}).get("by_role_class") if isinstance(m.get("mixture"), dict) else None
    return ("<h2>Datasheet</h2>" + table(["field", "value"], [[esc(k), esc(v)] for k, v in rows.items()])
            + "<h3>Counts</h3>" + table(["", "count"], [[esc(k.replace("_", " ")), num(v)] for k, v in counts.items()])
            + ("<h3>Mixture by role class</h3>" + table(
                ["role class", "records", "stored tokens", "processed tokens", "target tokens"],
                [[esc(k), num(v.get("records")), num(v.get("stored_tokens")), num(v.get("processed_tokens")),
                  num(v.get("target_tokens"))] for k, v in by_role.items() if isinstance(v, dict)])
               if isinstance(by_role, dict) else "")
            + ("<h3>Source pools</h3>" + table(["collection run", "origin", "task source", "executions", "members"],
                                               [[link(q("/runs/" + quote(str(p.get("collection_run_id")), safe="")),
                                                      p.get("collection_run_id")), esc(p.get("origin")),
                                                 esc(p.get("task_source")), num(p.get("executions")), num(p.get("members"))]
                                                for p in pools]) if pools else ""))


def html_manifest(doc: dict, page: int = 1, limit: int = 200, withdrawn: str | None = None) -> str:
    pub = doc["publication"]
    route, version = pub["route"], pub["version"]
    wd = doc["withdrawn_since"]
    parts = [kv({"route": route, "version": version, "route version": pub["route_version"],
                 "published": pub.get("published_at") or "-", "members": f"{pub['size']:,}", "root": pub["root"],
                 "log position": _position(pub["log_position"]), "signed by": pub.get("key_id"), "archive": doc["archive"]})]
    parts.append(f'<p>{link(q("/manifests/croissant", route=route, version=version), "Croissant 1.0 (JSON-LD)")} · '
                 f'{link(q("/api/manifests/view", route=route, version=version), "manifest JSON")}</p>')
    if wd["count"]:
        subjects = ", ".join(link(q("/withdrawals", subject=x), x) for x in wd["subjects"])
        parts.append(f'<p class="error" id="withdrawn-since"><b>{wd["count"]:,} of {wd["of"]:,} members withdrawn since'
                     f'</b> publication (by {subjects}): a trainer must drop them; the manifest itself never changes</p>')
    else:
        parts.append(f'<p class="ok" id="withdrawn-since">0 of {wd["of"]:,} members withdrawn since publication</p>')
    parts.append(f"<p class='{'ok' if doc['authenticated'] else 'bad'}'>"
                 + ("archived document matches the manifest_sha256 on the log" if doc["authenticated"]
                    else esc(doc["problem"])) + "</p>")
    parts.append(f'<form method="post" action="{esc(q("/manifests/verify", route=route, version=version))}">'
                 f'<button type="submit" id="verify">verify --deep</button> <span class="muted">replays the log into a '
                 f'temporary database and rebuilds the manifest; writes nothing to the store</span></form>')
    parts.append(f'<h2>Inclusion proof</h2><form method="get" action="/manifests/prove">'
                 f'<input type="hidden" name="route" value="{esc(route)}">'
                 f'<input type="hidden" name="version" value="{version}">'
                 f'<label>member <input name="member" size="50" id="member"></label> '
                 f'<button type="submit" id="prove">prove</button></form>')
    m = doc["manifest"]
    if m:
        parts.append(datasheet_html(m))
        parts.append(members_html(m, route, version, wd, page, limit, withdrawn))
    return "".join(parts)


def members_html(m: dict, route: str, version: Any, wd: dict, page: int, limit: int, withdrawn: str | None) -> str:
    every = [x for x in m.get("members") if isinstance(x, dict)] if isinstance(m.get("members"), list) else []
    with_lineage = any("lineage" in x for x in every)  # semantics 3 (SPEC 11.2)
    members = every if withdrawn is None else [
        x for x in every if (str(x.get("execution_id")) in wd["executions"]) == (withdrawn == "yes")]
    pages = max(1, -(-len(members) // limit))
    shown = members[(page - 1) * limit: page * limit]
    keep = {"route": route, "version": version, "withdrawn": withdrawn}
    nav = pager("/manifests/view", {"matching": len(members), "page": page, "pages": pages, "shown": len(shown),
                                    "limit": limit}, keep)
    pick = " · ".join(f"<b>{esc(t)}</b>" if v == withdrawn else link(q("/manifests/view", **{**keep, "withdrawn": v}), t)
                      for v, t in ((None, "every member"), ("yes", "withdrawn since"), ("no", "still available")))
    nav = f"<p>{pick}</p>" + nav
    rows = []
    for x in shown:
        w = wd["executions"].get(str(x.get("execution_id")))
        mark = "" if w is None else (' <span class="tag erased">erased</span>' if w["erased"] else
                                     ' <span class="tag withdrawn">withdrawn</span>')
        rows.append([esc(x.get("member_id")) + mark, link(ex_href(str(x.get("execution_id"))), x.get("execution_id")),
                     esc(x.get("role_class")), num(x.get("target_tokens")), num(x.get("reward"))]
                    + ([esc(lineage_summary(x.get("lineage")))] if with_lineage else [])
                    + [link(q("/manifests/prove", route=route, version=version, member=x.get("member_id")), "prove")])
    return (f"<h2>Members ({len(every):,})</h2>" + nav + table(
        ["member", "execution", "role class", "targets", "reward"] + (["lineage"] if with_lineage else []) + [""],
        rows).replace("<table>", '<table id="members">', 1))


def html_verify(doc: dict, route: str, version: str) -> str:
    head = (f'<p id="verdict" class="{"ok" if doc["ok"] else "bad"}">'
            + (f"manifest ok: {esc(route)} v{esc(version)}" if doc["ok"] else
               f"manifest FAILED verification: {esc(route)} v{esc(version)}") + "</p>")
    steps = table(["#", "step"], [[num(i + 1), esc(c)] for i, c in enumerate(doc["checks"])])
    problems = ("<h2>Problems</h2><ul id='problems'>" + "".join(f"<li class='bad'>{esc(p)}</li>" for p in doc["problems"])
                + "</ul>") if doc["problems"] else ""
    back = link(q("/manifests/view", route=route, version=version), "back to the publication")
    return head + "<h2>Steps</h2>" + steps + problems + f"<p>{back}</p>"


def lineage_summary(lin) -> str:
    """One line of a member's lineage (SPEC 11.2): task@fixture, run, evaluator, the view chain."""
    if not isinstance(lin, dict):
        return ""
    chain = " ← ".join(f"{t.get('execution_id')}" + (f" ({t['transformation']})" if t.get("transformation") else "")
                       for t in lin.get("transformations") or [] if isinstance(t, dict))
    sel = lin.get("selection") if isinstance(lin.get("selection"), dict) else {}
    parts = [f"task {lin.get('task_id')}@{lin.get('fixture') or '—'}", f"run {lin.get('collection_run_id') or '—'}",
             f"evaluator {lin.get('evaluator') or '—'}", chain]
    if sel:
        parts.append(f"selection {sel.get('selection_id')} ({sel.get('behavioral_role') or 'unlabelled'})")
    return " · ".join(p for p in parts if p)


def html_prove(doc: dict, route: str, version: str, member: str) -> str:
    lineage = {k: doc[k] for k in ("lineage", "rejected_lineage") if isinstance(doc.get(k), dict)}
    rest = {k: v for k, v in doc.items() if k not in lineage}
    lin_html = "".join(f"<h2 id='{k}'>{'Lineage' if k == 'lineage' else 'Rejected side lineage'}</h2>" + kv(v)
                       for k, v in lineage.items())
    return (f"<p class='ok' id='proved'>{esc(member)} is leaf {doc['leaf_index']} of {doc['tree_size']} "
            f"under root <code>{esc(doc['root'])}</code> (proof checked)</p>" + kv(rest) + lin_html
            + f"<p>{link(q('/manifests/view', route=route, version=version), 'back to the publication')}</p>")


def html_diff(doc: dict) -> str:
    a, b, s = doc["a"], doc["b"], doc["summary"]
    parts = [f"<p>{esc(a['route'])} v{esc(a['version'])} ({plain(a['size'])} members) → v{esc(b['version'])} "
             f"({plain(b['size'])} members): {plain(s['removed'])} removed, {plain(s['added'])} added, "
             f"{plain(s['changed'])} changed, {plain(doc['unchanged'])} "
             f"unchanged (reasons from {esc(doc['reasons_from'])})</p>"]
    for side in ("removed", "added", "changed"):
        parts.append(f"<h2>{side}</h2>" + table(["member", "reasons"], [[esc(m["member_id"]), esc(", ".join(m["reasons"]))]
                                                                      for m in doc[side]]))
    for name in ("a", "b"):
        for p in doc["verification"][name]:
            parts.append(f"<p class='bad'>{name.upper()} does not verify: {esc(p)}</p>")
    return "".join(parts)


def manifests(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    params(request, ())
    doc = manifests_doc(ctx.paths, db)
    return "Manifests", html_manifests(doc), doc, twin_of(request)


def manifest(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("route", "version", "page", "limit", "withdrawn"), ("route", "version"))
    doc = manifest_doc(ctx.paths, db, p["route"], p["version"])
    page = 1 if p["page"] is None else int_param("page", p["page"], 1, 10**9)
    limit = 200 if p["limit"] is None else int_param("limit", p["limit"], 1, 5000)
    if p["withdrawn"] not in (None, "yes", "no"):
        raise ServeError(400, f"withdrawn must be yes or no, got {p['withdrawn'][:40]!r}")
    return (f"Manifest {p['route']} v{doc['publication']['version']}",
            html_manifest(doc, page, limit, p["withdrawn"]), doc, twin_of(request))


def croissant_page(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("route", "version"), ("route", "version"))
    return "Croissant", "", croissant_doc(ctx.paths, db, p["route"], p["version"]), None


def prove(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("route", "version", "member"), ("route", "version", "member"))
    doc = prove_doc(ctx.paths, db, p["route"], p["version"], p["member"])
    return "Inclusion proof", html_prove(doc, p["route"], p["version"], p["member"]), doc, twin_of(request)


def diff(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("route", "a", "b"), ("route", "a", "b"))
    doc = diff_doc(ctx.paths, db, p["route"], p["a"], p["b"])
    return f"Diff {p['route']} v{p['a']} → v{p['b']}", html_diff(doc), doc, twin_of(request)


def verify(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("route", "version"), ("route", "version"))
    doc = verify_doc(ctx.paths, db, p["route"], p["version"])
    return (f"Verify {p['route']} v{p['version']} (deep)", html_verify(doc, p["route"], p["version"]), doc,
            None)


ROUTES = [Page("/manifests", manifests), Page("/manifests/view", manifest), Page("/manifests/prove", prove),
          Page("/manifests/croissant", croissant_page, json_only=True), Page("/manifests/diff", diff),
          Page("/manifests/verify", verify, ("POST",))]
