"""Collection manifests and model checkpoints (SPEC 6.10; seed 002 15.2.3, 15.3.1, 15.4.2).

Tables:

* ``collection_manifests`` — every version of every ``collection_manifest`` (the latest version of
  a campaign is the one in force);
* ``collection_executions`` — the campaign an ``execution_opened`` names (``collection_id``), with
  its ``occurred_at``; ``collection_requests`` — per request of such an execution its role class
  and whether it is a policy output without log-probs (reconstructed ones included);
* ``collection_routes`` — each route version that names a ``collection_id`` (with ``occurred_at``);
* ``model_checkpoints`` / ``checkpoint_manifests`` — ``checkpoint_trained``: the manifest versions
  (route, version) a checkpoint trained on and the evaluation claims it supports.

``apply`` records facts only.  The admission projection (registered after this one) calls
:func:`campaign_gate` from its ``record_adequacy`` step for routes of semantics >= 2 that name a
``collection_id``; a new manifest version re-evaluates the routes naming the campaign.

**declared_after_sampling** compares ``occurred_at`` (stored in the event, stamped at ingest when
absent), never log positions: the campaign's first execution is its smallest ``execution_opened``
``occurred_at``, and a manifest version or route version naming the campaign whose ``occurred_at``
is strictly later is a late declaration.  Replay and any partition interleaving give the same answer.
"""

from __future__ import annotations

import json
import sqlite3

from ledger.algorithms.collection_capture import late_declarations, missing_capture
from ledger.events.validate import format_micros
from ledger.projections.engine import Applied, TableProjection
from ledger.projections.lineage import iter_ancestors, root_of

__all__ = ["CollectionsProjection", "campaign_gate", "campaign_summary", "checkpoints_for", "datasheet_section",
           "name_checkpoints", "route_collection", "routes_naming", "summaries"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS collection_manifests (
    collection_id TEXT NOT NULL, version INTEGER NOT NULL, use TEXT NOT NULL, consumer TEXT, capability TEXT NOT NULL,
    required_capture TEXT NOT NULL, routes TEXT NOT NULL, evaluation_claim TEXT NOT NULL, body TEXT NOT NULL,
    occurred_at INTEGER NOT NULL, event_id TEXT NOT NULL,
    PRIMARY KEY (collection_id, version)
);
CREATE TABLE IF NOT EXISTS collection_executions (
    execution_id TEXT PRIMARY KEY, collection_id TEXT NOT NULL, occurred_at INTEGER NOT NULL,
    closed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS collection_executions_campaign ON collection_executions (collection_id, occurred_at);
CREATE TABLE IF NOT EXISTS collection_requests (
    execution_id TEXT NOT NULL, request_id TEXT NOT NULL, role_class TEXT NOT NULL, logprob_gap INTEGER NOT NULL,
    PRIMARY KEY (execution_id, request_id)
);
CREATE TABLE IF NOT EXISTS collection_routes (
    route TEXT NOT NULL, version INTEGER NOT NULL, collection_id TEXT NOT NULL, occurred_at INTEGER NOT NULL,
    PRIMARY KEY (route, version)
);
CREATE TABLE IF NOT EXISTS model_checkpoints (
    checkpoint_id TEXT PRIMARY KEY, evaluation_claims TEXT NOT NULL, occurred_at INTEGER NOT NULL, event_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoint_manifests (
    checkpoint_id TEXT NOT NULL, route TEXT NOT NULL, version INTEGER NOT NULL,
    PRIMARY KEY (checkpoint_id, route, version)
);
CREATE INDEX IF NOT EXISTS checkpoint_manifests_by_manifest ON checkpoint_manifests (route, version);
"""

_BODY_FIELDS = ("collection_id", "version", "use", "consumer", "capability", "sources", "permitted_use", "task_relations",
                "configuration", "required_capture", "routes", "evaluation_claim")
_JSON_FIELDS = ("permitted_use", "task_relations", "configuration")


class CollectionsProjection(TableProjection):
    name = "collections"
    event_types = frozenset(("execution_opened", "request", "execution_closed", "collection_manifest",
                             "admission_policy", "checkpoint_trained"))  # what apply acts on (the engine dispatches by type)

    SCHEMA = _SCHEMA

    def __init__(self) -> None:
        self._closed_memo: dict[str, int | None] = {}  # this batch's reads of collection_executions.closed

    def reset(self) -> None:
        self._closed_memo.clear()

    def finish(self, db: sqlite3.Connection) -> None:
        self._closed_memo.clear()

    def _closed(self, db: sqlite3.Connection, execution_id: str) -> int | None:
        """``closed`` of the execution's campaign row (``None``: not a campaign's execution), read once
        per batch (only this projection's execution_opened / execution_closed change it; they drop the memo)."""
        if execution_id not in self._closed_memo:
            row = db.execute("SELECT closed FROM collection_executions WHERE execution_id = ?", (execution_id,)).fetchone()
            self._closed_memo[execution_id] = None if row is None else row[0]
        return self._closed_memo[execution_id]

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev, et = item.event, item.type
        if et in ("execution_opened", "execution_closed"):
            self._closed_memo.pop(ev["execution_id"], None)
        if et == "execution_opened":
            if ev.get("collection_id"):
                db.execute("INSERT OR IGNORE INTO collection_executions (execution_id, collection_id, occurred_at) "
                           "VALUES (?,?,?)", (ev["execution_id"], ev["collection_id"], ev["occurred_at"]))
        elif et == "request":
            closed = self._closed(db, ev["execution_id"])
            if closed is None or closed:
                return  # not a campaign's execution, or a request after closure (ignored everywhere)
            gap = ev["generator"] == "policy" and bool(ev["output_ids"]) and not ev.get("output_logprobs")
            db.execute("INSERT OR IGNORE INTO collection_requests VALUES (?,?,?,?)",
                       (ev["execution_id"], ev["request_id"], f"{ev['agent_tier']}/{ev['turn_kind']}", int(gap)))
        elif et == "execution_closed":
            db.execute("UPDATE collection_executions SET closed = 1 WHERE execution_id = ?", (ev["execution_id"],))
        elif et == "collection_manifest":
            body = {k: ev.get(k) for k in _BODY_FIELDS}
            for k in _JSON_FIELDS:
                if body[k] is not None:
                    body[k] = json.loads(body[k])
            db.execute("INSERT OR IGNORE INTO collection_manifests VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       (ev["collection_id"], ev["version"], ev["use"], ev.get("consumer"), ev["capability"],
                        json.dumps(list(ev.get("required_capture") or [])), json.dumps(list(ev.get("routes") or [])),
                        ev["evaluation_claim"], json.dumps(body, sort_keys=True), ev["occurred_at"], ev["event_id"]))
        elif et == "admission_policy":
            if ev.get("collection_id"):
                db.execute("INSERT OR IGNORE INTO collection_routes VALUES (?,?,?,?)",
                           (ev["route"], ev["version"], ev["collection_id"], ev["occurred_at"]))
        elif et == "checkpoint_trained":
            cur = db.execute("INSERT OR IGNORE INTO model_checkpoints VALUES (?,?,?,?)",
                             (ev["checkpoint_id"], json.dumps(list(ev.get("evaluation_claims") or [])), ev["occurred_at"],
                              ev["event_id"]))
            if cur.rowcount:
                db.executemany("INSERT OR IGNORE INTO checkpoint_manifests VALUES (?,?,?)",
                               [(ev["checkpoint_id"], m["route"], m["version"]) for m in ev["manifests"]])


# ------------------------------------------------------------------------------ reads


def _has(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone() is not None


def route_collection(db: sqlite3.Connection, route: str, version: int) -> str | None:
    """The ``collection_id`` option of a route version (from the admission projection's ``routes``)."""
    row = db.execute("SELECT options FROM routes WHERE route = ? AND version = ?", (route, version)).fetchone()
    return json.loads(row[0] or "{}").get("collection_id") if row else None


def routes_naming(db: sqlite3.Connection, collection_id: str) -> set[str]:
    """Routes (any version) whose options name ``collection_id`` (the admission projection marks them dirty
    when a manifest version of the campaign arrives)."""
    if not _has(db, "routes"):
        return set()
    return {r for r, opts in db.execute("SELECT route, options FROM routes")
            if json.loads(opts or "{}").get("collection_id") == collection_id}


def _campaign_of(db: sqlite3.Connection, ex: str) -> str | None:
    """The campaign of ``ex``; a derived view inherits its parent's."""
    for cur in iter_ancestors(db, ex):
        row = db.execute("SELECT collection_id FROM collection_executions WHERE execution_id = ?", (cur,)).fetchone()
        if row is not None:
            return row[0]
    return None


def _latest_manifest(db: sqlite3.Connection, collection_id: str):
    return db.execute("SELECT version, required_capture FROM collection_manifests WHERE collection_id = ? "
                      "ORDER BY version DESC LIMIT 1", (collection_id,)).fetchone()


def campaign_gate(db: sqlite3.Connection, route, ex: str, base):
    """The ``record_adequacy`` step of a semantics >= 2 route that names a ``collection_id``.

    ``base`` is the route-independent record-adequacy verdict (an object with ``verdict``).  Returns
    ``None`` when the route names no campaign (``base`` stands), else ``(verdict, reason, missing)``:
    a campaign without a manifest is ``pending`` on "collection_manifest <id>" (every execution); an
    execution of another campaign or of none is ``fail`` naming both ids; once the record is complete (``base`` not
    pending), the campaign's required capture (latest manifest version) is checked and what is
    missing named; otherwise ``base`` stands."""
    cid = route_collection(db, route.name, route.version)
    if cid is None:
        return None
    if not _has(db, "collection_executions"):
        return ("unknown", "collection manifests not projected", "collections projection")
    manifest = _latest_manifest(db, cid)
    if manifest is None:  # no contract yet: nothing is decided on this route
        return ("pending", f"collection {cid} has no collection manifest", f"collection_manifest {cid}")
    opened = db.execute("SELECT opened FROM assessment_executions WHERE execution_id = ?", (ex,)).fetchone()
    own = _campaign_of(db, ex)
    if own != cid and (own is not None or (opened is not None and opened[0])):
        where = f"collection {own}" if own is not None else "no collection campaign"
        return ("fail", f"execution {ex} belongs to {where}; route {route.name} admits collection {cid} only", None)
    if base.verdict == "pending":
        return (base.verdict, base.reason, base.missing)
    version, required = manifest[0], json.loads(manifest[1])
    owner = ex if db.execute("SELECT 1 FROM collection_executions WHERE execution_id = ?", (ex,)).fetchone() else None
    src = owner or root_of(db, ex)
    roles = [r[0] for r in db.execute("SELECT DISTINCT role_class FROM collection_requests WHERE execution_id = ?", (src,))]
    gaps = [r[0] for r in db.execute("SELECT request_id FROM collection_requests WHERE execution_id = ? AND logprob_gap = 1",
                                     (src,))]
    calls = [r[0] for r in db.execute("SELECT call_id FROM capture_calls WHERE execution_id = ? AND consumed = 1 "
                                      "AND result = 0", (src,))] if _has(db, "capture_calls") else []
    missing = missing_capture(required, role_classes=roles, calls_without_result=calls, outputs_without_logprobs=gaps)
    if missing:
        return ("fail", f"required capture of collection_manifest {cid} v{version} missing: " + "; ".join(missing), None)
    return (base.verdict, base.reason, base.missing)


def campaign_summary(db: sqlite3.Connection, collection_id: str, *, route: str | None = None) -> dict:
    """A campaign's manifest in force, its executions and the declarations made after sampling began
    (restricted to ``route``'s versions when given)."""
    rows = db.execute("SELECT version, body, occurred_at FROM collection_manifests WHERE collection_id = ? ORDER BY version",
                      (collection_id,)).fetchall()
    n, first = db.execute("SELECT COUNT(*), MIN(occurred_at) FROM collection_executions WHERE collection_id = ?",
                          (collection_id,)).fetchone()
    decls = [{"declaration": "collection_manifest", "id": collection_id, "version": v, "occurred_at": at}
             for v, _b, at in rows]
    q = "SELECT route, version, occurred_at FROM collection_routes WHERE collection_id = ?"
    args: tuple = (collection_id,)
    if route is not None:
        q, args = q + " AND route = ?", (collection_id, route)
    decls += [{"declaration": "admission_policy", "id": r, "version": v, "occurred_at": at}
              for r, v, at in db.execute(q, args)]
    late = late_declarations(first, decls)
    return {"collection_id": collection_id,
            "manifest": json.loads(rows[-1][1]) if rows else None,
            "manifest_versions": [v for v, _b, _a in rows],
            "executions": n,
            "first_execution_at": None if first is None else format_micros(first),
            "declared_after_sampling": bool(late),
            "late_declarations": [{**{k: d[k] for k in ("declaration", "version")},
                                   ("collection_id" if d["declaration"] == "collection_manifest" else "route"): d["id"],
                                   "occurred_at": format_micros(d["occurred_at"])} for d in late]}


def datasheet_section(db: sqlite3.Connection, route) -> dict:
    """``{"collection": ...}`` for the manifest datasheet of a semantics >= 2 route naming a campaign, else ``{}``."""
    if not route.use_specific or not _has(db, "collection_manifests"):
        return {}
    cid = route_collection(db, route.name, route.version)
    return {} if cid is None else {"collection": campaign_summary(db, cid, route=route.name)}


def summaries(db: sqlite3.Connection) -> dict:
    """Every campaign (``ledger status --json`` ``collections``)."""
    if not _has(db, "collection_manifests"):
        return {}
    ids = sorted({r[0] for r in db.execute("SELECT collection_id FROM collection_manifests UNION "
                                           "SELECT collection_id FROM collection_executions UNION "
                                           "SELECT collection_id FROM collection_routes")})
    out = {}
    for cid in ids:
        s = campaign_summary(db, cid)
        out[cid] = {k: s[k] for k in ("manifest_versions", "executions", "first_execution_at", "declared_after_sampling",
                                      "late_declarations")}
    return out


def checkpoints_for(db: sqlite3.Connection, route: str, version: int) -> list[dict]:
    """The checkpoints trained on manifest (``route``, ``version``), each with its evaluation claims."""
    if not _has(db, "checkpoint_manifests"):
        return []
    return [{"checkpoint_id": c, "evaluation_claims": json.loads(claims)} for c, claims in db.execute(
        "SELECT c.checkpoint_id, c.evaluation_claims FROM checkpoint_manifests m JOIN model_checkpoints c "
        "ON c.checkpoint_id = m.checkpoint_id WHERE m.route = ? AND m.version = ? ORDER BY c.checkpoint_id",
        (route, version))]


def name_checkpoints(db: sqlite3.Connection, manifests: list[dict]) -> None:
    """Add ``checkpoints`` (when any) to each ``{route, version, ...}`` entry of an impact report."""
    for m in manifests:
        cks = checkpoints_for(db, m["route"], int(m["version"]))
        if cks:
            m["checkpoints"] = cks


def leak_checkpoints(db: sqlite3.Connection, offender: dict, route: str, version: int) -> dict:
    """Name, on a leak offender of ``ledger splits check``, the checkpoints trained on the affected manifest
    (``route`` v``version``) and the evaluation claims to re-run (seed 002 15.4.2: retire the checkpoint,
    re-evaluate); the offender is returned unchanged when no checkpoint trained on it."""
    cks = checkpoints_for(db, route, int(version))
    if cks:
        claims = sorted({c for ck in cks for c in ck["evaluation_claims"]})
        offender["checkpoints"] = [ck["checkpoint_id"] for ck in cks]
        offender["evaluation_claims"] = claims
        offender["detail"] += (f"; checkpoints trained on {route} v{version}: {', '.join(offender['checkpoints'])} "
                               f"(retire; re-run evaluation claims: {', '.join(claims) or 'none recorded'})")
    return offender
