"""Collection credits and staging reserves (seed 002 §15.8.2, napkin math 15.4 and 15.5).

Two models bound different quantities:

* **Rates** say how fast an outage eats staging headroom.  Completed rollouts arrive at
  ``lam`` records/s (Little's law: ``lam = concurrent rollouts / rollout seconds``); ``W``
  verifier slots with mean service ``s`` give capacity ``W / s`` and nominal utilisation
  ``rho = lam * s / W``.  When a defect makes every check run to its timeout ``tau``,
  capacity falls to ``W / tau`` and staging grows by ``g = lam - W / tau`` records/s, i.e.
  ``g * S`` bytes/s at per-record ceiling ``S``.  An empty store of ``C`` bytes is fully
  reserved after

      t_exh = C / (S * (lam - W / tau))

  (a store already holding ``B`` bytes: ``(C - B) / (S * g)``).  Dispatch must stop at the
  **high watermark** ``h``, the fraction of the store at which dispatch stops, leaving room
  for the in-flight reservation ``I`` (rollouts already running still emit records) and
  the growth during the controller's reaction delay ``D``:

      h <= (C - I - S * (lam - W / tau) * D) / C

* **Two limits** (seed exercise 7): the store holds at most ``C`` bytes *and* at most ``N``
  outstanding records (the pool's hard limit of credits).  Each is a limit of its own, with
  its own time to exhaustion (``N / g`` records, ``C / (S * g)`` bytes) and its own watermark
  (``(N - I_n - g * D) / N`` with ``I_n`` in-flight records, and the bytes bound above).  The
  **binding** limit is the one reached first -- records exactly when ``N * S < C``, because
  every record is charged the ceiling -- and the watermark is sized on it
  (:func:`staging_limits`, :func:`binding_limit`).  Sizing on bytes alone overstates the time
  left and the safe watermark whenever the record limit binds (exercise 7: 347.8 s and 56.8 %
  on bytes, but the record limit binds at 217.4 s and the watermark is at most 30.8 %).

* **Credits** cap total buffer use regardless of timing.  Each admitted run holds one
  credit, charged at the per-record ceiling ``S``, from dispatch until its record reaches
  a durable disposition or an acknowledged hand-off to another bounded owner; bytes held
  are at most ``credits * S``.  With ``W`` verifiers each taking ``s`` per record, an
  outstanding cohort of ``n`` drains in ``ceil(n / W) * s``.

:class:`CreditState` is the credit pool as a pure fold over reserve/release events
(:func:`apply`, :func:`fold`), so it can be a projection of the log; :class:`CreditPool`
is a convenience wrapper that builds the events.  No I/O, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from ledger.algorithms.errors import InputError

__all__ = [
    "arrival_rate",
    "nominal_utilization",
    "staging_growth_rate",
    "exhaustion_seconds",
    "high_watermark",
    "drain_seconds",
    "LIMITS",
    "StagingLimit",
    "staging_limits",
    "binding_limit",
    "BurstAnalysis",
    "analyse_timeout_burst",
    "RELEASE_REASONS",
    "CreditPoolConfig",
    "Decision",
    "CreditState",
    "initial_state",
    "apply",
    "fold",
    "CreditPool",
]


# --------------------------------------------------------------------------- rate model


def arrival_rate(concurrent_rollouts: float, rollout_seconds: float) -> float:
    """Completions per second of a steady rollout fleet (Little's law, ``N / R``)."""
    if rollout_seconds <= 0:
        raise InputError("rollout_seconds must be > 0")
    return concurrent_rollouts / rollout_seconds


def nominal_utilization(arrival: float, slots: int, mean_service_seconds: float) -> float:
    """``rho = lam * s / W``; by Little's law also the mean fraction of slots in use."""
    if slots <= 0:
        raise InputError("slots must be > 0")
    return arrival * mean_service_seconds / slots


def staging_growth_rate(arrival: float, slots: int, timeout_seconds: float) -> float:
    """Net staging growth in records/s during a timeout burst: ``lam - W / tau``."""
    if timeout_seconds <= 0:
        raise InputError("timeout_seconds must be > 0")
    return arrival - slots / timeout_seconds


def exhaustion_seconds(
    capacity_bytes: float,
    ceiling_bytes: float,
    growth_records_per_second: float,
    occupied_bytes: float = 0.0,
) -> float:
    """Time until the store is fully reserved: ``(C - B) / (S * (lam - W / tau))``.

    ``inf`` when staging does not grow; ``0`` when the store is already full.
    """
    if ceiling_bytes <= 0:
        raise InputError("ceiling_bytes must be > 0")
    headroom = capacity_bytes - occupied_bytes
    if headroom <= 0:
        return 0.0
    if growth_records_per_second <= 0:
        return math.inf
    return headroom / (ceiling_bytes * growth_records_per_second)


def high_watermark(
    capacity_bytes: float,
    inflight_bytes: float,
    growth_bytes_per_second: float,
    reaction_delay_seconds: float,
) -> float:
    """Largest safe dispatch-stop fraction ``(C - I - G * D) / C`` (seed §15.8.2).

    ``I`` is what the rollouts already running can still reserve, ``G = S * (lam - W/tau)``
    the burst growth in bytes/s (negative growth is treated as 0) and ``D`` the controller
    delay.  A result ``<= 0`` means no watermark is safe: in-flight work plus the reaction
    delay alone can exhaust the store, so the credit hard limit has to do the job.
    """
    if capacity_bytes <= 0:
        raise InputError("capacity_bytes must be > 0")
    growth = max(0.0, growth_bytes_per_second)
    return (capacity_bytes - inflight_bytes - growth * reaction_delay_seconds) / capacity_bytes


def drain_seconds(outstanding: int, verifiers: int, service_seconds: float) -> float:
    """Drain time of a cohort with no new admissions: ``ceil(n / W) * s`` (napkin 15.5)."""
    if verifiers <= 0:
        raise InputError("verifiers must be > 0")
    if outstanding <= 0:
        return 0.0
    return math.ceil(outstanding / verifiers) * service_seconds


LIMITS = ("records", "bytes")
"""The two limits of a staging store: outstanding records (the hard limit) and reserved bytes."""


@dataclass(frozen=True)
class StagingLimit:
    """One limit of the staging store during a timeout burst, in its own unit (records or bytes)."""

    limit: str
    capacity: float
    growth_per_second: float
    inflight: float
    delay_growth: float
    exhaustion_seconds: float
    """From the occupancy given to :func:`staging_limits` (``inf`` without growth)."""
    high_watermark: float
    """``(capacity - inflight - delay_growth) / capacity``; ``<= 0``: no watermark is safe."""


def _limit(name: str, capacity: float, unit: float, growth: float, inflight_records: float, delay: float,
           occupied_records: float) -> StagingLimit:
    delay_growth = max(0.0, growth) * unit * delay
    return StagingLimit(
        limit=name, capacity=capacity, growth_per_second=growth * unit, inflight=inflight_records * unit,
        delay_growth=delay_growth,
        exhaustion_seconds=exhaustion_seconds(capacity, unit, growth, occupied_records * unit),
        high_watermark=(high_watermark(capacity, inflight_records * unit, growth * unit, delay) if capacity > 0
                        else 0.0))


def staging_limits(
    *,
    capacity_bytes: float,
    ceiling_bytes: float,
    record_limit: float | None,
    growth_records_per_second: float,
    inflight_records: float,
    reaction_delay_seconds: float,
    occupied_records: float = 0.0,
) -> dict[str, StagingLimit]:
    """Both limits of a store under a burst growing ``g`` records/s (seed exercise 7).

    ``bytes``: ``C`` at ceiling ``S`` per record; ``records``: at most ``record_limit``
    outstanding records (left out when ``None``).  ``inflight_records`` are what the rollouts
    already running will still emit, ``occupied_records`` what the store holds now (each charged
    ``S``).  Exhaustion: ``(N - n) / g`` and ``(C - n S) / (S g)``; watermarks as in the module
    docstring.
    """
    args = (growth_records_per_second, inflight_records, reaction_delay_seconds, occupied_records)
    out = {"bytes": _limit("bytes", capacity_bytes, ceiling_bytes, *args)}
    if record_limit is not None:
        out = {"records": _limit("records", record_limit, 1.0, *args), **out}
    return out


def binding_limit(capacity_bytes: float, ceiling_bytes: float, record_limit: float | None) -> str:
    """``"records"`` when the record limit is reached before the bytes (``N * S < C``), else ``"bytes"``.

    Every record is charged the ceiling ``S``, so whatever the growth or the occupancy the
    record limit is reached first exactly when ``N * S < C``; on a tie the bytes are named.
    """
    if record_limit is not None and record_limit * ceiling_bytes < capacity_bytes:
        return "records"
    return "bytes"


@dataclass(frozen=True)
class BurstAnalysis:
    """Napkin-math 15.4 / exercise 7 quantities for one collector and one timeout burst.

    ``exhaustion_seconds`` and ``high_watermark`` are those of the ``binding_limit``;
    ``limits`` holds both limits (only ``bytes`` without a record limit), each with its own
    time to exhaustion and watermark.  ``inflight_bytes`` / ``delay_growth_bytes`` are the
    bytes terms of napkin 15.4.
    """

    arrival_per_second: float
    nominal_capacity_per_second: float
    nominal_utilization: float
    burst_capacity_per_second: float
    growth_records_per_second: float
    growth_bytes_per_second: float
    exhaustion_seconds: float
    inflight_bytes: float
    delay_growth_bytes: float
    high_watermark: float
    binding_limit: str = "bytes"
    record_limit: float | None = None
    inflight_records: float = 0.0
    limits: Mapping[str, StagingLimit] = field(default_factory=lambda: MappingProxyType({}))


def analyse_timeout_burst(
    *,
    concurrent_rollouts: int,
    rollout_seconds: float,
    verifier_slots: int,
    mean_service_seconds: float,
    timeout_seconds: float,
    ceiling_bytes: float,
    capacity_bytes: float,
    reaction_delay_seconds: float,
    occupied_bytes: float = 0.0,
    record_limit: float | None = None,
) -> BurstAnalysis:
    """Evaluate the rate model of seed §15.8.2 for a collector hit by a timeout burst.

    The in-flight reservation is every running rollout at its ceiling
    (``concurrent_rollouts`` records, ``concurrent_rollouts * ceiling_bytes`` bytes).  With
    ``record_limit`` (at most that many outstanding records) both limits are modelled and the
    binding one sets ``exhaustion_seconds`` and ``high_watermark``; ``occupied_bytes`` (what the
    store holds now) counts ``occupied_bytes / ceiling_bytes`` records against it.
    """
    if ceiling_bytes <= 0:
        raise InputError("ceiling_bytes must be > 0")
    lam = arrival_rate(concurrent_rollouts, rollout_seconds)
    growth = staging_growth_rate(lam, verifier_slots, timeout_seconds)
    limits = staging_limits(capacity_bytes=capacity_bytes, ceiling_bytes=ceiling_bytes, record_limit=record_limit,
                            growth_records_per_second=growth, inflight_records=concurrent_rollouts,
                            reaction_delay_seconds=reaction_delay_seconds,
                            occupied_records=occupied_bytes / ceiling_bytes)
    binding = limits[binding_limit(capacity_bytes, ceiling_bytes, record_limit)]
    by_bytes = limits["bytes"]
    return BurstAnalysis(
        arrival_per_second=lam,
        nominal_capacity_per_second=verifier_slots / mean_service_seconds,
        nominal_utilization=nominal_utilization(lam, verifier_slots, mean_service_seconds),
        burst_capacity_per_second=verifier_slots / timeout_seconds,
        growth_records_per_second=growth,
        growth_bytes_per_second=by_bytes.growth_per_second,
        exhaustion_seconds=binding.exhaustion_seconds,
        inflight_bytes=by_bytes.inflight,
        delay_growth_bytes=by_bytes.delay_growth,
        high_watermark=binding.high_watermark,
        binding_limit=binding.limit,
        record_limit=record_limit,
        inflight_records=concurrent_rollouts,
        limits=MappingProxyType(limits),
    )


# --------------------------------------------------------------------------- credit pool

RELEASE_REASONS = frozenset({"disposition", "handoff_ack"})
"""A credit returns only at a durable terminal disposition or an acknowledged hand-off."""

_EVENT_TYPE_OPS = {"credit_reserved": "reserve", "credit_released": "release"}


@dataclass(frozen=True)
class CreditPoolConfig:
    """A pool of ``credits`` collection credits, each charged at ``ceiling_bytes``.

    ``capacity_bytes`` is the staging store the pool protects (default
    ``credits * ceiling_bytes``); the hard limit is ``min(credits, capacity // ceiling)``
    credits.  ``high_watermark`` is the fraction of the ``watermark_limit`` -- ``"bytes"``:
    ``capacity_bytes``; ``"records"``: the ``credits`` record limit -- above which a
    reservation is still granted but answered ``"slow"`` (stop dispatching new work).
    """

    credits: int
    ceiling_bytes: int
    capacity_bytes: int | None = None
    high_watermark: float = 1.0
    watermark_limit: str = "bytes"

    def __post_init__(self) -> None:
        if self.credits < 0:
            raise InputError("credits must be >= 0")
        if self.ceiling_bytes <= 0:
            raise InputError("ceiling_bytes must be > 0")
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise InputError("capacity_bytes must be >= 0")
        if not (0.0 <= self.high_watermark <= 1.0):
            raise InputError("high_watermark must be in [0, 1]")
        if self.watermark_limit not in LIMITS:
            raise InputError(f"watermark_limit must be one of {', '.join(LIMITS)}")

    @property
    def capacity(self) -> int:
        return self.credits * self.ceiling_bytes if self.capacity_bytes is None else self.capacity_bytes

    @property
    def hard_limit(self) -> int:
        """Credits that may be held at once."""
        return min(self.credits, self.capacity // self.ceiling_bytes)

    @property
    def watermark_bytes(self) -> float:
        """The watermark in bytes: the fraction of the store, or of the record limit at the ceiling."""
        limit = self.credits * self.ceiling_bytes if self.watermark_limit == "records" else self.capacity
        return self.high_watermark * limit


@dataclass(frozen=True)
class Decision:
    """The pool's answer to one event.

    ``kind``: ``"grant"`` (credit held), ``"slow"`` (credit held, but the pool is above the
    high watermark: stop dispatching), ``"refuse"`` (no credit), ``"release"`` (credit
    returned), ``"ignored"`` (a release that frees nothing).  ``reason`` explains refusals,
    ignored releases and duplicate reservations.
    """

    kind: str
    id: str
    reason: str | None
    held: int
    reserved_bytes: int
    free_credits: int


@dataclass(frozen=True)
class CreditState:
    """Credit-pool state: a pure function of the events applied so far."""

    config: CreditPoolConfig
    held: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    """Run id -> the decision that granted its credit (``"grant"`` or ``"slow"``)."""
    closed: frozenset[str] = frozenset()
    """Runs whose credit came back; a later reserve for them is refused, never re-granted."""
    counts: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Events by decision kind."""
    last: Decision | None = None

    @property
    def reserved_bytes(self) -> int:
        return len(self.held) * self.config.ceiling_bytes

    @property
    def free_credits(self) -> int:
        return self.config.hard_limit - len(self.held)

    @property
    def above_watermark(self) -> bool:
        return self.reserved_bytes > self.config.watermark_bytes


class _Acc:
    """Mutable accumulator shared by :func:`apply`, :func:`fold` and :class:`CreditPool`."""

    __slots__ = ("config", "held", "closed", "counts", "last")

    def __init__(self, state: CreditState) -> None:
        self.config = state.config
        self.held: dict[str, str] = dict(state.held)
        self.closed: set[str] = set(state.closed)
        self.counts: dict[str, int] = dict(state.counts)
        self.last = state.last

    def freeze(self) -> CreditState:
        return CreditState(
            config=self.config,
            held=MappingProxyType(dict(self.held)),
            closed=frozenset(self.closed),
            counts=MappingProxyType(dict(sorted(self.counts.items()))),
            last=self.last,
        )

    def decide(self, kind: str, run_id: str, reason: str | None) -> Decision:
        cfg = self.config
        d = Decision(
            kind=kind,
            id=run_id,
            reason=reason,
            held=len(self.held),
            reserved_bytes=len(self.held) * cfg.ceiling_bytes,
            free_credits=cfg.hard_limit - len(self.held),
        )
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.last = d
        return d

    def step(self, event: Mapping[str, Any]) -> Decision:
        op = event.get("op") or _EVENT_TYPE_OPS.get(str(event.get("event_type")))
        run_id = event.get("id")
        if not isinstance(run_id, str) or not run_id:
            raise InputError(f"credit event needs a non-empty string 'id': {dict(event)!r}")
        cfg = self.config
        if op == "reserve":
            if run_id in self.held:  # a retried reservation returns the existing decision
                return self.decide(self.held[run_id], run_id, "duplicate")
            if run_id in self.closed:
                return self.decide("refuse", run_id, "closed")
            wanted = event.get("bytes")
            if wanted is not None and int(wanted) > cfg.ceiling_bytes:
                return self.decide("refuse", run_id, "over_ceiling")
            if len(self.held) + 1 > cfg.hard_limit:
                return self.decide("refuse", run_id, "no_credit")
            kind = "slow" if (len(self.held) + 1) * cfg.ceiling_bytes > cfg.watermark_bytes else "grant"
            self.held[run_id] = kind
            return self.decide(kind, run_id, None)
        if op == "release":
            reason = event.get("reason")
            if reason not in RELEASE_REASONS:
                return self.decide("ignored", run_id, "release_requires_disposition_or_ack")
            if run_id not in self.held:  # never frees a reservation twice
                return self.decide("ignored", run_id, "not_held")
            del self.held[run_id]
            self.closed.add(run_id)
            return self.decide("release", run_id, reason)
        raise InputError(f"unknown credit event op {op!r}")


def initial_state(config: CreditPoolConfig) -> CreditState:
    """The empty pool."""
    return CreditState(config=config)


def apply(state: CreditState, event: Mapping[str, Any]) -> CreditState:
    """Apply one event and return the new state (``state.last`` is the decision).

    Events are dicts: ``{"op": "reserve", "id": RUN, "bytes": optional}`` or
    ``{"op": "release", "id": RUN, "reason": "disposition" | "handoff_ack"}``
    (``event_type`` ``credit_reserved`` / ``credit_released`` may stand in for ``op``).
    """
    acc = _Acc(state)
    acc.step(event)
    return acc.freeze()


def fold(config: CreditPoolConfig, events: Iterable[Mapping[str, Any]], state: CreditState | None = None) -> CreditState:
    """``reduce(apply, events, state)`` in one pass (no per-event copies)."""
    acc = _Acc(state if state is not None else initial_state(config))
    for event in events:
        acc.step(event)
    return acc.freeze()


class CreditPool:
    """Convenience wrapper: builds reserve/release events, applies them, keeps them.

    ``events`` is exactly what a caller appends to the log; folding it with
    :func:`fold` reproduces :attr:`state`.
    """

    def __init__(self, config: CreditPoolConfig, state: CreditState | None = None) -> None:
        self._acc = _Acc(state if state is not None else initial_state(config))
        self.events: list[dict[str, Any]] = []

    @property
    def config(self) -> CreditPoolConfig:
        return self._acc.config

    @property
    def state(self) -> CreditState:
        return self._acc.freeze()

    @property
    def free_credits(self) -> int:
        return self._acc.config.hard_limit - len(self._acc.held)

    @property
    def reserved_bytes(self) -> int:
        return len(self._acc.held) * self._acc.config.ceiling_bytes

    def apply(self, event: Mapping[str, Any]) -> Decision:
        decision = self._acc.step(event)
        self.events.append(dict(event))
        return decision

    def reserve(self, run_id: str, expected_bytes: int | None = None) -> Decision:
        """Ask for a credit before dispatching ``run_id`` (charged at the ceiling)."""
        event: dict[str, Any] = {"op": "reserve", "id": run_id}
        if expected_bytes is not None:
            event["bytes"] = int(expected_bytes)
        return self.apply(event)

    def release(self, run_id: str, reason: str) -> Decision:
        """Return ``run_id``'s credit at durable disposition or acknowledged hand-off."""
        return self.apply({"op": "release", "id": run_id, "reason": reason})
