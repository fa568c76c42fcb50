"""Full replay with every projection vs decoding the same log alone (issue 33, SPEC §11.8).

Same log, same run: the realistic sealed log (:func:`workloads.synthetic.generate`,
prefix-referenced, sealed as ``ledger ingest`` stores it), replayed by
:func:`projections.registry.open_engine` (every projection, the store's data keys) into a fresh
database, vs the fastavro decode of every record alone (the floor: zero glue).  Target: ≥ 0.5.
``--profile`` prints the replay's top cProfile frames (tottime) instead.
Run: ``python -m benchmarks bench_replay``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from ledger.events.codec import default_codec
from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from projections.registry import open_engine

from .common import print_table, row, timed

N_EXECUTIONS = int(os.environ.get("LEDGER_BENCH_REPLAY_EXECUTIONS", "40"))


def build_store(root: Path, n_executions: int = N_EXECUTIONS) -> tuple[Path, int]:
    """A realistic sealed store under ``root``; returns its path and its number of events."""
    from workloads import synthetic as workload

    lines = workload.with_prefix_references(workload.generate(n_executions, seed=7))
    events = [(i, validate_line(line, line=i, now_micros=0)) for i, line in enumerate(lines, 1)]
    store = root / "s"
    with open_log(str(store), create=True) as log:
        ing = Ingestor(log)  # sealed by default
        for i in range(0, len(events), 500):
            ing.submit(events[i:i + 500])
    return store, len(events)


def replay(store: Path, db_path: Path, strict: bool = True) -> None:
    """Every projection over the whole log into a fresh database at ``db_path`` (``strict``: nothing
    may be rejected or dead-lettered)."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    with open_log(str(store)) as log:
        eng = open_engine(log, db_path, None)  # sealed requests open with the store's own keys
        stats = eng.run()
        eng.db.close()
    if strict and (stats.dead_letters or stats.rejected):
        raise RuntimeError(f"replay: {stats}")


def decode_alone(store: Path) -> float:
    codec = default_codec()
    with open_log(str(store)) as log:
        values = [r.value for w in log.partitions() for r in log.read(w)]
    return timed(lambda: [codec.decode(v) for v in values], 3)


def verify_deep_rows() -> list[dict]:
    """``ledger manifest verify --deep`` of the demo's manifest v2 (a CLI process) vs replaying the
    demo store with every projection in process; both wall seconds, best of three."""
    import subprocess

    from .bench_publish_check import _demo_store

    with tempfile.TemporaryDirectory() as d:
        store, _key = _demo_store(Path(d))
        cmd = [sys.executable, "-m", "ledger.cli", "--store", str(store), "manifest", "verify",
               str(store.parent / "manifest-v2.json"), "--deep"]  # v1 names erased members (exit 1)
        t_verify = timed(lambda: subprocess.run(cmd, cwd=store.parent, check=True, capture_output=True), 3)
        t_start = timed(lambda: subprocess.run([sys.executable, "-c", "import ledger.cli"], check=True), 3)
        t_replay = timed(lambda: replay(store, Path(d) / "r.db", strict=False), 3)  # erased requests are refused
    return [row("manifest verify --deep, demo store (s) vs in-process replay of it (s)", t_verify, t_replay, "s"),
            row("  the same minus the CLI's start-up (python -c 'import ledger.cli')", t_verify - t_start, t_replay, "s")]


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        store, n = build_store(Path(d))
        t_decode = decode_alone(store)
        t_replay = timed(lambda: replay(store, Path(d) / "r.db"), 3)
    return [row(f"replay, every projection, realistic sealed log ({n} events) vs fastavro decode alone",
                n / t_replay, n / t_decode, "events/s (same log, same run)", 0.5)] + verify_deep_rows()


def profile(limit: int = 30) -> None:
    import cProfile
    import pstats

    with tempfile.TemporaryDirectory() as d:
        store, _n = build_store(Path(d))
        prof = cProfile.Profile()
        prof.runcall(replay, store, Path(d) / "p.db")
    pstats.Stats(prof).sort_stats("tottime").print_stats(limit)


if __name__ == "__main__":
    if "--profile" in sys.argv:
        profile()
    else:
        print_table(run())
