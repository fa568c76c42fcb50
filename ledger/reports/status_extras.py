"""What `ledger status --json` reports beyond table counts: per-projection summaries."""

from __future__ import annotations

import json
import sqlite3
from ledger.projections.collections import summaries
from ledger.corpus.export import accounting_all


def _has(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone() is not None


def extras(db: sqlite3.Connection) -> dict:
    out: dict = {}
    if _has(db, "tree_stats"):
        n, req, nodes, stored, expanded = db.execute(
            "SELECT COUNT(*), COALESCE(SUM(requests),0), COALESCE(SUM(nodes),0), COALESCE(SUM(stored_tokens),0), "
            "COALESCE(SUM(expanded_tokens),0) FROM tree_stats").fetchone()
        out["trees"] = {"executions": n, "requests": req, "nodes": nodes, "stored_tokens": stored,
                        "expanded_tokens": expanded, "stored_over_expanded": round(stored / expanded, 4) if expanded else None}
    if _has(db, "execution_scores"):
        out["scores"] = dict(db.execute("SELECT state, COUNT(*) FROM execution_scores GROUP BY state ORDER BY state").fetchall())
    if _has(db, "route_telemetry"):
        routes = {}
        for row in db.execute("SELECT route, route_version, evaluated, admitted, dummy, rejected, unresolved, rejected_by, "
                              "unresolved_by FROM route_telemetry ORDER BY route"):
            routes[row[0]] = {"route_version": row[1], "evaluated": row[2], "admitted": row[3], "dummy": row[4],
                              "rejected": row[5], "unresolved": row[6], "rejected_by": json.loads(row[7]),
                              "unresolved_by": json.loads(row[8])}
        out["routes"] = routes

        if cs := summaries(db):  # SPEC 6.10: collection campaigns, declared_after_sampling
            out["collections"] = cs

        out["accounting"] = accounting_all(db)
    return out
