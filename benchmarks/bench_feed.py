"""Benchmark: the online feed (SPEC 11.6), latency and throughput.

**Latency.**  A producer thread appends the demo workload continuously (:mod:`workloads.scenario`:
Qwen3.6-rendered coding-agent executions, governance preamble with an ``sft`` route, j_max 2): each
execution's recorded events first, then -- ``pause`` seconds later -- its assessment and
``execution_finalized`` in one append.  A consumer (``Feed``, embedded log, default execution groups)
yields and acknowledges batches meanwhile.  Latency = time the batch is yielded minus the time the
finalizing append was called (so it includes the append, the feed's catch-up replay, admission and
building the records), p50 / p99 over the admitted executions.  Target (SPEC 11.8): p50 < 1 s.

**Throughput.**  The same records two ways, same run, same store: ``ledger export`` (replay into a fresh
projection database, then write the route's records as JSON lines) against a fresh feed consumer (its
own database replayed from zero, then every batch yielded and its records written as JSON lines, no
acknowledgement), and the yield-only part (a caught-up consumer) against the export-only part.

``python -m benchmarks bench_feed`` or ``python benchmarks/bench_feed.py [N_EXECUTIONS]``.
"""

from __future__ import annotations

import io
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import print_table, row, signed_store

SEED = 31


def _store(root: Path):
    from ledger.producers.ingest import Ingestor
    from workloads import scenario

    key, trust, paths, log = signed_store(root)
    ingestor = Ingestor(log, trust, producer="bench-feed")
    ingestor.ingest_lines(list(enumerate(scenario.sign_all(scenario.preamble(), key), 1)))
    return paths, log, ingestor, trust


def _split(lines: list[dict]) -> tuple[list[dict], list[dict]]:
    """An execution's lines: everything but its assessment, then the assessment + execution_finalized."""
    body = [x for x in lines if x["type"] != "assessment"]
    tail = [x for x in lines if x["type"] == "assessment"]
    ex = next(x["execution_id"] for x in lines if x["type"] == "execution_opened")
    return body, tail + [{"type": "execution_finalized", "execution_id": ex}]


def _produce(ingestor, n: int, pause: float, finalized_at: dict[str, float]) -> None:
    from workloads import scenario

    for i in range(n):
        body, tail = _split(scenario.execution_lines(i, seed=SEED, turns=13))
        ingestor.ingest_lines(list(enumerate(body, 1)))
        time.sleep(pause)
        finalized_at[tail[-1]["execution_id"]] = time.perf_counter()
        ingestor.ingest_lines(list(enumerate(tail, 1)))
        time.sleep(pause)


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def latency(n: int = 60, pause: float = 0.02) -> tuple[list[float], object, Path]:
    import ledger

    root = Path(tempfile.mkdtemp(prefix="bench-feed-"))
    paths, log, ingestor, trust = _store(root)
    finalized_at: dict[str, float] = {}
    producer = threading.Thread(target=_produce, args=(ingestor, n, pause, finalized_at), daemon=True)
    lat: list[float] = []
    with ledger.Feed(paths, "sft", "bench", trust=trust, poll_interval=0.01) as feed:
        producer.start()
        step = 0
        for batch in feed.batches(idle_timeout=3.0):
            now = time.perf_counter()
            lat += [now - finalized_at[ex] for ex in batch.executions if ex in finalized_at]
            step += 1
            feed.ack(batch, step=step)
    producer.join()
    log.close()
    return lat, paths, root


def throughput(paths, root: Path) -> list[dict]:
    import ledger
    from ledger.corpus.export import write_jsonl, trainer_records
    from ledger.events.signing import Trust
    from ledger.log import open_log
    from ledger.projections.registry import open_engine

    trust = Trust.load(paths.trust)

    def export(db_name: str):
        with open_log(paths.url) as log:
            t0 = time.perf_counter()
            engine = open_engine(log, root / db_name, trust)
            engine.run()
            t1 = time.perf_counter()
            s = write_jsonl(trainer_records(engine.db, "sft"), io.StringIO())
            t2 = time.perf_counter()
            engine.db.close()
        return t2 - t0, t2 - t1, s.records

    def feed(consumer: str):
        from ledger.algorithms.canonical import canonical_json

        out = io.StringIO()
        t0 = time.perf_counter()
        with ledger.Feed(paths, "sft", consumer, trust=trust) as f:  # opening replays the log into its database
            t1 = time.perf_counter()  # yield-only from here: a caught-up consumer
            n = 0
            for batch in f.batches(follow=False):
                for r in batch.records:
                    out.write(canonical_json(r).decode("utf-8") + "\n")
                n += len(batch.records)
            t2 = time.perf_counter()
        return t2 - t0, t2 - t1, n

    rows = []
    exp_total, exp_only, n_exp = min((export(f"export-{i}.db") for i in range(3)), key=lambda x: x[0])
    feed_total, feed_only, n_feed = min((feed(f"bulk-{i}") for i in range(3)), key=lambda x: x[0])
    assert n_exp == n_feed, (n_exp, n_feed)
    rows.append(row(f"feed replay+yield records/s vs export (project+write), {n_feed} records",
                    n_feed / feed_total, n_exp / exp_total, "rec/s"))
    rows.append(row("feed yield-only records/s vs export write-only", n_feed / feed_only, n_exp / exp_only, "rec/s"))
    return rows


def run(n: int = 60) -> list[dict]:
    lat, paths, root = latency(n)
    p50, p99 = _quantile(lat, 0.5), _quantile(lat, 0.99)
    rows = [row(f"feed latency p50, finalized -> yielded ({len(lat)} admitted of {n})", p50, 1.0, "s",
                note="target: value < 1 s (ratio < 1)"),
            row("feed latency p99, finalized -> yielded", p99, 1.0, "s")]
    return rows + throughput(paths, root)


if __name__ == "__main__":
    print_table(run(int(sys.argv[1]) if len(sys.argv) > 1 else 60))
