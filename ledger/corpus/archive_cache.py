"""Manifest archives as ``ledger serve`` reads them (issue 32: a first request must not take seconds).

Every read reads an archive's bytes and hashes them (SHA-256: ~0.06 s for a 57 MB archive of
70,000 members).  What parsing those exact bytes found -- the document's canonical SHA-256 (what
authenticates it against the ``manifest_sha256`` on the log), the document without its members and
the members' execution ids -- is kept in memory and in the store's ``archive-cache.db``, keyed by the
SHA-256 of the bytes, so that a new server need not parse and canonically re-hash the archive
(~1.3 s) to list publications, describe one (Croissant) or authenticate it; ``ledger manifest publish``
records the archive it writes (:func:`record`), so even a server's first look is fast.  A changed archive has
other bytes, so an answer found for other bytes is never used for it (a ``(size, mtime, inode)`` key
can be fooled by a rewrite that keeps them).  The cache is as trusted as the store's other side
files (its index, its projection database); deleting it costs only time.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ledger.corpus import manifest as M
from ledger.corpus.manifest import PublishError, parse_manifest

_SCHEMA = ("CREATE TABLE IF NOT EXISTS archives (file_sha256 TEXT PRIMARY KEY, document_sha256 TEXT NOT NULL, "
           "head TEXT NOT NULL, execution_ids TEXT NOT NULL)")


@dataclass(frozen=True)
class Archive:
    """What one version (these bytes) of an archive holds; ``problem`` when it cannot be read or parsed."""

    file_sha256: str | None
    document_sha256: str | None = None
    problem: str | None = None
    head: dict | None = None  # the document without "members"
    execution_ids: list[str] | None = None  # the members' execution ids in order (None: no members list)


_DOCS: dict[str, Any] = {}  # file SHA-256 -> the parsed document (the newest few; callers must not change it)
_FOUND: dict[str, Archive] = {}  # file SHA-256 -> Archive
_LOCK = threading.Lock()


def clear() -> None:
    """Forget what this process read (a new server; tests)."""
    _DOCS.clear()
    _FOUND.clear()


def _remember(table: dict, key: str, value: Any, most: int) -> None:
    with _LOCK:  # the server's worker threads share the tables
        while len(table) >= most:
            table.pop(next(iter(table)))
        table[key] = value


def _read(path: Path) -> tuple[bytes, str] | Archive:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return Archive(None, problem=f"cannot read {path}: {exc.strerror or exc}")
    return data, hashlib.sha256(data).hexdigest()


def _load(cache: Path | None, sha: str) -> Archive | None:
    if cache is None or not cache.exists():
        return None
    try:
        with closing(sqlite3.connect(f"file:{cache}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT document_sha256, head, execution_ids FROM archives WHERE file_sha256 = ?",
                             (sha,)).fetchone()
        if row is None:
            return None
        head, ids = json.loads(row[1]), json.loads(row[2])
    except (sqlite3.Error, ValueError):
        return None  # an unreadable cache is no cache
    if not isinstance(row[0], str) or not isinstance(head, dict) or not (ids is None or isinstance(ids, list)):
        return None
    return Archive(sha, row[0], None, head, ids)


def _save(cache: Path | None, found: Archive) -> None:
    if cache is None:
        return
    try:
        with closing(sqlite3.connect(cache)) as db, db:
            db.execute(_SCHEMA)
            db.execute("INSERT OR REPLACE INTO archives VALUES (?, ?, ?, ?)",
                       (found.file_sha256, found.document_sha256, json.dumps(found.head, sort_keys=True),
                        json.dumps(found.execution_ids)))
    except (sqlite3.Error, OSError):
        pass  # a read-only store: the next server parses again


def _parse(path: Path, data: bytes, sha: str, cache: Path | None) -> tuple[Any, Archive]:
    """Parse ``data`` (the bytes whose SHA-256 is ``sha``); the canonical hash is computed only when
    neither this process nor the cache has it for these bytes."""
    try:
        doc = parse_manifest(data, path)
    except PublishError as exc:
        return None, Archive(sha, problem=str(exc))
    known = _FOUND.get(sha) or _load(cache, sha)
    found = _found(sha, known.document_sha256 if known else M.document_sha256(doc), doc)
    if known is None:
        _save(cache, found)
    _remember(_FOUND, sha, found, 64)
    _remember(_DOCS, sha, doc, 4)
    return doc, found


def _found(sha: str, document_sha256: str, doc: dict) -> Archive:
    members = doc.get("members")
    return Archive(sha, document_sha256, None, {k: v for k, v in doc.items() if k != "members"},
                   [str(m.get("execution_id")) for m in members if isinstance(m, dict)]
                   if isinstance(members, list) else None)


def record(cache: Path | None, data: bytes, document_sha256: str, doc: dict) -> None:
    """Remember that the archive bytes ``data`` hold ``doc``, whose canonical SHA-256 is
    ``document_sha256`` (the publisher, which serialised ``doc`` into ``data`` itself)."""
    _save(cache, _found(hashlib.sha256(data).hexdigest(), document_sha256, doc))


def summary(path: Path, cache: Path | None) -> Archive:
    """What the archive at ``path`` holds now, without parsing it when these bytes were parsed before."""
    read = _read(path)
    if isinstance(read, Archive):
        return read
    data, sha = read
    found = _FOUND.get(sha) or _load(cache, sha)
    if found is None:
        return _parse(path, data, sha, cache)[1]
    _remember(_FOUND, sha, found, 64)
    return found


def document(path: Path, cache: Path | None) -> tuple[Any, Archive]:
    """``(document, Archive)`` of the archive at ``path`` now (the document None on a problem)."""
    read = _read(path)
    if isinstance(read, Archive):
        return None, read
    data, sha = read
    doc, found = _DOCS.get(sha), _FOUND.get(sha)
    if doc is not None and found is not None:
        return doc, found
    return _parse(path, data, sha, cache)
