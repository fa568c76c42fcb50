"""Manifest publications projection (SPEC §4.2 ManifestPublished, §6.4, §6.6).

Table ``manifests``: one row per accepted ManifestPublished — the signed header of a
published corpus manifest (route, version, route_version, Merkle root and size, the log
position it was built at, the SHA-256 of the whole signed document, the signing key and the
event's own log position).

Why there is no ``manifest_members`` table here.  The log carries only the header; the
member list lives in the manifest document.  A projection may hold only what the log
determines (SPEC §3), and re-deriving the members while applying the event is not
deterministic: the event may land after other events that changed admissions since the
build position, projections may finish a batch later than the event, and on Kafka the
executions partitions have no common order with the governance topic.  So the member lists
are read from the published documents instead — the publisher keeps a copy of every
manifest in the store's archive (``ledger.corpus.publish.archive_path``), and a reader accepts a
document only if ``sha256(canonical JSON)`` equals this table's ``manifest_sha256``, so the
log authenticates the archive.  When a document is lost, ``ledger manifest verify --deep``
style replay to ``log_position`` rebuilds exactly the same members (the root proves it).

Rules (deterministic: the governance topic is totally ordered, and signatures were already
checked by the engine against the trust file):

* versions of a route count its publications: a ManifestPublished whose ``version`` is not
  the route's latest + 1 is refused (recorded in ``_rejected`` with the reason);
* ``root`` must be 64 lowercase hex digits and ``size`` non-negative.
"""

from __future__ import annotations

import re
import sqlite3

from ledger.projections.engine import Applied, Rejected, TableProjection

__all__ = ["ManifestsProjection", "latest_version", "manifest_row", "published_manifests"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS manifests (
    route TEXT NOT NULL, version INTEGER NOT NULL, route_version INTEGER NOT NULL,
    root TEXT NOT NULL, size INTEGER NOT NULL, log_position INTEGER NOT NULL, manifest_sha256 TEXT NOT NULL,
    key_id TEXT, event_id TEXT NOT NULL, published_at_us INTEGER NOT NULL, event_position TEXT NOT NULL,
    PRIMARY KEY (route, version)
);
"""
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_COLUMNS = ("route", "version", "route_version", "root", "size", "log_position", "manifest_sha256", "key_id",
            "event_id", "published_at_us", "event_position")


class ManifestsProjection(TableProjection):
    """Records every accepted ManifestPublished header in ``manifests``."""

    name = "manifests"
    event_types = frozenset(("manifest_published",))  # what apply acts on (the engine dispatches by type)

    SCHEMA = _SCHEMA

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        if item.type != "manifest_published":
            return
        ev, rec = item.event, item.record
        route, version = ev["route"], int(ev["version"])
        if not _HEX64.match(ev["root"]) or not _HEX64.match(ev["manifest_sha256"]):
            raise Rejected("root and manifest_sha256 must be 64 lowercase hex digits")
        if ev["size"] < 0 or ev["log_position"] < 0:
            raise Rejected("size and log_position must be non-negative")
        latest = latest_version(db, route)
        if version != latest + 1:
            raise Rejected(f"route {route!r} has {latest} publication(s); the next version must be {latest + 1}, "
                           f"got {version}")
        sig = ev.get("signature") or {}
        db.execute(f"INSERT INTO manifests ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                   (route, version, int(ev["route_version"]), ev["root"], int(ev["size"]), int(ev["log_position"]),
                    ev["manifest_sha256"], sig.get("key_id"), ev["event_id"], int(ev["occurred_at"]),
                    f"{rec.stream}:{rec.partition}:{rec.offset}"))


def _has_table(db: sqlite3.Connection) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='manifests'").fetchone() is not None


def latest_version(db: sqlite3.Connection, route: str) -> int:
    """The number of publications of ``route`` recorded so far (0 when none)."""
    if not _has_table(db):
        return 0
    return db.execute("SELECT COALESCE(MAX(version), 0) FROM manifests WHERE route = ?", (route,)).fetchone()[0]


def manifest_row(db: sqlite3.Connection, route: str, version: int) -> dict | None:
    """The recorded header of one publication, or ``None``."""
    if not _has_table(db):
        return None
    row = db.execute(f"SELECT {', '.join(_COLUMNS)} FROM manifests WHERE route = ? AND version = ?",
                     (route, version)).fetchone()
    return dict(zip(_COLUMNS, row)) if row else None


def published_manifests(db: sqlite3.Connection, route: str | None = None) -> list[dict]:
    """Every recorded publication (of one route, or all), ordered by route and version."""
    if not _has_table(db):
        return []
    sql = f"SELECT {', '.join(_COLUMNS)} FROM manifests"
    args: tuple = ()
    if route is not None:
        sql += " WHERE route = ?"
        args = (route,)
    return [dict(zip(_COLUMNS, r)) for r in db.execute(sql + " ORDER BY route, version", args)]
