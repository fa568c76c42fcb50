"""Scale-out benchmark (issue 7): projector processes in a consumer group on Kafka.

``run(broker=None)`` returns rows ``{name, value, baseline, ratio, unit}`` (a tansu broker is
started when none is given), each figure beside its same-run baseline:

* **throughput**: the same realistic log (``workloads.scenario``: token-level agent executions,
  governance, credits; 4 executions partitions) projected by 1 and by 2 ``ledger project
  --follow --group`` processes started together on the full log; events/s = distinct events /
  (last commit - first commit) over all processes (wall clocks from their ``--stats``
  files; group join and shutdown are outside the window); median of ``repeats``.  The machine
  has 2 cores shared with the broker, and the busier half of the partitions bounds the
  2-process makespan, so 2.0x is out of reach.
* **latency**: produce -> applied (committed in the shard) for events appended one
  execution at a time while 2 projectors follow; p50 and p99 beside a bare
  ``read_committed`` consumer's produce -> received latency of the same messages (the
  transport's own share).

Standalone: ``python benchmarks/bench_scaleout.py [HOST:PORT]``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import row  # noqa: E402
from ledger.events.catalog import SIGNED_TYPES  # noqa: E402
from ledger.events.signing import Trust, new_private_key, public_bytes  # noqa: E402
from ledger.log.kafka import KafkaLog  # noqa: E402
from ledger.producers.ingest import Ingestor  # noqa: E402
from ledger.runtime.cluster import LocalCluster  # noqa: E402
from workloads import scenario  # noqa: E402

PARTITIONS = 4


class _Recording:
    """A log wrapper that keeps every appended batch of submissions (to replay them elsewhere)."""

    def __init__(self, log: KafkaLog) -> None:
        self.log = log
        self.batches: list[list] = []

    def append(self, subs):
        self.batches.append(list(subs))
        return self.log.append(subs)

    def __getattr__(self, name):
        return getattr(self.log, name)


def _positions(results) -> dict:
    out: dict = {}
    for res in results:
        for _eid, pos in res.appended:
            topic, part, off = pos.rsplit(":", 2)
            key = (topic, int(part))
            out[key] = max(out.get(key, 0), int(off) + 1)
    return out


def _split(subs: list, n: int) -> list[list]:
    return [subs[i:i + n] for i in range(0, len(subs), n)]


def _throughput(url: str, trust_path: Path, tmp: Path, n: int, want: dict, tag: str, events: int) -> tuple[float, dict]:
    cluster = LocalCluster(url, trust_path, tmp / f"state-{tag}", f"bench-{tag}", workdir=tmp / f"w-{tag}")
    try:
        names = cluster.start(n)
        if not cluster.wait_caught_up(want, timeout=300):
            raise RuntimeError(f"{n} projector(s) did not catch up: {cluster.positions()}")
        codes = cluster.stop_all()
        if any(c != 0 for c in codes.values()):
            raise RuntimeError(f"projectors exited with {codes}")
        stats = [cluster.stats(name) or {} for name in names]
    finally:
        cluster.stop_all(5)
    first = min(s["first_apply_at"] for s in stats if s.get("first_apply_at"))
    last = max(s["last_apply_at"] for s in stats if s.get("last_apply_at"))
    applied = sum(s.get("applied", 0) for s in stats)  # governance counts once per shard
    return events / (last - first), {"applied": applied, "window_s": round(last - first, 3),
                                     "assignments": [s.get("assignments") for s in stats]}


def _bare_latency(bootstrap: str, prefix: str, stop: threading.Event, out: list[float]) -> None:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-bare-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "fetch.wait.max.ms": 25, "enable.auto.commit": False,
                  "log_level": 0})
    c.assign([TopicPartition(f"{prefix}.governance", 0, 0)] +
             [TopicPartition(f"{prefix}.executions", p, 0) for p in range(PARTITIONS)])
    while not stop.is_set():
        m = c.poll(0.05)
        if m is None or m.error() is not None:
            continue
        ts_type, ts = m.timestamp()
        if ts_type != 0 and ts > 0:
            out.append(max(0.0, time.time() - ts / 1000.0))
    c.close()


def _latency(broker: str, trust_path: Path, tmp: Path, batches: list[list], gap: float) -> tuple[dict, dict]:
    prefix = f"lat{uuid.uuid4().hex[:8]}"
    url = f"kafka://{broker}/{prefix}?partitions={PARTITIONS}&index={tmp}/{prefix}.db"
    log = KafkaLog(url, create=True)
    cluster = LocalCluster(url, trust_path, tmp / "state-lat", "bench-lat", workdir=tmp / "w-lat")
    bare: list[float] = []
    stop = threading.Event()
    th = threading.Thread(target=_bare_latency, args=(broker, prefix, stop, bare), daemon=True)
    try:
        cluster.start(2)
        if not cluster.wait_owned(range(PARTITIONS), timeout=60):
            raise RuntimeError("the latency group did not form")
        th.start()
        results = []
        for subs in batches:
            results.append(log.append(subs))
            time.sleep(gap)
        if not cluster.wait_caught_up(_positions(results), timeout=120):
            raise RuntimeError("latency projectors did not catch up")
        cluster.stop_all()
        stats = [cluster.stats(n) or {} for n in ("p0", "p1")]
    finally:
        stop.set()
        cluster.stop_all(5)
        log.close()
    th.join(5)
    lat = [s.get("latency_ms", {}) for s in stats]
    applied = {"p50": max(x.get("p50", 0) for x in lat), "p99": max(x.get("p99", 0) for x in lat),
               "n": sum(x.get("n", 0) for x in lat)}
    bare.sort()
    transport = {"p50": 1000 * bare[len(bare) // 2], "p99": 1000 * bare[min(len(bare) - 1, int(0.99 * len(bare)))],
                 "n": len(bare)} if bare else {"p50": float("nan"), "p99": float("nan"), "n": 0}
    return applied, transport


def run(broker: str | None = None, n_executions: int = 400, repeats: int = 3, latency_batches: int = 60,
        gap: float = 0.1) -> list[dict]:
    if broker is None:
        from benchmarks.bench_kafka import tansu

        with tansu() as b:
            return run(b, n_executions, repeats, latency_batches, gap)
    tmp = Path(tempfile.mkdtemp(prefix="bench-scaleout-"))
    try:
        key = new_private_key()
        trust = Trust()
        trust.add(public_bytes(key), list(SIGNED_TYPES))
        trust_path = tmp / "trust.json"
        trust.save(trust_path)
        prefix = f"so{uuid.uuid4().hex[:8]}"
        url = f"kafka://{broker}/{prefix}?partitions={PARTITIONS}&index={tmp}/{prefix}.db"
        with KafkaLog(url, create=True) as log:
            rec = _Recording(log)
            ing = Ingestor(rec, trust)  # type: ignore[arg-type]
            results = []
            chunk: list = []
            for batch in [*scenario.batches(n_executions, seed=77, key=key), None]:
                if batch is not None:
                    chunk += batch
                if chunk and (batch is None or len(chunk) >= 1000):  # big ingest batches: fewer transactions
                    rep = ing.ingest_lines(enumerate(chunk, 1))
                    if rep.conflicts:
                        raise RuntimeError(rep.conflicts)
                    results.append(rep.result)
                    chunk = []
            want = _positions(results)
            events = sum(len(b) for b in rec.batches)
            per_part: dict[int, int] = {}
            for res in results:
                for _eid, pos in res.appended:
                    topic, part, _off = pos.rsplit(":", 2)
                    if topic.endswith(".executions"):
                        per_part[int(part)] = per_part.get(int(part), 0) + 1
            halves = [sum(per_part.get(p, 0) for p in range(PARTITIONS // 2)),
                      sum(per_part.get(p, 0) for p in range(PARTITIONS // 2, PARTITIONS))]
            bound = sum(halves) / max(halves)  # range assignment: the busier pair of partitions sets the makespan
        rates: dict[int, list[float]] = {1: [], 2: []}
        for i in range(repeats):
            for n in (1, 2):
                t0 = time.monotonic()
                rate, meta = _throughput(url, trust_path, tmp, n, want, f"{n}x{i}", events)
                print(f"  {n} projector(s): {rate:,.0f} events/s ({meta}, {time.monotonic() - t0:.1f} s)",
                      file=sys.stderr)
                if meta["applied"] < events:  # every event at least once (governance once per shard)
                    raise RuntimeError(f"{n} projector(s) applied {meta['applied']} of {events} events")
                rates[n].append(rate)
        best = {n: sorted(r)[len(r) // 2] for n, r in rates.items()}  # median: the machine is shared
        # latency: fresh topics, the second half of the recorded batches appended one at a time
        lat_batches = [list(b) for b in rec.batches for b in _split(b, 50)][:latency_batches]
        applied, transport = _latency(broker, trust_path, tmp, lat_batches, gap)
        note = f"2 cores shared with tansu; partition balance bounds the ratio at {bound:.2f}"
        return [
            row(f"scale-out: projection throughput, 2 vs 1 projector processes ({events} events, "
                f"{n_executions} executions, {PARTITIONS} partitions)", best[2], best[1], "events/s", note=note),
            row(f"scale-out: produce->applied latency p50, 2 projectors ({applied['n']} events) vs bare consumer "
                "produce->received", applied["p50"], transport["p50"], "ms"),
            row("scale-out: produce->applied latency p99, 2 projectors vs bare consumer produce->received",
                applied["p99"], transport["p99"], "ms"),
        ]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    from benchmarks.common import print_table

    print_table(run(sys.argv[1] if len(sys.argv) > 1 else None))
