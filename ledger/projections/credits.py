"""Collection-credit projection (seed 002 §15.8.2, napkin math 15.4 and 15.5).

Folds ``credit_pool_declared`` (governance topic), ``credit_reserved`` and
``credit_released`` (execution-scoped) with the pure pool of :mod:`ledger.algorithms.credits`: the
projection *is* ``ledger.algorithms.credits.fold`` over the pool's credit events.

**Pools.**  ``credit_pool_declared`` fixes a pool once (natural key
``credit_pool_declared/<pool>``): staging capacity ``C``, per-record ceiling ``S``, hard
limit (credits; the effective limit is ``min(hard_limit, C // S)``) and either an explicit
``high_watermark`` or the rate-model inputs of §15.8.2 (``in_flight_budget`` concurrent
rollouts of ``rollout_s`` seconds, ``verifier_slots`` with mean ``verifier_service_s`` and
timeout ``verifier_timeout_s``, controller delay ``controller_delay_s``).  The store has two
limits, the hard limit ``N`` of outstanding records and the ``C`` bytes; the **binding** one is
the records exactly when ``N * S < C`` (seed exercise 7), and the derived watermark is sized on
it: ``(N - I_n - g*D) / N`` on records, ``(C - I_n*S - S*g*D) / C`` on bytes (clamped to
[0, 1]), with ``I_n = in_flight_budget`` records in flight, ``lam = in_flight_budget /
rollout_s`` and ``g = lam - W/tau``.  A declared ``high_watermark`` is a fraction of the bytes,
as before.  With neither, the watermark is 1 (only the hard limit acts).  ``credit_status``
also carries the binding limit, the burst analysis of the declared inputs and, per limit
(``limits``), the time to exhaustion from empty and from what is held now and the watermark
sized on it (``exhaustion_s`` / ``exhaustion_s_now`` are the binding limit's), and the drain
time ``ceil(held / W) * verifier_service_s``.

**Releases need a durable disposition.**  A ``credit_released`` with reason
``disposition`` takes effect only once the execution's disposition is on the log: closed
and decisively assessed (``scored`` / ``not_assessable``), or finalized (time budget over);
its effective time is the latest of the release and that disposition.  Until then it is
*armed* (reported, not applied).  ``handoff_ack`` (an acknowledged transfer to another
bounded owner, ``acknowledged_by`` required) takes effect at once.

**Determinism.**  Credit events of one pool sit in many execution partitions, so the fold
never uses log order: ``finish`` re-folds every pool touched in the batch from the *set*
of its events, ordered by (effective time, releases before reservations, execution id).
Every interleaving of partitions and every batch size gives the same tables.  The
:class:`~ledger.producers.credit_client.CreditClient` stamps each event after the newest one it has
seen, so its own decisions and this fold agree; a reservation written past the hard
limit by a racing producer is folded as ``refuse`` (it holds nothing).

Tables: ``credit_pools`` (declarations), ``credit_events`` (facts), ``credit_exec_state``
(closure / assessment / finalization times per execution), ``credit_decisions`` (the
fold's answer to every event: the credit usage time series), ``credit_held`` (credits held
now) and ``credit_status`` (one row per pool).
"""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass
from typing import Any

from ledger.algorithms.credits import (
    CreditPool,
    CreditPoolConfig,
    analyse_timeout_burst,
    arrival_rate,
    binding_limit,
    drain_seconds,
    staging_growth_rate,
    staging_limits,
)
from ledger.projections.engine import Applied

__all__ = ["CreditsProjection", "PoolDeclaration", "pool_config", "pool_declaration", "pool_status", "held_credits",
           "usage_series", "credit_pools"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS credit_pools (
    pool TEXT PRIMARY KEY, event_id TEXT NOT NULL, declared_at INTEGER NOT NULL,
    capacity_bytes INTEGER NOT NULL, record_ceiling_bytes INTEGER NOT NULL, hard_limit INTEGER NOT NULL,
    high_watermark REAL, controller_delay_s REAL, in_flight_budget INTEGER, rollout_s REAL,
    verifier_slots INTEGER, verifier_service_s REAL, verifier_timeout_s REAL
);
CREATE TABLE IF NOT EXISTS credit_events (
    pool TEXT NOT NULL, execution_id TEXT NOT NULL, op TEXT NOT NULL CHECK (op IN ('reserve', 'release')),
    event_id TEXT NOT NULL, occurred_at INTEGER NOT NULL, bytes INTEGER, run_id TEXT, reason TEXT,
    acknowledged_by TEXT,
    PRIMARY KEY (pool, execution_id, op)
);
CREATE INDEX IF NOT EXISTS credit_events_execution ON credit_events (execution_id);
CREATE TABLE IF NOT EXISTS credit_exec_state (
    execution_id TEXT PRIMARY KEY, closed_at INTEGER, assessed_at INTEGER, finalized_at INTEGER
);
CREATE TABLE IF NOT EXISTS credit_decisions (
    pool TEXT NOT NULL, seq INTEGER NOT NULL, execution_id TEXT NOT NULL, op TEXT NOT NULL, at INTEGER NOT NULL,
    decision TEXT NOT NULL, reason TEXT, held INTEGER NOT NULL, reserved_bytes INTEGER NOT NULL,
    free_credits INTEGER NOT NULL,
    PRIMARY KEY (pool, seq)
);
CREATE TABLE IF NOT EXISTS credit_held (
    pool TEXT NOT NULL, execution_id TEXT NOT NULL, decision TEXT NOT NULL, reserved_at INTEGER NOT NULL,
    stage TEXT NOT NULL CHECK (stage IN ('running', 'staged', 'disposed')),
    PRIMARY KEY (pool, execution_id)
);
CREATE TABLE IF NOT EXISTS credit_status (
    pool TEXT PRIMARY KEY, declared INTEGER NOT NULL, effective_limit INTEGER, capacity_bytes INTEGER,
    record_ceiling_bytes INTEGER, high_watermark REAL, watermark_source TEXT, watermark_bytes REAL,
    held INTEGER NOT NULL, running INTEGER NOT NULL, staged INTEGER NOT NULL, disposed INTEGER NOT NULL,
    armed_releases INTEGER NOT NULL, reserved_bytes INTEGER NOT NULL, free_credits INTEGER,
    above_watermark INTEGER NOT NULL, counts TEXT NOT NULL, drain_s REAL, exhaustion_s REAL, exhaustion_s_now REAL,
    analysis TEXT, last_event_at INTEGER, binding_limit TEXT, watermark_limit TEXT, limits TEXT
);
"""

_DECISIVE = ("scored", "not_assessable")
_DISPOSITION_EVENTS = ("execution_closed", "assessment", "execution_finalized")


@dataclass(frozen=True)
class PoolDeclaration:
    pool: str
    capacity_bytes: int
    record_ceiling_bytes: int
    hard_limit: int
    high_watermark: float | None = None
    controller_delay_s: float | None = None
    in_flight_budget: int | None = None
    rollout_s: float | None = None
    verifier_slots: int | None = None
    verifier_service_s: float | None = None
    verifier_timeout_s: float | None = None

    @property
    def binding_limit(self) -> str:
        """The limit reached first: ``records`` (the hard limit) when ``hard_limit * S < C``, else ``bytes``."""
        return binding_limit(self.capacity_bytes, self.record_ceiling_bytes, self.hard_limit)

    def watermark(self) -> tuple[float, str, str]:
        """``(fraction, source, limit)``: declared (a fraction of the store's bytes), derived from the
        rate model on the binding limit (seed exercise 7), or 1 (none)."""
        if self.high_watermark is not None:
            return float(self.high_watermark), "declared", "bytes"
        needed = (self.in_flight_budget, self.rollout_s, self.verifier_slots, self.verifier_timeout_s,
                  self.controller_delay_s)
        if any(v is None for v in needed):
            return 1.0, "none", "bytes"
        growth = staging_growth_rate(arrival_rate(self.in_flight_budget, self.rollout_s),  # type: ignore[arg-type]
                                     self.verifier_slots, self.verifier_timeout_s)  # type: ignore[arg-type]
        limits = staging_limits(capacity_bytes=self.capacity_bytes, ceiling_bytes=self.record_ceiling_bytes,
                                record_limit=self.hard_limit, growth_records_per_second=growth,
                                inflight_records=self.in_flight_budget,  # type: ignore[arg-type]
                                reaction_delay_seconds=self.controller_delay_s)  # type: ignore[arg-type]
        return min(1.0, max(0.0, limits[self.binding_limit].high_watermark)), "rate_model", self.binding_limit

    def config(self) -> CreditPoolConfig:
        h, _, limit = self.watermark()
        return CreditPoolConfig(credits=self.hard_limit, ceiling_bytes=self.record_ceiling_bytes,
                                capacity_bytes=self.capacity_bytes, high_watermark=h, watermark_limit=limit)

    def burst(self, occupied_bytes: float = 0.0):
        """Napkin-math 15.4 / exercise 7 analysis of the declared inputs, both limits (``None`` when
        some inputs are missing)."""
        needed = (self.in_flight_budget, self.rollout_s, self.verifier_slots, self.verifier_service_s,
                  self.verifier_timeout_s)
        if any(v is None for v in needed):
            return None
        return analyse_timeout_burst(
            concurrent_rollouts=self.in_flight_budget, rollout_seconds=self.rollout_s,  # type: ignore[arg-type]
            verifier_slots=self.verifier_slots, mean_service_seconds=self.verifier_service_s,  # type: ignore[arg-type]
            timeout_seconds=self.verifier_timeout_s,  # type: ignore[arg-type]
            ceiling_bytes=self.record_ceiling_bytes, capacity_bytes=self.capacity_bytes,
            reaction_delay_seconds=self.controller_delay_s or 0.0, occupied_bytes=occupied_bytes,
            record_limit=self.hard_limit)


_POOL_COLS = ("pool", "capacity_bytes", "record_ceiling_bytes", "hard_limit", "high_watermark", "controller_delay_s",
              "in_flight_budget", "rollout_s", "verifier_slots", "verifier_service_s", "verifier_timeout_s")


def pool_declaration(db: sqlite3.Connection, pool: str) -> PoolDeclaration | None:
    row = db.execute(f"SELECT {', '.join(_POOL_COLS)} FROM credit_pools WHERE pool = ?", (pool,)).fetchone()
    return None if row is None else PoolDeclaration(*row)


def pool_config(db: sqlite3.Connection, pool: str) -> CreditPoolConfig | None:
    decl = pool_declaration(db, pool)
    return None if decl is None else decl.config()


class CreditsProjection:
    """Tables ``credit_pools``, ``credit_events``, ``credit_exec_state``, ``credit_decisions``,
    ``credit_held``, ``credit_status``."""

    name = "credits"
    # what apply acts on (the engine dispatches by type)
    event_types = frozenset(("credit_reserved", "credit_released", "credit_pool_declared", *_DISPOSITION_EVENTS))

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._cache: dict[str, _FoldCache | None] = {}  # forgotten after a rollback / rebuild
        self._clear()

    def _clear(self) -> None:
        self.dirty_pools: set[str] = set()
        self.dirty_execs: set[str] = set()

    def create(self, db: sqlite3.Connection) -> None:
        db.executescript(_SCHEMA)

    def apply(self, db: sqlite3.Connection, item: Applied) -> None:
        ev, et = item.event, item.type
        if et == "credit_reserved":
            db.execute("INSERT OR IGNORE INTO credit_events (pool, execution_id, op, event_id, occurred_at, bytes, run_id) "
                       "VALUES (?,?,?,?,?,?,?)", (ev["pool"], ev["execution_id"], "reserve", ev["event_id"],
                                                  ev["occurred_at"], ev["bytes"], ev.get("run_id")))
            self.dirty_pools.add(ev["pool"])
        elif et == "credit_released":
            db.execute("INSERT OR IGNORE INTO credit_events (pool, execution_id, op, event_id, occurred_at, reason, "
                       "acknowledged_by) VALUES (?,?,?,?,?,?,?)",
                       (ev["pool"], ev["execution_id"], "release", ev["event_id"], ev["occurred_at"], ev["reason"],
                        ev.get("acknowledged_by")))
            self.dirty_pools.add(ev["pool"])
        elif et == "credit_pool_declared":
            db.execute(f"INSERT OR IGNORE INTO credit_pools (event_id, declared_at, {', '.join(_POOL_COLS)}) "
                       f"VALUES ({','.join('?' * (len(_POOL_COLS) + 2))})",
                       (ev["event_id"], ev["occurred_at"], *(ev.get(c) for c in _POOL_COLS)))
            self.dirty_pools.add(ev["pool"])
        elif et in _DISPOSITION_EVENTS:
            col = {"execution_closed": "closed_at", "assessment": "assessed_at", "execution_finalized": "finalized_at"}[et]
            if et == "assessment" and ev["outcome"] not in _DECISIVE:
                return  # an evaluator error is not a disposition: the evaluator may retry
            ex = ev["execution_id"]
            db.execute("INSERT OR IGNORE INTO credit_exec_state (execution_id) VALUES (?)", (ex,))
            # the earliest such event counts (a set-based minimum: independent of log order)
            db.execute(f"UPDATE credit_exec_state SET {col} = MIN(COALESCE({col}, ?), ?) WHERE execution_id = ?",
                       (ev["occurred_at"], ev["occurred_at"], ex))
            self.dirty_execs.add(ex)

    def finish(self, db: sqlite3.Connection) -> None:
        pools = set(self.dirty_pools)
        for chunk in _chunks(sorted(self.dirty_execs)):
            pools.update(r[0] for r in db.execute(
                f"SELECT DISTINCT pool FROM credit_events WHERE execution_id IN ({','.join('?' * len(chunk))})", chunk))
        for pool in sorted(pools):
            self._cache[pool] = refold(db, pool, self._cache.get(pool))
        self._clear()


def _chunks(items: list, n: int = 500):
    for i in range(0, len(items), n):
        yield items[i:i + n]


def disposition_at(closed_at: int | None, assessed_at: int | None, finalized_at: int | None) -> int | None:
    """When an execution's disposition became durable: closed and decisively assessed, or
    finalized (time budget over), whichever came first; ``None`` while neither holds."""
    times = []
    if closed_at is not None and assessed_at is not None:
        times.append(max(closed_at, assessed_at))
    if finalized_at is not None:
        times.append(finalized_at)
    return min(times) if times else None


def _stage(state: tuple | None) -> str:
    closed_at, assessed_at, finalized_at = state if state is not None else (None, None, None)
    if disposition_at(closed_at, assessed_at, finalized_at) is not None:
        return "disposed"
    return "staged" if closed_at is not None else "running"


@dataclass
class _FoldCache:
    """What :func:`refold` folded last time for one pool (lets the next batch append)."""

    config: CreditPoolConfig
    keys: dict[tuple[str, str], tuple]  # (op, execution) -> its sort key when folded
    last: tuple | None  # the largest sort key folded
    fold: CreditPool
    seq: int
    held: dict[str, tuple]  # execution -> (decision, reserved_at, stage) as written in credit_held


def _fold_steps(rows: list) -> tuple[list[tuple[tuple, dict]], int, int | None]:
    """The pool's fold steps (unsorted), the number of releases still armed (waiting on a
    disposition) and the latest event time."""
    steps: list[tuple[tuple, dict]] = []
    armed = 0
    last_at = None
    for ex, op, at, nbytes, reason, c, a, f in rows:
        last_at = at if last_at is None else max(last_at, at)
        if op == "reserve":
            steps.append(((at, 1, ex), {"op": "reserve", "id": ex, "bytes": nbytes}))
        else:
            when: int | None = at
            if reason == "disposition":
                d = disposition_at(c, a, f)
                when = None if d is None else max(at, d)
            if when is None:
                armed += 1
                continue
            steps.append(((when, 0, ex), {"op": "release", "id": ex, "reason": reason}))
    return steps, armed, last_at


def _resumed_steps(steps: list[tuple[tuple, dict]], cache: _FoldCache | None, cfg) -> list[tuple[tuple, dict]]:
    """The steps left to fold after ``cache``: only the new ones when every new step sorts after
    the last folded one under the same config, else ``steps`` itself (the caller refolds from scratch)."""
    new_steps = steps
    if cache is None or not cache.config == cfg:
        return new_steps
    seen = 0
    fresh = []
    for key, event in steps:
        old = cache.keys.get((event["op"], event["id"]))
        if old is None:
            fresh.append((key, event))
        elif old == key:
            seen += 1
        else:
            break
    else:
        if seen == len(cache.keys) and (not fresh or cache.last is None or fresh[0][0] > cache.last):
            new_steps = fresh
    return new_steps


def refold(db: sqlite3.Connection, pool: str, cache: _FoldCache | None = None) -> _FoldCache | None:
    """Recompute ``pool``'s decisions, held credits and status from the set of its events.

    With ``cache`` (the previous result) and every new step sorting after the last folded
    one, the fold continues from the cached state and only the new decisions are written;
    any other change (an earlier-dated event, a release whose effective time moved, a new
    declaration) refolds from scratch.  Both paths give the same tables.
    """
    db.execute("DELETE FROM credit_status WHERE pool = ?", (pool,))
    rows = db.execute("SELECT e.execution_id, e.op, e.occurred_at, e.bytes, e.reason, s.closed_at, s.assessed_at, "
                      "s.finalized_at FROM credit_events e LEFT JOIN credit_exec_state s ON s.execution_id = e.execution_id "
                      "WHERE e.pool = ?", (pool,)).fetchall()
    states = {ex: (c, a, f) for ex, _op, _at, _b, _r, c, a, f in rows}
    steps, armed, last_at = _fold_steps(rows)
    decl = pool_declaration(db, pool)
    if decl is None:  # reservations for an undeclared pool: nothing is decided yet
        db.execute("DELETE FROM credit_decisions WHERE pool = ?", (pool,))
        db.execute("DELETE FROM credit_held WHERE pool = ?", (pool,))
        db.execute("INSERT INTO credit_status (pool, declared, held, running, staged, disposed, armed_releases, "
                   "reserved_bytes, above_watermark, counts, last_event_at) VALUES (?,0,0,0,0,0,?,0,0,'{}',?)",
                   (pool, armed, last_at))
        return None
    steps.sort(key=lambda st: st[0])
    cfg = decl.config()
    new_steps = _resumed_steps(steps, cache, cfg)
    if new_steps is steps:  # from scratch
        db.execute("DELETE FROM credit_decisions WHERE pool = ?", (pool,))
        db.execute("DELETE FROM credit_held WHERE pool = ?", (pool,))
        cache = _FoldCache(cfg, {}, None, CreditPool(cfg), 0, {})
    assert cache is not None
    fold = cache.fold
    decisions = []
    for key, event in new_steps:
        d = fold.apply(event)
        decisions.append((pool, cache.seq, event["id"], event["op"], key[0], d.kind, d.reason, d.held, d.reserved_bytes,
                          d.free_credits))
        cache.seq += 1
        cache.keys[(event["op"], event["id"])] = key
        cache.last = key
    fold.events.clear()  # the wrapper's event log is not needed here
    db.executemany("INSERT INTO credit_decisions VALUES (?,?,?,?,?,?,?,?,?,?)", decisions)
    state = fold.state
    held = {ex: (kind, cache.keys[("reserve", ex)][0], _stage(states.get(ex))) for ex, kind in state.held.items()}
    gone = [(pool, ex) for ex in cache.held if ex not in held]
    db.executemany("DELETE FROM credit_held WHERE pool = ? AND execution_id = ?", gone)
    db.executemany("INSERT OR REPLACE INTO credit_held VALUES (?,?,?,?,?)",
                   [(pool, ex, *row) for ex, row in sorted(held.items()) if cache.held.get(ex) != row])
    cache.held = held
    stages = {"running": 0, "staged": 0, "disposed": 0}
    for _kind, _at, stage in held.values():
        stages[stage] += 1
    h, source, wm_limit = decl.watermark()
    burst = decl.burst()
    burst_now = decl.burst(occupied_bytes=state.reserved_bytes)
    drain = (drain_seconds(len(state.held), decl.verifier_slots, decl.verifier_service_s)
             if decl.verifier_slots and decl.verifier_service_s is not None else None)
    analysis = limits = None
    if burst is not None and burst_now is not None:
        analysis = {k: _finite(v) if isinstance(v, float) else v for k, v in vars(burst).items() if k != "limits"}
        limits = _limits_doc(burst, burst_now)
    db.execute("INSERT INTO credit_status VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
               (pool, 1, cfg.hard_limit, cfg.capacity, cfg.ceiling_bytes, h, source, cfg.watermark_bytes,
                len(state.held), stages["running"], stages["staged"], stages["disposed"], armed, state.reserved_bytes,
                state.free_credits, int(state.above_watermark), json.dumps(dict(state.counts), sort_keys=True), drain,
                _finite(burst.exhaustion_seconds) if burst else None,
                _finite(burst_now.exhaustion_seconds) if burst_now else None,
                json.dumps(analysis, sort_keys=True) if analysis else None, last_at, decl.binding_limit, wm_limit,
                json.dumps(limits, sort_keys=True) if limits else None))
    return cache


def _limits_doc(burst, burst_now) -> dict:
    """Each limit of the store (records, bytes) under the declared timeout burst: capacity, time to
    exhaustion from empty and from what is held now, the watermark sized on it (seed exercise 7)."""
    return {name: {"capacity": lim.capacity, "exhaustion_s": _finite(lim.exhaustion_seconds),
                   "exhaustion_s_now": _finite(burst_now.limits[name].exhaustion_seconds),
                   "high_watermark": lim.high_watermark, "inflight": lim.inflight, "delay_growth": lim.delay_growth,
                   "binding": name == burst.binding_limit}
            for name, lim in burst.limits.items()}


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


# ---------------------------------------------------------------------- read API
_STATUS_COLS = ("pool", "declared", "effective_limit", "capacity_bytes", "record_ceiling_bytes", "high_watermark",
                "watermark_source", "watermark_bytes", "held", "running", "staged", "disposed", "armed_releases",
                "reserved_bytes", "free_credits", "above_watermark", "counts", "drain_s", "exhaustion_s",
                "exhaustion_s_now", "analysis", "last_event_at", "binding_limit", "watermark_limit", "limits")


def _has(db: sqlite3.Connection, table: str) -> bool:
    return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (table,)).fetchone() is not None


def credit_pools(db: sqlite3.Connection) -> list[str]:
    """Every pool with a declaration or a credit event."""
    if not _has(db, "credit_status"):
        return []
    names = {r[0] for r in db.execute("SELECT pool FROM credit_pools")}
    names |= {r[0] for r in db.execute("SELECT pool FROM credit_status")}
    return sorted(names)


def pool_status(db: sqlite3.Connection, pool: str) -> dict[str, Any] | None:
    """The pool's status row as a dict (``None`` when the pool is unknown)."""
    if not _has(db, "credit_status"):
        return None
    row = db.execute(f"SELECT {', '.join(_STATUS_COLS)} FROM credit_status WHERE pool = ?", (pool,)).fetchone()
    if row is None:
        return None
    out = dict(zip(_STATUS_COLS, row))
    out["declared"] = bool(out["declared"])
    out["above_watermark"] = bool(out["above_watermark"])
    out["counts"] = json.loads(out["counts"])
    out["analysis"] = json.loads(out["analysis"]) if out["analysis"] else None
    out["limits"] = json.loads(out["limits"]) if out["limits"] else None
    return out


def held_credits(db: sqlite3.Connection, pool: str) -> dict[str, str]:
    """Execution id -> the decision that granted its credit (``grant`` / ``slow``)."""
    return dict(db.execute("SELECT execution_id, decision FROM credit_held WHERE pool = ? ORDER BY execution_id", (pool,)))


def usage_series(db: sqlite3.Connection, pool: str) -> list[dict]:
    """The fold's answer to every credit event in effective-time order (credit usage over time)."""
    if not _has(db, "credit_decisions"):
        return []
    cols = ("seq", "execution_id", "op", "at", "decision", "reason", "held", "reserved_bytes", "free_credits")
    return [dict(zip(cols, r)) for r in db.execute(f"SELECT {', '.join(cols)} FROM credit_decisions WHERE pool = ? "
                                                   "ORDER BY seq", (pool,))]
