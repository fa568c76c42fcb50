"""The log contract (SPEC §4.3, §5), run against both backends: the embedded log and Kafka
(a real tansu broker from the ``kafka_broker`` fixture, never a mock)."""

from __future__ import annotations

import hashlib
import time
import uuid
import zlib
from collections import defaultdict
from pathlib import Path

import pytest

from ledger.events.codec import content_hash
from ledger.events.validate import validate_line
from ledger.log import Log, LogError, LogRecord, Submission, open_log
from ledger.log.embedded import EmbeddedLog
from ledger.producers.ingest import submission

NOW = 1_760_000_000_000_000


# ----------------------------------------------------------------------------- event helpers
def sub(obj: dict, now: int = NOW) -> Submission:
    return submission(validate_line(obj, line=1, now_micros=now))


def opened(ex: str, **kw) -> Submission:
    return sub({"type": "execution_opened", "execution_id": ex, "task_id": f"task-{ex}",
                "deadline": "2030-01-01T00:00:00Z", "policy": "qwen@1", **kw})


def request(ex: str, rid: str, n_in: int = 64, seed: int = 0, now: int = NOW, **kw) -> Submission:
    base = (zlib.crc32(f"{ex}/{rid}/{seed}".encode()) & 0xFFFF) + 1
    out = [base + i for i in range(8)]
    return sub({"type": "request", "execution_id": ex, "request_id": rid,
                "input_ids": [(base * 7 + i) % 150_000 for i in range(n_in)],
                "output_ids": out, "output_logprobs": [-0.5] * len(out), **kw}, now)


def task(tid: str, **kw) -> Submission:
    return sub({"type": "task_registered", "task_id": tid, "family": "swe", **kw})


# ----------------------------------------------------------------------------- backends
class Backend:
    """Opens logs of one kind; ``reopen(fresh_index=True)`` is a second process's view."""

    def __init__(self, kind: str, url: str, tmp: Path) -> None:
        self.kind, self.url, self.tmp = kind, url, tmp

    def open(self, create: bool = True) -> Log:
        return open_log(self.url, create=create)

    def reopen(self, *, fresh_index: bool = False) -> Log:
        if self.kind == "kafka" and fresh_index:
            return open_log(self.url.replace("idx.db", f"idx-{uuid.uuid4().hex[:6]}.db"))
        return open_log(self.url)


@pytest.fixture(params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "kafka":
        return Backend("kafka", request.getfixturevalue("kafka_url"), tmp_path)
    return Backend("embedded", str(tmp_path / "store"), tmp_path)


@pytest.fixture
def log(backend: Backend):
    with backend.open() as lg:
        yield lg


def position(lg: Log, rec: LogRecord) -> str:
    return str(rec.offset) if isinstance(lg, EmbeddedLog) else f"{rec.stream}:{rec.partition}:{rec.offset}"


def read_all(lg: Log) -> list[LogRecord]:
    return [rec for where in lg.partitions() for rec in lg.read(where)]


def by_event_id(lg: Log) -> dict[str, LogRecord]:
    out: dict[str, LogRecord] = {}
    for rec in read_all(lg):
        assert rec.event_id not in out, f"{rec.event_id} is on the log twice"
        out[rec.event_id] = rec
    return out


# ----------------------------------------------------------------------------- the contract
def test_append_read_round_trip_with_digests(log: Log) -> None:
    batch = [opened("ex-a"), request("ex-a", "r1"), request("ex-a", "r2", n_in=5000), opened("ex-b"),
             request("ex-b", "r1")]
    res = log.append(batch)
    assert res.ok and not res.duplicates
    assert [e for e, _ in res.appended] == [s.event_id for s in batch]
    recs = by_event_id(log)
    assert set(recs) == {s.event_id for s in batch}
    positions = dict(res.appended)
    for s in batch:
        rec = recs[s.event_id]
        assert rec.value == s.value
        assert rec.digest == s.digest == hashlib.sha256(rec.value).digest()
        assert rec.event_type == s.event_type
        assert rec.key == s.key
        assert position(log, rec) == positions[s.event_id]
    for where in log.partitions():  # the Merkle leaves come from the index, in read order
        assert log.digests(where) == [r.digest for r in log.read(where)]
        assert log.digests(where, 0) == []


def test_identical_retry_is_a_noop_returning_the_original_position(log: Log) -> None:
    first = [opened("ex-a"), request("ex-a", "r1")]
    res1 = log.append(first)
    ends = log.end_offsets()
    # the retry is re-validated later: stamped occurred_at differs, content does not
    retry = [opened("ex-a"), request("ex-a", "r1", now=NOW + 5_000_000)]
    assert retry[1].value != first[1].value and retry[1].content_hash == first[1].content_hash
    res2 = log.append(retry)
    assert res2.ok and res2.appended == []
    assert res2.duplicates == res1.appended
    assert log.end_offsets() == ends
    assert len(read_all(log)) == 2


def test_retry_mixed_with_new_events_appends_only_the_new_ones(log: Log) -> None:
    res1 = log.append([opened("ex-a"), request("ex-a", "r1")])
    res2 = log.append([opened("ex-a"), request("ex-a", "r1"), request("ex-a", "r2")])
    assert res2.ok
    assert res2.duplicates == res1.appended
    assert [e for e, _ in res2.appended] == ["request/ex-a/r2"]
    assert len(read_all(log)) == 3


def test_different_content_is_a_conflict_and_nothing_of_the_batch_is_appended(log: Log) -> None:
    res1 = log.append([opened("ex-a"), request("ex-a", "r1")])
    ends = log.end_offsets()
    bad = [request("ex-a", "r2"), request("ex-a", "r1", seed=1), opened("ex-c")]
    res = log.append(bad)
    assert not res.ok
    assert res.appended == []
    assert [c.event_id for c in res.conflicts] == ["request/ex-a/r1"]
    assert res.conflicts[0].existing_position == dict(res1.appended)["request/ex-a/r1"]
    assert log.end_offsets() == ends
    assert log.lookup("request/ex-a/r2") is None and log.lookup("execution_opened/ex-c") is None
    assert {s for s in by_event_id(log)} == {"execution_opened/ex-a", "request/ex-a/r1"}
    queue = log.conflicts()
    assert [(c["event_id"], c["existing_position"]) for c in queue] == \
        [("request/ex-a/r1", dict(res1.appended)["request/ex-a/r1"])]


def test_same_natural_key_under_another_event_id_is_a_conflict(log: Log) -> None:
    log.append([opened("ex-a")])
    other = opened("ex-a", event_id="my-own-id", task_id="something-else")
    res = log.append([other])
    assert [c.event_id for c in res.conflicts] == ["my-own-id"]
    assert res.appended == []
    assert log.lookup("execution_opened/ex-a").event_id == "execution_opened/ex-a"


def test_conflict_inside_one_batch_appends_nothing(log: Log) -> None:
    res = log.append([opened("ex-a"), request("ex-a", "r1"), request("ex-a", "r1", seed=2)])
    assert not res.ok and res.appended == []
    assert read_all(log) == []
    assert len(log.conflicts()) == 1
    # an identical copy inside one batch is a duplicate of the first copy
    res = log.append([opened("ex-a"), opened("ex-a")])
    assert res.ok and len(res.appended) == 1
    assert res.duplicates == [("execution_opened/ex-a", res.appended[0][1])]


def test_natural_key_lookup(log: Log) -> None:
    batch = [opened("ex-a"), request("ex-a", "r1"), task("task-1")]
    res = log.append(batch)
    for s in batch:
        rec = log.lookup(s.natural_key)
        assert rec is not None
        assert rec.event_id == s.event_id and rec.value == s.value and rec.digest == s.digest
        assert position(log, rec) == dict(res.appended)[s.event_id]
    assert log.lookup("request/ex-a/nope") is None


def test_positions_are_monotonic_per_partition(log: Log) -> None:
    appended = []
    for i in range(4):
        res = log.append([opened(f"ex-{i}"), request(f"ex-{i}", "r1"), request("ex-0" if i else f"ex-{i}", f"q{i}")])
        appended += res.appended
    recs = {position(log, r): r for r in read_all(log)}
    per_partition: dict[tuple, list[int]] = defaultdict(list)
    for _, pos in appended:
        rec = recs[pos]
        per_partition[rec.where].append(rec.offset)
    for where, offsets in per_partition.items():
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets), where
    for where in log.partitions():  # read order is offset order
        offs = [r.offset for r in log.read(where)]
        assert offs == sorted(offs)


def test_read_from_the_middle_and_bounded(log: Log) -> None:
    for i in range(3):
        log.append([opened(f"ex-{i}") if i == 0 else request("ex-0", f"r{i}")])
    where = log.lookup("execution_opened/ex-0").where
    recs = list(log.read(where))
    assert len(recs) == 3
    second = recs[1].offset
    assert [r.offset for r in log.read(where, second)] == [r.offset for r in recs[1:]]
    assert [r.offset for r in log.read(where, 0, second)] == [recs[0].offset]
    assert [r.offset for r in log.read(where, second, second + 1)] == [second]
    assert list(log.read(where, recs[-1].offset + 1)) == []
    assert list(log.read(where, recs[-1].offset + 10, recs[-1].offset + 20)) == []  # beyond the end
    assert [r.offset for r in log.read(where, 0, recs[-1].offset + 20)] == [r.offset for r in recs]


def test_reopen_keeps_everything(backend: Backend) -> None:
    batch = [opened("ex-a"), request("ex-a", "r1"), task("task-1")]
    with backend.open() as lg:
        res = lg.append(batch)
        lg.append([request("ex-a", "r1", seed=9)])  # a conflict for the operator queue
        before = {(r.where, r.offset, r.digest) for r in read_all(lg)}
    views = [False, True] if backend.kind == "kafka" else [False]
    for fresh in views:  # Kafka: the same index file, then a fresh one rebuilt from the topics
        with backend.reopen(fresh_index=fresh) as lg:
            # the operator queue lives beside the log (Kafka: in the index file)
            assert len(lg.conflicts()) == (0 if fresh else 1)
            assert {(r.where, r.offset, r.digest) for r in read_all(lg)} == before
            for s in batch:
                assert lg.lookup(s.natural_key).value == s.value
            again = lg.append(batch)
            assert again.appended == [] and again.duplicates == res.appended
            assert not lg.append([request("ex-a", "r1", seed=9)]).ok
            assert len(lg.conflicts()) == (1 if fresh else 2)
            lg.append([request("ex-a", "r2")])
            before = {(r.where, r.offset, r.digest) for r in read_all(lg)}
            assert len(before) == 4


def test_open_without_create_fails_clearly(backend: Backend) -> None:
    with pytest.raises(LogError, match="init"):
        backend.open(create=False)


# ----------------------------------------------------------------------------- Kafka specifics
kafka_only = pytest.mark.kafka


@kafka_only
def test_kafka_governance_routing_and_message_layout(kafka_url: str) -> None:
    from confluent_kafka import Consumer, TopicPartition

    with open_log(kafka_url, create=True) as lg:
        prefix = lg.prefix
        exe = [opened("ex-a"), request("ex-a", "r1"), opened("ex-b"), request("ex-b", "r1"), request("ex-a", "r2")]
        gov = [task("task-1"), task("task-2")]
        lg.append(exe[:2] + gov[:1] + exe[2:] + gov[1:])
        assert lg.partitions()[0] == (f"{prefix}.governance", 0)
        assert lg.partitions()[1:] == [(f"{prefix}.executions", p) for p in range(6)]
        recs = by_event_id(lg)
        for s in gov:
            assert recs[s.event_id].where == (f"{prefix}.governance", 0)
        for s in exe:
            assert recs[s.event_id].stream == f"{prefix}.executions"
            assert recs[s.event_id].key == s.key
        assert recs["execution_opened/ex-a"].partition == recs["request/ex-a/r1"].partition == \
            recs["request/ex-a/r2"].partition
        a = recs["execution_opened/ex-a"]
        bootstrap = lg.config.bootstrap
    # the raw message: value = single-object encoding, key = execution id, SPEC headers
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "raw", "isolation.level": "read_committed",
                  "enable.auto.commit": False})
    try:
        c.assign([TopicPartition(a.stream, a.partition, a.offset)])
        m = None
        deadline = time.monotonic() + 10
        while m is None and time.monotonic() < deadline:
            m = c.poll(0.2)
        assert m is not None and m.error() is None
        headers = dict(m.headers())
        assert m.value() == exe[0].value and m.value()[:2] == b"\xc3\x01"
        assert m.key() == b"ex-a"
        assert headers["event_type"] == b"execution_opened" and headers["event_id"] == b"execution_opened/ex-a"
    finally:
        c.close()


@kafka_only
def test_kafka_partitions_option_and_positions(kafka_broker: str, tmp_path: Path) -> None:
    url = f"kafka://{kafka_broker}/p{uuid.uuid4().hex[:8]}?partitions=3&index={tmp_path}/i.db"
    with open_log(url, create=True) as lg:
        assert len(lg.partitions()) == 4
        res = lg.append([opened("ex-a"), request("ex-a", "r1")])
        for _, pos in res.appended:
            topic, part, off = pos.rsplit(":", 2)
            assert topic == f"{lg.prefix}.executions" and 0 <= int(part) < 3 and int(off) >= 0
        # transactions put commit markers between batches: offsets are not dense
        res2 = lg.append([request("ex-a", "r2")])
        assert int(res2.appended[0][1].rsplit(":", 1)[1]) > int(res.appended[1][1].rsplit(":", 1)[1]) + 1
        assert [r.event_id for r in lg.read(lg.lookup("request/ex-a/r2").where)] == \
            ["execution_opened/ex-a", "request/ex-a/r1", "request/ex-a/r2"]


@kafka_only
def test_kafka_unreachable_broker_fails_fast() -> None:
    with socket_closed_port() as port:
        t0 = time.monotonic()
        with pytest.raises(LogError, match="cannot reach"):
            open_log(f"kafka://127.0.0.1:{port}/x?timeout=2", create=True)
        assert time.monotonic() - t0 < 10


@kafka_only
def test_kafka_single_writer_never_rereads_its_own_events(kafka_url: str, monkeypatch) -> None:
    import ledger.log.kafka as kafka

    seen = []
    real = kafka._index_row
    monkeypatch.setattr(kafka, "_index_row", lambda stream, m: seen.append(m.offset()) or real(stream, m))
    with open_log(kafka_url, create=True) as lg:
        for i in range(5):
            lg.append([opened(f"ex-{i}"), request(f"ex-{i}", "r1"), task(f"task-{i}")])
            assert lg.lookup(f"request/ex-{i}/r1") is not None
        assert seen == []  # only commit markers were read back
    with kafka.KafkaLog(kafka_url.replace("idx.db", "other.db")) as fresh:  # a rebuild reads everything
        assert fresh.lookup("request/ex-4/r1") is not None
        assert len(seen) == 15


@kafka_only
def test_kafka_index_sees_other_writers(kafka_url: str) -> None:
    with open_log(kafka_url, create=True) as a, open_log(kafka_url.replace("idx.db", "b.db")) as b:
        a.append([opened("ex-a"), request("ex-a", "r1")])
        assert b.lookup("request/ex-a/r1").value == request("ex-a", "r1").value
        res = b.append([request("ex-a", "r1"), request("ex-a", "r2")])
        assert [e for e, _ in res.appended] == ["request/ex-a/r2"]
        assert not b.append([request("ex-a", "r1", seed=3)]).ok
        assert a.append([request("ex-a", "r2")]).duplicates == res.appended
        assert not a.append([request("ex-a", "r2", seed=3)]).ok


@kafka_only
def test_kafka_concurrent_writer_race_first_record_wins(kafka_url: str, monkeypatch) -> None:
    """Two writers that both find an id absent both append it; readers keep the first copy."""
    with open_log(kafka_url, create=True) as a, open_log(kafka_url.replace("idx.db", "b.db")) as b:
        a.append([opened("ex-a")])
        b.lookup("execution_opened/ex-a")  # b is up to date now ...
        first = a.append([request("ex-a", "r1"), request("ex-a", "r2")]).appended
        monkeypatch.setattr(b, "_catch_up", lambda *_: False)  # ... and then misses a's append (the race)
        second = b.append([request("ex-a", "r1"), request("ex-a", "r2", seed=7)]).appended
        assert len(second) == 2  # both copies reached the log
        monkeypatch.undo()
    with open_log(kafka_url.replace("idx.db", "c.db")) as c:
        assert position(c, c.lookup("request/ex-a/r1")) == first[0][1]
        assert c.lookup("request/ex-a/r2").value == request("ex-a", "r2").value
        found = c.conflicts()
        assert [(f["event_id"], f["existing_position"]) for f in found] == [("request/ex-a/r2", first[1][1])]
        assert c.append([request("ex-a", "r1")]).duplicates == [first[0]]


@kafka_only
def test_kafka_open_foreign_transaction_neither_blocks_nor_leaks(kafka_url: str) -> None:
    """Another producer's open transaction: not visible, appends and lookups go on, ends never shrink."""
    from confluent_kafka import Producer

    with open_log(kafka_url, create=True) as lg:
        lg.append([opened("ex-a")])
        where = lg.lookup("execution_opened/ex-a").where
        ends = lg.end_offsets()
        p = Producer({"bootstrap.servers": lg.config.bootstrap, "transactional.id": uuid.uuid4().hex})
        p.init_transactions(10)
        p.begin_transaction()
        s = request("ex-a", "r9")
        p.produce(where[0], partition=where[1], value=s.value, key=s.key,
                  headers=[("event_type", b"request"), ("event_id", s.event_id.encode())])
        assert p.flush(10) == 0
        t0 = time.monotonic()
        assert lg.lookup("request/ex-a/r9") is None
        big = request("ex-a", "r1", n_in=100_000)  # too big for the value cache: fetched from the broker
        res = lg.append([big, opened("ex-b")])
        assert res.ok and len(res.appended) == 2
        assert lg.lookup("request/ex-a/r1").value == big.value  # ours, behind the open transaction
        assert time.monotonic() - t0 < 5
        assert all(lg.end_offsets()[w] >= ends[w] for w in ends)
        assert "request/ex-a/r9" not in {r.event_id for r in lg.read(where)}
        p.commit_transaction(10)
        assert lg.lookup("request/ex-a/r9").value == s.value
        assert {"request/ex-a/r9", "request/ex-a/r1"} <= {r.event_id for r in lg.read(where)}
        assert lg.append([request("ex-a", "r9")]).duplicates == [(s.event_id, position(lg, lg.lookup(s.natural_key)))]


def test_an_empty_writer_name_is_refused(backend: Backend, capsys) -> None:
    from ledger.cli import main as cli

    with pytest.raises(LogError, match="writer name must not be empty"):
        open_log(backend.url, writer=" ")
    assert cli(["--store", backend.url, "ingest", "--writer", "", "-"]) == 2
    assert "writer name must not be empty" in capsys.readouterr().err


def _abandon_a_transaction(lg: Log) -> tuple:
    """Produce a request of ex-a in a transaction of ``lg``'s producer and never commit it: what a SIGKILL
    leaves behind.  Returns ex-a's partition."""
    lg.append([opened("ex-a")])
    where = lg.lookup("execution_opened/ex-a").where
    s = request("ex-a", "r9")
    p = lg._producer_handle()
    p.begin_transaction()
    p.produce(where[0], partition=where[1], value=s.value, key=s.key)
    assert p.flush(10) == 0
    return where


def _readers_see_new_appends(url: str, where: tuple) -> bool:
    """Whether an append to ``where`` by another client is readable at once (no open transaction before it).
    (The abandoned producer's own commit is no proof: tansu lets it time out rather than answer "fenced".)"""
    with open_log(url.replace("idx.db", "w.db")) as writer:
        assert writer.append([request("ex-a", "r5")]).ok
    with open_log(url.replace("idx.db", "r.db")) as reader:
        return "request/ex-a/r5" in {r.event_id for r in reader.read(where)}


@kafka_only
def test_kafka_writer_name_fences_a_killed_predecessor(kafka_url: str) -> None:
    """A process killed inside its transaction leaves it open, and until the broker's transaction timeout
    (60 s) read_committed readers of that partition see nothing after it.  A new process with the same
    writer name aborts it when it opens the log (``open_log(url, writer=NAME)``)."""
    with open_log(kafka_url, create=True, writer="harness-7") as dead:
        where = _abandon_a_transaction(dead)
        assert not _readers_see_new_appends(kafka_url, where)  # held back behind the open transaction
        with open_log(kafka_url.replace("idx.db", "b.db"), writer="harness-7") as fresh:
            assert fresh.append([request("ex-a", "r1")]).ok
        assert _readers_see_new_appends(kafka_url, where)


@kafka_only
def test_kafka_a_writer_taken_over_stays_fenced(kafka_url: str) -> None:
    """Two processes under one writer name: the older is fenced and says so, and does not re-initialise
    (which would fence the newer one in turn, the two taking turns failing)."""
    with open_log(kafka_url, create=True, writer="w") as old:
        assert old.append([opened("ex-a")]).ok
        with open_log(kafka_url.replace("idx.db", "new.db"), writer="w") as new:
            for _ in range(2):
                with pytest.raises(LogError, match="as writer 'w' and took over: this one appends nothing more"):
                    old.append([request("ex-a", "r1")])
            assert new.append([request("ex-a", "r2")]).ok
            assert new.append([request("ex-a", "r3")]).ok
        assert old.lookup("request/ex-a/r1") is None


@kafka_only
def test_kafka_ingest_cli_takes_a_writer_name(kafka_url: str, tmp_path: Path, monkeypatch) -> None:
    from ledger.cli import main as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LEDGER_STORE", kafka_url)
    assert cli(["init"]) == 0
    (tmp_path / "ev.jsonl").write_text('{"type": "task_registered", "task_id": "t1"}\n')
    with open_log(kafka_url.replace("idx.db", "dead.db"), writer="harness-7") as dead:
        where = _abandon_a_transaction(dead)
        assert cli(["ingest", "--writer", "harness-7", str(tmp_path / "ev.jsonl")]) == 0
        assert _readers_see_new_appends(kafka_url, where)


@kafka_only
def test_kafka_gateway_worker_takes_its_writer_name(kafka_url: str, tmp_path: Path, monkeypatch) -> None:
    """``ledger gateway --writer gw --workers N``: worker 1 runs as ``--writer gw/worker-1`` and fences what a
    killed worker 1 left open."""
    from ledger.cli import _gateway_of, build_parser
    from ledger.gateway.workers import worker_argv

    monkeypatch.chdir(tmp_path)  # the gateway.db of a Kafka store
    base = ["--store", kafka_url, "gateway", "--upstream", "http://127.0.0.1:1", "--api", "vllm",
            "--tokenizer", "qwen3.6-27b"]
    front = build_parser().parse_args(base + ["--writer", "gw", "--workers", "2"])
    argv = worker_argv(front, 7, 1)
    assert argv[argv.index("--writer") + 1] == "gw/worker-1"
    assert "--writer" not in worker_argv(build_parser().parse_args(base), 7, 1)
    with open_log(kafka_url, create=True, writer="gw/worker-1") as dead:
        where = _abandon_a_transaction(dead)
        worker = build_parser().parse_args(argv[argv.index("--store"):])
        gw, rec, log, _host, _port = _gateway_of(worker, None)
        rec.close()
        log.close()
        gw.db.close()
        assert _readers_see_new_appends(kafka_url, where)


@kafka_only
def test_kafka_oversize_event_is_refused_before_anything_is_produced(kafka_broker: str, tmp_path: Path) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    prefix = f"small{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_broker})
    limit = {"max.message.bytes": "65536"}
    for f in admin.create_topics([NewTopic(f"{prefix}.executions", 2, 1, config=limit),
                                  NewTopic(f"{prefix}.governance", 1, 1, config=limit)]).values():
        f.result()
    with open_log(f"kafka://{kafka_broker}/{prefix}?index={tmp_path}/i.db") as lg:  # created by someone else
        assert len(lg.partitions()) == 3
        ends = lg.end_offsets()
        with pytest.raises(LogError, match="max.message.bytes"):
            lg.append([opened("ex-a"), request("ex-a", "r1", n_in=20_000)])
        assert lg.end_offsets() == ends and read_all(lg) == []
        assert lg.append([opened("ex-a"), request("ex-a", "r1", n_in=1_000)]).ok


@kafka_only
def test_kafka_events_from_a_foreign_producer_are_indexed(kafka_url: str) -> None:
    """A producer that writes only the SPEC headers (no natural_key/content_hash): decoded instead."""
    from confluent_kafka import Producer

    with open_log(kafka_url, create=True) as lg:
        lg.append([opened("ex-a")])
        s = request("ex-a", "r1")
        p = Producer({"bootstrap.servers": lg.config.bootstrap, "enable.idempotence": True, "acks": "all"})
        p.produce(f"{lg.prefix}.executions", value=s.value, key=s.key,
                  headers=[("event_type", s.event_type.encode()), ("event_id", s.event_id.encode())])
        assert p.flush(10) == 0
        rec = lg.lookup("request/ex-a/r1")
        assert rec is not None and rec.value == s.value
        assert lg.append([request("ex-a", "r1", now=NOW + 1)]).duplicates == [(s.event_id, position(lg, rec))]
        assert not lg.append([request("ex-a", "r1", seed=5)]).ok


def test_derived_content_hash_matches_ingest() -> None:
    """The Kafka index's fallback (no headers) hashes content exactly like ``ledger.producers.ingest``."""
    from ledger.events.codec import default_codec
    from ledger.log.kafka import _derive_identity

    for ev_obj in ({"type": "execution_opened", "execution_id": "e", "task_id": "t", "deadline": "2030-01-01T00:00:00Z",
                    "policy": "p"},
                   {"type": "cost_recorded", "execution_id": "e", "amount": 1.5, "occurred_at": "2025-01-01T00:00:00Z"}):
        ev = validate_line(ev_obj, line=1, now_micros=NOW)
        value = default_codec().encode(ev)
        s = submission(ev)
        assert _derive_identity(value) == (s.event_id, s.event_type, s.natural_key, content_hash(ev, value))


# ----------------------------------------------------------------------------- helpers
class socket_closed_port:
    """A port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        pass
