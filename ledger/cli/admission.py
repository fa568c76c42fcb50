"""Admission per route: ``cascade plan`` and ``admission show``.

May import: every layer below the CLI.
"""

from __future__ import annotations

import argparse

from ledger.cli.common import EXIT_OK, Subparsers, as_usage, ident, print_json, projected_db


def register(sub: Subparsers) -> None:
    _add_cascade(sub)
    _add_admission(sub)


def _add_cascade(sub: Subparsers) -> None:
    cascade = sub.add_parser("cascade", help="admission cascades").add_subparsers(dest="cascade_command", required=True)
    _add_cascade_plan(cascade)


def _add_cascade_plan(cascade: Subparsers) -> None:
    sp = cascade.add_parser("plan", help="order a route's predicates by cost per rejection t/(1-p) within dependencies")
    sp.set_defaults(fn=cmd_cascade_plan)
    sp.add_argument("route", type=ident)


def cmd_cascade_plan(args: argparse.Namespace) -> int:
    from ledger.algorithms.cascade_plan import format_plan  # lazy: startup time
    from ledger.projections.admission import cascade_plan  # lazy: startup time

    db = projected_db(args, "routes")
    with as_usage(KeyError):
        plan = cascade_plan(db, args.route)
    print(format_plan(plan))
    return EXIT_OK


def _add_admission(sub: Subparsers) -> None:
    admission = sub.add_parser("admission", help="admission decisions per route").add_subparsers(
        dest="admission_command", required=True)
    _add_admission_show(admission)


def _add_admission_show(admission: Subparsers) -> None:
    sp = admission.add_parser("show", help="each execution's admission state; preference routes: pairs and "
                                           "unassigned comparison candidates with their reasons")
    sp.set_defaults(fn=cmd_admission_show)
    sp.add_argument("route", type=ident)
    sp.add_argument("--json", action="store_true")


def cmd_admission_show(args: argparse.Namespace) -> int:
    """``ledger admission show ROUTE``: each execution's admission state on the route and, for a
    preference route, its pairs and the unassigned comparison candidates with their reasons."""
    from ledger.projections.admission import admission_rows, route_definition  # lazy: startup time
    from ledger.projections.preference import preference_route, route_summary  # lazy: startup time

    db = projected_db(args, "routes")
    with as_usage(KeyError):
        r = route_definition(db, args.route)
    rows = [{"execution_id": ex, "state": st, "predicate": pred, "verdict": v, "missing_evidence": miss, "reason": why,
             "reward": rw, "target_tokens": tt, "paths": n} for ex, st, pred, v, miss, why, rw, tt, n in admission_rows(db, r.name)]
    doc = {"route": r.name, "route_version": r.version, "use": r.use, "split": r.split, "executions": rows}
    if preference_route(r):
        doc["preference"] = route_summary(db, r.name)
    from ledger.projections.collections import datasheet_section  # lazy: startup time

    doc.update(datasheet_section(db, r))  # SPEC 6.10: the route's collection campaign, declared_after_sampling
    if args.json:
        print_json(doc)
        return EXIT_OK
    print(f"route {r.name} v{r.version} (use {r.use}, split {r.split}): {len(rows)} executions")
    for row in rows:
        why = row["missing_evidence"] or row["reason"] or ""
        print(f"  {row['execution_id']}  {row['state']}" + (f"  [{row['predicate']}]" if row["predicate"] else "")
              + (f"  {why}" if why else ""))
    if "collection" in doc:
        c = doc["collection"]
        print(f"collection {c['collection_id']}: manifest versions {c['manifest_versions'] or '-'}, {c['executions']} "
              f"executions, declared_after_sampling: {str(c['declared_after_sampling']).lower()}")
        for d in c["late_declarations"]:
            print(f"  declared after sampling: {d['declaration']} {d.get('collection_id') or d.get('route')} "
                  f"v{d['version']} at {d['occurred_at']} (first execution {c['first_execution_at']})")
    if "preference" in doc:
        p = doc["preference"]
        print(f"pairs: {p['pairs']} ({p['prompt_tokens']} prompt tokens, {p['continuation_tokens']} continuation tokens)"
              + "".join(f"; {c}: {n}" for c, n in p["by_criterion"].items()))
        print(f"unassigned comparison candidates: {len(p['unassigned'])}")
        for u in p["unassigned"]:
            print(f"  {u['execution_id']} (task {u['task_id']}): {u['reason']}")
    return EXIT_OK
