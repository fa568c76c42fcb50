"""The cost of re-deriving the projections at publish time (SPEC 11.7, issue 27 item 3).

``manifest publish`` replays the log into a fresh temporary database up to the positions the
store's ``projections.db`` has applied, compares every projection table with it, and builds the
manifest from the fresh replay (:mod:`ledger.corpus.projection_check`).  Same run, same store
(the demo's: ``examples/demo.py`` run into a temporary folder, or ``LEDGER_BENCH_DEMO_STORE``),
each publication on a fresh copy of it: ``publish`` as shipped vs ``publish`` with the check
replaced by the store's own database (what publish did before: build from ``projections.db``).
Target: at most 2x (ratio = checked / plain seconds).  Run: ``python -m benchmarks bench_publish_check``.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import ledger.corpus.publish as publish_mod
from ledger.corpus.projection_check import Rederived
from ledger.log.paths import store_paths

from .common import print_table, row

ROUNDS = int(os.environ.get("LEDGER_BENCH_PUBLISH_ROUNDS", "7"))
ROUTE = "rl-main"


@contextlib.contextmanager
def _unchecked(log, path, projections, trust):
    """The check left out: the store's own database, at the positions it has applied."""
    db = sqlite3.connect(str(path), isolation_level=None)
    try:
        yield Rederived(db, positions={(s, p): o for s, p, o in db.execute("SELECT * FROM _positions")})
    finally:
        db.close()


def _demo_store(tmp: Path) -> tuple[Path, Path]:
    given = os.environ.get("LEDGER_BENCH_DEMO_STORE")
    if given:
        return Path(given), Path(given).parent / "gov.key"
    import examples.demo as demo

    demo.OUT, demo.STORE = tmp / "demo-out", tmp / "demo-out" / "store"
    with contextlib.redirect_stdout(io.StringIO()):
        demo.main()
    return demo.STORE, demo.OUT / "gov.key"


def _copy(store: Path, to: Path) -> Path:
    """A copy of the store, its projection database copied with SQLite's backup (WAL included)."""
    shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(store, to, ignore=shutil.ignore_patterns("projections.db*"))
    src, dst = sqlite3.connect(store / "projections.db"), sqlite3.connect(to / "projections.db")
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return to


def _publish_once(store: Path, key: Path, tmp: Path, checked: bool) -> tuple[float, float]:
    s = _copy(store, tmp / "s")
    real = publish_mod.rederived
    if not checked:
        publish_mod.rederived = _unchecked
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        publish_mod.publish(store_paths(str(s)), ROUTE, key=key, out=tmp / "m.json")
        return time.perf_counter() - t0, time.process_time() - c0
    finally:
        publish_mod.rederived = real


def run() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as d:
        tmp = Path(d)
        store, key = _demo_store(tmp)
        events = sum(1 for _ in sqlite3.connect(store / "index.db").execute("SELECT 1 FROM events"))
        _publish_once(store, key, tmp, True)  # warm imports and caches on both paths
        _publish_once(store, key, tmp, False)
        plain, checked = [], []
        for _ in range(ROUNDS):  # interleaved, so that load on a shared machine hits both alike
            checked.append(_publish_once(store, key, tmp, True))
            plain.append(_publish_once(store, key, tmp, False))
    rows = []
    for i, what in enumerate(("wall", "CPU")):
        c, p = statistics.median(t[i] for t in checked), statistics.median(t[i] for t in plain)
        rows.append(row(f"manifest publish, projections re-derived from the log vs not, {what} (demo, {events} events)",
                        c, p, f"s {what} (median of {ROUNDS}; ratio = checked / plain, lower is better)",
                        note="target <= 2"))
    return rows


if __name__ == "__main__":
    print_table(run())
