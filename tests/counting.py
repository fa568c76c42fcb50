"""A minimal projection for engine tests: one row per applied event, so a double apply shows."""

from __future__ import annotations

import sqlite3

from ledger.projections.engine import Applied, Rejected


class CountingProjection:
    name = "counting"

    def create(self, db: sqlite3.Connection) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS seen (event_id TEXT NOT NULL, times INTEGER NOT NULL, PRIMARY KEY (event_id))")
        db.execute("CREATE TABLE IF NOT EXISTS type_counts (event_type TEXT PRIMARY KEY, n INTEGER NOT NULL)")

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        if item.event.get("request_id") == "refuse-me":
            raise Rejected("test refusal")
        db.execute("INSERT INTO seen VALUES (?, 1) ON CONFLICT(event_id) DO UPDATE SET times = times + 1",
                   (item.event["event_id"],))
        db.execute("INSERT INTO type_counts VALUES (?, 1) ON CONFLICT(event_type) DO UPDATE SET n = n + 1", (item.type,))

    def finish(self, db: sqlite3.Connection) -> None:
        pass

    def reset(self) -> None:
        pass
