"""``ledger project --follow``: latency from an append's return to the projection showing it applied (issue 33).

A private tansu broker; a **producer process** appends :mod:`workloads.scenario` executions
(Qwen3.6-rendered coding-agent runs with prefix references, sealed, one ``Ingestor`` batch per
execution, the signed governance preamble first) at a steady rate of ``RATE`` batches a second;
``ledger project --follow`` runs as its own process (every projection, one database).  For every
batch the producer reports the moment ``Ingestor.submit`` returned and the positions it wrote; this
process polls the projector's tracking table (``_positions``, committed in the same transaction as
the state: :mod:`projections.engine`) every ``POLL`` seconds and records when every position of
the batch is below its partition's ``next_offset``.  Latency = that moment - the append's return
(``time.monotonic``, one clock for every process), p50 and p99 over the batches after the first
(the projector's start-up), beside the appends' own duration (the baseline: what the producer waits
for anyway).  ``POLL`` bounds the error (+0..POLL).

Sizes: ``LEDGER_BENCH_FOLLOW_SECONDS`` (default 8), ``LEDGER_BENCH_FOLLOW_RATE`` (batches a second,
default 4), ``LEDGER_BENCH_FOLLOW_TURNS`` (main-agent turns per execution, default 13, ≈ 50 events).
Run: ``python -m benchmarks bench_follow``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from .common import print_table, row

SECONDS = float(os.environ.get("LEDGER_BENCH_FOLLOW_SECONDS", "8"))
RATE = float(os.environ.get("LEDGER_BENCH_FOLLOW_RATE", "4"))
TURNS = int(os.environ.get("LEDGER_BENCH_FOLLOW_TURNS", "13"))
POLL = 0.002
SEED = 34


def _produce(url: str, workdir: str, seconds: float, rate: float, turns: int, out) -> None:
    """The producer process: the preamble, then one execution per ``1 / rate`` s; sends
    ``(returned_at, append_seconds, [(topic, partition, offset), ...])`` per batch, then ``None``."""
    os.chdir(workdir)
    os.environ["LEDGER_DATA_KEYS"] = str(Path(workdir) / "data-keys.db")
    from ledger.events.signing import Trust, load_private_key
    from ledger.log import open_log
    from ledger.log.kafka import parse_position
    from ledger.producers.ingest import Ingestor
    from workloads import scenario

    key = load_private_key(Path("gov.key"))
    with open_log(url) as log:
        ing = Ingestor(log, Trust.load(Path("trust.json")), producer="bench-follow")
        batches = scenario.batches(10**6, seed=SEED, key=key, turns=turns, derive_every=0, withdraw_every=0)
        start = time.monotonic()
        for i, lines in enumerate(batches):
            due = start + i / rate
            if due - start > seconds:
                break
            time.sleep(max(0.0, due - time.monotonic()))
            t0 = time.monotonic()
            rep = ing.ingest_lines(list(enumerate(lines, 1)))
            t1 = time.monotonic()
            out.send((t1, t1 - t0, [parse_position(p) for _e, p in rep.result.appended]))
        ing.close()
    out.send(None)


def _applied(db: sqlite3.Connection) -> dict[tuple[str, int], int]:
    try:
        return {(s, p): o for s, p, o in db.execute("SELECT stream, partition, next_offset FROM _positions")}
    except sqlite3.OperationalError:  # the projector has not created its tables yet
        return {}


def _watch(db_path: Path, conn, deadline: float) -> tuple[list[float], list[float]]:
    """Poll the tracking table until every reported batch is applied; (latencies, append durations)."""
    pending: list[tuple[float, float, list]] = []
    latencies, appends, done = [], [], False
    db = None
    while (not done or pending) and time.monotonic() < deadline:
        while conn.poll():
            msg = conn.recv()
            if msg is None:
                done = True
            else:
                pending.append(msg)
        if db is None and db_path.exists():
            db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        positions = _applied(db) if db is not None and pending else {}
        now = time.monotonic()
        still = []
        for returned, took, where in pending:
            if all(positions.get((t, p), -1) > off for t, p, off in where):
                latencies.append(max(0.0, now - returned))
                appends.append(took)
            else:
                still.append((returned, took, where))
        pending = still
        time.sleep(POLL)
    if db is not None:
        db.close()
    if pending:
        raise RuntimeError(f"{len(pending)} batches were not applied before the deadline")
    return latencies, appends


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _setup(tmp: Path) -> None:
    from ledger.events.catalog import SIGNED_TYPES
    from ledger.events.signing import Trust, new_private_key, public_bytes, write_private_key

    key = new_private_key()
    write_private_key(key, tmp / "gov.key")
    trust = Trust()
    trust.add(public_bytes(key), list(SIGNED_TYPES))
    trust.save(tmp / "trust.json")


def measure(broker: str, tmp: Path, seconds: float = SECONDS, rate: float = RATE, turns: int = TURNS) -> list[dict]:
    _setup(tmp)
    url = f"kafka://{broker}/follow{uuid.uuid4().hex[:8]}?partitions=4&index={tmp}/idx.db"
    env = dict(os.environ, LEDGER_DATA_KEYS=str(tmp / "data-keys.db"))
    from ledger.log import open_log

    open_log(url, create=True).close()
    projector = subprocess.Popen([sys.executable, "-m", "ledger.cli", "--store", url, "project", "--follow", "--batch",
                                  "500"], cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe(duplex=False)
    producer = ctx.Process(target=_produce, args=(url, str(tmp), seconds, rate, turns, theirs))
    try:
        producer.start()
        latencies, appends = _watch(tmp / "projections.db", mine, time.monotonic() + seconds + 120)
        producer.join(30)
    finally:
        projector.terminate()
        own = projector.communicate(timeout=60)[0].strip()
        if producer.is_alive():
            producer.terminate()
    own = f"projector: {own.splitlines()[-1]}" if own else ""
    lat, app = latencies[2:], appends[2:]  # the preamble and the first execution meet the projector's start-up
    label = f"{len(lat)} executions at {rate:g}/s, {turns} turns"
    return [row(f"project --follow (Kafka): append returned -> applied, p50 ({label})", statistics.median(lat) * 1e3,
                statistics.median(app) * 1e3, "ms (baseline: the append's own duration, p50)", note=own),
            row(f"project --follow (Kafka): append returned -> applied, p99 ({label})", _quantile(lat, 0.99) * 1e3,
                _quantile(app, 0.99) * 1e3, "ms (baseline: the append's own duration, p99)")]


def run(broker: str | None = None) -> list[dict]:
    from .bench_kafka import tansu

    with tempfile.TemporaryDirectory(prefix="bench-follow-") as d:
        if broker is not None:
            return measure(broker, Path(d))
        with tansu() as b:
            return measure(b, Path(d))


if __name__ == "__main__":
    print_table(run(sys.argv[1] if len(sys.argv) > 1 else None))
