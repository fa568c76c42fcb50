"""The log interface shared by the embedded and Kafka backends (SPEC §4.3, §5).

A backend stores single-object encoded events, enforces idempotency by ``event_id``
(identical content: no-op returning the original position; different content: a
conflict, recorded in the operator queue and never applied), and replays records per
(stream, partition) in order.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterator, Sequence

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


class LogError(RuntimeError):
    """The log cannot do what was asked (locked, unreachable, corrupt)."""


class Log(abc.ABC):
    """What every backend provides.  Positions are strings: ``"17"`` embedded, ``"topic:p:offset"`` on Kafka."""

    url: str

    @abc.abstractmethod
    def append(self, batch: Sequence[Submission]) -> AppendResult:
        """Append atomically: all new events, or none if any conflicts."""

    @abc.abstractmethod
    def lookup(self, natural_key: str) -> LogRecord | None:
        """The accepted event with this natural key, if any."""

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
    def conflicts(self) -> list[dict]:
        """The operator queue of rejected conflicting submissions."""

    def close(self) -> None:  # pragma: no cover - trivial default
        pass

    def __enter__(self) -> "Log":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
