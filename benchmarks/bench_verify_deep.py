"""``ledger manifest verify --deep`` on a large store, relative to a full replay of it (issue 33).

The store: :mod:`workloads.scenario` (Qwen3.6-rendered coding-agent executions with prefix
references, sealed as ``ledger ingest`` stores it, the governance preamble with an ``sft`` route,
derived views and withdrawals), ingested in one batch per execution, projected with
``ledger project`` and published (``ledger manifest publish sft``).  Same run, same store:
``manifest verify --deep`` as a CLI process (best of ``REPEAT``), the interpreter's start-up and
the CLI's imports alone, and an in-process replay with every projection into a fresh database
(:func:`benchmarks.bench_replay.replay`).  Ratio = verify / replay seconds (lower is better).

Sizes: ``LEDGER_BENCH_VERIFY_EXECUTIONS`` (default 20, ≈ 1.3k events: CI-friendly); the
issue's 100k-event store is ≈ 1,500 executions.  ``LEDGER_BENCH_VERIFY_STORE=DIR`` measures a
store built before (``python -m benchmarks.bench_verify_deep build N DIR``; it holds
``store/`` and ``manifest.json``), so the build is paid once.
Run: ``python -m benchmarks bench_verify_deep``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .bench_replay import replay
from .common import print_table, row, timed

N_EXECUTIONS = int(os.environ.get("LEDGER_BENCH_VERIFY_EXECUTIONS", "20"))
REPEAT = int(os.environ.get("LEDGER_BENCH_VERIFY_REPEAT", "3"))
SEED = 33


def build(n_executions: int, root: Path) -> tuple[Path, Path]:
    """A projected, published store of ``n_executions`` scenario executions under ``root``;
    returns the store directory and the manifest's path."""
    from ledger.cli import main
    from ledger.events.catalog import SIGNED_TYPES
    from ledger.events.signing import Trust, new_private_key, public_bytes, write_private_key
    from ledger.log import open_log
    from ledger.log.paths import store_paths
    from ledger.producers.ingest import Ingestor
    from workloads import scenario

    root.mkdir(parents=True, exist_ok=True)
    key = new_private_key()
    write_private_key(key, root / "gov.key")
    trust = Trust()
    trust.add(public_bytes(key), list(SIGNED_TYPES))
    paths = store_paths(str(root / "store"))
    with open_log(paths.url, create=True) as log:
        trust.save(paths.trust)
        ing = Ingestor(log, trust, producer="bench-verify")
        try:
            line = 1
            for batch in scenario.batches(n_executions, seed=SEED, key=key):
                ing.ingest_lines(list(enumerate(batch, line)))
                line += len(batch)
        finally:
            ing.close()
    manifest = root / "manifest.json"
    quiet = ["--store", paths.url]
    if main([*quiet, "project"]) != 0 or main([*quiet, "manifest", "publish", "sft", "--key", str(root / "gov.key"),
                                                "--out", str(manifest)]) != 0:
        raise RuntimeError("building the verify store failed")
    return Path(paths.url), manifest


def measure(store: Path, manifest: Path, tmp: Path, repeat: int = REPEAT) -> list[dict]:
    import sqlite3

    events = sqlite3.connect(store / "index.db").execute("SELECT COUNT(*) FROM events").fetchone()[0]
    cmd = [sys.executable, "-m", "ledger.cli", "--store", str(store), "manifest", "verify", str(manifest), "--deep"]
    t_verify = timed(lambda: subprocess.run(cmd, cwd=manifest.parent, check=True, capture_output=True), repeat)
    t_start = timed(lambda: subprocess.run([sys.executable, "-c", "import ledger.cli"], check=True), repeat)
    t_replay = timed(lambda: replay(store, tmp / "r.db", strict=False), repeat)
    return [row(f"manifest verify --deep, {events:,}-event store (s) vs in-process replay of it (s)", t_verify,
                t_replay, "s (lower is better)", note=f"replay {events / t_replay:,.0f} events/s"),
            row(f"  the same minus the CLI's start-up (python -c 'import ledger.cli', {t_start:.2f} s)",
                t_verify - t_start, t_replay, "s (lower is better)")]


def run() -> list[dict]:
    given = os.environ.get("LEDGER_BENCH_VERIFY_STORE")
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as d:
        if given:
            return measure(Path(given) / "store", Path(given) / "manifest.json", Path(d))
        store, manifest = build(N_EXECUTIONS, Path(d) / "v")
        return measure(store, manifest, Path(d))


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"]:
        t0 = time.perf_counter()
        store, manifest = build(int(sys.argv[2]), Path(sys.argv[3]))
        print(f"built {store} and {manifest} in {time.perf_counter() - t0:.0f} s")
    else:
        print_table(run())
