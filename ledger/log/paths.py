"""Where a store keeps its side files (SPEC §7.2): trust file, checkpoint key, projection DB."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ledger.log import store_url


@dataclass(frozen=True)
class StorePaths:
    url: str
    trust: Path
    checkpoint_key: Path
    db: Path
    data_keys: Path  # per-subject data keys for crypto-shredding, kept outside the log
    checkpoints: Path | None = None  # the signed checkpoints `ledger log head` printed (audit checks the log against them)

    @property
    def is_kafka(self) -> bool:
        return self.url.startswith("kafka://")


def store_paths(url: str | None = None, *, db: str | None = None, trust: str | None = None) -> StorePaths:
    """Resolve the side files of a store: inside an embedded store, else the working directory.

    ``LEDGER_DATA_KEYS`` names the data-key store explicitly (every producer and projector of a
    Kafka store must see the same one; the default for Kafka is ``./data-keys.db``)."""
    url = store_url(url)
    base = Path(".") if url.startswith("kafka://") else Path(url)
    return StorePaths(
        url=url,
        trust=Path(trust) if trust else base / "trust.json",
        checkpoint_key=base / "checkpoint.key",
        db=Path(db) if db else base / "projections.db",
        data_keys=Path(os.environ["LEDGER_DATA_KEYS"]) if os.environ.get("LEDGER_DATA_KEYS") else base / "data-keys.db",
        checkpoints=base / "checkpoints.jsonl",
    )


def origin_name(url: str) -> str:
    """The checkpoint origin line for a store (stable, human-readable)."""
    name = url[len("kafka://"):].split("?")[0] if url.startswith("kafka://") else Path(url).resolve().name
    # signed-note key names may not contain spaces or '+'
    return "trajectory-ledger/" + "".join("-" if c.isspace() or c == "+" else c for c in name)
