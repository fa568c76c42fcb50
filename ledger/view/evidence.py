"""SPEC §6.10 evidence for ``ledger serve`` (issue 16): the Graders and Campaigns pages, and the
verifier-integrity sections of the route and execution pages.

Every document here is built from the projections' own read functions (read-only), so a page's
JSON twin equals the CLI's document: ``/graders`` is ``ledger graders --json``
(:func:`projections.verifier.graders`), ``/campaigns`` holds ``ledger status --json``
``collections`` (:func:`projections.collections.summaries`), ``/campaigns/ID?route=R`` holds
``ledger admission show R --json`` ``collection`` (:func:`projections.collections.campaign_summary`),
and a route's ``fault_coverage`` / ``probe_evidence`` are what its manifest datasheet lists
(``fault_injection.coverage``, ``capability_gap.probes_by_task``).
"""

from __future__ import annotations

import json
import sqlite3
from urllib.parse import quote

from starlette.requests import Request

from ledger.algorithms.canonical import json_or_text
from ledger.algorithms.path_globs import violations
from ledger.events.validate import format_micros
from ledger.projections.collections import campaign_summary, checkpoints_for, route_collection, summaries
from ledger.projections.evidence import TABLE9, fault_coverage, feedback_predicate, probe_evidence, route_option
from ledger.projections.manifests import published_manifests
from ledger.projections.verifier import control_exclusion, graders, protected_paths_verdict, task_policies
from ledger.view.page import ServeError, esc, ex_href, kv, link, num, plain, q, table
from ledger.view.page import has_table as _has, rows as _rows
from ledger.view.request import Answer, Context, Page, params, twin_of


def _table(element_id: str, head: list[str], rows: list[list[str]]) -> str:
    return table(head, rows).replace("<table>", f'<table id="{esc(element_id)}">', 1)


def _yes_no(flag: bool, good: bool = True) -> str:
    cls = "ok" if flag == good else "bad"
    return f'<td class="{cls}">{"yes" if flag else "no"}</td>'


def grader_href(evaluator: str) -> str:
    return "/graders/" + quote(evaluator, safe="")


def campaign_href(collection_id: str) -> str:
    return "/campaigns/" + quote(collection_id, safe="")


# ------------------------------------------------------------------ graders
def graders_doc(db: sqlite3.Connection) -> list[dict]:
    """``ledger graders --json``."""
    if not (_has(db, "grader_controls") and _has(db, "assessments")):
        return []
    return graders(db)


def grader_doc(db: sqlite3.Connection, evaluator: str) -> dict:
    rows = graders_doc(db)
    for g in rows:
        if g["evaluator"] == evaluator:
            return g
    known = ", ".join(g["evaluator"] for g in rows) or "none"
    raise ServeError(404, f"no evaluator version {evaluator[:200]!r} has controls or assessments (known: {known})")


def rate_text(d: dict, k: str, n: str) -> str:
    """``1.000 (1/1)``, as ``ledger graders`` prints it."""
    return "n/a (0 assessed)" if d["rate"] is None else f"{d['rate']:.3f} ({d[k]}/{d[n]})"


def _classified(c: dict) -> str:
    if c["observed"] is None:
        return '<td class="muted">not yet assessed</td>'
    return '<td class="ok">as expected</td>' if c["observed"] == c["expected"] else '<td class="bad">MISCLASSIFIED</td>'


def _controls_table(g: dict) -> str:
    return _table(f"controls-{g['evaluator']}", ["control", "kind", "expected", "observed", ""],
                  [[link(ex_href(c["execution_id"]), c["execution_id"]), esc(c["kind"]), esc(c["expected"]),
                    esc(c["observed"] or "-"), _classified(c)] for c in g["controls"]])


def _grader_row(g: dict) -> list[str]:
    return [link(grader_href(g["evaluator"]), g["evaluator"]), _yes_no(g["calibrated"]), esc(g["why_not"]),
            num(len(g["controls"])),
            f'<td class="num">{esc(rate_text(g["false_acceptance"], "inadequate_passed", "inadequate_assessed"))}</td>',
            f'<td class="num">{esc(rate_text(g["false_rejection"], "adequate_failed", "adequate_assessed"))}</td>',
            esc(", ".join(g["misclassified"])), esc(", ".join(g["not_assessed"]))]


_GRADER_HEAD = ["evaluator version", "calibrated", "why not", "controls", "false acceptance", "false rejection",
                "misclassified", "not assessed"]


def html_graders(rows: list[dict]) -> str:
    parts = ['<p class="muted">An evaluator version is calibrated when it has at least one adequate and one inadequate '
             "control, has assessed all of them and classified each as expected (its first decisive assessment: pass "
             "when scored with reward ≥ 1.0). False acceptance = inadequate controls passed / assessed; false "
             "rejection = adequate controls failed / assessed. Same document as <code>ledger graders --json</code>.</p>"]
    if not rows:
        return parts[0] + '<p class="muted">no evaluator has assessed anything or been given controls</p>'
    parts.append(_table("graders", _GRADER_HEAD, [_grader_row(g) for g in rows]))
    for g in rows:
        if g["controls"]:
            parts.append(f'<h2 id="ev-{esc(g["evaluator"])}">{esc(g["evaluator"])}</h2>' + _controls_table(g))
    return "".join(parts)


def html_grader(g: dict) -> str:
    return (_table("graders", _GRADER_HEAD, [_grader_row(g)]) + "<h2>Controls</h2>" + _controls_table(g)
            + (f"<p class='muted'>conflicting declarations: {esc(', '.join(g['conflicting']))}</p>"
               if g["conflicting"] else "") + f"<p>{link('/graders', 'every evaluator version')}</p>")


# ------------------------------------------------------------------ campaigns
def _publications_of(db: sqlite3.Connection, collection_id: str | None) -> list[dict]:
    """Published manifests (of the routes whose version named ``collection_id``; every one when None)
    with the checkpoints trained on each."""
    if not _has(db, "manifests"):
        return []
    out = []
    for m in published_manifests(db):
        cid = route_collection(db, m["route"], m["route_version"]) if _has(db, "routes") else None
        if collection_id is not None and cid != collection_id:
            continue
        out.append({"route": m["route"], "version": m["version"], "route_version": m["route_version"],
                    "members": m["size"], "collection_id": cid, "checkpoints": checkpoints_for(db, m["route"], m["version"])})
    return out


def campaigns_doc(db: sqlite3.Connection) -> dict:
    """``collections`` = ``ledger status --json`` ``collections``; ``checkpoints``: every publication a
    checkpoint trained on."""
    return {"collections": summaries(db),
            "checkpoints": [p for p in _publications_of(db, None) if p["checkpoints"]] if _has(db, "model_checkpoints")
            else []}


def campaign_doc(db: sqlite3.Connection, collection_id: str, route: str | None) -> dict:
    """One campaign: ``summary`` = ``campaign_summary`` (with ``route``: ``ledger admission show ROUTE --json``
    ``collection``), every manifest version, the route versions naming it, its executions and the
    publications of its routes with their checkpoints."""
    known = summaries(db)
    if collection_id not in known:
        raise ServeError(404, f"no collection campaign {collection_id[:200]!r} (known: {', '.join(known) or 'none'})")
    routes = _rows(db, "SELECT route, version, occurred_at FROM collection_routes WHERE collection_id = ? "
                       "ORDER BY route, version", (collection_id,))
    if route is not None and route not in {r["route"] for r in routes}:
        raise ServeError(400, f"route {route[:80]!r} names no version of collection {collection_id!r} (routes naming it: "
                              f"{', '.join(sorted({r['route'] for r in routes})) or 'none'})")
    summary = campaign_summary(db, collection_id, route=route)
    late = {(d["declaration"], d.get("route") or d.get("collection_id"), d["version"])
            for d in summary["late_declarations"]}
    if route is None:
        late_all = late
    else:
        late_all = {(d["declaration"], d.get("route") or d.get("collection_id"), d["version"])
                    for d in campaign_summary(db, collection_id)["late_declarations"]}
    versions = []
    for r in _rows(db, "SELECT version, use, consumer, capability, required_capture, routes, evaluation_claim, body, "
                       "occurred_at FROM collection_manifests WHERE collection_id = ? ORDER BY version", (collection_id,)):
        body = json.loads(r["body"])
        versions.append({"version": r["version"], "use": r["use"], "consumer": r["consumer"],
                         "capability": r["capability"], "required_capture": json.loads(r["required_capture"]),
                         "routes": json.loads(r["routes"]), "evaluation_claim": r["evaluation_claim"],
                         "sources": body.get("sources"), "configuration": body.get("configuration"),
                         "occurred_at": format_micros(r["occurred_at"]),
                         "declared_after_sampling": ("collection_manifest", collection_id, r["version"]) in late_all})
    route_rows = [{"route": r["route"], "version": r["version"], "occurred_at": format_micros(r["occurred_at"]),
                   "declared_after_sampling": ("admission_policy", r["route"], r["version"]) in late_all} for r in routes]
    executions = [{"execution_id": e["execution_id"], "opened_at": format_micros(e["occurred_at"]),
                   "closed": bool(e["closed"])}
                  for e in _rows(db, "SELECT execution_id, occurred_at, closed FROM collection_executions "
                                     "WHERE collection_id = ? ORDER BY occurred_at, execution_id", (collection_id,))]
    return {"collection_id": collection_id, "route": route, "summary": summary, "manifest_versions": versions,
            "routes": route_rows, "executions": executions, "publications": _publications_of(db, collection_id)}


def _late_text(d: dict) -> str:
    return f"{d['declaration']} {d.get('route') or d.get('collection_id')} v{d['version']} at {d['occurred_at']}"


def _checkpoint_table(element_id: str, pubs: list[dict]) -> str:
    return _table(element_id, ["publication", "route version", "members", "campaign", "checkpoint", "evaluation claims"],
                  [[link(q("/manifests/view", route=p["route"], version=p["version"]), f"{p['route']} v{p['version']}"),
                    num(p["route_version"]), num(p["members"]),
                    link(campaign_href(p["collection_id"]), p["collection_id"]) if p["collection_id"] else "-",
                    esc(c["checkpoint_id"]), esc(", ".join(c["evaluation_claims"]))]
                   for p in pubs for c in (p["checkpoints"] or [{"checkpoint_id": "-", "evaluation_claims": []}])])


def html_campaigns(doc: dict) -> str:
    cs = doc["collections"]
    parts = ['<p class="muted">Collection manifests (SPEC §6.10): a declaration or route version made after the '
             "campaign's first execution is flagged declared after sampling. <code>collections</code> of the JSON twin "
             "is <code>ledger status --json</code>'s.</p>"]
    parts.append(_table("campaigns", ["campaign", "manifest versions", "executions", "first execution", "declared after "
                                      "sampling", "late declarations"],
                        [[link(campaign_href(cid), cid), esc(", ".join(map(str, s["manifest_versions"])) or "none"),
                          num(s["executions"]), esc(s["first_execution_at"]), _yes_no(s["declared_after_sampling"], False),
                          esc("; ".join(_late_text(d) for d in s["late_declarations"]))] for cid, s in cs.items()]))
    parts.append("<h2>Checkpoints by manifest</h2>" + _checkpoint_table("checkpoints", doc["checkpoints"]))
    return "".join(parts)


def html_campaign(doc: dict) -> str:
    s, cid = doc["summary"], doc["collection_id"]
    m = s["manifest"] or {}
    parts = []
    if doc["route"]:
        parts.append(f"<p>late declarations restricted to route <b>{esc(doc['route'])}</b> "
                     f"(= <code>ledger admission show {esc(doc['route'])} --json</code> <code>collection</code>) · "
                     f"{link(campaign_href(cid), 'every route')}</p>")
    parts.append(f'<p id="declared-after-sampling" class="{"bad" if s["declared_after_sampling"] else "ok"}">'
                 + ("declared after sampling" if s["declared_after_sampling"] else "declared before sampling") + "</p>")
    parts.append("<h2>Manifest in force</h2>" + (kv({
        "version": m.get("version"), "use": m.get("use"), "consumer": m.get("consumer"), "capability": m.get("capability"),
        "required capture": ", ".join(m.get("required_capture") or []), "routes": ", ".join(m.get("routes") or []),
        "evaluation claim": m.get("evaluation_claim"), "sources": m.get("sources"),
        "configuration": m.get("configuration"), "permitted use": m.get("permitted_use"),
        "task relations": m.get("task_relations")}) if s["manifest"] else
        '<p class="bad">no collection manifest: routes naming this campaign leave every execution unresolved</p>'))
    parts.append("<h2>Manifest versions</h2>" + _table(
        "manifest-versions", ["version", "declared at", "use", "consumer", "required capture", "routes",
                              "declared after sampling"],
        [[num(v["version"]), esc(v["occurred_at"]), esc(v["use"]), esc(v["consumer"]), esc(", ".join(v["required_capture"])),
          esc(", ".join(v["routes"])), _yes_no(v["declared_after_sampling"], False)] for v in doc["manifest_versions"]]))
    parts.append(f"<h2>Late declarations</h2><p>first execution at <b>{esc(s['first_execution_at'] or '-')}</b></p>"
                 + _table("late", ["declaration", "id", "version", "declared at"],
                          [[esc(d["declaration"]), esc(d.get("route") or d.get("collection_id")), num(d["version"]),
                            esc(d["occurred_at"])] for d in s["late_declarations"]]))
    parts.append("<h2>Routes naming it</h2>" + _table(
        "routes", ["route", "version", "declared at", "declared after sampling"],
        [[link(q(campaign_href(cid), route=r["route"]), r["route"]), num(r["version"]), esc(r["occurred_at"]),
          _yes_no(r["declared_after_sampling"], False)] for r in doc["routes"]]))
    parts.append(f"<h2>Executions ({s['executions']})</h2>" + _table(
        "executions", ["execution", "opened", "closed"],
        [[link(ex_href(e["execution_id"]), e["execution_id"]), esc(e["opened_at"]), esc("yes" if e["closed"] else "no")]
         for e in doc["executions"]]))
    parts.append("<h2>Publications and the checkpoints trained on them</h2>"
                 + _checkpoint_table("checkpoints", doc["publications"]))
    return "".join(parts)


# ------------------------------------------------------------------ route page
def route_evidence(db: sqlite3.Connection, route) -> dict:
    """``fault_coverage`` (once any fault is on the log) and ``probe_evidence`` (on a ``capability_gap``
    route, or when the route's emitted executions' tasks have probes); ``None`` when absent."""
    faults = _has(db, "fault_injections") and db.execute("SELECT 1 FROM fault_injections LIMIT 1").fetchone() is not None
    gap = bool(route_option(db, route.name, route.version, "capability_gap")) if _has(db, "routes") else False
    probes = probe_evidence(db, route.name) if _has(db, "counterfactual_probes") else {}
    injected = _rows(db, "SELECT f.execution_id, f.injection_id, f.version, f.condition, f.target_call_id, a.state "
                         "FROM fault_injections f JOIN admission a ON a.execution_id = f.execution_id AND a.route = ? "
                         "ORDER BY f.execution_id, f.injection_id", (route.name,)) if faults and _has(db, "admission") else []
    return {"fault_coverage": fault_coverage(db, route.name) if faults else None, "faults": injected,
            "capability_gap": gap, "probe_evidence": probes if (gap or any(probes.values())) else None}


def html_route_evidence(doc: dict) -> str:
    parts = []
    cov = doc.get("fault_coverage")
    if cov is not None:
        parts.append("<h2>Fault-injection coverage</h2>" + _table(
            "fault-coverage", ["condition", "causal distinction", "attempts", "admitted executions", "admitted target tokens",
                               "expected responses"],
            [[esc(c), esc(v.get("causal_distinction", "custom condition")), num(v["attempts"]), num(v["admitted_executions"]),
              num(v["admitted_target_tokens"]), esc("; ".join(v["expected_responses"]))] for c, v in cov.items()]))
        if doc["faults"]:
            parts.append(_table("route-faults", ["execution", "injection", "version", "condition", "target call", "state"],
                                [[link(ex_href(f["execution_id"]), f["execution_id"]), esc(f["injection_id"]),
                                  esc(f["version"]), esc(f["condition"]), esc(f["target_call_id"]), esc(f["state"])]
                                 for f in doc["faults"]]))
    probes = doc.get("probe_evidence")
    if probes is not None:
        rule = ("this route requires <code>capability_gap: true</code>: admitted only when the latest probe of each rung "
                "(context, interface, runtime) of the task is failure_persists" if doc["capability_gap"] else
                "probes of the tasks of the route's emitted executions (the route does not require a capability gap)")
        parts.append(f"<h2>Capability-gap probe evidence</h2><p>{rule}</p>" + _table(
            "probes", ["task", "rung", "deciding probe", "result", "evidence"],
            [[esc(task), esc(p["rung"]), esc(p["probe_id"]),
              f'<td class="{"ok" if p["result"] == "failure_persists" else "bad"}">{esc(p["result"])}</td>',
              esc(plain(p["evidence"]) if p["evidence"] is not None else "")]
             for task, ps in probes.items() for p in ps]))
        if not probes:
            parts.append('<p class="muted">no emitted execution on this route yet</p>')
    return "".join(parts)


# ------------------------------------------------------------------ execution page
def execution_evidence(db: sqlite3.Connection, ex: str, chain: list[str]) -> dict:
    """The execution's artifact diffs with the protected-paths verdict, its feedback signals (and the
    ``feedback`` predicate's verdict), its injected faults and its grader-control declarations.
    ``chain``: ``ex`` and its ancestors (a derived view's task is its parent's)."""
    out: dict = {"artifact_diffs": [], "path_policies": [], "protected_paths": None, "feedback": [],
                 "feedback_verdict": None, "faults": [], "grader_controls": [], "control_exclusion": None}
    task_id = next((r[0] for cur in chain for r in db.execute(
        "SELECT task_id FROM executions WHERE execution_id = ? AND task_id IS NOT NULL", (cur,))), None)
    if _has(db, "artifact_diffs"):
        policies = task_policies(db, task_id)
        out["path_policies"] = [{"protected": p, "allowed": a} for p, a in policies]
        for d in _rows(db, "SELECT artifact_version, base_commit, changed_paths, has_diff, event_id FROM artifact_diffs "
                           "WHERE execution_id = ? ORDER BY artifact_version, event_id", (ex,)):
            changed = json.loads(d["changed_paths"])
            bad = dict(violations(changed, policies))
            out["artifact_diffs"].append({"artifact_version": d["artifact_version"], "base_commit": d["base_commit"],
                                          "unified_diff_recorded": bool(d["has_diff"]), "event_id": d["event_id"],
                                          "changed_paths": [{"path": p, "protected_by": bad.get(p)} for p in changed]})
        if (out["artifact_diffs"] or any(p for p, _a in policies)) and _has(db, "assessment_executions"):
            v, reason, missing = protected_paths_verdict(db, ex)
            out["protected_paths"] = {"verdict": v, "reason": reason, "missing_evidence": missing}
    if _has(db, "production_feedback"):
        out["feedback"] = [{**f, "occurred_at": format_micros(f["occurred_at"])} for f in _rows(
            db, "SELECT event_id, occurred_at, signal, value, consent_ref, evidence FROM production_feedback "
                "WHERE execution_id = ? ORDER BY occurred_at, event_id", (ex,))]
        if out["feedback"] and _has(db, "assessment_executions"):
            v, reason, missing = feedback_predicate(db, ex)
            out["feedback_verdict"] = {"verdict": v, "reason": reason, "missing_evidence": missing}
    if _has(db, "fault_injections"):
        for f in _rows(db, "SELECT injection_id, version, condition, target_call_id, simulated_state, expected_response "
                           "FROM fault_injections WHERE execution_id = ? ORDER BY injection_id", (ex,)):
            f["simulated_state"] = json_or_text(f["simulated_state"])
            f["table9_response"] = TABLE9[f["condition"]][1] if f["condition"] in TABLE9 else None
            out["faults"].append(f)
    if _has(db, "grader_controls"):
        out["grader_controls"] = _rows(db, "SELECT evaluator, kind, expected FROM grader_controls WHERE execution_id = ? "
                                           "ORDER BY evaluator, kind", (ex,))
        if _has(db, "assessment_executions"):
            out["control_exclusion"] = control_exclusion(db, ex)
    return out


def html_execution_evidence(ev: dict | None) -> str:
    if not ev or not any(ev[k] for k in ("artifact_diffs", "protected_paths", "feedback", "faults", "grader_controls")):
        return ""
    parts = ["<h2>Verifier evidence</h2>"]
    pp = ev["protected_paths"]
    if pp is not None or ev["artifact_diffs"]:
        parts.append("<h3>Artifact diffs</h3>")
        if pp is not None:
            cls = {"pass": "ok", "fail": "bad"}.get(pp["verdict"], "")
            parts.append(f'<p>protected paths: <b id="protected-paths" class="{cls}">{esc(pp["verdict"])}</b>'
                         + (f' <span id="protected-paths-reason">{esc(pp["reason"])}</span>' if pp["reason"] else "")
                         + (f' <span class="muted">(missing: {esc(pp["missing_evidence"])})</span>'
                            if pp["missing_evidence"] else "") + "</p>")
        for pol in ev["path_policies"]:
            parts.append(f"<p class='muted'>task protects {esc(', '.join(pol['protected']) or 'nothing')}; allowed "
                         f"{esc(', '.join(pol['allowed']) or 'nothing')}</p>")
        parts.append(_table("artifact-diffs", ["artifact version", "base commit", "changed path", "protected-paths check",
                                               "unified diff"],
                            [[esc(d["artifact_version"]), f"<code>{esc(d['base_commit'])}</code>",
                              esc(c["path"]) if c else "(none: a read-only run)",
                              f'<td class="bad">protected by {esc(c["protected_by"])}</td>' if c and c["protected_by"] else
                              '<td class="ok">allowed</td>', esc("recorded" if d["unified_diff_recorded"] else "not recorded")]
                             for d in ev["artifact_diffs"] for c in d["changed_paths"] or [None]]))
    if ev["feedback"]:
        fv = ev["feedback_verdict"]
        parts.append("<h3>Feedback signals</h3>" + (
            f'<p>feedback predicate: <b id="feedback-verdict">{esc(fv["verdict"])}</b> '
            f'<span class="muted">{esc(fv["reason"])}</span></p>' if fv else "")
            + _table("feedback", ["at", "signal", "value", "consent", "evidence"],
                     [[esc(f["occurred_at"]), esc(f["signal"]), num(f["value"]), esc(f["consent_ref"] or "none (ignored)"),
                       esc(f["evidence"])] for f in ev["feedback"]]))
    if ev["faults"]:
        parts.append("<h3>Injected faults</h3>" + _table(
            "faults", ["injection", "version", "condition", "target call", "simulated state", "expected response"],
            [[esc(f["injection_id"]), esc(f["version"]), esc(f["condition"]), esc(f["target_call_id"]),
              esc(plain(f["simulated_state"]) if f["simulated_state"] is not None else ""),
              esc(f["expected_response"] or f"{f['table9_response']} (Table 9 default)")] for f in ev["faults"]]))
    if ev["grader_controls"]:
        parts.append("<h3>Grader control</h3>"
                     + (f"<p class='bad'>{esc(ev['control_exclusion'])}</p>" if ev["control_exclusion"] else "")
                     + _table("grader-controls", ["evaluator version", "kind", "expected"],
                              [[link(grader_href(c["evaluator"]), c["evaluator"]), esc(c["kind"]), esc(c["expected"])]
                               for c in ev["grader_controls"]]))
    return "".join(parts)


def graders_page(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    params(request, ())
    doc = graders_doc(db)
    return "Graders", html_graders(doc), doc, twin_of(request)


def grader_page(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    params(request, ())
    doc = grader_doc(db, request.path_params["evaluator"])
    return f"Grader {doc['evaluator']}", html_grader(doc), doc, twin_of(request)


def campaigns_page(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    params(request, ())
    doc = campaigns_doc(db)
    return "Campaigns", html_campaigns(doc), doc, twin_of(request)


def campaign_page(ctx: Context, request: Request, db: sqlite3.Connection) -> Answer:
    p = params(request, ("route",))
    doc = campaign_doc(db, request.path_params["collection_id"], p["route"])
    return f"Campaign {doc['collection_id']}", html_campaign(doc), doc, twin_of(request)


ROUTES = [Page("/graders", graders_page), Page("/graders/{evaluator:path}", grader_page), Page("/campaigns", campaigns_page),
          Page("/campaigns/{collection_id:path}", campaign_page)]
