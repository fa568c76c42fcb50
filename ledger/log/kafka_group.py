"""Live readers of a Kafka ledger for projector processes (``ledger project --follow``).

:class:`GroupReader` combines two consumers:

* **executions**: with a ``group`` it ``subscribe()``s to ``PREFIX.executions`` as a member
  of that consumer group and reads only the partitions the group assigns to it; without a
  group it ``assign()``s every partition.  Offsets are never committed to Kafka (no
  auto-commit, no offset store): the source of truth is the position each projection
  database stores atomically with its state (SPEC §3, §5).  On every assignment the caller
  says where each partition starts (:meth:`GroupReader.start_executions`), typically the
  position stored in that partition's shard; a partition whose shard is not ready yet (its
  lock is still held by the previous owner) is simply left out until it is.
* **governance**: ``PREFIX.governance`` (one partition) ``assign()``-ed directly -- every
  projector reads it in full, from the lowest position any of its shards needs
  (:meth:`GroupReader.start_governance`).

Group settings: ``session.timeout.ms=6000`` and ``heartbeat.interval.ms=500`` (tansu makes a
new member wait for the session timeout of the group; with librdkafka's 45 s default a join
takes ~23 s, with these ~3 s), ``enable.auto.commit=false``, ``isolation.level=read_committed``.
``fetch.wait.max.ms`` is 25 (tansu holds an empty fetch for the whole wait instead of
answering when data arrives, so this bounds the idle latency; it must be >= 1).
Rebalance callbacks run inside :meth:`GroupReader.poll`, between the caller's batches, so a
revocation never interrupts a batch transaction.

Records come back as :class:`~ledger.log.base.LogRecord` plus the producer's timestamp (for
end-to-end latency figures only; projections never see it).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from ledger.log.base import LogError, LogRecord, Partition
from ledger.log.kafka import _MAX_MESSAGE, _record, parse_url

_log = logging.getLogger(__name__)

GROUP_DEFAULTS = {
    "session.timeout.ms": 6000,
    "heartbeat.interval.ms": 500,
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "isolation.level": "read_committed",
    "auto.offset.reset": "earliest",
    "fetch.wait.max.ms": 25,
    "max.partition.fetch.bytes": 8 * 1024 * 1024,
    "fetch.max.bytes": _MAX_MESSAGE,
    "receive.message.max.bytes": 2 * _MAX_MESSAGE,
    "queued.max.messages.kbytes": 65536,
}


@dataclass
class Batch:
    """Records of one partition, in offset order, with their producer timestamps (seconds)."""

    where: Partition
    records: list[LogRecord] = field(default_factory=list)
    timestamps: list[float | None] = field(default_factory=list)


class GroupReader:
    """Consumer-group reader of the executions topic plus a full reader of the governance topic."""

    def __init__(self, url: str, group: str | None, *, on_assign: Callable[[list[int]], None] | None = None,
                 on_revoke: Callable[[list[int]], None] | None = None, config: dict | None = None,
                 client_id: str | None = None) -> None:
        cfg = parse_url(url)
        self.url, self.group = url, group
        self.executions_topic = f"{cfg.prefix}.executions"
        self.governance_topic = f"{cfg.prefix}.governance"
        self._on_assign, self._on_revoke = on_assign, on_revoke
        base = {"bootstrap.servers": cfg.bootstrap, "client.id": client_id or f"ledger-projector-{cfg.prefix}",
                "socket.connection.setup.timeout.ms": max(1000, int(cfg.timeout * 1000)), "logger": _log,
                **GROUP_DEFAULTS, **(config or {})}
        self._timeout = cfg.timeout
        self.assigned: list[int] = []  # the partitions the group gave us (all of them without a group)
        self.running: dict[int, int] = {}  # partitions being fetched -> start offset given
        self._gov_running = False
        self._closed = False
        try:
            self._gov = Consumer({**base, "group.id": f"ledger-governance-{uuid.uuid4().hex}"})
            self._exe = Consumer({**base, "group.id": group or f"ledger-follow-{uuid.uuid4().hex}"})
            md = self._exe.list_topics(timeout=cfg.timeout)
        except KafkaException as exc:
            raise LogError(f"cannot reach the Kafka broker at {cfg.bootstrap}: {exc}") from None
        missing = [t for t in (self.governance_topic, self.executions_topic) if t not in md.topics
                   or md.topics[t].error is not None]
        if missing:
            self.close()
            raise LogError(f"no ledger topics {' and '.join(missing)} on {cfg.bootstrap} (run `ledger init` first)")
        self.n_partitions = len(md.topics[self.executions_topic].partitions)
        if group is not None:
            self._exe.subscribe([self.executions_topic], on_assign=self._assigned, on_revoke=self._revoked,
                                on_lost=self._revoked)
        else:
            self.assigned = list(range(self.n_partitions))

    # ------------------------------------------------------------------ group callbacks
    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.assigned = sorted(tp.partition for tp in partitions)
        self.running = {}
        consumer.assign([])  # nothing is fetched until the caller says where each partition starts
        _log.info("assigned %s partitions %s", self.executions_topic, self.assigned)
        if self._on_assign is not None:
            self._on_assign(list(self.assigned))

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        gone = sorted(tp.partition for tp in partitions)
        _log.info("revoked %s partitions %s", self.executions_topic, gone)
        self.assigned = [p for p in self.assigned if p not in gone]
        self.running = {p: o for p, o in self.running.items() if p not in gone}
        try:
            consumer.unassign()
        except KafkaException:
            pass
        if self._on_revoke is not None:
            self._on_revoke(gone)

    # ------------------------------------------------------------------ positions
    def start_executions(self, positions: dict[int, int]) -> None:
        """Fetch exactly these partitions, each from the offset given (replaces the previous set).

        Partitions not given are not fetched (e.g. their shard is still locked by the previous owner).
        """
        wanted = {p: int(o) for p, o in positions.items() if p in self.assigned}
        if wanted == self.running:
            return
        self._exe.assign([TopicPartition(self.executions_topic, p, o) for p, o in sorted(wanted.items())])
        self.running = wanted

    def start_governance(self, offset: int | None) -> None:
        """Read the governance topic from ``offset`` (``None``: stop reading it)."""
        if offset is None:
            if self._gov_running:
                self._gov.unassign()
                self._gov_running = False
            return
        self._gov.assign([TopicPartition(self.governance_topic, 0, int(offset))])
        self._gov_running = True

    # ------------------------------------------------------------------ reading
    def poll(self, timeout: float = 0.1, max_records: int = 500) -> list[Batch]:
        """Whatever arrived: governance first, then execution partitions (each batch one partition)."""
        out: list[Batch] = []
        waited = False
        if self._gov_running:
            msgs = self._drain(self._gov, max_records, 0.0)
            out += self._batches(msgs)
        if not out:
            waited = True
        msgs = self._drain(self._exe, max_records, timeout if waited else 0.0)
        out += self._batches(msgs, only=set(self.running))
        return out

    @staticmethod
    def _drain(consumer: Consumer, n: int, wait: float) -> list:
        first = consumer.poll(wait)
        if first is None:
            return []
        return [first, *consumer.consume(n - 1, 0)]

    def _batches(self, msgs: list, only: set[int] | None = None) -> list[Batch]:
        by: dict[Partition, Batch] = {}
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal():
                    raise LogError(f"Kafka consumer failed: {err.str()}")
                _log.warning("Kafka consumer: %s", err.str())
                continue
            topic, part = m.topic(), m.partition()
            if only is not None and topic == self.executions_topic and part not in only:
                continue  # fetched before a revocation or a re-assignment: not ours now
            b = by.get((topic, part))
            if b is None:
                b = by[(topic, part)] = Batch((topic, part))
            b.records.append(_record(topic, m))
            ts_type, ts = m.timestamp()
            b.timestamps.append(ts / 1000.0 if ts_type != 0 and ts > 0 else None)
        return list(by.values())

    def close(self) -> None:
        """Leave the group (revoking: the callbacks run) and close both consumers."""
        if self._closed:
            return
        self._closed = True
        for c in (getattr(self, "_exe", None), getattr(self, "_gov", None)):
            if c is None:
                continue
            try:
                c.close()
            except (KafkaException, RuntimeError):
                pass


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes (a helper for callers and tests)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
