"""The log interface shared by the embedded and Kafka backends (SPEC §4.3, §5).

A backend stores single-object encoded events, enforces idempotency by ``event_id``
(identical content: no-op returning the original position; different content: a
conflict, recorded in the operator queue and never applied), and replays records per
(stream, partition) in order.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence
from ledger.events.codec import CodecError, content_hash, default_codec

from ledger.algorithms.errors import StateError

Partition = tuple[str, int]  # (stream, partition): ("log", 0) embedded, (topic, n) on Kafka


@dataclass(frozen=True)
class Submission:
    """An encoded event ready to append."""

    event_id: str
    event_type: str
    key: str  # partition key (execution id or governance subject)
    natural_key: str
    content_hash: bytes  # hash of the producer-supplied content (idempotency comparison)
    governance: bool
    value: bytes  # Avro single-object encoding
    digest: bytes  # SHA-256 of value


@dataclass(frozen=True)
class LogRecord:
    stream: str
    partition: int
    offset: int
    key: str
    event_id: str
    event_type: str
    value: bytes
    digest: bytes

    @property
    def where(self) -> Partition:
        return (self.stream, self.partition)


_new_object, _set_attribute = object.__new__, object.__setattr__


def new_submission(event_id: str, event_type: str, key: str, natural_key: str, content_hash: bytes,
                   governance: bool, value: bytes, digest: bytes) -> Submission:
    """``Submission(event_id, event_type, key, natural_key, content_hash, governance, value, digest)``: the
    same frozen dataclass instance (equal, same hash, repr and fields), its ``__dict__`` set once instead of
    the eight ``object.__setattr__`` calls of the frozen ``__init__`` (ingest builds one per event: issue 33)."""
    sub = _new_object(Submission)
    _set_attribute(sub, "__dict__", {"event_id": event_id, "event_type": event_type, "key": key,
                                     "natural_key": natural_key, "content_hash": content_hash,
                                     "governance": governance, "value": value, "digest": digest})
    return sub


def log_records(stream: str, partition: int, rows: Iterable[tuple[int, int, int, str, str, str, bytes]],
                blob: bytes, blob_offset: int) -> Iterator[LogRecord]:
    """``LogRecord(stream, partition, offset, key, event_id, event_type, value, digest)`` for each
    index row ``(offset, file_offset, length, key, event_id, event_type, digest)`` whose value is
    ``blob[file_offset - blob_offset:][:length]``: the same frozen dataclass instances (equal, same
    hash, repr and fields), built by setting each instance's ``__dict__`` once instead of the eight
    ``object.__setattr__`` calls of the frozen ``__init__`` (a replay builds one per event: issue 33).
    Lazily: each value is sliced when its record is asked for (a consumer that decodes and drops
    each record reuses the same memory)."""
    for offset, file_offset, length, key, event_id, event_type, digest in rows:
        rec = _new_object(LogRecord)
        rel = file_offset - blob_offset
        _set_attribute(rec, "__dict__", {"stream": stream, "partition": partition, "offset": offset, "key": key,
                                         "event_id": event_id, "event_type": event_type,
                                         "value": blob[rel:rel + length], "digest": digest})
        yield rec


@dataclass(frozen=True)
class Conflict:
    event_id: str
    natural_key: str
    reason: str
    existing_position: str | None = None


@dataclass
class AppendResult:
    appended: list[tuple[str, str]] = field(default_factory=list)  # (event_id, position)
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (event_id, original position)
    conflicts: list[Conflict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.conflicts


@dataclass(frozen=True)
class Existing:
    """What a backend knows of an accepted event, for idempotency checks."""

    position: str
    event_id: str
    content_hash: bytes


def same_content_across_schema_versions(stored: bytes, sub: Submission) -> bool:
    """Whether ``stored`` (an accepted event's bytes, written under an older schema version of
    the same record) holds exactly ``sub``'s content.  The idempotency hash is taken over the
    encoded body, so a record whose schema gained an optional field since (ExecutionOpened v1
    -> v2, TaskRegistered v1 -> v2) hashes differently from its re-submission: decode the stored
    event (the newest reader fills the new fields' defaults), encode it under ``sub``'s schema
    and compare hashes.  Sealed events are not compared (their plain content needs the key)."""

    codec = default_codec()
    try:
        old_schema, new_schema = codec.writer_schema(stored), codec.writer_schema(sub.value)
        if old_schema is new_schema or old_schema.name != new_schema.name:
            return False
        ev = codec.decode(stored)
        if ev.get("sealed") is not None:
            return False
        return content_hash(ev, codec.encode(ev, new_schema)) == sub.content_hash
    except (CodecError, KeyError, ValueError, TypeError):
        return False


def classify(batch: Sequence[Submission], by_id: dict[str, Existing],
             by_key: dict[str, Existing],
             stored_value: Callable[[str], bytes] | None = None) -> tuple[list[Submission], AppendResult]:
    """The SPEC §4.3 rules, shared by every backend (pure but for ``stored_value``).

    Returns the submissions to append and a result holding the duplicates (identical
    content: the original position, or ``"batch"`` for a repeat inside this batch) and the
    conflicts (same event id or natural key with different content).  A backend appends
    ``new`` only when ``result.conflicts`` is empty, then calls :func:`settle`.
    ``stored_value(position)`` (the accepted event's bytes) is asked only when an event id's
    content hashes differ, to recognise a re-submission of an event accepted under an older
    schema version (:func:`same_content_across_schema_versions`).
    """
    result = AppendResult()
    if not by_id and not by_key and _all_distinct(batch):  # nothing on the log, no repeat in the batch (the usual)
        return list(batch), result
    new: list[Submission] = []
    seen: dict[str, Submission] = {}
    seen_keys: dict[str, Submission] = {}
    for sub in batch:
        old = by_id.get(sub.event_id)
        if old is not None:
            if old.content_hash == sub.content_hash or (
                    stored_value is not None and same_content_across_schema_versions(stored_value(old.position), sub)):
                result.duplicates.append((sub.event_id, old.position))
            else:
                result.conflicts.append(Conflict(sub.event_id, sub.natural_key, "same event_id with different content",
                                                 old.position))
            continue
        old = by_key.get(sub.natural_key)
        if old is not None:
            result.conflicts.append(Conflict(sub.event_id, sub.natural_key,
                                             f"{sub.natural_key} already recorded as event {old.event_id}", old.position))
            continue
        first = seen.get(sub.event_id) or seen_keys.get(sub.natural_key)
        if first is not None:
            if first.content_hash == sub.content_hash and first.event_id == sub.event_id:
                result.duplicates.append((sub.event_id, "batch"))
            else:
                result.conflicts.append(Conflict(sub.event_id, sub.natural_key,
                                                 "same id twice in one batch with different content"))
            continue
        seen[sub.event_id] = sub
        seen_keys[sub.natural_key] = sub
        new.append(sub)
    return new, result


def _all_distinct(batch: Sequence[Submission]) -> bool:
    """No event id and no natural key occurs twice in ``batch`` (two C-speed set builds)."""
    return len({s.event_id for s in batch}) == len(batch) == len({s.natural_key for s in batch})


def settle(result: AppendResult, new: Sequence[Submission], positions: Sequence[str]) -> AppendResult:
    """Record where ``new`` landed and point in-batch repeats at their first copy."""
    result.appended = [(s.event_id, p) for s, p in zip(new, positions)]
    if result.duplicates:
        first = dict(result.appended)
        result.duplicates = [(e, first.get(e, p) if p == "batch" else p) for e, p in result.duplicates]
    return result


class LogError(StateError):
    """The log cannot do what was asked (locked, unreachable, corrupt)."""


class CorruptStore(LogError):
    """A file of the store (the embedded index, a projection database) is damaged or not what
    it should be; the message names the file.  ``ledger audit`` reports it as a finding (exit 1),
    every other command as a one-line error (exit 2)."""


Recheck = Callable[[Sequence["Submission"]], None]
"""``recheck(subs)``: called by ``append`` while it holds the writer lock, after the backend
has caught up with the log and classified the batch, with the submissions about to be written
(duplicates of accepted events left out), before anything is written; raises to refuse the
whole batch (nothing appended).  Ingest uses it to re-check the references that a concurrent writer can
invalidate (a closure, a root split policy: SPEC §9 "References are checked under the writer
lock")."""


class Log(abc.ABC):
    """What every backend provides.  Positions are strings: ``"17"`` embedded, ``"topic:p:offset"`` on Kafka."""

    url: str

    @abc.abstractmethod
    def append(self, batch: Sequence[Submission], *, recheck: Recheck | None = None) -> AppendResult:
        """Append atomically: all new events, or none if any conflicts.

        ``recheck`` (see :data:`Recheck`) runs under the writer lock before anything is written;
        an exception it raises propagates and nothing of the batch is appended."""

    @abc.abstractmethod
    def lookup(self, natural_key: str) -> LogRecord | None:
        """The accepted event with this natural key, if any."""

    @abc.abstractmethod
    def first_of_type(self, event_type: str) -> str | None:
        """The event id of the earliest accepted event of this type (governance first), if any."""

    @abc.abstractmethod
    def partitions(self) -> list[Partition]:
        """Every (stream, partition), governance first."""

    @abc.abstractmethod
    def end_offsets(self) -> dict[Partition, int]:
        """Next offset to be written, per partition."""

    @abc.abstractmethod
    def read(self, where: Partition, start: int = 0, end: int | None = None) -> Iterator[LogRecord]:
        """Records of one partition from ``start`` up to (not including) ``end``."""

    @abc.abstractmethod
    def digests(self, where: Partition, end: int | None = None, start: int = 0) -> list[bytes]:
        """Stored digests of one partition from ``start`` below ``end``, in order (its Merkle leaves), without
        reading values."""

    @abc.abstractmethod
    def conflicts(self) -> list[dict]:
        """The operator queue of rejected conflicting submissions."""

    def event_ids(self, natural_keys: Iterable[str]) -> dict[str, str]:
        """natural key -> event id of the accepted event with that key, for the keys on the log.

        The batch form of ``lookup(k) is not None`` that reads no event bytes (SPEC §9 "Retries
        are cheap on Kafka": ingest's reference and duplicate checks cost O(batch)).  Backends
        whose ``lookup`` is not a local read override it (Kafka: one index catch-up, hashed
        index queries, no fetch)."""
        out = {}
        for key in set(natural_keys):
            rec = self.lookup(key)
            if rec is not None:
                out[key] = rec.event_id
        return out

    def stored_keys(self, where: Partition) -> Iterator[tuple]:
        """``(offset, natural key, idempotency hash, governance flag)`` as the backend stored them for
        each event of one partition when it was appended, in offset order (the flag is ``None`` where the
        backend keeps none): what :func:`ledger.corpus.integrity.audit` checks against the events
        themselves (a row altered there would let a different retry pass as a duplicate, or a
        conflicting event in).  Default: nothing, for a backend whose index is
        rebuilt from the log itself (Kafka's is a cache), so it holds nothing independent to check."""
        return iter(())

    def storage_problems(self) -> list[str]:
        """What an audit finds wrong with the backend's own storage, beyond the events' digests
        (the embedded log: SQLite's integrity check, missing index rows, non-contiguous file
        offsets, unindexed bytes).  Default: nothing to check (Kafka's index is a cache)."""
        return []

    def close(self) -> None:  # pragma: no cover - trivial default
        pass

    def __enter__(self) -> "Log":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
