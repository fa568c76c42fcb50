"""`ledger status`: counts per projection and the log head."""

from __future__ import annotations

from pathlib import Path

from ledger.log.base import Log
from ledger.log.paths import StorePaths, checkpoint_identity
from ledger.corpus.integrity import partition_head, store_frontiers
from ledger.projections.engine import connect
import sqlite3
from ledger.reports.status_extras import extras
from ledger.projections.consumers import consumer_lag


def status(log: Log, paths: StorePaths, db=None, frontiers: dict | None = None) -> dict:
    """``db``: an open (say read-only) projection database to read instead of ``paths.db``
    (``ledger serve``); it is left open.  ``frontiers``: the log heads' Merkle frontiers kept between
    calls (:func:`ledger.corpus.integrity.partition_head`; ``ledger serve``)."""
    ends = log.end_offsets()

    frontiers = {} if frontiers is None else frontiers
    if not frontiers:  # a new process: start from the frontiers saved at the last signed checkpoint
        frontiers.update(store_frontiers(log, paths))
    heads = {}
    for where in log.partitions():
        size, root = partition_head(log, where, ends.get(where, 0), frontiers)
        heads[f"{where[0]}:{where[1]}"] = {"size": size, "root": root.hex()}
    out: dict = {"log": {"url": paths.url, "events": sum(ends.values()),
                         "partitions": {f"{s}:{p}": n for (s, p), n in ends.items()},
                         "head": heads, "conflicts": len(log.conflicts())}}
    # the auditor's verifier key of the checkpoints `ledger log head` signs (None: no checkpoint key here)
    ident = checkpoint_identity(paths, write=False) if paths.checkpoint_key.exists() else None
    out["checkpoint_origin"] = ident["origin"] if ident else None
    out["checkpoint_vkey"] = ident["vkey"] if ident else None
    gateway = _gateway(paths)
    if gateway is not None:  # the capture gateway's calls and divergences by cause (SPEC 7.6)
        out["gateway"] = gateway
        if "error" in gateway:
            out["problems"] = [gateway["error"]]
    if db is None and not Path(paths.db).exists():
        out["projections"] = {"note": "no projection database yet (run `ledger project`)"}
        return out

    own = db is None
    if own:
        db = connect(paths.db)
    try:
        applied = {f"{s}:{p}": n for s, p, n in db.execute("SELECT stream, partition, next_offset FROM _positions")}
        import sqlite_utils  # cold path: sqlite_utils

        tables = {t.name: t.count for t in sorted(sqlite_utils.Database(db).tables, key=lambda t: t.name)}
        out["projections"] = {"applied": applied, "behind": sum(ends.values()) - sum(applied.values()), "tables": tables}
        out.update(extras(db))
        lag = consumer_lag(db)
        if lag:  # SPEC 11.6: per feed consumer, admitted members of its route not consumed yet
            out["consumers"] = lag
    finally:
        if own:
            db.close()
    return out


def _gateway(paths: StorePaths) -> dict | None:
    """The gateway's drift counts; ``{"error": why}`` for a gateway.db that cannot be read, damaged or
    not a database (SPEC 11.7: reported, never silently left out); None when no gateway ran on the store."""

    from ledger.gateway.store import drift_counts, gateway_db_path  # cold path: gateway.db is read by these commands only

    path = gateway_db_path(Path(".") if paths.is_kafka else Path(paths.url))
    try:
        return drift_counts(path, strict=True)
    except sqlite3.DatabaseError as exc:
        return {"error": f"the capture gateway's database {path} cannot be read, it is damaged or busy ({exc}); "
                         "its drift counts are missing from this status"}
