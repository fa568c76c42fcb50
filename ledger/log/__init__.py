"""Log backends behind one interface: ``open_log(url)`` picks embedded or Kafka.

``base`` (the ``Log`` interface and the shared idempotency classifier), ``embedded``
(segment file + SQLite index), ``kafka`` and ``kafka_group`` (the Kafka backend and its
consumer-group reader), ``paths`` (a store's side files), ``sealing`` (sealed token
payloads and the data-key store kept beside the log, for crypto-shredding).

May import: ``ledger.algorithms`` and ``ledger.events``. Not ``projections`` or anything above.
"""

from __future__ import annotations

import os

from ledger.log.base import (
    AppendResult,
    Conflict,
    Log,
    LogError,
    LogRecord,
    Partition,
    Submission,
)
from ledger.log.embedded import EmbeddedLog
from ledger.log.kafka import KafkaLog

DEFAULT_STORE = "./ledger-data"


def store_url(url: str | None = None) -> str:
    """``url``, else ``$LEDGER_STORE``, else ``./ledger-data`` (SPEC §7.2)."""
    return url or os.environ.get("LEDGER_STORE") or DEFAULT_STORE


def open_log(url: str | None = None, *, create: bool = False, writer: str | None = None) -> Log:
    """Open the log at ``url``: a directory (embedded) or ``kafka://HOST:PORT/PREFIX``.

    ``writer`` names an exclusive writer (one process at a time, e.g. a feed consumer).  On Kafka
    its transactional id is derived from that name and the log fences at once: a transaction a
    killed predecessor of the same name left open is aborted now instead of holding every
    ``read_committed`` reader of its partitions back until the broker's transaction timeout.  The
    embedded log needs nothing (a crashed writer leaves no open transaction there)."""
    url = store_url(url)
    if writer is not None and not writer.strip():
        raise LogError("a writer name must not be empty (it names one process that writes at a time)")
    if url.startswith("kafka://"):

        return KafkaLog(url, create=create, writer=writer)

    return EmbeddedLog(url, create=create)


__all__ = ["AppendResult", "Conflict", "Log", "LogError", "LogRecord", "Partition", "Submission", "open_log", "store_url"]
