"""Declared canaries (SPEC §11.2; seed 002 §15.9.3).

Projection ``canaries``.  Table ``canaries(canary_id, token_ids, tokenizer, scope, event_id,
position)``: one row per accepted ``canary`` event — the token sequence a training manifest
must never contain (a text canary's tokens were stamped at ingest), the splits it is
planted in (JSON list) and where on the log it was declared.  The text of a text canary is
not kept here: the projection holds what the scan needs, and reports show ids, lengths and
scopes, never a canary's value.

Rules (deterministic: ``canary`` is a governance event, totally ordered, its signature
already checked by the engine):

* the first declaration of a ``canary_id`` holds (a second with other content is a
  conflict on the log; on Kafka, where a producer could bypass ingest, the first wins);
* a canary without ``token_ids`` (a text canary that did not come through ingest, which
  tokenizes it) is refused and recorded in ``_rejected``: it could not be scanned for.

``manifest publish`` reads :func:`declared` at the log position it builds at, so a rebuild
for ``manifest verify --deep`` sees exactly the canaries declared before that manifest.
"""

from __future__ import annotations

import json
import sqlite3

from ledger.projections.engine import Applied, Rejected, TableProjection

__all__ = ["CanariesProjection", "declared"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS canaries (
    canary_id TEXT PRIMARY KEY, token_ids BLOB NOT NULL, tokenizer TEXT, scope TEXT NOT NULL,
    event_id TEXT NOT NULL, position TEXT NOT NULL
);
"""


class CanariesProjection(TableProjection):
    """Records every accepted canary declaration in ``canaries``."""

    name = "canaries"
    event_types = frozenset(("canary",))  # what apply acts on (the engine dispatches by type)
    SCHEMA = _SCHEMA

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        if item.type != "canary":
            return
        ev, rec = item.event, item.record
        if not ev.get("token_ids"):
            raise Rejected(f"canary {ev['canary_id']!r} has no token_ids: a text canary is tokenized when `ledger "
                           "ingest` accepts it, and this one was written to the log another way")
        db.execute("INSERT OR IGNORE INTO canaries VALUES (?,?,?,?,?,?)",
                   (ev["canary_id"], ev["token_ids"], ev.get("tokenizer"), json.dumps(list(ev["scope"])),
                    ev["event_id"], f"{rec.stream}:{rec.partition}:{rec.offset}"))


def declared(db: sqlite3.Connection) -> list[dict]:
    """Every declared canary, by ``canary_id``: ``{canary_id, token_ids (packed bytes), tokenizer,
    scope, event_id, position}`` (an empty list when the projection is absent)."""
    try:
        rows = db.execute("SELECT canary_id, token_ids, tokenizer, scope, event_id, position FROM canaries "
                          "ORDER BY canary_id").fetchall()
    except sqlite3.OperationalError:
        return []
    return [{"canary_id": cid, "token_ids": bytes(tok), "tokenizer": tokenizer, "scope": json.loads(scope),
             "event_id": eid, "position": pos} for cid, tok, tokenizer, scope, eid, pos in rows]
