"""The intervention ladder's evidence check (SPEC §6.10; seed 002 §15.2.2, Figure 1).

A failure belongs in the weights only when counterfactual probes at every lower rung --
``context``, ``interface``, ``runtime``, in that order -- leave it intact.  Per task and rung the
**latest** probe decides: the one with the greatest ``(occurred_at, probe_id)``, a total order
that does not depend on the log order in which the probes arrive (so replay and any reordering
of partitions give the same verdict).  Pure: plain tuples in, a verdict out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["RUNGS", "Probe", "LadderVerdict", "latest_per_rung", "ladder_verdict"]

RUNGS = ("context", "interface", "runtime")
RESULTS = ("failure_persists", "failure_resolved")


@dataclass(frozen=True)
class Probe:
    probe_id: str
    rung: str
    result: str
    occurred_at: int  # microseconds since the epoch (stored on the log, so replay is deterministic)


@dataclass(frozen=True)
class LadderVerdict:
    verdict: str  # pass | fail | pending
    rung: str | None  # the rung that decided a fail / pending (None on pass)
    reason: str


def latest_per_rung(probes: Iterable[Probe]) -> dict[str, Probe]:
    """``{rung: the probe with the greatest (occurred_at, probe_id)}`` for the rungs that have any."""
    out: dict[str, Probe] = {}
    for p in probes:
        cur = out.get(p.rung)
        if cur is None or (p.occurred_at, p.probe_id) > (cur.occurred_at, cur.probe_id):
            out[p.rung] = p
    return out


def ladder_verdict(probes: Iterable[Probe]) -> LadderVerdict:
    """Walk the ladder in order: the first rung whose latest probe resolved the failure rejects
    (``fail``: repair at that rung, below the weights); the first rung without a probe leaves it
    ``pending``; every rung ``failure_persists`` passes (a capability gap)."""
    latest = latest_per_rung(probes)
    for rung in RUNGS:
        p = latest.get(rung)
        if p is None:
            return LadderVerdict("pending", rung, f"no {rung} probe recorded for the task")
        if p.result == "failure_resolved":
            return LadderVerdict("fail", rung, f"failure resolved by the {rung} probe {p.probe_id}: repair the {rung} "
                                 "below the weights, do not train on it")
    ids = ", ".join(f"{r}={latest[r].probe_id}" for r in RUNGS)
    return LadderVerdict("pass", None, f"failure persists at every rung ({ids})")
