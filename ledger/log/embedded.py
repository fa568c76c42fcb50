"""The embedded log: a local directory, no server (SPEC §5).

Layout of the store directory:

``events.dat``   append-only segment: the single-object encoded events, back to back.
``index.db``     SQLite (WAL, synchronous=FULL): one row per event (position, offset,
                 length, partition key, event id, natural key, type, content hash, digest)
                 and the operator queue of conflicts.
``writer.lock``  ``flock`` held while appending: one writer at a time, readers never block.

An append writes the bytes, ``fdatasync``s the segment, then commits the index rows in one
transaction.  A crash between the two leaves unindexed bytes at the tail of the segment,
which the next writer truncates: an event is acknowledged exactly when its index row is.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ledger.log.base import (
    AppendResult,
    Conflict,
    CorruptStore,
    Existing,
    Log,
    LogError,
    LogRecord,
    Partition,
    Recheck,
    Submission,
    classify,
    log_records,
    settle,
)

STREAM = "log"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    position INTEGER PRIMARY KEY,
    file_offset INTEGER NOT NULL,
    length INTEGER NOT NULL,
    key TEXT NOT NULL,
    event_id TEXT NOT NULL UNIQUE,
    natural_key TEXT NOT NULL,
    event_type TEXT NOT NULL,
    governance INTEGER NOT NULL,
    content_hash BLOB NOT NULL,
    digest BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS events_natural_key ON events(natural_key);
CREATE TABLE IF NOT EXISTS conflicts (
    id INTEGER PRIMARY KEY,
    recorded_at_unix REAL NOT NULL,
    event_id TEXT NOT NULL,
    natural_key TEXT NOT NULL,
    reason TEXT NOT NULL,
    existing_position TEXT,
    value BLOB NOT NULL
);
"""


class EmbeddedLog(Log):
    """Append-only log in a local directory."""

    def __init__(self, path: str | os.PathLike, *, create: bool = False) -> None:
        self.path = Path(path)
        self.url = str(self.path)
        if not (self.path / "index.db").exists():
            if not create:
                raise LogError(f"no ledger store at {self.path} (run `ledger init` first)")
            self.path.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path / "index.db", isolation_level=None, check_same_thread=False)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA busy_timeout=30000")
            self._db.executescript(_SCHEMA)
            self._db.execute("SELECT COUNT(*) FROM events WHERE position < 0").fetchone()  # reads the table's root page
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise CorruptStore(f"{self.path / 'index.db'}: the index is damaged or not a SQLite database ({exc}); "
                               "run `ledger audit`") from None
        self._data_path = self.path / "events.dat"
        self._data_path.touch(exist_ok=True)
        self._reader = open(self._data_path, "rb")

    # ------------------------------------------------------------------ writing
    def append(self, batch: Sequence[Submission], *, recheck: Recheck | None = None) -> AppendResult:
        if not batch:
            return AppendResult()
        with _WriterLock(self.path / "writer.lock"):
            by_id, by_key = existing(self._db, batch)
            new, result = classify(batch, by_id, by_key, self._stored_value)
            if result.conflicts:
                self._record_conflicts(result.conflicts, batch)
                return result
            if new and recheck is not None:
                recheck(new)  # under the lock: what it reads cannot change before the write below
            if new:
                settle(result, new, list(map(str, self._write(new))))
        return result

    def _write(self, subs: list[Submission]) -> range:
        # the last row by position ends the segment (offsets are contiguous; `ledger audit` checks it):
        # one B-tree step, where MAX(file_offset + length) scanned the whole table on every append
        last = self._db.execute("SELECT position, file_offset + length FROM events ORDER BY position DESC LIMIT 1").fetchone()
        end_pos, end_off = (last[0] + 1, last[1]) if last is not None else (0, 0)
        fd = os.open(self._data_path, os.O_WRONLY)
        try:
            if os.fstat(fd).st_size != end_off:  # unacknowledged tail from a crashed writer
                os.ftruncate(fd, end_off)
            os.lseek(fd, end_off, os.SEEK_SET)
            write_all(fd, [s.value for s in subs])
            os.fdatasync(fd)
        finally:
            os.close(fd)
        rows = index_rows(subs, end_pos, end_off)
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.executemany("INSERT INTO events VALUES (?,?,?,?,?,?,?,?,?,?)", rows)
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return range(end_pos, end_pos + len(rows))

    def _stored_value(self, position: str) -> bytes:
        """The bytes of the accepted event at ``position`` (an idempotency re-check, rare)."""
        off, length = self._db.execute("SELECT file_offset, length FROM events WHERE position = ?",
                                       (int(position),)).fetchone()
        fd = os.open(self._data_path, os.O_RDONLY)
        try:
            return os.pread(fd, length, off)
        finally:
            os.close(fd)

    def _record_conflicts(self, conflicts: list[Conflict], batch: Sequence[Submission]) -> None:
        values = {s.event_id: s.value for s in batch}
        now = time.time()  # operator-queue bookkeeping only; never read by projections
        self._db.execute("BEGIN IMMEDIATE")
        self._db.executemany(
            "INSERT INTO conflicts (recorded_at_unix, event_id, natural_key, reason, existing_position, value) VALUES (?,?,?,?,?,?)",
            [(now, c.event_id, c.natural_key, c.reason, c.existing_position, values.get(c.event_id, b"")) for c in conflicts],
        )
        self._db.execute("COMMIT")

    # ------------------------------------------------------------------ reading
    def lookup(self, natural_key: str) -> LogRecord | None:
        row = self._db.execute(
            "SELECT position, file_offset, length, key, event_id, event_type, digest FROM events WHERE natural_key = ?",
            (natural_key,),
        ).fetchone()
        return self._record(row) if row else None

    def event_ids(self, natural_keys: Iterable[str]) -> dict[str, str]:
        """natural key -> event id of the event :meth:`lookup` returns (the first by position), for
        the keys on the log: one indexed query per 500 keys, no event bytes read (was one
        ``lookup`` per key, each reading its event: issue 33)."""
        keys = list(set(natural_keys))
        out: dict[str, str] = {}
        for i in range(0, len(keys), 500):
            chunk = keys[i:i + 500]
            q = f"SELECT natural_key, event_id FROM events WHERE natural_key IN ({','.join('?' * len(chunk))}) ORDER BY position"
            for nk, eid in self._db.execute(q, chunk):
                out.setdefault(nk, eid)
        return out

    def first_of_type(self, event_type: str) -> str | None:
        row = self._db.execute("SELECT event_id FROM events WHERE event_type = ? ORDER BY position LIMIT 1",
                               (event_type,)).fetchone()
        return row[0] if row else None

    def partitions(self) -> list[Partition]:
        return [(STREAM, 0)]

    def end_offsets(self) -> dict[Partition, int]:
        return {(STREAM, 0): self.size()}

    def size(self) -> int:
        return self._db.execute("SELECT COALESCE(MAX(position) + 1, 0) FROM events").fetchone()[0]

    def read(self, where: Partition = (STREAM, 0), start: int = 0, end: int | None = None) -> Iterator[LogRecord]:
        if where != (STREAM, 0):
            raise LogError(f"the embedded log has one partition, not {where}")
        end = self.size() if end is None else end
        pos = start
        while pos < end:
            rows = self._db.execute(
                "SELECT position, file_offset, length, key, event_id, event_type, digest FROM events "
                "WHERE position >= ? AND position < ? ORDER BY position LIMIT 2000",
                (pos, end),
            ).fetchall()
            if not rows:
                break
            first_off = rows[0][1]
            last = rows[-1]
            blob = self._pread(first_off, last[1] + last[2] - first_off)
            yield from log_records(STREAM, 0, rows, blob, first_off)
            pos = last[0] + 1

    def _record(self, row: tuple) -> LogRecord:
        pos, off, length, key, eid, etype, digest = row
        return LogRecord(STREAM, 0, pos, key, eid, etype, self._pread(off, length), digest)

    def _pread(self, offset: int, length: int) -> bytes:
        """``length`` bytes of the segment at ``offset``: one positional read, so threads sharing this
        log (a gateway's lookups run on several) never read each other's bytes, as seek + read could."""
        fd, out = self._reader.fileno(), []
        while length > 0:
            chunk = os.pread(fd, length, offset)
            if not chunk:
                break
            out.append(chunk)
            offset += len(chunk)
            length -= len(chunk)
        return b"".join(out)

    def digests(self, where: Partition = (STREAM, 0), end: int | None = None, start: int = 0) -> list[bytes]:
        if where != (STREAM, 0):
            raise LogError(f"the embedded log has one partition, not {where}")
        end = self.size() if end is None else end
        return [r[0] for r in self._db.execute("SELECT digest FROM events WHERE position >= ? AND position < ? "
                                               "ORDER BY position", (start, end))]

    def stored_keys(self, where: Partition = (STREAM, 0)) -> Iterator[tuple[int, str, bytes, int]]:
        if where != (STREAM, 0):
            raise LogError(f"the embedded log has one partition, not {where}")
        yield from self._db.execute("SELECT position, natural_key, content_hash, governance FROM events ORDER BY position")

    def storage_problems(self) -> list[str]:
        """SQLite's integrity check of index.db; positions 0..n-1 with no row missing; each event
        starting where the previous one ended; events.dat neither shorter nor longer than the
        index says (unindexed trailing bytes named with offset and length)."""
        problems: list[str] = []
        where = self.path / "index.db"
        try:
            bad = [r[0] for r in self._db.execute("PRAGMA integrity_check(20)")]
        except sqlite3.DatabaseError as exc:
            return [f"{where}: the index is damaged ({exc})"]
        if bad != ["ok"]:
            problems += [f"{where}: SQLite integrity check: {b}" for b in bad]
        expect_pos, expect_off, reported = 0, 0, 0
        try:
            rows = self._db.execute("SELECT position, file_offset, length FROM events ORDER BY position")
            for pos, off, length in rows:
                if reported < 20 and pos != expect_pos:
                    gap = f"positions {expect_pos}..{pos - 1} have no index row" if pos > expect_pos else \
                        f"position {pos} is out of order (expected {expect_pos})"
                    problems.append(f"{where}: {gap} (events missing from the index)")
                    reported += 1
                if reported < 20 and off != expect_off:
                    problems.append(f"{where}: position {pos} starts at byte {off} of events.dat, but the previous "
                                    f"event ends at byte {expect_off} (file offsets not contiguous)")
                    reported += 1
                if not isinstance(pos, int) or not isinstance(off, int) or not isinstance(length, int) or length < 0:
                    problems.append(f"{where}: position {pos}: offset/length are not byte counts ({off!r}, {length!r})")
                    return problems
                expect_pos, expect_off = pos + 1, off + length
        except sqlite3.DatabaseError as exc:
            return problems + [f"{where}: reading the index failed after position {expect_pos - 1} ({exc})"]
        size = os.path.getsize(self._data_path)
        if size > expect_off:
            problems.append(f"{self._data_path}: {size - expect_off} unindexed bytes at offset {expect_off} (after the "
                            "last indexed event: an append that was never acknowledged, or bytes added since)")
        elif size < expect_off:
            problems.append(f"{self._data_path}: is {size} bytes but the index covers {expect_off} (truncated)")
        return problems

    def conflicts(self) -> list[dict]:
        cur = self._db.execute("SELECT id, event_id, natural_key, reason, existing_position FROM conflicts ORDER BY id")
        return [dict(zip(("id", "event_id", "natural_key", "reason", "existing_position"), r)) for r in cur]

    def close(self) -> None:
        self._reader.close()
        self._db.close()


def existing(db: sqlite3.Connection, batch: Sequence[Submission]) -> tuple[dict[str, Existing], dict[str, Existing]]:
    """The accepted events of index ``db`` sharing an event id or a natural key with ``batch`` (by id, by key):
    one query per 500 submissions, both indexes probed by one ``OR`` of two ``IN`` lists (a value listed twice
    matches the same rows once, so the lists are not de-duplicated)."""
    by_id: dict[str, Existing] = {}
    by_key: dict[str, Existing] = {}
    for i in range(0, len(batch), 500):
        chunk = batch[i:i + 500]
        ids = [s.event_id for s in chunk]
        keys = [s.natural_key for s in chunk]
        marks = ",".join("?" * len(chunk))
        q = (f"SELECT event_id, natural_key, position, content_hash FROM events WHERE event_id IN ({marks}) "
             f"OR natural_key IN ({marks})")
        id_set, key_set = set(ids), set(keys)
        for eid, nk, pos, chash in db.execute(q, ids + keys):
            old = Existing(str(pos), eid, chash)
            if eid in id_set:
                by_id[eid] = old
            if nk in key_set:
                by_key[nk] = old
    return by_id, by_key


def index_rows(subs: Sequence[Submission], position: int, offset: int) -> list[tuple]:
    """The ``events`` rows of ``subs`` written back to back from segment ``offset``, the first at ``position``:
    ``(position, file_offset, length, key, event_id, natural_key, event_type, governance, content_hash, digest)``."""
    rows = []
    for pos, s in enumerate(subs, position):
        rows.append((pos, offset, len(s.value), s.key, s.event_id, s.natural_key, s.event_type, int(s.governance),
                     s.content_hash, s.digest))
        offset += len(s.value)
    return rows


_IOV_MAX = 1024  # buffers per writev (POSIX guarantees at least 16; Linux allows 1024)


def write_all(fd: int, values: Sequence[bytes]) -> None:
    """Write ``values`` back to back at ``fd``'s offset with ``writev`` (no joined copy of the batch;
    the large-event path's copy was 8 % of an append, issue 19), finishing every short write."""
    i = 0
    while i < len(values):
        chunk = values[i:i + _IOV_MAX]
        left = os.writev(fd, chunk)
        for v in chunk:
            if left >= len(v):
                left -= len(v)
                i += 1
                continue
            view = memoryview(v)[left:]  # a short write stopped inside v: finish it, then writev the rest
            while view:
                view = view[os.write(fd, view):]
            i += 1
            break


class _WriterLock:
    """Exclusive ``flock`` on the store's lock file for the duration of one append."""

    def __init__(self, path: Path, timeout: float = 60.0) -> None:
        self.path, self.timeout = path, timeout

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise LogError(f"another writer holds {self.path} (waited {self.timeout:.0f} s)") from None
                time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
