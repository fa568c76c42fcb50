"""The gateway's sqlite side state, ``gateway.db`` beside the store (SPEC 7.6, 11.4): drift and call counts,
the restoration state of every call (message-key digests and response metadata) and the Responses API's
stored conversations; read by ``ledger status`` / ``ledger report`` (:func:`drift_counts`) and scrubbed by
``withdraw --erase`` (:func:`forget_executions`)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["connect", "drift_counts", "forget_executions", "gateway_db_path"]


def gateway_db_path(store_dir: str | Path) -> Path:
    """The gateway's side file (drift counts) beside an embedded store (or in the working
    directory for a Kafka store)."""
    return Path(store_dir) / "gateway.db"


def connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(str(path), timeout=30, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    # a commit is durable against a process crash at once (the WAL is written before COMMIT returns); the fsync
    # is left to checkpoints, so concurrent calls are not serialised on one fsync each (group commit, SPEC 11.4)
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS drift (execution_id TEXT NOT NULL, request_id TEXT NOT NULL, "
               "agent_id TEXT NOT NULL, cause TEXT NOT NULL, at_message INTEGER, at_token INTEGER, "
               "parent_request_id TEXT, PRIMARY KEY (execution_id, request_id))")
    db.execute("CREATE TABLE IF NOT EXISTS calls (execution_id TEXT NOT NULL, request_id TEXT NOT NULL, "
               "kind TEXT NOT NULL, PRIMARY KEY (execution_id, request_id))")
    # restoration state (module doc, 4.): digests of message keys + response metadata; tokens stay on the log
    db.execute("CREATE TABLE IF NOT EXISTS state (execution_id TEXT NOT NULL, request_id TEXT NOT NULL, "
               "agent_id TEXT NOT NULL, turn_kind TEXT NOT NULL, keys TEXT NOT NULL, assistant TEXT NOT NULL, "
               "meta TEXT NOT NULL, PRIMARY KEY (execution_id, request_id))")
    # Responses API (SPEC 11.4): what previous_response_id resolves to -- the conversation's new messages and
    # output per response (message text: purged with the execution by withdraw --erase)
    db.execute("CREATE TABLE IF NOT EXISTS responses (response_id TEXT PRIMARY KEY, execution_id TEXT NOT NULL, "
               "request_id TEXT NOT NULL, previous TEXT, messages TEXT NOT NULL, meta TEXT NOT NULL)")
    db.commit()
    return db


def drift_counts(path: Path, *, strict: bool = False) -> dict | None:
    """``{"calls", "by_match": {...}, "drift": {cause: n}}`` from a gateway.db (None if absent;
    None if unreadable too, unless ``strict``: then ``sqlite3.DatabaseError`` says why)."""
    if not path.exists():
        return None
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        drift = {c: 0 for c in ("template", "retokenization", "edited_history", "other")}
        drift.update(dict(db.execute("SELECT cause, COUNT(*) FROM drift GROUP BY cause").fetchall()))
        kinds = dict(db.execute("SELECT kind, COUNT(*) FROM calls GROUP BY kind ORDER BY kind").fetchall())
        return {"calls": sum(kinds.values()), "by_match": kinds, "drift": drift}
    except sqlite3.DatabaseError:
        if strict:
            raise
        return None
    finally:
        db.close()


def forget_executions(path: Path, execution_ids: Sequence[str], *, timeout: float = 30.0) -> int:
    """Delete the restoration state of ``execution_ids`` from a gateway.db (``withdraw --erase``):
    its message-key digests (and the Responses API conversations) are derived from the erased content, so
    they go with it (pages zeroed, WAL truncated).  Drift and call counts, which hold ids and causes only, stay.
    Returns the rows deleted (0 when there is no gateway.db).  Waits up to ``timeout`` seconds for a lock; raises
    ``sqlite3.OperationalError`` (locked) when the WAL could not be truncated (a reader kept it),
    so that the caller retries -- the deletion itself is idempotent."""
    if not path.exists() or not execution_ids:
        return 0
    db = sqlite3.connect(path, timeout=timeout)
    try:
        db.execute("PRAGMA secure_delete=ON")
        n = 0
        ids = list(dict.fromkeys(execution_ids))
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            marks = ','.join('?' * len(chunk))
            n += db.execute(f"DELETE FROM state WHERE execution_id IN ({marks})", chunk).rowcount
            n += _delete_if_table(db, f"DELETE FROM responses WHERE execution_id IN ({marks})", chunk)
        db.commit()
        if db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:
            raise sqlite3.OperationalError("database is locked (a reader kept the WAL from being truncated)")
        return n
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):  # a gateway.db written before restoration state was kept
            return 0
        raise
    finally:
        db.close()


def _delete_if_table(db: sqlite3.Connection, sql: str, args: Sequence[str]) -> int:
    try:
        return db.execute(sql, args).rowcount
    except sqlite3.OperationalError as exc:  # a gateway.db written before that table existed
        if "no such table" in str(exc):
            return 0
        raise


# ------------------------------------------------------------------ rows of one call (the caller holds the lock)
def state_rows(db: sqlite3.Connection, execution_id: str) -> list[tuple]:
    """``(request_id, agent_id, turn_kind, keys, assistant, meta)`` of an execution's calls, in recording order."""
    return db.execute("SELECT request_id, agent_id, turn_kind, keys, assistant, meta FROM state "
                      "WHERE execution_id = ? ORDER BY rowid", (execution_id,)).fetchall()


def write_call(db: sqlite3.Connection, row: tuple, match_kind: str, drift: tuple | None,
               parent: str | None) -> None:
    """Commit a call's state ``row`` (execution, request, agent, turn kind, keys, assistant, meta as JSON text),
    its match kind and its drift (``(cause, at_message, at_token)`` or None)."""
    db.execute("INSERT OR REPLACE INTO state VALUES (?,?,?,?,?,?,?)", row)
    db.execute("INSERT OR REPLACE INTO calls VALUES (?,?,?)", (row[0], row[1], match_kind))
    if drift is not None:
        db.execute("INSERT OR REPLACE INTO drift VALUES (?,?,?,?,?,?,?)",
                   (row[0], row[1], row[2], drift[0], drift[1], drift[2], parent))
    db.commit()


def drop_calls(db: sqlite3.Connection, execution_id: str, request_ids: Sequence[str]) -> None:
    """Delete the rows of calls that never reached the log (state, calls, drift)."""
    for table in ("state", "calls", "drift"):
        db.executemany(f"DELETE FROM {table} WHERE execution_id = ? AND request_id = ?",
                       [(execution_id, rid) for rid in request_ids])
    db.commit()


def response_row(db: sqlite3.Connection, response_id: str) -> tuple | None:
    """``(execution_id, request_id, previous, messages, meta)`` of a stored response (None if unknown)."""
    return db.execute("SELECT execution_id, request_id, previous, messages, meta FROM responses "
                      "WHERE response_id = ?", (response_id,)).fetchone()


def insert_response(db: sqlite3.Connection, response_id: str, execution_id: str, request_id: str,
                    previous: str | None, messages: list[dict], meta: Mapping[str, Any]) -> None:
    db.execute("INSERT OR IGNORE INTO responses VALUES (?,?,?,?,?,?)",
               (response_id, execution_id, request_id, previous,
                json.dumps(messages, ensure_ascii=False), json.dumps(meta, ensure_ascii=False)))
    db.commit()
