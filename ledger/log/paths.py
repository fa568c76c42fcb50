"""Where a store keeps its side files (SPEC §7.2): trust file, checkpoint key, projection DB."""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ledger.algorithms.checkpoint import vkey as _vkey
from ledger.events.signing import load_private_key, public_bytes
from ledger.log import store_url
from ledger.log.base import LogError


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

    @property
    def frontiers(self) -> Path | None:
        """Each partition's Merkle frontier at its last signed checkpoint (``ledger log head`` writes
        it; ``ledger status`` and ``ledger serve`` extend it instead of hashing the whole log)."""
        return None if self.checkpoints is None else self.checkpoints.with_name("frontiers.json")

    @property
    def archive_cache(self) -> Path | None:
        """What ``ledger serve`` found in each manifest archive, keyed by the SHA-256 of its bytes
        (``ledger.corpus.archive_cache``; a cache: deleting it costs only time)."""
        return None if self.checkpoints is None else self.checkpoints.with_name("archive-cache.db")

    @property
    def checkpoint_origin(self) -> Path:
        """The store's checkpoint origin (one line), beside the checkpoint key."""
        return self.checkpoint_key.with_name("checkpoint.origin")

    @property
    def checkpoint_vkey(self) -> Path:
        """The checkpoint verifier key for auditors (public; one line), beside the checkpoint key."""
        return self.checkpoint_key.with_name("checkpoint.vkey")


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
    """The origin a store had before origins were stored (derived from its folder name or Kafka
    prefix): only for a store whose ``checkpoint.origin`` is missing; see :func:`store_origin`."""
    name = url[len("kafka://"):].split("?")[0] if url.startswith("kafka://") else Path(url).resolve().name
    # signed-note key names may not contain spaces or '+'
    return "trajectory-ledger/" + "".join("-" if c.isspace() or c == "+" else c for c in name)


MAX_ORIGIN = 200


class OriginError(LogError):
    """A checkpoint origin is not a valid signed-note key name, or cannot be set."""


def check_origin(origin: str, what: str = "origin") -> str:
    """``origin`` if it can name the checkpoint key (non-empty, no whitespace or '+', no control
    characters, at most 200 characters), else OriginError saying what is wrong."""
    if not origin:
        raise OriginError(f"{what} is empty")
    if len(origin) > MAX_ORIGIN:
        raise OriginError(f"{what} has {len(origin)} characters, at most {MAX_ORIGIN}")
    for char in origin:
        if char.isspace() or char == "+" or char < " " or char == "\x7f":
            raise OriginError(f"{what} {origin!r} contains {char!r} (no whitespace, '+' or control characters)")
    return origin


def default_origin(public_key: bytes) -> str:
    """A new store's origin: unique per checkpoint key, unchanged when the store moves."""
    return "trajectory-ledger/" + hashlib.sha256(public_key).hexdigest()[:16]


def _write_line(path: Path, text: str) -> None:
    """Write ``text`` + newline to ``path`` atomically (a temporary beside it, then rename)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_origin(paths: StorePaths) -> str | None:
    """The origin stored in ``checkpoint.origin`` (validated), or None when there is none."""
    try:
        text = paths.checkpoint_origin.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise OriginError(f"cannot read the store's origin file {paths.checkpoint_origin} ({exc})") from None
    return check_origin(text[:-1] if text.endswith("\n") else text, f"the origin in {paths.checkpoint_origin}")


def store_origin(paths: StorePaths, *, write: bool = True) -> str:
    """The store's checkpoint origin: the stored one; for a store made before origins were stored,
    the old folder-derived :func:`origin_name` (its published checkpoints keep verifying), stored
    now when ``write``."""
    origin = read_origin(paths)
    if origin is None:
        origin = check_origin(origin_name(paths.url), "the derived origin")
        if write:
            _write_line(paths.checkpoint_origin, origin)
    return origin


def check_init_origin(paths: StorePaths, requested: str | None, *, new_key: bool) -> str | None:
    """The stored origin (None if none) after checking that ``requested`` may be stored (OriginError)."""
    current = read_origin(paths)
    if requested is not None:
        check_origin(requested)
        if current is not None and current != requested:
            raise OriginError(f"the store already has origin {current!r} ({paths.checkpoint_origin}); an origin "
                              "never changes (its published checkpoints name it)")
        if current is None and not new_key and paths.checkpoints and paths.checkpoints.exists() \
                and paths.checkpoints.stat().st_size:
            raise OriginError(f"the store has recorded checkpoints ({paths.checkpoints}) under origin "
                              f"{origin_name(paths.url)!r}; an origin never changes")
    return current


def init_origin(paths: StorePaths, public_key: bytes, requested: str | None, *, new_key: bool) -> str:
    """Store the origin at ``ledger init``: ``requested`` (validated), else the stored one, else
    :func:`default_origin` for a new key (the derived one for an old store's key).  An origin
    already stored, or already used by recorded checkpoints, is never changed (OriginError)."""
    current = check_init_origin(paths, requested, new_key=new_key)
    if current is not None:
        return current
    origin = requested or (default_origin(public_key) if new_key else check_origin(origin_name(paths.url)))
    _write_line(paths.checkpoint_origin, origin)
    return origin


def checkpoint_identity(paths: StorePaths, *, write: bool = True) -> dict:
    """``{"origin", "vkey", "key_hash"}`` of the store's checkpoint key: the verifier key is derived
    from the private key (the key name is the origin) and, when ``write``, kept in
    ``checkpoint.vkey`` (rewritten if it differs).  Nothing secret leaves the key file."""
    public = public_bytes(load_private_key(paths.checkpoint_key))
    origin = store_origin(paths, write=write)
    line = _vkey(origin, public)
    if write:
        try:
            current = paths.checkpoint_vkey.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            current = None
        if current != line + "\n":
            _write_line(paths.checkpoint_vkey, line)
    return {"origin": origin, "vkey": line, "key_hash": line.split("+")[1]}
