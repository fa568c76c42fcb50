"""Embedded log ingest vs raw baselines on the same bytes (SPEC §8, first rows).

* large request events through ``Ingestor.submit`` (encode, content hash, digest, idempotency
  lookup, append with fdatasync, index commit) vs ``write`` + ``fdatasync`` of the same
  encoded bytes to a plain file, in the same batch sizes;
* small events (execution-scoped, ~300 B) vs raw SQLite ``executemany`` of the same bytes.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
from pathlib import Path

import numpy as np

from ledger.events.codec import default_codec
from ledger.events.validate import validate_line
from ledger.log import open_log
from ledger.producers.ingest import Ingestor, submission

from .common import print_table, row, timed


def _large_events(n: int, tokens: int, seed: int = 0) -> list[tuple[int, dict]]:
    rng = np.random.default_rng(seed)
    evs = [(0, validate_line({"type": "execution_opened", "execution_id": "bench", "task_id": "t",
                              "deadline": "2030-01-01T00:00:00Z", "policy": "p"}, now_micros=0))]
    for i in range(n):
        inp = rng.integers(0, 150_000, tokens).tolist()
        out = rng.integers(0, 150_000, 256).tolist()
        evs.append((i, validate_line({"type": "request", "execution_id": "bench", "request_id": f"r{i}", "input_ids": inp,
                                      "output_ids": out, "output_logprobs": [-0.5] * 256}, now_micros=0)))
    return evs


def _small_events(n: int) -> list[tuple[int, dict]]:
    evs = [(0, validate_line({"type": "execution_opened", "execution_id": "bench", "task_id": "t",
                              "deadline": "2030-01-01T00:00:00Z", "policy": "p"}, now_micros=0))]
    for i in range(n):
        evs.append((i, validate_line({"type": "cost_recorded", "execution_id": "bench", "amount": 0.01 * i,
                                      "category": "generation", "event_id": f"cost-{i}"}, now_micros=0)))
    return evs


def bench_large(n: int = 400, tokens: int = 32_768, batch: int = 20) -> dict:
    events = _large_events(n, tokens)
    encoded = [default_codec().encode(ev) for _, ev in events]
    nbytes = sum(len(b) for b in encoded)
    with tempfile.TemporaryDirectory() as d:
        counter = iter(range(10**6))

        def ledger_run() -> None:
            store = Path(d) / f"s{next(counter)}"
            with open_log(str(store), create=True) as log:
                ing = Ingestor(log)
                for i in range(0, len(events), batch):
                    ing.submit(events[i:i + batch])

        def raw_run() -> None:
            fd = os.open(Path(d) / f"raw{next(counter)}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            for i in range(0, len(encoded), batch):
                os.write(fd, b"".join(encoded[i:i + batch]))
                os.fdatasync(fd)
            os.close(fd)

        t_ledger = timed(ledger_run, 2)
        t_raw = timed(raw_run, 2)
    mb = nbytes / 1e6
    return row(f"embedded ingest, {n} request events x {nbytes / len(encoded) / 1024:.0f} KiB (batch {batch})",
               mb / t_ledger, mb / t_raw, "MB/s (vs raw append+fdatasync)", 0.5)


def bench_small(n: int = 20_000, batch: int = 1000) -> dict:
    events = _small_events(n)
    subs = [submission(ev) for _, ev in events]
    with tempfile.TemporaryDirectory() as d:
        counter = iter(range(10**6))

        def ledger_run() -> None:
            with open_log(str(Path(d) / f"s{next(counter)}"), create=True) as log:
                ing = Ingestor(log)
                for i in range(0, len(events), batch):
                    ing.submit(events[i:i + batch])

        def raw_run() -> None:
            db = sqlite3.connect(Path(d) / f"raw{next(counter)}.db", isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v BLOB)")
            for i in range(0, len(subs), batch):
                db.execute("BEGIN")
                db.executemany("INSERT INTO t (v) VALUES (?)", [(s.value,) for s in subs[i:i + batch]])
                db.execute("COMMIT")
            db.close()

        t_ledger = timed(ledger_run, 2)
        t_raw = timed(raw_run, 2)
    size = sum(len(s.value) for s in subs) / len(subs)
    return row(f"embedded ingest, {n} small events (~{size:.0f} B, batch {batch})", n / t_ledger, n / t_raw,
               "events/s (vs SQLite executemany)", 0.5)


def run() -> list[dict]:
    return [bench_large(), bench_small()]


if __name__ == "__main__":
    print_table(run())
