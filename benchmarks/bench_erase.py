"""The cost of erasing in every projection database (SPEC 11.7), same run, same sealed log.

A withdrawal with ``erase`` purges the covered token payloads wherever it is applied, and SQLite
must not keep the deleted bytes in free pages.  Two ways to get there:

* **secure_delete** (chosen): every projection connection runs with ``PRAGMA secure_delete=ON``,
  so deleted cells and freed pages are zeroed as they go; the purge is the DELETEs plus one WAL
  truncation.  Its cost is paid by every replay;
* **VACUUM**: replay without secure_delete, and rewrite the whole database after each purge.

Rows (ratio = value / baseline, both measured here):

1. replay (tree + governance projections) of the realistic sealed log with secure_delete ON vs OFF;
2. applying one erase withdrawal to an up-to-date database: secure_delete purge (DELETE + WAL
   truncation) vs the purge followed by a VACUUM (what the other design needs per erasure).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from ledger.events.signing import Trust, new_private_key, public_bytes, sign_line
from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.log.sealing import KeyStore, store_keys_path
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.governance import GovernanceProjection
from ledger.projections.tree import TreeProjection

from .bench_sealing import _events, _ingest
from .common import print_table, row, now

N_EXECUTIONS = int(os.environ.get("LEDGER_BENCH_ERASE_EXECUTIONS", "40"))


def _engine(log, db_path: Path, trust: Trust, keys: KeyStore, secure: bool) -> ReplayEngine:
    db = connect(db_path)
    if not secure:
        db.execute("PRAGMA secure_delete=OFF")
    return ReplayEngine(log, db, [TreeProjection(keystore=keys), GovernanceProjection()], trust=trust)


def _replay(store: Path, db_path: Path, trust: Trust, secure: bool) -> None:
    for f in db_path.parent.glob(db_path.name + "*"):
        f.unlink()
    with open_log(str(store)) as log, KeyStore(store_keys_path(str(store))) as keys:
        eng = _engine(log, db_path, trust, keys, secure)
        eng.run()
        eng.db.close()


def _erase(store: Path, base: Path, db_path: Path, trust: Trust, secure: bool) -> float:
    """Copy the up-to-date database, then time applying the withdrawal (the purge and WAL truncation),
    plus a VACUUM when not secure.  Returns the seconds of that part (the copy is not timed)."""
    for f in db_path.parent.glob(db_path.name + "*"):
        f.unlink()
    shutil.copyfile(base, db_path)
    with open_log(str(store)) as log, KeyStore(store_keys_path(str(store))) as keys:
        eng = _engine(log, db_path, trust, keys, secure)
        t0 = now()
        eng.run()
        if not secure:
            eng.db.execute("VACUUM")
            eng.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        took = now() - t0
        eng.db.close()
    return took


def _best_alternating(a: Callable[[], float], b: Callable[[], float], repeat: int) -> tuple[float, float]:
    """Best of ``repeat`` runs of each, alternating a, b, a, b (a loaded machine drifts)."""
    ta, tb = float("inf"), float("inf")
    for _ in range(repeat):
        ta, tb = min(ta, a()), min(tb, b())
    return ta, tb


def _timing(fn: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        t0 = now()
        fn()
        return now() - t0
    return run


def _withdraw_first(store: Path, events: list[tuple[int, dict]]) -> Trust:
    key = new_private_key()
    trust = Trust()
    trust.add(public_bytes(key), ["withdrawal"])
    victim = next(ev["execution_id"] for _, ev in events if ev["event_type"] == "request")
    line = sign_line({"type": "withdrawal", "subject": f"execution:{victim}", "reason": "bench", "authority": "bench",
                      "erase": True}, key)
    with open_log(str(store)) as log:
        Ingestor(log, trust).ingest_lines([(1, line)])
    return trust


def run() -> list[dict]:
    events = _events(N_EXECUTIONS)
    n = len(events)
    with tempfile.TemporaryDirectory() as d:
        store = Path(d) / "sealed"
        _ingest(store, events, "execution")
        trust = Trust()
        t_on, t_off = _best_alternating(_timing(lambda: _replay(store, Path(d) / "on.db", trust, True)),
                                        _timing(lambda: _replay(store, Path(d) / "off.db", trust, False)), 4)
        size = (Path(d) / "on.db").stat().st_size
        base = Path(d) / "base.db"
        _replay(store, base, trust, True)
        trust = _withdraw_first(store, events)
        e_secure, e_vacuum = _best_alternating(lambda: _erase(store, base, Path(d) / "es.db", trust, True),
                                               lambda: _erase(store, base, Path(d) / "ev.db", trust, False), 4)
    return [
        row(f"replay (tree+governance), secure_delete ON vs OFF ({N_EXECUTIONS} executions, {n} events)",
            n / t_on, n / t_off, "events/s (vs secure_delete OFF)"),
        row("apply one erase: secure_delete purge vs purge + VACUUM", 1 / e_secure, 1 / e_vacuum,
            "erasures/s (vs VACUUM)", note=f"database {size / 2**20:.1f} MiB; secure {e_secure * 1e3:.0f} ms, "
                                           f"vacuum {e_vacuum * 1e3:.0f} ms"),
    ]


if __name__ == "__main__":
    print_table(run())
