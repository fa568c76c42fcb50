"""Projector processes that follow a Kafka log (``ledger project --follow [--group NAME]``).

Two modes, one loop:

* **group** (``--group NAME --state-dir DIR``): the process is a member of consumer group
  NAME on ``PREFIX.executions`` and keeps one projection database ("shard", see
  :mod:`projections.shards`) per execution partition the group assigns to it,
  ``DIR/executions-<p>.db``.  Every shard also applies the whole governance topic, so each
  shard is self-contained, and ``ledger project --merge-shards DIR`` unions them into one
  database equal to a single-process replay.
* **single** (``--follow`` alone): one database (``--db``) follows every partition.

State follows its partition.  On assignment the projector takes an exclusive ``flock`` on
``executions-<p>.db.lock`` (non-blocking; while the previous owner still holds it -- a
zombie that has not noticed its revocation yet -- the partition is simply not fetched, and
the lock is retried), opens the shard and starts fetching at the offset stored *in the
shard* (never a Kafka committed offset; nothing is committed to Kafka).  Every batch is one
SQLite transaction holding the state and the new position (the replay engine,
:meth:`projections.engine.ReplayEngine.apply`, which also skips records below the stored
position).  On revocation, loss or exit the shard is closed and the lock released, so the
next owner continues from exactly the state and position committed last.  A SIGKILLed
owner's lock is released by the kernel; its uncommitted batch is rolled back by SQLite.

Shutdown: :meth:`Projector.run` returns when ``stop`` is set (the CLI sets it on SIGTERM /
SIGINT) after finishing the batch in progress; it then leaves the group and closes the shards.

Wall-clock use here is operational only (latency and throughput statistics, lock retries);
projections never see it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import resource
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ledger.algorithms.errors import InputError
from ledger.events.signing import Trust
from ledger.log.base import LogRecord
from ledger.log.kafka_group import GroupReader
from ledger.log.sealing import bind_store_keystore
from ledger.projections import registry
import importlib
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.shards import ShardIndexProjection, shard_path, write_shard_meta
from ledger.projections.shards import ShardIndexProjection, write_shard_meta
from ledger.projections.shards import shard_path

_log = logging.getLogger("ledger.projector")

LOCK_RETRY = 0.2  # seconds between attempts to take a shard lock held by the previous owner
STATS_EVERY = 1.0


class ShardLock:
    """An exclusive ``flock`` on ``<shard>.lock`` (a separate file: SQLite's own POSIX locks on
    the database file are left alone).  Released on close or when the process dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        if self.fd is not None:
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return False
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None


@dataclass(eq=False)
class Shard:
    """An open projection database and the partitions it follows."""

    path: Path
    lock: ShardLock
    engine: object  # ledger.projections.engine.ReplayEngine
    gov_next: int
    exec_next: dict[int, int]

    def close(self) -> None:
        try:
            self.engine.db.close()  # type: ignore[attr-defined]
        finally:
            self.lock.release()


@dataclass
class ProjectorStats:
    applied: int = 0
    rejected: int = 0
    dead_letters: int = 0
    batches: int = 0
    first_apply: float | None = None  # monotonic clock
    last_apply: float | None = None
    first_apply_at: float | None = None  # wall clock (comparable between processes: benchmarks)
    last_apply_at: float | None = None
    latencies: deque = field(default_factory=lambda: deque(maxlen=200_000))  # produce -> committed, seconds
    assignments: int = 0

    def latency_ms(self) -> dict:
        lat = sorted(self.latencies)
        if not lat:
            return {"n": 0}

        def q(f: float) -> float:
            return round(1000 * lat[min(len(lat) - 1, int(f * len(lat)))], 2)

        return {"n": len(lat), "p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "max": round(1000 * lat[-1], 2)}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


class Projector:
    """Follow a Kafka ledger and keep projection state current (see the module doc)."""

    def __init__(self, url: str, trust: Trust, *, group: str | None = None, state_dir: str | Path | None = None,
                 db: str | Path | None = None, projections_factory: Callable[[], list] | None = None,
                 batch: int = 500, throttle: float = 0.0, stats_path: str | Path | None = None,
                 consumer_config: dict | None = None, journal_mode: str = "wal") -> None:
        if journal_mode not in ("wal", "delete"):
            raise InputError(f"journal mode must be wal or delete, got {journal_mode!r}")
        if group is not None and state_dir is None:
            raise InputError("a consumer group needs a state directory for its partition shards")
        if group is None and db is None:
            raise InputError("a single follower needs a projection database")
        self.url, self.trust, self.group = url, trust, group
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.db_path = Path(db) if db is not None else None
        self.factory = projections_factory or _default_factory
        self.batch, self.throttle = max(1, int(batch)), float(throttle)
        self.stats_path = Path(stats_path) if stats_path else None
        self.consumer_config = consumer_config or {}
        self.journal_mode = journal_mode  # "delete" for network filesystems (SQLite WAL needs one host)
        self.stats = ProjectorStats()
        self.shards: dict[int, Shard] = {}  # execution partition -> its shard (single mode: the same one)
        self.pending: set[int] = set()  # assigned, waiting for the previous owner's lock
        self.reader: GroupReader | None = None
        self._gov_from: int | None = None
        self._next_lock_try = 0.0
        self._next_stats = 0.0
        self._seen_positions: dict[str, int] = {}  # last applied position of every partition ever owned
        self._waiting_since: dict[int, tuple[float, float]] = {}  # partition -> (since, last warning)

    # ------------------------------------------------------------------ shards
    def _open(self, path: Path, lock: ShardLock, partitions: list[int], *, shard_of: int | None) -> Shard:

        reader = self.reader
        assert reader is not None
        db = connect(path)
        try:
            if self.journal_mode != "wal":
                db.execute(f"PRAGMA journal_mode={self.journal_mode}")
            projections = list(self.factory())
            if shard_of is not None:
                db.execute("BEGIN IMMEDIATE")
                write_shard_meta(db, partition=shard_of, executions_topic=reader.executions_topic,
                                 governance_topic=reader.governance_topic)
                db.execute("COMMIT")
                projections.append(ShardIndexProjection(reader.executions_topic))
            engine = ReplayEngine(None, db, projections, trust=self.trust)  # type: ignore[arg-type]
            bind_store_keystore(projections, url=self.url)  # the engine has no log here
            pos = engine.positions()
        except BaseException:
            db.close()
            raise
        return Shard(path, lock, engine, pos.get((reader.governance_topic, 0), 0),
                     {p: pos.get((reader.executions_topic, p), 0) for p in partitions})

    def _try_take(self, partition: int) -> bool:
        assert self.state_dir is not None

        path = shard_path(self.state_dir, partition)
        lock = ShardLock(path.with_name(path.name + ".lock"))
        if not lock.try_acquire():
            now = time.monotonic()
            since, warned = self._waiting_since.setdefault(partition, (now, now))
            if now - warned > 30:
                self._waiting_since[partition] = (since, now)
                _log.warning("partition %d: shard %s still locked by its previous owner after %.0f s", partition,
                             path, now - since)
            return False
        try:
            self.shards[partition] = self._open(path, lock, [partition], shard_of=partition)
        except BaseException:
            lock.release()
            raise
        self._waiting_since.pop(partition, None)
        sh = self.shards[partition]
        _log.info("partition %d: shard %s opened at executions offset %d, governance offset %d", partition, path,
                  sh.exec_next[partition], sh.gov_next)
        return True

    def _close(self, partition: int) -> None:
        if self.reader is not None and partition in self.shards:
            self._seen_positions[f"{self.reader.executions_topic}:{partition}"] = \
                self.shards[partition].exec_next.get(partition, 0)
        sh = self.shards.pop(partition, None)
        if sh is not None and not any(sh is o for o in self.shards.values()):
            sh.close()
            _log.info("partition %d: shard closed at executions offset %d", partition, sh.exec_next.get(partition, -1))

    def _sync_reader(self) -> None:
        """Fetch every ready partition from its shard's position; governance from the lowest shard position."""
        reader = self.reader
        assert reader is not None
        reader.start_executions({p: sh.exec_next[p] for p, sh in self.shards.items()})
        shards = self._distinct()
        want = min((s.gov_next for s in shards), default=None)
        if want is None:
            if self._gov_from is not None:
                reader.start_governance(None)
                self._gov_from = None
        elif self._gov_from is None or want < self._gov_from:
            reader.start_governance(want)
            self._gov_from = want

    def _distinct(self) -> list[Shard]:
        out: list[Shard] = []
        for sh in self.shards.values():
            if not any(sh is o for o in out):
                out.append(sh)
        return out

    # ------------------------------------------------------------------ group callbacks
    def _on_assign(self, partitions: list[int]) -> None:
        self.stats.assignments += 1
        for p in list(self.shards):
            if p not in partitions:
                self._close(p)
        self.pending = {p for p in partitions if p not in self.shards}
        for p in sorted(self.pending):
            if self._try_take(p):
                self.pending.discard(p)
        if self.pending:
            _log.info("partitions %s: waiting for the previous owner to release their shards", sorted(self.pending))
        self._sync_reader()
        self._write_stats(force=True)

    def _on_revoke(self, partitions: list[int]) -> None:
        for p in partitions:
            self._close(p)
            self.pending.discard(p)
        self._sync_reader()
        self._write_stats(force=True)

    # ------------------------------------------------------------------ main loop
    def run(self, stop: threading.Event | None = None, *, idle_exit: float | None = None) -> ProjectorStats:
        """Follow until ``stop`` is set (or nothing arrived for ``idle_exit`` seconds)."""
        stop = stop or threading.Event()
        self.reader = GroupReader(self.url, self.group, on_assign=self._on_assign if self.group else None,
                                  on_revoke=self._on_revoke if self.group else None, config=self.consumer_config)
        idle_since = time.monotonic()
        try:
            if self.group is None:
                self._open_single()
            while not stop.is_set():
                if self.pending and time.monotonic() >= self._next_lock_try:
                    self._next_lock_try = time.monotonic() + LOCK_RETRY
                    took = [p for p in sorted(self.pending) if self._try_take(p)]
                    if took:
                        self.pending -= set(took)
                        self._sync_reader()
                        self._write_stats(force=True)
                batches = self.reader.poll(0.1, self.batch)
                if batches:
                    idle_since = time.monotonic()
                for b in batches:
                    self._apply(b)
                    if stop.is_set():
                        break
                self._write_stats()
                if idle_exit is not None and time.monotonic() - idle_since > idle_exit:
                    break
        finally:
            try:
                self.reader.close()  # leaves the group: the revoke callback closes our shards
            finally:
                for p in list(self.shards):
                    self._close(p)
                self._write_stats(force=True)
        return self.stats

    def _open_single(self) -> None:
        assert self.db_path is not None and self.reader is not None
        lock = ShardLock(self.db_path.with_name(self.db_path.name + ".lock"))
        deadline = time.monotonic() + 30
        while not lock.try_acquire():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.db_path} is locked by another projector")
            time.sleep(LOCK_RETRY)
        parts = list(self.reader.assigned)
        sh = self._open(self.db_path, lock, parts, shard_of=None)
        for p in parts:
            self.shards[p] = sh
        self._sync_reader()

    def _apply(self, b) -> None:
        reader = self.reader
        assert reader is not None
        topic, part = b.where
        if topic == reader.governance_topic:
            targets = [(sh, sh.gov_next) for sh in self._distinct()]
        else:
            sh = self.shards.get(part)
            if sh is None:
                return
            targets = [(sh, sh.exec_next.get(part, 0))]
        for t, (sh, nxt) in enumerate(targets):
            keep = [i for i, r in enumerate(b.records) if r.offset >= nxt]
            if not keep:
                continue
            recs: list[LogRecord] = [b.records[i] for i in keep]
            for i in range(0, len(recs), self.batch):
                chunk = recs[i:i + self.batch]
                st = sh.engine.apply(b.where, chunk)  # type: ignore[attr-defined]
                now = time.time()
                if topic == reader.governance_topic:
                    sh.gov_next = chunk[-1].offset + 1
                else:
                    sh.exec_next[part] = chunk[-1].offset + 1
                self.stats.applied += st.applied
                self.stats.rejected += st.rejected
                self.stats.dead_letters += st.dead_letters
                self.stats.batches += 1
                mono = time.monotonic()
                self.stats.first_apply = self.stats.first_apply or mono
                self.stats.last_apply = mono
                self.stats.first_apply_at = self.stats.first_apply_at or now
                self.stats.last_apply_at = now
                for j in keep[i:i + self.batch] if t == 0 else ():  # governance: one sample per record
                    ts = b.timestamps[j]
                    if ts is not None:
                        self.stats.latencies.append(max(0.0, now - ts))
                if self.throttle:
                    time.sleep(self.throttle)
        if topic == reader.governance_topic and b.records:
            self._gov_from = max(self._gov_from or 0, b.records[-1].offset + 1)

    # ------------------------------------------------------------------ statistics
    def snapshot(self) -> dict:
        reader = self.reader
        if reader is not None:
            for p, sh in self.shards.items():
                self._seen_positions[f"{reader.executions_topic}:{p}"] = sh.exec_next.get(p, 0)
        positions = dict(sorted(self._seen_positions.items()))
        gov = {str(sh.path): sh.gov_next for sh in self._distinct()}
        st = self.stats
        span = (st.last_apply - st.first_apply) if st.first_apply and st.last_apply else 0.0
        return {"pid": os.getpid(), "group": self.group, "assigned": sorted(reader.assigned) if reader else [],
                "owned": sorted(self.shards), "pending": sorted(self.pending), "applied": st.applied,
                "rejected": st.rejected, "dead_letters": st.dead_letters, "batches": st.batches,
                "assignments": st.assignments, "events_per_s": round(st.applied / span, 1) if span > 0 else None,
                "positions": positions, "governance_positions": gov, "latency_ms": st.latency_ms(),
                "peak_rss_mb": round(peak_rss_mb(), 1), "first_apply_at": st.first_apply_at,
                "last_apply_at": st.last_apply_at, "updated_at": time.time()}

    def _write_stats(self, force: bool = False) -> None:
        if self.stats_path is None:
            return
        now = time.monotonic()
        if not force and now < self._next_stats:
            return
        self._next_stats = now + STATS_EVERY
        tmp = self.stats_path.with_name(self.stats_path.name + f".{os.getpid()}.tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(self.snapshot(), sort_keys=True))
        os.replace(tmp, self.stats_path)


def _default_factory() -> list:

    return registry.all_projections()


def load_projection(spec: str):
    """``MODULE:CLASS`` -> a projection instance (plugins; e.g. a counting projection in tests)."""

    module, _, name = spec.partition(":")
    if not module or not name:
        raise InputError(f"expected MODULE:CLASS, got {spec!r}")
    return getattr(importlib.import_module(module), name)()


def catch_up_shard(log, state_dir: str | Path, partition: int, trust: Trust, *,
                   projections_factory: Callable[[], list] | None = None, until: dict | None = None,
                   lock_timeout: float = 30.0):
    """Bring shard ``partition`` of ``state_dir`` up to the log's end (or ``until``) in this process.

    Takes the shard's lock like a follower would (waits up to ``lock_timeout``).  For offline
    catch-up, tests and benchmarks; returns the replay statistics.
    """

    path = shard_path(state_dir, partition)
    lock = ShardLock(path.with_name(path.name + ".lock"))
    deadline = time.monotonic() + lock_timeout
    while not lock.try_acquire():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} is locked by another projector")
        time.sleep(LOCK_RETRY)
    try:
        gov, exe = log.partitions()[0], (log.executions_topic, partition)
        db = connect(path)
        try:
            db.execute("BEGIN IMMEDIATE")
            write_shard_meta(db, partition=partition, executions_topic=exe[0], governance_topic=gov[0])
            db.execute("COMMIT")
            projections = [*(projections_factory or _default_factory)(), ShardIndexProjection(exe[0])]
            engine = ReplayEngine(log, db, projections, trust=trust)
            ends = until if until is not None else log.end_offsets()
            return engine.run(until={gov: ends[gov], exe: ends[exe]})
        finally:
            db.close()
    finally:
        lock.release()
