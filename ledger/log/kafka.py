"""The Kafka log backend (SPEC §4.3, §5): ``kafka://HOST:PORT/PREFIX[?options]``.

Topics
    ``PREFIX.executions``  execution-scoped events, key = execution id (default 6 partitions)
    ``PREFIX.governance``  governance events, key = subject, exactly 1 partition (total order)

URL options (query string): ``partitions=N`` (executions partitions when creating the topics),
``index=PATH`` (the local index file, default ``~/.cache/ledger/kafka-HOST-PORT-PREFIX.db``),
``timeout=SECONDS`` (broker round trips, default 10).

Messages
    value = the Avro single-object encoded event (``Submission.value``), key = partition key,
    headers ``event_type`` and ``event_id`` (SPEC §5) plus ``natural_key`` and ``content_hash``
    (so the index can be rebuilt from the topics without decoding; records from a producer
    that omits them are decoded with the codec instead).

The local index
    Kafka has no lookup by event id, so every ``KafkaLog`` keeps a SQLite index (a cache of
    the log; deleting it only costs a rebuild): one row per data record ``(stream, partition,
    offset) -> key, event_id, natural_key, event_type, content_hash, digest`` (ids indexed by
    64-bit hashes, so inserts stay cheap) plus, per partition, the offset below which
    everything is indexed.  Before each append, lookup, conflicts() and digests() the index
    catches up: one ListOffsets round trip per isolation level (in parallel) for all
    partitions, then, only for partitions that moved, an ``assign()``-ed (never
    ``subscribe()``-d, so no group join) ``read_committed`` consumer reads from the stored
    offsets to the end.  After our own transaction commits, its records go into the index
    straight from the delivery reports (one SQLite transaction per batch), and a partition's
    stored offset jumps over them when they directly follow it.  The commit marker is not
    read either: when exactly one offset follows our last record and the partition is
    settled (LSO == HW), our transaction is decided, so that offset is its marker.  A single
    writer therefore never reads its own events back.

Idempotency and atomicity
    ``append`` catches up, classifies the batch exactly like the embedded log (same id and
    content: duplicate with the original position; same id or natural key with different
    content: conflict, written to the ``conflicts`` table of the index file, and nothing of
    the batch is produced), then produces the new events in one Kafka transaction
    (``transactional.id`` unique per instance, idempotent, ``acks=all``): all or nothing for
    ``read_committed`` readers.  An event larger than the topics accept (``max.message.bytes``)
    is refused before the transaction begins.  Positions are ``"topic:partition:offset"``;
    offsets are not dense (commit markers take offsets), so readers compare, never count them.

Races and how readers resolve them
    The check and the produce are not atomic across processes: two writers that both find a
    new event id absent both append it.  The index therefore never trusts the order it
    learnt things in: for an event id (or natural key) the *first record on the log wins*,
    ordered by (governance before executions, partition, offset) -- in the identical-retry
    race both copies share a partition key, so this is simply the lower offset -- and a
    later copy with different content is written to the operator queue as a conflict found
    on the log.  The writer that lost the race was told "appended" with its own position;
    every reader (this index, projections) ignores that copy.  Projections must apply the
    same rule: skip an event id already applied.

Broker notes (tansu 0.6, the test broker; Apache Kafka behaves as specified)
    * tansu returns no aborted-transaction list in Fetch, so records of an *aborted*
      transaction are visible to ``read_committed`` readers.  ``append`` checks everything
      before it begins a transaction, so an abort only follows a broker failure; the
      caller's retry of that batch then reports the already visible events as duplicates.
    * ListOffsets(read_committed) answers 0 for every partition while any transaction is
      open, and a committed transaction that shares a partition with an older open one is
      held back in *all* its partitions, without an end-of-partition event.  So
      ``end_offsets()`` never goes backwards (it keeps the highest stable end seen), and
      where a transaction is open the catch-up and ``read()`` take what a ``read_committed``
      fetch returns until it has been quiet for a moment, then resume later.  Our own
      records are committed when ``append`` returns, so ``lookup`` fetches an indexed offset
      with ``read_uncommitted``: they are readable at once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import sqlite3
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

from confluent_kafka import (
    Consumer,
    IsolationLevel,
    KafkaError,
    KafkaException,
    Producer,
    TopicCollection,
    TopicPartition,
)
from confluent_kafka.admin import (
    AdminClient,
    ConfigResource,
    NewTopic,
    OffsetSpec,
    ResourceType,
)

from ledger.log.base import (
    AppendResult,
    Conflict,
    Existing,
    Log,
    LogError,
    LogRecord,
    Partition,
    Recheck,
    Submission,
    classify,
    settle,
)
from ledger.events.catalog import natural_key
from ledger.events.codec import content_hash, default_codec

_log = logging.getLogger(__name__)

DEFAULT_PREFIX = "ledger"
DEFAULT_PARTITIONS = 6
DEFAULT_TIMEOUT = 10.0
GOVERNANCE, EXECUTIONS = 0, 1  # stream ranks in the index: governance sorts first
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_OPTIONS = {"partitions", "index", "timeout"}
_MAX_MESSAGE = 64 * 1024 * 1024  # a request may carry up to 16 MiB of tokens per list
_BATCH_BYTES = 8 * 1024 * 1024  # large produce batches: one transaction = few requests per partition
_KAFKA_DEFAULT_MAX_MESSAGE = 1048588  # the broker default when a topic does not say
_VALUE_CACHE_BYTES = 32 * 1024 * 1024
_VALUE_CACHE_ITEM = 256 * 1024
_INDEX_FLUSH_ROWS = 5000
_FENCED_CODES = (KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH)
_QUIET = 0.25  # seconds without data after which an unsettled partition (open transaction) is left for now
_INDEX_VERSION = "2"
# linger.ms of the transactional producer (issue 19, third round: 0 measured no better on small
# events and 4 % worse on large ones, so 5 stays).
_TXN_LINGER_MS = 5

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS cursors (
    stream INTEGER NOT NULL,
    partition INTEGER NOT NULL,
    next_offset INTEGER NOT NULL,
    PRIMARY KEY (stream, partition)
);
CREATE TABLE IF NOT EXISTS records (
    stream INTEGER NOT NULL,          -- 0 governance topic, 1 executions topic
    partition INTEGER NOT NULL,
    offset INTEGER NOT NULL,
    key TEXT,
    event_id TEXT,
    natural_key TEXT,                 -- NULL when equal to event_id (the usual, derived id)
    event_type TEXT,
    content_hash BLOB,
    digest BLOB NOT NULL,
    length INTEGER NOT NULL,
    event_id_h INTEGER,               -- 64-bit hashes: small integer indexes keep inserts cheap
    natural_key_h INTEGER,
    PRIMARY KEY (stream, partition, offset)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS records_event_id_h ON records(event_id_h);
CREATE INDEX IF NOT EXISTS records_natural_key_h ON records(natural_key_h) WHERE natural_key_h IS NOT NULL;
CREATE TABLE IF NOT EXISTS conflicts (
    id INTEGER PRIMARY KEY,
    recorded_at_unix REAL NOT NULL,
    event_id TEXT NOT NULL,
    natural_key TEXT NOT NULL,
    reason TEXT NOT NULL,
    existing_position TEXT,
    position TEXT UNIQUE,             -- set for conflicts found on the log (the losing copy)
    value BLOB NOT NULL
);
"""


# ---------------------------------------------------------------------------- URL
@dataclass(frozen=True)
class KafkaURL:
    host: str
    port: int
    prefix: str
    partitions: int
    index: Path
    timeout: float

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


def parse_url(url: str) -> KafkaURL:
    """Parse ``kafka://HOST:PORT/PREFIX?partitions=N&index=PATH&timeout=S``."""
    parts = urlsplit(url)
    if parts.scheme != "kafka" or not parts.hostname:
        raise LogError(f"not a Kafka log URL: {url!r} (expected kafka://HOST:PORT/PREFIX)")
    try:
        port = parts.port or 9092
    except ValueError:
        raise LogError(f"bad port in {url!r}") from None
    prefix = unquote(parts.path.strip("/")) or DEFAULT_PREFIX
    if not _TOPIC_RE.match(prefix):
        raise LogError(f"bad topic prefix {prefix!r} in {url!r} (letters, digits, '.', '_', '-')")
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - _OPTIONS)
    if unknown:
        raise LogError(f"unknown option(s) {', '.join(unknown)} in {url!r} (known: {', '.join(sorted(_OPTIONS))})")
    opt = {k: v[-1] for k, v in query.items()}
    try:
        partitions = int(opt.get("partitions", DEFAULT_PARTITIONS))
        timeout = float(opt.get("timeout", DEFAULT_TIMEOUT))
    except ValueError:
        raise LogError(f"partitions must be an integer and timeout a number in {url!r}") from None
    if partitions < 1 or timeout <= 0:
        raise LogError(f"partitions must be >= 1 and timeout > 0 in {url!r}")
    if "index" in opt and opt["index"]:
        index = Path(opt["index"]).expanduser()
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        index = cache / "ledger" / f"kafka-{parts.hostname}-{port}-{prefix}.db"
    return KafkaURL(parts.hostname, port, prefix, partitions, index, timeout)


def format_position(topic: str, partition: int, offset: int) -> str:
    return f"{topic}:{partition}:{offset}"


def parse_position(position: str) -> tuple[str, int, int]:
    """``"topic:partition:offset"`` -> (topic, partition, offset)."""
    try:
        topic, partition, offset = position.rsplit(":", 2)
        return topic, int(partition), int(offset)
    except ValueError:
        raise LogError(f"not a Kafka log position: {position!r} (expected topic:partition:offset)") from None


# ---------------------------------------------------------------------------- the log
class KafkaLog(Log):
    """Ledger log on two Kafka topics, with a local SQLite index for idempotency."""

    def __init__(self, url: str, *, create: bool = False, writer: str | None = None) -> None:
        self.url = url
        self.config = cfg = parse_url(url)
        self.prefix = cfg.prefix
        self.executions_topic = f"{cfg.prefix}.executions"
        self.governance_topic = f"{cfg.prefix}.governance"
        self._topics = (self.governance_topic, self.executions_topic)  # indexed by stream rank
        self._lock = threading.RLock()
        self._closed = False
        self._producer: Producer | None = None
        # One transactional.id for the life of this log object: a re-created producer's
        # init_transactions() then fences and aborts a transaction its predecessor left open.
        # An exclusive ``writer`` keeps its id across processes, so the same happens to a
        # transaction a killed process of that name left open (see ``open_log``).
        self._transactional_id = (f"ledger-{self.prefix}-writer-{hashlib.sha256(writer.encode()).hexdigest()[:32]}"
                                  if writer is not None else f"ledger-{self.prefix}-{uuid.uuid4().hex}")
        self.writer = writer
        self._fenced = False  # a named writer another process of that name took over: it never appends again
        self._tail: _Consumer | None = None  # catch-up consumer of the index
        self._readers: dict[bool, list[_Consumer]] = {True: [], False: []}  # idle consumers by read_committed
        self._own_tail: dict[tuple[int, int], int] = {}  # last offset of our last transaction, per partition
        self._stable: dict[tuple[int, int], int] = {}  # highest stable offset seen (end_offsets never goes back)
        self._values: OrderedDict[tuple[int, int, int], bytes] = OrderedDict()
        self._values_bytes = 0
        self._max_record_bytes: int | None = None
        # What this log object has asked of the broker and the index (tests assert a retry costs
        # O(batch), SPEC §9): catch_ups, records_consumed (data records read from the topics),
        # values_fetched (single records fetched by ``lookup``), keys_looked_up (``event_ids``).
        self.counters: Counter[str] = Counter()
        self._admin = AdminClient(self._common())
        self._n_partitions = self._open_topics(create)
        self._db = self._open_index()
        if writer is not None:
            try:
                self._producer_handle()  # init_transactions(): fence a predecessor, abort what it left open
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ setup
    def _common(self) -> dict:
        ms = int(self.config.timeout * 1000)
        return {
            "bootstrap.servers": self.config.bootstrap,
            "client.id": f"ledger-{self.prefix}",
            "socket.connection.setup.timeout.ms": max(1000, ms),
            "logger": _log,
        }

    def _open_topics(self, create: bool) -> int:
        timeout = self.config.timeout
        try:
            md = self._admin.list_topics(timeout=timeout)
        except KafkaException as exc:
            raise LogError(f"cannot reach the Kafka broker at {self.config.bootstrap} "
                           f"within {timeout:g} s: {exc.args[0].str() if exc.args else exc}") from None
        missing = [t for t in self._topics if t not in md.topics or md.topics[t].error is not None]
        if missing:
            if not create:
                raise LogError(f"no ledger topics {' and '.join(missing)} on {self.config.bootstrap} "
                               f"(run `ledger init --store {self._redacted_url()}` first)")
            self._create_topics(missing)
            md = self._admin.list_topics(timeout=timeout)
        n_gov = len(md.topics[self.governance_topic].partitions)
        if n_gov != 1:
            raise LogError(f"{self.governance_topic} has {n_gov} partitions; governance needs exactly 1 (total order)")
        n_exe = len(md.topics[self.executions_topic].partitions)
        if n_exe < 1:
            raise LogError(f"{self.executions_topic} has no partitions")
        if "partitions=" in self.url and n_exe != self.config.partitions:
            _log.warning("%s exists with %d partitions (the URL asks for %d; existing topics are kept)",
                         self.executions_topic, n_exe, self.config.partitions)
        return n_exe

    def _create_topics(self, missing: list[str]) -> None:
        forever = {"retention.ms": "-1", "retention.bytes": "-1", "max.message.bytes": str(_MAX_MESSAGE)}
        new = [NewTopic(t, num_partitions=1 if t == self.governance_topic else self.config.partitions,
                        replication_factor=-1, config=forever) for t in missing]
        futures = self._admin.create_topics(new, request_timeout=self.config.timeout,
                                            operation_timeout=self.config.timeout)
        for topic, fut in futures.items():
            try:
                fut.result()
            except KafkaException as exc:
                if exc.args and exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue  # another `ledger init` won the race
                raise LogError(f"cannot create topic {topic} on {self.config.bootstrap}: {exc}") from None
        deadline = time.monotonic() + self.config.timeout
        while True:  # metadata propagation
            md = self._admin.list_topics(timeout=self.config.timeout)
            if all(t in md.topics and md.topics[t].error is None and md.topics[t].partitions for t in missing):
                return
            if time.monotonic() > deadline:
                raise LogError(f"topics {missing} were created but do not show up in the metadata")
            time.sleep(0.05)

    def _redacted_url(self) -> str:
        return f"kafka://{self.config.bootstrap}/{self.prefix}"

    def _topic_ids(self) -> dict[str, str]:
        try:
            futures = self._admin.describe_topics(TopicCollection(list(self._topics)),
                                                  request_timeout=self.config.timeout)
            return {t: str(f.result().topic_id) for t, f in futures.items()}
        except Exception:  # noqa: BLE001 - older brokers: no topic ids, no incarnation check
            return {}

    def _open_index(self) -> sqlite3.Connection:
        path = self.config.index
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # a cache of the log; the operator queue switches to FULL
            db.execute("PRAGMA busy_timeout=30000")
            db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise LogError(f"cannot open the Kafka log index {path}: {exc}") from None
        meta = dict(db.execute("SELECT k, v FROM meta"))
        if meta.get("version") not in (None, _INDEX_VERSION):
            db.executescript("DROP TABLE IF EXISTS records; DROP TABLE IF EXISTS cursors;")
            db.executescript(_SCHEMA)
        if meta.get("prefix") not in (None, self.prefix):
            db.close()
            raise LogError(f"index {path} belongs to the log {meta['prefix']!r}, not {self.prefix!r}")
        ident = {"bootstrap": self.config.bootstrap, "prefix": self.prefix}  # topic ids identify the log
        ids = self._topic_ids()
        for t, tid in ids.items():
            if meta.get(f"topic_id:{t}") not in (None, tid):
                _log.warning("topic %s was re-created (id %s, index has %s): rebuilding the index %s",
                             t, tid, meta[f"topic_id:{t}"], path)
                self._reset_index(db)
                break
        with _tx(db):
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                           [*ident.items(), ("version", _INDEX_VERSION), *((f"topic_id:{t}", tid) for t, tid in ids.items())])
        return db

    @staticmethod
    def _reset_index(db: sqlite3.Connection) -> None:
        with _tx(db):
            db.execute("DELETE FROM records")
            db.execute("DELETE FROM cursors")

    # ------------------------------------------------------------------ clients
    def _consumer(self, committed: bool = True) -> _Consumer:
        c = _Consumer({
            **self._common(),
            "group.id": f"ledger-reader-{uuid.uuid4().hex}",  # never joined: assign() only
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "isolation.level": "read_committed" if committed else "read_uncommitted",
            "enable.partition.eof": True,
            "auto.offset.reset": "error",
            "fetch.wait.max.ms": 1,  # only assigned while reading: the end of a partition shows at once
            # read_committed consumers stream partitions; read_uncommitted ones fetch single
            # indexed records (lookup), so they prefetch little (a fetch still returns at
            # least one whole record batch, whatever its size)
            "max.partition.fetch.bytes": 8 * 1024 * 1024 if committed else 256 * 1024,
            "queued.max.messages.kbytes": 65536 if committed else 1024,
            "fetch.max.bytes": _MAX_MESSAGE,
            "receive.message.max.bytes": 2 * _MAX_MESSAGE,
        })
        c.known_topics = set()
        c.committed = committed
        return c

    def _producer_handle(self) -> Producer:
        if self._producer is None:
            p = Producer({
                **self._common(),
                "transactional.id": self._transactional_id,
                "enable.idempotence": True,
                "acks": "all",
                "linger.ms": _TXN_LINGER_MS,
                "partitioner": "murmur2_random",  # the Java client's partitioner: same key, same partition
                "message.max.bytes": _MAX_MESSAGE,
                "batch.size": min(_BATCH_BYTES, self._max_record()),
                "transaction.timeout.ms": max(60_000, int(self.config.timeout * 3000)),
            })
            try:
                p.init_transactions(self.config.timeout)
            except KafkaException as exc:
                raise LogError(f"cannot start a transactional producer on {self.config.bootstrap}: {exc}") from None
            self._producer = p
        return self._producer

    def _max_record(self) -> int:
        """Largest record we may produce: the smallest ``max.message.bytes`` of our topics
        (it bounds a whole record batch), less room for the batch header and our headers."""
        if self._max_record_bytes is None:
            self._max_record_bytes = min(_MAX_MESSAGE, self._topic_max_message()) - 4096
        return self._max_record_bytes

    def _topic_max_message(self) -> int:
        limits = []
        try:
            futures = self._admin.describe_configs([ConfigResource(ResourceType.TOPIC, t) for t in self._topics],
                                                   request_timeout=self.config.timeout)
            for fut in futures.values():
                entry = fut.result().get("max.message.bytes")
                limits.append(int(entry.value) if entry is not None and entry.value else _KAFKA_DEFAULT_MAX_MESSAGE)
        except Exception:  # noqa: BLE001 - no describe_configs: assume the broker default
            limits.append(_KAFKA_DEFAULT_MAX_MESSAGE)
        return max(16 * 1024, min(limits))

    def _borrow(self, committed: bool = True) -> _Consumer:
        with self._lock:
            self._check_open()
            if self._readers[committed]:
                return self._readers[committed].pop()
            return self._consumer(committed)

    def _release(self, consumer: _Consumer) -> None:
        with self._lock:
            try:
                consumer.unassign()
            except (KafkaException, RuntimeError):
                return
            if self._closed:
                consumer.close()
            else:
                self._readers[consumer.committed].append(consumer)

    def client_config(self) -> dict:
        """Base librdkafka settings for this log's broker (for projector consumer groups)."""
        return {"bootstrap.servers": self.config.bootstrap, "isolation.level": "read_committed",
                "enable.auto.commit": False}

    # ------------------------------------------------------------------ topology
    def partitions(self) -> list[Partition]:
        return [(self.governance_topic, 0)] + [(self.executions_topic, p) for p in range(self._n_partitions)]

    def _stream(self, where: Partition) -> int:
        topic, part = where
        try:
            stream = self._topics.index(topic)
        except ValueError:
            raise LogError(f"{topic!r} is not a topic of this log ({', '.join(self._topics)})") from None
        if not 0 <= part < (1 if stream == GOVERNANCE else self._n_partitions):
            raise LogError(f"{topic} has no partition {part}")
        return stream

    def _all_tps(self) -> list[tuple[int, int]]:
        return [(GOVERNANCE, 0)] + [(EXECUTIONS, p) for p in range(self._n_partitions)]

    def _list_offsets(self, *levels: IsolationLevel) -> list[dict[tuple[int, int], int]]:
        """Latest offsets of every partition, one dict per isolation level (requests in parallel)."""
        return self._list_offsets_begin(*levels)()

    def _list_offsets_begin(self, *levels: IsolationLevel) -> Callable[[], list[dict[tuple[int, int], int]]]:
        """Send the ListOffsets requests of :meth:`_list_offsets` now; the returned callable waits
        for the answers (``append`` queries the index while they are on the way)."""
        tps = [TopicPartition(self._topics[s], p) for s, p in self._all_tps()]
        try:
            pending = [self._admin.list_offsets({tp: OffsetSpec.latest() for tp in tps}, isolation_level=level,
                                                request_timeout=self.config.timeout) for level in levels]
        except KafkaException as exc:
            raise LogError(f"cannot list offsets on {self.config.bootstrap}: {exc}") from None

        def result() -> list[dict[tuple[int, int], int]]:
            try:
                return [{(self._topics.index(tp.topic), tp.partition): f.result().offset for tp, f in futures.items()}
                        for futures in pending]
            except KafkaException as exc:
                raise LogError(f"cannot list offsets on {self.config.bootstrap}: {exc}") from None
        return result

    def end_offsets(self) -> dict[Partition, int]:
        """The stable end per partition: every record below it is decided (committed).

        Records of an open transaction are not counted; the value never decreases (tansu
        answers 0 for a partition with an open transaction; the last known end is kept).
        """
        with self._lock:
            self._check_open()
            (lso,) = self._list_offsets(IsolationLevel.READ_COMMITTED)
            out = {}
            for tp, off in lso.items():
                self._stable[tp] = max(self._stable.get(tp, 0), off)
                out[(self._topics[tp[0]], tp[1])] = self._stable[tp]
            return {w: out[w] for w in self.partitions()}

    # ------------------------------------------------------------------ index catch-up
    def _cursors(self) -> dict[tuple[int, int], int]:
        rows = dict(((s, p), o) for s, p, o in self._db.execute("SELECT stream, partition, next_offset FROM cursors"))
        return {tp: rows.get(tp, 0) for tp in self._all_tps()}

    def _catch_up(self, offsets: Callable[[], list[dict[tuple[int, int], int]]] | None = None) -> bool:
        """Index everything committed up to the current end of both topics.  ``offsets``: the
        answer of a ``_list_offsets_begin(READ_UNCOMMITTED, READ_COMMITTED)`` sent earlier.
        Returns whether index rows were added or dropped (False: every index query made since
        ``offsets`` was sent still holds)."""
        own, self._own_tail = self._own_tail, {}
        self.counters["catch_ups"] += 1
        consumed = self.counters["records_consumed"]
        hw, lso = (offsets or self._list_offsets_begin(IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED))()
        cursors = self._cursors()
        reset = any(cursors[tp] > hw.get(tp, 0) for tp in cursors)
        if reset:
            _log.warning("the log is shorter than the index %s (broker reset?): rebuilding the index", self.config.index)
            self._reset_index(self._db)
            self._values.clear()
            self._values_bytes = 0
            cursors = {tp: 0 for tp in cursors}
        todo = {tp: off for tp, off in cursors.items() if off < hw.get(tp, 0)}
        # Our own last transaction ended at ``off - 1`` and exactly one offset follows it.  When
        # that offset is also stable (LSO == HW), our transaction is decided, so its commit marker
        # is written after our records and below HW: it is that one offset.  Nothing to read.
        markers = {tp: hw[tp] for tp, off in todo.items()
                   if own.get(tp) == off - 1 and hw[tp] == off + 1 and lso.get(tp) == hw[tp]}
        if markers:
            self._index([], markers, check=False)
            for tp in markers:
                del todo[tp]
                self._stable[tp] = max(self._stable.get(tp, 0), hw[tp])
        if not todo:
            return reset
        if self._tail is None:
            self._tail = self._consumer()
        tail = self._tail
        _assign(tail, [TopicPartition(self._topics[s], p, off) for (s, p), off in todo.items()], self.config.timeout)
        # Settled partitions (LSO == HW) are read to the end.  Where a transaction is open the
        # stable end is unknown (tansu even reports LSO 0, and holds back committed transactions
        # that share a partition with an open one, without signalling EOF): take what a
        # read_committed fetch returns until it goes quiet; the rest is indexed next time.
        settled = {tp for tp in todo if lso.get(tp) == hw[tp]}
        try:
            pending = set(todo)
            new_cursors: dict[tuple[int, int], int] = {}
            rows: list[tuple] = []
            last_progress = time.monotonic()
            while pending:
                msgs = _drain(tail, 1000)
                if msgs:
                    last_progress = time.monotonic()
                else:
                    idle = time.monotonic() - last_progress
                    if idle > _QUIET and pending - settled:
                        quiet = pending - settled
                        for tp in tail.position([TopicPartition(self._topics[s], p) for s, p in quiet]):
                            key = (self._topics.index(tp.topic), tp.partition)
                            if tp.offset > new_cursors.get(key, todo[key]):
                                new_cursors[key] = tp.offset  # past the commit markers it skipped
                        pending -= quiet
                        continue
                    if idle > self.config.timeout:
                        raise LogError(f"the index of {self._redacted_url()} made no progress for "
                                       f"{self.config.timeout:g} s (partitions {sorted(pending)})")
                for m in msgs:
                    tp = (self._topics.index(m.topic()), m.partition())
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            if m.offset() >= todo[tp]:
                                new_cursors[tp] = max(new_cursors.get(tp, 0), m.offset())
                                self._stable[tp] = max(self._stable.get(tp, 0), m.offset())
                                pending.discard(tp)
                            continue
                        raise LogError(f"reading {m.topic()}:{m.partition()} for the index: {err.str()}")
                    rows.append(_index_row(tp[0], m))
                    self.counters["records_consumed"] += 1
                    new_cursors[tp] = m.offset() + 1
                    if m.offset() + 1 >= hw[tp]:
                        pending.discard(tp)
                if len(rows) >= _INDEX_FLUSH_ROWS:
                    self._index(rows, new_cursors, check=True)
                    rows, new_cursors = [], {}
            self._index(rows, new_cursors, check=True)
        finally:
            tail.unassign()
        return reset or self.counters["records_consumed"] != consumed

    def _index(self, rows: list[tuple], cursors: dict[tuple[int, int], int], *, check: bool) -> None:
        """Insert index rows and move cursors, in one SQLite transaction."""
        if not rows and not cursors:
            return
        found = self._conflicts_on_log(rows) if check and rows else []
        with _tx(self._db):
            if rows:
                self._db.executemany("INSERT OR IGNORE INTO records VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
            if found:
                self._db.executemany(
                    "INSERT OR IGNORE INTO conflicts (recorded_at_unix, event_id, natural_key, reason, existing_position,"
                    " position, value) VALUES (?,?,?,?,?,?,?)", found)
            if cursors:
                self._db.executemany(
                    "INSERT INTO cursors VALUES (?,?,?) ON CONFLICT(stream, partition) "
                    "DO UPDATE SET next_offset = MAX(next_offset, excluded.next_offset)",
                    [(s, p, o) for (s, p), o in cursors.items()])

    def _conflicts_on_log(self, rows: list[tuple]) -> list[tuple]:
        """Copies of an event id / natural key that reached the log with different content.

        The first record on the log wins (governance, then partition, then offset); the
        later copy is reported.  Identical copies (the concurrent-retry race) are silent.
        """
        ids, keys = self._winners([r[4] for r in rows if r[4]], [r[5] or r[4] for r in rows if r[5] or r[4]])
        out = []
        now = time.time()
        for r in sorted(rows, key=lambda r: r[:3]):
            nk = r[5] or r[4]
            mine = (r[:3], r[4], nk, r[7])  # ((stream, partition, offset), event_id, natural_key, content_hash)
            for what, table, value in (("event_id", ids, r[4]), ("natural key", keys, nk)):
                if not value:
                    continue
                w = table.get(value)
                if w is None or w[0] == mine[0]:  # new, or our own record read back
                    table[value] = w or mine
                    continue
                first, later = (w, mine) if w[0] < mine[0] else (mine, w)
                table[value] = first
                if w[1] == mine[1] and w[3] == mine[3]:
                    continue  # identical copy: the concurrent-retry race, first one wins silently
                out.append((now, later[1] or "", later[2] or "",
                            f"found on the log: same {what} as {self._position(*first[0])} with different content "
                            f"(concurrent writers); the first record wins", self._position(*first[0]),
                            self._position(*later[0]), b""))
        return out

    def _winners_by_id(self, event_ids: list[str]) -> dict[str, tuple]:
        """event_id -> ((stream, partition, offset), event_id, natural_key, content_hash) of its first record."""
        want = set(event_ids)
        rows = self._by_hash("event_id_h", want)
        out: dict[str, tuple] = {}
        for rank, eid, nk, chash in rows:
            if eid in want and (eid not in out or rank < out[eid][0]):
                out[eid] = (rank, eid, nk or eid, chash)
        return out

    def _winners_by_key(self, keys: list[str]) -> dict[str, tuple]:
        """natural_key -> ((stream, partition, offset), event_id, natural_key, content_hash) of its first record."""
        want = set(keys)
        out: dict[str, tuple] = {}
        rows = self._by_hash("natural_key_h", want) + self._by_hash("event_id_h", want, "AND natural_key IS NULL")
        for rank, eid, nk, chash in rows:
            nk = nk or eid
            if nk in want and (nk not in out or rank < out[nk][0]):
                out[nk] = (rank, eid, nk, chash)
        return out

    def _winners(self, event_ids: list[str], keys: list[str]) -> tuple[dict[str, tuple], dict[str, tuple]]:
        """``(_winners_by_id(event_ids), _winners_by_key(keys))`` from two index queries instead of
        three: one ``event_id_h`` query for both sets (a natural key equal to its event id, the usual
        case, is stored as ``natural_key IS NULL`` and found by its event id) and one ``natural_key_h``."""
        want_ids, want_keys = set(event_ids), set(keys)
        by_id: dict[str, tuple] = {}
        by_key: dict[str, tuple] = {}
        for rank, eid, nk, chash in self._by_hash("event_id_h", want_ids | want_keys):
            if eid in want_ids and (eid not in by_id or rank < by_id[eid][0]):
                by_id[eid] = (rank, eid, nk or eid, chash)
            if nk is None and eid in want_keys and (eid not in by_key or rank < by_key[eid][0]):
                by_key[eid] = (rank, eid, eid, chash)
        for rank, eid, nk, chash in self._by_hash("natural_key_h", want_keys):
            nk = nk or eid
            if nk in want_keys and (nk not in by_key or rank < by_key[nk][0]):
                by_key[nk] = (rank, eid, nk, chash)
        return by_id, by_key

    def _by_hash(self, column: str, values: set[str], extra: str = "") -> list[tuple]:
        """Candidate rows whose hashed id is one of ``values`` (callers compare the text)."""
        out = []
        uniq = list({_h(v) for v in values})
        for i in range(0, len(uniq), 500):
            chunk = uniq[i:i + 500]
            q = (f"SELECT stream, partition, offset, event_id, natural_key, content_hash FROM records "
                 f"WHERE {column} IN ({','.join('?' * len(chunk))}) {extra}")
            out += [((st, p, o), eid, nk, chash) for st, p, o, eid, nk, chash in self._db.execute(q, chunk)]
        return out

    def _position(self, stream: int, partition: int, offset: int) -> str:
        return format_position(self._topics[stream], partition, offset)

    # ------------------------------------------------------------------ writing
    def append(self, batch: Sequence[Submission], *, recheck: Recheck | None = None) -> AppendResult:
        """See :meth:`Log.append`.  ``recheck`` runs after the index caught up with the topics and
        the batch was classified, inside this object's lock, just before the transaction begins.
        Kafka has no lock shared by writer processes, so it narrows the window in which another
        process can append an invalidating event (a closure, a root split policy) to the
        catch-up-to-commit interval of one append; it does not close it.  What lands in that
        window is decided by readers in log order: the tree projection rejects a request after
        its execution's closure (``_rejected``), the splits projection marks a competing root
        split policy ``conflict`` (never the policy in force)."""
        if not batch:
            return AppendResult()
        with self._lock:
            self._check_open()
            if self._fenced:
                raise self._fenced_error()
            self._producer_handle()  # (re)initialise first: fences a transaction a failed append left open
            # The idempotency lookups run while the catch-up's ListOffsets requests are on the way;
            # they are repeated only when the catch-up changed the index (another writer appended).
            offsets = self._list_offsets_begin(IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED)
            wanted = ([s.event_id for s in batch], [s.natural_key for s in batch])
            ids, keys = self._winners(*wanted)
            if self._catch_up(offsets):
                ids, keys = self._winners(*wanted)
            by_id = {e: Existing(self._position(*r[0]), r[1], r[3]) for e, r in ids.items()}
            by_key = {k: Existing(self._position(*r[0]), r[1], r[3]) for k, r in keys.items()}
            new, result = classify(batch, by_id, by_key, self._stored_value)
            if result.conflicts:
                self._record_conflicts(result.conflicts, batch)
                return result
            limit = self._max_record()
            too_big = [s for s in new if len(s.value) + len(s.key) + len(s.event_id) + len(s.natural_key) > limit]
            if too_big:  # refuse before the transaction starts: nothing of the batch reaches the broker
                raise LogError(f"event {too_big[0].event_id} is {len(too_big[0].value)} bytes; the topics of "
                               f"{self._redacted_url()} accept records up to {limit} bytes "
                               f"(max.message.bytes); nothing of the batch was appended")
            if new and recheck is not None:
                recheck(new)
            if new:
                positions = self._produce(new)
                self._remember(new, positions)
                settle(result, new, [self._position(*p) for p in positions])
        return result

    def _produce(self, subs: list[Submission]) -> list[tuple[int, int, int]]:
        """Produce ``subs`` in one transaction; their (stream, partition, offset) in order."""
        producer = self._producer_handle()
        reports: list = [None] * len(subs)

        def delivered(i: int, err: KafkaError | None, msg) -> None:
            reports[i] = err if err is not None else (msg.partition(), msg.offset())

        timeout = self.config.timeout
        try:
            producer.begin_transaction()
        except KafkaException as exc:
            self._drop_producer()
            raise self._failure(exc, "cannot begin a Kafka transaction") from None
        try:
            for i, s in enumerate(subs):
                topic = self.governance_topic if s.governance else self.executions_topic
                headers = [("event_type", s.event_type.encode()), ("event_id", s.event_id.encode()),
                           ("natural_key", s.natural_key.encode()), ("content_hash", s.content_hash)]
                cb = functools.partial(delivered, i)
                while True:
                    try:
                        producer.produce(topic, value=s.value, key=s.key.encode(), headers=headers, on_delivery=cb)
                        break
                    except BufferError:  # local queue full: let deliveries drain
                        producer.poll(0.05)
            # commit_transaction() flushes first, and fails (abortable) if any event failed delivery
            self._commit(producer)
        except BaseException as exc:
            self._abort(producer)
            if isinstance(exc, KafkaException):
                raise self._failure(exc, "Kafka append failed, nothing committed") from None
            raise
        deadline = time.monotonic() + timeout
        while None in reports and time.monotonic() < deadline:  # delivery reports of a committed transaction
            producer.poll(0.01)
        failed = [r for r in reports if not isinstance(r, tuple)]
        if failed:  # cannot happen after a successful commit; never report positions we do not know
            raise LogError(f"transaction committed but {len(failed)} delivery reports are missing or failed: {failed[0]}")
        return [(GOVERNANCE if s.governance else EXECUTIONS, r[0], r[1]) for s, r in zip(subs, reports)]

    def _commit(self, producer: Producer) -> None:
        deadline = time.monotonic() + self.config.timeout
        while True:
            try:
                producer.commit_transaction(self.config.timeout)
                return
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if err is not None and err.retriable() and time.monotonic() < deadline:
                    continue
                raise

    def _abort(self, producer: Producer) -> None:
        try:
            producer.abort_transaction(self.config.timeout)
        except KafkaException as exc:
            _log.warning("aborting the Kafka transaction failed (%s); the producer is re-created", exc)
            self._drop_producer()

    def _failure(self, exc: KafkaException, what: str) -> LogError:
        """The error of a failed transaction step (``what: exc``), except when a newer producer of this named
        writer fenced ours: then this log stays fenced (re-initialising would fence the newer process in turn,
        and the two would take turns failing) and says so."""
        err = exc.args[0] if exc.args else None
        if self.writer is not None and isinstance(err, KafkaError) and err.code() in _FENCED_CODES:
            self._fenced = True
            self._drop_producer()
            return self._fenced_error()
        return LogError(f"{what}: {exc}")

    def _fenced_error(self) -> LogError:
        return LogError(f"another process opened {self._redacted_url()} as writer {self.writer!r} and took over: "
                        "this one appends nothing more (one process per writer name; close this log)")

    def _drop_producer(self) -> None:
        self._producer = None  # fenced or fatal: the next producer re-inits the same transactional.id

    def _remember(self, subs: list[Submission], positions: list[tuple[int, int, int]]) -> None:
        """Index our own committed records straight from the delivery reports."""
        rows = []
        by_tp: dict[tuple[int, int], list[int]] = {}
        for s, (stream, part, off) in zip(subs, positions):
            rows.append(_row(stream, part, off, s.key, s.event_id, s.natural_key, s.event_type,
                             s.content_hash, s.digest, len(s.value)))
            by_tp.setdefault((stream, part), []).append(off)
            if len(s.value) <= _VALUE_CACHE_ITEM:
                self._cache_value((stream, part, off), s.value)
        cursors = self._cursors()
        moved = {}
        for tp, offs in by_tp.items():
            nxt = cursors[tp]
            for off in sorted(offs):  # jump over our records only where they directly follow the cursor
                if off != nxt:
                    break
                nxt = off + 1
            if nxt != cursors[tp]:
                moved[tp] = nxt
                if nxt - 1 == max(offs):
                    self._own_tail[tp] = nxt - 1
        self._index(rows, moved, check=False)

    def _record_conflicts(self, conflicts: list[Conflict], batch: Sequence[Submission]) -> None:
        values = {s.event_id: s.value for s in batch}
        now = time.time()  # operator-queue bookkeeping only; never read by projections
        self._db.execute("PRAGMA synchronous=FULL")
        try:
            with _tx(self._db):
                self._db.executemany(
                    "INSERT INTO conflicts (recorded_at_unix, event_id, natural_key, reason, existing_position, value)"
                    " VALUES (?,?,?,?,?,?)",
                    [(now, c.event_id, c.natural_key, c.reason, c.existing_position, values.get(c.event_id, b""))
                     for c in conflicts])
        finally:
            self._db.execute("PRAGMA synchronous=NORMAL")

    # ------------------------------------------------------------------ reading
    def first_of_type(self, event_type: str) -> str | None:
        with self._lock:
            self._check_open()
            self._catch_up()
            row = self._db.execute("SELECT event_id FROM records WHERE event_type = ? "
                                   "ORDER BY stream, partition, offset LIMIT 1", (event_type,)).fetchone()
        return row[0] if row else None

    def lookup(self, natural_key: str) -> LogRecord | None:
        with self._lock:
            self._check_open()
            self._catch_up()
            cols = "stream, partition, offset, key, event_id, event_type, digest FROM records"
            h = _h(natural_key)
            row = self._db.execute(
                f"SELECT {cols} WHERE natural_key_h = ? AND natural_key = ? UNION ALL "
                f"SELECT {cols} WHERE event_id_h = ? AND event_id = ? AND natural_key IS NULL "
                "ORDER BY 1, 2, 3 LIMIT 1", (h, natural_key, h, natural_key)).fetchone()
            if row is None:
                return None
            stream, part, off, key, eid, etype, digest = row
            value = self._values.get((stream, part, off))
            if value is not None:
                self._values.move_to_end((stream, part, off))
        if value is None:
            value = self._fetch_value(stream, part, off)
            if hashlib.sha256(value).digest() != digest:
                raise LogError(f"{self._position(stream, part, off)}: bytes on the log do not match the indexed digest")
            with self._lock:
                if len(value) <= _VALUE_CACHE_ITEM:
                    self._cache_value((stream, part, off), value)
        return LogRecord(self._topics[stream], part, off, key or "", eid or "", etype or "", value, digest)

    def event_ids(self, natural_keys: Iterable[str]) -> dict[str, str]:
        """natural key -> event id of its first record on the log (the record ``lookup`` returns),
        for the keys on the log: one index catch-up (incremental, from the stored offsets) and
        hashed index queries, 500 keys each; no record is fetched from the broker."""
        keys = list(set(natural_keys))
        if not keys:
            return {}
        with self._lock:
            self._check_open()
            self._catch_up()
            self.counters["keys_looked_up"] += len(keys)
            return {k: r[1] for k, r in self._winners_by_key(keys).items()}

    def _stored_value(self, position: str) -> bytes:
        """The bytes of the accepted event at ``position`` (an idempotency re-check, rare)."""
        topic, part, off = parse_position(position)
        return self._fetch_value(self._topics.index(topic), part, off)

    def _fetch_value(self, stream: int, part: int, offset: int) -> bytes:
        # The index holds committed records only (read back read_committed, or our own after the
        # commit), so the exact offset can be fetched read_uncommitted: a record of ours that sits
        # behind another producer's still-open transaction is readable at once.
        self.counters["values_fetched"] += 1
        for rec in self._read(stream, part, offset, offset + 1, committed=False):
            if rec.offset == offset:
                return rec.value
            break
        raise LogError(f"{self._position(stream, part, offset)} is indexed but not on the log")

    def _cache_value(self, pos: tuple[int, int, int], value: bytes) -> None:
        if pos in self._values:
            return
        self._values[pos] = value
        self._values_bytes += len(value)
        while self._values_bytes > _VALUE_CACHE_BYTES:
            _, old = self._values.popitem(last=False)
            self._values_bytes -= len(old)

    def read(self, where: Partition, start: int = 0, end: int | None = None) -> Iterator[LogRecord]:
        """Records of one partition with ``start <= offset < end``, in offset order.

        ``end`` defaults to the stable end at call time (``end_offsets()``); an ``end`` beyond
        it is clamped to it (records not yet decided are never waited for).
        """
        stream = self._stream(where)
        stable = self.end_offsets()[where]
        end = stable if end is None else min(end, stable)
        return self._read(stream, where[1], max(0, start), end)

    def _read(self, stream: int, part: int, start: int, end: int, *, committed: bool = True) -> Iterator[LogRecord]:
        if start >= end:
            return
        topic = self._topics[stream]
        consumer = self._borrow(committed)
        try:
            _assign(consumer, [TopicPartition(topic, part, start)], self.config.timeout)
            last_progress = next_check = time.monotonic()
            while True:
                msgs = _drain(consumer, 500)
                now = time.monotonic()
                if msgs:
                    last_progress = next_check = now
                else:
                    if now - last_progress > _QUIET and now >= next_check:
                        # No EOF and no data: an open transaction holds the stable end back (on
                        # tansu possibly below ``end``).  Stop here; the caller resumes later.
                        if committed and self._unsettled(stream, part):
                            return
                        next_check = now + _QUIET
                    if now - last_progress > self.config.timeout:
                        raise LogError(f"reading {topic}:{part}: no progress for {self.config.timeout:g} s")
                for m in msgs:
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            self._stable[(stream, part)] = max(self._stable.get((stream, part), 0), m.offset())
                            return
                        raise LogError(f"reading {topic}:{part}: {err.str()}")
                    if m.offset() >= end:
                        return
                    self.counters["records_consumed"] += 1
                    yield _record(topic, m)
        finally:
            self._release(consumer)

    def _unsettled(self, stream: int, part: int) -> bool:
        """Does an open transaction make the stable end of the partition uncertain?"""
        hw, lso = self._list_offsets(IsolationLevel.READ_UNCOMMITTED, IsolationLevel.READ_COMMITTED)
        return hw.get((stream, part)) != lso.get((stream, part))

    def digests(self, where: Partition, end: int | None = None, start: int = 0) -> list[bytes]:
        """Digests of the records of one partition from ``start`` below ``end``, in offset order (Merkle leaves)."""
        stream = self._stream(where)
        with self._lock:
            self._check_open()
            self._catch_up()
            end = self._cursors()[(stream, where[1])] if end is None else end
            return [r[0] for r in self._db.execute(
                "SELECT digest FROM records WHERE stream = ? AND partition = ? AND offset >= ? AND offset < ? ORDER BY offset",
                (stream, where[1], start, end))]

    def conflicts(self) -> list[dict]:
        with self._lock:
            self._check_open()
            self._catch_up()
            cur = self._db.execute("SELECT id, event_id, natural_key, reason, existing_position FROM conflicts ORDER BY id")
            return [dict(zip(("id", "event_id", "natural_key", "reason", "existing_position"), r)) for r in cur]

    # ------------------------------------------------------------------ lifecycle
    def _check_open(self) -> None:
        if self._closed:
            raise LogError(f"{self._redacted_url()} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._producer is not None:
                    self._producer.flush(self.config.timeout)
            finally:
                self._producer = None
                for c in ([self._tail] if self._tail is not None else []) + self._readers[True] + self._readers[False]:
                    try:
                        c.close()
                    except (KafkaException, RuntimeError):
                        pass
                self._readers = {True: [], False: []}
                self._tail = None
                self._db.close()

    def __repr__(self) -> str:
        return f"KafkaLog({self._redacted_url()!r})"


# ---------------------------------------------------------------------------- helpers
class _tx:
    """``with _tx(db):`` one IMMEDIATE SQLite transaction."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, *exc: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


class _Consumer(Consumer):
    """A consumer that remembers which topics it has metadata for."""

    known_topics: set[str]
    committed: bool  # isolation.level=read_committed


def _assign(consumer: _Consumer, tps: list[TopicPartition], timeout: float) -> None:
    """``assign()``; a topic new to this consumer gets its metadata now, not at librdkafka's
    next 1 s topic scan (which would otherwise delay the first fetch by up to a second)."""
    consumer.assign(tps)
    for topic in {tp.topic for tp in tps} - consumer.known_topics:
        try:
            consumer.list_topics(topic, timeout=timeout)
            consumer.known_topics.add(topic)
        except KafkaException:
            pass  # only an optimisation: the fetch still starts at the next scan


def _drain(consumer: Consumer, n: int, wait: float = 0.1) -> list:
    """Up to ``n`` messages/events: wait for the first one, then take whatever is queued."""
    first = consumer.poll(wait)
    if first is None:
        return []
    return [first, *consumer.consume(n - 1, 0)]


def _headers(m) -> dict[str, bytes]:
    return {k: v for k, v in (m.headers() or ()) if v is not None}


def _record(topic: str, m) -> LogRecord:
    h = _headers(m)
    value = m.value() or b""
    key = m.key()
    return LogRecord(topic, m.partition(), m.offset(), key.decode("utf-8", "replace") if key else "",
                     h.get("event_id", b"").decode("utf-8", "replace"), h.get("event_type", b"").decode("utf-8", "replace"),
                     value, hashlib.sha256(value).digest())


def _index_row(stream: int, m) -> tuple:
    h = _headers(m)
    value = m.value() or b""
    key = m.key()
    eid, etype = h.get("event_id"), h.get("event_type")
    nk, chash = h.get("natural_key"), h.get("content_hash")
    if eid is None or etype is None or nk is None or chash is None:
        derived = _derive_identity(value)  # a producer that bypassed the ledger: decode instead
        if derived is not None:
            eid = eid or derived[0].encode()
            etype = etype or derived[1].encode()
            nk = nk or derived[2].encode()
            chash = chash or derived[3]
    dec = (lambda b: b.decode("utf-8", "replace") if b else None)
    return _row(stream, m.partition(), m.offset(), dec(key), dec(eid), dec(nk), dec(etype), chash,
                hashlib.sha256(value).digest(), len(value))


@functools.lru_cache(maxsize=1 << 16)
def _h(text: str) -> int:
    """Stable signed 64-bit hash of an id (the index's integer keys)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _row(stream: int, partition: int, offset: int, key: str | None, event_id: str | None, natural_key: str | None,
         event_type: str | None, content_hash: bytes | None, digest: bytes, length: int) -> tuple:
    """A ``records`` row; the natural key is stored only where it differs from the event id."""
    nk = natural_key if natural_key != event_id else None
    return (stream, partition, offset, key, event_id, nk, event_type, content_hash, digest, length,
            _h(event_id) if event_id else None, _h(nk) if nk else None)


def _derive_identity(value: bytes) -> tuple[str, str, str, bytes] | None:
    """(event_id, event_type, natural_key, content_hash) of an encoded event, or None if undecodable.

    The content hash is :func:`ledger.events.codec.content_hash`, as at ingest.
    """

    try:
        ev = default_codec().decode(value)
        return ev["event_id"], ev["event_type"], natural_key(ev), content_hash(ev, value)
    except Exception:  # noqa: BLE001 - undecodable: indexed by position only; projections dead-letter it
        return None
