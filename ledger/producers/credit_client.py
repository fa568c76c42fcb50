"""Collection credits for producers (seed 002 §15.8.2): acquire before a rollout, release
only at a durable disposition or an acknowledged hand-off.

::

    from ledger import open_log
    from ledger.producers.credit_client import CreditClient
    from ledger.producers.recorder import Recorder

    credits = CreditClient(open_log(url), "staging-a", timeout=30)   # its own log handle
    with Recorder(open_log(url), credits=credits) as rec:
        rec.open_execution("ex-1", ...)        # blocks for a credit first (CreditTimeout after 30 s)
        ...
        rec.close_execution("ex-1", "completed", ["v1"])
        rec.record_assessment("ex-1", "a1", "v1", "scored", "grader@1", reward=1.0)
        # closed + decisively assessed and flushed: the credit is released here

The client keeps a private replay of the log with only :class:`projections.credits.
CreditsProjection` (default an in-memory SQLite database; never the shared projection
database, whose ``_positions`` belong to every projection).  Each call catches up with the
log, then decides from the pool state with :func:`ledger.algorithms.credits.apply`, the same pure
fold the projection runs:

* **refuse** at the hard limit: :meth:`acquire` polls (``poll_interval``) until a credit
  frees up or ``timeout`` passes (:class:`CreditTimeout`); a permanent refusal (the
  execution already had and returned a credit, or was refused before) raises
  :class:`CreditRefused` at once;
* **slow** above the high watermark: the credit is granted, ``Grant.slow`` is true, and
  the dispatcher should stop dispatching new work;
* **grant** otherwise.  A retried acquire of a held credit returns it (``duplicate``).

Every event is stamped after the newest credit event the client has seen (so the
projection's fold, ordered by time, replays the client's decisions exactly) and appended
through :class:`~ledger.producers.ingest.Ingestor` (validated, idempotent).  After appending a
reservation the client catches up again and checks that the fold granted it: with two
dispatchers racing on one pool, the later reservation is folded as ``refuse`` and
:class:`CreditRefused` is raised (one dispatcher per pool is the intended deployment).

:meth:`release` with reason ``disposition`` is refused until the execution's disposition
is on the log (closed and decisively assessed, or finalized); :meth:`hand_off` releases on
an acknowledged transfer to another bounded owner.  A credit is never released twice.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

from ledger.algorithms.credits import CreditState, Decision, apply
from ledger.algorithms.errors import StateError
from ledger.events.signing import Trust
from ledger.events.validate import validate_line
from ledger.log.base import Log
from ledger.producers.ingest import Ingestor
from ledger.projections.credits import CreditsProjection
from ledger.projections.engine import ReplayEngine, connect
from ledger.log import open_log
from ledger.projections.credits import pool_status
from ledger.projections.credits import held_credits, pool_config
from ledger.projections.credits import held_credits
from ledger.projections.credits import disposition_at

__all__ = ["CreditClient", "CreditError", "CreditRefused", "CreditTimeout", "Grant", "format_pool"]


class CreditError(StateError):
    """A credit operation cannot be done as asked (undeclared pool, no credit held, ...)."""


class CreditRefused(CreditError):
    """No credit for this execution: ``reason`` says why (``no_credit``, ``closed``, ...)."""

    def __init__(self, pool: str, execution_id: str, reason: str, status: dict | None = None) -> None:
        self.pool, self.execution_id, self.reason, self.status = pool, execution_id, reason, status
        super().__init__(f"credit pool {pool!r} refused execution {execution_id!r}: {reason}")


class CreditTimeout(CreditRefused):
    """The pool stayed at its hard limit for the whole acquire timeout."""


@dataclass(frozen=True)
class Grant:
    pool: str
    execution_id: str
    kind: str  # "grant" | "slow"
    duplicate: bool
    held: int
    reserved_bytes: int
    free_credits: int

    @property
    def slow(self) -> bool:
        """Above the high watermark: the credit is held, but stop dispatching new work."""
        return self.kind == "slow"


def _now_micros() -> int:
    return time.time_ns() // 1000


class CreditClient:
    """Acquire / release collection credits of one pool on a log."""

    def __init__(self, log: Log | str, pool: str, *, trust: Trust | None = None, producer: str = "credit-client",
                 db: str = ":memory:", timeout: float = 30.0, poll_interval: float = 0.05,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 now_micros: Callable[[], int] = _now_micros) -> None:

        if isinstance(log, str):

            log = open_log(log)
        self.log, self.pool = log, pool
        self.trust = trust or Trust()
        self.timeout, self.poll_interval = timeout, poll_interval
        self._clock, self._sleep, self._now = clock, sleep, now_micros
        self.ingestor = Ingestor(log, self.trust, producer=producer)
        self.producer = producer
        self.db = connect(db)
        self._engine = ReplayEngine(log, self.db, [CreditsProjection()], trust=self.trust)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ state
    def refresh(self) -> None:
        """Catch up with the log (only events appended since the last call are read)."""
        with self._lock:
            self._engine.run()

    def status(self) -> dict:
        """The pool's status row (:func:`projections.credits.pool_status`), caught up."""

        with self._lock:
            self.refresh()
            st = pool_status(self.db, self.pool)
            if st is None or not st["declared"]:
                raise CreditError(f"credit pool {self.pool!r} is not declared (append a credit_pool_declared event)")
            return st

    def decide(self, execution_id: str) -> Decision:
        """What the pool would answer to a reservation for ``execution_id`` now (no write, no catch-up)."""

        cfg = pool_config(self.db, self.pool)
        if cfg is None:
            raise CreditError(f"credit pool {self.pool!r} is not declared (append a credit_pool_declared event)")
        closed = {r[0] for r in self.db.execute("SELECT execution_id FROM credit_events WHERE pool = ? AND op = 'release'",
                                                 (self.pool,))}
        state = CreditState(config=cfg, held=MappingProxyType(held_credits(self.db, self.pool)),
                            closed=frozenset(closed))
        d = apply(state, {"op": "reserve", "id": execution_id, "bytes": cfg.ceiling_bytes}).last
        assert d is not None
        return d

    # ------------------------------------------------------------------ acquire
    def acquire(self, execution_id: str, *, run_id: str | None = None, timeout: float | None = None) -> Grant:
        """Block until ``execution_id`` holds a credit (or raise :class:`CreditTimeout`)."""

        with self._lock:
            limit = self.timeout if timeout is None else timeout
            deadline = self._clock() + max(0.0, limit)
            while True:
                st = self.status()
                mine = self._event(execution_id, "reserve")
                if mine is not None:  # a retry: the reservation is already on the log
                    held = held_credits(self.db, self.pool)
                    if execution_id in held:
                        return self._grant(execution_id, held[execution_id], st, duplicate=True)
                    raise CreditRefused(self.pool, execution_id, "its reservation was refused or already released", st)
                d = self.decide(execution_id)
                if d.kind in ("grant", "slow"):
                    st = self._append({"type": "credit_reserved", "execution_id": execution_id, "pool": self.pool,
                                       "bytes": int(st["record_ceiling_bytes"]), "run_id": run_id})
                    held = held_credits(self.db, self.pool)
                    if execution_id not in held:
                        raise CreditRefused(self.pool, execution_id, "over-committed by a concurrent reservation", st)
                    return self._grant(execution_id, held[execution_id], st, duplicate=False)
                if d.reason != "no_credit":
                    raise CreditRefused(self.pool, execution_id, d.reason or d.kind, st)
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise CreditTimeout(self.pool, execution_id,
                                        f"no_credit: {st['held']} of {st['effective_limit']} credits held "
                                        f"for {limit:g} s", st)
                self._sleep(min(self.poll_interval, remaining))

    def _grant(self, execution_id: str, kind: str, st: dict, *, duplicate: bool) -> Grant:
        return Grant(self.pool, execution_id, kind, duplicate, st["held"], st["reserved_bytes"], st["free_credits"])

    # ------------------------------------------------------------------ release
    def release(self, execution_id: str, reason: str = "disposition", *, acknowledged_by: str | None = None) -> bool:
        """Return ``execution_id``'s credit; ``False`` when it was already released (never twice).

        ``reason="disposition"`` needs the disposition on the log (closed and decisively
        assessed, or finalized); ``"handoff_ack"`` needs ``acknowledged_by``.
        """

        if reason not in ("disposition", "handoff_ack"):
            raise CreditError(f"a credit returns only at a durable disposition or an acknowledged hand-off, not {reason!r}")
        if reason == "handoff_ack" and not acknowledged_by:
            raise CreditError("a hand-off release needs acknowledged_by (the owner that reserved the buffer space)")
        with self._lock:
            self.status()
            if self._event(execution_id, "reserve") is None:
                raise CreditError(f"execution {execution_id!r} holds no credit of pool {self.pool!r}")
            if self._event(execution_id, "release") is not None:
                return False
            if reason == "disposition":
                row = self.db.execute("SELECT closed_at, assessed_at, finalized_at FROM credit_exec_state "
                                      "WHERE execution_id = ?", (execution_id,)).fetchone()
                if row is None or disposition_at(*row) is None:
                    raise CreditError(f"execution {execution_id!r} has no durable disposition on the log yet "
                                      "(needs execution_closed and a scored/not_assessable assessment, or "
                                      "execution_finalized)")
            self._append({"type": "credit_released", "execution_id": execution_id, "pool": self.pool, "reason": reason,
                          "acknowledged_by": acknowledged_by})
            return True

    def hand_off(self, execution_id: str, acknowledged_by: str) -> bool:
        """Release on an acknowledged transfer to another capacity-controlled queue."""
        return self.release(execution_id, "handoff_ack", acknowledged_by=acknowledged_by)

    # ------------------------------------------------------------------ internals
    def _event(self, execution_id: str, op: str) -> Any:
        return self.db.execute("SELECT event_id FROM credit_events WHERE pool = ? AND execution_id = ? AND op = ?",
                               (self.pool, execution_id, op)).fetchone()

    def _append(self, line: dict) -> dict:
        """Stamp after every credit event seen, validate, append, catch up; the new status."""
        floor = self.db.execute("SELECT MAX(at) FROM credit_decisions WHERE pool = ?", (self.pool,)).fetchone()[0]
        last = self.db.execute("SELECT MAX(occurred_at) FROM credit_events WHERE pool = ?", (self.pool,)).fetchone()[0]
        now = self._now()
        stamp = max(now, (floor or 0) + 1, (last or 0) + 1)
        line = {k: v for k, v in line.items() if v is not None}
        line["producer"] = self.producer
        ev = validate_line(line, now_micros=stamp, producer=self.producer)  # occurred_at stamped = stamp
        report = self.ingestor.submit([(None, ev)])
        if report.conflicts:
            c = report.conflicts[0]
            raise CreditError(f"conflict on {c['event_id']}: {c['reason']}")
        return self.status()

    def close(self) -> None:
        self.db.close()


def _bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:g} B"


_LIMIT_NAMES = {"records": "record limit", "bytes": "byte limit"}


def _limit_size(st: dict) -> str:
    if st["binding_limit"] == "records":
        return f"{st['effective_limit']} records of {_bytes(st['record_ceiling_bytes'])}"
    return f"{_bytes(st['capacity_bytes'])}"


def _watermark_size(st: dict) -> str:
    """The watermark as what it stops at: records (``watermark_bytes`` / ceiling) and bytes."""
    if st["watermark_limit"] == "records":
        return f"{st['watermark_bytes'] / st['record_ceiling_bytes']:g} records, {_bytes(st['watermark_bytes'])}"
    return _bytes(st["watermark_bytes"])


def format_pool(st: dict) -> str:
    """Human-readable status of one pool (``ledger credits status``)."""
    if not st.get("declared"):
        return (f"pool {st['pool']}: NOT DECLARED ({st.get('armed_releases', 0)} armed releases; reservations wait "
                "for a credit_pool_declared event)")
    lines = [f"pool {st['pool']}: {st['held']} of {st['effective_limit']} credits held "
             f"({_bytes(st['reserved_bytes'])} of {_bytes(st['capacity_bytes'])} reserved at "
             f"{_bytes(st['record_ceiling_bytes'])} per record); {st['free_credits']} free",
             f"  held by stage: running {st['running']}, staged {st['staged']}, disposed-not-released {st['disposed']}; "
             f"armed releases {st['armed_releases']}",
             f"  high watermark {100 * st['high_watermark']:.1f}% of the {_LIMIT_NAMES[st['watermark_limit']]} "
             f"({st['watermark_source']}; {_watermark_size(st)})"
             f"{' ABOVE: slow dispatch' if st['above_watermark'] else ''}",
             f"  binding limit: {_LIMIT_NAMES[st['binding_limit']]} ({_limit_size(st)}, reached first)"]
    if st.get("drain_s") is not None:
        lines.append(f"  drain time of the held credits: {st['drain_s']:g} s")
    for name, lim in sorted((st.get("limits") or {}).items(), key=lambda kv: not kv[1]["binding"]):
        sec = lambda x: "never (no growth)" if x is None else f"{x:.1f} s"  # noqa: E731
        size = _bytes(lim["capacity"]) if name == "bytes" else f"{lim['capacity']:g} records"
        lines.append(f"  timeout burst, {_LIMIT_NAMES[name]} ({size}{', binding' if lim['binding'] else ''}): "
                     f"exhausted after {sec(lim['exhaustion_s'])} from empty, {sec(lim['exhaustion_s_now'])} from "
                     f"what is held now; watermark on it {100 * lim['high_watermark']:.1f}%")
    if st.get("counts"):
        lines.append("  decisions: " + ", ".join(f"{k} {v}" for k, v in sorted(st["counts"].items())))
    return "\n".join(lines)
