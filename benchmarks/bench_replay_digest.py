"""The cost of verifying every event's digest during replay (SPEC §9 "Replay trusts no byte").

Same log, same run: ``ReplayEngine`` with every projection (``all_projections``) over an
unsealed realistic log (:func:`workloads.synthetic.generate`, prefix-referenced), with the
digest check (the engine as shipped) vs with the check disabled (``event_digest`` replaced by a
value that compares equal to any digest).  Figures are events/s; ratio = checked / unchecked.
Run: ``python -m benchmarks bench_replay_digest``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import ledger.projections.engine as engine_mod
from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.projections.registry import open_engine
from workloads import synthetic as workload

from .common import print_table, row, timed

N_EXECUTIONS = int(os.environ.get("LEDGER_BENCH_DIGEST_EXECUTIONS", "40"))


class _Any:
    """Compares equal to every digest: the check disabled."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False


def _replay(store: Path, db_path: Path) -> None:
    if db_path.exists():
        db_path.unlink()
    with open_log(str(store)) as log:
        eng = open_engine(log, db_path, None)
        eng.run()
        eng.db.close()


def run() -> list[dict]:
    lines = workload.with_prefix_references(workload.generate(N_EXECUTIONS, seed=7))
    events = [(i, validate_line(line, line=i, now_micros=0)) for i, line in enumerate(lines, 1)]
    with tempfile.TemporaryDirectory() as d:
        store = Path(d) / "s"
        with open_log(str(store), create=True) as log:
            ing = Ingestor(log, seal=None)
            for i in range(0, len(events), 500):
                ing.submit(events[i:i + 500])
        n = len(events)
        nbytes = (store / "events.dat").stat().st_size
        checked = timed(lambda: _replay(store, Path(d) / "c.db"), 3)
        real = engine_mod.event_digest
        engine_mod.event_digest = lambda _value: _Any()
        try:
            unchecked = timed(lambda: _replay(store, Path(d) / "u.db"), 3)
        finally:
            engine_mod.event_digest = real
    return [row(f"replay, all projections, digest verified vs not ({n} events, {nbytes / 1e6:.1f} MB)",
                n / checked, n / unchecked, "events/s (vs the check disabled, same log)")]


if __name__ == "__main__":
    print_table(run())
