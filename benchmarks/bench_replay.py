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
from ledger.projections.registry import open_engine

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
    from .bench_floors import _fresh

    with open_log(str(store)) as log:
        eng = open_engine(log, _fresh(db_path), None)  # sealed requests open with the store's own keys
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


def floor_steps(store: Path, db: Path, tmp: Path) -> dict[str, float]:
    """Each step a replay of ``store`` must take, timed alone (best of three, wall): the SPEC §9 digest
    check, opening the sealed requests (one key lookup and cipher per key, as the tree projection does),
    resolving prefix references + prefix matching in memory, and writing the final state once
    (``db``, a replay's database: :func:`benchmarks.bench_floors.sqlite_floor`)."""
    from ledger.algorithms.prefix_match import Tree, output_flag
    from ledger.events.codec import event_digest
    from ledger.log.sealing import KeyCache, KeyStore, store_keys_path, unseal

    from .bench_floors import sqlite_floor

    codec = default_codec()
    with open_log(str(store)) as log:
        records = [r for w in log.partitions() for r in log.read(w)]
    decoded = [codec.decode(r.value) for r in records]
    with KeyStore(store_keys_path(str(store))) as keystore:
        cache = KeyCache(keystore)

        def open_all() -> list:
            cache.clear()
            return [unseal(ev, cache) if ev["event_type"] == "request" else ev for ev in decoded]

        plain = [ev for ev in open_all() if ev["event_type"] == "request"]
        t_open = timed(open_all, 3)

    def match_all() -> None:
        trees: dict[str, Tree] = {}
        for ev in plain:
            tree = trees.setdefault(ev["execution_id"], Tree())
            ref = ev["input_prefix"]
            inp = ev["input_ids"] if ref is None else \
                tree.resolve_prefix(ref["request_id"], ref["length"], ref["sha256"]) + ev["input_suffix_ids"]
            tree.insert(ev["request_id"], len(tree.requests), inp, ev["output_ids"], ev["output_logprobs"],
                        output_flag(ev["generator"], ev["reconstructed"]), hint=ev["parent_request_id"])
        for tree in trees.values():
            tree.release()

    return {"digest check": timed(lambda: [event_digest(r.value) == r.digest for r in records], 3),
            "opening the sealed requests": t_open, "prefix references + matching (in memory)": timed(match_all, 3),
            "SQLite: the final tables written once (executemany, one commit, close)": sqlite_floor(db, tmp)}


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        store, n = build_store(Path(d))
        t_decode = decode_alone(store)
        t_replay = timed(lambda: replay(store, Path(d) / "r.db"), 3)
        steps = floor_steps(store, Path(d) / "r.db", Path(d))
    unit = "events/s (vs decode alone, same log, same run)"
    label = f"realistic sealed log ({n} events)"
    rows = [row(f"replay, every projection, {label} vs fastavro decode alone", n / t_replay, n / t_decode,
                "events/s (same log, same run)", 0.5)]
    rows += [row(f"  floor, {label}: {what} alone", n / t, n / t_decode, unit) for what, t in steps.items()]
    rows.append(row(f"  floor, {label}: decode + the steps above, zero glue (one core)", n / (t_decode + sum(steps.values())),
                    n / t_decode, unit, 0.5))
    return rows + verify_deep_rows()


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
