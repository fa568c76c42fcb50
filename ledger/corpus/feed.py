"""The online feed: a route's admitted members for a trainer while collection goes on (SPEC §11.6).

``Feed(store, route, consumer)`` follows the log (embedded or Kafka) with its own projection database
per consumer (default ``<store>/feeds/<consumer>.db``; for Kafka ``./feeds/<consumer>.db`` beside the
projection database), kept current incrementally by the replay engine, and yields **batches** of trainer
records -- exactly the records ``ledger export`` writes (:func:`ledger.corpus.export.execution_records`) --
in admission order as the feed observes it, oldest first.

* **Admission order.**  After each catch-up, executions newly admitted (or admitted as dummies) on the
  route are appended to the feed's queue (table ``feed_queue``; executions observed in the same
  catch-up are ordered by close time, then id).  An execution that leaves the route before it is
  consumed (a withdrawal) is not delivered; the report lists it as ``withdrawn``.
* **Groups.**  By default a batch is one execution: all of its J_max paths (and its dummy entry, marked
  ``dummy``) together, so 1/L_i stays a per-execution normalisation.  ``group_by="task"`` makes a batch
  of the admitted attempts of one task wherever they were collected (SPEC 12.4: across collection runs),
  within one split (a route has one): with ``group_size`` N the first N attempts (oldest first); without,
  every attempt of the task, once each attempt of it opened so far is decided on the route.  After
  ``group_timeout`` seconds (from the first member's observation; default :data:`DEFAULT_GROUP_TIMEOUT`,
  300 s; ``None``: never) an incomplete group is yielded with ``partial=True``.  The batch's ``group``
  names the task and the ``collection_run_ids`` its attempts came from.
* **Staleness.**  ``execution_opened.policy_version`` is the behaviour policy's version; the trainer
  sets ``feed.policy_version``.  A member more than ``max_staleness`` versions behind is *held*: counted
  and reported per task and per completion-time bucket (open -> close duration), and then either
  yielded oldest-first with ``stale=True`` (``stale_policy="yield"``, the default: dropping slow
  executions biases training toward fast completions) or given the disposition ``stale``
  (``stale_policy="stale"``): a ``batch_consumed`` event with ``disposition: "stale"`` records it on the
  log, so the decision is durable.
* **Exactly once.**  ``feed.ack(batch, step=N)`` appends ``batch_consumed`` (consumer, route, step,
  members with digests, policy version, optional checkpoint id); its natural key is (consumer, step),
  so a retried acknowledgement is a duplicate and another batch under the same step a conflict
  (:class:`FeedError`).  What a consumer consumed is read back from the log (projection
  :mod:`projections.consumers`), so a restarted consumer resumes after its last acknowledged batch and
  an unacknowledged batch is delivered again.  One process per consumer: the feed database is locked.
  On Kafka the feed's log is an exclusive writer named after the consumer, so a restarted consumer
  aborts an acknowledgement its killed predecessor left uncommitted; acknowledgements of this process
  that the projection cannot read yet (another producer's open transaction) still count
  (``last_step``, and their executions are not delivered again).

Wall-clock use here is operational only (polling, group timeouts, observation times for the report).
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ledger.algorithms.errors import InputError
from ledger.algorithms.identifiers import file_name
from ledger.corpus.feed_report import completion_bucket, report
from ledger.log.paths import StorePaths, store_paths
from ledger.events.signing import Trust
from ledger.log import open_log
from ledger.producers.ingest import Ingestor
from ledger.runtime.projector import ShardLock
from ledger.projections.engine import ReplayEngine, connect
from ledger.projections.registry import all_projections, store_keystore
from ledger.projections.admission import current_routes
from ledger.projections.preference import preference_route
from ledger.projections.admission import route_definition
from ledger.projections.splits import execution_split
from ledger.corpus.export import execution_records
from ledger.projections.consumers import last_step
from ledger.events.catalog import natural_key

__all__ = ["DEFAULT_GROUP_TIMEOUT", "Batch", "Feed", "FeedError", "completion_bucket", "feed_db_path"]  # completion_bucket: re-exported (its home is feed_report)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS feed_queue (
    seq INTEGER PRIMARY KEY, route TEXT NOT NULL, execution_id TEXT NOT NULL, observed_at REAL NOT NULL,
    UNIQUE (route, execution_id)
);
CREATE TABLE IF NOT EXISTS feed_meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
GROUP_BY = ("execution", "task")
STALE_POLICIES = ("yield", "stale")
DEFAULT_GROUP_TIMEOUT = 300.0  # seconds an incomplete task group waits before it is yielded partial (SPEC 12.4: finite)


class FeedError(InputError):
    """A feed cannot do what was asked (unknown route, consumer already running, conflicting ack)."""


def feed_db_path(paths, consumer: str) -> Path:
    """``<store>/feeds/<consumer>.db`` (embedded) or ``<dir of the projection db>/feeds/<consumer>.db`` (Kafka)."""
    base = Path(paths.db).parent if paths.is_kafka else Path(paths.url)
    return base / "feeds" / f"{file_name(consumer)}.db"


@dataclass
class _Pending:
    seq: int
    execution_id: str
    observed_at: float
    task_id: str | None
    run_id: str | None
    split: str | None
    policy_version: int | None
    bucket: str


@dataclass
class Batch:
    """One group of trainer records; acknowledge it with :meth:`Feed.ack`."""

    consumer: str
    route: str
    group: dict
    records: list[dict]
    executions: list[str]
    partial: bool = False
    stale: bool = False
    policy_versions: dict[str, int | None] = field(default_factory=dict)

    @property
    def members(self) -> list[dict]:
        return [{"member_id": r["member_id"], "digest": r["digest"]} for r in self.records]

    def header(self) -> dict:
        return {"consumer": self.consumer, "route": self.route, "group": self.group, "executions": self.executions,
                "members": len(self.records), "partial": self.partial, "stale": self.stale,
                "policy_versions": self.policy_versions}


class Feed:
    """Admitted members of ``route`` for trainer ``consumer`` (see the module doc)."""

    def __init__(self, store, route: str, consumer: str, group_by: str | None = None, group_size: int | None = None,
                 max_staleness: int | None = None, *, group_timeout: float | None = DEFAULT_GROUP_TIMEOUT,
                 stale_policy: str = "yield",
                 policy_version: int | None = None, db: str | Path | None = None, trust=None,
                 poll_interval: float = 0.05) -> None:

        group_by = group_by or "execution"
        if group_by not in GROUP_BY:
            raise FeedError(f"group_by must be one of {', '.join(GROUP_BY)}, not {group_by!r}")
        if group_size is not None and (group_by != "task" or int(group_size) < 1):
            raise FeedError("group_size needs group_by='task' and is at least 1")
        if stale_policy not in STALE_POLICIES:
            raise FeedError(f"stale_policy must be one of {', '.join(STALE_POLICIES)}, not {stale_policy!r}")
        if max_staleness is not None and int(max_staleness) < 0:
            raise FeedError("max_staleness is at least 0")
        if group_timeout is not None and not float(group_timeout) >= 0:
            raise FeedError(f"group_timeout is a number of seconds >= 0 (or None: never), not {group_timeout!r}")
        self.paths = store if isinstance(store, StorePaths) else store_paths(None if store is None else str(store))
        self.route, self.consumer, self.group_by = route, consumer, group_by
        self.group_size, self.group_timeout = group_size, group_timeout
        self.max_staleness, self.stale_policy, self.policy_version = max_staleness, stale_policy, policy_version
        self.poll_interval = poll_interval
        self.db_path = Path(db) if db is not None else feed_db_path(self.paths, consumer)
        self._open(trust)
        self._delivered: dict[str, Batch] = {}  # execution -> its delivered, unacknowledged batch
        # Executions this process acknowledged (or recorded stale) that the projection does not show consumed
        # yet, and the highest step it acknowledged: on Kafka another producer's open transaction can hold our
        # committed batch_consumed events back from read_committed readers for a while (SPEC 11.6 exactly once).
        self._settled: set[str] = set()
        self._own_step: int | None = None
        self._queue: list[_Pending] | None = None  # pending executions in feed order (rebuilt on refresh)
        try:
            self.refresh()
            self._check_route()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing
    def _open(self, trust) -> None:

        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = ShardLock(self.db_path.with_name(self.db_path.name + ".lock"))
        if not self._lock.try_acquire():
            raise FeedError(f"consumer {self.consumer!r} is already being fed by another process ({self._lock.path} is locked)")
        try:
            self.trust = trust if trust is not None else Trust.load(self.paths.trust)
            # an exclusive writer: on Kafka this aborts an acknowledgement a killed predecessor left open
            self.log = open_log(self.paths.url, writer=f"ledger-feed/{self.consumer}")
            self.keystore = store_keystore(self.paths)
            self.engine = ReplayEngine(self.log, connect(self.db_path), all_projections(keystore=self.keystore),
                                       trust=self.trust)
            self.db: sqlite3.Connection = self.engine.db
            self.db.executescript(_SCHEMA)
            self.ingestor = Ingestor(self.log, self.trust, producer=f"ledger-feed/{self.consumer}")
        except BaseException:
            self._lock.release()
            raise

    def close(self) -> None:
        for closer in (self.db.close, self.log.close, self._lock.release):
            closer()
        if self.keystore is not None:
            self.keystore.close()

    def __enter__(self) -> "Feed":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_route(self) -> None:

        if self.route not in current_routes(self.db):
            raise FeedError(f"no route {self.route!r} (declared: {', '.join(sorted(current_routes(self.db))) or 'none'})")
        if preference_route(route_definition(self.db, self.route)):
            raise FeedError(f"route {self.route!r} is a preference route (pairs, SPEC 6.9); the feed serves path routes")

    # ------------------------------------------------------------------ following the log
    def refresh(self) -> int:
        """Catch up with the log and queue newly admitted executions; returns how many were queued."""
        applied = self.engine.run().applied
        if applied:
            self._purge_erased()
        new = self._observe()
        if applied or new or self._queue is None:
            self._queue = self._pending()
        return new

    def _purge_erased(self) -> None:
        """A withdrawal with ``erase`` destroyed data keys: rebuild this database from the log (the erased tokens
        no longer open) and vacuum it, so no decrypted copy stays here, free pages included (SPEC 11.7).  The
        queue is rebuilt too: executions still admitted and not consumed are observed again, in close order."""
        erasures = self.db.execute("SELECT COUNT(*) FROM withdrawals WHERE erase = 1").fetchone()[0]
        seen = self.db.execute("SELECT value FROM feed_meta WHERE key = 'erasures'").fetchone()
        if erasures and (seen is None or seen[0] < erasures):
            self.engine.rebuild()
            self.engine.run()
            self.db.execute("VACUUM")
            self.db.executescript(_SCHEMA)
            self._queue = None
        self.db.execute("INSERT OR REPLACE INTO feed_meta VALUES ('erasures', ?)", (erasures,))

    def _observe(self) -> int:
        rows = self.db.execute(
            "SELECT a.execution_id FROM admission a LEFT JOIN executions e ON e.execution_id = a.execution_id "
            "WHERE a.route = ? AND a.state IN ('admitted', 'dummy') AND NOT EXISTS "
            "(SELECT 1 FROM feed_queue q WHERE q.route = a.route AND q.execution_id = a.execution_id) "
            "ORDER BY e.closed_at_us, a.execution_id", (self.route,)).fetchall()
        if rows:
            now = time.time()
            self.db.execute("BEGIN IMMEDIATE")
            self.db.executemany("INSERT INTO feed_queue (route, execution_id, observed_at) VALUES (?,?,?)",
                                [(self.route, ex, now) for (ex,) in rows])
            self.db.execute("COMMIT")
        return len(rows)

    def _rows(self, *, unconsumed: bool = False) -> list[tuple]:
        """(seq, execution, observed_at, admitted now, consumed by this consumer, task, run, opened, closed, pv);
        ``unconsumed``: only the executions this consumer has not consumed."""
        return self.db.execute(
            "SELECT q.seq, q.execution_id, q.observed_at, a.state IN ('admitted', 'dummy'), "
            "EXISTS (SELECT 1 FROM consumed_members c WHERE c.consumer = ? AND c.route = q.route "
            "        AND c.execution_id = q.execution_id), "
            "e.task_id, e.collection_run_id, e.opened_at_us, e.closed_at_us, p.policy_version "
            "FROM feed_queue q LEFT JOIN admission a ON a.route = q.route AND a.execution_id = q.execution_id "
            "LEFT JOIN executions e ON e.execution_id = q.execution_id "
            "LEFT JOIN policy_versions p ON p.execution_id = q.execution_id "
            "WHERE q.route = ?" + (" AND NOT EXISTS (SELECT 1 FROM consumed_members c WHERE c.consumer = ? AND "
                                   "c.route = q.route AND c.execution_id = q.execution_id)" if unconsumed else "")
            + " ORDER BY q.seq", (self.consumer, self.route) + ((self.consumer,) if unconsumed else ())).fetchall()

    def _pending(self) -> list[_Pending]:

        out = []
        rows = self._rows(unconsumed=True)
        self._settled &= {row[1] for row in rows}  # the rest the projection shows consumed now
        for seq, ex, observed, admitted, done, task, run, opened, closed, pv in rows:
            if admitted and not done and ex not in self._delivered and ex not in self._settled:
                out.append(_Pending(seq, ex, observed, task, run, execution_split(self.db, ex)[0], pv,
                                    completion_bucket(opened, closed)))
        return out

    # ------------------------------------------------------------------ batches
    def is_stale(self, policy_version: int | None) -> bool:
        """A member of behaviour version ``policy_version`` is beyond the bound at the trainer's current version."""
        return (self.max_staleness is not None and self.policy_version is not None and policy_version is not None
                and self.policy_version - policy_version > self.max_staleness)

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    def batches(self, *, follow: bool = True, idle_timeout: float | None = None,
                stop: Callable[[], bool] | None = None) -> Iterator[Batch]:
        """Yield batches as they become ready; without ``follow``, stop when nothing is ready; with
        ``idle_timeout``, stop after that many seconds without a batch; ``stop()`` true ends the wait."""
        idle_since = time.monotonic()
        while stop is None or not stop():
            batch = self.next_batch()
            if batch is None:
                self.refresh()
                batch = self.next_batch()
            if batch is not None:
                idle_since = time.monotonic()
                yield batch
                continue
            if not follow or (idle_timeout is not None and time.monotonic() - idle_since >= idle_timeout):
                return
            time.sleep(self.poll_interval)

    def next_batch(self) -> Batch | None:
        """The next ready batch from the queue as last refreshed (``None`` when none is ready)."""
        while True:
            chosen = self._choose()
            if chosen is None:
                return None
            rows, group, partial = chosen
            rows = self._drop_stale(rows)
            if not rows:
                continue
            batch = self._batch(rows, group, partial or len(rows) < len(chosen[0]))
            if batch is not None:
                return batch

    def _choose(self) -> tuple[list[_Pending], dict, bool] | None:
        queue = self._queue or []
        if self.group_by == "execution":
            if not queue:
                return None
            p = queue[0]
            return [p], {"by": "execution", "execution_id": p.execution_id, "split": p.split, "task_id": p.task_id}, False
        groups: dict[tuple, list[_Pending]] = {}
        for p in queue:  # one task's attempts from every collection run (SPEC 12.4), oldest first
            groups.setdefault((p.split, p.task_id), []).append(p)
        now = time.time()
        for (split, task), rows in groups.items():
            chosen, partial = None, False
            if self.group_size is not None and len(rows) >= self.group_size:
                chosen = rows[:self.group_size]
            elif self.group_size is None and self._attempts_decided(task):
                chosen = rows
            elif self.group_timeout is not None and now - rows[0].observed_at >= self.group_timeout:
                chosen, partial = rows, True
            if chosen is not None:
                runs = list(dict.fromkeys(p.run_id for p in chosen))
                return chosen, {"by": "task", "split": split, "task_id": task, "collection_run_ids": runs}, partial
        return None

    def _attempts_decided(self, task: str | None) -> bool:
        """Every attempt of ``task`` opened so far (in any collection run) has a decided admission on the route."""
        undecided = self.db.execute(
            "SELECT COUNT(*) FROM executions e LEFT JOIN admission a ON a.execution_id = e.execution_id AND a.route = ? "
            "WHERE e.task_id IS ? AND (a.state IS NULL OR a.state = 'unresolved')",
            (self.route, task)).fetchone()[0]
        return undecided == 0

    def _drop_stale(self, rows: list[_Pending]) -> list[_Pending]:
        """Under ``stale_policy="stale"``: record the stale executions' members with disposition ``stale``."""
        stale = [p for p in rows if self.is_stale(p.policy_version)]
        if not stale or self.stale_policy == "yield":
            return rows

        members = [{"member_id": r["member_id"], "digest": r["digest"]}
                   for p in stale for r in execution_records(self.db, self.route, p.execution_id)]
        if members:
            self._append(self._line(members, self.last_step or 0, disposition="stale"))
        self._settled.update(p.execution_id for p in stale)
        self._take(stale)
        return [p for p in rows if p not in stale]

    def _take(self, rows: list[_Pending]) -> None:
        taken = {p.execution_id for p in rows}
        self._queue = [p for p in self._queue or [] if p.execution_id not in taken]

    def _batch(self, rows: list[_Pending], group: dict, partial: bool) -> Batch | None:

        self._take(rows)
        records, executions = [], []
        for p in rows:
            recs = execution_records(self.db, self.route, p.execution_id)
            if recs:  # empty: it left the route since the last refresh
                records += recs
                executions.append(p.execution_id)
        if not records:
            return None
        kept = [p for p in rows if p.execution_id in executions]
        batch = Batch(self.consumer, self.route, group, records, executions, partial=partial,
                      stale=any(self.is_stale(p.policy_version) for p in kept),
                      policy_versions={p.execution_id: p.policy_version for p in kept})
        for ex in executions:
            self._delivered[ex] = batch
        return batch

    # ------------------------------------------------------------------ acknowledgement
    @property
    def last_step(self) -> int | None:
        """The last step this consumer acknowledged: read back from the log, or acknowledged by this process
        and not readable yet."""

        steps = [s for s in (last_step(self.db, self.consumer), self._own_step) if s is not None]
        return max(steps) if steps else None

    def _line(self, members: list[dict], step: int, *, disposition: str | None = None,
              checkpoint_id: str | None = None, policy_version: int | None = None) -> dict:
        line = {"type": "batch_consumed", "consumer": self.consumer, "route": self.route, "step": step,
                "members": sorted(members, key=lambda m: m["member_id"].encode("utf-8"))}
        for k, v in (("disposition", disposition), ("checkpoint_id", checkpoint_id), ("policy_version", policy_version)):
            if v is not None:
                line[k] = v
        return line

    def _append(self, line: dict) -> dict:
        report = self.ingestor.ingest_lines([(1, line)])
        if report.conflicts:
            c = report.conflicts[0]
            raise FeedError(f"consumer {self.consumer!r} already acknowledged step {line['step']} with other members "
                            f"({c['event_id']} at {c['existing_position']}); nothing appended")
        self.engine.run()

        return {"event_id": natural_key({**line, "event_type": line["type"]}), "appended": report.appended,
                "duplicates": report.duplicates}

    def ack(self, batch: Batch | list[Batch], step: int, *, checkpoint_id: str | None = None,
            policy_version: int | None = None) -> dict:
        """Acknowledge ``batch`` (or several) as trained at ``step``: one ``batch_consumed`` event on the log.
        ``policy_version`` defaults to the feed's.  Raises :class:`FeedError` when the step was acknowledged
        with other members."""
        batches = [batch] if isinstance(batch, Batch) else list(batch)
        for b in batches:
            if (b.consumer, b.route) != (self.consumer, self.route):
                raise FeedError(f"batch of {b.consumer}/{b.route} acknowledged on the feed of {self.consumer}/{self.route}")
        members = [m for b in batches for m in b.members]
        pv = self.policy_version if policy_version is None else policy_version
        out = self._append(self._line(members, step, checkpoint_id=checkpoint_id, policy_version=pv))
        self._own_step = step if self._own_step is None else max(self._own_step, step)
        for b in batches:
            for ex in b.executions:
                self._delivered.pop(ex, None)
                self._settled.add(ex)
        return out

    def nack(self, batch: Batch) -> None:
        """Give ``batch`` back: it is delivered again (oldest first) by this feed."""
        for ex in batch.executions:
            self._delivered.pop(ex, None)
        self._queue = None
        self.refresh()

    # ------------------------------------------------------------------ report
    def report(self) -> dict:
        """What happened to every admitted member the feed observed (see :func:`ledger.corpus.feed_report.report`)."""
        return report(self)

