"""Scale-out on Kafka (SPEC §3, §5, §9): projector processes in a consumer group, state that
follows its partition, merged shards equal to a single-process replay, and the fault suite
(SIGKILL + rebalance + restart, a slow / frozen projector, producer retries through broker
disconnects) plus a bounded soak.  Everything runs against the real tansu broker."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ledger.corpus.publish import build_document, log_position_of
from ledger.events.catalog import SIGNED_TYPES
from ledger.events.signing import (
    Trust,
    new_private_key,
    public_bytes,
    write_private_key,
)
from ledger.log import LogError, open_log
from ledger.producers.ingest import IngestError, Ingestor
from ledger.runtime.cluster import LocalCluster
from ledger.runtime.projector import ShardLock, catch_up_shard, peak_rss_mb
from ledger.projections.engine import ReplayEngine, canonical_dump, connect
from ledger.projections.registry import all_projections
from ledger.projections.shards import MergeError, merge_shards, shard_files
from workloads import scenario

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[1]
COUNTING = ["--extra-projection", "tests.counting:CountingProjection"]
COUNTING_TABLES = ("seen", "type_counts")


# ----------------------------------------------------------------------------- environment
@dataclass
class Env:
    url: str
    tmp: Path
    trust: Trust
    key: object
    trust_path: Path
    log: object
    appended: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def gov(self) -> tuple[str, int]:
        return (self.log.governance_topic, 0)

    def executions(self, p: int) -> tuple[str, int]:
        return (self.log.executions_topic, p)

    def producer_log(self, name: str):
        return open_log(self.url.replace("idx.db", f"{name}.db"))

    def ingest(self, batches, log=None, pause: float = 0.0) -> int:
        log = log or self.log
        ing = Ingestor(log, self.trust)
        n = 0
        for batch in batches:
            rep = ing.ingest_lines(enumerate(batch, 1))
            assert not rep.conflicts, rep.conflicts
            n += rep.appended
            if pause:
                time.sleep(pause)
        with self.lock:
            self.appended += n
        return n

    def single(self, name: str = "single.db", until=None) -> ReplayEngine:
        """A single-process replay of the log (the reference)."""
        eng = ReplayEngine(self.log, connect(self.tmp / name), all_projections(), trust=self.trust)
        eng.run(until=until)
        return eng

    def cluster(self, group: str, *extra: str, state: str = "shards") -> LocalCluster:
        return LocalCluster(self.url, self.trust_path, self.tmp / state, group, workdir=self.tmp / f"w-{group}",
                            extra_args=extra)


def make_env(kafka_url: str, tmp_path: Path, partitions: int = 4) -> Env:
    url = f"{kafka_url}&partitions={partitions}"
    key = new_private_key()
    trust = Trust()
    trust.add(public_bytes(key), list(SIGNED_TYPES))
    trust_path = tmp_path / "trust.json"
    trust.save(trust_path)
    write_private_key(key, tmp_path / "publisher.pem")
    return Env(url, tmp_path, trust, key, trust_path, open_log(url, create=True))


def manifest_doc(db: sqlite3.Connection, log, route: str = "sft") -> dict:
    positions = {(s, p): o for s, p, o in db.execute("SELECT stream, partition, next_offset FROM _positions")}
    return build_document(db, route, version=1, log_position=log_position_of(log, positions))


def assert_merged_equals_single(state_dir: Path, env: Env, single: ReplayEngine, *, skip=()) -> dict:
    out = env.tmp / f"merged-{uuid.uuid4().hex[:6]}.db"
    report = merge_shards(state_dir, out, skip_tables=skip)
    merged = connect(out)
    try:
        assert canonical_dump(merged) == canonical_dump(single.db)
        a, b = manifest_doc(merged, env.log), manifest_doc(single.db, env.log)
        assert a["merkle"]["root"] == b["merkle"]["root"] and a == b
        assert a["counts"]["members"] > 0
        return a
    finally:
        merged.close()
        del report


def counting_check(state_dir: Path, env: Env) -> None:
    """Every shard applied every governance event once and each record of its partition once."""
    gov_ids = {r.event_id for r in env.log.read(env.gov)}
    files = shard_files(state_dir)
    assert files
    for p, f in files.items():
        part_ids = {r.event_id for r in env.log.read(env.executions(p))}
        db = sqlite3.connect(f)
        rows = dict(db.execute("SELECT event_id, times FROM seen"))
        db.close()
        assert max(rows.values(), default=1) == 1, f"shard {p} applied an event twice"
        assert set(rows) == gov_ids | part_ids, f"shard {p} misses or has foreign events"


def produce_in_background(env: Env, batches: list, pause: float) -> threading.Thread:
    def run() -> None:
        with env.producer_log(f"prod-{uuid.uuid4().hex[:6]}") as log:
            env.ingest(batches, log=log, pause=pause)

    th = threading.Thread(target=run, name="producer", daemon=True)
    th.start()
    return th


# ----------------------------------------------------------------------------- merge (in-process)
def test_merged_shards_equal_a_single_replay_at_any_cut(kafka_url, tmp_path):
    """Shards caught up to arbitrary per-partition offsets merge into exactly the single
    replay to those offsets: tables (canonical dump), admitted members, digests, manifest root."""
    env = make_env(kafka_url, tmp_path)
    env.ingest(scenario.batches(16, seed=3, key=env.key))
    ends = env.log.end_offsets()
    rng = random.Random(5)
    for trial in range(3):
        if trial == 0:
            cut = dict(ends)
        else:
            cut = {w: (e if w == env.gov else rng.choice([0, rng.randrange(e + 1), e])) for w, e in ends.items()}
        state = tmp_path / f"shards{trial}"
        for p in range(4):
            catch_up_shard(env.log, state, p, env.trust, until=cut)
        single = env.single(f"single{trial}.db", until=cut)
        doc = assert_merged_equals_single(state, env, single)
        if trial == 0:  # the full log: derived views, withdrawals, credits all crossed partitions
            assert doc["counts"]["executions"] > 5
            assert single.db.execute("SELECT COUNT(*) FROM withdrawn_executions").fetchone()[0] > 0
            assert single.db.execute("SELECT COUNT(*) FROM admission WHERE execution_id LIKE '%/redacted' "
                                     "AND state = 'admitted'").fetchone()[0] > 0
        single.db.close()


def test_merge_refuses_an_inconsistent_cut(kafka_url, tmp_path, monkeypatch):
    env = make_env(kafka_url, tmp_path, partitions=2)
    env.ingest(scenario.batches(6, seed=4, key=env.key))
    ends = env.log.end_offsets()
    catch_up_shard(env.log, tmp_path / "s", 0, env.trust)
    catch_up_shard(env.log, tmp_path / "s", 1, env.trust, until={**ends, env.gov: 3})
    with pytest.raises(MergeError, match="different governance positions"):
        merge_shards(tmp_path / "s", tmp_path / "m.db")
    assert not (tmp_path / "m.db").exists()
    with pytest.raises(MergeError, match="no shard for partition"):
        merge_shards(tmp_path / "s", tmp_path / "m.db", require_partitions=[0, 1, 2])
    catch_up_shard(env.log, tmp_path / "s", 1, env.trust)  # caught up: now it merges
    from ledger.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["--store", env.url, "--trust", str(env.trust_path), "--db", str(tmp_path / "m.db"), "project",
                 "--merge-shards", str(tmp_path / "s")]) == 0
    assert main(["--store", env.url, "--trust", str(env.trust_path), "--db", str(tmp_path / "bad.db"), "project",
                 "--merge-shards", str(tmp_path / "nothing-here")]) == 1


def test_a_shard_has_one_writer(tmp_path):
    a, b = ShardLock(tmp_path / "x.lock"), ShardLock(tmp_path / "x.lock")
    assert a.try_acquire() and not b.try_acquire()
    a.release()
    assert b.try_acquire()
    b.release()


# ----------------------------------------------------------------------------- single follower
def test_single_follower_applies_new_events_as_they_arrive(kafka_url, tmp_path):
    env = make_env(kafka_url, tmp_path)
    batches = list(scenario.batches(8, seed=6, key=env.key))
    env.ingest(batches[:5])
    db = tmp_path / "follow.db"
    proc = subprocess.Popen([sys.executable, "-m", "ledger.cli", "--store", env.url, "--trust", str(env.trust_path),
                             "--db", str(db), "project", "--follow", "--stats", str(tmp_path / "f.json"),
                             "--journal-mode", "delete"],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        env.ingest(batches[5:])
        single = env.single()
        want = single.positions()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if db.exists():
                try:
                    with sqlite3.connect(db) as c:
                        have = {(s, p): o for s, p, o in c.execute("SELECT * FROM _positions")}
                except sqlite3.OperationalError:  # the follower has created the file, not yet its tables
                    have = {}
                if all(have.get(k, 0) >= v for k, v in want.items()):
                    break
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "applied" in out
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # state on a network filesystem
    with connect(db) as c:
        assert canonical_dump(c) == canonical_dump(single.db)


# ----------------------------------------------------------------------------- fault suite
def _kill_and_rebalance(env: Env, *, n_exec: int, kills: int, seed: int) -> None:
    """Three projectors in a group; SIGKILL one mid-stream, let the group rebalance, restart it;
    repeat ``kills`` times; then: counting check, merged shards == single replay."""
    rng = random.Random(seed)
    cluster = env.cluster("g-kill", *COUNTING, "--batch", "40")
    parts = range(6)
    try:
        names = cluster.start(3)
        assert cluster.wait_owned(parts, timeout=60), [cluster.log_text(n) for n in names]
        producer = produce_in_background(env, list(scenario.batches(n_exec, seed=seed, key=env.key)), pause=0.05)
        for k in range(kills):
            target = f"p{rng.randrange(3)}"
            start = sum(cluster.positions().values())
            deadline = time.monotonic() + 30
            while sum(cluster.positions().values()) < start + 150 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rng.random() * 0.3)  # a random point inside a batch
            cluster.kill(target)
            survivors = [n for n in names if n != target]
            assert cluster.wait_owned(parts, names=survivors, timeout=60), \
                f"no rebalance after killing {target}: " + cluster.log_text(survivors[0])[-2000:]
            cluster.spawn(target)
            assert cluster.wait_owned(parts, timeout=60)
        producer.join(120)
        assert not producer.is_alive()
        single = env.single()
        assert cluster.wait_caught_up(single.positions(), timeout=60), (cluster.positions(), single.positions())
        codes = cluster.stop_all()
        assert all(c == 0 for c in codes.values()), codes
        counting_check(cluster.state_dir, env)
        assert_merged_equals_single(cluster.state_dir, env, single, skip=COUNTING_TABLES)
    finally:
        cluster.stop_all(5)


def test_group_projectors_survive_sigkill_rebalance_and_restart(kafka_url, tmp_path):
    env = make_env(kafka_url, tmp_path, partitions=6)
    _kill_and_rebalance(env, n_exec=24, kills=1, seed=11)


@pytest.mark.slow
def test_group_projectors_survive_many_random_kills(kafka_url, tmp_path):
    env = make_env(kafka_url, tmp_path, partitions=6)
    _kill_and_rebalance(env, n_exec=80, kills=5, seed=12)


def _slow_and_fast(env: Env, *, n_exec: int, freeze: float) -> None:
    """A throttled projector next to a fast one; with ``freeze`` the slow one is also SIGSTOPped
    (a zombie holding its shard locks) until the group has given its partitions to the fast one."""
    cluster = env.cluster("g-slow", *COUNTING)
    try:
        cluster.spawn("fast", "--batch", "200")
        cluster.spawn("slow", "--batch", "10", "--throttle", "0.15")
        assert cluster.wait_owned(range(4), timeout=60)
        producer = produce_in_background(env, list(scenario.batches(n_exec, seed=21, key=env.key)), pause=0.05)
        if freeze:
            time.sleep(1.0)
            slow_parts = set((cluster.stats("slow") or {}).get("owned", []))
            cluster.signal("slow", signal.SIGSTOP)
            # the group evicts the frozen member and hands everything to the fast one, which
            # must wait for the zombie's locks for those partitions while its own ones go on
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                st = cluster.stats("fast") or {}
                if sorted(st.get("assigned", [])) == list(range(4)) and set(st.get("pending", [])) == slow_parts:
                    break
                time.sleep(0.2)
            else:
                pytest.fail("the fast projector was not assigned the frozen one's partitions: "
                            + json.dumps(cluster.stats("fast")))
            before = {k: v for k, v in cluster.positions().items() if k[1] not in slow_parts}
            time.sleep(freeze)
            after = {k: v for k, v in cluster.positions().items() if k[1] not in slow_parts}
            assert sum(after.values()) >= sum(before.values())
            cluster.signal("slow", signal.SIGCONT)  # it finds itself revoked and releases its shards
        producer.join(120)
        single = env.single()
        assert cluster.wait_caught_up(single.positions(), timeout=90), (cluster.positions(), single.positions())
        codes = cluster.stop_all()
        assert all(c == 0 for c in codes.values()), (codes, cluster.log_text("slow")[-3000:])
        counting_check(cluster.state_dir, env)
        assert_merged_equals_single(cluster.state_dir, env, single, skip=COUNTING_TABLES)
    finally:
        cluster.stop_all(5)


def test_a_slow_projector_never_makes_a_fast_one_lose_data(kafka_url, tmp_path):
    env = make_env(kafka_url, tmp_path)
    _slow_and_fast(env, n_exec=14, freeze=0.0)


@pytest.mark.slow
def test_a_frozen_projector_keeps_its_shards_until_it_lets_go(kafka_url, tmp_path):
    env = make_env(kafka_url, tmp_path)
    _slow_and_fast(env, n_exec=24, freeze=3.0)


# ----------------------------------------------------------------------------- producer retries
@pytest.fixture
def proxied_broker(tmp_path, monkeypatch):
    """A private tansu that advertises a TCP proxy's port, so every client connection goes
    through the proxy (which the test can cut)."""
    monkeypatch.setenv("LEDGER_DATA_KEYS", str(tmp_path / "data-keys.db"))  # sealing's keys stay in tmp_path
    if os.environ.get("LEDGER_SKIP_KAFKA") == "1":
        pytest.skip("LEDGER_SKIP_KAFKA=1: Kafka tests skipped")
    from benchmarks.bench_kafka import free_port, start_tansu, stop, wait_for_broker

    from .tcp_proxy import TcpProxy

    bport, pport = free_port(), free_port()
    proc = start_tansu(bport, advertised_port=pport)
    proxy = TcpProxy(bport, pport)
    try:
        try:
            wait_for_broker(f"127.0.0.1:{pport}", proc)
        except RuntimeError as exc:
            pytest.fail(f"tansu behind the proxy did not start: {exc}")
        yield f"127.0.0.1:{pport}", proxy
    finally:
        proxy.close()
        stop(proc)


def _all_event_ids(bootstrap: str, prefix: str, partitions: int, isolation: str) -> collections.Counter:
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"chk-{uuid.uuid4().hex}", "isolation.level": isolation,
                  "enable.partition.eof": True, "auto.offset.reset": "earliest", "fetch.wait.max.ms": 5,
                  "log_level": 0})
    tps = [TopicPartition(f"{prefix}.governance", 0, 0)] + \
          [TopicPartition(f"{prefix}.executions", p, 0) for p in range(partitions)]
    c.assign(tps)
    pending = {(t.topic, t.partition) for t in tps}
    ids: collections.Counter = collections.Counter()
    deadline = time.monotonic() + 30
    while pending and time.monotonic() < deadline:
        for m in c.consume(500, 0.2):
            if m.error() is not None:
                if m.error().code() == KafkaError._PARTITION_EOF:
                    pending.discard((m.topic(), m.partition()))
                continue
            ids[dict(m.headers())["event_id"].decode()] += 1
    c.close()
    assert not pending
    return ids


def _signed_lines(n_exec: int, seed: int):
    key = new_private_key()
    trust = Trust()
    trust.add(public_bytes(key), list(SIGNED_TYPES))
    return trust, list(scenario.batches(n_exec, seed=seed, key=key))


class _Recording:
    """Wraps a log and keeps every batch of submissions the ingest path appends."""

    def __init__(self, log) -> None:
        self.log, self.batches = log, []

    def append(self, subs):
        self.batches.append(list(subs))
        return self.log.append(subs)

    def __getattr__(self, name):
        return getattr(self.log, name)


def test_idempotent_producer_retries_through_lost_acks_never_duplicate(proxied_broker, tmp_path):
    """The ledger's producer settings (idempotent, acks=all) through a link that loses the
    broker's acknowledgements and then drops every connection, again and again: librdkafka
    resends what the broker already appended, the broker drops the resends, every event is on
    the log once (the same run without idempotence leaves thousands of duplicates).  Then a
    fresh ledger producer retrying every batch appends nothing: the event ids are there."""
    from confluent_kafka import Producer

    bootstrap, proxy = proxied_broker
    url = f"kafka://{bootstrap}/px?partitions=3&index={tmp_path}/idx.db"
    trust, batches = _signed_lines(8, 31)
    open_log(url, create=True).close()
    with open_log(str(tmp_path / "scratch"), create=True) as scratch:  # the exact encoded events of the ingest path
        rec = _Recording(scratch)
        ing = Ingestor(rec, trust)  # type: ignore[arg-type]
        for batch in batches:
            assert not ing.ingest_lines(enumerate(batch, 1)).conflicts
    subs = [s for b in rec.batches for s in b]

    def chaos() -> None:
        rng = random.Random(3)
        for _ in range(10):
            time.sleep(rng.uniform(0.15, 0.4))
            proxy.lose_answers(0.08)

    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 5,
                         "partitioner": "murmur2_random", "log_level": 0})
    failed: list = []
    th = threading.Thread(target=chaos, daemon=True)
    th.start()
    for s in subs:
        headers = [("event_type", s.event_type.encode()), ("event_id", s.event_id.encode()),
                   ("natural_key", s.natural_key.encode()), ("content_hash", s.content_hash)]
        topic = "px.governance" if s.governance else "px.executions"
        while True:
            try:
                producer.produce(topic, value=s.value, key=s.key.encode(), headers=headers,
                                 on_delivery=lambda err, _m: err and failed.append(err))
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
        time.sleep(0.006)  # spread the events over the chaos
    th.join(30)
    assert producer.flush(60) == 0
    assert not failed and proxy.cuts >= 5
    for isolation in ("read_committed", "read_uncommitted"):
        seen = _all_event_ids(bootstrap, "px", 3, isolation)
        dups = {e: n for e, n in seen.items() if n > 1}
        assert not dups, f"duplicated on the log: {list(dups.items())[:5]}"
        assert set(seen) == {s.event_id for s in subs}
    with open_log(url) as log:  # a restarted ledger producer retrying everything
        reports = [Ingestor(log, trust).ingest_lines(enumerate(b, 1)) for b in batches]
    assert not any(r.conflicts for r in reports)
    assert sum(r.appended for r in reports) == 0 and sum(r.duplicates for r in reports) == len(subs)
    print(f"\nidempotent producer: acknowledgements lost and connections cut {proxy.cuts} times, "
          f"{len(subs)} events, none twice")


def test_ledger_appends_retried_through_outages_never_duplicate(proxied_broker, tmp_path):
    """Outages long enough to make ``KafkaLog.append`` fail mid-transaction; the caller
    retries every failed batch with a fresh client until it is acknowledged.  The clients share a
    writer name, so a fresh one fences and aborts a transaction its dead predecessor left open.
    With a new transactional.id per client (no ``writer``) the abandoned copy survived on tansu,
    which keeps aborted records visible to read_committed readers: 2 runs in 20 here (with the
    writer name: 0 in 30)."""
    bootstrap, proxy = proxied_broker
    url = f"kafka://{bootstrap}/py?partitions=3&timeout=3&index={tmp_path}/idx.db"
    trust, batches = _signed_lines(6, 32)
    expected: set[str] = set()
    stale: list[str] = []
    stop = threading.Event()

    def chaos() -> None:
        rng = random.Random(4)
        while not stop.is_set():
            time.sleep(rng.uniform(0.05, 0.3))
            if rng.random() < 0.25:
                proxy.down(True)
                time.sleep(rng.uniform(0.2, 1.0))
                proxy.down(False)
            else:
                proxy.cut()

    log = open_log(url, create=True, writer="retrier")
    th = threading.Thread(target=chaos, daemon=True)
    th.start()
    try:
        for batch in batches:
            for _attempt in range(60):
                try:
                    if log is None:
                        log = open_log(url, writer="retrier")  # fences what the failed client left open
                    rep = Ingestor(log, trust).ingest_lines(enumerate(batch, 1))
                    assert not rep.conflicts, rep.conflicts
                    expected |= {e for e, _ in rep.result.appended + rep.result.duplicates}
                    break
                except LogError:
                    if log is not None:
                        log.close()
                    log = None
                except IngestError as exc:
                    # seen once in CI under full load: a fresh client's validation did not yet see an earlier,
                    # acknowledged batch (its index caught up while the dead client's transaction was still
                    # open). Retried like an outage; the assertions below still require every acknowledged
                    # event visible exactly once.
                    stale.append(str(exc))
                    if log is not None:
                        log.close()
                    log = None
            else:
                pytest.fail("an append never got through")
    finally:
        stop.set()
        th.join(5)
        if log is not None:
            log.close()
    for isolation in ("read_committed", "read_uncommitted"):
        seen = _all_event_ids(bootstrap, "py", 3, isolation)
        assert not {e for e, n in seen.items() if n > 1}, "duplicated on the log"
        assert set(seen) == expected, f"{len(expected - set(seen))} acknowledged events invisible to {isolation}"


# ----------------------------------------------------------------------------- soak
def _soak(env: Env, seconds: float) -> dict:
    """Sustained produce of realistic executions with two projectors in a group and manifest
    publications from merged shards; returns the figures (events/s, lag, peak RSS)."""
    from ledger.corpus.publish import PublishError, publish, verify_file
    from ledger.log.paths import StorePaths

    cluster = env.cluster("g-soak")
    published: list[Path] = []
    lags: list[int] = []
    appended_positions: dict = {}
    try:
        cluster.start(2)
        assert cluster.wait_owned(range(4), timeout=60)
        stop = threading.Event()
        produced = {"events": 0, "executions": 0}

        def produce() -> None:
            with env.producer_log("soak-producer") as log:
                ing = Ingestor(log, env.trust)
                i = 0
                for batch in scenario.batches(10_000, seed=41, key=env.key):
                    if stop.is_set():
                        break
                    rep = ing.ingest_lines(enumerate(batch, 1))
                    assert not rep.conflicts
                    for _eid, pos in rep.result.appended:
                        topic, part, off = pos.rsplit(":", 2)
                        appended_positions[(topic, int(part))] = max(appended_positions.get((topic, int(part)), 0),
                                                                     int(off) + 1)
                    produced["events"] += rep.appended
                    i += 1
                    produced["executions"] = i

        t0 = time.monotonic()
        th = threading.Thread(target=produce, daemon=True)
        th.start()
        next_publish = t0 + seconds / 3
        paths = StorePaths(env.url, env.trust_path, env.tmp / "checkpoint.key", env.tmp / "published.db",
                           env.tmp / "data-keys.db")
        # two publications at least: on a loaded machine a merge + publish can outlast a third of the run
        while time.monotonic() - t0 < seconds or (len(published) < 2 and time.monotonic() - t0 < 4 * seconds):
            time.sleep(0.5)
            have = cluster.positions()
            lags.append(sum(max(0, v - have.get(k, 0)) for k, v in dict(appended_positions).items()))
            if time.monotonic() >= next_publish:
                next_publish += seconds / 3
                merge_deadline = time.monotonic() + 60  # shards mid-commit refuse a merge; a loaded machine needs longer
                while True:
                    try:
                        merge_shards(cluster.state_dir, paths.db)
                        break
                    except MergeError:
                        if time.monotonic() > merge_deadline:
                            raise
                        time.sleep(0.2)
                out = env.tmp / f"manifest-{len(published) + 1}.json"
                try:
                    publish(paths, "sft", key=env.tmp / "publisher.pem", out=out)
                except PublishError as exc:  # a loaded machine: the shard owning the route's partition is behind
                    if "no admission policy declared" not in str(exc):
                        raise
                    continue  # the next round publishes
                published.append(out)
        stop.set()
        th.join(60)
        elapsed = time.monotonic() - t0
        single = env.single()
        t_wait = time.monotonic()
        assert cluster.wait_caught_up(single.positions(), timeout=120)
        drain = time.monotonic() - t_wait
        stats = [cluster.stats(n) or {} for n in cluster.alive()]
        codes = cluster.stop_all()
        assert all(c == 0 for c in codes.values()), codes
        assert_merged_equals_single(cluster.state_dir, env, single)
        for path in published:  # each manifest built from merged shards re-derives from the log, root for root
            rep = verify_file(path, paths, deep=True)
            assert rep.ok, rep.problems
        lat = [s.get("latency_ms", {}) for s in stats]
        return {"seconds": round(elapsed, 1), "executions": produced["executions"], "events": produced["events"],
                "produce_events_per_s": round(produced["events"] / elapsed, 1),
                "max_lag_records": max(lags, default=0), "mean_lag_records": round(sum(lags) / max(1, len(lags)), 1),
                "drain_after_stop_s": round(drain, 2), "manifests": len(published),
                "projector_peak_rss_mb": max((s.get("peak_rss_mb", 0) for s in stats), default=None),
                "test_process_peak_rss_mb": round(peak_rss_mb(), 1),
                "latency_ms_p50": [x.get("p50") for x in lat], "latency_ms_p99": [x.get("p99") for x in lat]}
    finally:
        cluster.stop_all(5)


def _soak_report(figures: dict) -> None:
    text = json.dumps(figures, sort_keys=True)
    print(f"\nsoak: {text}")
    target = os.environ.get("LEDGER_SOAK_REPORT")
    if target:
        Path(target).write_text(text + "\n")


def test_soak_bounded(kafka_url, tmp_path):
    env = make_env(kafka_url, tmp_path)
    figures = _soak(env, float(os.environ.get("LEDGER_SOAK_SECONDS", "15")))
    assert figures["manifests"] >= 2 and figures["events"] > 0
    _soak_report(figures)


@pytest.mark.slow
def test_soak_long(kafka_url, tmp_path):
    env = make_env(kafka_url, tmp_path)
    figures = _soak(env, float(os.environ.get("LEDGER_SOAK_SECONDS", "300")))
    assert figures["manifests"] >= 2
    _soak_report(figures)
