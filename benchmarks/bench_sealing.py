"""The cost of sealing by default (SPEC §9 "Erase always means erased"), same run, same events.

* ingest: ``Ingestor.submit`` of a realistic workload (:func:`workloads.synthetic.generate`,
  prefix-referenced requests as the recorder writes them) with ``seal="execution"`` (the
  default: AES-GCM per execution, deterministic nonce, keys in ``data-keys.db``) vs
  ``seal=None`` on the same lines;
* replay: ``ReplayEngine`` with the tree projection over the sealed log (every request opened
  with the store's keys) vs over the unsealed log.

Each figure is events/s, the unsealed run is the baseline: ratio = sealed / unsealed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.tree import TreeProjection
from workloads import synthetic as workload

from .common import print_table, row, timed

N_EXECUTIONS = int(os.environ.get("LEDGER_BENCH_SEAL_EXECUTIONS", "40"))
BATCH = 500


def _events(n: int) -> list[tuple[int, dict]]:
    out = []
    for i, line in enumerate(workload.with_prefix_references(workload.generate(n, seed=7)), 1):
        out.append((i, validate_line(line, line=i, now_micros=0)))
    return out


def _ingest(store: Path, events: list[tuple[int, dict]], seal: str | None) -> None:
    with open_log(str(store), create=True) as log:
        ing = Ingestor(log, seal=seal)
        try:
            for i in range(0, len(events), BATCH):
                ing.submit(events[i:i + BATCH])
        finally:
            ing.close()


def _replay(store: Path, db_path: Path) -> None:
    if db_path.exists():
        db_path.unlink()
    with open_log(str(store)) as log:
        db = connect(db_path)
        ReplayEngine(log, db, [TreeProjection()]).run()
        db.close()


def run() -> list[dict]:
    events = _events(N_EXECUTIONS)
    n = len(events)
    with tempfile.TemporaryDirectory() as d:
        counter = iter(range(10**6))
        t_sealed = timed(lambda: _ingest(Path(d) / f"s{next(counter)}", events, "execution"), 2)
        t_plain = timed(lambda: _ingest(Path(d) / f"p{next(counter)}", events, None), 2)
        sealed_store, plain_store = Path(d) / "sealed", Path(d) / "plain"
        _ingest(sealed_store, events, "execution")
        _ingest(plain_store, events, None)
        r_sealed = timed(lambda: _replay(sealed_store, Path(d) / "rs.db"), 2)
        r_plain = timed(lambda: _replay(plain_store, Path(d) / "rp.db"), 2)
        sizes = (sealed_store / "events.dat").stat().st_size, (plain_store / "events.dat").stat().st_size
    return [
        row(f"ingest sealed per execution vs unsealed ({N_EXECUTIONS} executions, {n} events)", n / t_sealed, n / t_plain,
            "events/s (vs seal=None, same lines)"),
        row("replay (tree projection) of the sealed log vs the unsealed log", n / r_sealed, n / r_plain,
            "events/s (vs unsealed log)", note=f"log bytes sealed/plain = {sizes[0] / sizes[1]:.3f}"),
    ]


if __name__ == "__main__":
    print_table(run())
