"""`ledger finalize --due`: the one place the wall clock enters (SPEC §4.2 ExecutionFinalized).

Executions whose deadline has passed and that are not finalized yet get an
``execution_finalized`` event; replay then excludes those without a valid reward.
"""

from __future__ import annotations

import sqlite3
import time

from ledger.producers.ingest import Ingestor, IngestReport


def due_executions(db: sqlite3.Connection, now_micros: int) -> list[str]:
    """Executions whose deadline is before ``now_micros`` and that are not finalized.

    Derived views are left out: the tree projection copies their row (deadline, finalized)
    from their parent, whose own finalization they follow."""
    views = ""
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'lineage'").fetchone() is not None:
        views = " AND execution_id NOT IN (SELECT derived_execution_id FROM lineage)"
    return [r[0] for r in db.execute(
        "SELECT execution_id FROM executions WHERE deadline_us < ? AND finalized = 0" + views + " ORDER BY execution_id",
        (now_micros,))]


def finalize_due(db: sqlite3.Connection, ingestor: Ingestor, now_micros: int | None = None) -> tuple[list[str], IngestReport]:
    now = time.time_ns() // 1000 if now_micros is None else now_micros
    due = due_executions(db, now)
    lines = [(i, {"type": "execution_finalized", "execution_id": ex}) for i, ex in enumerate(due, 1)]
    report = ingestor.ingest_lines(lines) if lines else IngestReport()
    return due, report
