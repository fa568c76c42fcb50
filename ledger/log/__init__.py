"""Log backends behind one interface: ``open_log(url)`` picks embedded or Kafka."""

from __future__ import annotations

import os

from .base import AppendResult, Conflict, Log, LogError, LogRecord, Partition, Submission

DEFAULT_STORE = "./ledger-data"


def store_url(url: str | None = None) -> str:
    """``url``, else ``$LEDGER_STORE``, else ``./ledger-data`` (SPEC §7.2)."""
    return url or os.environ.get("LEDGER_STORE") or DEFAULT_STORE


def open_log(url: str | None = None, *, create: bool = False) -> Log:
    """Open the log at ``url``: a directory (embedded) or ``kafka://HOST:PORT/PREFIX``."""
    url = store_url(url)
    if url.startswith("kafka://"):
        from .kafka import KafkaLog

        return KafkaLog(url, create=create)
    from .embedded import EmbeddedLog

    return EmbeddedLog(url, create=create)


__all__ = ["AppendResult", "Conflict", "Log", "LogError", "LogRecord", "Partition", "Submission", "open_log", "store_url"]
